// TMA producer of the backward dK/dV kernel (one thread): K and V of the CTA's key block once,
// then per query block Q, dO (4-D tensor copies) and its lse2/dvec rows (1-D bulk copies) into a
// ring stage, all four completing the stage's q_full barrier. A stage is refilled once every
// consumer thread has arrived on its q_empty (its S^T/dP^T/dK/dV/dQ GEMMs have completed).
// With pdl the K/V loads are issued before waiting for the preprocess kernel.
#pragma once

template <class Cfg, bool CAUSAL>
struct BwdProducer {
    const HopperBackwardParams& p;
    BwdSmem<Cfg> smem;
    BwdSchedule sched;

    CF_DEVICE void run() const {
        mbarrier_arrive_expect_tx(smem.kv_full(), 2 * Cfg::KV_BYTES);
        const int key0 = sched.n_block * Cfg::BC;
#pragma unroll
        for (int c = 0; c < Cfg::D_BLOCKS; ++c) {
            tma_load_4d(smem.k() + c * Cfg::BC * Cfg::ROW_BYTES, &p.tma_k, smem.kv_full(), c * Cfg::COL_BLOCK, key0,
                        sched.kv_head, sched.batch);
            tma_load_4d(smem.v() + c * Cfg::BC * Cfg::ROW_BYTES, &p.tma_v, smem.kv_full(), c * Cfg::COL_BLOCK, key0,
                        sched.kv_head, sched.batch);
        }
        if constexpr (Cfg::PDL) {
            // K and V are inputs; lse2 and dvec (and, for the writer warp, dq_accum) are the
            // preprocess's: wait for it here, then let the convert kernel's grid launch (its
            // CTAs find SMs only as this grid's last wave drains).
            pdl_wait_for_predecessor();
            pdl_launch_dependents();
        }
        const int n = sched.iterations();
        for (int it = 0; it < n; ++it) {
            const int s = bwd_stage(it, Cfg::STAGES);
            mbarrier_wait(smem.q_empty(s), bwd_phase(it, Cfg::STAGES) ^ 1u);
            const int head = sched.q_head(it);
            const int row0 = sched.template m_block<Cfg::ROTATE>(it) * Cfg::BR;
            mbarrier_arrive_expect_tx(smem.q_full(s), Cfg::STAGE_LOAD_BYTES);
#pragma unroll
            for (int c = 0; c < Cfg::D_BLOCKS; ++c) {
                tma_load_4d(smem.q(s) + c * Cfg::BR * Cfg::ROW_BYTES, &p.tma_q, smem.q_full(s), c * Cfg::COL_BLOCK, row0,
                            head, sched.batch);
                tma_load_4d(smem.dout(s) + c * Cfg::BR * Cfg::ROW_BYTES, &p.tma_do, smem.q_full(s), c * Cfg::COL_BLOCK,
                            row0, head, sched.batch);
            }
            const long long stat = ((long long)sched.batch * p.n_heads + head) * p.seq_len_q_pad + row0;
            bulk_load(smem.lse2(s), p.lse2 + stat, Cfg::STAT_BYTES, smem.q_full(s));
            bulk_load(smem.dvec(s), p.dvec + stat, Cfg::STAT_BYTES, smem.q_full(s));
        }
    }
};
