// Lightning indexer (DeepSeek-V4 CSA layers), one decode token per sequence: score every live
// compressed key, score[b, t] = sum_h w[b, h] * ReLU(q[b, h] . keys[b, t]), and select the top k.
// fp4kit/reference/indexer.py is the specification.
//
// Arguments (row-major, contiguous, 16-byte aligned):
//   q        bf16  [B, H, D]   index queries; H a multiple of 8 in [8, 64], D a multiple of 32 in [32, 128]
//   w        fp32  [B, H]      per-head weights (bf16 with w_bf16), each times w_scale in fp32
//   keys     bf16  [B, C, D]   the compressed-key cache, capacity C; or [1, C, D] with shared_keys:
//                              one sequence's cache scored by every row (the query positions of a prefill)
//   lengths  int32 [B]         live entries of each row, read on the device; n_b = clamp(lengths[b], 0, C)
//   scores   fp32  [B, C]      scratch written by indexer_scores for t < n_b (the rest is left as it was)
//   indices  int32 [B, k]      the selected indices in ascending order, then -1
//   values   fp32  [B, k]      their canonical scores (NaN -> -inf, -0 -> +0), then -inf
//   status   uint32 [1]        FP4_STATUS_INDEXER_INPUT (2) is or-ed in when a live score is NaN or a length
//                              lies outside [0, C]
//   q_pos    int32 [B]         or null; given, q is the raw projection and indexer_scores rotates the
//                              last q_rope_dim channels of each head (RoPE alone, no norm) at position
//                              q_pos[b] + q_pos_offset (frequencies q_inv_freq, float64 [q_rope_dim / 2])
//                              as it stages the query: the bits of elementwise.cu's rmsnorm_rope_bf16
//                              with normalize = 0 (one launch less); decode only
//   key_range uint32 [B, 2]    or null; zero between calls: indexer_scores gathers each row's lowest
//                              (stored complemented) and highest score key by atomicMax, the select
//                              reads them, starts its radix passes at the highest bit in which they
//                              differ (select_range, next_digit) and writes the zeros back (empty_range);
//                              null: the passes cover all 32 bits
//
// indexer_scores: grid (ceil(C / 128), B), 128 threads (4 warps). Block (x, b) scores keys
//   128x .. 128x+127 of row b and returns at once when 128x >= n_b, so the grid is sized for the
//   capacity but only live tiles load anything. The 64 x 128 query block and the weights are staged
//   in shared memory in MMA fragment order; each warp computes 32 keys x H heads with
//   mma.m16n8k16 bf16 -> fp32 (keys are the A operand, 16-byte loads, one row per lane group;
//   queries the B operand), then ReLU, times w, summed over heads in a fixed order (per thread,
//   then across the 4 threads of a row by shuffles): deterministic, fp32 throughout.
// indexer_topk_registers (C <= 32768) / indexer_topk_global (any C): grid B, 1024 threads, one
//   block per row. Thread i owns a contiguous range of the live scores (in registers, 32 at most,
//   or re-read from global memory). The scores map to order-preserving unsigned keys; a radix
//   select (digits of up to 11 bits from the highest bit that varies, by the key range; 11, 11 and
//   10 bits without one; a shared 2048-bin histogram per pass, a block scan to
//   find the bin holding the k-th largest key) fixes the threshold key T and how many entries
//   equal to T are taken; it stops early once the threshold bin is taken whole. A block scan of
//   (greater, equal) counts then gives every thread its output position: entries above T, and the
//   first ones equal to T in index order (the tie rule: larger score first, equal scores lower
//   index first), are written in ascending index order. No sort, one read of the scores (registers).
//   indexer_topk_registers_small (C <= 8192): the same with 256 threads (fewer warps at every
//   barrier and block scan), the same selection bit for bit.
// indexer_topk_cluster (C <= 131072): grid 8B, 1024 threads, one thread-block cluster of 8 blocks
//   per row (blocks 8b .. 8b+7, cluster rank r). The same select spread over 8 SMs: thread
//   1024r + i owns a contiguous range of the row's capacity (in registers, 16 at most; loaded
//   before the live length is known, the entries past it dropped), so block r holds the r-th
//   eighth and the output positions are a block scan plus the counts of the lower ranks.
//   Digits of up to 8 bits (4 passes at most, fewer with a key range, stopping early as above):
//   each block builds the histogram of its share (256 bins in shared memory, equal bins of a warp
//   added as one atomic), a cluster barrier, then warp 0 of every block sums the 8 histograms through distributed shared
//   memory and finds the threshold bin; every block computes the same integer sums, so all take
//   the same decisions without another barrier. Each pass has its own histogram (zeroed once),
//   so a block never clears one a peer may still read. Same selection, order and values as the
//   one-block kernels. indexer_topk_cluster_small (C <= 32768): the same with blocks of 256
//   threads (grid 8B, 256 threads), fewer warps at every barrier and block scan.
#include <cuda_bf16.h>

#include "common/block_scan.cuh"
#include "common/status.cuh"
#include "common/pdl.cuh"
#include "common/rope.cuh"

#define IDX_NEG_INF __int_as_float(0xFF800000)

constexpr int kScoreWarps = 4;
constexpr int kScoreThreads = 32 * kScoreWarps;
constexpr unsigned kKeysPerWarp = 32;  // two m16 tiles
constexpr unsigned kKeysPerBlock = kScoreWarps * kKeysPerWarp;
constexpr int kMaxHeadTiles = 8;  // 64 heads, 8 per n8 tile
constexpr int kMaxChunks = 4;     // 128 dims, 32 per chunk

constexpr int kTopkThreads = 1024;
constexpr int kRegisterItems = 32;  // scores per thread in registers: C <= 32 * 1024
constexpr unsigned kBins = 2048;

constexpr int kClusterBlocks = 8;  // the portable maximum cluster size
constexpr int kClusterItems = 16;  // scores per thread in registers: C <= 16 * 8192 (32 would spill at 64 registers)
constexpr unsigned kRadixBins = 256;  // 8-bit digits: 8 histograms are 8 KB, one warp sums them
constexpr int kRadixPasses = 4;

__device__ __forceinline__ unsigned live_length(const int* lengths, unsigned b, unsigned C) {
    const int len = lengths[b];
    return len < 0 ? 0u : ((unsigned)len > C ? C : (unsigned)len);
}

// D += A (16x16, row) * B (16x8, col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void idx_mma(float d[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                        unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Order-preserving map of the canonical score (NaN -> -inf; zero and subnormals -> +0, as -ftz
// arithmetic would see them) to an unsigned key: a larger score gives a larger key.
__device__ __forceinline__ unsigned score_key(float s) {
    unsigned u = isnan(s) ? 0xFF800000u : __float_as_uint(s);
    if ((u & 0x7F800000u) == 0u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_score(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// ReLU that keeps a NaN a NaN (fmaxf would drop it and hide a broken input).
__device__ __forceinline__ float relu_keep_nan(float x) { return x < 0.0f ? 0.0f : x; }

constexpr int kStageEach = kMaxChunks * kMaxHeadTiles * 32 / kScoreThreads;  // query words per thread

// The query words this thread stages (8 channels each: head h, channels d .. d + 7, as indexer_scores
// lays them out) with their pairs among the last rope_dim channels rotated at position p, as
// rmsnorm_rope_bf16 rotates them with normalize = 0 (each pair's cosine and sine once per block,
// in cs, by the first rope_dim / 2 threads).
__device__ __forceinline__ void rotate_query(uint4 (&qv)[kStageEach], unsigned D, unsigned rope_dim, int p,
                                             const double* inv_freq, unsigned head_tiles, unsigned staged,
                                             float2* cs) {
    if (threadIdx.x < rope_dim / 2) {
        float c, s;
        rope_cos_sin(p, threadIdx.x, inv_freq, c, s);
        cs[threadIdx.x] = make_float2(c, s);
    }
    __syncthreads();
    const unsigned first_rope_pair = (D - rope_dim) / 2;
#pragma unroll
    for (int i = 0; i < kStageEach; ++i) {
        const unsigned e = threadIdx.x + i * kScoreThreads;
        const unsigned l = e & 31, tile_id = e >> 5;
        const unsigned d = (tile_id / head_tiles) * 32 + 8 * (l & 3);
        if (e >= staged || d + 8 <= 2 * first_rope_pair) continue;  // no rotated pair in this word
        unsigned* words = reinterpret_cast<unsigned*>(&qv[i]);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned j = d / 2 + k;
            if (j < first_rope_pair) continue;
            const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[k]));
            float a = v.x, bb = v.y;
            const float2 r = cs[j - first_rope_pair];
            rope_apply(a, bb, r.x, r.y);
            const __nv_bfloat162 out = __floats2bfloat162_rn(a, bb);
            words[k] = *reinterpret_cast<const unsigned*>(&out);
        }
    }
}

// The MMA's k order is a permutation of the head dimension, the same for both operands, so the
// dot products are unchanged: in a 32-wide chunk, lane group member t (lane & 3) holds elements
// 8t .. 8t+7 of its row as one 16-byte word (x, y, z, w). MMA step 0 takes (x, y), step 1 (z, w):
// the A registers (a0 | a2) of row g and the B registers (b0 | b1) of head g cover the same
// element pairs.
extern "C" __global__ void __launch_bounds__(kScoreThreads) indexer_scores(
    const __nv_bfloat16* __restrict__ q, const void* __restrict__ w, int w_bf16, float w_scale,
    const __nv_bfloat16* __restrict__ keys, const int* __restrict__ lengths, float* __restrict__ scores, unsigned H,
    unsigned D, unsigned C, unsigned shared_keys, unsigned* __restrict__ key_range, const int* __restrict__ q_pos,
    int q_pos_offset, const double* __restrict__ q_inv_freq, unsigned q_rope_dim) {
    pdl::wait_prior();
    const unsigned b = blockIdx.y;
    const unsigned n = live_length(lengths, b, C);
    const unsigned tile = blockIdx.x * kKeysPerBlock;
    if (tile >= n) return;  // past the live length: nothing to load

    __shared__ uint4 sq[kMaxChunks * kMaxHeadTiles * 32];  // query B fragments, [chunk][head tile][lane]
    __shared__ float sw[kMaxHeadTiles * 8];
    __shared__ float2 rope_cs[kMaxChunks * 32 / 2];  // the query's RoPE: (cos, sin) of each rotated pair
    const unsigned head_tiles = H / 8, chunks = D / 32;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const unsigned first = tile + warp * kKeysPerWarp;

    // The keys first (HBM), then the query and weights (L2): their latencies overlap instead of
    // adding up, since the keys do not wait for the block barrier of the query staging.
    // A operand: key rows first + 16 mt + 8 half + g; rows past the live length read as zero.
    const __nv_bfloat16* kb = shared_keys ? keys : keys + (size_t)b * C * D;
    uint4 a[kMaxChunks][2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const unsigned row = first + 16 * mt + 8 * half + g;
            const bool live = row < n;
            const uint4* src = reinterpret_cast<const uint4*>(kb + (size_t)(live ? row : 0u) * D + 8 * t);
#pragma unroll
            for (int c = 0; c < kMaxChunks; ++c)
                a[c][mt][half] = (live && (unsigned)c < chunks) ? src[4 * c] : make_uint4(0u, 0u, 0u, 0u);
        }
    }

    // all of a thread's query words loaded before any is stored: one L2 round trip, not a chain
    const __nv_bfloat16* qb = q + (size_t)b * H * D;
    const unsigned staged = chunks * head_tiles * 32;
    uint4 qv[kStageEach];
#pragma unroll
    for (int i = 0; i < kStageEach; ++i) {
        const unsigned e = threadIdx.x + i * kScoreThreads;
        const unsigned l = e & 31, tile_id = e >> 5;  // tile_id = chunk * head_tiles + head tile
        const unsigned h = (tile_id % head_tiles) * 8 + (l >> 2);
        const unsigned d = (tile_id / head_tiles) * 32 + 8 * (l & 3);
        if (e < staged) qv[i] = *reinterpret_cast<const uint4*>(qb + (size_t)h * D + d);
    }
    if (q_pos != nullptr) rotate_query(qv, D, q_rope_dim, q_pos[b] + q_pos_offset, q_inv_freq, head_tiles, staged,
                                       rope_cs);
#pragma unroll
    for (int i = 0; i < kStageEach; ++i) {
        const unsigned e = threadIdx.x + i * kScoreThreads;
        if (e < staged) sq[e] = qv[i];
    }
    // the head weights w * w_scale in fp32 (w fp32 or bf16): the scale folded in here, not by a launch
    static_assert(kMaxHeadTiles * 8 <= kScoreThreads, "one head weight per thread");
    if (threadIdx.x < H) {
        const size_t i = (size_t)b * H + threadIdx.x;
        const float wh = w_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(w)[i]) : static_cast<const float*>(w)[i];
        sw[threadIdx.x] = __fmul_rn(wh, w_scale);
    }
    __syncthreads();
    if (first >= n) return;  // no barrier below

    float acc[2][kMaxHeadTiles][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < kMaxHeadTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
        if ((unsigned)c >= chunks) break;
#pragma unroll
        for (int nt = 0; nt < kMaxHeadTiles; ++nt) {
            if ((unsigned)nt >= head_tiles) break;
            const uint4 bq = sq[((unsigned)c * head_tiles + nt) * 32 + lane];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                idx_mma(acc[mt][nt], a[c][mt][0].x, a[c][mt][1].x, a[c][mt][0].y, a[c][mt][1].y, bq.x, bq.y);
                idx_mma(acc[mt][nt], a[c][mt][0].z, a[c][mt][1].z, a[c][mt][0].w, a[c][mt][1].w, bq.z, bq.w);
            }
        }
    }

    // C fragment: acc[mt][nt][0..1] = row g, heads 8nt + 2t, +1; acc[mt][nt][2..3] = row g + 8.
    float* out = scores + (size_t)b * C;
    unsigned key_lo = 0xFFFFFFFFu, key_hi = 0u;  // this lane's live keys
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        float s_lo = 0.0f, s_hi = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kMaxHeadTiles; ++nt) {
            if ((unsigned)nt >= head_tiles) break;
            const float w0 = sw[8 * nt + 2 * t], w1 = sw[8 * nt + 2 * t + 1];
            s_lo = __fmaf_rn(w0, relu_keep_nan(acc[mt][nt][0]), s_lo);
            s_lo = __fmaf_rn(w1, relu_keep_nan(acc[mt][nt][1]), s_lo);
            s_hi = __fmaf_rn(w0, relu_keep_nan(acc[mt][nt][2]), s_hi);
            s_hi = __fmaf_rn(w1, relu_keep_nan(acc[mt][nt][3]), s_hi);
        }
        s_lo = __fadd_rn(s_lo, __shfl_xor_sync(0xFFFFFFFFu, s_lo, 1));
        s_lo = __fadd_rn(s_lo, __shfl_xor_sync(0xFFFFFFFFu, s_lo, 2));
        s_hi = __fadd_rn(s_hi, __shfl_xor_sync(0xFFFFFFFFu, s_hi, 1));
        s_hi = __fadd_rn(s_hi, __shfl_xor_sync(0xFFFFFFFFu, s_hi, 2));
        const unsigned row = first + 16 * mt + g;
        if (t == 0 && row < n) out[row] = s_lo;
        if (t == 0 && row + 8 < n) out[row + 8] = s_hi;
        if (t == 0 && row < n) key_lo = min(key_lo, score_key(s_lo)), key_hi = max(key_hi, score_key(s_lo));
        if (t == 0 && row + 8 < n) key_lo = min(key_lo, score_key(s_hi)), key_hi = max(key_hi, score_key(s_hi));
    }
    if (key_range) {  // the row's key range for the select's first radix digit (see select_range)
        key_lo = __reduce_min_sync(0xFFFFFFFFu, key_lo);
        key_hi = __reduce_max_sync(0xFFFFFFFFu, key_hi);
        if (lane == 0) {
            atomicMax(key_range + 2 * b, ~key_lo);  // stored complemented: a zeroed range is empty
            atomicMax(key_range + 2 * b + 1, key_hi);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// top-k

// This thread's share of a row's live scores: the contiguous range [begin, begin + count), as keys.
// Contiguous ranges make the output positions one block scan; per is a multiple of 4 so that the
// range starts on a 16-byte boundary for float4 loads.
template <int kItems>
struct RegisterKeys {
    unsigned key[kItems];
    unsigned begin, count;

    // Returns true if a live score is NaN.
    // thread `t` of the `threads` that share the row
    __device__ __forceinline__ bool load(const float* row, unsigned n, bool vec4, unsigned t, unsigned threads) {
        const unsigned per = ((n + threads - 1) / threads + 3u) & ~3u;  // <= kItems for n <= kItems * threads
        begin = t * per;
        count = begin < n ? min(per, n - begin) : 0u;
        bool nan = false;
#pragma unroll
        for (int i = 0; i < kItems; i += 4) {
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if ((unsigned)i < count) {
                if (vec4) {  // begin + i < n <= C and C % 4 == 0: the whole float4 lies inside the row
                    const float4 f = *reinterpret_cast<const float4*>(row + begin + i);
                    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
                } else {
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if ((unsigned)(i + j) < count) v[j] = row[begin + i + j];
                }
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bool live = (unsigned)(i + j) < count;
                nan |= live && isnan(v[j]);
                key[i + j] = live ? score_key(v[j]) : 0u;
            }
        }
        return nan;
    }

    // The same keys, but the row split by its capacity C (C % 4 == 0 with vec4, C <= kItems *
    // threads) instead of its live length n: the scores' addresses do not wait for the length, so
    // their loads and the length's are in flight together (one L2 round trip instead of two in a
    // chain). Entries at or past n are loaded and not kept. Kept apart from `load`: written as one
    // function for both, the 256-thread one-block select compiled to 113 registers (89 apart) and
    // the 1024-thread one to a stack frame.
    __device__ __forceinline__ bool load_by_capacity(const float* row, unsigned n, unsigned C, bool vec4, unsigned t,
                                                     unsigned threads) {
        const unsigned per = ((C + threads - 1) / threads + 3u) & ~3u;
        begin = t * per;
        float v[kItems];
#pragma unroll
        for (int i = 0; i < kItems; i += 4) {
            v[i] = v[i + 1] = v[i + 2] = v[i + 3] = 0.0f;
            if ((unsigned)i < per && begin + i < C) {
                if (vec4) {
                    const float4 f = *reinterpret_cast<const float4*>(row + begin + i);
                    v[i] = f.x, v[i + 1] = f.y, v[i + 2] = f.z, v[i + 3] = f.w;
                } else {
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (begin + i + j < C) v[i + j] = row[begin + i + j];
                }
            }
        }
        count = begin < n ? min(per, n - begin) : 0u;
        bool nan = false;
#pragma unroll
        for (int i = 0; i < kItems; ++i) {
            const bool live = (unsigned)i < count;
            nan |= live && isnan(v[i]);
            key[i] = live ? score_key(v[i]) : 0u;
        }
        return nan;
    }

    template <class F>
    __device__ __forceinline__ void for_each(F&& f) const {
#pragma unroll
        for (int i = 0; i < kItems; ++i)
            if ((unsigned)i < count) f(begin + i, key[i]);
    }
};

struct GlobalKeys {
    const float* row;
    unsigned begin, count;

    __device__ __forceinline__ bool load(const float* r, unsigned n, bool, unsigned t, unsigned threads) {
        row = r;
        const unsigned per = (n + threads - 1) / threads;
        begin = t * per;
        count = begin < n ? min(per, n - begin) : 0u;
        bool nan = false;
        for (unsigned i = 0; i < count; ++i) nan |= isnan(row[begin + i]);
        return nan;
    }

    template <class F>
    __device__ __forceinline__ void for_each(F&& f) const {
        for (unsigned i = 0; i < count; ++i) f(begin + i, score_key(row[begin + i]));
    }
};

// The threshold found by the radix passes: key bits under `mask` (the top bits) equal `bits`.
// Entries whose top bits are larger are all taken; of those equal, the first `need` in index order.
// This thread's (greater, equal) counts, packed for one 64-bit scan.
template <class Keys>
__device__ __forceinline__ unsigned long long threshold_counts(const Keys& keys, unsigned mask, unsigned bits) {
    unsigned greater = 0u, equal = 0u;
    keys.for_each([&](unsigned, unsigned key) {
        const unsigned top = key & mask;
        greater += top > bits;
        equal += top == bits;
    });
    return greater | ((unsigned long long)equal << 32);
}

// This thread's selected entries in index order from `before` (the packed counts of every entry
// before its own), then the -1 / -inf padding of slots min(n, k) + first, + stride, ... below k.
template <class Keys>
__device__ __forceinline__ void write_selection(const Keys& keys, unsigned mask, unsigned bits, unsigned need,
                                                unsigned long long before, unsigned n, unsigned k, unsigned first,
                                                unsigned stride, int* out_idx, float* out_val) {
    unsigned eq_rank = (unsigned)(before >> 32);
    unsigned pos = (unsigned)before + min(eq_rank, need);
    keys.for_each([&](unsigned i, unsigned key) {
        const unsigned top = key & mask;
        const bool take = top > bits || (top == bits && eq_rank++ < need);
        if (take) {
            out_idx[pos] = (int)i;
            out_val[pos] = key_score(key);
            ++pos;
        }
    });
    for (unsigned j = min(n, k) + first; j < k; j += stride) {
        out_idx[j] = -1;
        out_val[j] = IDX_NEG_INF;
    }
}

// The row's key range from the scoring kernel (key_range [B, 2]: ~lowest key, highest key; all zero
// means empty, and the select puts them back to zero once read): every live key lies in [lo, hi],
// so the bits above the highest bit where lo and hi differ are the same in every key and need no
// radix pass. Returns that bit, with the common top bits as `mask` / `bits`: 31 with an empty mask
// when no range is known (null, or nothing was scored), -1 when every live key is equal.
__device__ __forceinline__ int select_range(unsigned* key_range, unsigned b, unsigned& mask, unsigned& bits) {
    mask = 0u, bits = 0u;
    if (!key_range) return 31;
    const unsigned lo = ~__ldcg(key_range + 2 * b), hi = __ldcg(key_range + 2 * b + 1);  // written at L2 by atomics
    if (lo > hi) return 31;
    if (lo == hi) {
        mask = 0xFFFFFFFFu, bits = hi;
        return -1;
    }
    const int top = 31 - __clz(lo ^ hi);
    mask = top == 31 ? 0u : 0xFFFFFFFFu << (top + 1);
    bits = hi & mask;
    return top;
}

// Puts a row's key range back to empty (zero) once every block of its select has read it.
__device__ __forceinline__ void empty_range(unsigned* key_range, unsigned b) {
    if (key_range) key_range[2 * b] = 0u, key_range[2 * b + 1] = 0u;
}

// The next radix digit from bit `high` down: `bits` wide, or the bits left; its shift and mask,
// with `high` moved below it (negative once every bit is resolved).
__device__ __forceinline__ unsigned next_digit(int& high, int bits, int& shift) {
    const int width = high + 1 < bits ? high + 1 : bits;
    shift = high + 1 - width;
    high = shift - 1;
    return (1u << width) - 1u;
}

template <class Keys, int kThreads = kTopkThreads>
__device__ __forceinline__ void topk_row(const float* __restrict__ scores, const int* __restrict__ lengths,
                                         unsigned C, unsigned k, int vec4, int* __restrict__ indices,
                                         float* __restrict__ values, unsigned* __restrict__ status,
                                         unsigned* __restrict__ key_range) {
    static_assert(kBins % kThreads == 0, "whole bins per thread");
    constexpr unsigned kBinsEach = kBins / kThreads;
    __shared__ unsigned hist[kBins];
    __shared__ unsigned scan32[32];
    __shared__ unsigned long long scan64[32];
    __shared__ unsigned s_digit, s_need, s_count, s_mask, s_bits;
    __shared__ int s_top;

    const unsigned b = blockIdx.x, tid = threadIdx.x;
    const unsigned n = live_length(lengths, b, C);
    Keys keys;
    bool flag = keys.load(scores + (size_t)b * C, n, vec4 != 0, tid, kThreads);
    if (tid == 0) {
        const int len = lengths[b];
        flag |= len < 0 || (unsigned)len > C;
        s_top = select_range(key_range, b, s_mask, s_bits);
        empty_range(key_range, b);  // this thread was its only reader
    }
    if (__syncthreads_or(flag) && tid == 0) atomicOr(status, FP4_STATUS_INDEXER_INPUT);

    // The threshold: the key bits under resolved_mask (top bits) equal resolved_bits. Entries whose
    // top bits are larger are all taken; of those equal, the first `need` in index order. Before
    // any pass (n <= k: everything is taken) the mask is empty and every entry is "equal".
    // Digits of up to 11 bits from the highest bit that varies (no range: 11, 11 and 10 bits).
    unsigned resolved_mask = 0u, resolved_bits = 0u, need = k;
    if (n > k) {
        resolved_mask = s_mask, resolved_bits = s_bits;
#pragma unroll 1
        for (int high = s_top; high >= 0;) {
            int shift;
            const unsigned digit_mask = next_digit(high, 11, shift);
#pragma unroll
            for (unsigned i = 0; i < kBinsEach; ++i) hist[tid + i * kThreads] = 0u;
            __syncthreads();
            keys.for_each([&](unsigned, unsigned key) {
                if ((key & resolved_mask) == resolved_bits) atomicAdd(&hist[(key >> shift) & digit_mask], 1u);
            });
            __syncthreads();
            // thread j holds bins 2047 - kBinsEach j down to 2048 - kBinsEach (j + 1): the scan
            // counts the entries in larger bins
            const unsigned top = kBins - 1 - kBinsEach * tid;
            unsigned counts[kBinsEach], sum = 0u;
#pragma unroll
            for (unsigned i = 0; i < kBinsEach; ++i) sum += counts[i] = hist[top - i];
            unsigned above = block_inclusive_scan(sum, scan32) - sum;
#pragma unroll
            for (unsigned i = 0; i < kBinsEach; ++i) {
                if (above < need && need <= above + counts[i]) s_digit = top - i, s_need = need - above, s_count = counts[i];
                above += counts[i];
            }
            __syncthreads();
            resolved_bits |= s_digit << shift;
            resolved_mask |= digit_mask << shift;
            const unsigned in_bin = s_count;
            need = s_need;
            if (in_bin == need) break;  // the threshold bin is taken whole: no tie left to resolve
        }
    }

    const unsigned long long mine = threshold_counts(keys, resolved_mask, resolved_bits);
    const unsigned long long before = block_inclusive_scan(mine, scan64) - mine;
    write_selection(keys, resolved_mask, resolved_bits, need, before, n, k, tid, kThreads, indices + (size_t)b * k,
                    values + (size_t)b * k);
}

// The one-block select in a block of kSmallTopkThreads (8 warps) for rows of up to 32 * 256 entries:
// the same passes, with a quarter of the warps at every barrier and block scan (ops/indexer.py
// `TOPK_SMALL_MAX_CAPACITY`).
constexpr int kSmallTopkThreads = 256;
extern "C" __global__ void __launch_bounds__(kSmallTopkThreads, 1) indexer_topk_registers_small(
    const float* __restrict__ scores, const int* __restrict__ lengths, unsigned C, unsigned k, int vec4,
    int* __restrict__ indices, float* __restrict__ values, unsigned* __restrict__ status,
    unsigned* __restrict__ key_range) {
    pdl::wait_prior();
    topk_row<RegisterKeys<kRegisterItems>, kSmallTopkThreads>(scores, lengths, C, k, vec4, indices, values, status, key_range);
}

extern "C" __global__ void __launch_bounds__(kTopkThreads, 1) indexer_topk_registers(
    const float* __restrict__ scores, const int* __restrict__ lengths, unsigned C, unsigned k, int vec4,
    int* __restrict__ indices, float* __restrict__ values, unsigned* __restrict__ status,
    unsigned* __restrict__ key_range) {
    pdl::wait_prior();
    topk_row<RegisterKeys<kRegisterItems>>(scores, lengths, C, k, vec4, indices, values, status, key_range);
}

extern "C" __global__ void __launch_bounds__(kTopkThreads, 1) indexer_topk_global(
    const float* __restrict__ scores, const int* __restrict__ lengths, unsigned C, unsigned k, int vec4,
    int* __restrict__ indices, float* __restrict__ values, unsigned* __restrict__ status,
    unsigned* __restrict__ key_range) {
    pdl::wait_prior();
    topk_row<GlobalKeys>(scores, lengths, C, k, vec4, indices, values, status, key_range);
}

// ---------------------------------------------------------------------------------------------
// top-k in a thread-block cluster (sm_90)

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// barrier.cluster in two halves: arrive (release: this block's shared writes become visible to
// the peers) and wait (acquire); a block may not exit while a peer can still read its memory.
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}

// The address of `p` (this block's shared memory) in the shared memory of cluster block `rank`.
__device__ __forceinline__ unsigned cluster_address(const void* p, unsigned rank) {
    unsigned remote;
    asm("mapa.shared::cluster.u32 %0, %1, %2;"
        : "=r"(remote) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))), "r"(rank));
    return remote;
}

__device__ __forceinline__ uint4 load_cluster_u4(unsigned address) {
    uint4 v;
    asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long load_cluster_u64(unsigned address) {
    unsigned long long v;
    asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(address) : "memory");
    return v;
}

// One row's select on the cluster of 8 blocks of kThreads threads this block belongs to.
template <int kThreads>
__device__ __forceinline__ void topk_cluster_row(const float* __restrict__ scores, const int* __restrict__ lengths,
                                                 unsigned C, unsigned k, int vec4, int* __restrict__ indices,
                                                 float* __restrict__ values, unsigned* __restrict__ status,
                                                 unsigned* __restrict__ key_range) {
    constexpr unsigned kClusterThreads = kClusterBlocks * kThreads;
    __shared__ __align__(16) unsigned hist[kRadixPasses][kRadixBins];
    __shared__ unsigned long long scan64[32];
    __shared__ unsigned long long s_total, s_base;
    __shared__ unsigned s_digit, s_need, s_count, s_mask, s_bits;
    __shared__ int s_top;

    const unsigned rank = cluster_rank(), b = blockIdx.x / kClusterBlocks, tid = threadIdx.x;
    const unsigned lane = tid & 31, warp = tid >> 5;
    const unsigned n = live_length(lengths, b, C);
    for (unsigned i = tid; i < kRadixPasses * kRadixBins; i += kThreads) (&hist[0][0])[i] = 0u;
    RegisterKeys<kClusterItems> keys;
    bool flag = keys.load_by_capacity(scores + (size_t)b * C, n, C, vec4 != 0, rank * kThreads + tid, kClusterThreads);
    if (rank == 0 && tid == 0) {
        const int len = lengths[b];
        flag |= len < 0 || (unsigned)len > C;
    }
    if (tid == 0) s_top = select_range(key_range, b, s_mask, s_bits);  // rank 0 empties it after a cluster barrier
    if (__syncthreads_or(flag) && tid == 0) atomicOr(status, FP4_STATUS_INDEXER_INPUT);

    // As in topk_row: the top bits under resolved_mask equal resolved_bits at the threshold; digits
    // of up to 8 bits from the highest bit that varies (no range: 4 passes of 8).
    unsigned resolved_mask = 0u, resolved_bits = 0u, need = k;
    if (n > k) {
        resolved_mask = s_mask, resolved_bits = s_bits;
        const unsigned warp_items = __reduce_max_sync(0xFFFFFFFFu, keys.count);  // the warp runs converged
        int high = s_top;
#pragma unroll 1
        for (int pass = 0; high >= 0; ++pass) {
            int shift;
            const unsigned digit_mask = next_digit(high, 8, shift);
            unsigned* h = hist[pass];
            // Scores bunch into few bins (the top digit is sign and exponent): lanes with the same
            // bin add their count with one atomic instead of queueing on one address.
#pragma unroll
            for (int i = 0; i < kClusterItems; ++i) {
                if ((unsigned)i >= warp_items) break;
                const unsigned key = keys.key[i];
                const bool in = (unsigned)i < keys.count && (key & resolved_mask) == resolved_bits;
                const unsigned bin = in ? (key >> shift) & digit_mask : kRadixBins;
                const unsigned peers = __match_any_sync(0xFFFFFFFFu, bin);
                if (in && lane == (unsigned)__ffs(peers) - 1u) atomicAdd(&h[bin], (unsigned)__popc(peers));
            }
            cluster_sync();  // every block's histogram of this pass is complete
            if (warp == 0) {
                // lane l sums bins 255 - 8l down to 248 - 8l over the 8 blocks; a warp scan counts
                // the entries in larger bins
                const unsigned low = kRadixBins - 8u * (lane + 1u);
                unsigned c[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};  // c[j]: bin low + 7 - j
#pragma unroll
                for (int r = 0; r < kClusterBlocks; ++r) {
                    const unsigned at = cluster_address(h + low, (unsigned)r);
                    const uint4 lo = load_cluster_u4(at), hi = load_cluster_u4(at + 16u);
                    c[0] += hi.w, c[1] += hi.z, c[2] += hi.y, c[3] += hi.x;
                    c[4] += lo.w, c[5] += lo.z, c[6] += lo.y, c[7] += lo.x;
                }
                unsigned total = 0u;
#pragma unroll
                for (int j = 0; j < 8; ++j) total += c[j];
                unsigned above = total;
#pragma unroll
                for (int off = 1; off < 32; off <<= 1) {
                    const unsigned x = __shfl_up_sync(0xFFFFFFFFu, above, off);
                    if (lane >= (unsigned)off) above += x;
                }
                above -= total;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (above < need && need <= above + c[j])
                        s_digit = low + 7u - j, s_need = need - above, s_count = c[j];
                    above += c[j];
                }
            }
            __syncthreads();
            resolved_bits |= s_digit << shift;
            resolved_mask |= digit_mask << shift;
            const unsigned in_bin = s_count;
            need = s_need;
            if (in_bin == need) break;  // the threshold bin is taken whole: no tie left to resolve
        }
    }

    const unsigned long long mine = threshold_counts(keys, resolved_mask, resolved_bits);
    const unsigned long long inclusive = block_inclusive_scan(mine, scan64);
    if (tid == kThreads - 1) s_total = inclusive;
    cluster_sync();  // every block's (greater, equal) totals are complete; every block has read the range
    if (rank == 0 && tid == 0) empty_range(key_range, b);
    if (warp == 0) {  // the counts of the lower ranks, which hold the earlier indices
        unsigned long long x = lane < rank ? load_cluster_u64(cluster_address(&s_total, lane)) : 0ull;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, off);
        if (lane == 0) s_base = x;
    }
    __syncthreads();
    cluster_arrive();  // no more reads of the peers' shared memory

    write_selection(keys, resolved_mask, resolved_bits, need, s_base + inclusive - mine, n, k, rank * kThreads + tid,
                    kClusterThreads, indices + (size_t)b * k, values + (size_t)b * k);
    cluster_wait();  // the peers are done with this block's shared memory
}

extern "C" __global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kTopkThreads, 1)
    indexer_topk_cluster(const float* __restrict__ scores, const int* __restrict__ lengths, unsigned C, unsigned k,
                         int vec4, int* __restrict__ indices, float* __restrict__ values,
                         unsigned* __restrict__ status, unsigned* __restrict__ key_range) {
    pdl::wait_prior();
    topk_cluster_row<kTopkThreads>(scores, lengths, C, k, vec4, indices, values, status, key_range);
}

// The same select in blocks of kSmallTopkThreads (8 warps at each barrier and block scan instead of
// 32) for rows of up to kClusterItems * 8 * 256 = 32768 entries: the same selection bit for bit.
extern "C" __global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kSmallTopkThreads, 1)
    indexer_topk_cluster_small(const float* __restrict__ scores, const int* __restrict__ lengths, unsigned C,
                               unsigned k, int vec4, int* __restrict__ indices, float* __restrict__ values,
                               unsigned* __restrict__ status, unsigned* __restrict__ key_range) {
    pdl::wait_prior();
    topk_cluster_row<kSmallTopkThreads>(scores, lengths, C, k, vec4, indices, values, status, key_range);
}
