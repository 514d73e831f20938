"""Replayable forward launches for the framework operators (cupyflash.torch, cupyflash.jax).

`forward`'s own fast path (launch_plans) covers calls without a log-sum-exp; the framework
operators also need the lse variant (autograd saves it) and, in JAX, buffers whose pointers only
exist inside XLA's callback. Both build, once per problem signature, a `FastLaunch` whose
parameter block holds everything but five pointers (q, k, v, out, lse), for the kernel that
`forward(cfg=None)` would run: the Hopper family where it applies (its TMA descriptors re-packed
from each call's pointers), else the mma.sync family (five pointers written into the first five
ForwardParams fields).
"""
from __future__ import annotations

import ctypes
import functools
import struct
from typing import Any, Callable

from . import launch_plans
from .interop import TensorView
from .validation import LaunchPlan

__all__ = ["POINTERS", "MAX_POINTERS", "OpLaunch", "pointer_words", "address_offsets", "address_writer", "hopper_plan", "leading_writer", "plan_views",
           "make_launch", "repack_writer", "embedded_pointers"]

POINTERS = struct.Struct("<5Q")  # q, k, v, o, lse: the first five ForwardParams fields


def hopper_plan(q: TensorView, k: TensorView, v: TensorView, causal: bool, softmax_scale: float | None,
                device: int) -> tuple[Any, tuple[TensorView, ...]] | None:
    """(Sm90Plan, views) when forward(cfg=None) would run the Hopper family on this problem
    (sm_90 and a layout TMA takes), else None (the mma.sync plan)."""
    from . import api

    if not api._hopper_default(device):
        return None
    views = (q, k, v)
    if api._hopper_reason(*views) is not None:
        return None
    from .families.forward_sm90.launch import plan_sm90

    return plan_sm90(None, *views, None, softmax_scale, causal), views


def plan_views(q: TensorView, k: TensorView, v: TensorView, causal: bool,
               softmax_scale: float | None) -> tuple[LaunchPlan, Any]:
    """forward(cfg=None)'s plan for validated views: (the mma.sync LaunchPlan, (Sm90Plan, views)
    or None). Raises forward's TypeError/ValueError on bad arguments."""
    from . import api

    plan = api.plan_forward(None, q, k, v, None, softmax_scale, causal)
    return plan, hopper_plan(q, k, v, plan.causal, softmax_scale, plan.device)


class OpLaunch(launch_plans.FastLaunch):
    """The operators' FastLaunch; its `write_pointers(q, k, v, o, lse)` puts one call's five
    pointers into its parameter block (hold `lock` around it and the launch)."""

    __slots__ = ()


def leading_writer(buf: Any) -> Any:
    """write_pointers for kernels whose five pointers are the block's first fields (mma.sync)."""
    return functools.partial(POINTERS.pack_into, buf, 0)


_WORD = struct.Struct("<Q")
# Distinct, 16-byte aligned stand-in addresses with low and high bits set, fourteen per set (the
# forward kernels' q, k, v, o, lse and the varlen kernels' cu_seqlens_q/k; the backward's q, k,
# v, out, dout, lse, dq, dk, dv, its three workspaces and the varlen cu_seqlens_q/k); never
# dereferenced: they only go through the parameter packs and cuTensorMapEncodeTiled.
_PROBES = ((0x1_0000_0000, 0x2_0000_0100, 0x3_0000_0200, 0x4_0000_0300, 0x5_0000_0400, 0x6_0000_0500,
            0x7_0000_0600, 0x8_0000_0700, 0x9_0000_0800, 0xA_0000_0900, 0xB_0000_0A00, 0xC_0000_0B00,
            0xD_0000_0C00, 0xE_0000_0D00),
           (0x7F12_3456_7800, 0x7F00_0000_0010, 0x1_0000_0020, 0x2000_0000_0030, 0x40, 0x7E00_1111_0050,
            0x3_3333_3360, 0x6000_0000_0080, 0x7F12_0000_00A0, 0x55_0000_00B0, 0x3000_0000_00C0,
            0x7EFF_FFFF_FFD0, 0x7D00_0000_00E0, 0x4000_0000_00F0),
           (0x7FFF_FFFF_FFF0, 0x10, 0x5555_5555_5550, 0x2AAA_AAAA_AAA0, 0x1234_5670, 0x4444_0000_0070, 0x80,
            0x6666_6666_6660, 0x1000_0000_0000, 0x3_0000_00E0, 0x7777_7777_7770, 0xABC_DEF0, 0x5A5A_5A5A_5A50,
            0x123_4560),
           (0x100, 0x7F00_DEAD_BEE0, 0x3C00_0000_0000, 0x20, 0x7FFF_0000_0000, 0x90, 0x1_2345_6780,
            0x30, 0x7ABC_0000_0040, 0x1111_1111_1110, 0x60, 0x2468_ACE0_0000, 0x50, 0x6C00_0000_00A0))
MAX_POINTERS = len(_PROBES[0])


def pointer_words(repack: Any, size: int, count: int) -> tuple[tuple[tuple[int, ...], ...], bytes] | None:
    """Where each of `repack`'s `count` pointer arguments lands in its parameter block, if nothing
    else in the block depends on them: ((byte offsets of every 8-byte word holding pointer i, for
    each i), template), else None. A pointer may fill several words (the backward's outputs and
    workspaces appear in both of its parameter structs) but must fill at least one.

    The TMA descriptor format is opaque (CUtensorMap): this measures it instead of assuming it.
    The block is encoded for several sets of addresses; a pointer's words are those that hold
    exactly its value in the first two sets, and writing the words into the first block must give,
    byte for byte, the block the driver encodes for every other set. Otherwise (another driver,
    another format) the caller re-encodes per call."""
    if not 1 <= count <= MAX_POINTERS:
        raise ValueError(f"count: 1..{MAX_POINTERS} pointers, got {count}")
    probes = [probe[:count] for probe in _PROBES]
    try:
        blocks = [bytes(repack(*probe)) for probe in probes]
    except Exception:  # the driver refused a stand-in address: keep encoding per call
        return None
    if any(len(b) != size for b in blocks):
        return None
    offsets = []
    for i in range(count):
        found = tuple(off for off in range(0, size - 7, 8)
                      if all(_WORD.unpack_from(b, off)[0] == probe[i] for b, probe in zip(blocks[:2], probes[:2])))
        if not found:
            return None
        offsets.append(found)
    template = blocks[0]
    for block, probe in zip(blocks[1:], probes[1:]):
        patched = bytearray(template)
        for words, ptr in zip(offsets, probe):
            for off in words:
                _WORD.pack_into(patched, off, ptr)
        if bytes(patched) != block:
            return None
    return tuple(offsets), template


def address_offsets(repack: Any, size: int, count: int = 5) -> tuple[tuple[int, ...], bytes] | None:
    """pointer_words for blocks where each pointer fills exactly one word: ((byte offset per
    pointer), template), else None. For the forward kernels the pointers are q, k, v, o, lse; the
    varlen kernels add cu_seqlens_q/k."""
    found = pointer_words(repack, size, count)
    if found is None or any(len(words) != 1 for words in found[0]):
        return None
    return tuple(words[0] for words in found[0]), found[1]


def address_writer(buf: Any, offsets: tuple[int, ...]) -> Any:
    """write(q, k, v, o, lse) storing the five pointers at `offsets` of the block `buf`; with seven
    offsets write(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k) (the varlen kernels)."""
    # Item stores into a 64-bit view of the block: half the cost of five struct.pack_into calls.
    words = memoryview(buf).cast("B").cast("Q")
    q_at, k_at, v_at, o_at, lse_at = (offset // 8 for offset in offsets[:5])

    def write(q: int, k: int, v: int, o: int, lse: int) -> None:
        words[q_at] = q
        words[k_at] = k
        words[v_at] = v
        words[o_at] = o
        words[lse_at] = lse

    if len(offsets) == 5:
        return write
    cq_at, ck_at = (offset // 8 for offset in offsets[5:7])

    def write_varlen(q: int, k: int, v: int, o: int, lse: int, cq: int, ck: int) -> None:
        write(q, k, v, o, lse)
        words[cq_at] = cq
        words[ck_at] = ck

    return write_varlen


def repack_writer(buf: Any, repack: Any, size: int) -> Any:
    """write_pointers that re-packs the whole block (descriptors whose format hides the address)."""
    def write(*ptrs: int) -> None:
        ctypes.memmove(buf, repack(*ptrs), size)

    return write


def embedded_pointers(repack: Any, size: int, count: int = 5) -> tuple[bytes, Callable[[Any], Any]]:
    """(initial parameter block, buf -> write_pointers) for a block whose `count` pointers (5: q, k,
    v, o, lse; 7: and the varlen kernels' cu_seqlens_q/k) `repack` embeds (the Hopper family's TMA
    descriptors): the address words `address_offsets` found, with its template, or else a re-pack
    of the whole block per call (the initial block is then zeros, never launched as it is)."""
    found = address_offsets(repack, size, count)
    if found:
        return found[1], functools.partial(address_writer, offsets=found[0])
    return bytes(size), functools.partial(repack_writer, repack=repack, size=size)


def make_launch(plan: LaunchPlan, sm90: Any, device: int) -> OpLaunch:
    """The replayable launch of `plan` (or of the Hopper plan `sm90`) on `device`: kernel handle,
    grid and every parameter but the five pointers packed.

    The Hopper family's parameters embed the pointers in its TMA descriptors: when the driver's
    encoding puts the address in one word of each descriptor and nothing else depends on it
    (`address_offsets`, checked once per plan), a call writes five words, as for the mma.sync
    family; else it re-encodes the descriptors (tma's cache) and copies the whole block."""
    if sm90 is not None:
        from .families.forward_sm90.launch import get_kernel, make_repack
        from .families.forward_sm90.params import PARAMS_SIZE

        hopper, views = sm90
        cfg = hopper.cfg
        kernel = get_kernel(cfg, device, hopper.base.causal)
        params, writer = embedded_pointers(make_repack(hopper, *views), PARAMS_SIZE)
        fast = OpLaunch(kernel.func_ptr, hopper.grid, cfg.n_threads, cfg.smem_bytes(), device, params,
                        hopper.base.out_shape, None, None)
        fast.write_pointers = writer(fast.buf)
        return fast
    from .registry import get_registry

    kernel = get_registry().get(plan.cfg, device, plan.causal)
    fast = OpLaunch(kernel.func_ptr, plan.grid, plan.block, plan.smem_bytes, device, plan.pack(0, 0, 0, 0, 0),
                    plan.out_shape, None, None)
    fast.write_pointers = leading_writer(fast.buf)
    return fast
