// Longest-first launch order (the Hopper families' `lpt` knobs). The hardware starts CTAs in
// linear block order, so the first ones should get the longest tiles. `linear` runs over the
// `ranks` tiles of each of `pairs` (head, batch) pairs, rank fastest (rank 0: the pair's longest
// tile). It is re-cut into chunks of `per` pairs (those whose data fit the caller's L2 budget):
// inside a chunk rank 0 of every pair comes first, then rank 1, ... The chunk keeps what the
// CTAs running together read inside L2.
#pragma once

struct LaunchSlot {
    int pair, rank;
};

CF_DEVICE LaunchSlot longest_first_slot(int linear, int ranks, int pairs, int per) {
    const int chunk = linear / (per * ranks), r = linear % (per * ranks);
    const int in_chunk = min(per, pairs - chunk * per);  // the last chunk may be smaller
    return {chunk * per + r % in_chunk, r / in_chunk};
}
