"""CPU tests of backward's per-signature fast path (cupyflash.backward_plans): which calls may
take it and how their keys differ. The replay itself runs in tests/test_gpu_backward_sm90.py."""
from __future__ import annotations

import pytest

from cupyflash import backward_plans

torch = pytest.importorskip("torch")


def _args(**kw):
    q, k, v, out, dout = (torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.zeros(1, 2, 8, dtype=torch.float32)
    args = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, causal=False, softmax_scale=None, deterministic=False)
    args.update(kw)
    return args


def test_signature_of_torch_tensors_names_every_argument():
    key = backward_plans.signature(**_args())
    assert key is not None and key[0] is torch.Tensor
    assert backward_plans.signature(**_args(causal=True)) != key
    assert backward_plans.signature(**_args(deterministic=True)) != key
    assert backward_plans.signature(**_args(softmax_scale=0.1)) != key
    assert backward_plans.signature(**_args(lse=torch.zeros(1, 2, 8, dtype=torch.float32)[:, :, :])) == key
    wide = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    assert backward_plans.signature(**_args(q=wide)) != key


def test_signature_with_given_outputs():
    """dq, dk, dv all given: their layouts join the key; some given, or of another array type: the
    full path."""
    base = _args()
    key = backward_plans.signature(**base)
    grads = dict(dq=torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16), dk=torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16),
                 dv=torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16))
    given = backward_plans.signature(**base, **grads)
    assert given is not None and given != key and given[:len(key)] == key
    strided = dict(grads, dq=torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)[:, :, :2])
    assert backward_plans.signature(**base, **strided) not in (None, given)
    assert backward_plans.signature(**base, dq=grads["dq"]) is None
    assert backward_plans.signature(**base, dk=grads["dk"], dv=grads["dv"]) is None
    assert backward_plans.signature(**base, **dict(grads, dv=[0.0])) is None


@pytest.mark.parametrize("change", [dict(causal=1), dict(deterministic=None), dict(softmax_scale=1),
                                    dict(lse=[0.0]), dict(k="k")])
def test_signature_refuses_what_only_the_full_path_checks(change):
    assert backward_plans.signature(**_args(**change)) is None


def test_run_without_a_replay_takes_the_full_path():
    a = _args()
    key = backward_plans.signature(**a)
    backward_plans.clear()
    assert backward_plans.run(key, a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"]) is None
    assert backward_plans.run(None, a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"]) is None


@pytest.mark.parametrize("deterministic", [False, True])
def test_replay_packs_what_the_full_path_packs(monkeypatch, deterministic):
    """backward_sm80's replay on host tensors (device 0 current, stream 77, launches recorded):
    each call's pointers and a fresh workspace in the parameter block, every other field as the
    full path packs it."""
    import struct

    from cupyflash import backward_api
    from cupyflash.backward_validation import check_backward_args
    from cupyflash.config import DType
    from cupyflash.families.backward_sm80 import kernels
    from cupyflash.families.backward_sm80.config_sets import default_config
    from cupyflash.interop import TORCH, TensorView

    import ctypes

    from cupyflash.families.backward_sm80 import BACKWARD_SM80, roles_for
    from cupyflash.families.backward_sm80.params import PARAMS_STRUCT

    calls = []

    class Launcher:  # the loaded kernels of the variant: role names stand in for them
        def __init__(self, cfg, device, causal, deterministic, varlen=False):
            self.kernels = {role: role for role in roles_for(deterministic)}
            self._steps = [(role, 0, BACKWARD_SM80.block_threads(cfg, role), BACKWARD_SM80.smem_bytes(cfg, role))
                           for role in roles_for(deterministic)]

        def launch(self, params, *sizes_and_stream):  # the full path's launches
            calls.append((params, sizes_and_stream))

    def argv_launcher(role, grid, block, smem, pdl):  # a replay's launches, from its packed block
        def go(stream, argv):
            block_ptr = ctypes.c_void_p.from_address(argv).value
            calls.append((ctypes.string_at(block_ptr, PARAMS_STRUCT.size), (role, grid, stream)))
        return go

    monkeypatch.setattr(kernels, "get_launcher", Launcher)
    monkeypatch.setattr(kernels, "argv_launcher", argv_launcher)

    def view(x, name):
        return TensorView(x.data_ptr(), tuple(x.shape), tuple(x.stride()), {torch.bfloat16: DType.BF16}.get(x.dtype),
                          x.dtype, 0, TORCH, x)

    def problem():
        q, k, v = torch.randn(2, 40, 4, 64, dtype=torch.bfloat16), *(torch.randn(2, 56, 2, 64, dtype=torch.bfloat16)
                                                                     for _ in range(2))
        dout = torch.randn(2, 4, 40, 64, dtype=torch.bfloat16).transpose(1, 2)  # strided: its own strides
        return dout, q, k, v, torch.randn_like(q), torch.randn(2, 4, 40)

    args = problem()
    views = [view(x, n) for x, n in zip(args, ("dout", "q", "k", "v", "out", "lse"))]
    plan = check_backward_args(default_config(DType.BF16, 64), *views, None, None, None, None, True, deterministic,
                               select=backward_api._select)
    key = backward_plans.signature(*args, True, None, deterministic)
    backward_plans.clear()
    backward_plans.remember(key, backward_plans.BackwardReplay(plan, views[1], views[2], views[3], views[0]))
    monkeypatch.setattr(backward_plans._TABLE, "get_device", lambda: 0)  # bound by remember(); no GPU here
    monkeypatch.setattr(backward_plans._TABLE.plans[key], "current_stream", lambda: 77)
    for _ in range(2):
        args = problem()
        dq, dk, dv = backward_plans.run(key, *args)
        assert (dq.shape, dk.shape, dv.shape) == (args[1].shape, args[2].shape, args[3].shape)
        params, (role, grid, stream) = calls[-1]
        roles = [c[1][0] for c in calls[-len(roles_for(deterministic)):]]
        assert roles == list(roles_for(deterministic)) and stream == 77
        assert grid == BACKWARD_SM80.grid(plan.cfg, role, 2, 4, 2, 40, 56)
        assert all(c[0] == params for c in calls[-len(roles):])  # every kernel reads the one block
        ptrs = struct.unpack_from("<12Q", params)
        dout, q, k, v, out, lse = args
        assert ptrs[:9] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(), lse.data_ptr(),
                            dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
        lse2, dvec, accum = ptrs[10], ptrs[11], ptrs[9]
        stats = 2 * 4 * plan.seq_len_q_pad
        assert dvec - lse2 >= 4 * stats and (accum == 0) == deterministic
        assert deterministic or accum - dvec >= 4 * stats
        assert (dvec - lse2) % 256 == 0 and (deterministic or (accum - lse2) % 256 == 0)
        assert params == plan.pack(ptrs)  # every non-pointer field as the full path packs it
    backward_plans.clear()
