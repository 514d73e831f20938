"""Argument checks for `forward`, as pure functions over TensorViews and plain numbers.

Nothing here touches CUDA, so every rule is testable on a machine without a GPU. The result is a
`LaunchPlan`: everything the launch needs except the device pointers.

Error types: TypeError when an argument has the wrong kind (not an array, wrong dtype), ValueError
when its value is wrong (shape, layout, alignment, limits). Every message starts with the name of
the argument at fault and says what was expected.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, Callable, NamedTuple

import numpy as np

from .config import SUPPORTED_D_HEADS, DType
from .families.forward_sm80.config import FlashForwardKernelConfig
from .interop import TensorView, contiguous_strides
from .families.forward_sm80.params import pack_params

__all__ = ["LaunchPlan", "ConfigSelector", "check_forward_args", "check_compute_capability",
           "check_softmax_scale", "check_flag", "check_lse_request", "check_lse_out", "MIN_COMPUTE_CAPABILITY",
           "ALIGN_BYTES", "MAX_GRID_YZ", "INT32_MAX"]

# Same value as cupyflash.device.MIN_COMPUTE_CAPABILITY (a test keeps them equal); repeated here so
# that this module imports without CuPy/NVRTC.
MIN_COMPUTE_CAPABILITY = 80
ALIGN_BYTES = 16             # cp.async and the vectorised stores move 16 bytes at a time
MAX_GRID_YZ = 65535          # CUDA limit on gridDim.y and gridDim.z
INT32_MAX = 2**31 - 1        # the kernel keeps sequence lengths and head counts in int
_ALIGN_ELEMS = ALIGN_BYTES // 2  # elements per 16 bytes (fp16/bf16 are 2 bytes)
LOG2_E = math.log2(math.e)
_FP32_MAX = 3.4028234663852886e38
_FP32_MIN_NORMAL = 1.1754943508222875e-38


# (dtype, d_head, seq_len_q, seq_len_k, device, causal) -> config, for cfg=None / 'auto'.
ConfigSelector = Callable[[DType, int, int, int, int, bool], FlashForwardKernelConfig]


class LaunchPlan(NamedTuple):
    """The launch of one forward call, minus the pointers (which `pack` takes)."""

    cfg: FlashForwardKernelConfig  # the config to launch (the selector's choice for cfg=None)
    grid: tuple[int, int, int]
    block: int
    smem_bytes: int
    out_shape: tuple[int, ...]
    # (batch, seq, head) strides in elements; o_strides are out's, or the contiguous strides of
    # the output forward() allocates.
    q_strides: tuple[int, int, int]
    k_strides: tuple[int, int, int]
    v_strides: tuple[int, int, int]
    o_strides: tuple[int, int, int]
    seq_len_q: int
    seq_len_k: int
    n_heads: int
    n_kv_heads: int
    softmax_scale: float
    softmax_scale_log2: float
    kv_group_size: int  # n_heads // n_kv_heads: q heads sharing one k/v head (1 without GQA/MQA)
    causal: bool        # bottom-right aligned: key j visible to query i iff j <= i + seq_len_k - seq_len_q
    device: int
    launch: bool  # False for zero-size problems: the output is empty, nothing to compute

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        """(batch, n_heads, seq_len_q): the contiguous fp32 log-sum-exp array the kernel writes."""
        return (self.out_shape[0], self.n_heads, self.seq_len_q)

    def pack(self, q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, lse_ptr: int = 0) -> bytes:
        """The kernel's ForwardParams bytes (field order: families.forward_sm80.params.PARAM_FIELDS). `lse_ptr` 0:
        the kernel writes no log-sum-exp."""
        return pack_params(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, 0, 0, 0, *self.q_strides, *self.k_strides,
                           *self.v_strides, *self.o_strides, self.seq_len_q, self.seq_len_k,
                           self.n_heads, self.n_kv_heads, self.softmax_scale, self.softmax_scale_log2,
                           self.kv_group_size, 0)


def check_compute_capability(cc: int, device: int) -> None:
    """ValueError naming q when the inputs' device is older than Ampere."""
    if cc < MIN_COMPUTE_CAPABILITY:
        raise ValueError(
            f"q: is on CUDA device {device} with compute capability {cc // 10}.{cc % 10}; cupyflash "
            f"needs compute capability {MIN_COMPUTE_CAPABILITY // 10}.{MIN_COMPUTE_CAPABILITY % 10} "
            "or newer (Ampere, Ada, Hopper, ...)"
        )


def check_softmax_scale(softmax_scale, d_head: int) -> float:
    """The scale to use: 1/sqrt(d_head) for None, else a finite positive real number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d_head)
    if type(softmax_scale) is not float:  # fast path for the common case
        # numbers.Real covers int, numpy scalars and Fraction; bools are ints but never a scale.
        if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(
                f"softmax_scale: expected None or a real number, got {type(softmax_scale).__name__}"
            )
    scale = float(softmax_scale)
    # The kernel takes scale and scale*log2(e) as normal fp32 numbers.
    if not (_FP32_MIN_NORMAL <= scale and scale * LOG2_E <= _FP32_MAX):  # also False for NaN
        raise ValueError(
            f"softmax_scale: expected a finite number > 0 (within float32 range), got {softmax_scale!r}"
        )
    return scale


# Devices that passed check_device_once: the entry points test membership before calling it.
CHECKED_DEVICES: set[int] = set()


def check_device_once(device: int) -> None:
    """A GPU is there and `device` is new enough (RuntimeError/ValueError otherwise); remembered
    in CHECKED_DEVICES so that later calls skip it (forward_kvcache, forward_varlen)."""
    from .device import compute_capability, require_gpu

    require_gpu()
    check_compute_capability(compute_capability(device), device)
    CHECKED_DEVICES.add(device)


_CHECK_ENV = "CUPYFLASH_CHECK_INDICES"
# os.environ's own store (bytes keys on POSIX): a lookup there costs ~0.03 us where
# os.environ.get of an absent name raises and catches a KeyError (~0.6 us), on every fast-path call
_ENV_STORE = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(_CHECK_ENV) if _ENV_STORE is not None and hasattr(os.environ, "encodekey") else None


def index_check_env() -> bool:
    """Whether CUPYFLASH_CHECK_INDICES is set to anything (the fast paths step aside then)."""
    if _ENV_KEY is not None:
        return bool(_ENV_STORE.get(_ENV_KEY))
    return bool(os.environ.get(_CHECK_ENV))


def index_check_requested(check_indices) -> bool:
    """Whether a call checks its index arrays (cache_seqlens, block_table, cu_seqlens) on the host:
    `check_indices` when it is a bool, else the environment variable CUPYFLASH_CHECK_INDICES=1."""
    if check_indices is None:
        return os.environ.get("CUPYFLASH_CHECK_INDICES", "") not in ("", "0")
    return check_flag(check_indices, "check_indices")


def check_flag(value, name: str) -> bool:
    """A real boolean argument (`causal`, `return_lse`): bool or numpy.bool_, nothing else. 0/1,
    None or strings are refused rather than guessed at."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name}: expected a bool (True or False), got {type(value).__name__} {value!r}")


def _dtype_name(view: TensorView) -> str:
    return view.dtype.name.lower() if view.dtype is not None else str(view.raw_dtype)


def _check_layout(view: TensorView, name: str) -> tuple[int, int, int]:
    """Last dim contiguous, pointer and outer strides 16-byte aligned; returns the outer strides
    (batch, seq, head) in elements."""
    strides = view.strides
    # Fast path, the common case: one expression, no loop.
    if (strides[3] == 1 and not view.ptr % ALIGN_BYTES
            and not (strides[0] % _ALIGN_ELEMS or strides[1] % _ALIGN_ELEMS or strides[2] % _ALIGN_ELEMS)):
        return strides[0], strides[1], strides[2]
    if strides[3] != 1 and view.shape[3] > 1:
        raise ValueError(
            f"{name}: the last dimension (d_head) must be contiguous (stride 1), got strides {tuple(strides)} "
            "(in elements); call .contiguous() / cupy.ascontiguousarray() first"
        )
    if view.ptr % ALIGN_BYTES:
        raise ValueError(f"{name}: data pointer 0x{view.ptr:x} is not {ALIGN_BYTES}-byte aligned")
    shape = view.shape
    for dim, label in ((0, "batch"), (1, "seq"), (2, "head")):
        # a stride only matters when its dimension has more than one index
        if shape[dim] > 1 and strides[dim] % _ALIGN_ELEMS:
            raise ValueError(
                f"{name}: the {label} stride {strides[dim]} (elements) is not a multiple of {_ALIGN_ELEMS}; "
                f"every row must start {ALIGN_BYTES}-byte aligned"
            )
    return strides[0], strides[1], strides[2]


def _raise_v_shape_error(k_shape, v_shape) -> None:
    shapes = f"(shapes k {tuple(k_shape)}, v {tuple(v_shape)})"
    if len(v_shape) == 4:
        for dim, label in ((0, "batch size"), (1, "seq_len"), (2, "number of heads"), (3, "d_head")):
            if v_shape[dim] != k_shape[dim]:
                raise ValueError(f"v: {label} {v_shape[dim]} does not match k's {k_shape[dim]}; k and v "
                                 f"must have the same shape {shapes}")
    raise ValueError(f"v: shape {tuple(v_shape)} does not match k's shape {tuple(k_shape)}")


def _raise_dtype_error(q: TensorView, k: TensorView, v: TensorView) -> None:
    if q.dtype is None:
        raise TypeError(f"q: dtype must be float16 or bfloat16, got {_dtype_name(q)}")
    for view, name in ((k, "k"), (v, "v")):
        if view.dtype is None:
            raise TypeError(f"{name}: dtype must be float16 or bfloat16, got {_dtype_name(view)}")
        if view.dtype is not q.dtype:
            raise TypeError(f"{name}: dtype {_dtype_name(view)} does not match q's dtype {_dtype_name(q)}")


def check_forward_args(cfg: FlashForwardKernelConfig | None, q: TensorView, k: TensorView,
                       v: TensorView, out: TensorView | None = None, softmax_scale=None, causal=False, *,
                       select: ConfigSelector | None = None) -> LaunchPlan:
    """Check every rule of SPEC §4 that needs no GPU and return the launch plan.

    q and out are (batch, seq_len_q, n_heads, d_head); k and v are (batch, seq_len_k, n_kv_heads,
    d_head) with n_heads a multiple of n_kv_heads (GQA/MQA). `cfg` None means "library picks":
    `select` is called with (dtype, d_head, seq_len_q, seq_len_k, device, causal) once the inputs are
    known to be sane, so its choice can depend on the problem. Raises TypeError/ValueError naming
    the argument.
    """
    if causal is not False and causal is not True:
        causal = check_flag(causal, "causal")
    if cfg is None:
        if select is None:
            raise TypeError("cfg: is None but no config selector was given")
    elif not isinstance(cfg, FlashForwardKernelConfig):
        raise TypeError(f"cfg: expected a FlashForwardKernelConfig, a short-form str, 'auto' or None, "
                        f"got {type(cfg).__name__}")

    # Each group below is one cheap test in the common case; the messages are built only on failure.

    # dtypes: supported and equal among inputs
    dtype = q.dtype
    if dtype is None or k.dtype is not dtype or v.dtype is not dtype:
        _raise_dtype_error(q, k, v)

    # ranks and shapes
    q_shape, k_shape = q.shape, k.shape
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v.shape) != 4:
        for view, name in ((q, "q"), (k, "k"), (v, "v")):
            if len(view.shape) != 4:
                raise ValueError(f"{name}: expected 4 dimensions (batch, seq, heads, d_head), "
                                 f"got shape {tuple(view.shape)}")
    batch, seq_len_q, n_heads, d_head = q_shape
    kb, seq_len_k, n_kv_heads, kd = k_shape
    if kb != batch:
        raise ValueError(f"k: batch size {kb} does not match q's {batch} "
                         f"(shapes q {tuple(q_shape)}, k {tuple(k_shape)})")
    if kd != d_head:
        raise ValueError(f"k: d_head {kd} does not match q's {d_head} "
                         f"(shapes q {tuple(q_shape)}, k {tuple(k_shape)})")
    if v.shape != k_shape:
        _raise_v_shape_error(k_shape, v.shape)
    if n_kv_heads != n_heads and (not n_kv_heads or n_heads % n_kv_heads):
        raise ValueError(
            f"k: k and v have {n_kv_heads} heads but q has {n_heads}; q's head count must be a multiple of "
            f"k/v's (grouped-query attention: each k/v head serves n_heads // n_kv_heads q heads)"
        )
    if d_head not in SUPPORTED_D_HEADS:
        raise ValueError(f"q: d_head {d_head} is not supported; expected one of {SUPPORTED_D_HEADS}")

    # devices
    device = q.device
    if k.device != device or v.device != device:
        name, other = ("k", k) if k.device != device else ("v", v)
        raise ValueError(f"{name}: is on CUDA device {other.device} but q is on device {device}; "
                         "all arrays must be on one device")

    # the config: picked now that dtype, shapes and device are known, then checked against them
    if cfg is None:
        cfg = select(dtype, d_head, seq_len_q, seq_len_k, device, causal)
    if cfg.dtype is not dtype:
        raise ValueError(f"cfg: config dtype {cfg.dtype.name} does not match the inputs' dtype {dtype.name}")
    if d_head != cfg.d_head:
        raise ValueError(f"cfg: config d_head {cfg.d_head} does not match the inputs' d_head {d_head}")

    # out
    out_shape = (batch, seq_len_q, n_heads, d_head)
    if out is not None:
        if out.shape != out_shape:  # tuple (or torch.Size, a tuple) equality covers the rank
            raise ValueError(f"out: expected shape {out_shape} (q's shape), got {tuple(out.shape)}")
        if out.dtype is not dtype:
            raise TypeError(f"out: expected dtype {_dtype_name(q)} (q's dtype), got {_dtype_name(out)}")
        if out.device != device:
            raise ValueError(f"out: is on CUDA device {out.device} but q is on device {device}")

    # sizes: int32 fields, grid limits, degenerate problems
    if seq_len_q > INT32_MAX or seq_len_k > INT32_MAX or n_heads > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        if seq_len_q > INT32_MAX:
            raise ValueError(f"q: seq_len_q={seq_len_q} exceeds the int32 limit {INT32_MAX}")
        if seq_len_k > INT32_MAX:
            raise ValueError(f"k: seq_len_k={seq_len_k} exceeds the int32 limit {INT32_MAX}")
        if n_heads > MAX_GRID_YZ:
            raise ValueError(f"q: {n_heads} heads exceed the CUDA grid limit gridDim.y <= {MAX_GRID_YZ}")
        raise ValueError(f"q: batch size {batch} exceeds the CUDA grid limit gridDim.z <= {MAX_GRID_YZ}")
    empty = not (batch and seq_len_q and n_heads)
    if not seq_len_k and not empty:
        raise ValueError(f"k: seq_len_k is 0 but q has {seq_len_q} query rows; attention over no keys is undefined")

    scale = check_softmax_scale(softmax_scale, d_head)

    # layouts (after shapes, so that the messages about shape come first)
    q_strides = _check_layout(q, "q")
    k_strides = _check_layout(k, "k")
    v_strides = _check_layout(v, "v")
    if out is not None:
        o_strides = _check_layout(out, "out")
        for dim in range(3):
            # a zero stride would make several threads write one element
            if out.shape[dim] > 1 and o_strides[dim] == 0:
                raise ValueError(f"out: has a zero stride in dimension {dim} (a broadcast view); "
                                 "expected a writable array whose elements do not overlap")
    else:  # forward() allocates a contiguous output
        o_strides = (seq_len_q * n_heads * d_head, n_heads * d_head, d_head)

    # No kernel limits beyond these rules: tails of any seq_len_q / seq_len_k are masked in the
    # kernel, whatever the config's B_r and B_c, and k/v heads may be shared (GQA/MQA).

    # Positional construction in field order: keyword arguments cost a microsecond per call here.
    return LaunchPlan(
        cfg, (-(-seq_len_q // cfg.B_r), n_heads, batch), cfg.n_warps * 32, cfg.smem_bytes(), out_shape,
        q_strides, k_strides, v_strides, o_strides, seq_len_q, seq_len_k, n_heads, n_kv_heads,
        scale, scale * LOG2_E, n_heads // n_kv_heads if n_kv_heads else 1, causal, device, not empty,
    )


# ----------------------------------------------------------------------------- log-sum-exp
def check_lse_request(return_lse, lse_given: bool) -> bool:
    """Whether forward() computes the log-sum-exp: `return_lse` must be a bool, and an `lse=`
    buffer is only taken together with return_lse=True (so the return type depends on one flag)."""
    want = return_lse if (return_lse is True or return_lse is False) else check_flag(return_lse, "return_lse")
    if lse_given and not want:
        raise ValueError("lse: an lse buffer was given but return_lse is False; pass return_lse=True "
                         "(forward then returns (out, lse))")
    return want


def _is_float32(view: TensorView) -> bool:
    raw = view.raw_dtype
    if str(raw) == "torch.float32":
        return True
    try:
        return np.dtype(raw) == np.float32
    except TypeError:
        return False


def check_lse_out(lse: TensorView, plan: Any, layout: str = "(batch, n_heads, seq_len_q)") -> None:
    """A caller-provided `lse=` buffer: fp32, shape plan.lse_shape (`layout`: (batch, n_heads,
    seq_len_q) for forward, (n_heads, total_q) for forward_varlen), C-contiguous (the kernels
    write it densely in that order), 4-byte aligned, on q's device (plan.device)."""
    shape = plan.lse_shape
    if tuple(lse.shape) != shape:
        raise ValueError(f"lse: expected shape {shape} {layout}, got {tuple(lse.shape)}")
    if not _is_float32(lse):
        raise TypeError(f"lse: expected dtype float32, got {lse.raw_dtype}")
    if lse.device != plan.device:
        raise ValueError(f"lse: is on CUDA device {lse.device} but q is on device {plan.device}")
    expected = contiguous_strides(shape)
    if any(n > 1 and st != ex for n, st, ex in zip(shape, lse.strides, expected)):
        raise ValueError(f"lse: must be C-contiguous (strides {expected} in elements), got strides "
                         f"{tuple(lse.strides)}; pass a contiguous array or omit lse=")
    if lse.ptr % 4:
        raise ValueError(f"lse: data pointer 0x{lse.ptr:x} is not 4-byte aligned")
