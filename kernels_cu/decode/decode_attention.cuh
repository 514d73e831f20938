// Split-KV decode attention (flash-decoding) with GQA packing and an optional page table.
//
// Grid (num_splits, head_blocks * row_tiles, batch), head_blocks = ceil(n_kv_heads / HEADS). A
// CTA reads the keys of its split of HEADS KV heads once for every query row of each head's
// group: rows r = t * group + g (query position t, group member g) form the M dimension of
// mma.m16n8k16, so a GQA group of 4 with one query costs the same K/V traffic as a single head.
// Warp w serves head slot w % HEADS and, within that slot's team of TEAM warps, takes the split's
// steps of B_c keys w / HEADS, w / HEADS + TEAM, ...; each warp keeps its own cp.async ring of
// STAGES slots and its own online softmax (so the loop has only warp-level synchronisation), and
// a team's states merge at the end through shared memory. One split writes O directly; several write fp32 partial rows plus
// their log-sum-exp to a workspace that decode_combine_kernel merges.
//
// k_new / v_new (seq_new rows per sequence) are appended here too, not by a kernel of their own: the
// CTAs of split 0 and row tile 0 write them into the cache at cache_seqlens[b] .. + seq_new - 1, and
// every CTA reads keys from those positions out of k_new / v_new instead of the cache. No CTA reads
// a cache row this call writes, so the writes need no ordering against the reads, and a decode
// step with an append is one launch (two with a combine) instead of two (three).
#pragma once

template <class Cfg, bool CAUSAL, bool PAGED>
struct DecodeCTA {
    using Softmax = OnlineSoftmax<Cfg::M_TILES, Cfg::S_N_TILES, true>;
    using KVTile = typename Cfg::KVTile;
    using QTile = typename Cfg::QTile;
    // Paged: the warp's page list lives in its lanes, one 16-key sub-block's page index a lane:
    // a list covers LIST_STEPS consecutive steps of the warp, and the next list is read a whole
    // list ahead (see pages_for).
    static constexpr int LIST_STEPS = 32 / Cfg::SUB_BLOCKS;

    const DecodeParams& p;
    const int tid, lane, warp;
    const int slot_head, team_warp;  // head slot (warp % HEADS) and index within its team
    const int batch, head_block, kv_head, row_tile, split;
    bool head_valid;           // kv_head < n_kv_heads (the last head block may be partial)
    int cache_len;             // rows already in the cache (keys at and past it come from k_new / v_new)
    int seqlen_k;              // keys of the sequence (cache + appended)
    int key_begin, key_end;    // this CTA's keys: [key_begin, key_end) (INTERLEAVE: every
                               // num_splits-th step of [0, key_end), from step `split` on)
    int my_steps;              // warp steps this warp processes
    int active;                // warps of each team that take at least one step (a prefix)
    int page_list, next_list;  // paged: the pages of this warp's steps, lane-wise (pages_for)
    const u16* k_base;         // K cache at (kv_head, and batch when contiguous)
    const u16* v_base;
    u64 policy;
    QTile q_tile;
    KVTile k_tile0, v_tile0;   // slot 0 of this warp's ring
    typename QTile::Cursor q_frag;
    typename KVTile::Cursor k_frag, v_frag;

    float o_acc[Cfg::M_TILES][Cfg::O_N_TILES][4];
    int diag[Cfg::M_TILES][2];  // causal: last key visible to each of this lane's rows
    Softmax softmax;

    CF_DEVICE DecodeCTA(const DecodeParams& params, unsigned char* smem)
        : p(params),
          tid(threadIdx.x),
          lane(threadIdx.x & 31),
          warp(threadIdx.x >> 5),
          slot_head((threadIdx.x >> 5) % Cfg::HEADS),
          team_warp((threadIdx.x >> 5) / Cfg::HEADS),
          batch(blockIdx.z),
          head_block(blockIdx.y / params.row_tiles),
          kv_head(blockIdx.y / params.row_tiles * Cfg::HEADS + (threadIdx.x >> 5) % Cfg::HEADS),
          row_tile(blockIdx.y % params.row_tiles),
          split(blockIdx.x) {
        cache_len = p.cache_seqlens[batch];
        // INTERLEAVE: this warp's first step keys do not depend on the length, so the page-table
        // reads for them go out now, beside the cache_seqlens read (entries below max_keys are
        // inside the table; those past the sequence are read but never used).
        if constexpr (PAGED && Cfg::INTERLEAVE) {
            page_list = load_list(0, p.max_keys);
            next_list = load_list(LIST_STEPS, p.max_keys);
        }
        seqlen_k = cache_len + p.seq_new;
        // Keys the tile can see: all of them, or under causal masking (bottom-right aligned) up to
        // the diagonal of its last query position.
        int limit = seqlen_k;
        if constexpr (CAUSAL) {
            const int last_row = min(p.rows_total, (row_tile + 1) * Cfg::ROWS) - 1;
            limit = max(0, min(seqlen_k, seqlen_k - p.seq_q + last_row / p.group + 1));
        }
        head_valid = kv_head < p.n_kv_heads;
        if constexpr (Cfg::INTERLEAVE) {
            // Step g of the sequence goes to split g % num_splits; warp j of the team takes the
            // split's steps j, j + TEAM, ...: global steps split + num_splits * (j + TEAM * k).
            key_begin = 0;
            key_end = limit;
            const int steps = (limit + Cfg::BC - 1) / Cfg::BC;
            const int mine = steps > split ? (steps - 1 - split) / p.num_splits + 1 : 0;  // this split's steps
            active = min(Cfg::TEAM, mine);
            my_steps = head_valid && mine > team_warp ? (mine - 1 - team_warp) / Cfg::TEAM + 1 : 0;
        } else {
            // Even splits of whole warp steps, per sequence (lengths live on the GPU only).
            const int per_split = ((limit + p.num_splits - 1) / p.num_splits + Cfg::BC - 1) / Cfg::BC * Cfg::BC;
            key_begin = min(limit, split * per_split);
            key_end = min(limit, key_begin + per_split);
            const int steps = (key_end - key_begin + Cfg::BC - 1) / Cfg::BC;
            active = min(Cfg::TEAM, steps);
            my_steps = head_valid && steps > team_warp ? (steps - 1 - team_warp) / Cfg::TEAM + 1 : 0;
        }

        const long long k_off = PAGED ? 0 : batch * p.k_batch_stride;
        const long long v_off = PAGED ? 0 : batch * p.v_batch_stride;
        const int head = head_valid ? kv_head : 0;  // a warp of a missing head loads nothing
        k_base = static_cast<const u16*>(p.k_cache) + k_off + head * p.k_head_stride;
        v_base = static_cast<const u16*>(p.v_cache) + v_off + head * p.v_head_stride;
        if constexpr (Cfg::EVICT_FIRST) policy = l2_evict_first_policy();

        const u32 base = shared_address(smem);
        q_tile.base = base + slot_head * QTile::BYTES;
        k_tile0.base = base + Cfg::Q_BYTES + warp * Cfg::WARP_BYTES;
        v_tile0.base = k_tile0.base + KVTile::BYTES;
        q_frag = a_fragment_cursor(q_tile, 0, lane);
        k_frag = b_fragment_cursor(k_tile0, lane);
        v_frag = b_transposed_fragment_cursor(v_tile0, lane);

#pragma unroll
        for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
            for (int n = 0; n < Cfg::O_N_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[m][n][e] = 0.f;
        softmax.init();
        if constexpr (CAUSAL) {
#pragma unroll
            for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = row_tile * Cfg::ROWS + 16 * m + 8 * h + (lane >> 2);
                    // rows past the group's end are padding: let them see everything
                    diag[m][h] = row < p.rows_total ? seqlen_k - p.seq_q + row / p.group : 0x3fffffff;
                }
        }
    }

    // First key of this warp's k-th step.
    CF_DEVICE int step_key(int k) const {
        if constexpr (Cfg::INTERLEAVE) return interleaved_key(k);
        return key_begin + (team_warp + k * Cfg::TEAM) * Cfg::BC;
    }
    CF_DEVICE int interleaved_key(int k) const {
        return (split + p.num_splits * (team_warp + k * Cfg::TEAM)) * Cfg::BC;
    }

    // ---- loads ----
    // The Q tiles of all head slots (rows of heads past n_kv_heads and past the group are zeros).
    CF_DEVICE void load_q() {
        constexpr int CHUNKS = Cfg::ROWS * Cfg::CHUNKS_PER_ROW;
        const u16* q = static_cast<const u16*>(p.q) + batch * p.q_batch_stride;
        const u32 base = q_tile.base - slot_head * QTile::BYTES;
        for (int idx = tid; idx < Cfg::HEADS * CHUNKS; idx += Cfg::N_THREADS) {
            const int hs = idx / CHUNKS, rest = idx % CHUNKS;
            const int row = rest / Cfg::CHUNKS_PER_ROW, chunk = rest % Cfg::CHUNKS_PER_ROW;
            const int packed = row_tile * Cfg::ROWS + row;
            const int kvh = head_block * Cfg::HEADS + hs;
            const bool valid = packed < p.rows_total && kvh < p.n_kv_heads;
            const int t = packed / p.group;
            const int head = kvh * p.group + (packed - t * p.group);
            const u16* src = q + t * p.q_seq_stride + head * p.q_head_stride + chunk * 8;
            QTile tile;
            tile.base = base + hs * QTile::BYTES;
            cp_async_16(tile.lane_address(row, chunk), valid ? src : q, valid);
        }
    }

    // The page list of this warp's steps first .. first + LIST_STEPS - 1: lane i holds the page of
    // sub-block i % SUB_BLOCKS of step first + i / SUB_BLOCKS (0 at and past `bound`, never read
    // from the table). One coalesced read per list instead of one per step.
    CF_DEVICE int load_list(int first, int bound) const {
        int page = 0;
        if constexpr (PAGED) {
            const int sub_key = step_key(first + lane / Cfg::SUB_BLOCKS) + 16 * (lane % Cfg::SUB_BLOCKS);
            if (sub_key < bound) page = p.block_table[batch * p.block_table_stride + (sub_key >> p.page_shift)];
        }
        return page;
    }

    // The pages of step s's sub-blocks in every lane, for s = 0, 1, 2, ... in turn (the steps
    // are issued in order). Crossing into a new list takes the one read a list earlier (landed
    // long ago: a register still waiting for its load must not even be moved, or the warp stalls
    // there) and reads the one after it.
    struct StepPages {
        int page[Cfg::SUB_BLOCKS];
    };
    CF_DEVICE StepPages pages_for(int s) {
        StepPages sp;
        if constexpr (PAGED) {
            const int at = s & (LIST_STEPS - 1);
            if (at == 0 && s > 0) {
                page_list = next_list;
                next_list = load_list(s + LIST_STEPS, key_end);
            }
#pragma unroll
            for (int j = 0; j < Cfg::SUB_BLOCKS; ++j)
                sp.page[j] = __shfl_sync(0xffffffffu, page_list, at * Cfg::SUB_BLOCKS + j);
        } else {
#pragma unroll
            for (int j = 0; j < Cfg::SUB_BLOCKS; ++j) sp.page[j] = 0;
        }
        return sp;
    }

    // One step's K/V rows into ring slot `slot`. NEW: the step reaches the appended rows (key +
    // B_c > cache_len), which are read from k_new / v_new; the hot path (NEW false) has no such test.
    template <bool NEW>
    CF_DEVICE void load_step(int key, int slot, const StepPages& sp) {
        const u32 slot_offset = slot * Cfg::STAGE_BYTES;
        const int row0 = lane / Cfg::CHUNKS_PER_ROW, chunk = lane % Cfg::CHUNKS_PER_ROW;
        // Paged: the element offset of each 16-key sub-block's first row (its page's row
        // key & page_mask; a sub-block never straddles a page, page sizes being multiples of 16),
        // one wide multiply per sub-block rather than per copy pass (d_head 256 copies one row
        // per pass: 16 passes of the same page).
        long long k_sub[Cfg::SUB_BLOCKS], v_sub[Cfg::SUB_BLOCKS];
        if constexpr (PAGED) {
            const int page_mask = (1 << p.page_shift) - 1;
#pragma unroll
            for (int j = 0; j < Cfg::SUB_BLOCKS; ++j) {
                const long long page = sp.page[j];
                const long long first = (key + 16 * j) & page_mask;
                k_sub[j] = page * p.k_batch_stride + first * p.k_seq_stride;
                v_sub[j] = page * p.v_batch_stride + first * p.v_seq_stride;
            }
        }
#pragma unroll
        for (int i = 0; i < Cfg::COPY_PASSES; ++i) {
            const int row = row0 + i * Cfg::ROWS_PER_PASS;
            const int k = key + row;
            const bool valid = k < key_end;
            long long k_off, v_off;
            if constexpr (PAGED) {
                // the pass's rows lie in one 16-key sub-block, hence one page
                const int J = (i * Cfg::ROWS_PER_PASS) / 16;  // a constant once unrolled
                k_off = k_sub[J] + (row - 16 * J) * p.k_seq_stride;
                v_off = v_sub[J] + (row - 16 * J) * p.v_seq_stride;
            } else {
                k_off = k * p.k_seq_stride;
                v_off = k * p.v_seq_stride;
            }
            const u16* k_src = valid ? k_base + k_off + chunk * 8 : k_base;
            const u16* v_src = valid ? v_base + v_off + chunk * 8 : v_base;
            if constexpr (NEW) {
                if (valid && k >= cache_len) {
                    const int t = k - cache_len;
                    const int head = head_valid ? kv_head : 0;
                    k_src = static_cast<const u16*>(p.k_new) + batch * p.knew_batch_stride + t * p.knew_seq_stride +
                            head * p.knew_head_stride + chunk * 8;
                    v_src = static_cast<const u16*>(p.v_new) + batch * p.vnew_batch_stride + t * p.vnew_seq_stride +
                            head * p.vnew_head_stride + chunk * 8;
                }
            }
            const u32 k_dst = k_tile0.lane_address(row, chunk) + slot_offset;
            const u32 v_dst = v_tile0.lane_address(row, chunk) + slot_offset;
            if constexpr (Cfg::EVICT_FIRST) {
                cp_async_16_hinted(k_dst, k_src, valid, policy);
                cp_async_16_hinted(v_dst, v_src, valid, policy);
            } else {
                cp_async_16(k_dst, k_src, valid);
                cp_async_16(v_dst, v_src, valid);
            }
        }
    }

    // The step at `key`, through the appended-rows path only where the step reaches them (only
    // calls with k_new / v_new, APPEND, have such steps).
    template <bool APPEND>
    CF_DEVICE void issue_step(int key, int slot, const StepPages& sp) {
        if (APPEND && key + Cfg::BC > cache_len) {
            load_step<true>(key, slot, sp);
        } else {
            load_step<false>(key, slot, sp);
        }
    }

    // k_new / v_new -> cache rows cache_len .. cache_len + seq_new - 1 of this CTA's KV heads (through
    // the page table when PAGED), by the CTAs of split 0 and row tile 0: every (sequence, head block)
    // has exactly one. Plain 16-byte loads and stores; nothing in this grid reads these cache rows.
    CF_DEVICE void append_new_rows() const {
        constexpr int CPR = Cfg::CHUNKS_PER_ROW;
        if (p.seq_new == 0 || split != 0 || row_tile != 0) return;
        const int total = p.seq_new * Cfg::HEADS * CPR;
        for (int idx = tid; idx < total; idx += Cfg::N_THREADS) {
            const int chunk = idx % CPR, rest = idx / CPR;
            const int hs = rest % Cfg::HEADS, t = rest / Cfg::HEADS;
            const int head = head_block * Cfg::HEADS + hs;
            if (head >= p.n_kv_heads) continue;
            const int pos = cache_len + t;
            const long long k_dst = cache_row_offset<PAGED>(p, batch, pos, p.k_batch_stride, p.k_seq_stride) +
                                    head * p.k_head_stride + chunk * 8;
            const long long v_dst = cache_row_offset<PAGED>(p, batch, pos, p.v_batch_stride, p.v_seq_stride) +
                                    head * p.v_head_stride + chunk * 8;
            const u16* k_src = static_cast<const u16*>(p.k_new) + batch * p.knew_batch_stride +
                               t * p.knew_seq_stride + head * p.knew_head_stride + chunk * 8;
            const u16* v_src = static_cast<const u16*>(p.v_new) + batch * p.vnew_batch_stride +
                               t * p.vnew_seq_stride + head * p.vnew_head_stride + chunk * 8;
            st_global_16(static_cast<u16*>(p.k_cache) + k_dst, ld_global_16(k_src));
            st_global_16(static_cast<u16*>(p.v_cache) + v_dst, ld_global_16(v_src));
        }
    }

    // ---- one warp step: S = Q K^T, mask, online softmax, O += P V ----
    CF_DEVICE void compute_step(int key, int slot) {
        const u32 slot_offset = slot * Cfg::STAGE_BYTES;
        typename KVTile::Cursor kc = k_frag, vc = v_frag;
        kc.addr += slot_offset;
        vc.addr += slot_offset;

        float s[Cfg::M_TILES][Cfg::S_N_TILES][4];
#pragma unroll
        for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
            for (int n = 0; n < Cfg::S_N_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[m][n][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < Cfg::QK_K_STEPS; ++ks) {
            u32 a[Cfg::M_TILES][4];
#pragma unroll
            for (int m = 0; m < Cfg::M_TILES; ++m) load_a_fragment(a[m], q_tile, q_frag, 16 * m, ks);
            u32 b[Cfg::S_N_TILES][2];
#pragma unroll
            for (int n = 0; n < Cfg::S_N_TILES; n += 2) load_b_fragments(b[n], b[n + 1], k_tile0, kc, 8 * n, ks);
#pragma unroll
            for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
                for (int n = 0; n < Cfg::S_N_TILES; ++n) mma_m16n8k16<Cfg::dtype>(s[m][n], a[m], b[n][0], b[n][1]);
        }

        // Masks: keys past the split's end (only its last step has them) and, under causal
        // masking, keys after a row's diagonal (only steps reaching past the tile's first one).
        const int keys_valid = key_end - key;
        bool cut = keys_valid < Cfg::BC;
        if constexpr (CAUSAL) {
            const int first_diag = seqlen_k - p.seq_q + (row_tile * Cfg::ROWS) / p.group;
            cut = cut || key + Cfg::BC - 1 > first_diag;
        }
        if (cut) {
            mask_fragments(s, lane, [&](int m, int h, int col) {
                bool masked = col >= keys_valid;
                if constexpr (CAUSAL) masked |= key + col > diag[m][h];
                return masked;
            });
        }

        float rescale[Cfg::M_TILES][2];
        softmax.template update<false>(s, rescale, p.softmax_scale, p.softmax_scale_log2);
#pragma unroll
        for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
            for (int n = 0; n < Cfg::O_N_TILES; ++n) {
                o_acc[m][n][0] *= rescale[m][0];
                o_acc[m][n][1] *= rescale[m][0];
                o_acc[m][n][2] *= rescale[m][1];
                o_acc[m][n][3] *= rescale[m][1];
            }

#pragma unroll
        for (int ks = 0; ks < Cfg::PV_K_STEPS; ++ks) {
            u32 pa[Cfg::M_TILES][4];
#pragma unroll
            for (int m = 0; m < Cfg::M_TILES; ++m) {
                pa[m][0] = pack_pair<Cfg::dtype>(s[m][2 * ks][0], s[m][2 * ks][1]);
                pa[m][1] = pack_pair<Cfg::dtype>(s[m][2 * ks][2], s[m][2 * ks][3]);
                pa[m][2] = pack_pair<Cfg::dtype>(s[m][2 * ks + 1][0], s[m][2 * ks + 1][1]);
                pa[m][3] = pack_pair<Cfg::dtype>(s[m][2 * ks + 1][2], s[m][2 * ks + 1][3]);
            }
#pragma unroll
            for (int n = 0; n < Cfg::O_N_TILES; n += 2) {
                u32 b0[2], b1[2];
                load_b_fragments_transposed(b0, b1, v_tile0, vc, 8 * n, ks);
#pragma unroll
                for (int m = 0; m < Cfg::M_TILES; ++m) {
                    mma_m16n8k16<Cfg::dtype>(o_acc[m][n], pa[m], b0[0], b0[1]);
                    mma_m16n8k16<Cfg::dtype>(o_acc[m][n + 1], pa[m], b1[0], b1[1]);
                }
            }
        }
    }

    // ---- the warp's pipelined walk over its steps ----
    // Two copies of the walk, one per launch: a call without k_new / v_new runs the one without
    // the appended-rows copy path, which keeps the hot loop's code small (see below).
    CF_DEVICE void run() {
        if (p.seq_new > 0) {
            walk<true>();
        } else {
            walk<false>();
        }
        append_new_rows();
        merge_and_store();
    }

    template <bool APPEND>
    CF_DEVICE void walk() {
        load_q();
        cp_async_commit();
        // Paged: the first two page lists (INTERLEAVE: read in the constructor).
        if constexpr (PAGED && !Cfg::INTERLEAVE) {
            page_list = load_list(0, key_end);
            next_list = load_list(LIST_STEPS, key_end);
        }
#pragma unroll
        for (int s = 0; s < Cfg::STAGES - 1; ++s) {
            const StepPages sp = pages_for(s);
            if (s < my_steps) issue_step<APPEND>(step_key(s), s, sp);
            cp_async_commit();  // possibly empty: keeps the group count uniform for the waits
        }
        cp_async_wait<Cfg::STAGES - 1>();  // this thread's Q copies have landed
        __syncthreads();                    // ... and every thread's

        int issue_slot = Cfg::STAGES - 1, compute_slot = 0;
        for (int k = 0; k < my_steps; ++k) {
            // Issue step k + STAGES - 1 (the copies and compute_step exist once in the loop: three
            // copies of them, one per page register as before item 69, missed the instruction
            // cache).
            const int issue = k + Cfg::STAGES - 1;
            const StepPages sp = pages_for(issue);
            if (issue < my_steps) issue_step<APPEND>(step_key(issue), issue_slot, sp);
            cp_async_commit();
            cp_async_wait<Cfg::STAGES - 1>();  // step k has landed (this lane's copies)
            __syncwarp();                       // ... and the whole warp's
            compute_step(step_key(k), compute_slot);
            __syncwarp();  // every lane has read the slot before the next iteration refills it
            issue_slot = issue_slot + 1 == Cfg::STAGES ? 0 : issue_slot + 1;
            compute_slot = compute_slot + 1 == Cfg::STAGES ? 0 : compute_slot + 1;
        }
        cp_async_wait<0>();
    }


    // ---- merge the warps' softmax states, then write O (or the split's partial) and LSE ----
    // Each warp rescales its output rows to the CTA's row maxima and stores them in its own fp32
    // slice (no shared-memory atomics: fp32 atomic adds on shared memory are compare-and-swap
    // loops); the output pass sums the slices of the warps that saw keys.
    CF_DEVICE void merge_and_store() {
        constexpr int ROWS = Cfg::ROWS;
        float row_sum[Cfg::M_TILES][2];
        softmax.finish(row_sum);
        __syncthreads();  // every warp is done with its K/V ring, which the merge area reuses
        constexpr int H = Cfg::HEADS, TEAM = Cfg::TEAM;
        float* merge = reinterpret_cast<float*>(smem_generic() + Cfg::Q_BYTES);
        float* warp_max_rows = merge;                          // [N_WARPS][ROWS]
        float* warp_sum_rows = merge + Cfg::N_WARPS * ROWS;     // [N_WARPS][ROWS]
        float* final_max = merge + 2 * Cfg::N_WARPS * ROWS;     // [HEADS][ROWS]
        float* final_sum = final_max + H * ROWS;                // [HEADS][ROWS]
        float* slices = final_sum + H * ROWS;                   // [N_WARPS][ROWS][O_STRIDE]
        if ((lane & 3) == 0) {
#pragma unroll
            for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = 16 * m + 8 * h + (lane >> 2);
                    warp_max_rows[warp * ROWS + row] = softmax.row_max[m][h];
                    warp_sum_rows[warp * ROWS + row] = row_sum[m][h];
                }
        }
        __syncthreads();

        // Warp w of head slot hs is hs + H * j (team member j); team members j < active took
        // steps (they are handed out round-robin from member 0).
        for (int hr = tid; hr < H * ROWS; hr += Cfg::N_THREADS) {
            const int hs = hr / ROWS, r = hr % ROWS;
            float mx = CF_NEG_INF;
#pragma unroll
            for (int j = 0; j < TEAM; ++j) mx = fmaxf(mx, warp_max_rows[(hs + H * j) * ROWS + r]);
            float total = 0.f;
            if (mx != CF_NEG_INF) {
#pragma unroll
                for (int j = 0; j < TEAM; ++j)
                    total += warp_sum_rows[(hs + H * j) * ROWS + r] *
                             fast_exp2((warp_max_rows[(hs + H * j) * ROWS + r] - mx) * p.softmax_scale_log2);
            }
            final_max[hr] = mx;
            final_sum[hr] = total;
        }
        if (team_warp < active) {
            float* slice = slices + warp * ROWS * Cfg::O_STRIDE;
#pragma unroll
            for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = 16 * m + 8 * h + (lane >> 2);
                    float mx = CF_NEG_INF;
#pragma unroll
                    for (int j = 0; j < TEAM; ++j) mx = fmaxf(mx, warp_max_rows[(slot_head + H * j) * ROWS + row]);
                    const float mine = softmax.row_max[m][h];
                    const float scale = mine == CF_NEG_INF ? 0.f : fast_exp2((mine - mx) * p.softmax_scale_log2);
                    float* dst = slice + row * Cfg::O_STRIDE + 2 * (lane & 3);
#pragma unroll
                    for (int n = 0; n < Cfg::O_N_TILES; ++n)
                        *reinterpret_cast<float2*>(dst + 8 * n) =
                            make_float2(o_acc[m][n][2 * h] * scale, o_acc[m][n][2 * h + 1] * scale);
                }
        }
        __syncthreads();

        // 8 output elements per thread and pass: rows of the tile that are real (packed row <
        // rows_total), to O (one split) or to the split's fp32 partial rows.
        constexpr int CPR = Cfg::CHUNKS_PER_ROW;
        for (int idx = tid; idx < H * ROWS * CPR; idx += Cfg::N_THREADS) {
            const int hs = idx / (ROWS * CPR), rest = idx % (ROWS * CPR);
            const int row = rest / CPR, chunk = rest % CPR;
            const int packed = row_tile * ROWS + row;
            const int kvh = head_block * H + hs;
            if (packed >= p.rows_total || kvh >= p.n_kv_heads) continue;
            const int t = packed / p.group;
            const int head = kvh * p.group + (packed - t * p.group);
            const float total = final_sum[hs * ROWS + row];
            const float inv = total > 0.f ? 1.f / total : 0.f;
            float4 x0 = make_float4(0.f, 0.f, 0.f, 0.f), x1 = x0;
            for (int j = 0; j < active; ++j) {
                const float* src = slices + ((hs + H * j) * ROWS + row) * Cfg::O_STRIDE + chunk * 8;
                const float4 a = *reinterpret_cast<const float4*>(src);
                const float4 b = *reinterpret_cast<const float4*>(src + 4);
                x0.x += a.x; x0.y += a.y; x0.z += a.z; x0.w += a.w;
                x1.x += b.x; x1.y += b.y; x1.z += b.z; x1.w += b.w;
            }
            // (batch, t, head) row index of the partial-output workspace and the combine kernel
            const long long out_row = ((long long)batch * p.seq_q + t) * p.n_heads + head;
            if (p.num_splits == 1) {
                uint4 v;
                v.x = pack_pair<Cfg::dtype>(x0.x * inv, x0.y * inv);
                v.y = pack_pair<Cfg::dtype>(x0.z * inv, x0.w * inv);
                v.z = pack_pair<Cfg::dtype>(x1.x * inv, x1.y * inv);
                v.w = pack_pair<Cfg::dtype>(x1.z * inv, x1.w * inv);
                u16* o = static_cast<u16*>(p.o) + batch * p.o_batch_stride + t * p.o_seq_stride +
                         head * p.o_head_stride + chunk * 8;
                st_global_16(o, v);
            } else {
                float* dst = p.ws_o + ((long long)split * p.total_rows + out_row) * Cfg::D + chunk * 8;
                *reinterpret_cast<float4*>(dst) = make_float4(x0.x * inv, x0.y * inv, x0.z * inv, x0.w * inv);
                *reinterpret_cast<float4*>(dst + 4) = make_float4(x1.x * inv, x1.y * inv, x1.z * inv, x1.w * inv);
            }
            if (chunk == 0) {
                const float lse = total > 0.f ? final_max[hs * ROWS + row] * p.softmax_scale + __logf(total) : CF_NEG_INF;
                if (p.num_splits == 1) {
                    if (p.lse != nullptr) p.lse[((long long)batch * p.n_heads + head) * p.seq_q + t] = lse;
                } else {
                    p.ws_lse[(long long)split * p.total_rows + out_row] = lse;
                }
            }
        }
    }

    CF_DEVICE static unsigned char* smem_generic();
};

extern __shared__ __align__(1024) unsigned char cf_decode_smem[];

template <class Cfg, bool CAUSAL, bool PAGED>
CF_DEVICE unsigned char* DecodeCTA<Cfg, CAUSAL, PAGED>::smem_generic() {
    return cf_decode_smem;
}

template <class Cfg, bool CAUSAL, bool PAGED>
__global__ void __launch_bounds__(Cfg::N_THREADS, 1) decode_attention_kernel(const __grid_constant__ DecodeParams params) {
    pdl_launch_dependents();    // the combine kernel may launch (it waits for this grid's results)
    pdl_wait_for_predecessor();  // the append kernel's rows are in the cache
    DecodeCTA<Cfg, CAUSAL, PAGED> cta(params, cf_decode_smem);
    cta.run();
}
