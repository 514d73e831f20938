"""Argument validation and launch planning for forward(), on fake TensorViews (no GPU needed)."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash import api, interop
from cupyflash.config import SUPPORTED_D_HEADS, DType
from cupyflash.families.forward_sm80.config import FlashForwardKernelConfig
from cupyflash.families.forward_sm80.config_sets import default_config, progression_configs
from cupyflash.interop import TensorView, as_view, contiguous_strides, output_view, resolve_stream
from cupyflash.families.forward_sm80.params import PARAMS_STRUCT, param_names
from cupyflash.validation import (
    INT32_MAX, MAX_GRID_YZ, MIN_COMPUTE_CAPABILITY, check_compute_capability, check_flag, check_forward_args,
    check_lse_out, check_lse_request, check_softmax_scale,
)

# (FP16, 64, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax
CFG = progression_configs(DType.FP16, 64)[-1]
CFG_128 = FlashForwardKernelConfig.parse(
    "(BF16, 128, 128, 64, 8): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax")
BASE_PTR = 0x7F00_0000_0000  # fake, 16-byte aligned device address


def view(shape=(2, 128, 4, 64), dtype=DType.FP16, strides=None, ptr=BASE_PTR, device=0,
         raw_dtype=None, framework=interop.CUPY) -> TensorView:
    """A fake TensorView; contiguous unless strides (in elements) are given."""
    if raw_dtype is None:
        raw_dtype = dtype.numpy_dtype if dtype is not None else np.dtype(np.float32)
    return TensorView(ptr, tuple(shape), tuple(strides or contiguous_strides(tuple(shape))), dtype,
                      raw_dtype, device, framework, None)


def np_view(arr: np.ndarray, device: int = 0) -> TensorView:
    """A TensorView of a host numpy array's layout (pointer, strides), as if it lived on a GPU."""
    ptr = arr.__array_interface__["data"][0]
    return TensorView(ptr, arr.shape, tuple(s // arr.itemsize for s in arr.strides),
                      interop._NUMPY_DTYPES.get(arr.dtype), arr.dtype, device, interop.CUPY, arr)


def qkv(shape=(2, 128, 4, 64), kshape=None, dtype=DType.FP16, **kw):
    kshape = kshape or shape
    return view(shape, dtype, **kw), view(kshape, dtype, **kw), view(kshape, dtype, **kw)


def raises(exc, *names, match=None):
    """pytest.raises whose message must start with '<name>:' for one of `names`."""
    pattern = "^(" + "|".join(names) + "):"
    if match:
        pattern += ".*" + match
    return pytest.raises(exc, match=pattern)


# ----------------------------------------------------------------------------- valid plans
def test_plan_for_contiguous_inputs():
    q, k, v = qkv((2, 128, 4, 64))
    plan = check_forward_args(CFG, q, k, v)
    assert plan.cfg is CFG
    assert plan.grid == (128 // 64, 4, 2)
    assert plan.block == CFG.n_warps * 32 == 128
    assert plan.smem_bytes == CFG.smem_bytes() == (64 + 2 * 64) * 64 * 2
    assert plan.out_shape == (2, 128, 4, 64)
    contiguous = (128 * 4 * 64, 4 * 64, 64)
    assert plan.q_strides == plan.k_strides == plan.v_strides == plan.o_strides == contiguous
    assert (plan.seq_len_q, plan.seq_len_k, plan.n_heads, plan.n_kv_heads) == (128, 128, 4, 4)
    assert plan.softmax_scale == pytest.approx(1 / math.sqrt(64))
    assert plan.softmax_scale_log2 == pytest.approx(plan.softmax_scale * math.log2(math.e))
    assert plan.device == 0 and plan.launch


def test_plan_cross_attention_lengths():
    q = view((3, 256, 2, 128), DType.BF16)
    k = v = view((3, 192, 2, 128), DType.BF16)
    plan = check_forward_args(CFG_128, q, k, v)
    assert plan.grid == (256 // 128, 2, 3)
    assert plan.block == 256
    assert (plan.seq_len_q, plan.seq_len_k) == (256, 192)
    assert plan.smem_bytes == (128 + 2 * 64) * 128 * 2


def test_plan_for_slices_of_packed_qkv_uses_each_tensors_strides():
    # (B, S, 3, H, D) packed QKV, sliced: non-contiguous outer strides, last dim contiguous.
    packed = np.zeros((2, 64, 3, 4, 64), np.float16)
    q, k, v = (np_view(packed[:, :, i]) for i in range(3))
    plan = check_forward_args(CFG, q, k, v, softmax_scale=0.5)
    assert plan.q_strides == plan.k_strides == plan.v_strides == (64 * 3 * 4 * 64, 3 * 4 * 64, 64)
    assert plan.o_strides == (64 * 4 * 64, 4 * 64, 64)  # forward() allocates a contiguous output
    assert plan.softmax_scale == 0.5


def test_plan_with_out_uses_out_strides_and_heads_major_layouts_work():
    # (B, H, S, D) memory viewed as (B, S, H, D): a transposed but valid layout.
    bhsd = np.zeros((2, 4, 128, 64), np.float16)
    q = np_view(bhsd.transpose(0, 2, 1, 3))
    out_mem = np.zeros((2, 4, 128, 64), np.float16)
    out = np_view(out_mem.transpose(0, 2, 1, 3))
    plan = check_forward_args(CFG, q, q, q, out)
    assert plan.q_strides == (4 * 128 * 64, 64, 128 * 64)
    assert plan.o_strides == (4 * 128 * 64, 64, 128 * 64)


def test_plan_packs_params_in_kernel_abi_order():
    q, k, v = qkv((1, 64, 2, 64))
    plan = check_forward_args(CFG, q, k, v, softmax_scale=0.25)
    raw = plan.pack(0x1000, 0x2000, 0x3000, 0x4000)
    assert len(raw) == PARAMS_STRUCT.size
    fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(raw)))
    assert (fields["q"], fields["k"], fields["v"], fields["o"], fields["lse"]) == (0x1000, 0x2000, 0x3000, 0x4000, 0)
    for t in "qkvo":
        assert (fields[f"{t}_batch_stride"], fields[f"{t}_seq_stride"], fields[f"{t}_head_stride"]) == (128 * 64, 128, 64)
    assert (fields["seq_len_q"], fields["seq_len_k"], fields["n_heads"], fields["n_kv_heads"]) == (64, 64, 2, 2)
    assert fields["softmax_scale"] == 0.25
    assert fields["softmax_scale_log2"] == pytest.approx(0.25 * math.log2(math.e), rel=1e-6)


def test_size_one_dimensions_ignore_their_strides():
    # torch/cupy may report arbitrary strides for dimensions of size 1; the kernel never uses them.
    q = view((1, 64, 1, 64), strides=(3, 64, 5, 1))
    plan = check_forward_args(CFG, q, q, q)
    assert plan.launch


@pytest.mark.parametrize("shape", [(0, 64, 2, 64), (2, 0, 2, 64), (2, 64, 0, 64)])
def test_zero_size_problems_plan_no_launch(shape):
    q = view(shape)
    k = view((shape[0], 64, shape[2], 64))
    plan = check_forward_args(CFG, q, k, k)
    assert not plan.launch
    assert plan.out_shape == shape


def test_empty_query_with_empty_keys_is_fine():
    q = view((2, 0, 2, 64))
    assert not check_forward_args(CFG, q, q, q).launch


# ----------------------------------------------------------------------------- cfg
def test_cfg_wrong_type():
    q, k, v = qkv()
    with raises(TypeError, "cfg"):
        check_forward_args(42, q, k, v)


def test_cfg_dtype_mismatch():
    q, k, v = qkv(dtype=DType.BF16)
    with raises(ValueError, "cfg", match="dtype"):
        check_forward_args(CFG, q, k, v)


def test_cfg_d_head_mismatch():
    q, k, v = qkv((2, 128, 4, 128))
    with raises(ValueError, "cfg", match="d_head"):
        check_forward_args(CFG, q, k, v)


def test_cfg_none_calls_selector_with_problem_description():
    calls = []

    def select(dtype, d_head, sq, sk, device, causal):
        calls.append((dtype, d_head, sq, sk, device, causal))
        return CFG

    q, k, v = view((2, 128, 4, 64), device=1), view((2, 192, 4, 64), device=1), view((2, 192, 4, 64), device=1)
    plan = check_forward_args(None, q, k, v, select=select)
    assert calls == [(DType.FP16, 64, 128, 192, 1, False)]
    assert plan.cfg is CFG
    check_forward_args(None, q, k, v, causal=True, select=select)
    assert calls[-1] == (DType.FP16, 64, 128, 192, 1, True)  # causal problems have their own table rows


def test_cfg_none_without_selector():
    with raises(TypeError, "cfg"):
        check_forward_args(None, *qkv())


# ----------------------------------------------------------------------------- dtypes
def test_q_dtype_not_fp16_or_bf16():
    q = view(dtype=None, raw_dtype=np.dtype(np.float32))
    _, k, v = qkv()
    with raises(TypeError, "q", match="float32"):
        check_forward_args(CFG, q, k, v)


@pytest.mark.parametrize("name", ["k", "v"])
def test_kv_dtype_unsupported(name):
    q, k, v = qkv()
    args = {"k": k, "v": v}
    args[name] = view(dtype=None, raw_dtype=np.dtype(np.int8))
    with raises(TypeError, name, match="float16 or bfloat16"):
        check_forward_args(CFG, q, args["k"], args["v"])


@pytest.mark.parametrize("name", ["k", "v"])
def test_dtype_mismatch_among_inputs(name):
    q, k, v = qkv()
    args = {"k": k, "v": v}
    args[name] = view(dtype=DType.BF16)
    with raises(TypeError, name, match="does not match q"):
        check_forward_args(CFG, q, args["k"], args["v"])


# ----------------------------------------------------------------------------- ranks and shapes
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(128, 4, 64), (1, 2, 128, 4, 64)])
def test_wrong_rank(name, shape):
    args = dict(zip("qkv", qkv()))
    args[name] = view(shape)
    with raises(ValueError, name, match="4 dimensions"):
        check_forward_args(CFG, args["q"], args["k"], args["v"])


def test_batch_mismatch():
    q, k, v = qkv((2, 128, 4, 64), kshape=(3, 128, 4, 64))
    with raises(ValueError, "k", match="batch"):
        check_forward_args(CFG, q, k, v)


def test_d_head_mismatch_between_q_and_k():
    q, k, v = view((2, 128, 4, 64)), view((2, 128, 4, 128)), view((2, 128, 4, 128))
    with raises(ValueError, "k", match="d_head"):
        check_forward_args(CFG, q, k, v)


def test_v_shape_differs_from_k():
    q, k = view((2, 128, 4, 64)), view((2, 128, 4, 64))
    with raises(ValueError, "v", match="shape"):
        check_forward_args(CFG, q, k, view((2, 64, 4, 64)))


# ----------------------------------------------------------------------------- layout and alignment
@pytest.mark.parametrize("name", ["q", "k", "v", "out"])
def test_last_dim_not_contiguous(name):
    mem = np.zeros((2, 128, 4, 128), np.float16)
    bad = np_view(mem[..., ::2])  # d_head 64 with stride 2
    args = dict(zip("qkv", qkv()))
    args["out"] = None
    args[name] = bad
    with raises(ValueError, name, match="contiguous"):
        check_forward_args(CFG, args["q"], args["k"], args["v"], args["out"])


@pytest.mark.parametrize("name", ["q", "k", "v", "out"])
def test_misaligned_pointer(name):
    args = dict(zip("qkv", qkv()))
    args["out"] = None
    args[name] = view(ptr=BASE_PTR + 2)  # one fp16 element off
    with raises(ValueError, name, match="aligned"):
        check_forward_args(CFG, args["q"], args["k"], args["v"], args["out"])


@pytest.mark.parametrize("dim,label", [(0, "batch"), (1, "seq"), (2, "head")])
def test_misaligned_strides(dim, label):
    strides = list(contiguous_strides((2, 128, 4, 64)))
    strides[dim] += 4  # 8 bytes: rows would start only 8-byte aligned
    q = view(strides=tuple(strides))
    _, k, v = qkv()
    with raises(ValueError, "q", match=label):
        check_forward_args(CFG, q, k, v)


def test_misaligned_row_slices_of_a_wider_array():
    # d_head 64 taken out of rows of 68 elements: seq stride 68*4 is fine, head stride 68 is not.
    mem = np.zeros((2, 128, 4, 68), np.float16)
    with raises(ValueError, "q", match="head stride"):
        check_forward_args(CFG, np_view(mem[..., :64]), *qkv()[1:])


# ----------------------------------------------------------------------------- devices
@pytest.mark.parametrize("name", ["k", "v", "out"])
def test_arrays_on_different_devices(name):
    args = dict(zip("qkv", qkv()))
    args["out"] = None
    args[name] = view(device=1)
    with raises(ValueError, name, match="device"):
        check_forward_args(CFG, args["q"], args["k"], args["v"], args["out"])


@pytest.mark.parametrize("cc", [60, 70, 75, 86 - 10])
def test_compute_capability_below_8(cc):
    with raises(ValueError, "q", match="compute capability"):
        check_compute_capability(cc, 0)


@pytest.mark.parametrize("cc", [80, 86, 89, 90, 100, 120])
def test_compute_capability_ok(cc):
    check_compute_capability(cc, 0)


def test_min_compute_capability_matches_device_module():
    from cupyflash import device

    assert MIN_COMPUTE_CAPABILITY == device.MIN_COMPUTE_CAPABILITY


# ----------------------------------------------------------------------------- out
def test_out_wrong_shape():
    q, k, v = qkv()
    with raises(ValueError, "out", match="shape"):
        check_forward_args(CFG, q, k, v, view((2, 128, 4, 32)))
    with raises(ValueError, "out", match="shape"):
        check_forward_args(CFG, q, k, v, view((2, 128, 256)))


def test_out_wrong_dtype():
    q, k, v = qkv()
    with raises(TypeError, "out", match="dtype"):
        check_forward_args(CFG, q, k, v, view(dtype=DType.BF16))
    with raises(TypeError, "out", match="dtype"):
        check_forward_args(CFG, q, k, v, view(dtype=None, raw_dtype=np.dtype(np.float32)))


def test_out_broadcast_view_rejected():
    q, k, v = qkv()
    out = view(strides=(0, 4 * 64, 64, 1))
    with raises(ValueError, "out", match="zero stride"):
        check_forward_args(CFG, q, k, v, out)


# ----------------------------------------------------------------------------- limits
def test_grid_y_limit_heads():
    q, k, v = qkv((1, 64, MAX_GRID_YZ + 1, 64))
    with raises(ValueError, "q", match="gridDim.y"):
        check_forward_args(CFG, q, k, v)


def test_grid_z_limit_batch():
    q, k, v = qkv((MAX_GRID_YZ + 1, 64, 1, 64))
    with raises(ValueError, "q", match="gridDim.z"):
        check_forward_args(CFG, q, k, v)


def test_grid_limits_inclusive():
    q, k, v = qkv((MAX_GRID_YZ, 64, 1, 64))
    assert check_forward_args(CFG, q, k, v).grid == (1, 1, MAX_GRID_YZ)


def test_seq_len_q_int32_overflow():
    q = view((1, INT32_MAX + 1 + 63, 1, 64))
    _, k, v = qkv((1, 64, 1, 64))
    with raises(ValueError, "q", match="int32"):
        check_forward_args(CFG, q, k, v)


def test_seq_len_k_int32_overflow():
    q = view((1, 64, 1, 64))
    k = view((1, 2**32, 1, 64))
    with raises(ValueError, "k", match="int32"):
        check_forward_args(CFG, q, k, k)


@pytest.mark.parametrize("seq_q,seq_k", [(100, 96), (1, 1), (1, 3001), (3001, 7), (65, 129)])
def test_any_sequence_lengths_plan(seq_q, seq_k):
    # The kernel masks tails: lengths need not be multiples of B_r (64) or B_c (64).
    q, k = view((2, seq_q, 4, 64)), view((2, seq_k, 4, 64))
    plan = check_forward_args(CFG, q, k, k)
    assert plan.launch and (plan.seq_len_q, plan.seq_len_k) == (seq_q, seq_k)
    assert plan.grid == (-(-seq_q // CFG.B_r), 4, 2)


@pytest.mark.parametrize("n_kv_heads,group", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_grouped_and_multi_query_heads_plan(n_kv_heads, group):
    q, k = view((2, 128, 8, 64)), view((2, 96, n_kv_heads, 64))
    plan = check_forward_args(CFG, q, k, k)
    assert (plan.n_heads, plan.n_kv_heads, plan.kv_group_size) == (8, n_kv_heads, group)
    assert plan.grid == (2, 8, 2)  # one CTA row per q head: k/v heads are shared, never copied
    assert plan.out_shape == (2, 128, 8, 64)
    fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(plan.pack(0x1000, 0x2000, 0x3000, 0x4000))))
    assert (fields["n_heads"], fields["n_kv_heads"], fields["kv_group_size"]) == (8, n_kv_heads, group)
    assert (fields["k_batch_stride"], fields["k_seq_stride"], fields["k_head_stride"]) == \
        (96 * n_kv_heads * 64, n_kv_heads * 64, 64)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(8, 3), (2, 4), (6, 4), (4, 0)])
def test_q_heads_must_be_a_multiple_of_kv_heads(n_heads, n_kv_heads):
    q, k = view((1, 128, n_heads, 64)), view((1, 128, n_kv_heads, 64))
    with raises(ValueError, "k", match=f"{n_kv_heads} heads but q has {n_heads}"):
        check_forward_args(CFG, q, k, k)


def test_gqa_rule_holds_for_empty_problems_too():
    q, k = view((0, 128, 8, 64)), view((0, 128, 3, 64))
    with raises(ValueError, "k", match="multiple"):
        check_forward_args(CFG, q, k, k)
    assert not check_forward_args(CFG, view((2, 128, 0, 64)), view((2, 128, 2, 64)), view((2, 128, 2, 64))).launch


@pytest.mark.parametrize("vshape,label", [((1, 128, 4, 64), "number of heads 4 does not match k's 2"),
                                          ((1, 100, 2, 64), "seq_len 100 does not match k's 128"),
                                          ((2, 128, 2, 64), "batch size 2 does not match k's 1"),
                                          ((1, 128, 2, 128), "d_head 128 does not match k's 64")])
def test_v_must_match_k_dimension_by_dimension(vshape, label):
    q, k = view((1, 128, 8, 64)), view((1, 128, 2, 64))
    with raises(ValueError, "v", match=label):
        check_forward_args(CFG, q, k, view(vshape))


@pytest.mark.parametrize("d_head", [8, 32, 80, 100, 160, 512])
def test_unsupported_d_head(d_head):
    assert d_head not in SUPPORTED_D_HEADS
    q = view((1, 64, 2, d_head))

    def select(*args):  # pragma: no cover - must not be reached
        raise AssertionError("the selector is not asked about an unsupported d_head")

    with raises(ValueError, "q", match=f"d_head {d_head} is not supported.*{SUPPORTED_D_HEADS}"):
        check_forward_args(None, q, q, q, select=select)
    with raises(ValueError, "q", match=f"d_head {d_head} is not supported"):
        check_forward_args(CFG, q, q, q)  # the head dim is reported before the config mismatch


@pytest.mark.parametrize("d_head", SUPPORTED_D_HEADS)
@pytest.mark.parametrize("dtype", list(DType))
def test_every_supported_d_head_plans_with_its_default_config(d_head, dtype):
    cfg = default_config(dtype, d_head)
    q, k = view((2, 77, 4, d_head), dtype), view((2, 300, 1, d_head), dtype)
    plan = check_forward_args(None, q, k, k, causal=True, select=lambda *a: cfg)
    assert plan.cfg is cfg and plan.launch and plan.causal is True and plan.kv_group_size == 4
    assert plan.smem_bytes == cfg.smem_bytes()


# ----------------------------------------------------------------------------- causal and lse
def test_causal_defaults_to_false_and_selects_the_kernel_not_a_field():
    q, k = view((2, 100, 4, 64)), view((2, 300, 2, 64))
    plan = check_forward_args(CFG, q, k, k)
    assert plan.causal is False
    fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(plan.pack(0x1000, 0x2000, 0x3000, 0x4000))))
    assert "causal" not in fields  # a template parameter of the kernel: the plan picks the instantiation
    assert fields["lse_head_stride"] == 0 and fields["lse"] == 0 and fields["kv_group_size"] == 2
    plan = check_forward_args(CFG, q, k, k, causal=True)
    assert plan.causal is True
    fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(plan.pack(0x1000, 0x2000, 0x3000, 0x4000, 0x5000))))
    assert (fields["q"], fields["k"], fields["v"], fields["o"], fields["lse"]) == (0x1000, 0x2000, 0x3000, 0x4000, 0x5000)
    assert (fields["lse_head_stride"], fields["kv_group_size"]) == (0, 2)
    assert (fields["seq_len_q"], fields["seq_len_k"], fields["n_heads"], fields["n_kv_heads"]) == (100, 300, 4, 2)
    assert plan.grid == (2, 4, 2)  # causal does not change the grid: each CTA skips masked blocks


def test_causal_accepts_numpy_bools():
    plan = check_forward_args(CFG, *qkv(), causal=np.bool_(True))
    assert plan.causal is True
    assert check_forward_args(CFG, *qkv(), causal=np.False_).causal is False


@pytest.mark.parametrize("bad", [1, 0, None, "True", 1.0, np.array([True]), np.int64(1)])
def test_causal_must_be_a_bool(bad):
    with raises(TypeError, "causal", match="expected a bool"):
        check_forward_args(CFG, *qkv(), causal=bad)


def test_check_flag():
    assert check_flag(True, "x") is True and check_flag(np.True_, "x") is True
    with raises(TypeError, "return_lse", match="bool"):
        check_flag(1, "return_lse")


def test_lse_shape_is_batch_heads_seq_q():
    q, k = view((3, 100, 8, 64)), view((3, 7, 2, 64))
    assert check_forward_args(CFG, q, k, k).lse_shape == (3, 8, 100)


def test_lse_request_rules():
    assert check_lse_request(False, False) is False
    assert check_lse_request(True, False) is True
    assert check_lse_request(True, True) is True
    assert check_lse_request(np.True_, False) is True
    for bad in (1, None, "yes"):
        with raises(TypeError, "return_lse"):
            check_lse_request(bad, False)
    with raises(ValueError, "lse", match="return_lse is False"):
        check_lse_request(False, True)


def lse_view(shape=(2, 4, 128), strides=None, ptr=BASE_PTR + 0x100000, device=0, raw_dtype=np.dtype(np.float32)):
    return TensorView(ptr, tuple(shape), tuple(strides or contiguous_strides(tuple(shape))), None, raw_dtype,
                      device, interop.CUPY, None)


def test_lse_out_accepted_when_right():
    plan = check_forward_args(CFG, *qkv((2, 128, 4, 64)))
    check_lse_out(lse_view(), plan)
    check_lse_out(lse_view((2, 4, 128), strides=(512, 128, 1)), plan)
    check_lse_out(lse_view((1, 1, 5), strides=(77, 3, 1)), check_forward_args(CFG, *qkv((1, 5, 1, 64))))


def test_lse_out_torch_float32_dtype_is_recognised():
    torch_like = type("dtype", (), {"__str__": lambda self: "torch.float32"})()
    plan = check_forward_args(CFG, *qkv((2, 128, 4, 64)))
    check_lse_out(lse_view(raw_dtype=torch_like), plan)


@pytest.mark.parametrize("bad,exc,match", [
    (lse_view((2, 128, 4)), ValueError, "shape"),  # (batch, seq, heads): the wrong order
    (lse_view((2, 4, 128, 1)), ValueError, "shape"),
    (lse_view(raw_dtype=np.dtype(np.float16)), TypeError, "float32"),
    (lse_view(raw_dtype=np.dtype(np.float64)), TypeError, "float32"),
    (lse_view(device=1), ValueError, "device"),
    (lse_view(strides=(1, 2 * 128, 2)), ValueError, "contiguous"),  # a transposed view
    (lse_view(strides=(8 * 128, 2 * 128, 1)), ValueError, "contiguous"),  # heads with gaps
    (lse_view(ptr=BASE_PTR + 2), ValueError, "aligned"),
])
def test_lse_out_errors(bad, exc, match):
    plan = check_forward_args(CFG, *qkv((2, 128, 4, 64)))
    with raises(exc, "lse", match=match):
        check_lse_out(bad, plan)


def test_keys_empty_but_queries_not():
    q, k = view((1, 64, 2, 64)), view((1, 0, 2, 64))
    with raises(ValueError, "k", match="seq_len_k is 0"):
        check_forward_args(CFG, q, k, k)


# ----------------------------------------------------------------------------- softmax_scale
@pytest.mark.parametrize("bad", [0.0, -1.0, 0, -2, float("nan"), float("inf"), -float("inf"), 1e300, 1e-300])
def test_softmax_scale_bad_values(bad):
    with raises(ValueError, "softmax_scale"):
        check_softmax_scale(bad, 64)
    with raises(ValueError, "softmax_scale"):
        check_forward_args(CFG, *qkv(), softmax_scale=bad)


@pytest.mark.parametrize("bad", ["0.1", True, np.bool_(True), [0.1], np.array([0.1, 0.2]), 1j])
def test_softmax_scale_bad_types(bad):
    with raises(TypeError, "softmax_scale"):
        check_softmax_scale(bad, 64)


@pytest.mark.parametrize("good,expected", [(None, 0.125), (0.5, 0.5), (2, 2.0), (np.float32(0.25), 0.25),
                                           (np.float64(0.3), 0.3), (np.int64(1), 1.0)])
def test_softmax_scale_good(good, expected):
    scale = check_softmax_scale(good, 64)
    assert type(scale) is float and scale == pytest.approx(expected)


# ----------------------------------------------------------------------------- config resolution (api)
def test_resolve_config_object_string_and_auto():
    assert api.resolve_config(CFG) is CFG
    assert api.resolve_config(CFG.short_form()) == CFG
    # parsed once: the same object comes back from the cache
    assert api.resolve_config(CFG.short_form()) is api.resolve_config(CFG.short_form())
    assert api.resolve_config(None) is None
    assert api.resolve_config("auto") is None
    assert api.resolve_config(" AUTO ") is None


def test_resolve_config_bad_string():
    with raises(ValueError, "cfg", match="cannot parse"):
        api.resolve_config("(FP16, 64, 64): async")
    with raises(ValueError, "cfg", match="rule"):  # parses, but breaks a config rule
        api.resolve_config("(FP16, 64, 64, 64, 8): async+load_0_0_0_tiles")


@pytest.mark.parametrize("bad", [42, 1.5, b"(FP16, 64, 64, 64, 4): load_0_0_0_tiles", ("FP16", 64)])
def test_resolve_config_bad_type(bad):
    with raises(TypeError, "cfg"):
        api.resolve_config(bad)


def test_auto_uses_config_sets_default(monkeypatch):
    from cupyflash.families.forward_sm80 import config_sets

    seen = []

    def fake_default(dtype, d_head):
        seen.append((dtype, d_head))
        return CFG

    api._default_config.cache_clear()
    monkeypatch.setattr(config_sets, "default_config", fake_default, raising=False)
    # no tuning table: on a GPU that has one (the H100's ships), the table answers first
    monkeypatch.setattr(api, "_tuned_config", lambda *args: None)
    try:
        q, k, v = qkv()
        plan = api.plan_forward("auto", q, k, v)
        assert plan.cfg is CFG and seen == [(DType.FP16, 64)]
        api.plan_forward(None, q, k, v)
        assert seen == [(DType.FP16, 64)]  # cached per (dtype, d_head)
    finally:
        api._default_config.cache_clear()


def test_auto_rejects_unsupported_d_head():
    q = view((1, 64, 2, 80))
    with raises(ValueError, "q", match="d_head 80"):
        api.plan_forward(None, q, q, q)


def test_plan_forward_passes_causal():
    assert api.plan_forward(CFG, *qkv(), causal=True).causal is True
    assert api.plan_forward(CFG, *qkv()).causal is False


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("d_head", SUPPORTED_D_HEADS)
def test_default_config_exists_and_fits(dtype, d_head):
    from cupyflash.families.forward_sm80 import config_sets

    assert hasattr(config_sets, "default_config"), "config_sets.default_config(dtype, d_head) is missing"
    cfg = config_sets.default_config(dtype, d_head)
    assert isinstance(cfg, FlashForwardKernelConfig)
    assert (cfg.dtype, cfg.d_head) == (dtype, d_head)


def test_plan_forward_with_short_form():
    plan = api.plan_forward(CFG.short_form(), *qkv())
    assert plan.cfg == CFG and plan.grid == (2, 4, 2)


# ----------------------------------------------------------------------------- interop on the CPU
def test_as_view_rejects_host_numpy():
    with raises(TypeError, "q", match="host numpy"):
        as_view(np.zeros((1, 64, 1, 64), np.float16), "q")


@pytest.mark.parametrize("obj", [None, 3.0, [1, 2], "q"])
def test_as_view_rejects_non_arrays(obj):
    with raises(TypeError, "v", match="expected a CuPy array"):
        as_view(obj, "v")


class _FakeDLPack:
    def __init__(self, device_type):
        self.device_type = device_type

    def __dlpack__(self, stream=None):  # pragma: no cover - must not be reached
        raise AssertionError("should not export")

    def __dlpack_device__(self):
        return (self.device_type, 0)


@pytest.mark.parametrize("device_type", [1, 3])  # kDLCPU, kDLCUDAHost
def test_as_view_rejects_host_dlpack_producers(device_type):
    with raises(TypeError, "k", match="CUDA device"):
        as_view(_FakeDLPack(device_type), "k")


def test_output_view_rejects_jax_arrays():
    fake_jax_array = type("ArrayImpl", (_FakeDLPack,), {"__module__": "jaxlib._jax"})(2)
    with raises(TypeError, "out", match="immutable"):
        output_view(fake_jax_array)


def test_output_view_rejects_host_arrays_as_out():
    with raises(TypeError, "out"):
        output_view(np.zeros((1, 64, 1, 64), np.float16))


class _CupyLike:
    """Duck-typed stand-in for a cupy.ndarray (byte strides, .data.ptr, .data.device_id)."""

    class _MemPtr:
        def __init__(self, ptr, device_id):
            self.ptr, self.device_id = ptr, device_id

    def __init__(self, shape, byte_strides, dtype=np.float16, ptr=BASE_PTR, device_id=0):
        self.shape, self.strides, self.dtype = shape, byte_strides, np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.data = self._MemPtr(ptr, device_id)


def test_cupy_view_converts_byte_strides_to_elements():
    x = _CupyLike((2, 128, 4, 64), (128 * 4 * 64 * 2, 4 * 64 * 2, 64 * 2, 2), device_id=3)
    tv = interop._cupy_view(x, "q", interop.CUPY)
    assert tv.strides == (128 * 4 * 64, 4 * 64, 64, 1)
    assert (tv.ptr, tv.shape, tv.dtype, tv.device, tv.framework, tv.base) == (BASE_PTR, x.shape, DType.FP16, 3, "cupy", x)
    neg = interop._cupy_view(_CupyLike((2, 1, 1, 8), (-16, 16, 16, 2), ml_dtypes.bfloat16), "k", interop.CUPY)
    assert neg.strides == (-8, 8, 8, 1) and neg.dtype is DType.BF16
    f32 = interop._cupy_view(_CupyLike((1, 1, 1, 8), (32, 32, 32, 4), np.float32), "v", interop.CUPY)
    assert f32.strides == (8, 8, 8, 1) and f32.dtype is None and f32.raw_dtype == np.float32


def test_cupy_view_rejects_odd_byte_strides():
    with raises(ValueError, "q", match="element size"):
        interop._cupy_view(_CupyLike((1, 2, 1, 8), (32, 17, 16, 2)), "q", interop.CUPY)


def test_numpy_dtype_map_covers_fp16_and_bf16():
    assert interop._NUMPY_DTYPES[np.dtype(np.float16)] is DType.FP16
    assert interop._NUMPY_DTYPES[np.dtype(ml_dtypes.bfloat16)] is DType.BF16
    assert np.dtype(np.float32) not in interop._NUMPY_DTYPES


def test_contiguous_strides():
    assert contiguous_strides((2, 3, 4, 5)) == (60, 20, 5, 1)
    assert contiguous_strides((0, 3, 4, 5)) == (60, 20, 5, 1)


class _CupyLikeStream:
    def __init__(self, ptr, device_id=0):
        self.ptr = ptr
        self.device_id = device_id


class _TorchLikeStream:
    class _Device:
        def __init__(self, index):
            self.index = index

    def __init__(self, handle, index=0):
        self.cuda_stream = handle
        self.device = self._Device(index)


def test_resolve_stream_explicit():
    like = view()
    assert resolve_stream(0, like) == 0
    assert resolve_stream(0x1234, like) == 0x1234
    assert resolve_stream(np.int64(7), like) == 7
    assert resolve_stream(_CupyLikeStream(0xABC), like) == 0xABC
    assert resolve_stream(_TorchLikeStream(0xDEF), like) == 0xDEF


def test_resolve_stream_errors():
    like = view()
    with raises(ValueError, "stream"):
        resolve_stream(-1, like)
    with raises(TypeError, "stream"):
        resolve_stream(True, like)
    with raises(TypeError, "stream"):
        resolve_stream("default", like)
    with raises(TypeError, "stream"):
        resolve_stream(1.0, like)
    with raises(ValueError, "stream", match="device 1"):
        resolve_stream(_CupyLikeStream(0xABC, device_id=1), like)
    with raises(ValueError, "stream", match="device 2"):
        resolve_stream(_TorchLikeStream(0xABC, index=2), like)


# ----------------------------------------------------------------------------- forward() without a GPU
def _has_gpu() -> bool:
    from cupyflash.device import has_gpu

    return has_gpu()


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
def test_forward_without_gpu_raises_clear_runtime_error():
    x = np.zeros((1, 64, 1, 64), np.float16)
    with pytest.raises(RuntimeError, match="GPU"):
        cupyflash.forward(None, x, x, x)
    with pytest.raises(RuntimeError, match="GPU"):
        cupyflash.forward(CFG, x, x, x)


def test_forward_is_exported_with_spec_signature():
    import inspect

    sig = inspect.signature(cupyflash.forward)
    assert list(sig.parameters) == ["cfg", "q", "k", "v", "out", "softmax_scale", "causal", "return_lse", "lse",
                                    "stream"]
    assert sig.parameters["out"].default is None
    for name, default in (("softmax_scale", None), ("causal", False), ("return_lse", False), ("lse", None),
                          ("stream", None)):
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert sig.parameters[name].default is default


# ----------------------------------------------------------------------------- forward() wiring, faked
class _FakeKernel:
    def __init__(self):
        self.launches = []

    def launch(self, grid, block, smem_bytes, stream_ptr, params):
        self.launches.append((grid, block, smem_bytes, stream_ptr, params, _FakeCupy.current))


class _FakeRegistry:
    def __init__(self):
        self.kernel = _FakeKernel()
        self.asked = []

    def get(self, cfg, device_id, causal=False):
        self.asked.append((cfg, device_id))
        self.causal = causal
        return self.kernel


class _FakeCupy:
    """Just enough of the cupy namespace for api._launch: the current device and switching it."""
    current = 0

    class cuda:
        class runtime:
            @staticmethod
            def getDevice():
                return _FakeCupy.current

        class Device:
            def __init__(self, device):
                self.device = device

            def __enter__(self):
                self.previous, _FakeCupy.current = _FakeCupy.current, self.device

            def __exit__(self, *exc):
                _FakeCupy.current = self.previous


@pytest.fixture
def faked_gpu(monkeypatch):
    """forward() end to end on duck-typed CuPy arrays, with the launch captured instead of run."""
    registry = _FakeRegistry()
    monkeypatch.setattr(api, "_gpu_ready", True)
    monkeypatch.setattr(api, "_checked_devices", {0, 1})
    monkeypatch.setattr(api, "_get_registry", lambda: registry)
    monkeypatch.setattr(api, "_cupy", _FakeCupy)
    monkeypatch.setattr(_FakeCupy, "current", 0)
    fake_as_view = lambda x, name: interop._cupy_view(x, name, interop.CUPY)  # noqa: E731
    monkeypatch.setattr(api, "as_view", fake_as_view)
    monkeypatch.setattr(api, "output_view", lambda x, name="out": fake_as_view(x, name))
    return registry


def _cupy_like(shape, ptr, device_id=0):
    strides, acc = [], 2
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return _CupyLike(shape, tuple(reversed(strides)), ptr=ptr, device_id=device_id)


def test_forward_packs_and_launches(faked_gpu):
    shape = (2, 128, 4, 64)
    q, k, v, o = (_cupy_like(shape, BASE_PTR + i * 0x100000) for i in range(4))
    result = cupyflash.forward(CFG.short_form(), q, k, v, o, softmax_scale=0.5, stream=0x1234)
    assert result is o
    assert faked_gpu.asked == [(CFG, 0)]
    [(grid, block, smem, stream, params, device)] = faked_gpu.kernel.launches
    assert (grid, block, smem, stream, device) == ((2, 4, 2), 128, CFG.smem_bytes(), 0x1234, 0)
    fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(params)))
    assert [fields[n] for n in ("q", "k", "v", "o", "lse")] == [q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, 0]
    assert fields["softmax_scale"] == 0.5 and fields["seq_len_q"] == 128 and fields["n_heads"] == 4


def test_forward_launches_on_the_arrays_device(faked_gpu):
    shape = (1, 64, 2, 64)
    q, o = _cupy_like(shape, BASE_PTR, device_id=1), _cupy_like(shape, BASE_PTR + 0x10000, device_id=1)
    cupyflash.forward(CFG, q, q, q, o, stream=0)
    assert faked_gpu.asked == [(CFG, 1)]
    assert faked_gpu.kernel.launches[0][-1] == 1  # device 1 was current during the launch
    assert _FakeCupy.current == 0  # and the caller's device is restored


def test_forward_zero_size_does_not_launch(faked_gpu):
    q = _cupy_like((0, 64, 2, 64), BASE_PTR)
    assert cupyflash.forward(CFG, q, q, q, q, stream=0) is q
    assert faked_gpu.kernel.launches == [] and faked_gpu.asked == []


def test_forward_validation_error_before_launch(faked_gpu):
    q = _cupy_like((1, 100, 4, 64), BASE_PTR)
    kv = _cupy_like((1, 100, 3, 64), BASE_PTR + 0x100000)
    with raises(ValueError, "k", match="3 heads but q has 4"):
        cupyflash.forward(CFG, q, kv, kv, q, stream=0)
    with raises(TypeError, "causal"):
        cupyflash.forward(CFG, q, q, q, q, causal=1, stream=0)
    with raises(TypeError, "return_lse"):
        cupyflash.forward(CFG, q, q, q, q, return_lse="yes", stream=0)
    assert faked_gpu.kernel.launches == []


def _cupy_like_f32(shape, ptr, device_id=0):
    strides, acc = [], 4
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return _CupyLike(shape, tuple(reversed(strides)), dtype=np.float32, ptr=ptr, device_id=device_id)


def test_forward_ragged_causal_gqa_with_lse_buffer(faked_gpu):
    q, o = _cupy_like((2, 100, 8, 64), BASE_PTR), _cupy_like((2, 100, 8, 64), BASE_PTR + 0x1000000)
    k, v = _cupy_like((2, 37, 2, 64), BASE_PTR + 0x2000000), _cupy_like((2, 37, 2, 64), BASE_PTR + 0x3000000)
    lse = _cupy_like_f32((2, 8, 100), BASE_PTR + 0x4000000)
    result = cupyflash.forward(CFG, q, k, v, o, causal=True, return_lse=True, lse=lse, stream=7)
    assert result == (o, lse) and result[0] is o and result[1] is lse
    [(grid, block, smem, stream, params, _)] = faked_gpu.kernel.launches
    assert (grid, stream) == ((2, 8, 2), 7)
    fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(params)))
    assert fields["lse"] == lse.data.ptr and fields["o"] == o.data.ptr
    assert (fields["seq_len_q"], fields["seq_len_k"], fields["n_heads"], fields["n_kv_heads"]) == (100, 37, 8, 2)
    assert fields["kv_group_size"] == 4 and faked_gpu.causal is True  # the causal instantiation was asked for
    assert (fields["k_batch_stride"], fields["k_seq_stride"], fields["k_head_stride"]) == (37 * 2 * 64, 2 * 64, 64)


def test_forward_lse_buffer_errors(faked_gpu):
    q = _cupy_like((2, 100, 8, 64), BASE_PTR)
    good = _cupy_like_f32((2, 8, 100), BASE_PTR + 0x4000000)
    with raises(ValueError, "lse", match="return_lse is False"):
        cupyflash.forward(CFG, q, q, q, q, lse=good, stream=0)
    with raises(ValueError, "lse", match="shape"):
        cupyflash.forward(CFG, q, q, q, q, return_lse=True, lse=_cupy_like_f32((2, 100, 8), BASE_PTR), stream=0)
    with raises(TypeError, "lse", match="float32"):
        cupyflash.forward(CFG, q, q, q, q, return_lse=True, lse=_cupy_like((2, 8, 100), BASE_PTR), stream=0)
    assert faked_gpu.kernel.launches == []


def test_forward_return_lse_allocates_fp32_batch_heads_seq(faked_gpu, monkeypatch):
    allocated = []

    def fake_allocate_lse(like, shape):
        buf = _cupy_like_f32(shape, BASE_PTR + 0x5000000, like.device)
        allocated.append((like, shape, buf))
        return interop._cupy_view(buf, "lse", like.framework)

    monkeypatch.setattr(api, "allocate_lse", fake_allocate_lse)
    q, o = _cupy_like((3, 65, 4, 64), BASE_PTR), _cupy_like((3, 65, 4, 64), BASE_PTR + 0x1000000)
    k = _cupy_like((3, 129, 1, 64), BASE_PTR + 0x2000000)
    out, lse = cupyflash.forward(CFG, q, k, k, o, return_lse=True, stream=0)
    [(like, shape, buf)] = allocated
    assert out is o and lse is buf and shape == (3, 4, 65) and like.ptr == q.data.ptr
    fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(faked_gpu.kernel.launches[0][4])))
    assert fields["lse"] == buf.data.ptr and fields["kv_group_size"] == 4


def test_forward_fast_path_keys_on_causal_and_lse_and_steps_aside_for_given_lse(faked_gpu, monkeypatch):
    from cupyflash import launch_plans

    seen = []
    monkeypatch.setattr(launch_plans, "signature", lambda *args: seen.append(args) or None)
    monkeypatch.setattr(api, "resolve_stream", lambda stream, like: 0)
    q = _cupy_like((1, 64, 2, 64), BASE_PTR)
    cupyflash.forward(CFG, q, q, q, q)
    cupyflash.forward(CFG, q, q, q, q, causal=True)
    assert [args[-2:] for args in seen] == [(False, False), (True, False)]  # causal is part of the plan key
    lse = _cupy_like_f32((1, 2, 64), BASE_PTR + 0x100000)
    monkeypatch.setattr(api, "allocate_lse", lambda like, shape: interop._cupy_view(lse, "lse", interop.CUPY))
    cupyflash.forward(CFG, q, q, q, q, return_lse=True)
    assert seen[-1][-2:] == (False, True)  # so is return_lse
    cupyflash.forward(CFG, q, q, q, q, return_lse=True, lse=lse)
    assert len(seen) == 3  # a given lse array never takes the fast path
    assert len(faked_gpu.kernel.launches) == 4


def test_index_check_requested_by_argument_or_environment(monkeypatch):
    from cupyflash.validation import index_check_requested

    monkeypatch.delenv("CUPYFLASH_CHECK_INDICES", raising=False)
    assert index_check_requested(None) is False and index_check_requested(True) is True
    for value, want in (("1", True), ("0", False), ("", False), ("yes", True)):
        monkeypatch.setenv("CUPYFLASH_CHECK_INDICES", value)
        assert index_check_requested(None) is want
    assert index_check_requested(False) is False  # the argument wins over the environment
    with pytest.raises(TypeError, match="^check_indices"):
        index_check_requested(1)
