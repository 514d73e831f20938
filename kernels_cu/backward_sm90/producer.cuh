// TMA producer of the backward dK/dV kernel (one thread): K and V of the CTA's key block once,
// then per query block Q, dO (4-D tensor copies) and its lse2/dvec rows (1-D bulk copies) into a
// ring stage, all four completing the stage's q_full barrier. A stage is refilled once every
// consumer thread has arrived on its q_empty (its S^T/dP^T/dK/dV/dQ GEMMs have completed). With
// qdo_split dO and dvec complete do_full and are refilled after do_empty (dV done), Q and lse2
// q_full / q_empty.
// With pdl the K/V loads are issued before waiting for the preprocess kernel. Persistent CTAs
// run it once per tile, the Q/dO ring continuing across tiles.
#pragma once

template <class Cfg, bool CAUSAL, bool VARLEN = false>
struct BwdProducer {
    using Seq = BwdSeq<Cfg::BR, VARLEN>;
    const HopperBackwardParams& p;
    BwdSmem<Cfg> smem;
    BwdSchedule sched;

    CF_DEVICE void run() const {
        load_kv();
        wait_for_preprocess();
        const int n = sched.iterations();
        for (int it = 0; it < n; ++it) load_stage(it, 0);
    }

    // persistent: tile `index` of the CTA, whose query blocks take ring positions it_base, ...
    // The first runs as run() does; a later one loads its first Q/dO stage (freed while the
    // consumers still work on the previous tile), then K and V once the consumers' last GEMMs
    // have read the previous ones (kv_empty), then the rest. The loops are not unrolled: at the
    // producer's 40 registers an unrolled copy spilled.
    CF_DEVICE void run_tile(int index, int it_base) const {
        const int n = sched.iterations();
        int it = 0;
        if (index == 0) {
            load_kv();
            wait_for_preprocess();
        } else {
            if (n > 0) load_stage(it++, it_base);
            mbarrier_wait(smem.kv_empty(), (u32)(index - 1) & 1u);
            load_kv();
        }
#pragma unroll 1
        for (; it < n; ++it) load_stage(it, it_base);
    }

    // pdl: K and V are inputs; lse2 and dvec (and, for the writer warp, dq_accum) are the
    // preprocess's: wait for it here, then let the convert kernel's grid launch (its CTAs find
    // SMs only as this grid's last wave drains).
    CF_DEVICE static void wait_for_preprocess() {
        if constexpr (Cfg::PDL) {
            pdl_wait_for_predecessor();
            pdl_launch_dependents();
        }
    }

    // (VARLEN: rows of the packed arrays from the sequence's first token; a key block past the
    // sequence's end reads rows it never uses, or TMA's zero fill past the array)
    CF_DEVICE void load_kv() const {
        mbarrier_arrive_expect_tx(smem.kv_full(), 2 * Cfg::KV_BYTES);
        const Seq seq = Seq::of(p, sched.batch);
        const int key0 = seq.tok_k + sched.n_block * Cfg::BC;
#pragma unroll
        for (int c = 0; c < Cfg::D_BLOCKS; ++c) {
            tma_load_4d(smem.k() + c * Cfg::BC * Cfg::ROW_BYTES, &p.tma_k, smem.kv_full(), c * Cfg::COL_BLOCK, key0,
                        sched.kv_head, seq.coord);
            tma_load_4d(smem.v() + c * Cfg::BC * Cfg::ROW_BYTES, &p.tma_v, smem.kv_full(), c * Cfg::COL_BLOCK, key0,
                        sched.kv_head, seq.coord);
        }
    }

    // Query block `it` of the tile into ring position it_base + it, once its stage is free.
    CF_DEVICE void load_stage(int it, int it_base) const {
        if constexpr (Cfg::QDO_SPLIT) {
            load_stage_split(it, it_base);
            return;
        }
        const int g = it_base + it;
        const int s = bwd_stage(g, Cfg::STAGES);
        mbarrier_wait(smem.q_empty(s), bwd_phase(g, Cfg::STAGES) ^ 1u);
        const int head = sched.q_head(it);
        const int row0 = sched.template m_block<Cfg::ROTATE>(it) * Cfg::BR;
        const Seq seq = Seq::of(p, sched.batch);
        // (VARLEN: rows past the sequence's queries belong to the next one; their lse2 is the
        // preprocess's +inf padding, so P and dS are 0 there; a block reaching rows past the last
        // sequence lands on q_tail, and the tail zeroer zeroes them and completes q_full)
        const u32 full = seq.tail_query_rows(p, row0) >= 0 ? smem.q_tail(s) : smem.q_full(s);
        mbarrier_arrive_expect_tx(full, Cfg::STAGE_LOAD_BYTES);
#pragma unroll
        for (int c = 0; c < Cfg::D_BLOCKS; ++c) {
            tma_load_4d(smem.q(s) + c * Cfg::BR * Cfg::ROW_BYTES, &p.tma_q, full, c * Cfg::COL_BLOCK, seq.tok_q + row0,
                        head, seq.coord);
            tma_load_4d(smem.dout(s) + c * Cfg::BR * Cfg::ROW_BYTES, &p.tma_do, full, c * Cfg::COL_BLOCK,
                        seq.tok_q + row0, head, seq.coord);
        }
        const long long stat = seq.ws_row(p, head) + row0;
        bulk_load(smem.lse2(s), p.lse2 + stat, Cfg::STAT_BYTES, full);
        bulk_load(smem.dvec(s), p.dvec + stat, Cfg::STAT_BYTES, full);
    }

    // qdo_split: dO and dvec once dO's slot of the stage is free (dV done), then Q and lse2 once
    // Q's is (dK done), each pair completing its own barrier.
    CF_DEVICE void load_stage_split(int it, int it_base) const {
        const int g = it_base + it;
        const int s = bwd_stage(g, Cfg::STAGES);
        const u32 free_phase = bwd_phase(g, Cfg::STAGES) ^ 1u;
        const int head = sched.q_head(it);
        const int row0 = sched.template m_block<Cfg::ROTATE>(it) * Cfg::BR;
        const Seq seq = Seq::of(p, sched.batch);
        const long long stat = seq.ws_row(p, head) + row0;
        // (VARLEN: a block reading rows past its sequence's end lands both halves on q_tail)
        const bool tail = seq.tail_query_rows(p, row0) >= 0;
        const u32 do_full = tail ? smem.q_tail(s) : smem.do_full(s), q_full = tail ? smem.q_tail(s) : smem.q_full(s);
        mbarrier_wait(smem.do_empty(s), free_phase);
        mbarrier_arrive_expect_tx(do_full, Cfg::HALF_LOAD_BYTES);
        load_rows(smem.dout(s), &p.tma_do, do_full, seq, row0, head);
        bulk_load(smem.dvec(s), p.dvec + stat, Cfg::STAT_BYTES, do_full);
        mbarrier_wait(smem.q_empty(s), free_phase);
        mbarrier_arrive_expect_tx(q_full, Cfg::HALF_LOAD_BYTES);
        load_rows(smem.q(s), &p.tma_q, q_full, seq, row0, head);
        bulk_load(smem.lse2(s), p.lse2 + stat, Cfg::STAT_BYTES, q_full);
    }

    // B_r rows of Q or dO (from query row0 of `head`) into the tile at `dst`, completing on `bar`.
    CF_DEVICE static void load_rows(u32 dst, const void* map, u32 bar, const Seq& seq, int row0, int head) {
#pragma unroll
        for (int c = 0; c < Cfg::D_BLOCKS; ++c)
            tma_load_4d(dst + c * Cfg::BR * Cfg::ROW_BYTES, map, bar, c * Cfg::COL_BLOCK, seq.tok_q + row0, head,
                        seq.coord);
    }
};
