"""The forward() fast path: signatures, replay with new pointers, and when it must step aside."""
from __future__ import annotations

import ctypes

import pytest

from cupyflash import launch_plans, op_launch
from cupyflash.families.forward_sm80.config_sets import default_config
from cupyflash.config import DType
from cupyflash.families.forward_sm80.params import PARAMS_STRUCT, param_names


class FakeTensor:
    """Quacks like a torch CUDA tensor for the attributes the fast path reads."""

    def __init__(self, ptr, shape=(1, 128, 8, 64), dtype="bf16", device=0):
        self.ptr, self.shape, self.dtype, self.device = ptr, tuple(shape), dtype, device

    def data_ptr(self):
        return self.ptr

    def stride(self):
        b, s, h, d = self.shape
        return (s * h * d, h * d, d, 1)

    def get_device(self):
        return self.device

    def new_empty(self, shape):
        return FakeTensor(0x4000, shape=shape, dtype=self.dtype, device=self.device)


FakeTensor.__module__ = "torch.fake"  # the fast path dispatches on the type's module


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(launch_plans._TABLE, "launch_kernel", lambda *args: calls.append(args))
    monkeypatch.setattr(launch_plans._TABLE, "get_device", lambda: 0)
    launch_plans.clear()
    yield calls
    launch_plans.clear()


def make_plan(allocated=None):
    params = PARAMS_STRUCT.pack(*([0] * 20 + [100, 100, 8, 8] + [0.125, 0.18] + [1, 0]))
    plan = launch_plans.FastLaunch(0xF00, (1, 8, 1), 128, 49152, 0, params, out_shape=(1, 128, 8, 64),
                                   allocate=lambda: allocated, current_stream=lambda: 0x5)
    plan.write_pointers = op_launch.leading_writer(plan.buf)  # as api._fast_launch sets it
    return plan


def test_signature_covers_what_changes_the_launch():
    q, k, v = FakeTensor(0x1000), FakeTensor(0x2000), FakeTensor(0x3000)
    base = launch_plans.signature(None, q, k, v, None, None)
    assert base is not None
    # pointers are not part of it, shapes/dtypes/devices/cfg/scale are
    assert launch_plans.signature(None, FakeTensor(0x9000), k, v, None, None) == base
    assert launch_plans.signature(None, FakeTensor(0x1000, shape=(2, 128, 8, 64)), k, v, None, None) != base
    assert launch_plans.signature(None, FakeTensor(0x1000, dtype="fp16"), k, v, None, None) != base
    assert launch_plans.signature(None, FakeTensor(0x1000, device=1), k, v, None, None) != base
    assert launch_plans.signature("auto", q, k, v, None, None) != base
    assert launch_plans.signature(None, q, k, v, None, 0.5) != base
    cfg = default_config(DType.BF16, 64)
    assert launch_plans.signature(cfg, q, k, v, None, None) != base


def test_signature_covers_causal():
    q, k, v = FakeTensor(0x1000), FakeTensor(0x2000), FakeTensor(0x3000)
    base = launch_plans.signature(None, q, k, v, None, None)
    assert launch_plans.signature(None, q, k, v, None, None, False) == base  # the default
    causal = launch_plans.signature(None, q, k, v, None, None, True)
    assert causal is not None and causal != base
    assert launch_plans.signature(None, FakeTensor(0x9000), k, v, None, None, True) == causal
    # anything but a real bool goes through the full path, which validates it (1 == True would
    # otherwise replay the causal plan without the TypeError)
    for odd in (1, 0, None, "yes"):
        assert launch_plans.signature(None, q, k, v, None, None, odd) is None


def test_signature_covers_return_lse():
    q, k, v = FakeTensor(0x1000), FakeTensor(0x2000), FakeTensor(0x3000)
    for causal in (False, True):
        plain = launch_plans.signature(None, q, k, v, None, None, causal)
        assert launch_plans.signature(None, q, k, v, None, None, causal, False) == plain  # the default
        with_lse = launch_plans.signature(None, q, k, v, None, None, causal, True)
        assert with_lse is not None and with_lse != plain
    for odd in (1, 0, None, "yes"):
        assert launch_plans.signature(None, q, k, v, None, None, False, odd) is None


def test_lse_plan_returns_a_new_lse_per_call(launches):
    """A return_lse plan allocates each call's lse and writes its pointer; out is the pair's first."""
    lses = iter([FakeTensor(0x6000, shape=(1, 8, 128)), FakeTensor(0x7000, shape=(1, 8, 128))])
    plan = make_plan()
    plan.lse_shape, plan.allocate_lse = (1, 8, 128), lambda: next(lses)
    q, k, v = FakeTensor(0x1000), FakeTensor(0x2000), FakeTensor(0x3000)
    key = launch_plans.signature(None, q, k, v, None, None, False, True)
    launch_plans.remember(key, plan)
    for want in (0x6000, 0x7000):
        out, lse = launch_plans.lookup(key, q, k, v, None)
        assert out.ptr == 0x4000 and lse.ptr == want
        fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(ctypes.string_at(plan.buf, PARAMS_STRUCT.size))))
        assert (fields["o"], fields["lse"]) == (0x4000, want)
    assert len(launches) == 2


def test_given_stream_reads_handles_of_the_plans_device():
    class CupyStream:
        def __init__(self, ptr, device_id):
            self.ptr, self.device_id = ptr, device_id

    class TorchDevice:
        def __init__(self, index):
            self.index = index

    class TorchStream:
        def __init__(self, handle, index):
            self.cuda_stream, self.device = handle, TorchDevice(index)

    assert launch_plans.given_stream(0x77, 0) == 0x77 and launch_plans.given_stream(0, 1) == 0
    assert launch_plans.given_stream(CupyStream(0x88, 1), 1) == 0x88
    assert launch_plans.given_stream(CupyStream(0x88, -1), 1) == 0x88  # a stream that names no device
    assert launch_plans.given_stream(TorchStream(0x99, 0), 0) == 0x99
    # the full path resolves (and refuses) everything else: other devices, odd handles, bools
    for odd in (CupyStream(0x88, 0), TorchStream(0x99, 0), -1, True, 1.0, "0", object()):
        assert launch_plans.given_stream(odd, 1) is None, odd


def test_replay_launches_on_a_given_stream(launches):
    q, k, v = FakeTensor(0x1000), FakeTensor(0x2000), FakeTensor(0x3000)
    key = launch_plans.signature(None, q, k, v, None, None)
    launch_plans.remember(key, make_plan())
    assert launch_plans.lookup(key, q, k, v, None, 0xABC) is not None
    assert launch_plans.lookup(key, q, k, v, None) is not None  # the plan's current stream: 0x5
    assert launch_plans.lookup(key, q, k, v, None, -3) is None  # the full path reports it
    assert [args[8] for args in launches] == [0xABC, 0x5]


def test_gqa_shapes_get_their_own_signature():
    q = FakeTensor(0x1000, shape=(1, 128, 8, 64))
    k, v = FakeTensor(0x2000, shape=(1, 128, 2, 64)), FakeTensor(0x3000, shape=(1, 128, 2, 64))
    gqa = launch_plans.signature(None, q, k, v, None, None)
    mha = launch_plans.signature(None, q, q, q, None, None)
    assert gqa is not None and gqa != mha


def test_signature_refuses_what_it_cannot_replay():
    q, k, v = FakeTensor(0x1000), FakeTensor(0x2000), FakeTensor(0x3000)
    assert launch_plans.signature(["not", "a", "cfg"], q, k, v, None, None) is None
    assert launch_plans.signature(None, q, k, v, None, "0.5") is None
    assert launch_plans.signature(None, q, object(), v, None, None) is None  # mixed kinds
    assert launch_plans.signature(None, object(), object(), object(), None, None) is None  # not torch/cupy


def test_replay_packs_new_pointers_and_allocates(launches):
    plan = make_plan()
    q, k, v = FakeTensor(0x1000), FakeTensor(0x2000), FakeTensor(0x3000)
    key = launch_plans.signature(None, q, k, v, None, None)
    assert launch_plans.lookup(key, q, k, v, None) is None  # nothing remembered yet
    launch_plans.remember(key, plan)
    out = launch_plans.lookup(key, q, k, v, None)
    # a torch output comes from the call's own q: its dtype and device, the plan's shape
    assert isinstance(out, FakeTensor) and out.shape == (1, 128, 8, 64)
    assert (out.dtype, out.device, out.ptr) == (q.dtype, q.device, 0x4000)
    (args,) = launches
    assert args[:9] == (0xF00, 1, 8, 1, 128, 1, 1, 49152, 0x5)
    packed = PARAMS_STRUCT.unpack(ctypes.string_at(plan.buf, PARAMS_STRUCT.size))
    fields = dict(zip(param_names(), packed))
    assert (fields["q"], fields["k"], fields["v"], fields["o"]) == (0x1000, 0x2000, 0x3000, 0x4000)
    assert fields["seq_len_q"] == 100 and fields["n_heads"] == 8  # the prepacked tail is untouched
    assert fields["lse"] == 0 and fields["kv_group_size"] == 1 and fields["lse_head_stride"] == 0


def test_misaligned_pointer_or_other_device_falls_back(launches, monkeypatch):
    out = FakeTensor(0x4000)
    q, k, v = FakeTensor(0x1000), FakeTensor(0x2000), FakeTensor(0x3000)
    key = launch_plans.signature(None, q, k, v, None, None)
    launch_plans.remember(key, make_plan(out))
    assert launch_plans.lookup(key, FakeTensor(0x1008), k, v, None) is None
    monkeypatch.setattr(launch_plans._TABLE, "get_device", lambda: 1)
    assert launch_plans.lookup(key, q, k, v, None) is None
    assert launches == []


def test_out_argument_is_written_and_returned(launches):
    q, k, v, out = FakeTensor(0x1000), FakeTensor(0x2000), FakeTensor(0x3000), FakeTensor(0x5000)
    key = launch_plans.signature(None, q, k, v, out, None)
    launch_plans.remember(key, make_plan(allocated=None))
    assert launch_plans.lookup(key, q, k, v, out) is out
    assert len(launches) == 1


def test_plan_table_caps_in_place_and_marks_the_array_type():
    table = launch_plans.PlanTable(max_plans=2)
    table.launch_kernel, table.get_device = (lambda *a: None), (lambda: 0)  # no driver binding needed
    plans = table.plans
    a, b, c = make_plan(), make_plan(), make_plan()
    table.remember(None, a)
    assert plans == {}
    table.remember((FakeTensor, 1), a)
    table.remember((object, 2), b)
    assert a.is_torch and not b.is_torch and len(plans) == 2
    table.remember((FakeTensor, 3), c)  # at the cap: starts over, in the same dict
    assert table.plans is plans and list(plans) == [(FakeTensor, 3)]
    table.clear()
    assert table.plans is plans and plans == {}
    shapes = (3, 4)  # a key that does not start with an array type (torch.py's: q's shape first)
    kinds = dict(launch_plans._kinds)
    table.remember((shapes, 5), a, is_torch=True)
    table.remember((shapes, 6), b, is_torch=False)
    assert a.is_torch and not b.is_torch and launch_plans._kinds == kinds  # nothing cached for it
