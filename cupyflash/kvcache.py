"""`cupyflash.forward_kvcache`: decode / append attention against a contiguous or paged KV cache.

One call launches one or two kernels of the decode family on one stream: `attention` (split-KV,
GQA-packed; it also writes k_new/v_new into the cache, when given) and `combine` (only with more
than one split); on sm_90 the combine is a programmatic dependent launch (its grid starts while
the attention grid still runs and waits for its results: cupyflash.kvcache_pdl).
Nothing in a call reads device memory on the host, synchronises, or allocates
except the output (when `out` is None), the log-sum-exp (return_lse=True) and the split
workspace (more than one split and no `workspace` given), all through the caller's framework
allocator, whose sizes depend on the shapes only. So a call can be captured in a CUDA graph
(after one warm-up call that compiles the kernels) and replayed with new cache_seqlens.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from .config import DType
from .families.decode import COMBINE_THREADS, DecodeKernelConfig
from .families.decode import config_sets as decode_sets
from .families.decode.params import DECODE_PARAMS
from .families.decode.splits import choose_num_splits, choose_paged_num_splits, streaming_ctas
from . import kvcache_plans
from .launch_plans import current_stream_reader, lse_allocator
from .interop import (TORCH, TensorView, _cupy, allocate_lse, allocate_output, as_view, host_copy, output_view,
                      external_stream, resolve_stream, scratch_f32, wrap_output)
from .kvcache_checks import KVCachePlan, check_index_values, check_kvcache_args, check_num_splits
from .validation import CHECKED_DEVICES, LOG2_E, check_device_once, index_check_env, index_check_requested

__all__ = ["forward_kvcache", "resolve_decode_config", "workspace_bytes", "plan_num_splits", "is_wide"]

_get_registry = None
_carveout_set: set[int] = set()  # kernels whose shared-memory carveout preference is set
_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


# -------------------------------------------------------------------------------- devices
@functools.lru_cache(maxsize=None)
def _device_limits(device: int) -> tuple[int, int, int]:
    """(SM count, shared memory per SM, opt-in shared memory per block) of `device`."""
    props = _cupy.cuda.runtime.getDeviceProperties(device)
    return (int(props["multiProcessorCount"]), int(props["sharedMemPerMultiprocessor"]),
            int(props["sharedMemPerBlockOptin"]))


@functools.lru_cache(maxsize=None)
def _dram_bytes_per_s(device: int) -> float | None:
    """Peak DRAM bandwidth of `device` (memory clock x bus width, double data rate), or None
    where the driver does not report it."""
    rt = _cupy.cuda.runtime
    try:
        khz = rt.deviceGetAttribute(rt.cudaDevAttrMemoryClockRate, device)
        bits = rt.deviceGetAttribute(rt.cudaDevAttrGlobalMemoryBusWidth, device)
    except Exception:  # noqa: BLE001 - an attribute a driver drops must not break decoding
        return None
    return 2.0 * khz * 1e3 * bits / 8 if khz > 0 and bits > 0 else None


# -------------------------------------------------------------------------------- configs
@functools.lru_cache(maxsize=256)
def _parse(text: str) -> DecodeKernelConfig | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return DecodeKernelConfig.parse(text)
    except ValueError as exc:
        raise ValueError(f"cfg: {exc}") from None


def _fit_smem(cfg: DecodeKernelConfig, smem_limit: int) -> DecodeKernelConfig:
    while cfg.smem_bytes() > smem_limit and cfg.stages > 1:  # smaller GPUs (sm_86: 99 KB per CTA)
        cfg = cfg.replace(stages=cfg.stages - 1)
    return cfg


@functools.lru_cache(maxsize=256)
def _default_for(dtype: DType, d_head: int, rows_total: int, paged: bool, wide: bool,
                 smem_limit: int, wave_heads: int | None = None) -> DecodeKernelConfig:
    cfg = decode_sets.default_config(dtype, d_head, rows_total, paged, wide, wave_heads)
    if wave_heads is not None and cfg.smem_bytes() > smem_limit:  # a smaller GPU: the wide default
        cfg = decode_sets.default_config(dtype, d_head, rows_total, paged, wide)
    return _fit_smem(cfg, smem_limit)


# The tuning table's problems stream TUNING_KV_BYTES (256 MB) of K and V; below a quarter of that
# a step is latency-bound (batch 1 x 8k keys at d_head 128 reads 34 MB in ~20 us, 0.55x the copy
# rate), the regime the heuristic defaults were probed on (config_sets), so those keep it.
TABLE_MIN_KV_BYTES = 64 << 20


@functools.lru_cache(maxsize=1024)
def _choice_for(dtype: DType, d_head: int, rows_total: int, paged: bool, wide: bool, causal: bool, max_keys: int,
                device: int, smem_limit: int, streaming: bool, wave_heads: int | None = None) -> DecodeKernelConfig:
    """For a narrow, streaming (K/V >= TABLE_MIN_KV_BYTES) problem on a contiguous cache, the
    tuning table's config for this device and cache length (fitted to the packed rows and the
    device's shared memory; the table is tuned on such problems: families/decode/tuning.py);
    else, and without a table, the heuristic default (`wave_heads`: decode_sets.one_wave_heads)."""
    from .tuning import tuned_config

    use_table = streaming and not (paged or wide)
    tuned = tuned_config(dtype, d_head, rows_total, max_keys, device, causal, "decode") if use_table else None
    if tuned is not None:
        fitted = decode_sets.fit_to_rows(tuned, rows_total)
        if fitted is not None:
            fitted = _fit_smem(fitted, smem_limit)
            if fitted.smem_bytes() <= smem_limit:
                return fitted
    return _default_for(dtype, d_head, rows_total, paged, wide, smem_limit, wave_heads)


def is_wide(plan: KVCachePlan, num_sms: int) -> bool:
    """Whether the problem has at least one CTA per SM without splitting the keys (batch x KV heads
    x row tiles of the default tile height >= the SM count): the defaults differ (config_sets)."""
    rows = decode_sets.rows_for(plan.d_head, plan.rows_total)
    return plan.batch * plan.n_kv_heads * -(-plan.rows_total // rows) >= num_sms


def resolve_decode_config(cfg: Any, plan: KVCachePlan, smem_limit: int = 227 * 1024,
                          num_sms: int = 132) -> DecodeKernelConfig:
    """The config to launch: `cfg` itself (object or short form, checked against the inputs), or
    the library's choice for None / 'auto': the device's tuning table entry for the cache length
    (`python -m cupyflash autotune --family decode`), else the heuristic default for the cache kind
    and the problem's width on a GPU of `num_sms` SMs."""
    if isinstance(cfg, str):
        cfg = _parse(cfg)
    if cfg is None:
        kv_bytes = 2 * plan.batch * plan.max_keys * plan.n_kv_heads * plan.d_head * 2
        streaming = kv_bytes >= TABLE_MIN_KV_BYTES
        wave_heads = (decode_sets.one_wave_heads(plan.d_head, plan.rows_total, plan.paged, plan.batch,
                                                 plan.n_kv_heads, num_sms) if streaming else None)
        return _choice_for(plan.dtype, plan.d_head, plan.rows_total, plan.paged, is_wide(plan, num_sms),
                           plan.causal and plan.seq_q > 1, plan.max_keys, plan.device, smem_limit,
                           streaming, wave_heads)
    if not isinstance(cfg, DecodeKernelConfig):
        raise TypeError(f"cfg: expected a DecodeKernelConfig, its short form, 'auto' or None, got {type(cfg).__name__}")
    if cfg.dtype is not plan.dtype:
        raise ValueError(f"cfg: config dtype {cfg.dtype.name} does not match the inputs' dtype {plan.dtype.name}")
    if cfg.d_head != plan.d_head:
        raise ValueError(f"cfg: config d_head {cfg.d_head} does not match the inputs' d_head {plan.d_head}")
    if cfg.smem_bytes() > smem_limit:
        raise ValueError(f"cfg: {cfg.short_form()} needs {cfg.smem_bytes()} bytes of shared memory per CTA; "
                         f"this GPU allows {smem_limit}")
    return cfg


def plan_num_splits(plan: KVCachePlan, cfg: DecodeKernelConfig, num_sms: int,
                    dram_bytes_per_s: float | None = None) -> int:
    """The library's split count for this problem on a GPU of `num_sms` SMs and peak DRAM
    bandwidth `dram_bytes_per_s` (None: as the H100's; families/decode/splits.py)."""
    row_tiles = -(-plan.rows_total // cfg.rows)
    head_blocks = -(-plan.n_kv_heads // cfg.heads)
    step = cfg.B_c * cfg.team
    if plan.paged:  # see families/decode/splits.py
        return choose_paged_num_splits(plan.batch, head_blocks, row_tiles, plan.max_keys, num_sms, step,
                                       4 * plan.d_head, dram_bytes_per_s)
    return choose_num_splits(plan.batch, head_blocks, row_tiles, plan.max_keys,
                             streaming_ctas(num_sms, dram_bytes_per_s), step)


def workspace_bytes(batch: int, seq_q: int, n_heads: int, d_head: int, num_splits: int) -> int:
    """Bytes of split scratch one call needs: fp32 partial rows and their log-sum-exp per split
    (0 for one split)."""
    if num_splits <= 1:
        return 0
    rows = batch * seq_q * n_heads
    return num_splits * rows * (d_head + 1) * 4


def _prefer_shared_memory(kernels) -> None:
    """Ask for the largest shared-memory carveout for both kernels: the attention kernel needs
    it, and when the combine kernel after it preferred another L1/shared split, each switch
    would make the SMs drain and reconfigure."""
    from cupy_backends.cuda.api import driver

    for kernel in kernels:
        if kernel.func_ptr not in _carveout_set:
            driver.funcSetAttribute(kernel.func_ptr, _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
            _carveout_set.add(kernel.func_ptr)


def _workspace_pointer(workspace: Any, nbytes: int) -> int:
    view = output_view(workspace, "workspace")
    itemsize = 4 if "32" in str(view.raw_dtype) else 2
    size = 1
    for n in view.shape:
        size *= n
    if size * itemsize < nbytes:
        raise ValueError(f"workspace: holds {size * itemsize} bytes but this call needs {nbytes} "
                         "(cupyflash.kvcache.workspace_bytes)")
    if view.ptr % 16:
        raise ValueError(f"workspace: data pointer 0x{view.ptr:x} is not 16-byte aligned")
    return view.ptr


# -------------------------------------------------------------------------------- forward_kvcache
def forward_kvcache(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any, block_table: Any = None,
                    k_new: Any = None, v_new: Any = None, causal: bool = True, softmax_scale: float | None = None,
                    return_lse: bool = False, num_splits: int | None = None, out: Any = None, stream: Any = None,
                    cfg: Any = None, workspace: Any = None, check_indices: bool | None = None) -> Any:
    """Attention of new query rows against a KV cache (FlashAttention's `flash_attn_with_kvcache`).

    For sequence b, the keys are cache rows 0 .. cache_seqlens[b] + seq_new - 1: the cached ones
    and, when k_new/v_new are given, the seq_new rows this call first writes into the cache at
    positions cache_seqlens[b] .. cache_seqlens[b] + seq_new - 1 (in place; cache_seqlens itself
    is not advanced: the caller does that).

    Args:
        q: (batch, seq_q, n_heads, d_head) fp16 or bf16, d_head 64, 128 or 256; seq_q >= 1 new
            query positions per sequence (1 for decoding, more for speculative decoding or
            chunked prefill).
        k_cache, v_cache: the cache, same shape and dtype as each other:
            contiguous (block_table None): (batch, capacity, n_kv_heads, d_head);
            paged: (num_pages, page_size, n_kv_heads, d_head), page_size a power of two from 16
            to 256. n_heads must be a multiple of n_kv_heads (GQA/MQA: q head h reads cache head
            h // (n_heads // n_kv_heads)). Last dimension contiguous, 16-byte aligned rows.
        cache_seqlens: (batch,) int32 on the GPU: rows already in each sequence's cache; any mix
            of lengths, 0 included.
        block_table: (batch, max_pages) int32 on the GPU, or None for a contiguous cache: row b
            lists the pages of sequence b in order (key j lives in page block_table[b, j //
            page_size], row j % page_size).
        k_new, v_new: optional (batch, seq_new, n_kv_heads, d_head), appended as described above.
        causal: a bool (default True). Query position i sees key j iff j <= i + seqlen_k - seq_q,
            seqlen_k = cache_seqlens[b] + seq_new (bottom-right aligned, as in `forward`); rows
            that see no key get output 0 and lse -inf. Irrelevant for seq_q = 1.
        softmax_scale: default 1 / sqrt(d_head).
        return_lse: a bool; True returns (out, lse), lse the fp32 (batch, n_heads, seq_q)
            natural-log log-sum-exp of each row's scaled scores.
        num_splits: None (the library picks from the SM count, batch, heads and capacity) or
            1..128: how many CTAs share one sequence's keys (flash-decoding). Any value gives the
            same result up to rounding.
        out: optional array of q's shape and dtype to write into (not a JAX array).
        stream: default the caller's current stream (PyTorch's for torch tensors, CuPy's
            otherwise); or a cupy/torch stream or an int handle.
        cfg: a DecodeKernelConfig, its short form ('decode (BF16, 128, 16, 16, 4): stages_4'),
            or None / 'auto' for the library's choice.
        workspace: optional CUDA array of at least `workspace_bytes(...)` bytes, 16-byte aligned,
            used as split scratch instead of an allocation (for strict no-allocation capture).
        check_indices: a bool, or None to follow the environment variable
            CUPYFLASH_CHECK_INDICES=1. Index values are NOT checked per call by default (that
            would read device memory on the host); with the check on, cache_seqlens and
            block_table are copied to the host and validated against the cache (ValueError
            naming the argument) before anything is launched. The check synchronises: never
            turn it on inside graph capture.

    Returns:
        out (a new array in q's framework unless `out` was given), or (out, lse).
    """
    key = None
    if workspace is None and check_indices is None and not index_check_env():
        key, result = kvcache_plans.run(cfg, num_splits, softmax_scale, causal, return_lse, q, k_cache, v_cache,
                                        cache_seqlens, block_table, k_new, v_new, out, stream)
        if result is not None:
            return result
    qv = as_view(q, "q")
    if qv.device not in CHECKED_DEVICES:
        check_device_once(qv.device)
    kv = as_view(k_cache, "k_cache")
    vv = as_view(v_cache, "v_cache")
    sv = as_view(cache_seqlens, "cache_seqlens")
    bv = as_view(block_table, "block_table") if block_table is not None else None
    knv = as_view(k_new, "k_new") if k_new is not None else None
    vnv = as_view(v_new, "v_new") if v_new is not None else None
    ov = output_view(out) if out is not None else None
    plan = check_kvcache_args(qv, kv, vv, sv, bv, knv, vnv, ov, causal, softmax_scale, return_lse)
    splits = check_num_splits(num_splits)
    num_sms, _, smem_limit = _device_limits(plan.device)
    config = resolve_decode_config(cfg, plan, smem_limit, num_sms)
    if splits is None:
        splits = plan_num_splits(plan, config, num_sms, _dram_bytes_per_s(plan.device))
    if index_check_requested(check_indices):
        check_index_values(plan, host_copy(sv), host_copy(bv) if bv is not None else None)
    stream_ptr = resolve_stream(stream, qv)

    if ov is None:
        ov = allocate_output(qv, plan.out_shape)
    lv = allocate_lse(qv, plan.lse_shape) if plan.want_lse else None
    if not plan.empty:
        launch = _launch(plan, config, splits, qv, kv, vv, sv, bv, knv, vnv, ov, lv, workspace, stream_ptr)
        if key is not None:
            kvcache_plans.remember(key, launch)
    result = out if out is not None else wrap_output(ov)
    return (result, wrap_output(lv)) if plan.want_lse else result


def _fast_launch(plan: KVCachePlan, splits: int, q: TensorView, heads: list, params: bytes
                 ) -> kvcache_plans.KVCacheLaunch:
    """The launches of a validated call, replayable with new pointers by later calls with the
    same signature. On sm_90+ the combine kernel is a programmatic dependent launch."""
    ws_bytes = workspace_bytes(plan.batch, plan.seq_q, plan.n_heads, plan.d_head, splits)
    device = plan.device
    current = current_stream_reader(q.framework == TORCH, device)
    lse_shape = plan.lse_shape if plan.want_lse else None
    allocate_lse = lse_allocator(q.framework == TORCH, device, lse_shape) if lse_shape is not None else None
    if q.framework == TORCH:
        import torch

        allocate = None
        ws_alloc, ws_free = _torch_workspace_allocator(torch, device)
    else:
        allocate = functools.partial(_cupy.empty, plan.out_shape, dtype=q.raw_dtype)
        # CuPy's pool: a MemoryPointer, freed (back to its stream's arena) when dropped
        ws_alloc, ws_free = functools.partial(_cupy_workspace, current, device), (lambda handle: None)
    launches = kvcache_plans.build_launches(heads, _pdl_capable(device))
    return kvcache_plans.KVCacheLaunch(launches, device, params, plan.out_shape, ws_bytes,
                                       splits * plan.total_rows * plan.d_head * 4, allocate, ws_alloc, ws_free,
                                       current, lse_shape, allocate_lse)


def _cupy_workspace(current: Callable[[], int], device: int, nbytes: int, stream: int) -> Any:
    """`nbytes` from CuPy's pool, ordered on `stream` (the pool is per stream: a block freed after
    the launches is reused only behind them): allocated with that stream current when it is not."""
    if stream == current():
        return _cupy.cuda.alloc(nbytes)
    with external_stream(stream, device):
        return _cupy.cuda.alloc(nbytes)


def _torch_workspace_allocator(torch: Any, device: int):
    """(alloc(nbytes, stream) -> int pointer, free(pointer)) on PyTorch's caching allocator: its raw
    blocks (about a microsecond a pair, no tensor object; under graph capture they come from the
    graph's pool like any tensor's), or, where this torch lacks them, tensors kept until freed."""
    raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
    raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
    if raw_alloc is not None and raw_delete is not None:
        return raw_alloc, raw_delete
    held: dict[int, Any] = {}

    def alloc(nbytes: int, stream: int) -> int:
        buf = torch.empty((-(-nbytes // 4),), dtype=torch.float32, device=f"cuda:{device}")
        held[buf.data_ptr()] = buf
        return buf.data_ptr()

    return alloc, held.pop


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: int) -> bool:
    """Programmatic dependent launch needs sm_90 (griddepcontrol) and cuLaunchKernelEx."""
    from .device import compute_capability
    from .kvcache_pdl import available

    return compute_capability(device) >= 90 and available()


def _launch(plan: KVCachePlan, cfg: DecodeKernelConfig, splits: int, q: TensorView, k: TensorView, v: TensorView,
            seqlens: TensorView, table: TensorView | None, k_new: TensorView | None, v_new: TensorView | None,
            o: TensorView, lse: TensorView | None, workspace: Any, stream_ptr: int) -> kvcache_plans.KVCacheLaunch:
    """Launch attention (which also appends k_new/v_new) and combine (with splits); return the
    launches with their packed parameters, which the fast path replays with new pointers."""
    global _get_registry
    if _get_registry is None:
        from .registry import get_registry as _get_registry
    kernels = _get_registry().get_all(cfg, plan.device, variant=(plan.causal, plan.paged))
    _prefer_shared_memory(kernels.values())
    row_tiles = -(-plan.rows_total // cfg.rows)
    head_blocks = -(-plan.n_kv_heads // cfg.heads)
    if head_blocks * row_tiles > 65535:
        raise ValueError(f"q: {head_blocks} KV head blocks x {row_tiles} row tiles exceed the CUDA grid limit 65535")
    ws_bytes = workspace_bytes(plan.batch, plan.seq_q, plan.n_heads, plan.d_head, splits)
    keep = None
    ws_ptr = 0
    if ws_bytes:
        if workspace is not None:
            ws_ptr = _workspace_pointer(workspace, ws_bytes)
        else:
            keep, ws_ptr = scratch_f32(q, (-(-ws_bytes // 4),), stream_ptr)
    ws_lse_ptr = ws_ptr + splits * plan.total_rows * plan.d_head * 4 if ws_bytes else 0
    params = DECODE_PARAMS.pack(
        q.ptr, k.ptr, v.ptr, k_new.ptr if k_new is not None else 0, v_new.ptr if v_new is not None else 0, o.ptr,
        lse.ptr if lse is not None else 0, ws_ptr, ws_lse_ptr, seqlens.ptr, table.ptr if table is not None else 0,
        *plan.q_strides, *plan.k_strides, *plan.v_strides, *plan.knew_strides, *plan.vnew_strides, *plan.o_strides,
        plan.block_table_stride, plan.page_shift, plan.max_keys, plan.batch, plan.seq_q, plan.n_heads, plan.n_kv_heads, plan.group,
        plan.rows_total, row_tiles, plan.total_rows, plan.seq_new, splits, plan.softmax_scale,
        plan.softmax_scale * LOG2_E)
    heads = [(kernels["attention"], (splits, head_blocks * row_tiles, plan.batch), cfg.n_threads, cfg.smem_bytes())]
    if splits > 1:
        heads.append((kernels["combine"], (-(-plan.total_rows // 4), 1, 1), COMBINE_THREADS, 0))
    launch = _fast_launch(plan, splits, q, [(k.func_ptr, *grid, block, 1, 1, smem) for k, grid, block, smem in heads],
                          params)
    # cuLaunchKernel uses the calling thread's current context: make it the arrays' device.
    with _cupy.cuda.Device(plan.device):
        launch.run(stream_ptr)
    del keep  # the framework allocator keeps stream order: freeing after enqueueing is safe
    return launch
