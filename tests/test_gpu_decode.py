"""GPU tests of forward_kvcache against the SPEC §5 rule, per sequence, on a float64 reference:
seq_q 1/2/4/16, cache lengths 0, 1, page boundaries and ragged mixes, page sizes 16..256 with
shuffled page tables, GQA 1/4/8 and MQA, causal and not, every num_splits, LSE, k_new appended
into the cache, fp16/bf16, d_head 64/128/256, poisoned outputs, and a CUDA graph replayed over
changing cache_seqlens. Skipped cleanly without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.config import DType
from cupyflash.device import has_gpu
from cupyflash.families.decode.config import DecodeKernelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")]

if has_gpu():
    import cupy as cp

    import cupyflash
    from gpu_reference import check_attention, poisoned, random_inputs, to_float32


@pytest.fixture(scope="module", autouse=True)
def prewarmed_cache():
    """Compile the configs these tests use (every tile height of the defaults, both dtypes and
    head sizes, causal and not, each with the cache layout it serves) in parallel before the
    tests use them one at a time."""
    from cupyflash.device import device_arch
    from cupyflash.families.decode.config_sets import default_config
    from cupyflash.prewarm import prewarm

    arch, _ = device_arch(cp.cuda.runtime.getDevice())
    from cupyflash.families.decode.config import DecodeKernelConfig

    by_layout: dict[bool, set] = {False: set(), True: set()}  # paged -> configs
    for paged in (False, True):
        by_layout[paged] |= {default_config(dt, d, rows, paged) for dt in DType for d in (64, 128, 256)
                             for rows in (1, 32, 64)}
        # the wide-batch defaults of one-tile groups (the wide cases below and the bench's wide rows)
        by_layout[paged] |= {default_config(dt, d, 1, paged, wide=True) for dt in DType for d in (64, 128)}
    by_layout[False] |= {default_config(dt, 128, 4, wide=True, wave_heads=h) for dt in DType for h in (2, 4)}
    # the several-heads-per-CTA cases and the tune/progression picks (paged), so no test compiles alone
    for c in HEADS_CASES:
        by_layout[c[5] is not None] |= {DecodeKernelConfig(dt, d, 16, 16, c[3], c[4], False, c[2])
                                        for dt, d in ((DType.BF16, 128), (DType.FP16, 64))}
    by_layout[True] |= set(_tune_and_progression_picks())
    for paged in (False, True):
        by_layout[paged] |= {c.replace(dtype=dt) for c in INTERLEAVED + WAVES for dt in DType}
    results = []
    for paged, configs in by_layout.items():
        variants = [(causal, paged) for causal in (False, True)]
        results += prewarm(sorted(configs), [arch], variants=variants, progress=None).results
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]


@pytest.fixture
def rng():
    return np.random.default_rng()


# ----------------------------------------------------------------------------- problem builders
def bits(x):
    """The 16-bit patterns of an fp16/bf16 array: copies move bits, never convert values."""
    return x.view(cp.uint16)


class Problem:
    """A logical cache (batch, capacity, n_kv, d) and, when paged, its pages under a shuffled table."""

    def __init__(self, rng, dtype, d, batch, seq_q, n_heads, n_kv, lengths, page_size=None, seq_new=0,
                 capacity=None):
        self.dtype, self.d, self.batch, self.seq_q = dtype, d, batch, seq_q
        self.n_heads, self.n_kv, self.seq_new, self.page_size = n_heads, n_kv, seq_new, page_size
        self.lengths = np.asarray(lengths, dtype=np.int32)
        need = int((self.lengths + seq_new).max()) if batch else 1
        cap = capacity or max(need, 1)
        if page_size:
            cap = -(-cap // page_size) * page_size
        self.capacity = cap
        self.q = random_inputs(cp, dtype, (batch, seq_q, n_heads, d), rng)
        self.k_logical = random_inputs(cp, dtype, (batch, cap, n_kv, d), rng)
        self.v_logical = random_inputs(cp, dtype, (batch, cap, n_kv, d), rng)
        self.k_new = random_inputs(cp, dtype, (batch, seq_new, n_kv, d), rng) if seq_new else None
        self.v_new = random_inputs(cp, dtype, (batch, seq_new, n_kv, d), rng) if seq_new else None
        self.cache_seqlens = cp.asarray(self.lengths)
        if page_size:
            pages_per_seq = cap // page_size
            n_pages = batch * pages_per_seq + 3  # spare pages nobody uses
            perm = rng.permutation(n_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
            self.block_table = cp.asarray(perm.astype(np.int32))
            self.k_cache = random_inputs(cp, dtype, (n_pages, page_size, n_kv, d), rng)
            self.v_cache = random_inputs(cp, dtype, (n_pages, page_size, n_kv, d), rng)
            for b in range(batch):
                for j in range(pages_per_seq):
                    rows = slice(j * page_size, (j + 1) * page_size)
                    bits(self.k_cache)[int(perm[b, j])] = bits(self.k_logical)[b, rows]
                    bits(self.v_cache)[int(perm[b, j])] = bits(self.v_logical)[b, rows]
        else:
            self.block_table = None
            self.k_cache = bits(self.k_logical).copy().view(dtype.numpy_dtype)
            self.v_cache = bits(self.v_logical).copy().view(dtype.numpy_dtype)

    def run(self, **kw):
        out = poisoned(cp, self.dtype, self.q.shape)
        res = cupyflash.forward_kvcache(self.q, self.k_cache, self.v_cache, cache_seqlens=self.cache_seqlens,
                                        block_table=self.block_table, k_new=self.k_new, v_new=self.v_new,
                                        out=out, **kw)
        return res

    def settle_append(self) -> bool:
        """After a call that appended k_new / v_new (and was checked): later calls attend to the
        cache as it is now (the appended rows counted in the lengths, nothing left to append).
        False when there was nothing appended."""
        if not self.seq_new:
            return False
        self.k_logical, self.v_logical = self.logical_from_pages() if self.page_size else (self.k_cache, self.v_cache)
        self.k_new = self.v_new = None
        self.lengths = self.lengths + self.seq_new
        self.cache_seqlens = cp.asarray(self.lengths)
        self.seq_new = 0
        return True

    def logical_after_append(self):
        k, v = bits(self.k_logical).copy(), bits(self.v_logical).copy()
        for b in range(self.batch):
            n = int(self.lengths[b])
            if self.seq_new:
                k[b, n:n + self.seq_new] = bits(self.k_new)[b]
                v[b, n:n + self.seq_new] = bits(self.v_new)[b]
        return k.view(self.dtype.numpy_dtype), v.view(self.dtype.numpy_dtype)

    def logical_from_pages(self):
        """The logical (batch, capacity, n_kv, d) view of the paged cache's current contents."""
        pages = cp.asnumpy(self.block_table)
        k = cp.stack([cp.concatenate([bits(self.k_cache)[int(j)] for j in pages[b]]) for b in range(self.batch)])
        v = cp.stack([cp.concatenate([bits(self.v_cache)[int(j)] for j in pages[b]]) for b in range(self.batch)])
        return k.view(self.dtype.numpy_dtype), v.view(self.dtype.numpy_dtype)

    def check(self, out, lse=None, causal=True, scale=None, context=""):
        k, v = self.logical_after_append()
        figures = []
        for b in range(self.batch):
            n = int(self.lengths[b]) + self.seq_new
            where = f"{context} b={b} len={n}"
            if n == 0:  # no key at all: output 0, lse -inf
                assert bool((to_float32(cp, out[b]) == 0).all()), where
                if lse is not None:
                    assert bool(cp.isneginf(lse[b]).all()), where
                continue
            figures.append(check_attention(cp, self.dtype, self.q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n],
                                           out[b:b + 1], scale, causal=causal,
                                           lse=None if lse is None else lse[b:b + 1], context=where))
        return figures


# ----------------------------------------------------------------------------- the case matrix
# (dtype, d, batch, seq_q, n_heads, n_kv, lengths, page_size, seq_new, causal, num_splits)
B, F = DType.BF16, DType.FP16
CASES = [
    # decode (seq_q 1), GQA 4, ragged lengths including 0, 1 and page boundaries
    (B, 128, 6, 1, 32, 8, [0, 1, 15, 16, 17, 300], None, 0, True, None),
    (B, 128, 6, 1, 32, 8, [0, 1, 15, 16, 17, 300], 16, 0, True, None),
    (F, 128, 5, 1, 32, 8, [255, 256, 257, 1, 1000], 256, 0, False, 3),
    (B, 128, 3, 1, 8, 8, [4096, 37, 2049], 64, 0, True, None),        # MHA (ratio 1)
    (F, 128, 2, 1, 16, 2, [5000, 3], 32, 0, True, 7),                   # GQA 8
    (B, 128, 2, 1, 16, 1, [1234, 777], 128, 0, False, None),            # MQA
    # speculative / chunked: seq_q 2, 4, 16, causal bottom-right, several row tiles
    (B, 128, 3, 2, 32, 8, [0, 5, 600], 16, 0, True, None),
    (F, 128, 3, 4, 32, 8, [3, 100, 2000], None, 0, True, 5),
    (B, 128, 2, 16, 32, 8, [10, 3000], 16, 0, True, None),              # 64 rows: 2 row tiles of 32
    (B, 128, 2, 16, 8, 1, [20, 1500], 64, 0, True, 4),                  # MQA group 8 x 16 = 128 rows
    (F, 128, 2, 16, 32, 8, [40, 900], None, 0, False, None),
    # k_new appended (decode step and a chunk), contiguous and paged
    (B, 128, 4, 1, 32, 8, [0, 15, 16, 500], 16, 1, True, None),
    (F, 128, 3, 4, 32, 8, [0, 14, 700], 16, 4, True, 3),
    (B, 128, 2, 3, 16, 4, [1, 63], None, 3, True, None),
    # head sizes and dtypes
    (B, 64, 4, 1, 32, 8, [0, 1, 999, 4100], None, 0, True, None),
    (F, 64, 3, 4, 16, 4, [17, 256, 3333], 16, 2, True, None),
    (B, 64, 2, 16, 16, 4, [16, 2000], 32, 0, True, 6),                  # 64 rows in one tile
    (B, 256, 3, 1, 32, 8, [0, 1, 2500], None, 0, True, None),
    (F, 256, 3, 2, 8, 2, [31, 32, 1800], 16, 1, True, 9),
    (B, 256, 2, 16, 4, 4, [50, 700], 256, 0, True, None),
    # wide batches (>= one CTA per SM without splits on an H100: the 2-CTA-per-SM defaults), k_new
    (B, 128, 20, 1, 32, 8, [0, 1, 15, 16, 17, 300, 5, 64, 65, 1000] * 2, 16, 1, True, None),
    (F, 64, 20, 2, 16, 8, [3, 700, 31, 32, 0] * 4, None, 1, True, None),
    # every page size, shuffled
    *[(B, 128, 3, 1, 16, 4, [ps - 1, ps, 3 * ps + 5], ps, 0, True, 2) for ps in (16, 32, 64, 128, 256)],
]


def _case_id(c):
    dt, d, b, sq, h, hk, lens, ps, new, causal, ns = c
    return (f"{dt.name}-d{d}-b{b}-q{sq}-h{h}/{hk}-{'paged' + str(ps) if ps else 'contig'}-new{new}"
            f"-{'causal' if causal else 'full'}-s{ns}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kvcache_matches_reference(case, rng):
    dt, d, b, sq, h, hk, lens, ps, new, causal, ns = case
    p = Problem(rng, dt, d, b, sq, h, hk, lens, ps, new)
    out, lse = p.run(causal=causal, num_splits=ns, return_lse=True)
    p.check(out, lse, causal=causal, context=_case_id(case))


@pytest.mark.parametrize("paged", [False, True])
def test_every_num_splits_gives_the_same_result(paged, rng):
    p = Problem(rng, DType.BF16, 128, 3, 2, 16, 4, [0, 700, 2047], 16 if paged else None)
    outs = []
    for ns in (1, 2, 3, 5, 8, 17, 32, 64, 128):
        out, lse = p.run(num_splits=ns, return_lse=True)
        p.check(out, lse, context=f"num_splits={ns}")
        outs.append(to_float32(cp, out))
    spread = max(float(cp.abs(o - outs[0]).max()) for o in outs)
    assert spread <= 2 ** -7, spread  # at most a rounding step of bf16 at |O| < 1


@pytest.mark.parametrize("paged", [False, True])
def test_k_new_is_written_into_the_cache(paged, rng):
    p = Problem(rng, DType.FP16, 64, 3, 2, 8, 2, [0, 16, 45], 16 if paged else None, seq_new=2)
    k_before = bits(p.k_cache).copy()
    out = p.run()
    p.check(out)
    k_expect, v_expect = p.logical_after_append()
    if paged:
        got_k, got_v = p.logical_from_pages()
        used = set(int(j) for j in cp.asnumpy(p.block_table).reshape(-1))
        spare = [j for j in range(p.k_cache.shape[0]) if j not in used]
        assert bool((bits(p.k_cache)[spare] == k_before[spare]).all())
    else:
        got_k, got_v = p.k_cache, p.v_cache
    assert bool((got_k.view(cp.uint16) == k_expect.view(cp.uint16)).all())
    assert bool((got_v.view(cp.uint16) == v_expect.view(cp.uint16)).all())


def test_softmax_scale_and_cfg_short_form(rng):
    from cupyflash.families.decode.config_sets import default_config

    p = Problem(rng, DType.BF16, 128, 2, 1, 8, 2, [100, 2000], None)
    cfg = default_config(DType.BF16, 128).replace(stages=2)
    out = p.run(softmax_scale=0.05, cfg=cfg.short_form(), num_splits=3)
    p.check(out, scale=0.05)


def _tune_and_progression_picks():
    from cupyflash.families.decode.config_sets import get_kernel_configs

    tune = [c for c in get_kernel_configs("tune") if c.dtype is DType.BF16 and c.d_head == 128]
    prog = [c for c in get_kernel_configs("prog") if c.dtype is DType.BF16]
    return [prog[0], prog[1], tune[0], tune[len(tune) // 2], tune[-1], prog[-1]]


@pytest.mark.parametrize("cfg_index", range(6))
def test_tune_and_progression_configs(cfg_index, rng):
    """A spread of the tune and progression sets (each knob's code path) on one paged problem."""
    cfg = _tune_and_progression_picks()[cfg_index]
    p = Problem(rng, DType.BF16, 128, 2, 2, 16, 4, [333, 1900], 16)
    out = p.run(cfg=cfg, num_splits=3)
    p.check(out, context=str(cfg))


def test_torch_tensors_and_cuda_graph_replay(rng):
    """Capture one decode step (attention with the k_new append, then combine) in a CUDA graph,
    then replay it after changing cache_seqlens in place: each replay matches the reference."""
    torch = pytest.importorskip("torch")
    dt = DType.BF16
    p = Problem(rng, dt, 128, 4, 1, 32, 8, [10, 20, 30, 40], 16, seq_new=1, capacity=4096)
    def as_torch(x):  # bf16 through its bits: no reliance on DLPack's bfloat16 support
        return torch.from_dlpack(x.view(cp.uint16)).view(torch.bfloat16)

    tq, tk, tv, tkn, tvn = (as_torch(x) for x in (p.q, p.k_cache, p.v_cache, p.k_new, p.v_new))
    seqlens = torch.from_dlpack(p.cache_seqlens)
    table = torch.from_dlpack(p.block_table)
    out = torch.empty_like(tq)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles and loads the kernels outside the capture
        cupyflash.forward_kvcache(tq, tk, tv, cache_seqlens=seqlens, block_table=table, k_new=tkn, v_new=tvn,
                                  out=out, num_splits=4)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cupyflash.forward_kvcache(tq, tk, tv, cache_seqlens=seqlens, block_table=table, k_new=tkn, v_new=tvn,
                                  out=out, num_splits=4)
    for lengths in ([0, 100, 4000, 7], [4095, 1, 2, 3], [500, 501, 502, 16]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        p.lengths = np.asarray(lengths, dtype=np.int32)
        # the replayed append wrote k_new/v_new at the new positions of the paged cache; rebuild
        # the logical view from the pages to compare against
        p.k_logical, p.v_logical = p.logical_from_pages()
        p.check(cp.from_dlpack(out.view(torch.int16)).view(cp.uint16), context=f"replay {lengths}")


def test_index_check_is_opt_in(rng):
    p = Problem(rng, DType.BF16, 128, 2, 1, 8, 2, [10, 20], 16)
    bad = p.cache_seqlens.copy()
    bad[1] = p.capacity + 1
    with pytest.raises(ValueError, match="^cache_seqlens"):
        cupyflash.forward_kvcache(p.q, p.k_cache, p.v_cache, cache_seqlens=bad, block_table=p.block_table,
                                  check_indices=True)
    table = p.block_table.copy()
    table[0, 0] = 10_000
    with pytest.raises(ValueError, match="^block_table"):
        cupyflash.forward_kvcache(p.q, p.k_cache, p.v_cache, cache_seqlens=p.cache_seqlens, block_table=table,
                                  check_indices=True)
    out = cupyflash.forward_kvcache(p.q, p.k_cache, p.v_cache, cache_seqlens=p.cache_seqlens,
                                    block_table=p.block_table, check_indices=True)
    p.check(out)


# (n_heads, n_kv, heads per CTA, n_warps, stages, page size): whole and partial head blocks, teams
# of 1 and 2 warps, contiguous and paged
HEADS_CASES = [(32, 8, 8, 8, 2, 16), (32, 8, 8, 8, 1, None), (16, 2, 4, 8, 2, 16), (24, 6, 4, 8, 1, None),
               (8, 1, 8, 8, 3, 32), (12, 3, 2, 4, 2, 16)]


@pytest.mark.parametrize("case", HEADS_CASES, ids=[f"h{c[0]}/{c[1]}-heads{c[2]}-w{c[3]}-s{c[4]}-p{c[5]}"
                                                   for c in HEADS_CASES])
def test_several_kv_heads_per_cta(case, rng):
    from cupyflash.families.decode.config import DecodeKernelConfig

    h, hk, heads, warps, stages, ps = case
    for dt, d, sq in ((DType.BF16, 128, 1), (DType.FP16, 64, 4)):
        cfg = DecodeKernelConfig(dt, d, 16, 16, warps, stages, False, heads)
        p = Problem(rng, dt, d, 3, sq, h, hk, [0, 37, 1500], ps, seq_new=1)
        for ns in (1, 3, None):
            out, lse = p.run(cfg=cfg, num_splits=ns, return_lse=True)
            p.check(out, lse, context=f"{cfg} num_splits={ns}")
            p.settle_append()  # appended once (checked above); later calls attend to the cache as it is now


# Splits taking warp steps round-robin (`interleave`): the paged narrow default's shape, the d_head
# 64 single-slot shape with 32-key steps (two pages of 16 per step) and a d_head 256 one.
INTERLEAVED = [DecodeKernelConfig.parse(t) for t in (
    "decode (BF16, 128, 16, 16, 8): stages_2+evict_first+interleave",
    "decode (BF16, 64, 16, 32, 8): stages_1+interleave",
    "decode (BF16, 256, 16, 16, 4): stages_2+evict_first+interleave")]


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("cfg_index", range(len(INTERLEAVED)))
def test_interleaved_splits(cfg_index, page_size, rng):
    """Every split count (more splits than steps included), ragged lengths with 0 and 1, page
    boundaries, a cache larger than its sequences (first page-table reads past the sequence's
    end), causal seq_q 4 and an append: the same results as the reference."""
    for dt, sq, causal, new in ((DType.BF16, 1, False, 0), (DType.FP16, 4, True, 1)):
        cfg = INTERLEAVED[cfg_index].replace(dtype=dt)  # 16 rows: GQA 4 x seq_q up to 4
        p = Problem(rng, dt, cfg.d_head, 5, sq, 32, 8, [0, 1, 63, 700, 2049], page_size, seq_new=new,
                    capacity=3072)
        for ns in (1, 2, 7, 64, None):
            out, lse = p.run(cfg=cfg, num_splits=ns, causal=causal, return_lse=True)
            p.check(out, lse, causal=causal, context=f"{cfg} num_splits={ns}")
            p.settle_append()  # appended once (checked above); later calls attend to the cache as it is now


# Paged walks of many steps a warp: each warp's page list (one page index a lane: 32, 16 or 8 steps
# for 16-, 32- or 64-key steps) is replaced by the next one several times, on round-robin and on
# contiguous splits.
LONG_WALKS = [DecodeKernelConfig.parse(t) for t in (
    "decode (BF16, 128, 16, 16, 8): stages_2+evict_first+interleave",
    "decode (BF16, 64, 16, 32, 8): stages_2+interleave",
    "decode (BF16, 64, 16, 64, 4): stages_2",
    "decode (BF16, 256, 16, 16, 4): stages_2+evict_first")]


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("cfg_index", range(len(LONG_WALKS)))
def test_paged_walks_longer_than_one_page_list(cfg_index, page_size, rng):
    """One and three splits over sequences of up to 9001 keys (35-140 steps a warp at one split),
    lengths 0 and 1 beside them, causal seq_q 4 with an append: the same results as the
    reference, and as the contiguous cache."""
    for dt, sq, causal, new in ((DType.BF16, 1, False, 0), (DType.FP16, 4, True, 1)):
        cfg = LONG_WALKS[cfg_index].replace(dtype=dt)
        p = Problem(rng, dt, cfg.d_head, 4, sq, 32, 8, [0, 1, 5000, 9001], page_size, seq_new=new, capacity=9216)
        for ns in (1, 3):
            out, lse = p.run(cfg=cfg, num_splits=ns, causal=causal, return_lse=True)
            p.check(out, lse, causal=causal, context=f"{cfg} page {page_size} num_splits={ns}")
            p.settle_append()


# Grids of several waves of CTAs: the wide default's shape and an interleaved 8-warp one with two
# KV heads per CTA.
WAVES = [DecodeKernelConfig.parse(t) for t in (
    "decode (BF16, 128, 16, 16, 4): stages_3",
    "decode (BF16, 64, 16, 32, 8): stages_2+interleave+heads_2")]


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("cfg_index", range(len(WAVES)))
def test_unused_cache_rows_hold_nan(cfg_index, page_size, rng):
    """Every cache row past its sequence's end holds NaN (as in a cache allocated with
    torch.empty); lengths 0, 1, one step, a step and a key, several waves of CTAs; causal seq_q 4
    with an append and several split counts: the reference's results and no NaN (rows past the
    end are zero-filled in shared memory, never read, since P's zeros would not cancel a NaN)."""
    lengths = np.resize(np.array([0, 1, 15, 16, 17, 33, 100, 129, 300, 1999], dtype=np.int32), 160)
    for dt, sq, causal, new in ((DType.BF16, 1, False, 0), (DType.FP16, 4, True, 1)):
        cfg = WAVES[cfg_index].replace(dtype=dt)
        p = Problem(rng, dt, cfg.d_head, 160, sq, 32, 8, lengths, page_size, seq_new=new, capacity=2048)
        _poison_unused_rows(p)
        for ns in (1, 3, None):
            out, lse = p.run(cfg=cfg, num_splits=ns, causal=causal, return_lse=True)
            assert not bool(cp.isnan(to_float32(cp, out)).any()), f"{cfg} num_splits={ns}: NaN in out"
            p.check(out, lse, causal=causal, context=f"{cfg} num_splits={ns}")
            if p.settle_append():  # appended once (checked above); the new rows past the end are NaN too
                _poison_unused_rows(p)


def _poison_unused_rows(p) -> None:
    """NaN into every cache row at and past its sequence's length (and its appended rows)."""
    nan = int(np.float16(np.nan).view(np.uint16)) if p.dtype is DType.FP16 else 0x7FC0
    starts = [int(n) + p.seq_new for n in p.lengths]
    if p.block_table is None:
        for b, start in enumerate(starts):
            bits(p.k_cache)[b, start:] = nan
            bits(p.v_cache)[b, start:] = nan
        return
    table = cp.asnumpy(p.block_table)
    rows = np.concatenate([np.arange(start, p.capacity) for start in starts])
    seqs = np.concatenate([np.full(p.capacity - start, b) for b, start in enumerate(starts)])
    pages = cp.asarray(table[seqs, rows // p.page_size])
    offsets = cp.asarray(rows % p.page_size)
    bits(p.k_cache)[pages, offsets] = nan
    bits(p.v_cache)[pages, offsets] = nan


@pytest.mark.parametrize("paged", [False, True])
def test_fast_path_returns_the_same_lse(paged, rng):
    """The second call of a signature takes the per-signature fast path, return_lse included."""
    torch = pytest.importorskip("torch")
    p = Problem(rng, DType.FP16, 128, 2, 1, 16, 4, [100, 3000], 16 if paged else None)
    tq, tk, tv = (torch.from_dlpack(x) for x in (p.q, p.k_cache, p.v_cache))
    lens = torch.from_dlpack(p.cache_seqlens)
    table = torch.from_dlpack(p.block_table) if paged else None
    results = [cupyflash.forward_kvcache(tq, tk, tv, cache_seqlens=lens, block_table=table, return_lse=True,
                                         num_splits=4) for _ in range(3)]
    torch.cuda.synchronize()
    for out, lse in results:
        assert lse.dtype == torch.float32 and tuple(lse.shape) == (2, 16, 1)
        p.check(cp.from_dlpack(out), cp.from_dlpack(lse))
    assert results[1][1].data_ptr() != results[2][1].data_ptr()  # a fresh lse per call



def test_split_workspace_on_a_side_stream(rng):
    """stream= other than the current stream with several splits: the split workspace (dropped
    when the call returns) is stream-ordered on the launch stream, so the caller's next
    allocations on its own (non-blocking) stream cannot take it while the kernels run; the
    result equals the current stream's bit for bit. The calls with stream= (a CuPy stream object
    and its handle) replay the plan of the current stream's call."""
    from cupyflash import kvcache_plans

    kvcache_plans.clear()
    p = Problem(rng, DType.BF16, 128, 4, 1, 32, 8, [4000, 3000, 1, 4096])
    call = dict(cache_seqlens=p.cache_seqlens, num_splits=8)
    want = cupyflash.forward_kvcache(p.q, p.k_cache, p.v_cache, **call)
    cp.cuda.Device().synchronize()
    mine, side = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    rows = 8 * 4 * 32  # splits x batch x heads: the workspace's partial rows
    with mine:
        for i in range(4):
            got = cupyflash.forward_kvcache(p.q, p.k_cache, p.v_cache, stream=side if i % 2 else side.ptr, **call)
            for n in (rows * 128, rows * 129, rows * 128 + rows):
                cp.full((n,), cp.nan, dtype=cp.float32)  # the current stream's next allocations
            side.synchronize()
            mine.synchronize()
            assert bool((bits(got) == bits(want)).all())
    assert len(kvcache_plans._TABLE.plans) == 1


@pytest.mark.parametrize("dt", [B, F], ids=lambda d: d.name)
def test_one_wave_multi_head_shapes(dt, rng):
    """The one-wave shapes (config_sets.ONE_WAVE_SHAPES: 2 or 4 KV heads a CTA, one warp or two
    per head): explicit on ragged lengths, one split and several, then through cfg=None on a
    step they serve on the H100 (batch 32 x 8 KV heads of 4096 keys: 537 MB of K/V, 128 CTAs of
    2 heads on 132 SMs)."""
    from cupyflash.families.decode import config_sets

    for heads in config_sets.ONE_WAVE_SHAPES:
        cfg = config_sets.default_config(dt, 128, 4, wide=True, wave_heads=heads)
        p = Problem(rng, dt, 128, 5, 1, 32, 8, [0, 1, 37, 1500, 4101])
        for ns in (1, 3, None):
            out, lse = p.run(cfg=cfg, num_splits=ns, return_lse=True)
            p.check(out, lse, context=f"{cfg} num_splits={ns}")
    p = Problem(rng, dt, 128, 32, 1, 32, 8, [4096] * 31 + [4000])
    p.check(p.run(), context="cfg=None")
