"""`cupyflash.forward_varlen`: attention over packed ragged batches (FlashAttention's
`flash_attn_varlen_func`).

Sequences of different lengths are packed token after token into (total_tokens, heads, d_head)
arrays and described by cumulative offsets, so no padding is stored or computed. One launch of a
forward family's varlen variant: each CTA reads its sequence's offsets from `cu_seqlens_*` on the
GPU, and the grid is sized from `max_seqlen_q` (a host int), so a call reads no device value on
the host and can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
import math
import os
import struct
from typing import Any, Callable, NamedTuple

from .families.forward_sm80 import FORWARD_SM80
from .families.forward_sm80.config import FlashForwardKernelConfig
from .families.forward_sm80.params import pack_params
from .families.forward_sm90 import FORWARD_SM90, HopperForwardKernelConfig
from . import op_launch, varlen_plans
from .launch_plans import current_stream_reader, lse_allocator
from .interop import (TORCH, _cupy, allocate_lse, allocate_output, as_view, host_copy, output_view, resolve_stream,
                      wrap_output)
from .validation import (CHECKED_DEVICES, check_device_once, check_lse_out, check_lse_request,
                         index_check_requested)
from .varlen_checks import VarlenProblem, check_index_values, check_varlen_args

__all__ = ["forward_varlen", "pack_varlen_sm80", "pack_varlen_sm90"]

# q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k: the first seven ForwardParams fields
_SM80_POINTERS = struct.Struct("<7Q")

_get_registry = None


def _hopper_reason(problem: VarlenProblem, q, k, v) -> str | None:
    """Why the Hopper family cannot run this varlen call (the mma.sync family then does), or None."""
    from .api import _compute_capability
    from .families.forward_sm90 import tma
    from .families.forward_sm90.config import D_HEADS

    cc = _compute_capability(problem.device)
    if cc != 90:
        return f"device {problem.device} has compute capability {cc // 10}.{cc % 10}, not 9.0"
    if problem.d_head not in D_HEADS:
        return f"q: d_head {problem.d_head} is not supported by {FORWARD_SM90.name} (supported: {D_HEADS})"
    if not problem.total_k:
        return "k: no keys at all (a TMA tensor map needs at least one row)"
    for view, name in ((q, "q"), (k, "k"), (v, "v")):
        reason = tma.tma_layout_problem(name, _as_4d(view.shape), _as_4d_strides(view.strides))
        if reason:
            return reason
    return None


def _as_4d(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A packed (tokens, heads, d) array as forward's (batch, seq, heads, d) with one 'batch'."""
    return (1, *shape)


def _as_4d_strides(strides: tuple[int, ...]) -> tuple[int, int, int, int]:
    return (0, *strides)  # the batch extent is 1: its stride is never used


def _resolve_config(cfg: Any, problem: VarlenProblem, q, k, v) -> FlashForwardKernelConfig | HopperForwardKernelConfig:
    """The config for this call: `cfg` (a forward family's config or short form) checked against
    the inputs, or for None/'auto' the Hopper family on sm_90 where its TMA layout rules hold
    (its default for dtype, d_head and causal), else forward()'s tuned mma.sync pick for the
    longest sequences."""
    from .api import _forward_config, _parse_config, _select_config

    if isinstance(cfg, str):
        cfg = _parse_config(cfg)
    elif cfg is not None:
        cfg = _forward_config(cfg)  # ValueError naming another family
    if cfg is None:
        if _hopper_reason(problem, q, k, v) is None:
            from .families.forward_sm90.config_sets import varlen_default_config

            return varlen_default_config(problem.dtype, problem.d_head, problem.causal)
        return _select_config(problem.dtype, problem.d_head, problem.max_seqlen_q, problem.max_seqlen_k,
                              problem.device, problem.causal)
    if cfg.dtype is not problem.dtype:
        raise ValueError(f"cfg: config dtype {cfg.dtype.name} does not match the inputs' dtype {problem.dtype.name}")
    if cfg.d_head != problem.d_head:
        raise ValueError(f"cfg: config d_head {cfg.d_head} does not match the inputs' d_head {problem.d_head}")
    if type(cfg) is HopperForwardKernelConfig:
        reason = _hopper_reason(problem, q, k, v)
        if reason:
            raise ValueError(f"cfg: {cfg} (family {FORWARD_SM90.name}) cannot run this call: {reason}")
    return cfg


def pack_varlen_sm80(problem: VarlenProblem, q: int, k: int, v: int, o: int, lse: int, cu_q: int,
                     cu_k: int, zero_tail: bool = False) -> bytes:
    """ForwardParams of the varlen variant: batch strides 0 (the kernel offsets by tokens), the
    seq_len fields the longest lengths (unused by the kernel), lse_head_stride = total_q;
    `zero_tail`: the kernel zeroes o's rows and lse's columns past the last sequence."""
    return pack_params(q, k, v, o, lse, cu_q, cu_k, problem.total_q if zero_tail else 0,
                       0, problem.q_strides[0], problem.q_strides[1],
                       0, problem.k_strides[0], problem.k_strides[1],
                       0, problem.v_strides[0], problem.v_strides[1],
                       0, problem.o_strides[0], problem.o_strides[1],
                       problem.max_seqlen_q, problem.max_seqlen_k, problem.n_heads, problem.n_kv_heads,
                       problem.softmax_scale, problem.softmax_scale_log2, problem.kv_group_size, problem.total_q)


def forward_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                   max_seqlen_k: int, *, causal: bool = False, softmax_scale: float | None = None,
                   return_lse: bool = False, out: Any = None, lse: Any = None, stream: Any = None,
                   cfg: Any = None, check_indices: bool | None = None) -> Any:
    """Attention over a packed batch of sequences of different lengths.

    Sequence b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] and its keys/values
    k/v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]; each sequence attends only to its own keys, and no
    value of another sequence, nor of the tokens past the last one (which may hold anything, NaN
    included), reaches its results.

    Args:
        q: (total_q, n_heads, d_head) fp16 or bf16, d_head one of config.SUPPORTED_D_HEADS.
        k, v: (total_k, n_kv_heads, d_head), same dtype; n_heads a multiple of n_kv_heads (GQA/MQA:
            q head h reads k/v head h // (n_heads // n_kv_heads)). Last dimension contiguous,
            token and head strides multiples of 8 elements (16-byte aligned rows), else free.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 on q's device: 0, then the running total
            of each sequence's length. Empty sequences (equal neighbours) are allowed: a sequence
            with queries but no keys gets output 0 and lse -inf.
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest query / key sequence.
            They size the grid; a max_seqlen_q below the true longest leaves rows unwritten.
        causal: a bool. True masks key j for query i unless j <= i + len_k - len_q, per sequence
            (bottom-right aligned, as in `forward` and FlashAttention >= 2.1).
        softmax_scale: default 1 / sqrt(d_head).
        return_lse: a bool. True returns (out, lse), lse the float32 (n_heads, total_q)
            natural-log log-sum-exp of each row (FlashAttention's varlen layout). Tokens past
            cu_seqlens_q[-1] belong to no sequence: their out and lse rows are not written.
        out: optional (total_q, n_heads, d_head) array of q's dtype to write into (not a JAX array).
        lse: optional C-contiguous float32 (n_heads, total_q) array to write the log-sum-exp into
            (needs return_lse=True; not a JAX array); returned as given.
        stream: default the caller's current stream (PyTorch's for torch tensors, CuPy's
            otherwise); or a cupy/torch stream or an int handle.
        cfg: a config of a forward family (forward_sm80: mma.sync, sm_80+; forward_sm90:
            wgmma/TMA, sm_90), its short form, or None / 'auto': on Hopper the forward_sm90 family
            where its TMA rules hold (positive strides below 2**40 bytes), else forward_sm80's
            tuned pick for max_seqlen_q/k.
        check_indices: a bool, or None to follow CUPYFLASH_CHECK_INDICES=1. The offsets live on
            the GPU and are NOT checked per call by default; with the check on they are copied
            to the host (a synchronisation: not inside graph capture) and validated against the
            packed arrays and max_seqlen_q/k, raising ValueError naming the argument instead of
            reading out of bounds.

    Returns:
        out (a new array in q's framework unless `out` was given), or (out, lse).
    """
    key = None
    if (lse is None and check_indices is None and (return_lse is False or return_lse is True)
            and not os.environ.get("CUPYFLASH_CHECK_INDICES")):
        key = varlen_plans.signature(cfg, softmax_scale, causal, return_lse, max_seqlen_q, max_seqlen_k, q, k, v,
                                     cu_seqlens_q, cu_seqlens_k, out)
        result = varlen_plans.lookup(key, q, k, v, cu_seqlens_q, cu_seqlens_k, out, stream)
        if result is not None:
            return result
    result, launch = _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                     softmax_scale, return_lse, out, lse, stream, cfg, check_indices, key is not None)
    if launch is not None:
        varlen_plans.remember(key, launch)
    return result


def _forward_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                    max_seqlen_k: int, causal: bool, softmax_scale: float | None, return_lse: bool, out: Any,
                    lse: Any, stream: Any, cfg: Any, check_indices: bool | None, keep: bool,
                    zero_tail: bool = False) -> tuple[Any, varlen_plans.VarlenLaunch | None]:
    """forward_varlen's full path: validation, config choice, launch. Returns (its result, the
    call's replayable launch when `keep` and the call launched without the index check, else
    None). `zero_tail` (cupyflash.jax, whose output buffers come uninitialised): the tokens past
    cu_seqlens_q[-1] get out 0 and lse 0, from the kernel (or a memset when nothing launches)."""
    qv = as_view(q, "q")
    if qv.device not in CHECKED_DEVICES:
        check_device_once(qv.device)
    kv = as_view(k, "k")
    vv = as_view(v, "v")
    cqv = as_view(cu_seqlens_q, "cu_seqlens_q")
    ckv = as_view(cu_seqlens_k, "cu_seqlens_k")
    ov = output_view(out) if out is not None else None
    problem = check_varlen_args(qv, kv, vv, cqv, ckv, max_seqlen_q, max_seqlen_k, ov, softmax_scale, causal)
    want_lse = check_lse_request(return_lse, lse is not None)
    config = _resolve_config(cfg, problem, qv, kv, vv)
    checked = index_check_requested(check_indices)
    if checked:
        check_index_values(problem, host_copy(cqv), host_copy(ckv))
    stream_ptr = resolve_stream(stream, qv)
    if ov is None:
        ov = allocate_output(qv, problem.out_shape)
    if lse is not None:
        lv = output_view(lse, "lse")
        check_lse_out(lv, problem, "(n_heads, total_q)")
    else:
        lv = allocate_lse(qv, problem.lse_shape) if want_lse else None
    replayable = None
    if not problem.empty:
        prepared = _prepare(problem, config, qv, kv, vv, zero_tail)
        with _cupy.cuda.Device(problem.device):
            params = prepared.launch(stream_ptr, qv.ptr, kv.ptr, vv.ptr, ov.ptr, lv.ptr if lv is not None else 0,
                                     cqv.ptr, ckv.ptr)
        if keep and not checked:
            replayable = _fast_launch(problem, qv, want_lse, prepared.head, params, prepared.writer)
    elif zero_tail:
        with _cupy.cuda.Device(problem.device):
            zero_outputs(problem, ov.ptr, lv.ptr if lv is not None else 0, stream_ptr)
    result = out if out is not None else wrap_output(ov)
    if want_lse:
        return (result, (lse if lse is not None else wrap_output(lv))), replayable
    return result, replayable


def zero_outputs(problem: VarlenProblem, o_ptr: int, lse_ptr: int, stream_ptr: int) -> None:
    """zero_tail for a problem with nothing to launch (no sequence, no query row): every token is
    past the last sequence, so the contiguous out (and lse, when lse_ptr) get 0 by memsets on the
    launch stream (capturable into a CUDA graph; the caller holds the device current)."""
    for ptr, shape, itemsize in ((o_ptr, problem.out_shape, 2), (lse_ptr, problem.lse_shape, 4)):
        nbytes = itemsize * math.prod(shape)
        if ptr and nbytes:
            _cupy.cuda.runtime.memsetAsync(ptr, 0, nbytes, stream_ptr)


class PreparedKernel(NamedTuple):
    """One problem's varlen kernel, compiled and loaded, with everything its launches need but the
    seven pointers (q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)."""

    kernel: Any                                  # registry.LoadedKernel
    grid: tuple[int, int, int]
    block: int
    smem: int
    repack: Callable[..., bytes]                 # (seven pointers) -> the parameter block
    template: bytes                              # a block whose every field but the pointers is packed
    writer: Callable[[Any], Callable[..., None]]  # writer(buf)(seven pointers): store them into buf

    @property
    def head(self) -> tuple:
        """cuLaunchKernel's arguments up to the stream."""
        return (self.kernel.func_ptr, *self.grid, self.block, 1, 1, self.smem)

    def launch(self, stream_ptr: int, *ptrs: int) -> bytes:
        """Pack the block for these pointers and launch on `stream_ptr` (the device current); the block."""
        params = self.repack(*ptrs)
        self.kernel.launch(self.grid, self.block, self.smem, stream_ptr, params)
        return params


def _prepare(problem: VarlenProblem, config: Any, q, k, v, zero_tail: bool) -> PreparedKernel:
    """The config's family's varlen kernel for `problem`, launching nothing (q, k, v: views of the
    arrays' layouts; their pointers are not read)."""
    global _get_registry
    if _get_registry is None:
        from .registry import get_registry as _get_registry
    if type(config) is HopperForwardKernelConfig:
        return _prepare_sm90(problem, config, q, k, v, zero_tail)
    return _prepare_sm80(problem, config, zero_tail)


def prepared_launch(problem: VarlenProblem, q, k, v, with_lse: bool) -> varlen_plans.VarlenLaunch | None:
    """cupyflash.jax's varlen forward for a problem validated on views of the traced shapes (q, k,
    v: their pointers are not read): forward_varlen(cfg=None)'s config, its kernel compiled and
    loaded, and the launch (zero_tail: XLA's buffers come uninitialised) that `replay` relaunches
    on each run's pointers; launching nothing now. None for a problem with nothing to launch
    (zero_outputs covers it)."""
    if problem.device not in CHECKED_DEVICES:
        check_device_once(problem.device)
    if problem.empty:
        return None
    prepared = _prepare(problem, _resolve_config(None, problem, q, k, v), q, k, v, True)
    # replay only: no allocators and no current-stream reader (the caller passes XLA's stream)
    return varlen_plans.VarlenLaunch(prepared.head, problem.device, prepared.template, problem.out_shape,
                                     tuple(problem.lse_shape) if with_lse else None, None, None, None,
                                     prepared.writer)


def _prepare_sm80(problem: VarlenProblem, cfg: FlashForwardKernelConfig, zero_tail: bool) -> PreparedKernel:
    """The mma.sync family's varlen kernel: the seven pointers are ForwardParams' first fields."""
    kernel = _get_registry().get(cfg, problem.device, variant=FORWARD_SM80.variant(causal=problem.causal, varlen=True))
    grid = (-(-problem.max_seqlen_q // cfg.B_r), problem.n_heads, problem.batch)

    def repack(q: int, k: int, v: int, o: int, lse: int, cq: int, ck: int) -> bytes:
        return pack_varlen_sm80(problem, q, k, v, o, lse, cq, ck, zero_tail)

    def writer(buf: Any) -> Callable[..., None]:
        return functools.partial(_SM80_POINTERS.pack_into, buf, 0)  # every other field as packed

    return PreparedKernel(kernel, grid, cfg.n_warps * 32, cfg.smem_bytes(), repack, repack(0, 0, 0, 0, 0, 0, 0),
                          writer)


def pack_varlen_sm90(cfg: HopperForwardKernelConfig, problem: VarlenProblem, q, k, v, o: int, lse: int,
                     cu_q: int, cu_k: int, zero_tail: bool = False) -> bytes:
    """HopperForwardParams of the varlen variant: tensor maps over the packed arrays as one
    'batch' of total tokens (tiles address tokens cu_seqlens[b] + row), o's batch stride 0;
    `zero_tail` as pack_varlen_sm80's."""
    from .families.forward_sm90.params import operand_encoder, pack_params as pack_sm90_params

    dtype, encode = cfg.dtype, operand_encoder(cfg)  # tensor maps, or plain records for cp_async configs
    descriptors = [encode(x.ptr, dtype, _as_4d(x.shape), _as_4d_strides(x.strides), rows)
                   for x, rows in ((q, cfg.B_r), (k, cfg.B_c), (v, cfg.B_c))]
    return pack_sm90_params(*descriptors, o, lse, cu_q, cu_k, 0, problem.o_strides[0], problem.o_strides[1],
                            problem.max_seqlen_q, problem.max_seqlen_k, problem.n_heads, problem.n_kv_heads,
                            problem.softmax_scale, problem.softmax_scale_log2, problem.kv_group_size, problem.batch,
                            problem.total_q, problem.total_q if zero_tail else 0, problem.total_k)


def _prepare_sm90(problem: VarlenProblem, cfg: HopperForwardKernelConfig, q, k, v,
                  zero_tail: bool) -> PreparedKernel:
    """The Hopper family's varlen kernel: the pointers are embedded in its TMA descriptors."""
    from .families.forward_sm90.launch import _sm_count, cluster_padded
    from .families.forward_sm90.params import PARAMS_SIZE

    kernel = _get_registry().get(cfg, problem.device, variant=FORWARD_SM90.variant(causal=problem.causal, varlen=True))
    q_blocks = -(-problem.max_seqlen_q // cfg.B_r)
    if cfg.persistent:  # tiles past a sequence's end are skipped by the scheduler
        tiles = q_blocks * problem.n_heads * problem.batch
        grid = (max(1, min(tiles, _sm_count(problem.device) or tiles)), 1, 1)
    else:
        grid = (cluster_padded(cfg, q_blocks), problem.n_heads, problem.batch)
    qs, ks, vs = (x._replace(base=None) for x in (q, k, v))  # the plan must not keep this call's arrays alive

    def repack(q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, lse_ptr: int, cq: int, ck: int) -> bytes:
        # the descriptors embed the pointers: each a lookup in tma's cache (encoded on a miss)
        return pack_varlen_sm90(cfg, problem, qs._replace(ptr=q_ptr), ks._replace(ptr=k_ptr),
                                vs._replace(ptr=v_ptr), o_ptr, lse_ptr, cq, ck, zero_tail)

    template, writer = op_launch.embedded_pointers(repack, PARAMS_SIZE, 7)
    return PreparedKernel(kernel, grid, cfg.n_threads, cfg.smem_bytes(), repack, template, writer)


def sm90_writer(repack: Callable[..., bytes], size: int) -> Callable[[Any], Callable[..., None]]:
    """writer(buf) -> write(q, k, v, o, lse, cu_q, cu_k) for a Hopper varlen plan, `repack(q, k,
    v, o, lse, cu_q, cu_k)` being its parameter packer (op_launch.embedded_pointers)."""
    return op_launch.embedded_pointers(repack, size, 7)[1]


def _fast_launch(problem: VarlenProblem, q, want_lse: bool, head: tuple, params: bytes,
                 writer: Callable[[Any], Callable[..., None]]) -> varlen_plans.VarlenLaunch:
    """The replayable form of a validated call, for later calls with the same signature."""
    device = problem.device
    is_torch = q.framework == TORCH
    lse_shape = tuple(problem.lse_shape) if want_lse else None
    # torch: q.new_empty(out_shape) on each call's own q
    allocate = None if is_torch else functools.partial(_cupy.empty, problem.out_shape, dtype=q.raw_dtype)
    allocate_lse = lse_allocator(is_torch, device, lse_shape) if want_lse else None
    return varlen_plans.VarlenLaunch(head, device, params, problem.out_shape, lse_shape, allocate, allocate_lse,
                                     current_stream_reader(is_torch, device), writer)
