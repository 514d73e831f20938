"""CPU tests of backward_varlen: argument checks, the plan the kernels are packed from, the
workspace layout, and the varlen kernels' parameters (no GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.backward_varlen import check_backward_varlen_args, workspace_rows
from cupyflash.config import DType
from cupyflash.families.backward_sm80 import BACKWARD_SM80
from cupyflash.families.backward_sm80.config_sets import default_config
from cupyflash.families.backward_sm80.params import PARAMS_STRUCT, param_names
from cupyflash.families.backward_sm90.config_sets import default_config as sm90_default
from fake_views import ints, view

BF16 = DType.BF16
CFG = default_config(BF16, 128)
SELECTED = []


def select(dtype, d_head, seq_q, seq_k, device, causal):
    SELECTED.append((dtype, d_head, seq_q, seq_k, device, causal))
    return default_config(dtype, d_head)


def args(**over):
    a = dict(cfg=None, dout=view((100, 16, 128)), q=view((100, 16, 128)), k=view((300, 4, 128)),
             v=view((300, 4, 128)), out=view((100, 16, 128)), lse=view((16, 100), dtype=None, raw=np.dtype(np.float32)),
             cu_q=ints((4,)), cu_k=ints((4,)), max_seqlen_q=60, max_seqlen_k=200, dq=None, dk=None, dv=None)
    a.update(over)
    return a


def check(**over):
    a = args(**over)
    return check_backward_varlen_args(a["cfg"], a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["cu_q"],
                                      a["cu_k"], a["max_seqlen_q"], a["max_seqlen_k"], a["dq"], a["dk"], a["dv"],
                                      a.get("softmax_scale"), a.get("causal", False), a.get("deterministic", False),
                                      select=select)


def test_valid_problem_and_its_plan():
    SELECTED.clear()
    problem, plan = check(causal=True, deterministic=True)
    assert SELECTED == [(BF16, 128, 60, 200, 0, True)]  # cfg=None picks for the longest sequences
    assert (problem.total_q, problem.total_k, problem.batch) == (100, 300, 3)
    assert plan.cfg == CFG and plan.causal and plan.deterministic and plan.launch
    assert (plan.batch, plan.seq_len_q, plan.seq_len_k, plan.n_heads, plan.n_kv_heads) == (3, 60, 200, 16, 4)
    # (batch, seq, head) strides: batch strides 0 (each CTA moves to its sequence), packed rows
    assert plan.strides == ((0, 2048, 128), (0, 512, 128), (0, 512, 128), (0, 2048, 128), (0, 2048, 128),
                            (0, 2048, 128), (0, 512, 128), (0, 512, 128))
    assert plan.lse_strides == (0, 100, 1)  # (batch, head, token) of the (n_heads, total_q) lse
    assert plan.seq_len_q_pad == workspace_rows(100, 3, CFG.B_r)
    # given outputs keep their strides
    dq = view((100, 16, 128), strides=(32 * 128, 128, 1))
    assert check(dq=dq).plan.strides[5] == (0, 32 * 128, 128)


@pytest.mark.parametrize("total, batch, b_r", [(0, 1, 64), (100, 3, 64), (1, 1, 128), (4096, 7, 128), (64, 1, 64)])
def test_workspace_rows_hold_whole_disjoint_blocks(total, batch, b_r):
    """Every sequence's rows start at a B_r multiple, its blocks (its length rounded up to B_r)
    end at or before the next sequence's start, and the last one inside the workspace, for any
    split of `total` tokens into `batch` sequences (random and extreme ones)."""
    rows = workspace_rows(total, batch, b_r)
    rng = np.random.default_rng(total + batch)
    splits = [np.sort(rng.integers(0, total + 1, batch - 1)) for _ in range(50)]
    splits += [np.zeros(batch - 1, dtype=int), np.full(batch - 1, total)]
    for cuts in splits:
        cu = np.concatenate([[0], cuts, [total]])
        starts = (cu[:-1] + np.arange(batch) * b_r) // b_r * b_r
        ends = starts + -(-(cu[1:] - cu[:-1]) // b_r) * b_r
        assert (starts % b_r == 0).all() and (ends[:-1] <= starts[1:]).all() and ends[-1] <= rows


LSE32 = dict(dtype=None, raw=np.dtype(np.float32))


@pytest.mark.parametrize("over, err, prefix", [
    (dict(dout=view((100, 16, 64))), ValueError, "dout:"),
    (dict(dout=view((100, 16, 128), dtype=DType.FP16)), TypeError, "dout:"),
    (dict(dout=view((100, 16, 128), device=1)), ValueError, "dout:"),
    (dict(dout=view((100, 16, 128), strides=(16 * 128, 128, 2))), ValueError, "dout:"),
    (dict(out=view((99, 16, 128))), ValueError, "out:"),
    (dict(out=view((100, 16, 128), ptr=(1 << 30) + 8)), ValueError, "out:"),
    (dict(lse=view((100, 16), **LSE32)), ValueError, "lse:"),
    (dict(lse=view((1, 16, 100), **LSE32)), ValueError, "lse:"),
    (dict(lse=view((16, 100))), TypeError, "lse:"),
    (dict(lse=view((16, 100), device=1, **LSE32)), ValueError, "lse:"),
    (dict(lse=view((16, 100), ptr=(1 << 30) + 2, **LSE32)), ValueError, "lse:"),
    (dict(q=view((100, 16, 128), dtype=DType.FP16)), TypeError, "k:"),
    (dict(cu_k=ints((5,))), ValueError, "cu_seqlens_k:"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q:"),
    (dict(dq=view((100, 16, 64))), ValueError, "dq:"),
    (dict(dk=view((300, 4, 128), dtype=DType.FP16)), TypeError, "dk:"),
    (dict(dv=view((300, 4, 128), strides=(0, 128, 1))), ValueError, "dv:"),
    (dict(dv=view((300, 4, 128), device=1)), ValueError, "dv:"),
    (dict(deterministic=1), TypeError, "deterministic:"),
    (dict(causal="yes"), TypeError, "causal:"),
    (dict(cfg=default_config(DType.FP16, 128)), ValueError, "cfg:"),
    (dict(cfg=default_config(BF16, 64)), ValueError, "cfg:"),
    (dict(cfg=sm90_default(FP16 := DType.FP16, 128, False)), ValueError, "cfg:"),  # dtype mismatch
])
def test_bad_arguments_name_the_argument(over, err, prefix):
    with pytest.raises(err) as info:
        check(**over)
    assert str(info.value).startswith(prefix), str(info.value)


def test_hopper_configs_plan_one_workspace_entry():
    """A backward_sm90 config plans as well (cfg=None picks it on Hopper); the workspaces are one
    batch entry of seq_len_q_pad rows per head, counters included (dq_workspace_shape)."""
    from cupyflash.families.backward_sm90.launch import dq_workspace_shape

    cfg = sm90_default(BF16, 128, True)
    problem, plan = check(cfg=cfg, causal=True)
    assert plan.cfg is cfg and plan.varlen and plan.ws_batch == 1 and plan.batch == 3
    rows = workspace_rows(100, 3, cfg.B_r)
    assert plan.stats_shape == (1, 16, rows) and plan.dq_accum_shape == (1, 16, rows, 128)
    blocks = 16 * rows // cfg.B_r if cfg.dq_early else 0
    assert dq_workspace_shape(plan) == (16 * rows * 128 + blocks + int(cfg.dynamic),)
    with pytest.raises(TypeError, match="^cfg:"):
        check(cfg="backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds".split()[0])


def test_what_launches():
    assert not check(cu_q=ints((1,)), cu_k=ints((1,))).plan.launch  # batch 0
    assert not check(max_seqlen_q=0, max_seqlen_k=0).plan.launch
    # keys of sequences without queries still get their zero dk/dv written
    assert check(max_seqlen_q=0).plan.launch and check(max_seqlen_k=0).plan.launch


def test_packed_parameters_carry_the_offsets():
    problem, plan = check(causal=True)
    ptrs = tuple(range(1, 13))  # q, k, v, o, dout, lse, dq, dk, dv, dq_accum, lse2, dvec
    raw = plan.pack(ptrs, (0xC0, 0xD0))
    fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(raw)))
    assert fields["cu_seqlens_q"] == 0xC0 and fields["cu_seqlens_k"] == 0xD0 and fields["dvec"] == 12
    assert (fields["q_batch_stride"], fields["q_seq_stride"], fields["q_head_stride"]) == (0, 2048, 128)
    assert (fields["seq_len_q"], fields["seq_len_k"], fields["seq_len_q_pad"]) == (60, 200, plan.seq_len_q_pad)
    assert (fields["lse_batch_stride"], fields["lse_head_stride"], fields["lse_seq_stride"]) == (0, 100, 1)
    dense = dict(zip(param_names(), PARAMS_STRUCT.unpack(plan.pack(ptrs))))
    assert dense["cu_seqlens_q"] == dense["cu_seqlens_k"] == 0


def test_varlen_is_a_template_flag_of_every_role():
    variant = BACKWARD_SM80.variant(causal=True, deterministic=True, varlen=True)
    for role, expr in BACKWARD_SM80.name_expressions(CFG, variant).items():
        assert expr.endswith(", true, true, true>"), (role, expr)
    # a backward_sm80 grid is sized by the longest sequences (max_seqlen_q/k)
    assert BACKWARD_SM80.grid(CFG, "dkdv", 3, 16, 4, 60, 200) == (-(-200 // CFG.B_c), 4, 3)


def test_varlen_defaults_of_the_hopper_family():
    """backward_varlen's cfg=None on Hopper: default_config but, at d_head 128, with `park` (the
    varlen values in shared memory and, non-causal, the tail zeroer, so neither dq_frag's nor
    dq_mid's build is serialised, C7512), non-causal with dynamic claims instead of rotate; every
    one persistent with dynamic claims, causal ones with nomask as the dense defaults."""
    from cupyflash.families.backward_sm90.config_sets import (default_config as dense, varlen_default_config,
                                                              varlen_default_launches)

    for dtype in DType:
        for d in (64, 128):
            for causal in (False, True):
                for rows in (0, 4096, 8192):
                    got = varlen_default_config(dtype, d, causal, rows)
                    want = dense(dtype, d, causal, rows)
                    if d == 128:
                        want = (want.replace(park=True) if causal else
                                want.replace(rotate=False, dynamic=True, park=True))
                    assert got == want and got.persistent and got.dynamic and got.nomask == causal
    assert all(cfg.dq_frag and cfg.dq_mid and cfg.park for cfg, _ in varlen_default_launches() if cfg.d_head == 128)


def test_varlen_replay_signature():
    """backward_varlen's replay key: every array's layout, the max lengths and the flags; calls
    the replay cannot serve (another array type, a non-int max length, a non-bool flag) take the
    full path."""
    torch = pytest.importorskip("torch")
    from cupyflash.backward_varlen import _run, _signature

    def args(**kw):
        q, k, v, out, dout = (torch.zeros(50, 4, 64, dtype=torch.bfloat16) for _ in range(5))
        a = dict(dout=dout, q=q, k=k, v=v, out=out, lse=torch.zeros(4, 50), cu_q=torch.zeros(3, dtype=torch.int32),
                 cu_k=torch.zeros(3, dtype=torch.int32), max_q=30, max_k=30, causal=False, softmax_scale=None,
                 deterministic=False)
        a.update(kw)
        return a

    key = _signature(**args())
    assert key is not None and key[0] is torch.Tensor
    for change in (dict(causal=True), dict(deterministic=True), dict(softmax_scale=0.1), dict(max_q=31),
                   dict(cu_q=torch.zeros(4, dtype=torch.int32)), dict(q=torch.zeros(50, 4, 128, dtype=torch.bfloat16))):
        assert _signature(**args(**change)) not in (None, key), change
    for change in (dict(causal=1), dict(deterministic=None), dict(softmax_scale=1), dict(max_q=30.0),
                   dict(cu_k=[0, 0, 0])):
        assert _signature(**args(**change)) is None, change
    a = args()
    assert _run(key, a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["cu_q"], a["cu_k"]) is None  # none kept


class _FakeTensor:
    """What a plan key reads of a torch tensor (shape, stride(), dtype, get_device()), on a class
    the fast paths take for torch's (its module is 'torch')."""

    def __init__(self, shape, dtype="bf16", device=0):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    def stride(self):
        out, step = [], 1
        for n in reversed(self.shape):
            out.append(step)
            step *= n
        return tuple(reversed(out))

    def get_device(self):
        return self.device


_FakeTensor.__module__ = "torch"


def test_replay_keys_without_a_framework():
    """Both backward replays' keys on stand-in tensors (CPU, no torch): every array's layout and
    device counts; mixed array types take the full path."""
    from cupyflash import backward_plans
    from cupyflash.backward_varlen import _signature

    t = _FakeTensor
    a = dict(dout=t((50, 4, 64)), q=t((50, 4, 64)), k=t((50, 4, 64)), v=t((50, 4, 64)), out=t((50, 4, 64)),
             lse=t((4, 50), "f32"), cu_q=t((3,), "i32"), cu_k=t((3,), "i32"), max_q=30, max_k=30, causal=True,
             softmax_scale=None, deterministic=False)
    key = _signature(**a)
    assert key is not None and key[0] is t and key[4:6] == (30, 30)
    assert _signature(**dict(a, cu_k=t((3,), "i32", device=1))) not in (None, key)
    assert _signature(**dict(a, lse=np.zeros((4, 50), np.float32))) is None
    dense = dict(dout=t((1, 8, 2, 64)), q=t((1, 8, 2, 64)), k=t((1, 8, 2, 64)), v=t((1, 8, 2, 64)),
                 out=t((1, 8, 2, 64)), lse=t((1, 2, 8), "f32"), causal=False, softmax_scale=None, deterministic=False)
    plain = backward_plans.signature(**dense)
    given = backward_plans.signature(**dense, dq=t((1, 8, 2, 64)), dk=t((1, 8, 2, 64)), dv=t((1, 8, 2, 64)))
    assert plain is not None and given is not None and given[:len(plain)] == plain and given != plain
    assert backward_plans.signature(**dense, dq=t((1, 8, 2, 64))) is None
