// Consumer warpgroup of the backward dK/dV kernel: 64 keys of the CTA's block (rows of every
// wgmma m64 tile are keys, so dK and dV stay in registers for the whole CTA).
//
// Per query block (Q, dO, lse2, dvec in a ring stage):
//   S^T  = K Q^T       wgmma ss, A = K (K-major), B = Q (K-major), N = B_r
//   dP^T = V dO^T      wgmma ss, same shapes
//   P^T  = exp2(S^T * scale * log2 e - lse2[q]) (masked: keys past seq_k, queries past seq_q,
//          causal keys after the query's diagonal); dS^T = P^T * (dP^T - dvec[q])
//   dV  += P^T dO      wgmma rs, A = P^T from registers, B = dO (MN-major)
//   dK  += dS^T Q      wgmma rs, A = dS^T from registers, B = Q (MN-major)
//   dQ   = dS K       (atomic variant) dS^T staged in shared memory [key][query] (two buffers,
//                      alternating per iteration), wgmma ss with both operands MN-major, added to
//                      the fp32 dq_accum with red.global.add.v2. With two warpgroups and 128
//                      query rows each computes 64 of them over all B_c keys, with d_head 128
//                      half of dQ's columns, with d_head 96 and dq_colsplit 64 or 32 of them
//                      (every dQ element is reduced once per CTA); otherwise each warpgroup
//                      computes all of dQ over its own 64 keys.
// With dq_tma the dQ block is staged in shared memory and a writer warp adds it with TMA tensor
// reductions (dq_writer.cuh) instead of the red.global.add.v2 above.
// The deterministic variant skips dQ (backward_sm80's dQ kernel computes it in a separate pass).
// d_head 256 (Cfg::KV_SPLIT): both warpgroups hold the CTA's 64 keys; warpgroup w computes S^T and
// dP^T for queries 32 w .. 32 w + 31 (N = 32), stores its halves of P^T and dS^T to shared
// memory, and after a barrier of both runs dV += P^T dO, dK += dS^T Q for columns 128 w .. 128 w
// + 127 (wgmma ss, A = P^T / dS^T from shared memory) and dQ for the same columns. With sdp_roles
// warpgroup 0 computes S^T and P^T, warpgroup 1 dP^T and dS^T, each for all 64 queries (N = 64:
// the N = 32 tiles read K or V once per 32 queries, more than the SM's shared-memory bandwidth),
// P^T reaching warpgroup 1 in fp32 through shared memory; dV takes P^T from registers.
#pragma once

template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
struct BwdConsumer {
    using Seq = BwdSeq<Cfg::BR, VARLEN>;
    static constexpr bool KV_SPLIT = Cfg::KV_SPLIT;
    static constexpr int NT = Cfg::S_QUERIES / 8;   // n-tiles of this warpgroup's S^T over the queries
    static constexpr int QK = Cfg::S_QUERIES / 16;  // k-steps over those queries (the A fragments of P^T, dS^T)
    static constexpr int DKV_N = Cfg::DKV_N;        // dK/dV columns of this warpgroup
    static constexpr int DK = Cfg::D / 16;        // k-steps over d_head (S^T, dP^T)
    static constexpr bool DQ_SPLIT = Cfg::DQ_SPLIT;  // dQ by columns over the warpgroups
    static constexpr bool DQ_ROWS = Cfg::DQ_ROWS;    // ... by query rows; neither: by keys
    static constexpr int DQ_N = Cfg::DQ_N;           // dQ columns of a warpgroup
    static constexpr int DQ_STEPS = (Cfg::DS_SHARED ? Cfg::BC : Cfg::WG_KEYS) / 16;  // k-steps over keys
    static constexpr int DS_BARRIER = 1;  // named barriers (0 is __syncthreads): 1, or 1 + wg split by keys
    static constexpr int DS_THREADS = Cfg::DS_SHARED ? 128 * Cfg::CONSUMERS : 128;

    const HopperBackwardParams& p;
    BwdSmem<Cfg> smem;
    BwdSchedule sched;
    const int wg, tid, lane, warp;
    const int it_base;   // ring position of the tile's first query block (persistent CTAs run on)
    const u32 kv_phase;  // parity of the tile's kv_full phase (tiles this CTA took before, mod 2)

    float dk[DKV_N / 8][4];
    float dv[DKV_N / 8][4];

    CF_DEVICE BwdConsumer(const HopperBackwardParams& params, BwdSmem<Cfg> layout, BwdSchedule s, int warpgroup,
                          int thread, int ring = 0, int tile_index = 0)
        : p(params), smem(layout), sched(s), wg(warpgroup), tid(thread), lane(thread & 31), warp(thread >> 5),
          it_base(ring), kv_phase((u32)tile_index & 1u) {
#pragma unroll
        for (int n = 0; n < DKV_N / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
    }

    // Key index (inside the CTA's block) of accumulator element e of this thread.
    CF_DEVICE int key_row(int e) const {
        return (KV_SPLIT ? 0 : wg * Cfg::WG_KEYS) + 16 * warp + (lane >> 2) + 8 * (e >> 1);
    }
    // First query (inside the block) of this warpgroup's S^T and dP^T, and first dK/dV column.
    CF_DEVICE int s_query0() const { return KV_SPLIT && !Cfg::SDP_ROLES ? wg * Cfg::S_QUERIES : 0; }
    CF_DEVICE int dkv_col0() const { return KV_SPLIT ? wg * DKV_N : 0; }
    CF_DEVICE static int query_col(int j, int e, int lane) { return 8 * j + 2 * (lane & 3) + (e & 1); }

    // ---- descriptors ----
    // One descriptor per tile (and warpgroup), advanced per k-step (descriptor_advance). The Q,
    // K, V, dO tiles are swizzled over ROW_BYTES (128, or 64 at d_head 96): a d-step k lies in
    // column block k / K_STEPS_PER_BLOCK, 32 bytes per step inside it.
    static constexpr int KSB = Cfg::K_STEPS_PER_BLOCK;
    CF_DEVICE static u64 tile_descriptor(u32 addr, u32 leading_bytes) {
        return smem_descriptor_swizzled<Cfg::ROW_BYTES>(addr, leading_bytes, Cfg::CORE_GROUP_BYTES);
    }
    CF_DEVICE u64 kmajor_a(u32 tile, int k) const {  // K or V rows of this warpgroup, d-steps
        const int key0 = KV_SPLIT ? 0 : warp_uniform(wg) * Cfg::WG_KEYS;
        return descriptor_advance(tile_descriptor(tile + key0 * Cfg::ROW_BYTES, 16),
                                  (k / KSB) * Cfg::BC * Cfg::ROW_BYTES + 32 * (k % KSB));
    }
    // Q or dO rows of this warpgroup's queries as the N = S_QUERIES operand of S^T / dP^T, d-steps:
    // all B_r rows, or with KV_SPLIT 32 rows on inside every column block (the 1024-byte swizzle
    // phase is kept).
    CF_DEVICE u64 kmajor_b_own(u32 tile, int k) const {
        if constexpr (KV_SPLIT && !Cfg::SDP_ROLES) return kmajor_b(tile + warp_uniform(wg) * Cfg::S_QUERIES * Cfg::ROW_BYTES, k);
        else return kmajor_b(tile, k);
    }
    // KV_SPLIT: P^T or dS^T [key][query] (128-byte rows of the 64 queries) as the K-major A operand of
    // dV / dK (M = the 64 keys), query-steps.
    CF_DEVICE static u64 pds_a(u32 tile, int k) {
        return descriptor_advance(smem_descriptor_sw128(tile, 16, 8 * Cfg::DS_ROW_BYTES), 32 * k);
    }
    // KV_SPLIT: dO or Q columns of this warpgroup's half as the MN-major N = 128 operand (its two
    // 64-column swizzle blocks), query-steps.
    CF_DEVICE u64 mnmajor_b_half(u32 tile, int k) const {
        return mnmajor_b_q(tile + (warp_uniform(wg) * DKV_N / Cfg::COL_BLOCK) * Cfg::BR * Cfg::ROW_BYTES, k);
    }
    CF_DEVICE static u64 kmajor_b(u32 tile, int k) {  // Q or dO as the N = B_r operand, d-steps
        return descriptor_advance(tile_descriptor(tile, 16), (k / KSB) * Cfg::BR * Cfg::ROW_BYTES + 32 * (k % KSB));
    }
    CF_DEVICE static u64 mnmajor_b_q(u32 tile, int k) {  // Q or dO as the N = d operand, query-steps
        return descriptor_advance(tile_descriptor(tile, Cfg::BR * Cfg::ROW_BYTES), 16 * k * Cfg::ROW_BYTES);
    }
    // First key (inside the CTA's block), query row (inside the query block) and d column of
    // warpgroup w's dQ GEMM. The descriptors pass warp_uniform(wg), which keeps them on the
    // uniform datapath (built from wg, each of the GEMM's wgmmas waited on two R2UR moves).
    CF_DEVICE int dq_key0(int w) const { return Cfg::DS_SHARED ? 0 : w * Cfg::WG_KEYS; }
    CF_DEVICE int dq_row0(int w) const { return DQ_ROWS ? w * Cfg::DQ_M : 0; }
    CF_DEVICE int dq_col0(int w) const { return DQ_SPLIT ? w * DQ_N : 0; }
    CF_DEVICE int dq_row0() const { return dq_row0(wg); }
    CF_DEVICE int dq_col0() const { return dq_col0(wg); }
    CF_DEVICE u64 mnmajor_b_k(u32 k_tile, int k) const {  // K as the N = d operand of dQ, key-steps (whole column blocks)
        const int w = warp_uniform(wg);
        return descriptor_advance(tile_descriptor(k_tile + (dq_col0(w) / Cfg::COL_BLOCK) * Cfg::BC * Cfg::ROW_BYTES +
                                                      dq_key0(w) * Cfg::ROW_BYTES, Cfg::BC * Cfg::ROW_BYTES),
                                  16 * k * Cfg::ROW_BYTES);
    }
    // dS^T [key][query] as the M = queries operand, key-steps: the buffers of every warpgroup
    // are contiguous in the key, so key k of the CTA is row k of the buffer's query block (this
    // warpgroup's 64 query rows: block dq_row0() / 64). (128B-swizzled at every d_head.)
    CF_DEVICE u64 ds_a(u32 ds_tile, int k) const {
        const int w = warp_uniform(wg);
        return descriptor_advance(
            smem_descriptor_sw128(ds_tile + (dq_row0(w) / 64) * Cfg::BC * Cfg::DS_ROW_BYTES + dq_key0(w) * Cfg::DS_ROW_BYTES,
                                  Cfg::DS_BYTES, 8 * Cfg::DS_ROW_BYTES),
            16 * k * Cfg::DS_ROW_BYTES);
    }

    // Accumulator pairs of 16 columns -> the A fragment of one k-step (mma.m16n8k16 layout).
    CF_DEVICE static void to_fragments(const float (&x)[NT][4], u32 (&a)[QK][4]) {
#pragma unroll
        for (int k = 0; k < QK; ++k) {
            a[k][0] = pack_pair<Cfg::dtype>(x[2 * k][0], x[2 * k][1]);
            a[k][1] = pack_pair<Cfg::dtype>(x[2 * k][2], x[2 * k][3]);
            a[k][2] = pack_pair<Cfg::dtype>(x[2 * k + 1][0], x[2 * k + 1][1]);
            a[k][3] = pack_pair<Cfg::dtype>(x[2 * k + 1][2], x[2 * k + 1][3]);
        }
    }

    // Non-causal CTAs whose key block reaches past seq_len_k clamp the exponent (probabilities);
    // the others (all but the last key block of each head) run the loop without the clamp.
    // (VARLEN: the tail zeroer zeroed the K/V rows past the sequence's end, so its last key block
    // runs the dense kernel's tail; park: every block clamps, since a second instance of the loop
    // was what made ptxas serialise the wgmma chain of dq_mid's build, C7512, and the clamp
    // changes no visible key's exponent.)
    CF_DEVICE void run() {
        park_tile();
        if constexpr (CAUSAL) {
            walk<false>();
        } else if constexpr (CLAMP_EVERY_BLOCK) {
            walk<true>();
        } else {
            if ((sched.n_block + 1) * Cfg::BC > seq().len_k)
                walk<true>();
            else
                walk<false>();
        }
    }

    // park (VARLEN): the tile's sequence, walk (m_begin, m_blocks, rot) and mask offset come from
    // cu_seqlens (global loads), which ptxas cannot recompute inside the loop as it does the dense
    // kernels' (kernel parameters). Held in registers across the loop, they made ptxas serialise
    // the d_head 128 causal consumers' wgmma with dq_frag (C7512), so backward_varlen ran without
    // it, 3-9% under the dense kernel on the same batch (NOTES.md items 336-340). Each consumer warp
    // parks them in its shared-memory slot at the tile's start and loads them where they are used
    // (volatile asm: never hoisted into a register across the loop).
    static constexpr bool PARKED = VARLEN && Cfg::PARK;
    // (non-causal: every block clamps the exponent as the dense kernel's last key block does, on
    // K/V rows the tail zeroer zeroed past a sequence's end, tail_zeroer.cuh)
    static constexpr bool CLAMP_EVERY_BLOCK = PARKED && !CAUSAL;
    enum Parked { LEN_Q, LEN_K, TOK_Q, TOK_K, WS_ROW0, M_BEGIN, M_BLOCKS, ROT, MASK_OFFSET, PARKED_VALUES };
    static_assert(PARKED_VALUES * 4 <= Cfg::PARK_SLOT_BYTES, "a consumer warp's parked values fit its slot");
    CF_DEVICE u32 parked_address(Parked i) const {
        return opaque(smem.base) + (smem.park_slot(4 * wg + warp) - smem.base) + 4 * i;
    }
    // (No "memory" clobber: a load may move among the loop's other shared-memory accesses; the
    // writes it must follow are ordered by park_tile's __syncwarp. Broadcast from lane 0: a loop
    // bound or branch built from a per-thread load is one ptxas cannot prove warp-uniform, and it
    // then gave every warp-collective instruction after it a WARPSYNC.COLLECTIVE fallback, 68 more
    // in the causal kernel, which ran 9% slower; NOTES.md item 340.)
    CF_DEVICE int parked(Parked i) const {
        int x;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(x) : "r"(parked_address(i)));
        return warp_uniform(x);
    }
    CF_DEVICE void park(Parked i, int x) const {
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(parked_address(i)), "r"(x) : "memory");
    }
    // (every lane of the warp writes the same values; __syncwarp orders the lanes' last reads of
    // the previous tile's before the writes, and the writes before this tile's reads)
    CF_DEVICE void park_tile() {
        if constexpr (PARKED) {
            const Seq s = Seq::of(p, sched.batch);
            __syncwarp();
            park(LEN_Q, s.len_q);
            park(LEN_K, s.len_k);
            park(TOK_Q, s.tok_q);
            park(TOK_K, s.tok_k);
            park(WS_ROW0, s.ws_row0);
            park(M_BEGIN, sched.m_begin);
            park(M_BLOCKS, sched.m_blocks);
            park(ROT, sched.rot);
            if constexpr (CAUSAL) park(MASK_OFFSET, s.len_k - s.len_q);
            __syncwarp();
        }
    }
    // The tile's sequence and walk: dense, from the kernel parameters; VARLEN, from cu_seqlens or
    // (park) the parked copy.
    CF_DEVICE Seq seq() const {
        if constexpr (PARKED) return {parked(LEN_Q), parked(LEN_K), parked(TOK_Q), parked(TOK_K), parked(WS_ROW0), 0};
        else return Seq::of(p, sched.batch);
    }
    CF_DEVICE BwdSchedule schedule() const {
        if constexpr (PARKED) {
            BwdSchedule w = sched;
            w.m_begin = parked(M_BEGIN);
            w.m_blocks = parked(M_BLOCKS);
            w.rot = parked(ROT);
            return w;
        } else {
            return sched;
        }
    }
    // causal: the diagonal's shift (park: the parked one; else `offset`, which walk derived).
    CF_DEVICE int mask_offset(int offset) const {
        if constexpr (PARKED) return parked(MASK_OFFSET);
        else return offset;
    }

    template <bool KEY_TAIL>
    CF_DEVICE void walk() {
        mbarrier_wait(smem.kv_full(), kv_phase);
        if constexpr (VARLEN) mbarrier_wait(smem.kv_ready(), kv_phase);  // the tail zeroer's (tail_zeroer.cuh)
        const int n = sched.iterations();
        // the walk's length (park: loaded, not held). A parked loop tests a bound loaded at the
        // start of the block before the test (early_bound below): loaded at the test itself, the
        // shared load and its broadcast stood between every two blocks' GEMMs, and the parked
        // kernels ran 4-6% more cycles than the dense ones (ncu, NOTES.md item 349).
        auto iterations = [&] { return PARKED ? schedule().iterations() : n; };
        const int key_base = sched.n_block * Cfg::BC;
        const Seq seq = Seq::of(p, sched.batch);
        // causal: the diagonal's shift (park: mask_offset reads the parked one where it is used)
        const int causal_offset = PARKED ? 0 : seq.len_k - seq.len_q;
        if constexpr (CAUSAL && Cfg::NOMASK) {
            // Each query head's walk (causal: no rotate) starts at the diagonal: its first
            // `masked` blocks cut the CTA's keys, the rest see all of them. Two loops, each with
            // one body (a branch between two bodies in one loop made it 932 instructions long,
            // item 88): the mask's compares and selects only where they change anything. One
            // count for every warpgroup (the last one's, whose keys are cut longest): the
            // dS^T barrier both warpgroups meet in each block must be the same instruction for
            // all of them (bar.sync is aligned; per-warpgroup counts met it from two loops,
            // which synccheck reports, item 251). (warp_uniform: loop bounds ptxas cannot prove
            // uniform took the loop's descriptors off the uniform datapath, 88 R2UR per block)
            const int last_key = key_base + Cfg::BC - 1;
            const int masked = warp_uniform(min(schedule().m_blocks,
                                                max(0, (last_key - mask_offset(causal_offset) + Cfg::BR - 1) / Cfg::BR -
                                                           schedule().m_begin)));
            for (int head_start = 0; head_start < iterations(); head_start += schedule().m_blocks) {
                int it = head_start;
                for (; it < head_start + masked; ++it) step<true, KEY_TAIL>(it, key_base, causal_offset);
                if constexpr (PARKED) {
                    for (int end = head_start + schedule().m_blocks; it < end; ++it) {
                        end = head_start + schedule().m_blocks;  // early_bound
                        step<false, KEY_TAIL>(it, key_base, causal_offset);
                    }
                } else {
                    for (; it < head_start + schedule().m_blocks; ++it) step<false, KEY_TAIL>(it, key_base, causal_offset);
                }
            }
        } else if constexpr (PARKED) {
            for (int it = 0, end = iterations(); it < end; ++it) {
                end = iterations();  // early_bound
                step<CAUSAL, KEY_TAIL>(it, key_base, causal_offset);
            }
        } else {
            for (int it = 0; it < iterations(); ++it) step<CAUSAL, KEY_TAIL>(it, key_base, causal_offset);
        }
    }

    // Query block `it` of the walk (MASK: the causal diagonal's compares).
    template <bool MASK, bool KEY_TAIL>
    CF_DEVICE void step(int it, int key_base, int causal_offset) {
        if constexpr (Cfg::SDP_ROLES)
            block_sdp_roles<MASK, KEY_TAIL>(it, key_base, causal_offset);
        else if constexpr (KV_SPLIT)
            block_kv_split<MASK, KEY_TAIL>(it, key_base, causal_offset);
        else
            block<MASK, KEY_TAIL>(it, key_base, causal_offset);
    }

    // Query block `it`'s ring stage, query head and first row, once its Q/dO stage has landed.
    struct BlockStart {
        int s, head, q0;
    };
    // (qdo_split: no wait; each role waits for the tile it reads first, wait_q / wait_dout)
    CF_DEVICE BlockStart start_block(int it) const {
        const int s = bwd_stage(it_base + it, Cfg::STAGES);
        int head, q0;
        if constexpr (PARKED && !Cfg::ROTATE) {  // (only the parked values this block reads)
            const bool gqa = sched.group != 1;
            const int m_blocks = gqa ? parked(M_BLOCKS) : 1;
            head = gqa ? sched.kv_head * sched.group + it / m_blocks : sched.kv_head;
            q0 = (parked(M_BEGIN) + (gqa ? it % m_blocks : it)) * Cfg::BR;
        } else if constexpr (PARKED) {
            const BwdSchedule w = schedule();
            head = w.q_head(it);
            q0 = w.template m_block<Cfg::ROTATE>(it) * Cfg::BR;
        } else {
            head = sched.q_head(it);
            q0 = sched.template m_block<Cfg::ROTATE>(it) * Cfg::BR;
        }
        if constexpr (!Cfg::QDO_SPLIT) mbarrier_wait(smem.q_full(s), bwd_phase(it_base + it, Cfg::STAGES));
        return {s, head, q0};
    }
    // qdo_split: block it's Q and lse2 / dO and dvec have landed (a completed phase: no wait on a
    // second call for the same block)
    CF_DEVICE void wait_q(int it, int s) const { mbarrier_wait(smem.q_full(s), bwd_phase(it_base + it, Cfg::STAGES)); }
    CF_DEVICE void wait_dout(int it, int s) const {
        mbarrier_wait(smem.do_full(s), bwd_phase(it_base + it, Cfg::STAGES));
    }

    template <bool MASK, bool KEY_TAIL>
    CF_DEVICE void block(int it, int key_base, int causal_offset) {
        const auto [s, head, q0] = start_block(it);
        float st[NT][4], dpt[NT][4];
        // K and V descriptors derived here from an opaque copy of the shared base, not kept
        // across the loop (at the consumers' 232 registers ptxas spilled one of them)
        const BwdSmem<Cfg> kv{opaque(smem.base)};
        score_tiles<MASK, KEY_TAIL>(st, dpt, kv, s, key_base, q0, causal_offset);
        u32 pa[QK][4], dsa[QK][4];
        to_fragments(st, pa);
        to_fragments(dpt, dsa);

        // dS^T to shared memory (the dQ GEMMs' A operand). The buffer was last read by the dQ
        // GEMMs of iteration it - 2, which every reader completed before the barrier of
        // iteration it - 1. 128-query tiles store it before the dV GEMM is issued, so that the
        // proxy fence behind that issue finds the stores landed (d64 +1.4-3.4% in two runs);
        // 64-query tiles store it after it (stored before, d128 lost 1-4%; item 250).
        [[maybe_unused]] const int buf = (it_base + it) & 1;
        constexpr bool DS_BEFORE_DV = NT > 8;
        if constexpr (!DETERMINISTIC && DS_BEFORE_DV) store_ds(dsa, buf);
        // dQ after the barrier below: with dq_mid, dK is issued behind it (dQ completes first)
        constexpr bool DK_AFTER_DQ = Cfg::DQ_MID && !DETERMINISTIC;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < QK; ++k) wgmma_rs<Cfg::dtype, Cfg::D, 1>(dv, pa[k], mnmajor_b_q(smem.dout(s), k), 1);
        if constexpr (!DK_AFTER_DQ) {
#pragma unroll
            for (int k = 0; k < QK; ++k) wgmma_rs<Cfg::dtype, Cfg::D, 1>(dk, dsa[k], mnmajor_b_q(smem.q(s), k), 1);
        }
        wgmma_commit();

        if constexpr (DETERMINISTIC) {
            wgmma_wait<0>();
            fence_registers(dv);
            fence_registers(dk);
            release(s);  // Q, dO, lse2, dvec of this stage are no longer read
        } else {
            if constexpr (!DS_BEFORE_DV) store_ds(dsa, buf);
            fence_proxy_async_shared();
            // Every dS^T row this dQ GEMM reads is written (and, by program order, every
            // reader's dQ GEMM of the previous iteration has completed; with dq_bulk, the
            // previous block's reductions have read the staged dQ rows).
            if constexpr (Cfg::DQ_BULK) {
                if (issues_dq()) bulk_wait_group_0<true>();
            }
            named_barrier_sync(Cfg::DS_SHARED ? DS_BARRIER : DS_BARRIER + wg, DS_THREADS);
            if constexpr (Cfg::DQ_UNEVEN) {  // (warpgroup-uniform: each runs its own width's code)
                if (warp_uniform(wg) == 0)
                    dq_block<Cfg::DQ_N, DK_AFTER_DQ>(dsa, kv, s, buf, head, q0);
                else
                    dq_block<Cfg::DQ_N1, DK_AFTER_DQ>(dsa, kv, s, buf, head, q0);
            } else {
                dq_block<DQ_N, DK_AFTER_DQ>(dsa, kv, s, buf, head, q0);
            }
        }
    }

    // dQ = dS K for this warpgroup's N columns (N = dq_cols(wg)), queued behind dV/dK (no wait in
    // between: the tensor cores stay busy), with DK_AFTER_DQ then dK; dQ's hand-over and the
    // stage's release once the GEMMs reading it have completed. IN_SEQUENCE: issued straight
    // behind dV/dK's wgmmas, inside their fenced sequence (KV_SPLIT), so without a fence of its own.
    template <int N, bool DK_AFTER_DQ, bool IN_SEQUENCE = false>
    CF_DEVICE void dq_block(const u32 (&dsa)[QK][4], BwdSmem<Cfg> kv, int s, int buf, int head, int q0) {
        float dq[N / 8][4];
        if constexpr (!IN_SEQUENCE) wgmma_fence();
#pragma unroll
        for (int k = 0; k < DQ_STEPS; ++k)
            wgmma_ss_tt<Cfg::dtype, N>(dq, ds_a(kv.ds(buf, 0), k), mnmajor_b_k(kv.k(), k), k > 0);
        wgmma_commit();
        if constexpr (DK_AFTER_DQ) {
#pragma unroll
            for (int k = 0; k < QK; ++k) wgmma_rs<Cfg::dtype, Cfg::D, 1>(dk, dsa[k], mnmajor_b_q(smem.q(s), k), 1);
            wgmma_commit();
            wgmma_wait<1>();  // dV and dQ done; dK (reading Q of this stage) still runs
            fence_registers(dv);
            fence_registers(dq);
        } else {
            wgmma_wait<1>();  // dV/dK done: Q, dO, lse2, dvec of this stage are no longer read
            fence_registers(dv);
            fence_registers(dk);
            release(s);
            wgmma_wait<0>();
            fence_registers(dq);
        }
        hand_over_dq<N>(dq, head, q0);
        if constexpr (DK_AFTER_DQ) {
            wgmma_wait<0>();  // dK done: Q, dO, lse2, dvec of this stage are no longer read
            fence_registers(dk);
            release(s);
        }
    }

    // Query block `it` with KV_SPLIT (d_head 256, the header's last paragraph).
    template <bool MASK, bool KEY_TAIL>
    CF_DEVICE void block_kv_split(int it, int key_base, int causal_offset) {
        const auto [s, head, q0] = start_block(it);
        // P^T and dS^T: the 64 keys x this warpgroup's 32 queries
        float st[NT][4], dpt[NT][4];
        const BwdSmem<Cfg> kv{opaque(smem.base)};
        score_tiles<MASK, KEY_TAIL>(st, dpt, kv, s, key_base, q0, causal_offset);
        u32 pa[QK][4], dsa[QK][4];
        to_fragments(st, pa);
        to_fragments(dpt, dsa);

        // This warpgroup's query halves of dS^T and P^T into buffer buf (last read by the GEMMs
        // of iteration it - 2, which both warpgroups completed before the barrier of it - 1).
        const int buf = (it_base + it) & 1;
        store_query_chunks(dsa, kv.ds_shared(buf), 4 * wg);
        store_query_chunks(pa, kv.pt(buf), 4 * wg);
        fence_proxy_async_shared();
        named_barrier_sync(DS_BARRIER, DS_THREADS);  // both warpgroups' halves are written

        // dV += P^T dO and dK += dS^T Q over the block's 64 queries, this warpgroup's columns; then dQ
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < Cfg::BR / 16; ++k)
            wgmma_ss<Cfg::dtype, DKV_N, 1>(dv, pds_a(kv.pt(buf), k), mnmajor_b_half(smem.dout(s), k), 1);
#pragma unroll
        for (int k = 0; k < Cfg::BR / 16; ++k)
            wgmma_ss<Cfg::dtype, DKV_N, 1>(dk, pds_a(kv.ds_shared(buf), k), mnmajor_b_half(smem.q(s), k), 1);
        wgmma_commit();
        if constexpr (DETERMINISTIC) {
            wgmma_wait<0>();
            fence_registers(dv);
            fence_registers(dk);
            release(s);
        } else {
            dq_block<DQ_N, false, true>(dsa, kv, s, buf, head, q0);  // (ds(buf, 0) is the shared dS^T tile)
        }
    }

    // Query block `it` with sdp_roles (d_head 256): warpgroup 0 computes S^T = K Q^T and P^T and
    // hands P^T (fp32) to warpgroup 1 through shared memory; warpgroup 1 computes dP^T = V dO^T and
    // dS^T = P^T (dP^T - dvec) (as the other tiles: from the fp32 P^T) and stores dS^T. Both run
    // dV += P^T dO with P^T's 16-bit A fragments from registers, then dK += dS^T Q and dQ with
    // dS^T from shared memory.
    template <bool MASK, bool KEY_TAIL>
    CF_DEVICE void block_sdp_roles(int it, int key_base, int causal_offset) {
        const auto [s, head, q0] = start_block(it);
        const BwdSmem<Cfg> kv{opaque(smem.base)};
        const int buf = (it_base + it) & 1;  // (its tiles last read by iteration it - 2's GEMMs: block_kv_split)
        float x[NT][4];  // S^T then P^T (warpgroup 0), dP^T then dS^T (warpgroup 1)
        u32 pa[QK][4];   // P^T as A fragments
        if (warp_uniform(wg) == 0) {
            if constexpr (Cfg::QDO_SPLIT) wait_q(it, s);
            score_tile(x, kv.k(), smem.q(s));
            probabilities<MASK, KEY_TAIL>(x, s, key_base, q0, causal_offset);
            // (the exchange is free: warpgroup 1 read the previous block's P^T before that block's
            // dS^T barrier, which this warpgroup has passed)
            exchange_p(kv, x);
            named_barrier_arrive(Cfg::PT_BARRIER, 256);
            to_fragments(x, pa);
            if constexpr (Cfg::QDO_SPLIT) wait_dout(it, s);  // dV's B operand
        } else {
            if constexpr (Cfg::QDO_SPLIT) wait_dout(it, s);
            score_tile(x, kv.v(), smem.dout(s));
            named_barrier_sync(Cfg::PT_BARRIER, 256);  // warpgroup 0's P^T is in the exchange
            dscores_from_exchange(kv, x, pa, s);
            if constexpr (Cfg::QDO_SPLIT) wait_q(it, s);  // dK's B operand (its own wait: the TMA
                                                          // writes are visible to the threads that
                                                          // observe the barrier's phase)
        }
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < QK; ++k) wgmma_rs<Cfg::dtype, DKV_N, 1>(dv, pa[k], mnmajor_b_half(smem.dout(s), k), 1);
        wgmma_commit();
        u32 dsa[QK][4];
        if (warp_uniform(wg) == 1) {
            to_fragments(x, dsa);
            store_query_chunks(dsa, kv.ds_shared(buf), 0);
            fence_proxy_async_shared();
        }
        named_barrier_sync(DS_BARRIER, DS_THREADS);  // warpgroup 1's dS^T is written
        // (dV ran beside dS^T: P^T's registers are free before dQ's accumulator is live)
        wgmma_wait<0>();
        fence_registers(dv);
        if constexpr (Cfg::QDO_SPLIT) release_dout(s);  // dV was the last GEMM reading dO (and dvec read)
        wgmma_fence();
        dk_from_shared(kv, s, buf);
        if constexpr (DETERMINISTIC) {
            wgmma_wait<0>();
            fence_registers(dk);
            release(s);
        } else {
            dq_block<DQ_N, false>(dsa, kv, s, buf, head, q0);  // (dsa: read only with DK_AFTER_DQ)
        }
    }

    // sdp_roles: P^T (fp32, this thread's accumulator elements) to the exchange in fragment order
    // (n-tile j's four values as one 16-byte store at (j * 128 + tid) * 16: a warp's stores are
    // contiguous), over the two buffers' P^T slots (n-tiles 0-3 and 4-7; 8 KiB each).
    CF_DEVICE u32 exchange_address(BwdSmem<Cfg> kv, int j) const {
        return kv.pt(j / 4) + ((j % 4) * 128 + tid) * 16;
    }
    CF_DEVICE void exchange_p(BwdSmem<Cfg> kv, const float (&pt)[NT][4]) const {
#pragma unroll
        for (int j = 0; j < NT; ++j) st_shared_f32x4(exchange_address(kv, j), pt[j][0], pt[j][1], pt[j][2], pt[j][3]);
    }
    // sdp_roles, warpgroup 1: P^T from the exchange (thread t reads what thread t of warpgroup 0
    // stored: the same (key, query) elements), its 16-bit A fragments into pa, and dP^T -> dS^T in
    // place: P^T * (dP^T - dvec[q]).
    CF_DEVICE void dscores_from_exchange(BwdSmem<Cfg> kv, float (&dpt)[NT][4], u32 (&pa)[QK][4], int s) const {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const float4 p = ld_shared_f32x4(exchange_address(kv, j));
            pa[j / 2][2 * (j % 2)] = pack_pair<Cfg::dtype>(p.x, p.y);
            pa[j / 2][2 * (j % 2) + 1] = pack_pair<Cfg::dtype>(p.z, p.w);
            const float2 dvec = ld_shared_f32x2(stats_lane(s) + Cfg::STAT_BYTES + 32 * j);
            dpt[j][0] = p.x * (dpt[j][0] - dvec.x);
            dpt[j][1] = p.y * (dpt[j][1] - dvec.y);
            dpt[j][2] = p.z * (dpt[j][2] - dvec.x);
            dpt[j][3] = p.w * (dpt[j][3] - dvec.y);
        }
    }

    // KV_SPLIT: dK += dS^T Q for this warpgroup's columns, dS^T from buffer buf (committed).
    CF_DEVICE void dk_from_shared(BwdSmem<Cfg> kv, int s, int buf) {
#pragma unroll
        for (int k = 0; k < Cfg::BR / 16; ++k)
            wgmma_ss<Cfg::dtype, DKV_N, 1>(dk, pds_a(kv.ds_shared(buf), k), mnmajor_b_half(smem.q(s), k), 1);
        wgmma_commit();
    }

    // sdp_roles: one score tile over all B_r queries (A = the K or V tile, B = the Q or dO tile of
    // the stage), completed.
    CF_DEVICE void score_tile(float (&x)[NT][4], u32 a_tile, u32 b_tile) const {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < DK; ++k) wgmma_ss<Cfg::dtype, Cfg::S_QUERIES, 0>(x, kmajor_a(a_tile, k), kmajor_b(b_tile, k), k > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(x);
    }

    // S^T = K Q^T and dP^T = V dO^T for this warpgroup's keys and queries (s_query0() on), as two
    // wgmma groups; then P^T in st (once S^T is ready, dP^T may still run) and dS^T in dpt.
    template <bool MASK, bool KEY_TAIL>
    CF_DEVICE void score_tiles(float (&st)[NT][4], float (&dpt)[NT][4], BwdSmem<Cfg> kv, int s, int key_base, int q0,
                               int causal_offset) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < DK; ++k)
            wgmma_ss<Cfg::dtype, Cfg::S_QUERIES, 0>(st, kmajor_a(kv.k(), k), kmajor_b_own(smem.q(s), k), k > 0);
        wgmma_commit();
#pragma unroll
        for (int k = 0; k < DK; ++k)
            wgmma_ss<Cfg::dtype, Cfg::S_QUERIES, 0>(dpt, kmajor_a(kv.v(), k), kmajor_b_own(smem.dout(s), k), k > 0);
        wgmma_commit();

        wgmma_wait<1>();  // S^T is ready; dP^T may still run
        fence_registers(st);
        probabilities<MASK, KEY_TAIL>(st, s, key_base, q0 + s_query0(), causal_offset);
        wgmma_wait<0>();
        fence_registers(dpt);
        dscores(st, dpt, s);
    }

    // dP^T -> dS^T in place: P^T * (dP^T - dvec[q]).
    CF_DEVICE void dscores(const float (&pt)[NT][4], float (&dpt)[NT][4], int s) const {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const float2 dvec = ld_shared_f32x2(stats_lane(s) + Cfg::STAT_BYTES + 32 * j);
#pragma unroll
            for (int e = 0; e < 4; ++e) dpt[j][e] = pt[j][e] * (dpt[j][e] - ((e & 1) ? dvec.y : dvec.x));
        }
    }

    // KV_SPLIT: this warpgroup's 64 keys x S_QUERIES queries of P^T or dS^T (A fragments) into the
    // [key][query] tile at `tile` (128-byte rows, 128B-swizzled), 16-byte query chunks from chunk0
    // (4 wg: its half; sdp_roles: 0, all of them): one stmatrix.x4 per k-step, as store_ds.
    CF_DEVICE void store_query_chunks(const u32 (&a)[QK][4], u32 tile, int chunk0) const {
        const u32 t = opaque(tid);
        const u32 r = t & 7, i = (t >> 3) & 3;
        const u32 key = 16 * (t >> 5 & 3) + 8 * (i & 1) + r;
        const u32 row = tile + key * Cfg::DS_ROW_BYTES + (((i >> 1) ^ r) << 4);
#pragma unroll
        for (int k = 0; k < QK; ++k)
            stmatrix_x4(row ^ (u32)(((chunk0 + 2 * k) & 7) << 4), a[k][0], a[k][1], a[k][2], a[k][3]);
    }

    // This warpgroup's dQ of the block (rows dq_row0() + 16 warp + lane / 4, + 8; its N columns from
    // dq_col0() on) on to dq_accum: staged for the writer warp (dq_frag, dq_tma), staged and
    // bulk-reduced by one consumer warp (dq_bulk), or added with red.global.add.v2 (the atomic mode).
    template <int N>
    CF_DEVICE void hand_over_dq(const float (&dq)[N / 8][4], int head, int q0) const {
        const int row = 16 * warp + (lane >> 2);
        if constexpr (Cfg::DQ_FRAG) {
            stage_dq_fragments<N>(dq);
        } else if constexpr (Cfg::DQ_TMA) {
            stage_dq_panels<N>(dq, row);
        } else if constexpr (Cfg::DQ_BULK) {
            // Stage this half of dQ (the previous block's reductions finished reading the
            // rows before this iteration's dS^T barrier), then the issuing warp adds the
            // block to dq_accum: one bulk reduction per row, lane l rows l and l + 32.
#pragma unroll
            for (int j = 0; j < N / 8; ++j) {
                const int col = dq_col0() + 8 * j + 2 * (lane & 3);
                st_shared_f32x2(smem.dq(row) + 4 * col, dq[j][0], dq[j][1]);
                st_shared_f32x2(smem.dq(row + 8) + 4 * col, dq[j][2], dq[j][3]);
            }
            fence_proxy_async_shared();  // the bulk reductions read it through the async proxy
            if (issues_dq()) {
                named_barrier_sync(Cfg::DQ_FULL_BARRIER, 128 * Cfg::CONSUMERS);
                float* dst = p.dq_accum +
                             (seq().ws_row(p, head) + q0 + lane) * Cfg::D;
                bulk_reduce_add_f32(dst, smem.dq(lane), Cfg::D * 4);
                bulk_reduce_add_f32(dst + 32 * Cfg::D, smem.dq(lane + 32), Cfg::D * 4);
                bulk_commit_group();
            } else {
                named_barrier_arrive(Cfg::DQ_FULL_BARRIER, 128 * Cfg::CONSUMERS);
            }
        } else {
            add_dq_atomic<N>(dq, head, q0, row);
        }
    }

    // dQ of this warpgroup (rows dq_row0() + row, + 8; its N columns) added to the fp32
    // dq_accum with red.global.add.v2 (the atomic dQ mode).
    template <int N>
    CF_DEVICE void add_dq_atomic(const float (&dq)[N / 8][4], int head, int q0, int row) const {
        float* acc = p.dq_accum + (seq().ws_row(p, head) + q0 + dq_row0()) * Cfg::D + dq_col0();
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
            const int col = 8 * j + 2 * (lane & 3);
            red_add_v2(acc + row * Cfg::D + col, dq[j][0], dq[j][1]);
            red_add_v2(acc + (row + 8) * Cfg::D + col, dq[j][2], dq[j][3]);
        }
    }

    // This lane's lse2 pair of n-tile 0 of its warpgroup's queries in stage s (query_col(0, 0,
    // lane), s_query0() on); n-tile j is 32 j bytes on, dvec STAT_BYTES on. Opaque, so that the
    // compiler cannot see that the lane's offset and the tile's are disjoint bits and join them
    // with an OR per load (14 LOP3 an iteration): as an add, each tile's offset is the load's immediate.
    CF_DEVICE u32 stats_lane(int s) const {
        return opaque(smem.lse2(s) + 4 * (s_query0() + query_col(0, 0, lane)));
    }

    // dS^T of this warpgroup's keys into dS buffer `buf` (one stmatrix.x4 per k-step).
    CF_DEVICE void store_ds(const u32 (&dsa)[QK][4], int buf) const {
        // stmatrix: lane 8 i + r addresses row r of matrix i, matrices (keys 0-7, 8-15 of
        // the warp's 16) x (queries 16 k + 0-7, + 8-15), which are dsa[k][0..3]. The
        // 128-byte row's swizzled chunk c ^ (row & 7) for c = 2k + (i >> 1) is the lane's
        // chunk (i >> 1) ^ (row & 7) XOR the immediate 2k % 8: one address per lane, one
        // XOR per k. The shared base and the thread index are opaque so that ptxas
        // derives the address here instead of keeping it live across the loop (it
        // spilled it).
        const u32 base = opaque(smem.base), t = opaque(tid);
        const u32 r = t & 7, i = (t >> 3) & 3;
        const u32 key = 16 * (t >> 5 & 3) + 8 * (i & 1) + r;  // the lane's row of the warpgroup's keys
        const u32 ds_row = base + (smem.ds(buf, wg) - smem.base) + key * Cfg::DS_ROW_BYTES + (((i >> 1) ^ r) << 4);
        // (query chunk 2k + h of a row: chunk (2k + h) % 8 of query block k / 4, B_c rows on)
#pragma unroll
        for (int k = 0; k < QK; ++k)
            stmatrix_x4((ds_row ^ (u32)(((2 * k) % 8) << 4)) + (k / 4) * Cfg::BC * Cfg::DS_ROW_BYTES, dsa[k][0],
                        dsa[k][1], dsa[k][2], dsa[k][3]);
    }

    // S^T -> P^T in place: exp2(S^T * scale * log2 e - lse2[q]), with MASK (causal only) zero
    // where the key is after the query's diagonal.
    // The tails need no mask: rows past seq_len_q (and rows whose forward saw no key) carry lse2
    // = +inf (the preprocess), so their P^T, and dS^T = P^T (dP^T - dvec) with dvec 0 there, are
    // exactly 0; keys past seq_len_k are TMA's zero fill in K and V (varlen: the tail zeroer's zeros,
    // where the packed arrays hold rows past the sequence's end), so their P^T and dS^T reach
    // only their own dK/dV rows, which the epilogue never stores, and dQ = dS K through K's zero
    // rows. That keeps two compares and a select per element off the consumers' critical path.
    // Those keys' score is 0, which may lie far above a row's lse (a row whose every logit is
    // below -88): without the causal mask (which hides every key past seq_len_k) the CTA of a
    // head's last key block (KEY_TAIL) clamps the exponent at 0, which no visible score exceeds
    // (lse2 bounds them), so their P^T stays <= 1 and dS^T finite, and 0 * K's zero rows adds
    // exactly 0 to dQ. The other CTAs have no such keys and run the loop without the clamp.
    template <bool MASK, bool KEY_TAIL>
    CF_DEVICE void probabilities(float (&st)[NT][4], int s, int key_base, int q0, int causal_offset) const {
        // Causal: key key_base + key_row(e) is visible to query q0 + query_col(j, e) when
        //   g + 8 (e >> 1) - (e & 1) <= 8 j,  g = key_base + key_row(0) - q0 - causal_offset - 2 (lane & 3),
        // one compare with an immediate per element; a hidden score's exponent becomes -inf
        // (ex2.approx gives +0), so every element runs the same FFMA (scale read from the
        // parameter bank) and MUFU, with one select between them.
        if constexpr (CAUSAL) causal_offset = mask_offset(causal_offset);
        const int g = key_base + key_row(0) - q0 - causal_offset - 2 * (lane & 3);
        // lse2 of the thread's two query columns per n-tile: one 8-byte load each
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const float2 l2 = ld_shared_f32x2(stats_lane(s) + 32 * j);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float x = fmaf(st[j][e], p.softmax_scale_log2, -((e & 1) ? l2.y : l2.x));
                if constexpr (!CAUSAL && KEY_TAIL)  // (causal: the diagonal masks every key past seq_len_k)
                    st[j][e] = fast_exp2(fminf(x, 0.f));
                else if constexpr (MASK && CAUSAL)
                    st[j][e] = fast_exp2(g <= 8 * j - 8 * (e >> 1) + (e & 1) ? x : CF_NEG_INF);
                else
                    st[j][e] = fast_exp2(x);
            }
        }
    }

    // dq_tma: this warpgroup's N dQ columns into its swizzled panels (N / 32) (once the writer warp's
    // reductions have read the previous block's), then handed to the writer warp.
    template <int N>
    CF_DEVICE void stage_dq_panels(const float (&dq)[N / 8][4], int row) const {
        named_barrier_sync(Cfg::DQ_TMA_EMPTY_BARRIER + wg, Cfg::DQ_TMA_THREADS);
        // Element (r, 8 j' + 2 (lane & 3)) of a panel: 16-byte chunk 2 j' + h (h = bit 1 of the
        // lane), swizzled (2 j' + h) ^ (r & 7) = 2 j' ^ (h ^ (r & 7)): one base address per
        // thread, XOR j' << 5 per n-tile; row r + 8 is 1024 bytes on (same r & 7), the second
        // panel DQ_PANEL_BYTES.
        const u32 a0 = dq_panel_address(0, row, 2 * (lane & 3));
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
            const u32 a = (a0 ^ (u32)((j % 4) << 5)) + (j / 4) * Cfg::DQ_PANEL_BYTES;
            st_shared_f32x2(a, dq[j][0], dq[j][1]);
            st_shared_f32x2(a + 8 * 128, dq[j][2], dq[j][3]);
        }
        fence_proxy_async_shared();  // the TMA reductions read the panels through the async proxy
        named_barrier_arrive(Cfg::DQ_TMA_FULL_BARRIER + wg, Cfg::DQ_TMA_THREADS);
    }
    // dq_frag: this warpgroup's dQ (one 64 x N part, config.cuh) in fragment order: n-tile j's
    // four values as one 16-byte store at (j * 128 + tid) * 16, a warp's 32 stores contiguous
    // (conflict-free, no swizzle arithmetic), then handed to the writer warp.
    template <int N>
    CF_DEVICE void stage_dq_fragments(const float (&dq)[N / 8][4]) const {
        named_barrier_sync(Cfg::DQ_TMA_EMPTY_BARRIER + wg, Cfg::DQ_TMA_THREADS);
        // (from warp and lane, not tid: tid kept live to here serialised the causal kernel's wgmma
        // chain, C7512)
        const u32 a0 = smem.dq_panel(wg, 0) + 512 * warp + 16 * lane;  // 16 tid
#pragma unroll
        for (int j = 0; j < N / 8; ++j) st_shared_f32x4(a0 + j * 128 * 16, dq[j][0], dq[j][1], dq[j][2], dq[j][3]);
        fence_proxy_async_shared();  // the bulk reduction reads the part through the async proxy
        named_barrier_arrive(Cfg::DQ_TMA_FULL_BARRIER + wg, Cfg::DQ_TMA_THREADS);
    }
    // Shared address of fp32 element (row r, column c) of this warpgroup's dQ panel: 128-byte rows,
    // 16-byte chunk index XOR (r & 7) (the map's 128B swizzle; conflict-free 8-byte stores).
    CF_DEVICE u32 dq_panel_address(int panel, int r, int c) const {
        return smem.dq_panel(wg, panel) + r * 128 + (((c >> 2) ^ (r & 7)) << 4) + (c & 3) * 4;
    }

    // dq_bulk: the warp that issues the bulk reductions of dQ (warp 0 of the first consumer).
    CF_DEVICE bool issues_dq() const { return wg == 0 && warp == 0; }

    // persistent: this thread's GEMMs of the tile (the last ones read K and V) have completed
    // (walk waited for them), so the producer may load the next tile's K and V.
    CF_DEVICE void release_kv() const { mbarrier_arrive(smem.kv_empty()); }

    // The bulk reductions of the last block have completed (before the CTA may exit).
    CF_DEVICE void drain() const {
        if constexpr (Cfg::DQ_BULK && !DETERMINISTIC) {
            if (issues_dq()) bulk_wait_group_0<false>();
        }
    }

    // Every consumer thread releases the stage once its GEMMs reading Q/dO have completed (waited
    // above) and its own lse2/dvec loads are done: each thread's arrive releases its own reads.
    // One arrive per warp after __syncwarp is enough for the hardware (the warp barrier orders
    // the lanes' reads before lane 0's release), but compute-sanitizer racecheck does not follow
    // that chain and reported the producer's next bulk copies into the stage as racing with
    // lanes 1..31's reads; per-thread arrivals make the ordering visible to it.
    CF_DEVICE void release(int s) const { mbarrier_arrive(smem.q_empty(s)); }
    // qdo_split: dO and dvec of stage s are no longer read by this thread (release: Q and lse2)
    CF_DEVICE void release_dout(int s) const { mbarrier_arrive(smem.do_empty(s)); }
};
