"""Launching the Hopper forward family on validated views (the lead's `forward` wires it in).

`plan_sm90` runs the library's validation (cupyflash.validation.check_forward_args, the same
rules and messages as `forward`), then the family's own rules; `launch_sm90` encodes the TMA
descriptors (cached), packs `HopperForwardParams` and launches. `forward_sm90` is the whole call
on CuPy / PyTorch / DLPack arrays, for tests and benchmarks until `forward(cfg=None)` picks this
family on Hopper.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

from ...interop import (TensorView, allocate_lse, allocate_output, as_view, output_view, resolve_stream,
                        wrap_output)
from ...validation import LaunchPlan, check_forward_args, check_lse_out, check_lse_request
from ..forward_sm80 import config_sets as sm80_config_sets
from . import tma
from .config import D_HEADS, HopperForwardKernelConfig
from .config_sets import default_config
from .params import operand_encoder, pack_params

__all__ = ["Sm90Plan", "auto_config", "cluster_padded", "plan_sm90", "launch_sm90", "forward_sm90",
           "unsupported_reason", "get_kernel", "pack_sm90", "make_repack"]


class Sm90Plan(NamedTuple):
    cfg: HopperForwardKernelConfig
    base: LaunchPlan  # the validated problem (strides, lengths, scale, device, causal)

    sm_count: int = 0  # SMs of the device (persistent grids); 0 = not known (CPU planning)

    @property
    def n_tiles(self) -> int:
        return -(-self.base.seq_len_q // self.cfg.B_r) * self.base.n_heads * self.base.out_shape[0]

    @property
    def n_work_units(self) -> int:
        """What a persistent CTA takes at a time: a tile, or under causal masking a pair of one
        head's query blocks (tile_scheduler.cuh)."""
        if not self.base.causal:
            return self.n_tiles
        q_blocks = -(-self.base.seq_len_q // self.cfg.B_r)
        return (q_blocks + 1) // 2 * self.base.n_heads * self.base.out_shape[0]

    @property
    def grid(self) -> tuple[int, int, int]:
        if self.cfg.persistent:  # one CTA per SM (these kernels fit one per SM), never more than work units
            return (max(1, min(self.n_work_units, self.sm_count or self.n_work_units)), 1, 1)
        return (cluster_padded(self.cfg, -(-self.base.seq_len_q // self.cfg.B_r)), self.base.n_heads,
                self.base.out_shape[0])


def cluster_padded(cfg: HopperForwardKernelConfig, query_blocks: int) -> int:
    """A non-persistent grid's x extent: the query blocks, padded to whole clusters for `cluster`
    configs (the pad's CTA computes rows past the end, or leaves: tile_scheduler.cuh)."""
    return query_blocks + query_blocks % 2 if cfg.cluster else query_blocks


def unsupported_reason(q: TensorView, k: TensorView, v: TensorView) -> str | None:
    """Why this family cannot run a validated problem (the mma.sync family then takes it), or None."""
    d = q.shape[3]
    if d not in D_HEADS:
        return f"q: d_head {d} is not supported by forward_sm90 (supported: {D_HEADS})"
    for view, name in ((q, "q"), (k, "k"), (v, "v")):
        problem = tma.tma_layout_problem(name, view.shape, view.strides)
        if problem:
            return problem
    return None


@functools.lru_cache(maxsize=64)
def _stand_in_config(dtype, d_head: int, *_):
    """The mma.sync default for (dtype, d_head): check_forward_args's config argument only
    matters for its dtype and d_head (cached: building a config costs ~10 us per call)."""
    return sm80_config_sets.default_config(dtype, d_head)


def plan_sm90(cfg: HopperForwardKernelConfig | None, q: TensorView, k: TensorView, v: TensorView,
              out: TensorView | None = None, softmax_scale: Any = None, causal: Any = False) -> Sm90Plan:
    """Validate as `forward` does, then apply this family's rules; ValueError naming the argument."""
    if cfg is not None and not isinstance(cfg, HopperForwardKernelConfig):
        raise TypeError(f"cfg: expected a HopperForwardKernelConfig or None, got {type(cfg).__name__}")
    # The shared validation checks shapes, dtypes, devices, layouts and the scale.
    base = check_forward_args(None, q, k, v, out, softmax_scale, causal, select=_stand_in_config)
    reason = unsupported_reason(q, k, v)
    if reason:
        raise ValueError(reason)
    if cfg is None:
        cfg = auto_config(q.dtype, q.shape[3], base.seq_len_q, base.seq_len_k, base.device, base.causal)
    if cfg.dtype is not q.dtype:
        raise ValueError(f"cfg: config dtype {cfg.dtype.name} does not match the inputs' dtype {q.dtype.name}")
    if cfg.d_head != q.shape[3]:
        raise ValueError(f"cfg: config d_head {cfg.d_head} does not match the inputs' d_head {q.shape[3]}")
    return Sm90Plan(cfg, base, _sm_count(base.device) if cfg.persistent else 0)


def auto_config(dtype, d_head: int, seq_len_q: int, seq_len_k: int, device: int,
                causal: bool) -> HopperForwardKernelConfig:
    """This family's choice for cfg=None: the user's or the shipped tuning table for the device
    (`cupyflash autotune --family forward_sm90`), else the measured default for (d_head, causal).
    Both lookups are cached."""
    from ...tuning import tuned_config

    tuned = tuned_config(dtype, d_head, seq_len_q, seq_len_k, device, causal, "forward_sm90")
    return tuned if tuned is not None else default_config(dtype, d_head, causal)


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    """SMs of `device`; 0 where it cannot be asked (no GPU: planning on a CPU)."""
    try:
        import cupy

        return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    except Exception:
        return 0


# ------------------------------------------------------------------------------ kernels
def get_kernel(cfg: HopperForwardKernelConfig, device: int, causal: bool):
    """The loaded kernel of (cfg, causal) on `device`, through the library's registry and cache
    (compiled for sm_90a on first use; the registry raises the shared-memory limit)."""
    from ...registry import get_registry

    return get_registry().get(cfg, device, causal)  # the dense variant: (causal, varlen=False)


# ------------------------------------------------------------------------------ launch
def make_repack(plan: Sm90Plan, q: TensorView, k: TensorView, v: TensorView) -> Callable[..., bytes]:
    """`repack(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr=0)` -> HopperForwardParams for new pointers of
    these layouts: the per-call half of the packing (each descriptor a lookup in tma's cache; a
    cp_async config packs plain pointer-and-strides records instead)."""
    cfg, b = plan.cfg, plan.base
    dtype, descriptor = cfg.dtype, operand_encoder(cfg)  # tensor maps, or plain records for cp_async
    (qs, qst), (ks, kst), (vs, vst) = ((x.shape, x.strides) for x in (q, k, v))
    tail = (*b.o_strides, b.seq_len_q, b.seq_len_k, b.n_heads, b.n_kv_heads, b.softmax_scale, b.softmax_scale_log2,
            b.kv_group_size, b.out_shape[0], 0, 0, 0)

    def repack(q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, lse_ptr: int = 0) -> bytes:
        return pack_params(descriptor(q_ptr, dtype, qs, qst, cfg.B_r), descriptor(k_ptr, dtype, ks, kst, cfg.B_c),
                           descriptor(v_ptr, dtype, vs, vst, cfg.B_c), o_ptr, lse_ptr, 0, 0, *tail)

    return repack


def pack_sm90(plan: Sm90Plan, q: TensorView, k: TensorView, v: TensorView, o_ptr: int, lse_ptr: int) -> bytes:
    """HopperForwardParams for one call: the three (cached) descriptors, then the scalars."""
    return make_repack(plan, q, k, v)(q.ptr, k.ptr, v.ptr, o_ptr, lse_ptr)


def launch_sm90(plan: Sm90Plan, q: TensorView, k: TensorView, v: TensorView, o: TensorView,
                stream_ptr: int, lse_ptr: int = 0) -> None:
    """Launch a validated plan (nothing to do for an empty problem)."""
    if not plan.base.launch:
        return
    import cupy

    kernel = get_kernel(plan.cfg, plan.base.device, plan.base.causal)
    params = pack_sm90(plan, q, k, v, o.ptr, lse_ptr)
    cfg = plan.cfg
    if cupy.cuda.runtime.getDevice() == plan.base.device:
        kernel.launch(plan.grid, cfg.n_threads, cfg.smem_bytes(), stream_ptr, params)
    else:
        with cupy.cuda.Device(plan.base.device):
            kernel.launch(plan.grid, cfg.n_threads, cfg.smem_bytes(), stream_ptr, params)


def forward_sm90(cfg: Any, q: Any, k: Any, v: Any, out: Any = None, *, softmax_scale: float | None = None,
                 causal: bool = False, return_lse: bool = False, lse: Any = None, stream: Any = None) -> Any:
    """`cupyflash.forward` with this family's kernel (same arguments and results; `cfg` a
    HopperForwardKernelConfig, its short form, or None for the family default)."""
    if isinstance(cfg, str):
        try:
            cfg = HopperForwardKernelConfig.parse(cfg)
        except ValueError as exc:
            raise ValueError(f"cfg: {exc}") from None
    qv, kv, vv = as_view(q, "q"), as_view(k, "k"), as_view(v, "v")
    ov = output_view(out) if out is not None else None
    plan = plan_sm90(cfg, qv, kv, vv, ov, softmax_scale, causal)
    want_lse = check_lse_request(return_lse, lse is not None)
    lv = None
    if lse is not None:
        lv = output_view(lse, "lse")
        check_lse_out(lv, plan.base)
    stream_ptr = resolve_stream(stream, qv)
    if ov is None:
        ov = allocate_output(qv, plan.base.out_shape)
    if want_lse and lv is None:
        lv = allocate_lse(qv, plan.base.lse_shape)
    launch_sm90(plan, qv, kv, vv, ov, stream_ptr, lv.ptr if lv is not None else 0)
    result = out if out is not None else wrap_output(ov)
    if want_lse:
        return result, (lse if lse is not None else wrap_output(lv))
    return result

