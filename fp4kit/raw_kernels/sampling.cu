// Token sampling: one draw per row from softmax(logits / T) truncated by top-k, top-p and min-p.
// fp4kit/reference/sampling.py is the specification (filter order, tie rules, special rows, the
// Philox counter layout and the Gumbel race).
//
// Arguments (row-major, contiguous):
//   logits    bf16 | fp32 [B, V]   any finite, +-inf or NaN values (NaN is read as -inf)
//   B, V, per, G                   rows; vocabulary; tokens per thread (a multiple of 4, <= the build's P);
//                                  blocks per row (G * kThreads * per >= V)
//   t_rows    fp32  [B] or null    per-row temperature; null: every row uses t_all
//   k_rows    int32 [B] or null    per-row top_k (0: off); null: k_all
//   p_rows    fp32  [B] or null    per-row top_p (1: off); null: p_all
//   m_rows    fp32  [B] or null    per-row min_p (0: off); null: m_all
//   seed      uint64 [1]           Philox key (lo word, hi word)
//   offset    uint64 [1]           Philox counter words 2 and 3; advanced by one per launch, on the
//                                  device, by the last block to arrive
//   arrivals  uint32 [1]           0 between launches: counts the blocks that have read `offset`
//   scratch   uint32 [R * (kRowWords + 2 * smp_gather_slots(G))]  0 between launches: the counters,
//                                  histograms, candidates and gather slots of the row each group
//                                  of G blocks is working on; the last block of a row to finish
//                                  puts them back to 0
//   out       int32 [B]            the drawn token ids, always in [0, V)
//   status    uint32 [1]           FP4_STATUS_SAMPLER_INPUT (8) is or-ed in for a NaN or +inf logit, a row
//                                  with no finite logit, or an invalid per-row parameter
//
// Geometry: a cooperative launch (every block resident, so blocks may wait for each other) of
// R * G blocks of kThreads threads; blocks g*G .. g*G+G-1 handle rows g, g + R, g + 2R, ... (one
// per round; a round starts once the previous round's finisher has cleared the scratch). Block
// c of a row holds tokens [c * kThreads * per, ...) in registers, thread t the `per` consecutive
// tokens from t * per (so a Philox call covers 4 tokens of one thread). The row is read once.
// The G blocks of a row meet at row barriers (a counter in the row's scratch):
//   1. max / argmax of the canonical logits: block maxima -> atomicMax -> barrier. Greedy rows
//      (T == 0) skip the barrier: the finisher (below) writes the argmax.
//      d_i = (l_i - l_max) * (1 / T) <= 0 from here on; tokens are ordered by the composite
//      key(d_i) << 32 | ~i (larger d first, equal d: lower id first), every filter keeps a prefix
//      of that order, so a filter is one threshold `theta` on the composite.
//   2. top-k (by count), then top-p (by mass, target ceil(p * mass(top-k))): a histogram of 1024
//      bins of width 1/32 in d (36-bit fixed-point masses exp(d) * 2^36, counts; masses only when
//      top-p is on), block-local in shared memory, summed into the row's global histogram by
//      fire-and-forget reductions, barrier, a scan finds the boundary bin. If it holds more than kCap tokens (ties, clusters, the d < -32 tail), radix
//      passes over the 8 composite bits below the highest bit that varies within it narrow it.
//      For top-k followed by top-p, the top-k bucket's tokens are appended to a candidate list,
//      barrier, and every block finds the exact boundary token among them (in-block radix passes
//      on the bits that vary among them, then one warp ranks the last <= 32): top-p's target
//      needs the top-k mass. The last filter's cut is
//      deferred to step 3 instead, saving a barrier.
//      A top-k row whose k * G fit its gather slots (k <= 64 at G = 127, the batch-1 split of a
//      129280-token vocabulary) skips this step and step 3 (smp_gather): the blocks post their
//      largest thread maxima with the maximum, the k-th largest posted logit bounds the row's k
//      best, each block sends its tokens above the bound (at most its own k best), and the row's
//      finisher cuts them (top-k, then top-p over the survivors) and races the survivors. With
//      top-p after the top-k always; a top-k alone when the bound holds (see "top-k by gathering").
//   3. race: each kept token's exp(d_i) / -log(u_i) (the exponential race; its log is the
//      reference's d_i - log(-log u_i); u from Philox, min-p checked as exp(d) >= m),
//      block maxima of the tokens above the last filter's bucket -> atomicMax; the bucket's tokens
//      go to the candidate list with their race keys. The last block of the row to arrive cuts
//      the candidates exactly, writes the best kept token (the argmax for special rows) and puts
//      the row's scratch back to zero for the next launch.
// Masses and counts are integers and the maxima are order-independent, so the result does not
// depend on the order of the atomics: the same seed and offset give the same tokens. The seed and
// offset are read by thread 0 of every block while its tokens load; the grid's last block to
// arrive advances the offset at its end.
#include <cuda_bf16.h>

#include "common/gpu_sync.cuh"
#include "common/philox.cuh"
#include "common/status.cuh"

#define SMP_NEG_INF __int_as_float(0xFF800000)
#define SMP_FLT_MIN 1.175494351e-38f

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPer = 16;                    // tokens per thread, held in registers
constexpr int kBins = 1024;                    // first-level histogram over d
constexpr float kBinsPerUnit = 32.0f;          // bin b < kBins-1 holds d in (-(b+1)/32, -b/32]
constexpr float kBinFloor = -31.96875f;        // d <= -(kBins-1)/32: the last bin (masses round to 0)
constexpr int kRadixBins = 256;                // refinement: 8 bits of the composite per pass
constexpr int kCap = 512;                      // a bucket this small is resolved exactly
constexpr int kCapEach = kCap / kThreads;
constexpr float kMassScale = 68719476736.0f;   // 2^36: V <= 2^24 tokens of mass <= 2^36 fit in 64 bits
constexpr int kMassSplit = 18;
// Gumbel numbers lie in [-2.82, 16.64] (u in [2^-24, 1 - 2^-24]) and the max token (d = 0) is
// always kept, so a token with d < -20 can never win the race: no Philox or logs for it.
constexpr float kNeverWins = -20.0f;

// Scratch per row in flight, in uint32 words (fp4kit/ops/sampling.py ROW_WORDS, allocates R * kRowWords).
constexpr int kHdrWords = 16;  // best u64, race u64, arrive, done, ncand[2], round, ngather, verdict, ack, front_over,
                               // cut_n, cut_rem u64
constexpr int kCountOff = kHdrWords;               // 3 histograms of kBins uint32 counts
constexpr int kMassOff = kCountOff + 3 * kBins;    // 3 histograms of kBins uint64 masses
constexpr int kCandOff = kMassOff + 6 * kBins;     // kCap (composite, race key) uint64 pairs
constexpr int kPostSlots = 256;                    // the blocks' posted thread maxima (smp_post_bound)
constexpr int kPostOff = kCandOff + 4 * kCap;
constexpr int kRowWords = kPostOff + kPostSlots;
// Then the row's gather slots (smp_gather): composites, min(kGatherSlots, G * kGatherMaxK) of
// them, so a row's scratch is kRowWords + 2 * smp_gather_slots(G) words.
constexpr int kGatherSlots = 8192;
constexpr int kGatherMaxK = 256;
constexpr int kPostMaxEach = 16;  // thread maxima a block posts at most
static_assert(kMassOff % 2 == 0 && kCandOff % 4 == 0 && kRowWords % 4 == 0, "64-bit fields need even word offsets");
static_assert(kPostSlots == kThreads && kWarps * kPostMaxEach <= kPostSlots, "one posted value a thread");

__device__ __forceinline__ unsigned smp_gather_slots(unsigned G) {
    return G * kGatherMaxK < (unsigned)kGatherSlots ? G * kGatherMaxK : (unsigned)kGatherSlots;
}
static_assert(kBins % kThreads == 0 && kRadixBins == kThreads && kCap % kThreads == 0, "per thread");

struct RowScratch {
    unsigned long long *best, *race;  // atomicMax slots: phase 1 argmax, race winner
    unsigned *arrive, *done, *ncand;  // barrier arrivals, finished blocks, candidate counts
    unsigned* round;                  // the round whose row may use the scratch (0: the first)
    unsigned* count;                  // [3][kBins]
    unsigned long long* mass;         // [3][kBins]
    ulonglong2* cand;                 // [kCap] (composite, race key or 0)
    unsigned long long* gather;       // [smp_gather_slots(G)] composites (or 0)
    unsigned* ngather;                // gathered composites so far (the next free slot)
    unsigned* posts;                  // [kPostSlots] thread maxima' keys posted for the bound
    unsigned *verdict, *ack;          // the racing-first top-p's decision, and the blocks that read it
    unsigned* front_over;             // a block's front did not fit the row's slots
    unsigned* cut_n;                  // the boundary bin's tokens, when the blocks send them
    unsigned long long* cut_rem;      // the mass the boundary bin must supply
};

__device__ __forceinline__ RowScratch smp_row_scratch(unsigned* base) {
    RowScratch s;
    s.best = reinterpret_cast<unsigned long long*>(base);
    s.race = reinterpret_cast<unsigned long long*>(base + 2);
    s.arrive = base + 4;
    s.done = base + 5;
    s.ncand = base + 6;
    s.round = base + 8;
    s.ngather = base + 9;
    s.verdict = base + 10;
    s.ack = base + 11;
    s.front_over = base + 12;
    s.cut_n = base + 13;
    s.cut_rem = reinterpret_cast<unsigned long long*>(base + 14);
    s.count = base + kCountOff;
    s.mass = reinterpret_cast<unsigned long long*>(base + kMassOff);
    s.cand = reinterpret_cast<ulonglong2*>(base + kCandOff);
    s.posts = base + kPostOff;
    s.gather = reinterpret_cast<unsigned long long*>(base + kRowWords);
    return s;
}

// ---- values, keys, masses

// Order-preserving map of a float (NaN -> -inf, -0 -> +0) to uint32.
__device__ __forceinline__ unsigned smp_key(float s) {
    unsigned u = isnan(s) ? 0xFF800000u : __float_as_uint(s);
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float smp_unkey(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// The token order: larger d first, equal d: lower id first.
__device__ __forceinline__ unsigned long long smp_comp(float d, unsigned id) {
    return ((unsigned long long)smp_key(d) << 32) | (unsigned)~id;
}

__device__ __forceinline__ unsigned long long smp_mass(float d) {
    return __float2ull_rn(__fmul_rn(expf(d), kMassScale));
}

// Monotone in d (larger d, smaller or equal bin); the last bin's masses round to 0.
__device__ __forceinline__ int smp_bin(float d) {
    return d > kBinFloor ? __float2int_rz(-d * kBinsPerUnit) : kBins - 1;
}

__device__ __forceinline__ float smp_load1(const float* p) { return *p; }
__device__ __forceinline__ float smp_load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// Four logits at p, n of them valid (n may be <= 0); vec: p is 16-byte (fp32) or 8-byte (bf16) aligned.
__device__ __forceinline__ void smp_load4(const float* p, int n, bool vec, float v[4]) {
    if (vec && n >= 4) {
        const float4 f = *reinterpret_cast<const float4*>(p);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = j < n ? p[j] : SMP_NEG_INF;
}

__device__ __forceinline__ void smp_load4(const __nv_bfloat16* p, int n, bool vec, float v[4]) {
    if (vec && n >= 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        v[0] = __uint_as_float(w.x << 16), v[1] = __uint_as_float(w.x & 0xFFFF0000u);
        v[2] = __uint_as_float(w.y << 16), v[3] = __uint_as_float(w.y & 0xFFFF0000u);
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = j < n ? smp_load1(p + j) : SMP_NEG_INF;
}

// ---- block and row synchronisation

// Global adds whose result nobody reads (no round trip; the row barrier's fence orders them).
__device__ __forceinline__ void smp_red_add(unsigned* p, unsigned v) {
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void smp_red_add(unsigned long long* p, unsigned long long v) {
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

struct Smem {
    // Block histogram: counts and masses split at bit kMassSplit (a token's mass is <= 2^36, a
    // block holds <= 4096 tokens: each half sums below 2^31), so every update is a native 32-bit
    // shared atomic (a 64-bit one is a compare-and-swap loop).
    unsigned count[kBins], mass_hi[kBins], mass_lo[kBins];
    // The exact cut: the candidates in list order with their race keys, and the last few.
    unsigned long long cand_comp[kCap], cand_key[kCap], sorted[32];
    unsigned long long red64[kWarps], red_and[kWarps];
    unsigned red32[kWarps];
    unsigned long long s_seed, s_offset;
    // a scan's or an exact search's result
    unsigned long long pick_mass_above, pick_mass_in, theta, prefix;
    unsigned pick_idx, pick_count_above, pick_count_in, found, last, nclear, nlast;
    unsigned ngather;  // the gathered cut's survivors (smp_gather_cut)
    alignas(16) unsigned post[kPostSlots];  // the posted thread maxima (read as uint4: smp_post_bound)
    unsigned bound;                          // and their bound
    // each level-0 bin's best race key (smp_race_front) as two words, each updated by a native
    // 32-bit shared atomic (a 64-bit atomicMax is a compare-and-swap loop): the high word (the
    // race value) first, then the low one (~id) among the tokens whose high word is the bin's best
    unsigned bin_hi[kBins], bin_lo[kBins];
    unsigned verdict, cut_n;
    unsigned long long cut_rem;
};

__device__ __forceinline__ unsigned long long smp_block_max(unsigned long long v, Smem& sm) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned long long x = __shfl_xor_sync(0xFFFFFFFFu, v, off);
        v = x > v ? x : v;
    }
    if (lane == 0) sm.red64[warp] = v;
    __syncthreads();
    v = sm.red64[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v = sm.red64[w] > v ? sm.red64[w] : v;
    __syncthreads();  // red64 may be reused at once
    return v;
}

// Bitwise OR and AND of 64-bit values over the block (every thread gets both).
__device__ __forceinline__ void smp_block_or_and(unsigned long long& v_or, unsigned long long& v_and, Smem& sm) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned long long o = ((unsigned long long)__reduce_or_sync(0xFFFFFFFFu, (unsigned)(v_or >> 32)) << 32) |
                                 __reduce_or_sync(0xFFFFFFFFu, (unsigned)v_or);
    const unsigned long long a = ((unsigned long long)__reduce_and_sync(0xFFFFFFFFu, (unsigned)(v_and >> 32)) << 32) |
                                 __reduce_and_sync(0xFFFFFFFFu, (unsigned)v_and);
    if (lane == 0) sm.red64[warp] = o, sm.red_and[warp] = a;
    __syncthreads();
    v_or = 0ull, v_and = ~0ull;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v_or |= sm.red64[w], v_and &= sm.red_and[w];
    __syncthreads();  // red64 / red_and may be reused at once
}

// Exclusive block scan of (count, mass) pairs; also returns the block's total mass.
__device__ __forceinline__ unsigned long long smp_block_scan(unsigned c, unsigned long long m, unsigned& c_before,
                                                             unsigned long long& m_before, Smem& sm) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned ci = c;
    unsigned long long mi = m;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned cx = __shfl_up_sync(0xFFFFFFFFu, ci, off);
        const unsigned long long mx = __shfl_up_sync(0xFFFFFFFFu, mi, off);
        if (lane >= (unsigned)off) ci += cx, mi += mx;
    }
    if (lane == 31) sm.red32[warp] = ci, sm.red64[warp] = mi;
    __syncthreads();
    unsigned cw = 0u;
    unsigned long long mw = 0ull, total = 0ull;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        if ((unsigned)w < warp) cw += sm.red32[w], mw += sm.red64[w];
        total += sm.red64[w];
    }
    c_before = cw + ci - c;
    m_before = mw + mi - m;
    __syncthreads();  // red32 / red64 may be reused at once
    return total;
}

// The G blocks of a row wait for each other; the n-th barrier of a launch waits for n * G arrivals.
// Everything a block wrote (stores, atomics) before it is visible to every block of the row after.
__device__ __forceinline__ void smp_row_barrier(unsigned* arrive, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        gpu_sync::fence_acq_rel();
        atomicAdd(arrive, 1u);
        while (gpu_sync::ld_acquire(arrive) < target) {  // acquires what the row's blocks wrote
        }
    }
    __syncthreads();
}

// The first of `mine` consecutive candidate slots for this thread, from one atomic per warp.
// Call with the whole warp (warp-uniform control flow).
__device__ __forceinline__ unsigned smp_warp_slots(unsigned* counter, unsigned mine) {
    const unsigned lane = threadIdx.x & 31;
    unsigned incl = mine;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned x = __shfl_up_sync(0xFFFFFFFFu, incl, off);
        if (lane >= (unsigned)off) incl += x;
    }
    const unsigned total = __shfl_sync(0xFFFFFFFFu, incl, 31);
    unsigned base = 0u;
    if (lane == 31 && total) base = atomicAdd(counter, total);
    return __shfl_sync(0xFFFFFFFFu, base, 31) + incl - mine;
}

// ---- the block's tokens

template <int P>
struct Tile {
    float v[P];  // canonical logits, then d
    unsigned first;    // id of v[0] (a multiple of 4)
    int n;             // valid tokens
};

template <typename T, int P>
__device__ __forceinline__ bool smp_load_tile(const T* row, unsigned V, int per, bool vec, Tile<P>& t) {
    t.n = t.first < V ? min(per, (int)(V - t.first)) : 0;
    bool odd = false;  // a NaN or +inf
#pragma unroll
    for (int g = 0; g < P; g += 4) {  // beyond t.n: -inf, nothing read
        float q[4];
        smp_load4(row + t.first + g, t.n - g, vec, q);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            odd |= isnan(q[e]) || q[e] == __int_as_float(0x7F800000);
            t.v[g + e] = isnan(q[e]) ? SMP_NEG_INF : q[e];
        }
    }
    return odd;
}

// ---- thresholds

struct Ctx {
    RowScratch rs;
    unsigned G, chunk;
    unsigned nbar;   // row barriers passed in this launch
    unsigned hpass;  // histogram passes in this launch (buffer hpass % 3)
    bool with_mass;  // the histograms carry masses (top-p needs them; top-k alone only counts)
    bool posted;     // this row's blocks posted thread maxima (the finisher clears them)
};

__device__ __forceinline__ void smp_barrier(Ctx& cx) {
    ++cx.nbar;
    smp_row_barrier(cx.rs.arrive, cx.nbar * cx.G);
}

// The tokens being searched: level-0 bin `bin` and composite prefix `bits` under `mask`. [lo, hi]
// is the intersection of the bin's composite range and the prefix's, so the bucket is exactly the
// tokens with a composite in [lo, hi]; bits above the highest bit where lo and hi differ need no
// radix pass.
struct Bucket {
    int bin;
    unsigned long long mask, bits, lo, hi;
};

// The composite range of level-0 bin `bin` (its d range, any id below V).
__device__ __forceinline__ void smp_bin_range(int bin, unsigned V, Bucket& bk) {
    unsigned klo, khi;
    if (bin == kBins - 1) {
        klo = smp_key(SMP_NEG_INF), khi = smp_key(kBinFloor);
    } else {  // d in (-(bin+1)/32, -bin/32]: exact in fp32
        klo = smp_key(-(float)(bin + 1) / kBinsPerUnit) + 1u;
        khi = smp_key(bin ? -(float)bin / kBinsPerUnit : 0.0f);
    }
    bk.lo = ((unsigned long long)klo << 32) | (unsigned)~(V - 1u);
    bk.hi = ((unsigned long long)khi << 32) | 0xFFFFFFFFu;
}

__device__ __forceinline__ void smp_flush(Smem& sm, int run, unsigned c, unsigned long long m) {
    if (run < 0) return;
    atomicAdd(&sm.count[run], c);
    if (m) {
        atomicAdd(&sm.mass_hi[run], (unsigned)(m >> kMassSplit));
        atomicAdd(&sm.mass_lo[run], (unsigned)m & ((1u << kMassSplit) - 1u));
    }
}

// Block-local histogram in shared memory. Level 0: every token by bin (the last bin only counted,
// per warp); radix: the bucket's tokens by the composite's 8 bits at `shift`, top digit first.
// Runs of equal bins within a thread are summed before the atomics (ties and clusters).
template <bool kLevel0, int P>
__device__ void smp_local_hist(Smem& sm, const Tile<P>& t, const Bucket& bk, int shift, bool with_mass) {
    const int nb = kLevel0 ? kBins : kRadixBins;
    for (int i = threadIdx.x; i < nb; i += kThreads) sm.count[i] = 0u, sm.mass_hi[i] = 0u, sm.mass_lo[i] = 0u;
    __syncthreads();
    int run = -1;
    unsigned rc = 0u, tail = 0u;
    unsigned long long rm = 0ull;
#pragma unroll
    for (int j = 0; j < P; ++j) {
        if (j >= t.n) break;
        const float d = t.v[j];
        const int bin = smp_bin(d);
        int idx;
        if (kLevel0) {
            if (bin == kBins - 1) {
                ++tail;
                continue;
            }
            idx = bin;
        } else {
            if (bin != bk.bin) continue;
            const unsigned long long c = smp_comp(d, t.first + j);
            if ((c & bk.mask) != bk.bits) continue;
            idx = kRadixBins - 1 - (int)((c >> shift) & 0xFFull);
        }
        if (idx != run) {
            smp_flush(sm, run, rc, rm);
            run = idx, rc = 0u, rm = 0ull;
        }
        ++rc;
        if (with_mass) rm += smp_mass(d);
    }
    smp_flush(sm, run, rc, rm);
    if (kLevel0) {
        tail = __reduce_add_sync(0xFFFFFFFFu, tail);
        if ((threadIdx.x & 31) == 0 && tail) atomicAdd(&sm.count[kBins - 1], tail);
    }
    __syncthreads();
}

// The last level-0 bin a block must merge for a cut by count `want` (kMergeByCount) or at a
// known bin (`limit` >= 0). By count: the bin holding the block's own want-th token (the last bin
// if it has fewer). The row's cut lies in a bin no later than every block's: a block whose want-th
// token is in bin j holds `want` tokens in bins <= j, so the row's want-th token is in a bin <= j.
// Every bin up to the row's cut is then merged by every block, exactly, and the bins after it are
// never read by the scan, which stops at the cut. (A top-k of 50 over 1024 tokens per block merges
// ~50 of ~600 busy bins. Measured on an H100, that took top-k 50 + top-p 0.9 from 24.4 to 22.3 us
// at batch 1 but top-k 50 alone only 0.2 us: the reductions are not most of the barrier's wait.)
constexpr int kMergeAll = kBins - 1;
constexpr int kMergeByCount = -1;

// Scans the block's own level-0 histogram (sm.count, and sm.mass_hi / mass_lo when by_mass) from
// the top bin for the bin where the count or the mass reaches `want`: sm.pick_idx,
// pick_count_above, pick_count_in, pick_mass_above. Returns false (block-uniform) when the block
// holds less than `want`.
__device__ bool smp_local_pick(Smem& sm, bool by_mass, unsigned long long want) {
    constexpr int kEach = kBins / kThreads;
    unsigned c[kEach], csum = 0u;
    unsigned long long m[kEach], msum = 0ull;
#pragma unroll
    for (int e = 0; e < kEach; ++e) {
        const int i = threadIdx.x * kEach + e;
        c[e] = sm.count[i];
        m[e] = by_mass ? ((unsigned long long)sm.mass_hi[i] << kMassSplit) + sm.mass_lo[i] : 0ull;
        csum += c[e], msum += m[e];
    }
    if (threadIdx.x == 0) sm.found = 0u;
    unsigned ca;
    unsigned long long ma;
    smp_block_scan(csum, msum, ca, ma, sm);  // orders found = 0 first
#pragma unroll
    for (int e = 0; e < kEach; ++e) {
        if (by_mass ? (ma < want && want <= ma + m[e]) : (ca < want && want <= (unsigned long long)ca + c[e])) {
            sm.pick_idx = threadIdx.x * kEach + e;
            sm.pick_count_above = ca, sm.pick_count_in = c[e], sm.pick_mass_above = ma;
            sm.found = 1u;
        }
        ca += c[e], ma += m[e];
    }
    __syncthreads();
    return sm.found != 0u;
}

__device__ int smp_merge_bound(Smem& sm, int limit, unsigned long long want) {
    if (limit != kMergeByCount) return limit;
    const int bound = smp_local_pick(sm, false, want) ? (int)sm.pick_idx : kMergeAll;
    __syncthreads();  // every thread has read the pick before it is written again
    return bound;
}

// Adds the block's histogram, bins 0..bound, into the row's buffer `buf`, and zeroes this block's
// share of the buffer the pass after next will use (last read two passes ago, before the previous
// barrier).
__device__ void smp_merge(const Smem& sm, const Ctx& cx, int nb, int bound) {
    const unsigned buf = cx.hpass % 3u, next = (cx.hpass + 1u) % 3u;
    unsigned* gc = cx.rs.count + buf * kBins;
    unsigned long long* gm = cx.rs.mass + buf * kBins;
    for (int i = threadIdx.x; i <= bound && i < nb; i += kThreads) {
        const unsigned c = sm.count[i];
        const unsigned long long m = ((unsigned long long)sm.mass_hi[i] << kMassSplit) + sm.mass_lo[i];
        if (c) smp_red_add(gc + i, c);
        if (m) smp_red_add(gm + i, m);
    }
    for (unsigned i = cx.chunk * kThreads + threadIdx.x; i < (unsigned)kBins; i += cx.G * kThreads) {
        cx.rs.count[next * kBins + i] = 0u;
        cx.rs.mass[next * kBins + i] = 0ull;
    }
}


// The top-p target ceil(p * mass), at least 1.
__device__ __forceinline__ unsigned long long smp_target(float p, unsigned long long mass) {
    const unsigned long long t = (unsigned long long)ceil((double)p * (double)mass);
    return t < 1ull ? 1ull : t;
}

// Scans the row's histogram (after the barrier) from the top bin for the bin where the count
// (by_mass false) or the mass (by_mass true) reaches `rem`; the result lands in sm.pick_*.
// frac > 0 (top-p without top-k): rem is first set to the target over the histogram's total mass.
__device__ bool smp_pick(Smem& sm, const Ctx& cx, int nb, bool by_mass, unsigned long long& rem, float frac) {
    constexpr int kMaxEach = kBins / kThreads;
    const int each = nb / kThreads;
    const unsigned buf = cx.hpass % 3u;
    const unsigned* gc = cx.rs.count + buf * kBins;
    const unsigned long long* gm = cx.rs.mass + buf * kBins;
    unsigned c[kMaxEach];
    unsigned long long m[kMaxEach];
    unsigned csum = 0u;
    unsigned long long msum = 0ull;
#pragma unroll
    for (int e = 0; e < kMaxEach; ++e) {
        const int i = threadIdx.x * each + e;
        c[e] = e < each ? __ldcg(gc + i) : 0u;
        m[e] = e < each && cx.with_mass ? __ldcg(gm + i) : 0ull;
        csum += c[e], msum += m[e];
    }
    if (threadIdx.x == 0) sm.found = 0u;
    unsigned ca;
    unsigned long long ma;
    const unsigned long long total = smp_block_scan(csum, msum, ca, ma, sm);  // orders found = 0 first
    if (frac > 0.0f) rem = smp_target(frac, total);
#pragma unroll
    for (int e = 0; e < kMaxEach; ++e) {
        if (e >= each) break;
        const bool hit = by_mass ? (ma < rem && rem <= ma + m[e]) : (ca < rem && rem <= (unsigned long long)ca + c[e]);
        if (hit) {
            sm.pick_idx = threadIdx.x * each + e;
            sm.pick_count_above = ca, sm.pick_count_in = c[e];
            sm.pick_mass_above = ma, sm.pick_mass_in = m[e];
            sm.found = 1u;
        }
        ca += c[e], ma += m[e];
    }
    __syncthreads();
    return sm.found != 0u;
}

// One histogram pass: local histogram, merge (level 0: bins up to smp_merge_bound(limit)),
// barrier, scan. Returns false on inconsistent data.
template <bool kLevel0, int P>
__device__ bool smp_pass(Smem& sm, const Tile<P>& t, Ctx& cx, const Bucket& bk, int shift, bool by_mass,
                         unsigned long long& rem, float frac, int limit) {
    const int nb = kLevel0 ? kBins : kRadixBins;
    smp_local_hist<kLevel0>(sm, t, bk, shift, cx.with_mass);
    smp_merge(sm, cx, nb, kLevel0 ? smp_merge_bound(sm, limit, rem) : nb - 1);
    smp_barrier(cx);
    const bool ok = smp_pick(sm, cx, nb, by_mass, rem, frac);
    ++cx.hpass;
    return ok;
}

struct Cut {
    unsigned long long theta;  // kept: composite >= theta
    unsigned long long mass;   // mass of the kept prefix; ~0: no cut (inconsistent data, keep all)
};

__device__ __forceinline__ bool smp_in_bucket(float d, unsigned id, const Bucket& bk) {
    return smp_bin(d) == bk.bin && (smp_comp(d, id) & bk.mask) == bk.bits;
}

// The composite mass of a candidate (0: none).
__device__ __forceinline__ unsigned long long smp_comp_mass(unsigned long long c) {
    return c ? smp_mass(smp_unkey((unsigned)(c >> 32))) : 0ull;
}

// One candidate (composite c) into bin `idx` of the block's histogram: its count, and its mass
// when by_mass.
__device__ __forceinline__ void smp_count(Smem& sm, int idx, unsigned long long c, bool by_mass) {
    atomicAdd(&sm.count[idx], 1u);
    if (by_mass) {
        const unsigned long long m = smp_comp_mass(c);
        atomicAdd(&sm.mass_hi[idx], (unsigned)(m >> kMassSplit));
        atomicAdd(&sm.mass_lo[idx], (unsigned)m & ((1u << kMassSplit) - 1u));
    }
}

// The exact boundary among the candidates held in registers, kEach a thread (the distinct nonzero
// composites of c in [lo, hi], n of them in all; 0 for none): the candidate where the count
// (by_mass false) or the mass (by_mass true) from the top reaches `rem`, in sm.theta, and with
// by_mass or `with_mass` the mass of it and those ranked above it in sm.prefix (a cut by count
// counts masses only for that: a top-k cut's kept mass is the base of the top-p target after it;
// without, the passes lost the mass above the last 32 and top-p kept too few tokens). 8-bit radix
// passes over the composite, each at the highest bit that still
// varies among the remaining candidates (ties in d leave only id bits), narrow them to at most 32,
// which one warp ranks exactly. Every block that calls it with the same candidates finds the same
// boundary whatever their order. Returns false on inconsistent data.
template <int kEach, int kUnroll = kEach>
__device__ __forceinline__ bool smp_exact_in(Smem& sm, const unsigned long long (&c)[kEach], unsigned n, bool by_mass,
                             unsigned long long rem, unsigned long long lo = 1ull, unsigned long long hi = ~0ull,
                             bool with_mass = false) {
    const unsigned tid = threadIdx.x, lane = tid & 31;
    // Narrow: the candidates (c & mask) == bits; `above` is the mass of those ranked above them.
    unsigned long long mask = 0ull, bits = 0ull, above = 0ull;
    unsigned cnt = n;
    if (tid == 0) sm.found = 0u, sm.nlast = 0u;
    __syncthreads();
    while (cnt > 32u) {
        unsigned long long all_or = 0ull, all_and = ~0ull;  // over the remaining candidates
#pragma unroll kUnroll
        for (int e = 0; e < kEach; ++e)
            if (c[e] >= lo && c[e] <= hi && (c[e] & mask) == bits) all_or |= c[e], all_and &= c[e];
        smp_block_or_and(all_or, all_and, sm);
        const unsigned long long varying = all_or ^ all_and;
        if (!varying) return false;  // block-uniform: cnt > 1 equal composites, an inconsistent list
        const int shift = max(63 - __clzll((long long)varying) - 7, 0);
        sm.count[tid] = 0u, sm.mass_hi[tid] = 0u, sm.mass_lo[tid] = 0u;  // kRadixBins == kThreads
        __syncthreads();
#pragma unroll kUnroll
        for (int e = 0; e < kEach; ++e) {
            if (c[e] < lo || c[e] > hi || (c[e] & mask) != bits) continue;
            smp_count(sm, kRadixBins - 1 - (int)((c[e] >> shift) & 0xFFull), c[e], by_mass || with_mass);  // top digit first
        }
        __syncthreads();
        const unsigned bc = sm.count[tid];
        const unsigned long long bm = ((unsigned long long)sm.mass_hi[tid] << kMassSplit) + sm.mass_lo[tid];
        unsigned ca;
        unsigned long long ma;
        smp_block_scan(bc, bm, ca, ma, sm);
        if (by_mass ? (ma < rem && rem <= ma + bm) : (ca < rem && rem <= (unsigned long long)ca + bc)) {
            sm.pick_idx = tid, sm.pick_count_above = ca, sm.pick_count_in = bc, sm.pick_mass_above = ma;
            sm.found = 1u;
        }
        __syncthreads();
        if (!sm.found) return false;  // block-uniform: inconsistent masses
        const unsigned long long digit = (unsigned long long)(kRadixBins - 1 - (int)sm.pick_idx);
        bits = (all_and & (shift + 8 >= 64 ? 0ull : ~0ull << (shift + 8))) | (digit << shift);  // above: common
        mask = ~0ull << shift;
        rem -= by_mass ? sm.pick_mass_above : sm.pick_count_above;
        above += sm.pick_mass_above;
        cnt = sm.pick_count_in;
        __syncthreads();  // every thread has read the pick before it is written again
        if (tid == 0) sm.found = 0u;
    }
    // The last <= 32 candidates: compacted into sm.sorted, ranked by warp 0 (each lane one).
#pragma unroll kUnroll
    for (int e = 0; e < kEach; ++e) {
        if (c[e] >= lo && c[e] <= hi && (c[e] & mask) == bits) {
            const unsigned slot = atomicAdd(&sm.nlast, 1u);
            if (slot < 32u) sm.sorted[slot] = c[e];
        }
    }
    __syncthreads();
    if (tid < 32u) {
        const unsigned k = min(sm.nlast, 32u);
        const unsigned long long ci = lane < k ? sm.sorted[lane] : 0ull;
        const unsigned long long mi = smp_comp_mass(ci);
        unsigned rank = 0u;
        unsigned long long mass_above = 0ull;
        for (unsigned j = 0; j < k; ++j) {
            const unsigned long long cj = __shfl_sync(0xFFFFFFFFu, ci, j);
            const unsigned long long mj = __shfl_sync(0xFFFFFFFFu, mi, j);
            if (cj > ci) ++rank, mass_above += mj;
        }
        if (lane < k && (by_mass ? (mass_above < rem && rem <= mass_above + mi) : rank + 1ull == rem))
            sm.theta = ci, sm.prefix = above + mass_above + mi, sm.found = 1u;
    }
    __syncthreads();
    return sm.found != 0u;
}

// smp_exact_in over the bucket's n <= kCap tokens collected in the row's candidate list. Leaves the
// candidates' composites and race keys, in list order, in sm.cand_comp / cand_key.
__device__ bool smp_exact(Smem& sm, const Ctx& cx, unsigned n, bool by_mass, unsigned long long rem,
                          bool with_mass = false) {
    unsigned long long c[kCapEach];
#pragma unroll
    for (int e = 0; e < kCapEach; ++e) {
        const unsigned i = threadIdx.x + e * kThreads;
        c[e] = 0ull;  // 0: not a candidate (every composite is nonzero)
        if (i < n) {
            const ulonglong2 v = __ldcg(&cx.rs.cand[i]);
            c[e] = sm.cand_comp[i] = v.x;
            sm.cand_key[i] = v.y;
        }
    }
    return smp_exact_in<kCapEach>(sm, c, n, by_mass, rem, 1ull, ~0ull, with_mass);
}

// The boundary of the shortest prefix of the token order holding `want` tokens (by_mass false)
// or reaching the mass `want` (by_mass true; with frac > 0 the mass ceil(frac * total)), narrowed
// by histogram passes to a bucket of n <= kCap tokens: the composites in [bk.lo, bk.hi]. Every
// token above the bucket is in the prefix, none below it; `rem` is what the bucket must supply,
// `above` the mass above it. Returns false on inconsistent data.
struct Narrow {
    Bucket bk;
    unsigned n;
    unsigned long long rem, above;
};

// `limit`: the level-0 merge's bound (smp_merge_bound).
template <int P>
__device__ bool smp_narrow(Smem& sm, const Tile<P>& t, Ctx& cx, unsigned V, bool by_mass, unsigned long long want,
                           float frac, int limit, Narrow& nr) {
    Bucket& bk = nr.bk;
    bk = Bucket{-1, 0ull, 0ull, 0ull, ~0ull};
    nr.rem = want, nr.above = 0ull;
    if (!smp_pass<true>(sm, t, cx, bk, 0, by_mass, nr.rem, frac, limit)) return false;
    bk.bin = (int)sm.pick_idx;
    nr.rem -= by_mass ? sm.pick_mass_above : sm.pick_count_above;
    nr.above += sm.pick_mass_above;
    nr.n = sm.pick_count_in;
    __syncthreads();  // every thread has read the pick before the next pass writes it
    smp_bin_range(bk.bin, V, bk);
    // Radix passes over the 8 bits below the highest bit that varies in the bucket's range.
    while (nr.n > (unsigned)kCap && bk.lo < bk.hi) {
        const int high = 63 - __clzll((long long)(bk.lo ^ bk.hi));
        const int shift = high > 7 ? high - 7 : 0;
        if (!smp_pass<false>(sm, t, cx, bk, shift, by_mass, nr.rem, 0.0f, kMergeAll)) return false;
        const unsigned long long upper = shift + 8 >= 64 ? 0ull : ~0ull << (shift + 8);
        const unsigned long long low = (1ull << shift) - 1ull;
        bk.mask = ~0ull << shift;
        bk.bits = (bk.lo & upper) | ((unsigned long long)(kRadixBins - 1 - (int)sm.pick_idx) << shift);
        bk.lo = bk.lo > bk.bits ? bk.lo : bk.bits;
        bk.hi = bk.hi < (bk.bits | low) ? bk.hi : (bk.bits | low);
        nr.rem -= by_mass ? sm.pick_mass_above : sm.pick_count_above;
        nr.above += sm.pick_mass_above;
        nr.n = sm.pick_count_in;
        __syncthreads();
    }
    return nr.n <= (unsigned)kCap;
}

// The exact cut from a narrowed bucket: its tokens are collected in the row's candidate list
// (counter `stage`), barrier, and every block ranks them.
template <int P>
__device__ Cut smp_resolve(Smem& sm, const Tile<P>& t, Ctx& cx, const Narrow& nr, bool by_mass, int stage) {
    unsigned in[P], mine = 0u;
#pragma unroll
    for (int j = 0; j < P; ++j) {
        in[j] = j < t.n && smp_in_bucket(t.v[j], t.first + j, nr.bk);
        mine += in[j];
    }
    unsigned slot = smp_warp_slots(cx.rs.ncand + stage, mine);
#pragma unroll
    for (int j = 0; j < P; ++j) {
        if (!in[j]) continue;
        if (slot < (unsigned)kCap) cx.rs.cand[slot] = make_ulonglong2(smp_comp(t.v[j], t.first + j), 0ull);
        ++slot;
    }
    smp_barrier(cx);
    // the cut's mass too: a top-k cut resolved here is followed by top-p, whose target it sets
    if (!smp_exact(sm, cx, nr.n, by_mass, nr.rem, true)) return Cut{0ull, ~0ull};
    const Cut cut{sm.theta, nr.above + sm.prefix};
    __syncthreads();  // sm.theta / sm.prefix are read before they are reused
    return cut;
}

// ---- the race

// The race key is exp(d) / E with E = -log(u) ~ Exp(1), whose log is d + Gumbel: the same order
// with one log instead of two. The log is the accurate one (a small E, u near 1, decides the
// winner); the fast exp and divide add ~1e-6 relative error, i.e. ~1e-6 in Gumbel space.
__device__ __forceinline__ unsigned long long smp_word_key(float d, unsigned id, unsigned word) {
    const float expo = -logf(fp4_philox_uniform(word));  // in [6e-8, 16.7]
    const float r = __fdividef(__expf(d), expo);          // d >= -20: r in [1e-10, 2e7]
    return ((unsigned long long)smp_key(r) << 32) | (unsigned)~id;
}

// A group's 4 tokens' parts in the race (bit e of each nibble: token e): bits 0-3 rng (it needs a
// race key), 4-7 sure (certainly kept: its key may win), 8-11 cand (in the deferred cut's bucket:
// the candidate list gets it, key or not). Tokens from n on are not the row's.
template <bool defer>
__device__ __forceinline__ unsigned smp_group_flags(const float* d, unsigned id0, int n, float low_d,
                                                    unsigned long long theta, float min_p, const Narrow& nr) {
    unsigned flags = 0u;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (e >= n || d[e] < low_d) continue;
        const unsigned long long c = smp_comp(d[e], id0 + e);
        const bool live = d[e] >= kNeverWins && c >= theta && (min_p <= 0.0f || expf(d[e]) >= min_p);
        const bool cand = defer && nr.bk.lo <= c && c <= nr.bk.hi;  // the bucket is its range
        const bool sure = live && !(defer && c <= nr.bk.hi);
        flags |= (unsigned)(live && (sure || cand)) << e | (unsigned)sure << (4 + e) | (unsigned)cand << (8 + e);
    }
    return flags;
}

// One group's race: one Philox call for its 4 tokens' keys (none when no token needs one), the
// best key of the sure ones into win, the bucket's tokens into the candidate list from slot on.
__device__ __forceinline__ void smp_race_group(const float* d, unsigned id0, unsigned flags, uint4 ctr, unsigned k0,
                                               unsigned k1, unsigned& slot, ulonglong2* cand_list,
                                               unsigned long long& win) {
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (flags & 0xFu) {
        ctr.x = id0 >> 2;
        x = fp4_philox4x32_10(ctr, k0, k1);
    }
    const unsigned words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const unsigned long long key = flags >> e & 1u ? smp_word_key(d[e], id0 + e, words[e]) : 0ull;
        if (flags >> (4 + e) & 1u) win = key > win ? key : win;
        if (flags >> (8 + e) & 1u) {
            if (slot < (unsigned)kCap) cand_list[slot] = make_ulonglong2(smp_comp(d[e], id0 + e), key);
            ++slot;
        }
    }
}

// The warp's list of groups that race (32 at a time): (first id, flags, candidate slot) and d.
__device__ __forceinline__ uint4* smp_race_list() {
    __shared__ uint4 items[kWarps * 64];
    return items + (threadIdx.x >> 5) * 64;
}

// The block's best race key among the tokens certainly kept: composite >= theta, min-p, and, with
// a deferred cut (`defer`), above its bucket. The bucket's tokens go to the candidate list with
// their race keys (0 where theta or min-p drops them): the row's finisher cuts them exactly. One
// Philox call covers a thread's 4 consecutive tokens (a group). A thread of several groups lists
// those that race for its warp, and the warp races 32 listed groups at a time, one a lane: kept
// tokens are scattered (top-p keeps a few percent), so in a group loop nearly every warp runs
// every group's Philox call for a lane or two; listed, a sparse warp runs one or two. A dense warp
// (over 64 groups listed: temperature sampling) keeps the group loop, where listing cost more
// (batch 8, temperature 1.0: H200 12.3 -> 14.0 us listed; H100 12.5 -> 13.1 with this fallback). The keys, the winner and the candidate list
// (each group keeps its thread's slots) are the group loop's.
template <bool defer, int P>  // compiled twice: a row without a deferred cut has no candidate bookkeeping
__device__ __forceinline__ unsigned long long smp_race(const Tile<P>& t, Ctx& cx, unsigned long long theta,
                                                       float min_p, const Narrow& nr, int stage, uint4 ctr,
                                                       unsigned k0, unsigned k1) {
    unsigned long long win = 0ull;
    // Float bounds first (composite >= c implies d >= the d of c's key): most tokens of a top-k or
    // top-p row lie below the bucket and are dismissed with one compare.
    const float bucket_d = defer ? smp_unkey((unsigned)(nr.bk.lo >> 32)) : SMP_NEG_INF;
    const float live_d = theta ? fmaxf(smp_unkey((unsigned)(theta >> 32)), kNeverWins) : kNeverWins;
    const float low_d = defer ? fminf(bucket_d, live_d) : live_d;
    unsigned slot = 0u;  // this thread's next candidate slot
    if (defer) {         // block-uniform: one atomic per warp for all the warp's bucket tokens
        unsigned mine = 0u;
#pragma unroll
        for (int j = 0; j < P; ++j) {
            if (j >= t.n || t.v[j] < bucket_d) continue;
            const unsigned long long c = smp_comp(t.v[j], t.first + j);
            mine += nr.bk.lo <= c && c <= nr.bk.hi;
        }
        slot = smp_warp_slots(cx.rs.ncand + stage, mine);
    }
    if constexpr (P == 4) {
        const unsigned flags = smp_group_flags<defer>(t.v, t.first, t.n, low_d, theta, min_p, nr);
        smp_race_group(t.v, t.first, flags, ctr, k0, k1, slot, cx.rs.cand, win);
    } else {
        unsigned flags[P / 4], mine = 0u;
#pragma unroll
        for (int g = 0; g < P; g += 4) {
            flags[g / 4] = smp_group_flags<defer>(t.v + g, t.first + g, t.n - g, low_d, theta, min_p, nr);
            mine += (flags[g / 4] & 0xF0Fu) != 0u;  // a key to draw or a candidate to list
        }
        const unsigned lane = threadIdx.x & 31;
        unsigned incl = mine;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const unsigned x = __shfl_up_sync(0xFFFFFFFFu, incl, off);
            if (lane >= (unsigned)off) incl += x;
        }
        const unsigned total = __shfl_sync(0xFFFFFFFFu, incl, 31);
        if (total > 2u * 32u) {  // a dense warp (temperature sampling): the group loop, no list
#pragma unroll
            for (int g = 0; g < P; g += 4)
                if (flags[g / 4] & 0xF0Fu) smp_race_group(t.v + g, t.first + g, flags[g / 4], ctr, k0, k1, slot, cx.rs.cand, win);
            return win;
        }
        uint4* list = smp_race_list();
        for (unsigned round = 0; round < total; round += 32) {  // warp-uniform: at most two rounds
            unsigned at = incl - mine, s = slot;
#pragma unroll
            for (int g = 0; g < P; g += 4) {
                if (!(flags[g / 4] & 0xF0Fu)) continue;
                if (at - round < 32u) {
                    list[2 * (at - round)] = make_uint4(t.first + g, flags[g / 4], s, 0u);
                    list[2 * (at - round) + 1] = make_uint4(__float_as_uint(t.v[g]), __float_as_uint(t.v[g + 1]),
                                                            __float_as_uint(t.v[g + 2]), __float_as_uint(t.v[g + 3]));
                }
                ++at, s += __popc(flags[g / 4] >> 8);
            }
            __syncwarp();
            if (round + lane < total) {
                const uint4 head = list[2 * lane], dv = list[2 * lane + 1];
                const float d[4] = {__uint_as_float(dv.x), __uint_as_float(dv.y), __uint_as_float(dv.z),
                                    __uint_as_float(dv.w)};
                unsigned group_slot = head.z;
                smp_race_group(d, head.x, head.y, ctr, k0, k1, group_slot, cx.rs.cand, win);
            }
            __syncwarp();  // the list is read before the next round writes it
        }
    }
    return win;
}

// The block's arrival at the row's finish count: everything it wrote is visible to the last block
// to arrive, which gets sm.last (block-uniform after the barrier).
__device__ __forceinline__ void smp_arrive(Smem& sm, const Ctx& cx) {
    gpu_sync::last_to_arrive(cx.rs.done, cx.G, &sm.last);
}

// ---- top-k by gathering
//
// A top-k row (alone or followed by top-p) whose top_k * G fits its gather slots skips the
// histogram passes: every block sends the tokens that can be among the row's k best to the row's
// gather slots, and the row's finisher cuts them exactly (top-k, then top-p over the survivors) and
// races the survivors. One row barrier (the maximum's) instead of three, and no race in the blocks.
// What a block sends:
// - The bound. Before the max barrier each block posts the keys of its `each` largest thread
//   maxima (a thread's largest logit), `each` such that the G - 1 full blocks post at least k
//   (smp_post_each). After it, every block finds the k-th largest posted key L: k distinct tokens
//   have a logit >= L, so each of the row's k best has d >= d(L) (d is monotone in the logit).
//   At batch 1 (127 blocks of 1024 tokens, `each` 1 for k <= 126) about k tokens lie above it
//   where 127 * k did before (H100, top-k 50: 6,350 candidates took the finisher ~9.5 us).
//   Ties at L, and rows whose large logits sit in a few blocks, leave more (each block sends at
//   most k; tests/test_sampling_cuts.py models the cases). A row without a bound (too many posts
//   needed) sends each block's k best, and takes this path only with top-p after the top-k.
// - Only tokens above the last bin (d > kBinFloor): the rest have no mass and cannot win the race,
//   so they change neither a top-p target nor the winner, whether or not the top-k keeps them.
// - At most the block's own k best of those (the row's k best are among the blocks' k best).
// The slots come from the row's count (one atomic per warp holding any); the finisher ranks up to
// kThreads candidates by counting (one a thread), and reduces more to the k best by the histogram
// select first.

// Thread maxima a block posts for the bound of a top-k of k over G blocks (0: no bound): enough
// that the G - 1 full blocks (256 threads holding tokens each) post k, within the row's slots.
__device__ __forceinline__ unsigned smp_post_each(unsigned k, unsigned G) {
    if (G < 2u || k == 0u) return 0u;
    const unsigned each = (k + G - 2u) / (G - 1u);
    return each <= (unsigned)kPostMaxEach && G * each <= (unsigned)kPostSlots ? each : 0u;
}

// Posts the keys of the block's `each` largest thread maxima (thread_key: 0 for a thread without
// tokens) to the row's slots chunk * each onwards: `each` rounds of a warp maximum (one holder
// drops out per round) give each warp's largest, then their ranks among the block's warps.
__device__ void smp_post_maxima(Smem& sm, const Ctx& cx, unsigned thread_key, unsigned each) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned v = thread_key;
#pragma unroll 1
    for (unsigned i = 0; i < each; ++i) {
        const unsigned m = __reduce_max_sync(0xFFFFFFFFu, v);
        if (lane == __ffs(__ballot_sync(0xFFFFFFFFu, v == m)) - 1u) v = 0u;
        if (lane == 0) sm.post[warp * each + i] = m;
    }
    __syncthreads();
    const unsigned n = kWarps * each;
    if (threadIdx.x < n) {
        const unsigned mine = sm.post[threadIdx.x];
        unsigned above = 0u;  // ranked before mine: larger, or equal at a lower index
#pragma unroll 1
        for (unsigned j = 0; j < n; ++j) above += sm.post[j] > mine || (sm.post[j] == mine && j < threadIdx.x);
        if (above < each) cx.rs.posts[cx.chunk * each + above] = mine;
    }
}

// After the max barrier: the k-th largest of the n posted keys (this thread's is `posted`, loaded
// with the maximum), block-uniform. Every block computes the same value from the same slots.
__device__ unsigned smp_post_bound(Smem& sm, unsigned posted, unsigned n, unsigned k) {
    if (threadIdx.x == 0) sm.bound = 0u;
    if (threadIdx.x < n) sm.post[threadIdx.x] = posted;
    if (threadIdx.x >= n && threadIdx.x < ((n + 3u) & ~3u)) sm.post[threadIdx.x] = 0u;  // to whole uint4s: counts as no key
    __syncthreads();
    if (threadIdx.x < n) {
        unsigned at_or_above = 0u;
        const uint4* four = reinterpret_cast<const uint4*>(sm.post);
#pragma unroll 4
        for (unsigned j = 0; j < (n + 3u) / 4u; ++j) {
            const uint4 q = four[j];
            at_or_above += (q.x >= posted) + (q.y >= posted) + (q.z >= posted) + (q.w >= posted);
        }
        if (at_or_above >= k) atomicMax(&sm.bound, posted);
    }
    __syncthreads();
    return sm.bound;
}

// The candidate where the count (by_mass false) or the mass from the top reaches `want`, among
// the distinct nonzero composites c held kEach a thread: a level-0 histogram of the candidates'
// d in shared memory, then smp_exact_in over the bucket. 0 when they hold less than `want` (all
// kept) or the data is inconsistent.
template <int kEach, int kUnroll = kEach>
__device__ __forceinline__ unsigned long long smp_select(Smem& sm, const unsigned long long (&c)[kEach], bool by_mass,
                                         unsigned long long want) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) sm.count[i] = 0u, sm.mass_hi[i] = 0u, sm.mass_lo[i] = 0u;
    __syncthreads();
#pragma unroll kUnroll
    for (int e = 0; e < kEach; ++e) {
        if (c[e]) smp_count(sm, smp_bin(smp_unkey((unsigned)(c[e] >> 32))), c[e], by_mass);
    }
    __syncthreads();
    if (!smp_local_pick(sm, by_mass, want)) return 0ull;
    Bucket bk;
    smp_bin_range((int)sm.pick_idx, 0u, bk);  // any id: V - 1 = ~0u
    const unsigned n = sm.pick_count_in;
    const unsigned long long rem = want - (by_mass ? sm.pick_mass_above : sm.pick_count_above);
    __syncthreads();  // every thread has read the pick before smp_exact_in writes it
    return smp_exact_in<kEach, kUnroll>(sm, c, n, by_mass, rem, bk.lo, bk.hi) ? sm.theta : 0ull;
}

// The race key of token `id` (its Philox word: counter (id / 4, row, offset), word id % 4), 0 when
// it cannot win (d < kNeverWins) or min-p drops it.
__device__ __forceinline__ unsigned long long smp_token_key(float d, unsigned id, float min_p, uint4 ctr, unsigned k0,
                                                            unsigned k1) {
    if (d < kNeverWins || (min_p > 0.0f && !(expf(d) >= min_p))) return 0ull;
    ctr.x = id >> 2;
    const uint4 x = fp4_philox4x32_10(ctr, k0, k1);
    const unsigned r = id & 3u;
    return smp_word_key(d, id, r == 0u ? x.x : r == 1u ? x.y : r == 2u ? x.z : x.w);
}

// A block's part: its tokens with d >= d_bound and above the last bin, at most its own k best of
// them (by the exact select when it holds more), to the row's gather slots, taken from the row's
// count by one atomic per warp that holds any. A block whose threads holding any hold at most k
// together (P a thread at most) needs no block scan: usually a few tokens in a few threads.
template <int P>
__device__ void smp_gather(Smem& sm, const Tile<P>& t, const Ctx& cx, unsigned k, float d_bound) {
    unsigned long long c[P];
    unsigned mine = 0u;
#pragma unroll
    for (int j = 0; j < P; ++j) {
        c[j] = j < t.n && t.v[j] >= d_bound && t.v[j] > kBinFloor ? smp_comp(t.v[j], t.first + j) : 0ull;
        mine += c[j] != 0ull;
    }
    if ((unsigned)__syncthreads_count(mine != 0u) * P > k) {  // block-uniform
        unsigned before;
        unsigned long long unused;
        if ((unsigned)smp_block_scan(mine, mine, before, unused, sm) > k) {
            const unsigned long long theta = smp_select<P>(sm, c, false, k);  // 0 (inconsistent data): keep all
            mine = 0u;
#pragma unroll
            for (int j = 0; j < P; ++j) {
                if (c[j] < theta) c[j] = 0ull;
                mine += c[j] != 0ull;
            }
        }
    }
    unsigned slot = smp_warp_slots(cx.rs.ngather, mine);
    const unsigned slots = smp_gather_slots(cx.G);  // k a block fill at most G * k of them
#pragma unroll
    for (int j = 0; j < P; ++j) {
        if (!c[j]) continue;
        if (slot < slots) cx.rs.gather[slot] = c[j];
        ++slot;
    }
}

// The finisher's cut of a gathered row: k and top_p of the row, and the race's parameters.
struct GatherCut {
    unsigned k;
    float top_p, min_p;
    uint4 ctr;
    unsigned k0, k1;
};

// The cut of at most kThreads distinct candidates, one a thread (`mine`, 0: none; n of them):
// each one's rank by counting those above it, the k best survive, top-p keeps the survivors whose
// mass above them (rank order) is below ceil(p * their mass), and the kept ones race.
__device__ unsigned long long smp_rank_cut(Smem& sm, unsigned long long mine, unsigned n, const GatherCut& g) {
    const unsigned tid = threadIdx.x;
    sm.cand_comp[tid] = mine;
    __syncthreads();
    unsigned rank = 0u;
    if (mine) {
#pragma unroll 4
        for (unsigned j = 0; j < n; ++j) rank += sm.cand_comp[j] > mine;
    }
    const unsigned kept = n < g.k ? n : g.k;
    __syncthreads();  // every rank counted before the survivors are stored in rank order
    if (mine && rank < kept) sm.cand_comp[rank] = mine;
    __syncthreads();
    unsigned long long c = tid < kept ? sm.cand_comp[tid] : 0ull;
    if (g.top_p < 1.0f) {
        unsigned cb;
        unsigned long long above;
        const unsigned long long total = smp_block_scan(0u, smp_comp_mass(c), cb, above, sm);
        if (above >= smp_target(g.top_p, total)) c = 0ull;
    }
    unsigned long long key = 0ull;
    if (c) key = smp_token_key(smp_unkey((unsigned)(c >> 32)), ~(unsigned)c, g.min_p, g.ctr, g.k0, g.k1);
    return smp_block_max(key, sm);
}

// The finisher's part: the row's n gathered candidates (slots [0, n); the first kThreads are loaded
// with n, the slots past n hold 0), cut by smp_rank_cut; more than kThreads are first reduced to
// their k best by the histogram select (its loops are not unrolled: this code runs once a launch,
// on one SM, fetched cold). Every slot it reads is put back to zero.
constexpr int kGatherEach = kGatherSlots / kThreads;
static_assert(kGatherMaxK <= kThreads && kGatherMaxK <= kCap && kGatherMaxK <= kThreads * 4,
              "one survivor a thread, in the candidate array; a block's k slots full");

__device__ unsigned long long smp_gather_cut(Smem& sm, unsigned long long* slots, const unsigned* ngather,
                                             unsigned G, GatherCut g) {
    const unsigned tid = threadIdx.x;
    const unsigned n = min(__ldcg(ngather), smp_gather_slots(G));  // more only on inconsistent data
    const unsigned long long first = __ldcg(&slots[tid]);
    if (first) slots[tid] = 0ull;
    if (n <= (unsigned)kThreads) return smp_rank_cut(sm, first, n, g);  // block-uniform
    unsigned long long c[kGatherEach];
    c[0] = first;
#pragma unroll
    for (int e = 1; e < kGatherEach; ++e) {
        const unsigned i = tid + e * kThreads;
        c[e] = 0ull;
        if (i < n) {
            c[e] = __ldcg(&slots[i]);
            slots[i] = 0ull;
        }
    }
    const unsigned long long theta = smp_select<kGatherEach, 4>(sm, c, false, g.k);  // 0: keep all
    if (tid == 0) sm.ngather = 0u;
    __syncthreads();
#pragma unroll 4
    for (int e = 0; e < kGatherEach; ++e) {
        if (c[e] && c[e] >= theta) {
            const unsigned slot = atomicAdd(&sm.ngather, 1u);
            if (slot < (unsigned)kThreads) sm.cand_comp[slot] = c[e];  // k <= kThreads of them
        }
    }
    __syncthreads();
    const unsigned m = sm.ngather < (unsigned)kThreads ? sm.ngather : (unsigned)kThreads;
    const unsigned long long mine = tid < m ? sm.cand_comp[tid] : 0ull;
    __syncthreads();  // read before smp_rank_cut stores
    return smp_rank_cut(sm, mine, m, g);
}

// ---- top-p alone by racing first
//
// A row with top-p and no top-k races before it cuts. After the max barrier every block merges
// its level-0 histogram into the row's (the histogram path's first pass, without its barrier),
// races every token that can win (d >= kNeverWins, min-p) and sends its front: per level-0 bin
// the block's best race key there, kept where it beats the best keys of all better bins of the
// block. The row's last block to arrive (the decider) scans the row's histogram for the top-p
// cut's boundary bin b*: the bins before it are kept whole, those after it dropped. The winner
// (the best key of a kept token) is then the best front key of the bins before b*, unless a front
// key in b* beats it: a kept bin's best key is on its block's front or beaten by a better, kept
// bin of the block, and every key of b* is on a front or beaten by a key of a kept bin. When a key
// of b* does beat it, the exact cut inside b* decides, unless b* holds a single token (a bin's
// first token is always kept): the blocks wait for the decider's verdict, send b*'s tokens with
// their race keys (at most kCap of them) and the row's finisher cuts them as the histogram path's
// deferred cut does. A larger b* (ties), or data the decider cannot use, sends the row down the
// histogram path from its first pass, into the next histogram buffer. Undecided draws are a few
// percent at top-p 0.9 on smooth or peaked rows, most draws at small p (top-p 0.3 keeps a handful
// of tokens, b* holding much of their mass).
constexpr unsigned kVerdictDecided = 1u, kVerdictFallback = 2u, kVerdictBin = 3u;  // kVerdictBin | b* << 2

// Exclusive prefix maximum over the block in thread order (0 for thread 0).
__device__ __forceinline__ unsigned long long smp_block_prefix_max(unsigned long long v, Smem& sm) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long incl = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned long long x = __shfl_up_sync(0xFFFFFFFFu, incl, off);
        if (lane >= (unsigned)off) incl = x > incl ? x : incl;
    }
    if (lane == 31) sm.red64[warp] = incl;
    const unsigned long long left = __shfl_up_sync(0xFFFFFFFFu, incl, 1);
    __syncthreads();
    unsigned long long before = 0ull;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
        if ((unsigned)w < warp && sm.red64[w] > before) before = sm.red64[w];
    __syncthreads();  // red64 may be reused at once
    return lane && left > before ? left : before;
}

// A block's part: the level-0 histogram merged into the row's buffer cx.hpass, then the race and
// the block's front, as (key, bin) pairs in the row's gather slots from the row's count.
template <int P>
__device__ void smp_race_front(Smem& sm, const Tile<P>& t, const Ctx& cx, float min_p, uint4 ctr, unsigned k0,
                               unsigned k1) {
    const Bucket all{-1, 0ull, 0ull, 0ull, ~0ull};
    smp_local_hist<true>(sm, t, all, 0, true);
    smp_merge(sm, cx, kBins, kMergeAll);
    for (int i = threadIdx.x; i < kBins; i += kThreads) sm.bin_hi[i] = 0u, sm.bin_lo[i] = 0u;
    __syncthreads();
    unsigned hi[P];  // each token's race key's high word (never 0: smp_key of r > 0), 0 if it does not race
#pragma unroll
    for (int g = 0; g < P; g += 4) {  // one Philox call per 4 tokens that race
        hi[g] = hi[g + 1] = hi[g + 2] = hi[g + 3] = 0u;
        bool any = false;
#pragma unroll
        for (int e = 0; e < 4; ++e) any |= g < t.n && t.v[g + e] >= kNeverWins;  // -inf past t.n
        if (any) {
            ctr.x = (t.first + g) >> 2;
            const uint4 x = fp4_philox4x32_10(ctr, k0, k1);
            const unsigned words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float d = t.v[g + e];
                if (d < kNeverWins || (min_p > 0.0f && !(expf(d) >= min_p))) continue;
                hi[g + e] = (unsigned)(smp_word_key(d, t.first + g + e, words[e]) >> 32);
                atomicMax(&sm.bin_hi[smp_bin(d)], hi[g + e]);
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < P; ++g) {  // of the tokens with their bin's best high word, the lowest id
        const int bin = smp_bin(t.v[g]);
        if (hi[g] && hi[g] == sm.bin_hi[bin]) atomicMax(&sm.bin_lo[bin], ~(t.first + g));
    }
    __syncthreads();
    constexpr int kEach = kBins / kThreads;  // bins kEach * tid onwards: thread order is bin order
    unsigned long long v[kEach], run = 0ull;
#pragma unroll
    for (int e = 0; e < kEach; ++e) {
        const unsigned bin = threadIdx.x * kEach + e;
        v[e] = (unsigned long long)sm.bin_hi[bin] << 32 | sm.bin_lo[bin];
        run = v[e] > run ? v[e] : run;
    }
    unsigned long long before = smp_block_prefix_max(run, sm);
    unsigned mine = 0u, front = 0u;
#pragma unroll
    for (int e = 0; e < kEach; ++e) {
        if (v[e] > before) front |= 1u << e, ++mine, before = v[e];
    }
    unsigned slot = smp_warp_slots(cx.rs.ngather, mine);
    const unsigned pairs = smp_gather_slots(cx.G) / 2u;
#pragma unroll
    for (int e = 0; e < kEach; ++e) {
        if (!(front >> e & 1u)) continue;
        if (slot < pairs) {
            cx.rs.gather[2u * slot] = v[e];
            cx.rs.gather[2u * slot + 1u] = (unsigned long long)(threadIdx.x * kEach + e);
        } else {
            *cx.rs.front_over = 1u;  // the decider falls back
        }
        ++slot;
    }
}

// The decider's part: the top-p cut's boundary bin b* from the row's histogram (buffer cx.hpass),
// then the best front key of the kept bins. Every front slot it read is put back to 0.
constexpr int kFrontEach = 4;  // front pairs a thread of the decider loads at once

struct RaceDecision {
    unsigned verdict;          // kVerdictDecided, kVerdictBin | b* << 2, or kVerdictFallback
    unsigned long long key;    // decided: the winner; kVerdictBin: the best key of the kept bins
    unsigned n;                // kVerdictBin: the tokens of b*
    unsigned long long rem;    // kVerdictBin: the mass b* must supply to reach the target
};

__device__ RaceDecision smp_race_decide(Smem& sm, const Ctx& cx, float top_p) {
    const unsigned pairs = smp_gather_slots(cx.G) / 2u;
    // The count, the first pairs (zero past the count) and the histogram: one round trip.
    const unsigned n = __ldcg(cx.rs.ngather), over = __ldcg(cx.rs.front_over);
    const unsigned long long* pair = cx.rs.gather;
    unsigned long long key[kFrontEach];
    unsigned bin[kFrontEach];
#pragma unroll
    for (int e = 0; e < kFrontEach; ++e) {
        const unsigned i = threadIdx.x + e * kThreads;
        key[e] = i < pairs ? __ldcg(&pair[2u * i]) : 0ull;
        bin[e] = i < pairs ? (unsigned)__ldcg(&pair[2u * i + 1u]) : 0u;
    }
    unsigned long long rem = 0ull;
    const bool found = smp_pick(sm, cx, kBins, true, rem, top_p);  // block-uniform
    const unsigned bstar = sm.pick_idx, in_bin = sm.pick_count_in;
    const unsigned long long bin_rem = rem - sm.pick_mass_above;
    const unsigned m = min(n, pairs);
    unsigned long long kept = 0ull, undecided = 0ull;
    for (unsigned base = 0u;; base += kFrontEach * kThreads) {
#pragma unroll
        for (int e = 0; e < kFrontEach; ++e) {
            const unsigned i = base + threadIdx.x + e * kThreads;
            if (i >= m) continue;
            if (base) key[e] = __ldcg(&pair[2u * i]), bin[e] = (unsigned)__ldcg(&pair[2u * i + 1u]);
            cx.rs.gather[2u * i] = 0ull;
            cx.rs.gather[2u * i + 1u] = 0ull;
            if (bin[e] < bstar) kept = key[e] > kept ? key[e] : kept;
            if (bin[e] == bstar) undecided = key[e] > undecided ? key[e] : undecided;
        }
        if (base + kFrontEach * kThreads >= m) break;
    }
    kept = smp_block_max(kept, sm);
    undecided = smp_block_max(undecided, sm);
    if (!found || over || n > m) return RaceDecision{kVerdictFallback, 0ull, 0u, 0ull};
    if (undecided <= kept) return RaceDecision{kVerdictDecided, kept, 0u, 0ull};
    if (in_bin == 1u) return RaceDecision{kVerdictDecided, undecided, 0u, 0ull};
    if (in_bin <= (unsigned)kCap) return RaceDecision{kVerdictBin | bstar << 2, kept, in_bin, bin_rem};
    return RaceDecision{kVerdictFallback, 0ull, 0u, 0ull};
}

// After smp_race_front: the row's blocks arrive; the last one decides, and every block returns
// the verdict.
// - Decided: the decider writes the token, puts the row's scratch back to zero, posts the
//   verdict, waits until every block has read it, clears it and hands the scratch to the next
//   round.
// - kVerdictBin: the decider leaves the kept bins' best key in the row's race slot and b*'s token
//   count and remaining mass in cut_n / cut_rem (also in sm); every block then sends b*'s tokens
//   with their race keys to the candidate list, and the row's finisher cuts them exactly, as the
//   histogram path's deferred cut does.
// - Fallback: the histogram path from its first pass.
// In the last two the finisher's arrival count (`done`) goes back to 0, and the finisher clears
// the rest; the row barriers' count (`arrive`) stays at G, so their next target, 2G, holds.
__device__ unsigned smp_race_verdict(Smem& sm, const Ctx& cx, unsigned b, unsigned V, unsigned round, unsigned next,
                                     float top_p, int* out) {
    smp_arrive(sm, cx);
    if (!sm.last) {  // block-uniform
        if (threadIdx.x == 0) {
            unsigned v;
            while ((v = gpu_sync::ld_acquire(cx.rs.verdict)) == 0u) {  // acquires the decider's writes
            }
            sm.verdict = v;
            if ((v & 3u) == kVerdictBin) sm.cut_n = __ldcg(cx.rs.cut_n), sm.cut_rem = __ldcg(cx.rs.cut_rem);
            atomicAdd(cx.rs.ack, 1u);  // after this the block touches the verdict no more
        }
        __syncthreads();
        return sm.verdict;  // read before a later unit writes it: every path on has block barriers
    }
    const RaceDecision dec = smp_race_decide(sm, cx, top_p);
    const bool decided = dec.verdict == kVerdictDecided;
    if (decided)  // the histogram buffer the blocks merged into (the next one was zero and stays so)
        for (int i = threadIdx.x; i < kBins; i += kThreads)
            cx.rs.count[cx.hpass % 3u * kBins + i] = 0u, cx.rs.mass[cx.hpass % 3u * kBins + i] = 0ull;
    if (threadIdx.x == 0) {
        *cx.rs.ngather = 0u;
        *cx.rs.front_over = 0u;
        *cx.rs.done = 0u;
        if (decided) {
            const unsigned tok = ~(unsigned)dec.key;
            out[b] = (int)(tok < V ? tok : 0u);
            *cx.rs.best = 0ull;
            *cx.rs.arrive = 0u;
        } else if ((dec.verdict & 3u) == kVerdictBin) {
            *cx.rs.race = dec.key;  // the finisher's best key beside the cut candidates
            *cx.rs.cut_n = dec.n;
            *cx.rs.cut_rem = dec.rem;
            sm.cut_n = dec.n, sm.cut_rem = dec.rem;
        }
        sm.verdict = dec.verdict;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        gpu_sync::fence_acq_rel();
        atomicExch(cx.rs.verdict, dec.verdict);
        if (decided) {
            while (gpu_sync::ld_acquire(cx.rs.ack) != cx.G - 1u) {
            }
            *cx.rs.verdict = 0u;
            *cx.rs.ack = 0u;
            if (next != round) {  // as smp_finish hands over
                gpu_sync::fence_acq_rel();
                atomicExch(cx.rs.round, next);
            }
        }
    }
    __syncthreads();
    return dec.verdict;
}

// kVerdictBin: the block's tokens of bin `bin` (with d >= kNeverWins and min-p: a race key; else 0)
// to the row's candidate list (count ncand[0]).
template <int P>
__device__ void smp_send_bin(const Tile<P>& t, const Ctx& cx, int bin, float min_p, uint4 ctr, unsigned k0,
                             unsigned k1) {
    unsigned mine = 0u;
#pragma unroll
    for (int j = 0; j < P; ++j) mine += j < t.n && smp_bin(t.v[j]) == bin;
    unsigned slot = smp_warp_slots(cx.rs.ncand, mine);
#pragma unroll
    for (int j = 0; j < P; ++j) {
        if (j >= t.n || smp_bin(t.v[j]) != bin) continue;
        const unsigned long long key = smp_token_key(t.v[j], t.first + j, min_p, ctr, k0, k1);
        if (slot < (unsigned)kCap) cx.rs.cand[slot] = make_ulonglong2(smp_comp(t.v[j], t.first + j), key);
        ++slot;
    }
}

// ---- one (row, block) unit

struct Params {
    float temp, top_p, min_p;
    int top_k;
    bool invalid;
};

// Per-row parameters, with invalid device values replaced as the reference says.
__device__ __forceinline__ Params smp_params(unsigned b, const float* t_rows, float t_all, const int* k_rows,
                                             int k_all, const float* p_rows, float p_all, const float* m_rows,
                                             float m_all) {
    Params p;
    p.temp = t_rows ? t_rows[b] : t_all;
    p.top_k = k_rows ? k_rows[b] : k_all;
    p.top_p = p_rows ? p_rows[b] : p_all;
    p.min_p = m_rows ? m_rows[b] : m_all;
    p.invalid = false;
    if (isnan(p.temp) || p.temp < 0.0f) p.invalid = true, p.temp = 0.0f;
    if (p.top_k < 0) p.invalid = true, p.top_k = 0;
    if (isnan(p.top_p) || p.top_p <= 0.0f || p.top_p > 1.0f) p.invalid = true, p.top_p = 1.0f;
    if (isnan(p.min_p) || p.min_p < 0.0f || p.min_p >= 1.0f) p.invalid = true, p.min_p = 0.0f;
    if (p.temp < SMP_FLT_MIN) p.temp = 0.0f;
    return p;
}

// The deferred cut: the exact boundary among the candidates, then the best race key of those kept.
__device__ unsigned long long smp_cut_candidates(Smem& sm, const Ctx& cx, const Narrow& nr, bool by_mass) {
    const unsigned long long theta = smp_exact(sm, cx, nr.n, by_mass, nr.rem) ? sm.theta : 0ull;
    unsigned long long best = 0ull;
#pragma unroll
    for (int e = 0; e < kCapEach; ++e) {
        const unsigned i = threadIdx.x + e * kThreads;
        if (i < nr.n && sm.cand_comp[i] >= theta && sm.cand_key[i] > best) best = sm.cand_key[i];
    }
    return smp_block_max(best, sm);
}

// The last block of the row to arrive writes the token (the best race key, with the deferred
// cut's candidates when `defer`; the argmax when no race ran), puts the scratch back to zero,
// then hands it to the group's next round (`next`; 0 after the last round, `round` is this one).
// No block of the row touches the scratch after arriving here.
// `gather.k` > 0: the row took the gathered top-k (smp_gather); the finisher makes its cut here.
__device__ void smp_finish(Smem& sm, Ctx& cx, unsigned b, unsigned V, unsigned round, unsigned next, bool defer,
                           const Narrow& nr, bool by_mass, int* out, unsigned* status, GatherCut gather = GatherCut()) {
    smp_arrive(sm, cx);
    if (sm.last) {  // block-uniform
        unsigned long long race = 0ull, best = 0ull;
        unsigned n0 = 0u, n1 = 0u;
        if (threadIdx.x == 0) {  // issued together: one round trip, overlapping the candidates' load
            race = __ldcg(cx.rs.race);
            best = __ldcg(cx.rs.best);
            n0 = __ldcg(cx.rs.ncand);
            n1 = __ldcg(cx.rs.ncand + 1);
        }
        const unsigned long long from_cands =
            defer ? smp_cut_candidates(sm, cx, nr, by_mass)
            : gather.k ? smp_gather_cut(sm, cx.rs.gather, cx.rs.ngather, cx.G, gather) : 0ull;
        if (threadIdx.x == 0) {
            const unsigned long long win = race > from_cands ? race : from_cands;
            const unsigned tok = ~(unsigned)(win ? win : best);
            out[b] = (int)(tok < V ? tok : 0u);
            if ((unsigned)(best >> 32) == smp_key(SMP_NEG_INF)) atomicOr(status, FP4_STATUS_SAMPLER_INPUT);  // no finite logit
            *cx.rs.race = 0ull;
            *cx.rs.best = 0ull;
            *cx.rs.arrive = 0u;
            *cx.rs.done = 0u;
            cx.rs.ncand[0] = 0u;
            cx.rs.ncand[1] = 0u;
            *cx.rs.ngather = 0u;
            *cx.rs.verdict = 0u;  // a racing-first row that fell back: every block has read it
            *cx.rs.ack = 0u;
            *cx.rs.front_over = 0u;
            *cx.rs.cut_n = 0u;
            *cx.rs.cut_rem = 0ull;
            // The candidate slots written this unit (by either stage) go back to zero too.
            const unsigned n = n0 > n1 ? n0 : n1;
            sm.nclear = n < (unsigned)kCap ? n : (unsigned)kCap;
        }
        __syncthreads();  // sm.nclear
        for (unsigned i = threadIdx.x; i < sm.nclear; i += kThreads) cx.rs.cand[i] = make_ulonglong2(0ull, 0ull);
        if (cx.posted) cx.rs.posts[threadIdx.x] = 0u;  // kPostSlots == kThreads
        if (cx.hpass)
            for (int i = threadIdx.x; i < 3 * kBins; i += kThreads) cx.rs.count[i] = 0u, cx.rs.mass[i] = 0ull;
        if (next != round) {  // the next round's blocks wait for `next`; a single round leaves 0 in place
            __syncthreads();
            if (threadIdx.x == 0) {
                gpu_sync::fence_acq_rel();
                atomicExch(cx.rs.round, next);
            }
        }
    }
    __syncthreads();  // sm.last is read before a later unit writes it
}

// The Philox key and counter of this launch, read once by thread 0 (in flight while the block
// loads its tokens); the last block of the grid to arrive advances the counter for the next
// launch, at its end (the arrival's result is waited for only there).
struct Rng {
    unsigned long long key, ctr;
    unsigned ticket;
    bool taken;
};

__device__ __forceinline__ void smp_take_counter(Smem& sm, Rng& rng, unsigned* arrivals) {
    if (rng.taken) return;
    rng.taken = true;
    if (threadIdx.x == 0) {
        sm.s_seed = rng.key;
        sm.s_offset = rng.ctr;
        gpu_sync::fence_acq_rel();  // the read of offset happens before the arrival
        rng.ticket = atomicAdd(arrivals, 1u);
    }
}

template <typename T, int P>
__device__ void sample_unit(Smem& sm, const T* __restrict__ logits, unsigned V, int per, bool vec, unsigned b,
                            unsigned round, unsigned next, Ctx& cx, const Params& p, Rng& rng,
                            unsigned* __restrict__ arrivals, int* __restrict__ out, unsigned* __restrict__ status) {
    const unsigned tid = threadIdx.x;
    Tile<P> t;
    t.first = cx.chunk * (unsigned)(kThreads * per) + tid * (unsigned)per;
    const bool odd = smp_load_tile(logits + (size_t)b * V, V, per, vec, t);
    smp_take_counter(sm, rng, arrivals);  // sm.s_seed / s_offset are read after the barriers below

    // 1. max / argmax, ties to the lower id; NaN, +inf and invalid parameters are events.
    unsigned long long best = 0ull;
#pragma unroll
    for (int j = 0; j < P; ++j) {
        if (j >= t.n) break;
        const unsigned long long c = ((unsigned long long)smp_key(t.v[j]) << 32) | (unsigned)~(t.first + j);
        best = c > best ? c : best;
    }
    // A gathered top-k's bound (smp_post_each): the blocks' largest thread maxima, posted with the
    // maximum. Row-uniform: k, G and the slots are the row's.
    const bool use_k = p.top_k > 0 && (unsigned)p.top_k < V;
    const bool use_p = p.top_p < 1.0f;
    const bool fits = use_k && (unsigned long long)p.top_k * cx.G <= smp_gather_slots(cx.G);
    const unsigned post_each = fits && p.temp != 0.0f ? smp_post_each((unsigned)p.top_k, cx.G) : 0u;
    cx.posted = post_each != 0u;
    if (post_each > 1u) smp_post_maxima(sm, cx, (unsigned)(best >> 32), post_each);
    const bool flag = __syncthreads_or(odd || (p.invalid && cx.chunk == 0u));
    best = smp_block_max(best, sm);
    if (tid == 0) {
        if (flag) atomicOr(status, FP4_STATUS_SAMPLER_INPUT);
        if (best) atomicMax(cx.rs.best, best);
        if (post_each == 1u) cx.rs.posts[cx.chunk] = (unsigned)(best >> 32);  // the block's largest
    }
    Narrow nr;  // the deferred cut, when there is one
    if (p.temp == 0.0f) return smp_finish(sm, cx, b, V, round, next, false, nr, false, out, status);
    smp_barrier(cx);
    const unsigned nposts = cx.G * post_each;
    // volatile: the posted key's load is issued before the maximum's is used (one round trip)
    const unsigned posted = tid < nposts ? *(const volatile unsigned*)(cx.rs.posts + tid) : 0u;
    const float lmax = smp_unkey((unsigned)(*(const volatile unsigned long long*)cx.rs.best >> 32));
    if (!isfinite(lmax)) return smp_finish(sm, cx, b, V, round, next, false, nr, false, out, status);
    const float inv_t = __frcp_rn(p.temp);  // T >= FLT_MIN: finite
#pragma unroll
    for (int j = 0; j < P; ++j)  // d = (canonical logit - l_max) * (1 / T) <= 0 (or -inf)
        if (j < t.n) t.v[j] = __fmul_rn(__fsub_rn(t.v[j], lmax), inv_t) + 0.0f;

    const uint4 ctr = make_uint4(0u, b, (unsigned)sm.s_offset, (unsigned)(sm.s_offset >> 32));
    const unsigned k0 = (unsigned)sm.s_seed, k1 = (unsigned)(sm.s_seed >> 32);
    float d_bound = SMP_NEG_INF;  // the gathered cut's bound: d of the k-th largest posted key
    if (post_each) {
        const unsigned bound = smp_post_bound(sm, posted, nposts, (unsigned)p.top_k);
        if (bound) d_bound = __fmul_rn(__fsub_rn(smp_unkey(bound), lmax), inv_t) + 0.0f;  // as every d
    }
    // Row-uniform: the gathered cut with top-p after the top-k, or for a top-k alone when the bound
    // is above the last bin (else every block would send its k best: the histogram path cuts faster).
    if (fits && (use_p || d_bound > kBinFloor)) {
        smp_gather(sm, t, cx, (unsigned)p.top_k, d_bound);
        smp_finish(sm, cx, b, V, round, next, false, nr, false, out, status,
                   GatherCut{(unsigned)p.top_k, p.top_p, p.min_p, ctr, k0, k1});
        return;
    }

    if (use_p && !use_k) {  // row-uniform: top-p alone races first (smp_race_front)
        cx.with_mass = true;
        smp_race_front(sm, t, cx, p.min_p, ctr, k0, k1);
        const unsigned verdict = smp_race_verdict(sm, cx, b, V, round, next, p.top_p, out);
        if (verdict == kVerdictDecided) return;
        if ((verdict & 3u) == kVerdictBin) {  // the boundary bin's exact cut, by the row's finisher
            const int bin = (int)(verdict >> 2);
            smp_send_bin(t, cx, bin, p.min_p, ctr, k0, k1);
            Narrow nb;
            nb.bk = Bucket{bin, 0ull, 0ull, 0ull, ~0ull};
            smp_bin_range(bin, V, nb.bk);
            nb.n = sm.cut_n, nb.rem = sm.cut_rem, nb.above = 0ull;
            cx.hpass = 1u;  // the finisher clears the histogram buffers
            return smp_finish(sm, cx, b, V, round, next, true, nb, true, out, status);
        }
        ++cx.hpass;  // undecided: the histogram path, its first pass into the next buffer
    }

    // 2. top-k, then top-p over the top-k survivors: thresholds on the composite order. The last
    //    filter's exact cut is left to the finisher (its bucket's tokens race as candidates).
    Cut ck{0ull, 0ull};
    unsigned long long theta = 0ull;
    bool defer = false, defer_by_mass = false;
    int defer_stage = 0;
    cx.with_mass = use_p;
#pragma unroll 1
    for (int stage = 0; stage < 2; ++stage) {  // one copy of the descent's code for both filters
        if (stage == 0 ? !use_k : !(use_p && ck.mass != ~0ull)) continue;
        const bool by_mass = stage == 1;
        const unsigned long long want =
            by_mass ? (use_k ? smp_target(p.top_p, ck.mass) : 0ull) : (unsigned long long)p.top_k;
        const float frac = by_mass && !use_k ? p.top_p : 0.0f;  // the target comes from the histogram
        // the merge's bound: top-k by count; top-p after top-k at the top-k cut's bin (no kept
        // token lies past it, and the scan stops before the top-k mass is passed)
        const int limit = !by_mass ? kMergeByCount : use_k ? smp_bin(smp_unkey((unsigned)(ck.theta >> 32))) : kMergeAll;
        Cut cut{0ull, ~0ull};  // inconsistent data: keep everything
        if (smp_narrow(sm, t, cx, V, by_mass, want, frac, limit, nr)) {
            if (by_mass || !use_p) {
                defer = true, defer_by_mass = by_mass, defer_stage = stage;
                break;
            }
            cut = smp_resolve(sm, t, cx, nr, by_mass, stage);
        }
        if (!by_mass) ck = cut;
        theta = cut.theta > theta ? cut.theta : theta;
    }

    // 3. the race over the kept tokens; the row's last block writes the winner.
    const unsigned long long win =
        smp_block_max(defer ? smp_race<true>(t, cx, theta, p.min_p, nr, defer_stage, ctr, k0, k1)
                            : smp_race<false>(t, cx, theta, p.min_p, nr, defer_stage, ctr, k0, k1),
                      sm);
    if (tid == 0 && win) atomicMax(cx.rs.race, win);
    smp_finish(sm, cx, b, V, round, next, defer, nr, defer_by_mass, out, status);
}

template <typename T, int P>
__device__ __forceinline__ void sample_rows(const T* __restrict__ logits, unsigned B, unsigned V, int per, int G,
                                            int vec, const float* __restrict__ t_rows, float t_all,
                                            const int* __restrict__ k_rows, int k_all,
                                            const float* __restrict__ p_rows, float p_all,
                                            const float* __restrict__ m_rows, float m_all,
                                            const unsigned long long* __restrict__ seed,
                                            unsigned long long* __restrict__ offset, unsigned* __restrict__ arrivals,
                                            unsigned* __restrict__ scratch, int* __restrict__ out,
                                            unsigned* __restrict__ status) {
    __shared__ Smem sm;
    const unsigned tid = threadIdx.x;
    Rng rng{0ull, 0ull, 0u, false};
    if (tid == 0) rng.key = __ldcg(seed), rng.ctr = __ldcg(offset);  // waited for after the tile load

    const unsigned rows_per_round = gridDim.x / (unsigned)G, group = blockIdx.x / (unsigned)G;
    Ctx cx;
    cx.G = (unsigned)G;
    cx.chunk = blockIdx.x % (unsigned)G;
    cx.rs = smp_row_scratch(scratch + (size_t)group * (kRowWords + 2u * smp_gather_slots(cx.G)));
    unsigned round = 0u;
    for (unsigned b = group; b < B; b += rows_per_round, ++round) {
        if (round) {  // wait for the previous round's finisher to clear the scratch
            if (tid == 0) {
                while (gpu_sync::ld_acquire(cx.rs.round) != round) {  // acquires the cleared scratch
                }
            }
            __syncthreads();
        }
        cx.nbar = 0u;
        cx.hpass = 0u;
        cx.posted = false;
        const unsigned next = b + rows_per_round < B ? round + 1u : 0u;
        const Params p = smp_params(b, t_rows, t_all, k_rows, k_all, p_rows, p_all, m_rows, m_all);
        sample_unit<T, P>(sm, logits, V, per, vec != 0, b, round, next, cx, p, rng, arrivals, out, status);
    }
    if (tid == 0 && rng.ticket == gridDim.x - 1) {  // every block has read the counter
        *arrivals = 0u;
        *offset = rng.ctr + 1ull;
    }
}

#define SMP_ARGS(T)                                                                                               \
    const T *__restrict__ logits, unsigned B, unsigned V, int per, int G, int vec, const float *__restrict__ t_rows, \
        float t_all, const int *__restrict__ k_rows, int k_all, const float *__restrict__ p_rows, float p_all,      \
        const float *__restrict__ m_rows, float m_all, const unsigned long long *__restrict__ seed,                 \
        unsigned long long *__restrict__ offset, unsigned *__restrict__ arrivals, unsigned *__restrict__ scratch,   \
        int *__restrict__ out, unsigned *__restrict__ status
#define SMP_PASS \
    logits, B, V, per, G, vec, t_rows, t_all, k_rows, k_all, p_rows, p_all, m_rows, m_all, seed, offset, arrivals, scratch, out, status

// One build per register tile: `per` <= P tokens per thread (fp4kit/ops/sampling.py picks the
// smallest build holding the launch's `per`). The token loops are unrolled to P, so the P = 4 build
// that a small batch over a large vocabulary runs is half the code of the P = 16 one.
#define SMP_KERNEL(name, T, P)                                                            \
    extern "C" __global__ void __launch_bounds__(kThreads, 2) name(SMP_ARGS(T)) { sample_rows<T, P>(SMP_PASS); }
SMP_KERNEL(sample_f32, float, kMaxPer)
SMP_KERNEL(sample_bf16, __nv_bfloat16, kMaxPer)
SMP_KERNEL(sample_f32_p4, float, 4)
SMP_KERNEL(sample_bf16_p4, __nv_bfloat16, 4)
SMP_KERNEL(sample_f32_p8, float, 8)
SMP_KERNEL(sample_bf16_p8, __nv_bfloat16, 8)
