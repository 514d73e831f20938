"""`cupyflash.forward`: FlashAttention forward on CuPy arrays, PyTorch tensors and JAX arrays.

The per-call path is kept lean (a later target is ~15 us per call with a cached kernel): config
strings are parsed once (lru_cache), the GPU and each device's compute capability are checked
once, and argument metadata travels in NamedTuples rather than dataclasses.
"""
from __future__ import annotations

import functools
from typing import Any

from . import launch_plans
from .families.forward_sm80 import config_sets
from .config import SUPPORTED_D_HEADS, DType
from .config import KernelConfig
from .families import family_of, parse_config, pick_family
from .families.forward_sm80 import FORWARD_SM80
from .families.forward_sm90 import FORWARD_SM90, HopperForwardKernelConfig
from .families.forward_sm90.config import D_HEADS as SM90_D_HEADS
from .families.forward_sm80.config import FlashForwardKernelConfig
from .tuning import tuned_config as _tuned_config  # module attribute so tests can patch it
from .interop import (TORCH, TensorView, _cupy, allocate_lse, allocate_output, as_view, output_view,
                      resolve_stream, wrap_output)
from .validation import (LaunchPlan, check_compute_capability, check_forward_args, check_lse_out,
                         check_lse_request)

__all__ = ["forward", "resolve_config", "plan_forward"]

AUTO = "auto"

_gpu_ready = False               # set once a GPU has been seen; never re-checked after that
_checked_devices: set[int] = set()  # devices whose compute capability passed the check
_get_registry = None             # cupyflash.registry.get_registry, bound on first launch


# -------------------------------------------------------------------------------- configs
@functools.lru_cache(maxsize=512)
def _parse_config(text: str) -> FlashForwardKernelConfig | None:
    """Short form -> config, cached so that passing a string costs one dict lookup per call.
    None for 'auto'."""
    if text.strip().lower() == AUTO:
        return None
    try:
        config = parse_config(text)  # any family's short form; the family is read off its prefix
    except ValueError as exc:
        raise ValueError(f"cfg: {exc}") from None
    return _forward_config(config)


def _forward_config(cfg: Any) -> KernelConfig:
    """`cfg` if forward() can launch it (a forward family's config); ValueError naming the
    family otherwise."""
    if type(cfg) is not FlashForwardKernelConfig and type(cfg) is not HopperForwardKernelConfig:
        family = family_of(cfg)
        raise ValueError(f"cfg: {cfg} is a config of the {family.name} kernel family ({family.kind}); "
                         f"forward() launches configs of the forward families "
                         f"({FORWARD_SM80.name}, {FORWARD_SM90.name})")
    return cfg


@functools.lru_cache(maxsize=64)
def _default_config(dtype: DType, d_head: int) -> FlashForwardKernelConfig:
    if d_head not in SUPPORTED_D_HEADS:
        raise ValueError(f"q: d_head {d_head} is not supported; expected one of {SUPPORTED_D_HEADS}")
    return config_sets.default_config(dtype, d_head)  # looked up per miss, so tests can patch it


def _select_config(dtype: DType, d_head: int, seq_len_q: int, seq_len_k: int,
                   device: int, causal: bool = False) -> FlashForwardKernelConfig:
    """The library's choice for cfg=None/'auto': the user's tuning table for this GPU, else the
    shipped table for its family, else config_sets.default_config (see cupyflash.tuning).
    Both lookups are cached, so this costs two dict lookups per call."""
    cfg = _tuned_config(dtype, d_head, seq_len_q, seq_len_k, device, causal, FORWARD_SM80.name)
    return cfg if cfg is not None else _default_config(dtype, d_head)


def resolve_config(cfg: Any, dtype: DType | None = None, d_head: int | None = None,
                   seq_len_q: int = 0, seq_len_k: int = 0,
                   device: int = 0, causal: bool = False) -> FlashForwardKernelConfig | None:
    """A config object for `cfg` (object, short-form string, or None/'auto').

    For None/'auto' returns the library's pick when `dtype` and `d_head` are given, else None.
    """
    if isinstance(cfg, (FlashForwardKernelConfig, HopperForwardKernelConfig)):
        return cfg
    if isinstance(cfg, KernelConfig):
        return _forward_config(cfg)
    if isinstance(cfg, str):
        config = _parse_config(cfg)
        if config is not None:
            return config
    elif cfg is not None:
        raise TypeError(f"cfg: expected a FlashForwardKernelConfig, a short-form str, 'auto' or None, "
                        f"got {type(cfg).__name__}")
    if dtype is None or d_head is None:
        return None
    if _hopper_default(device) and d_head in SM90_D_HEADS:
        from .families.forward_sm90.launch import auto_config

        return auto_config(dtype, d_head, seq_len_q, seq_len_k, device, causal)
    return _select_config(dtype, d_head, seq_len_q, seq_len_k, device, causal)


# -------------------------------------------------------------------------------- families
_device_cc: dict[int, int] = {}


def _compute_capability(device: int) -> int:
    cc = _device_cc.get(device)
    if cc is None:
        from .device import compute_capability

        cc = _device_cc[device] = compute_capability(device)
    return cc


def _hopper_default(device: int) -> bool:
    """Whether cfg=None runs the Hopper family on `device` (when the layout suits TMA): the
    family that `pick_family('forward', cc)` prefers there."""
    try:
        return pick_family("forward", _compute_capability(device)) is FORWARD_SM90
    except Exception:  # no GPU to ask (planning on a CPU): the mma.sync family
        return False


def _hopper_reason(q: TensorView, k: TensorView, v: TensorView) -> str | None:
    """Why the Hopper family cannot run this problem (then the mma.sync family does), or None."""
    cc = _compute_capability(q.device)
    if cc != 90:
        return f"device {q.device} has compute capability {cc // 10}.{cc % 10}, not 9.0"
    from .families.forward_sm90.launch import unsupported_reason

    return unsupported_reason(q, k, v)


# -------------------------------------------------------------------------------- devices
def _ensure_gpu() -> None:
    global _gpu_ready
    from .device import require_gpu

    require_gpu()  # RuntimeError with a clear message when there is none
    _gpu_ready = True


def _check_device(device: int) -> None:
    from .device import compute_capability

    check_compute_capability(compute_capability(device), device)
    _checked_devices.add(device)


# -------------------------------------------------------------------------------- forward
def plan_forward(cfg: Any, q: TensorView, k: TensorView, v: TensorView,
                 out: TensorView | None = None, softmax_scale: Any = None, causal: Any = False) -> LaunchPlan:
    """Resolve `cfg` and validate the views; the GPU-free half of `forward`."""
    config = resolve_config(cfg)  # None for None/'auto': picked inside, once dtype/shape are known
    return check_forward_args(config, q, k, v, out, softmax_scale, causal, select=_select_config)


def forward(cfg: Any, q: Any, k: Any, v: Any, out: Any = None, *, softmax_scale: float | None = None,
            causal: bool = False, return_lse: bool = False, lse: Any = None, stream: Any = None) -> Any:
    """Attention forward: out = softmax(q k^T * softmax_scale + mask) v, per batch and head.

    Args:
        cfg: a forward family's config (FlashForwardKernelConfig: mma.sync, sm_80+;
            HopperForwardKernelConfig: wgmma/TMA, sm_90 only), its short form (str), or None /
            'auto': the library picks the family and config for the device (on Hopper the
            forward_sm90 family where the layout suits TMA, else forward_sm80).
        q: (batch, seq_len_q, n_heads, d_head); k, v: (batch, seq_len_k, n_kv_heads, d_head) with
            n_heads a multiple of n_kv_heads (grouped-query / multi-query attention: q head h reads
            k/v head h // (n_heads // n_kv_heads), nothing is copied). fp16 or bf16, d_head one of
            config.SUPPORTED_D_HEADS, any lengths >= 1, last dimension contiguous and 16-byte
            aligned, other strides free: CuPy arrays (bf16 as ml_dtypes.bfloat16), PyTorch CUDA
            tensors, or any DLPack producer on a CUDA device (e.g. JAX arrays).
        out: optional array of q's shape and dtype to write into (not a JAX array: those are
            immutable); returned as given.
        softmax_scale: default 1/sqrt(d_head).
        causal: a bool. True masks key j for query i unless j <= i + seq_len_k - seq_len_q
            (bottom-right aligned, as in FlashAttention-2; the usual lower triangle when the lengths
            are equal). Query rows that see no key (i < seq_len_q - seq_len_k) get output 0.
        return_lse: a bool. True returns (out, lse), lse the float32 (batch, n_heads, seq_len_q)
            natural-log log-sum-exp of each row's scaled, masked scores (-inf for rows that see
            no key), for merging partial results.
        lse: optional C-contiguous float32 (batch, n_heads, seq_len_q) array to write the
            log-sum-exp into (needs return_lse=True); returned as given.
        stream: default the caller's current stream (PyTorch's for torch tensors, CuPy's
            otherwise); or a cupy.cuda.Stream, a torch.cuda.Stream, or an int handle.

    Returns:
        The output in the framework of q (a new array unless `out` was given); with
        return_lse=True, the pair (out, lse), lse in the same framework. Nothing is copied.
    """
    key = None
    if lse is None:
        key = launch_plans.signature(cfg, q, k, v, out, softmax_scale, causal, return_lse)
        result = launch_plans.lookup(key, q, k, v, out, stream)
        if result is not None:
            return result
    if not _gpu_ready:
        _ensure_gpu()
    qv = as_view(q, "q")
    kv = as_view(k, "k")
    vv = as_view(v, "v")
    ov = output_view(out) if out is not None else None
    if qv.device not in _checked_devices:
        _check_device(qv.device)
    config = resolve_config(cfg)
    if type(config) is HopperForwardKernelConfig:
        reason = _hopper_reason(qv, kv, vv)
        if reason:
            raise ValueError(f"cfg: {config} (family {FORWARD_SM90.name}) cannot run this call: {reason}")
        return _forward_sm90(config, qv, kv, vv, ov, out, softmax_scale, causal, return_lse, lse, stream, key)
    if config is None and _hopper_default(qv.device) and _hopper_reason(qv, kv, vv) is None:
        return _forward_sm90(None, qv, kv, vv, ov, out, softmax_scale, causal, return_lse, lse, stream, key)
    plan = plan_forward(config, qv, kv, vv, ov, softmax_scale, causal)
    want_lse, ov, lv, stream_ptr = _outputs(plan, qv, ov, return_lse, lse, stream)
    if plan.launch:
        kernel = _launch(plan, qv, kv, vv, ov, stream_ptr, lv.ptr if lv is not None else 0)
        if key is not None:
            launch_plans.remember(key, _fast_launch(plan, kernel, qv, want_lse))
    return _result(out, ov, want_lse, lse, lv)


def _outputs(plan: LaunchPlan, qv: TensorView, ov: TensorView | None, return_lse: Any, lse: Any,
             stream: Any) -> tuple[bool, TensorView, TensorView | None, int]:
    """The output side of a validated forward plan, either family: (whether an lse is wanted,
    the output view, the lse view or None, the stream handle). The caller's `out`/`lse` are
    checked against the plan; missing ones are allocated, the lse only when asked for."""
    want_lse = check_lse_request(return_lse, lse is not None)
    lv = None
    if lse is not None:
        lv = output_view(lse, "lse")
        check_lse_out(lv, plan)
    stream_ptr = resolve_stream(stream, qv)
    if ov is None:
        ov = allocate_output(qv, plan.out_shape)
    if want_lse and lv is None:
        lv = allocate_lse(qv, plan.lse_shape)
    return want_lse, ov, lv, stream_ptr


def _result(out: Any, ov: TensorView, want_lse: bool, lse: Any, lv: TensorView | None) -> Any:
    """forward()'s return value: the caller's arrays where given, else the allocated ones."""
    result = out if out is not None else wrap_output(ov)
    if want_lse:
        return result, (lse if lse is not None else wrap_output(lv))
    return result


def _forward_sm90(cfg: HopperForwardKernelConfig | None, qv: TensorView, kv: TensorView, vv: TensorView,
                  ov: TensorView | None, out: Any, softmax_scale: Any, causal: Any, return_lse: Any, lse: Any,
                  stream: Any, key: tuple | None) -> Any:
    """forward() on the Hopper family: validated as forward validates, launched with TMA
    descriptors (cached by pointer and layout); remembered as a fast launch that stores each
    call's pointers into the descriptors' address words (or, where their format hides them,
    re-packs the descriptors)."""
    from .families.forward_sm90.launch import get_kernel, launch_sm90, make_repack, plan_sm90

    plan = plan_sm90(cfg, qv, kv, vv, ov, softmax_scale, causal)
    base = plan.base
    want_lse, ov, lv, stream_ptr = _outputs(base, qv, ov, return_lse, lse, stream)
    if base.launch:
        launch_sm90(plan, qv, kv, vv, ov, stream_ptr, lv.ptr if lv is not None else 0)
        if key is not None:
            from .families.forward_sm90.params import PARAMS_SIZE
            from .op_launch import embedded_pointers

            c = plan.cfg
            kernel = get_kernel(plan.cfg, base.device, base.causal)
            # as the operators do: a call stores five words into the descriptors where their
            # format allows, else re-packs them through tma's cache
            params, writer = embedded_pointers(make_repack(plan, qv, kv, vv), PARAMS_SIZE)
            fast = _fast_launch(base, kernel, qv, want_lse, grid=plan.grid, block=c.n_threads, smem=c.smem_bytes(),
                                params=params, writer=writer)
            launch_plans.remember(key, fast)
    return _result(out, ov, want_lse, lse, lv)


def _fast_launch(plan: LaunchPlan, kernel: Any, q: TensorView, want_lse: bool, *,
                 grid: tuple[int, int, int] | None = None, block: int | None = None, smem: int | None = None,
                 params: bytes | None = None, writer: Any = None) -> launch_plans.FastLaunch:
    """The replayable form of a validated launch, for later calls with the same signature (and
    `want_lse`: each call then allocates its lse); `writer(buf)` makes its write_pointers
    (default: the leading ForwardParams fields)."""
    is_torch = q.framework == TORCH
    # torch: the fast path calls q.new_empty(out_shape) on each call's own q
    allocate = None if is_torch else functools.partial(_cupy.empty, plan.out_shape, dtype=q.raw_dtype)
    lse_shape = tuple(plan.lse_shape) if want_lse else None
    allocate_lse = launch_plans.lse_allocator(is_torch, plan.device, lse_shape) if want_lse else None
    current_stream = launch_plans.current_stream_reader(is_torch, plan.device)
    from .op_launch import leading_writer

    fast = launch_plans.FastLaunch(kernel.func_ptr, grid or plan.grid, block or plan.block,
                                   plan.smem_bytes if smem is None else smem, plan.device,
                                   plan.pack(0, 0, 0, 0) if params is None else params, tuple(plan.out_shape),
                                   allocate, current_stream, lse_shape, allocate_lse)
    fast.write_pointers = (writer or leading_writer)(fast.buf)
    return fast


def _launch(plan: LaunchPlan, q: TensorView, k: TensorView, v: TensorView, o: TensorView,
            stream_ptr: int, lse_ptr: int = 0) -> Any:
    global _get_registry
    if _get_registry is None:  # bound on first launch: the registry pulls in NVRTC and the cache
        from .registry import get_registry as _get_registry
    kernel = _get_registry().get(plan.cfg, plan.device, plan.causal)
    params = plan.pack(q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr)
    # cuLaunchKernel uses the calling thread's current context: it must be the arrays' device.
    if _cupy.cuda.runtime.getDevice() == plan.device:
        kernel.launch(plan.grid, plan.block, plan.smem_bytes, stream_ptr, params)
    else:
        with _cupy.cuda.Device(plan.device):
            kernel.launch(plan.grid, plan.block, plan.smem_bytes, stream_ptr, params)
    return kernel
