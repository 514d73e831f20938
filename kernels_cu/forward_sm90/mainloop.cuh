// Consumer mainloop: one warpgroup computes 64 query rows of the tile against every key block.
//
// Per key block j: S = Q K_j^T (wgmma, both operands in shared memory; with Q_REGS Q's fragments
// are loaded to registers once per tile and A comes from there), mask, online softmax in
// fp32 registers, P converted in registers to the A operand of O += P V_j (V from shared memory,
// MN-major, so the transpose bit is set); with P_SMEM, P is stored to the warpgroup's shared P
// tile instead and P V reads both operands from shared memory, which frees the B_c/4 registers
// of P (d_head 128's 192 x 128 tiles fit the three consumer warpgroups' 160 registers so). With
// OVERLAP the QK^T of block j is issued together with the P V of block j-1, so the softmax of
// block j runs while P V_{j-1} is on the tensor cores. With PINGPONG the consumer warpgroups take
// turns issuing their GEMMs, in a ring of named barriers (0 -> 1 [-> 2] -> 0), so one
// warpgroup's softmax overlaps the others' GEMMs.
//
// VARLEN: a sequence's partial last key block reads the packed k/v rows past its end (the tile's
// tail block, tile_scheduler.cuh tail_reads_past_end): the next sequences' tokens, or rows past the last sequence, which
// belong to no sequence and may hold anything (a padded buffer never written: NaN, inf). Its mask
// gives those keys P = 0, which hides any K there, but P V adds 0 * V, NaN for a NaN row (one
// sequence's values would reach another's output). So before that block's P V every consumer
// thread zeroes its share of the V rows past the sequence's end and the consumer warpgroups meet
// on tail_cleared: each arrives after its turn of the block's Q K^T and before its turn of P V
// (idle WG_BLOCKS warpgroups at the same turn), so no turn is held while waiting there. (A
// zeroing role in the producer warpgroup made ptxas spill the producer at any register budget.)
#pragma once

// Q_REGS: Q K^T's A operand per k-step (the mma.m16n8k16 A-fragment layout); empty otherwise, so
// configs without it build as before.
template <int STEPS>
struct QFragments {
    u32 a[STEPS][4];
};
template <>
struct QFragments<0> {};

template <class Cfg, bool CAUSAL>
struct Consumer {
    using Softmax = WarpgroupSoftmax<Cfg, CAUSAL>;
    using Scores = typename Softmax::Scores;
    static constexpr int QK_STEPS = Cfg::D / 16;
    static constexpr int PV_STEPS = Cfg::BC / 16;
    // Named barrier ids: 1 + wg for ping-pong turns, 4 + wg for the epilogue (0 = __syncthreads).
    static constexpr int TURN_BARRIER = 1;
    static constexpr int EPILOGUE_BARRIER = 4;

    const HopperForwardParams& p;
    SmemLayout<Cfg> smem;
    TileScheduler<Cfg, CAUSAL> tile;
    const int wg;    // consumer warpgroup index (0 .. CONSUMERS-1)
    const int tid;   // thread index inside the warpgroup
    const int lane;
    const int warp;  // warp inside the warpgroup: rows 16*warp .. +15 of the warpgroup's 64
    const int ring_base;  // ring position of the tile's first key block (persistent CTAs continue it)
    const int tile_iter;  // tiles this CTA has computed before this one (phase of q_full)

    float o[Cfg::D / 8][4];
    typename Softmax::Probabilities pa;  // P of the next P V (unused with P_SMEM)
    QFragments<Cfg::Q_REGS ? QK_STEPS : 0> q_frag;  // Q_REGS: the warp's 16 rows of Q, Q K^T's A per k-step
    Softmax softmax;

    CF_DEVICE Consumer(const HopperForwardParams& params, SmemLayout<Cfg> layout, TileScheduler<Cfg, CAUSAL> t,
                       int warpgroup, int thread, int ring = 0, int iter = 0)
        : p(params), smem(layout), tile(t), wg(warpgroup), tid(thread), lane(thread & 31), warp(thread >> 5),
          ring_base(ring), tile_iter(iter) {
#pragma unroll
        for (int n = 0; n < Cfg::D / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
        softmax.init();
    }

    CF_DEVICE int wg_row0() const { return tile.first_row() + wg * Cfg::WG_ROWS; }
    // The warpgroup's last row inside the sequence (below wg_row0() when it has none).
    CF_DEVICE int wg_last_row() const { return min(tile.seq_len_q(p), wg_row0() + Cfg::WG_ROWS) - 1; }
    CF_DEVICE int row() const { return wg_row0() + 16 * warp + (lane >> 2); }

    // ---- GEMM issue ----
    CF_DEVICE u32 q_tile() const { return smem.q(q_buffer<Cfg>(tile_iter)); }  // this tile's Q (and O staging)
    // The base descriptors are derived at each issue from an opaque copy of the shared base, not
    // kept live across the loop: the consumers of 3-warpgroup tiles run at 160 registers, where
    // one more live value spills.
    // `q_iter`: the tile whose Q tile is read (CROSS_TILE issues the next tile's first Q K^T).
    CF_DEVICE void issue_qk(Scores& s, int stage) const { issue_qk(s, stage, tile_iter); }
    CF_DEVICE void issue_qk(Scores& s, int stage, int q_iter) const {
        const SmemLayout<Cfg> sm{opaque(smem.base)};
        const u64 q0 = smem_descriptor_swizzled<Cfg::ROW_BYTES>(  // unused with Q_REGS
            sm.q(q_buffer<Cfg>(q_iter)) + wg * Cfg::WG_ROWS * Cfg::ROW_BYTES, 16, Cfg::CORE_GROUP_BYTES);
        const u64 k0 = smem_descriptor_swizzled<Cfg::ROW_BYTES>(sm.k(stage), 16, Cfg::CORE_GROUP_BYTES);
        wgmma_fence();
        if constexpr (Cfg::Q_REGS) {
#pragma unroll
            for (int k = 0; k < QK_STEPS; ++k) {
                const int c = k / Cfg::K_STEPS_PER_BLOCK, kk = k % Cfg::K_STEPS_PER_BLOCK;
                wgmma_rs<Cfg::dtype, Cfg::BC, 0>(s[0], q_frag.a[k],
                                                 descriptor_advance(k0, c * Cfg::BC * Cfg::ROW_BYTES + 32 * kk), k > 0);
            }
        } else {
#pragma unroll
            for (int k = 0; k < QK_STEPS; ++k) {
                // 4 (2) k-steps of 16 elements per 128-byte (64-byte) row
                const int c = k / Cfg::K_STEPS_PER_BLOCK, kk = k % Cfg::K_STEPS_PER_BLOCK;
                wgmma_ss<Cfg::dtype, Cfg::BC, 0>(s[0], descriptor_advance(q0, c * Cfg::BR * Cfg::ROW_BYTES + 32 * kk),
                                                 descriptor_advance(k0, c * Cfg::BC * Cfg::ROW_BYTES + 32 * kk), k > 0);
            }
        }
        wgmma_commit();
    }

    // Q_REGS: the warp's 16 rows of the tile's Q into `q_frag`, k-step k = elements 16k .. 16k + 15
    // of each row: ldmatrix.x4's matrices (rows 0-7 | 8-15) x (elements 0-7 | 8-15) are the A
    // fragment's four registers; lane L addresses row L % 16 at element 8 (L / 16).
    CF_DEVICE void load_q_fragments() {
        if constexpr (Cfg::Q_REGS) {
            const int r = wg * Cfg::WG_ROWS + 16 * warp + (lane & 15);
#pragma unroll
            for (int k = 0; k < QK_STEPS; ++k) ldmatrix_x4(q_frag.a[k], q_tile_element<Cfg>(q_tile(), r, 16 * k + 8 * (lane >> 4)));
        }
    }

    // P V over the first STEPS k-steps (keys 0 .. 16 STEPS - 1 of the block).
    template <int STEPS = PV_STEPS>
    CF_DEVICE void issue_pv(int stage) {
        const SmemLayout<Cfg> sm{opaque(smem.base)};
        // k-step k covers keys 16k..16k+15: 16 rows of every column block; the N blocks of the
        // head dimension are BC rows apart (LBO).
        const u64 v0 = smem_descriptor_swizzled<Cfg::ROW_BYTES>(sm.v(stage), Cfg::BC * Cfg::ROW_BYTES,
                                                                Cfg::CORE_GROUP_BYTES);
        wgmma_fence();
        if constexpr (Cfg::P_SMEM) {
            // P's k-step k: 32 bytes into each 128-byte row of column block k / 4 (as Q in Q K^T)
            const u64 p0 = smem_descriptor_sw128(sm.p(wg), 16, 8 * Cfg::P_ROW_BYTES);
#pragma unroll
            for (int k = 0; k < STEPS; ++k)
                wgmma_ss<Cfg::dtype, Cfg::D, 1>(
                    o, descriptor_advance(p0, (k / 4) * Cfg::WG_ROWS * Cfg::P_ROW_BYTES + 32 * (k % 4)),
                    descriptor_advance(v0, 16 * k * Cfg::ROW_BYTES), 1);
        } else {
#pragma unroll
            for (int k = 0; k < STEPS; ++k)
                wgmma_rs<Cfg::dtype, Cfg::D, 1>(o, pa[k], descriptor_advance(v0, 16 * k * Cfg::ROW_BYTES), 1);
        }
        wgmma_commit();
    }

    // Block j's probabilities become the A operand of its P V. Every caller has completed the
    // previous P V (wgmma_wait<0>), so P_SMEM's single P tile per warpgroup is free to overwrite.
    // The stores are generic-proxy writes that the P V wgmma reads through the async proxy:
    // fence them; a warp's wgmma reads only its own 16 rows of P, so the warp's own barrier
    // suffices.
    // HALF: the block's first B_c / 2 columns only (HALF_LAST).
    template <bool HALF = false>
    CF_DEVICE void stage_p(const Scores& s) {
        constexpr int STEPS = HALF ? PV_STEPS / 2 : PV_STEPS;
        if constexpr (Cfg::P_SMEM) {
            const SmemLayout<Cfg> sm{opaque(smem.base)};
            Softmax::template store<STEPS>(s, Softmax::store_address(sm.p(wg), warp, lane));
            fence_proxy_async_shared();
            __syncwarp();
        } else {
            Softmax::template convert<STEPS>(s, pa);
        }
    }

    // ---- synchronisation ----
    // Every warp releases a stage's K (V) once its own wgmmas reading it have completed; with
    // kv_multicast in both CTAs of the pair, whose producers both write the stage.
    CF_DEVICE void release_k(int stage) const { release(smem.k_empty(stage)); }
    CF_DEVICE void release_v(int stage) const { release(smem.v_empty(stage)); }
    CF_DEVICE void release(u32 empty) const {
        if (lane == 0) {
            mbarrier_arrive(empty);
            if constexpr (kv_multicast<Cfg, CAUSAL>()) mbarrier_arrive_remote(empty, cluster_rank() ^ 1u);
        }
    }
    // EARLY_Q_RELEASE: the tile's last Q K^T has completed (or it has none), so the producer may
    // load the CTA's next Q into this tile while P V and the epilogue (from registers) finish.
    CF_DEVICE void release_q_early() const {
        if constexpr (Cfg::EARLY_Q_RELEASE)
            if (lane == 0) mbarrier_arrive(smem.q_empty(q_buffer<Cfg>(tile_iter)));
    }
    // After block j's Q K^T has completed: the Q tile's last read. With Q_REGS that is block 0's
    // (its wgmmas consumed the fragments, so every ldmatrix of the tile has returned).
    CF_DEVICE void q_read(int j, int n_blocks) const {
        if (j == (Cfg::Q_REGS ? 0 : n_blocks - 1)) release_q_early();
    }

    // A turn barrier counts 256 threads: the 128 of the warpgroup waiting for its turn and the
    // 128 of its predecessor in the ring handing it over. A warpgroup cannot hand over twice
    // before the next one has waited: between two hand-overs it must itself wait, which needs
    // a hand-over that, around the ring, follows the next warpgroup's wait.
    // Per tile (default): each tile starts the ring anew - the last warpgroup hands warpgroup 0
    // its first turn when it starts the tile (after its previous epilogue) and skips its last
    // hand-over, so every warpgroup waits exactly as often as it is signalled and no barrier is
    // left half-arrived. TURN_RING: the ring runs on across a persistent CTA's tiles - the last
    // warpgroup hands over right after its last GEMM of a tile, so warpgroup 0 starts the next
    // tile's Q K^T during the others' epilogues; open_turns primes the ring once and close_turns
    // takes its last hand-over.
    CF_DEVICE void wait_turn() const {
        if constexpr (Cfg::PINGPONG) named_barrier_sync(TURN_BARRIER + wg, 256);
    }
    // `tile_end`: the warpgroup's last turn of the tile.
    CF_DEVICE void pass_turn(bool tile_end) const {
        if constexpr (Cfg::PINGPONG)
            if (Cfg::TURN_RING || !(tile_end && wg == Cfg::CONSUMERS - 1))
                named_barrier_arrive(TURN_BARRIER + (wg + 1) % Cfg::CONSUMERS, 256);
    }
    CF_DEVICE void start_tile_turns() const {
        if constexpr (Cfg::PINGPONG && !Cfg::TURN_RING)
            if (wg == Cfg::CONSUMERS - 1) named_barrier_arrive(TURN_BARRIER, 256);  // warpgroup 0 goes first
    }
    // TURN_RING, before a CTA's first tile and after its last; `warpgroup` counts consumers from 0.
    CF_DEVICE static void open_turns(int warpgroup) {
        if constexpr (Cfg::TURN_RING)
            if (warpgroup == Cfg::CONSUMERS - 1) named_barrier_arrive(TURN_BARRIER, 256);
    }
    CF_DEVICE static void close_turns(int warpgroup) {
        if constexpr (Cfg::TURN_RING)
            if (warpgroup == 0) named_barrier_sync(TURN_BARRIER, 256);
    }

    // VARLEN, block `block` of the tile's `n_blocks`, its V landed in `stage`: when it is the tail
    // block that reads rows past the sequence's end, this thread's share of those rows zeroed
    // (fenced for the wgmma's async-proxy reads), then every consumer thread meets on tail_cleared
    // (an mbarrier, not a named one: warps leave the v_full spin split). The tail block is the same for every
    // consumer warpgroup, and each calls this for it exactly once.
    CF_DEVICE void clear_rows_past_end(int block, int n_blocks, int stage) const {
        if constexpr (Cfg::VARLEN) {
            if (block != n_blocks - 1 || !tile.tail_reads_past_end(p, n_blocks)) return;
            Cfg::template zero_rows<Cfg::BC>(smem.v(stage), tile.seq_len_k(p) - block * Cfg::BC, wg * 128 + tid,
                                             128 * Cfg::CONSUMERS);
            fence_proxy_async_shared();
            mbarrier_meet(smem.tail_cleared());
        }
    }

    CF_DEVICE void rescale_output(const float (&rescale)[1][2]) {
        if constexpr (Cfg::LAZY_RESCALE) {
            // Lazy rescaling leaves most factors at exactly 1: skip when all of the warp's are
            // (a warp-uniform branch; the multiplications would be no-ops).
            if (!__any_sync(0xffffffffu, rescale[0][0] != 1.f || rescale[0][1] != 1.f)) return;
        }
#pragma unroll
        for (int n = 0; n < Cfg::D / 8; ++n) {
            o[n][0] *= rescale[0][0];
            o[n][1] *= rescale[0][0];
            o[n][2] *= rescale[0][1];
            o[n][3] *= rescale[0][1];
        }
    }

    // Block j's scores S -> masked, online-softmax statistics updated (O rescaled from the second
    // block on), P staged as the A operand of P V_j.
    CF_DEVICE void softmax_block(Scores& s, int j) {
        Softmax::mask(s, tile.seq_len_q(p), tile.seq_len_k(p), j, wg_row0(), row(), lane);
        if (j == 0) {
            float unused[1][2];
            softmax.stats.template update<true>(s, unused, p.softmax_scale, p.softmax_scale_log2);
        } else {
            float rescale[1][2];
            softmax.stats.template update<false>(s, rescale, p.softmax_scale, p.softmax_scale_log2);
            rescale_output(rescale);
        }
        stage_p(s);
    }

    // `refill(block)`: called after a block's stage is released (non-warp-specialised kernels
    // issue the next loads from there).
    template <class Refill>
    CF_DEVICE void run(int n_blocks, Refill&& refill) {
        mbarrier_wait(smem.q_full(q_buffer<Cfg>(tile_iter)), q_phase<Cfg>(tile_iter));
        if (n_blocks <= 0) {
            release_q_early();
            return;
        }
        start_tile_turns();
        const int mine = own_blocks(n_blocks);
        if (mine > 0) {
            load_q_fragments();
            if constexpr (Cfg::OVERLAP) run_overlapped(mine, refill, mine == n_blocks);
            else run_sequential(mine, refill, mine == n_blocks);
        } else {
            release_q_early();
        }
        if (mine < n_blocks) idle_blocks(mine, n_blocks);
    }

    // WG_BLOCKS: the key blocks this warpgroup's own rows need. None for a warpgroup whose rows
    // all lie past the end of the sequence (the last tile of a length that is not a multiple of
    // B_r: at d_head 64's 192-row tiles, S = 1k and 4k leave two of three warpgroups without a
    // row, 512 and 2k one) or, causal, before the first visible key; causal, at most the tile's
    // n_blocks (which its last row decides) but only up to its own last row's diagonal.
    // Otherwise every warpgroup visits n_blocks.
    CF_DEVICE int own_blocks(int n_blocks) const {
        if constexpr (Cfg::WG_BLOCKS) {
            const int last_row = wg_last_row();
            int mine = n_blocks;
            if constexpr (CAUSAL) {
                const int last_key = last_row + tile.seq_len_k(p) - tile.seq_len_q(p);
                mine = last_key < 0 ? 0 : min(n_blocks, last_key / Cfg::BC + 1);
            }
            // Broadcast: ptxas cannot prove a value built from the warpgroup index warp-uniform,
            // and a loop bound it cannot prove uniform moves the ring's stage and phase
            // arithmetic off the uniform datapath for the whole main loop.
            return warp_uniform(last_row < wg_row0() ? 0 : mine);
        }
        return n_blocks;
    }

    // WG_BLOCKS: blocks mine .. n_blocks - 1, which this warpgroup does not need. It takes
    // the ping-pong turns it owes the ring without GEMMs (the others wait for its hand-overs) and
    // releases each block's K and V once loaded (every consumer warp arrives on a stage's empty
    // barrier; waiting for full first keeps the arrival in the stage's current phase). Turns
    // first, then the block: a hand-over never waits for a load. Overlapped, a warpgroup takes
    // n + 1 turns for n blocks (turn t: Q K_t^T and P V_{t-1}), so idle turn t stands for block
    // t - 1; sequential, two per block (Q K^T, then P V).
    CF_DEVICE void idle_blocks(int mine, int n_blocks) {
        if constexpr (Cfg::OVERLAP) {
            if (mine == 0) {  // the turn of the first Q K^T, which has no block of its own to release
                wait_turn();
                pass_turn(false);
            }
            for (int j = mine; j < n_blocks; ++j) {
                if (j == n_blocks - 1) clear_unused_tail(j, n_blocks);  // before the turn of its P V
                wait_turn();
                pass_turn(j == n_blocks - 1);
                release_unused(j);
            }
        } else {
            for (int j = mine; j < n_blocks; ++j) {
                wait_turn();
                pass_turn(false);
                if (j == n_blocks - 1) clear_unused_tail(j, n_blocks);
                wait_turn();
                pass_turn(j == n_blocks - 1);
                release_unused(j);
            }
        }
    }
    CF_DEVICE void release_unused(int j) const {
        const int stage = ring_stage(ring_base + j, Cfg::STAGES);
        const u32 phase = ring_phase(ring_base + j, Cfg::STAGES);
        mbarrier_wait(smem.k_full(stage), phase);
        release_k(stage);
        mbarrier_wait(smem.v_full(stage), phase);
        release_v(stage);
    }
    // An idle warpgroup's share of the tail block (clear_rows_past_end), at the turn where the others
    // have theirs.
    CF_DEVICE void clear_unused_tail(int j, int n_blocks) const {
        if constexpr (Cfg::VARLEN) {
            const int stage = ring_stage(ring_base + j, Cfg::STAGES);
            mbarrier_wait(smem.v_full(stage), ring_phase(ring_base + j, Cfg::STAGES));
            clear_rows_past_end(j, n_blocks, stage);
        }
    }

    // `ends_tile`: this warpgroup's last turn of the tile is its last block's P V (WG_BLOCKS: not
    // when idle turns follow).
    template <class Refill>
    CF_DEVICE void run_sequential(int n_blocks, Refill& refill, bool ends_tile = true) {
        Scores s;
        for (int j = 0; j < n_blocks; ++j) {
            const int stage = ring_stage(ring_base + j, Cfg::STAGES);
            const u32 phase = ring_phase(ring_base + j, Cfg::STAGES);
            mbarrier_wait(smem.k_full(stage), phase);
            wait_turn();
            issue_qk(s, stage);
            pass_turn(false);
            wgmma_wait<0>();
            fence_registers(s[0]);
            release_k(stage);
            q_read(j, n_blocks);
            softmax_block(s, j);
            mbarrier_wait(smem.v_full(stage), phase);
            if (ends_tile) clear_rows_past_end(j, n_blocks, stage);
            wait_turn();
            issue_pv(stage);
            pass_turn(ends_tile && j == n_blocks - 1);
            wgmma_wait<0>();
            fence_registers(o);
            release_v(stage);
            refill(j);
        }
    }

    // Block j's scores masked and turned into probabilities (FIRST: block 0, whose statistics
    // start); HALF: its first B_c / 2 columns only.
    template <bool FIRST, bool HALF>
    CF_DEVICE void probabilities(Scores& s, int j, float (&rescale)[1][2]) {
        auto& columns = Softmax::template columns<HALF>(s);
        Softmax::mask(columns, tile.seq_len_q(p), tile.seq_len_k(p), j, wg_row0(), row(), lane);
        softmax.stats.template update<FIRST>(columns, rescale, p.softmax_scale, p.softmax_scale_log2);
    }

    // HALF_LAST: no row of this warpgroup sees a key in the second half of its last block (n_blocks
    // - 1): causal, the warpgroup's last diagonal falls in the first half (every other warpgroup
    // of a 64-row-aligned tile with B_c 128), or the keys end there. That block's mask, softmax,
    // P conversion and P V then take its first B_c / 2 columns only: its masked second half's
    // probabilities are zeros. Q K^T keeps one width (a second wgmma shape in the loop makes
    // ptxas serialise the kernel's wgmmas, NOTES.md item 233).
    CF_DEVICE bool narrow_last(int n_blocks) const {
        if constexpr (Cfg::HALF_LAST) {
            const int last_row = wg_last_row();
            int last_key = tile.seq_len_k(p) - 1;
            if constexpr (CAUSAL) last_key = min(last_key, last_row + tile.seq_len_k(p) - tile.seq_len_q(p));
            return warp_uniform(last_key - (n_blocks - 1) * Cfg::BC < Cfg::BC / 2);
        }
        return false;
    }

    // Block 0 of the tile: S_0 = Q K_0^T, masked, its statistics started; `s` holds its
    // probabilities.
    CF_DEVICE void first_block(Scores& s, int n_blocks, float (&rescale)[1][2]) {
        const int first = ring_stage(ring_base, Cfg::STAGES);
        mbarrier_wait(smem.k_full(first), ring_phase(ring_base, Cfg::STAGES));
        wait_turn();
        issue_qk(s, first);
        pass_turn(false);
        wgmma_wait<0>();
        fence_registers(s[0]);
        release_k(first);
        q_read(0, n_blocks);
        probabilities<true, false>(s, 0, rescale);
    }

    // Blocks 1 .. n_blocks - 1, P_0 in `pa`: S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued
    // back to back; the softmax of S_j runs while P V is on the tensor cores. O is rescaled by
    // block j-1's factor between the two issues (P V_{j-2} has completed, and the Q K^T just
    // issued does not touch O). Leaves P of the last block in `pa`, its factor in `rescale`.
    // `half` (narrow_last): the last block takes its own copy of the step, whole (a branch that
    // merges while a wgmma is in flight serialises them, C7515).
    template <class Refill>
    CF_DEVICE void middle_blocks(Scores& s, int n_blocks, float (&rescale)[1][2], Refill& refill, bool half = false) {
        const int full = Cfg::HALF_LAST && half ? n_blocks - 1 : n_blocks;
        for (int j = 1; j < full; ++j) middle_block<false>(s, j, n_blocks, rescale, refill);
        if constexpr (Cfg::HALF_LAST)
            if (half && n_blocks > 1) middle_block<true>(s, n_blocks - 1, n_blocks, rescale, refill);
    }
    template <bool HALF, class Refill>
    CF_DEVICE void middle_block(Scores& s, int j, int n_blocks, float (&rescale)[1][2], Refill& refill) {
        const int stage = ring_stage(ring_base + j, Cfg::STAGES);
        const int prev = ring_stage(ring_base + j - 1, Cfg::STAGES);
        mbarrier_wait(smem.k_full(stage), ring_phase(ring_base + j, Cfg::STAGES));
        wait_turn();
        issue_qk(s, stage);
        if (j > 1) rescale_output(rescale);  // block j-1's factor (block 0 has none)
        mbarrier_wait(smem.v_full(prev), ring_phase(ring_base + j - 1, Cfg::STAGES));
        issue_pv(prev);
        pass_turn(false);
        wgmma_wait<1>();  // S_j is ready; P V_{j-1} may still run
        fence_registers(s[0]);
        release_k(stage);
        q_read(j, n_blocks);
        probabilities<false, HALF>(s, j, rescale);
        wgmma_wait<0>();
        fence_registers(o);
        release_v(prev);
        refill(j - 1);
        stage_p<HALF>(s);
    }

    // The last block's P V, issued in its own turn, then completed (O final). HALF: its first
    // B_c / 2 keys (narrow_last).
    template <bool HALF = false>
    CF_DEVICE void last_pv(int n_blocks, bool ends_tile = true) {
        const int last_slot = ring_base + n_blocks - 1, last = ring_stage(last_slot, Cfg::STAGES);
        mbarrier_wait(smem.v_full(last), ring_phase(last_slot, Cfg::STAGES));
        if (ends_tile) clear_rows_past_end(n_blocks - 1, n_blocks, last);
        wait_turn();
        issue_pv<HALF ? PV_STEPS / 2 : PV_STEPS>(last);
        pass_turn(ends_tile);
        complete_pv(last);
    }
    CF_DEVICE void complete_pv(int stage) {
        wgmma_wait<0>();
        fence_registers(o);
        release_v(stage);
    }

    template <class Refill>
    CF_DEVICE void run_overlapped(int n_blocks, Refill& refill, bool ends_tile = true) {
        Scores s;
        float rescale[1][2];
        // narrow_last: a tile's only block keeps its whole softmax (its P past the first half is 0
        // all the same; a narrow first block in a branch serialises the kernel's wgmmas, C7511)
        // and takes the narrow P V.
        const bool half = narrow_last(n_blocks);
        first_block(s, n_blocks, rescale);
        stage_p(s);
        middle_blocks(s, n_blocks, rescale, refill, half);
        if (n_blocks > 1) rescale_output(rescale);
        if (Cfg::HALF_LAST && half) last_pv<true>(n_blocks, ends_tile);
        else last_pv(n_blocks, ends_tile);
        refill(n_blocks - 1);
    }

    // CROSS_TILE (persistent, two Q tiles, the turn ring): the tile's last P V is issued behind
    // the next tile's first Q K^T, whose softmax statistics (into `next_softmax`) run while P V
    // completes; the epilogue then follows, and the next tile starts at its second block. With
    // `have_first` this tile's first block was computed so by the previous call: `s` holds its
    // probabilities, the consumer's softmax its statistics (copied from next_softmax). Returns
    // whether the next tile's first block is in `s` (it has key blocks).
    CF_DEVICE bool run_crossed(int n_blocks, Scores& s, bool have_first, const TileScheduler<Cfg, CAUSAL>& next,
                               int next_blocks, Softmax& next_softmax) {
        float rescale[1][2];
        if (!have_first) {
            mbarrier_wait(smem.q_full(q_buffer<Cfg>(tile_iter)), q_phase<Cfg>(tile_iter));
            if (n_blocks <= 0) {
                release_q_early();
                return false;
            }
            first_block(s, n_blocks, rescale);
        } else if (n_blocks == 1) {
            release_q_early();
        }
        stage_p(s);
        auto no_refill = [](int) {};
        middle_blocks(s, n_blocks, rescale, no_refill);
        if (n_blocks > 1) rescale_output(rescale);
        if (!next.valid || next_blocks <= 0) {
            last_pv(n_blocks);
            return false;
        }
        const int last_slot = ring_base + n_blocks - 1, last = ring_stage(last_slot, Cfg::STAGES);
        const int next_iter = tile_iter + 1, next_slot = ring_base + n_blocks;
        const int stage = ring_stage(next_slot, Cfg::STAGES);
        mbarrier_wait(smem.q_full(q_buffer<Cfg>(next_iter)), q_phase<Cfg>(next_iter));
        mbarrier_wait(smem.k_full(stage), ring_phase(next_slot, Cfg::STAGES));
        if constexpr (Cfg::VARLEN) {  // outside the turn, which the GEMMs below take
            mbarrier_wait(smem.v_full(last), ring_phase(last_slot, Cfg::STAGES));
            clear_rows_past_end(n_blocks - 1, n_blocks, last);
        }
        wait_turn();
        issue_qk(s, stage, next_iter);
        mbarrier_wait(smem.v_full(last), ring_phase(last_slot, Cfg::STAGES));
        issue_pv(last);
        pass_turn(true);
        wgmma_wait<1>();  // the next tile's S is ready; this tile's last P V may still run
        fence_registers(s[0]);
        release_k(stage);
        const int next_row0 = next.first_row() + wg * Cfg::WG_ROWS;
        Softmax::mask(s, next.seq_len_q(p), next.seq_len_k(p), 0, next_row0, next_row0 + 16 * warp + (lane >> 2), lane);
        next_softmax.init();
        next_softmax.stats.template update<true>(s, rescale, p.softmax_scale, p.softmax_scale_log2);
        complete_pv(last);
        return true;
    }
};
