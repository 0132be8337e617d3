// DeepSeek-V4 sparse decode attention: MQA over one shared bf16 latent (K = V), one query token
// per sequence, one softmax over the valid sliding-window slots and the valid selected compressed
// entries plus a per-head attention sink that adds to the normaliser only. The specification is
// fp4kit/reference/attention.py; fp32 accumulation, bf16 tensor cores (mma.sync m16n8k16).
//
// Arguments (row-major, contiguous; bf16 arrays 16-byte aligned):
//   q         bf16  [B, Hq, D]   query heads, D a multiple of 16, 16 <= D <= 512
//   swa       bf16  [B, W, D]    ring buffer: token t at slot t % W
//   pos       int32 [B]          tokens written; valid slots are 0 .. min(max(pos, 0), W) - 1
//   comp      bf16  [B, C, D]    compressed cache, capacity C
//   comp_len  int32 [B]          live compressed length; entry i is valid iff 0 <= i < min(comp_len, C)
//   indices   int32 [B, N]       selected entries; -1 / out of range ignored, duplicates count twice;
//                                null: every entry, N = C (what an index list 0 .. C-1 would select)
//   sink      fp32  [Hq]         attention-sink logit per head (-inf: no sink)
//   out       bf16 or fp32 [B, Hq, D] (out_f32 selects)
//   part_o    fp32  [B, S, Hq, D]  unnormalised partial outputs of the S candidate splits (S > 1)
//   part_ml   fp32  [B, S, Hq, 2]  their running max (log2 domain) and probability sum
//   counters  uint32 [B * ceil(Hq / 16)] or null  S > 1: one arrival counter per (query row, head
//                                group), zero between launches; null: sparse_decode_combine merges
//   start     int32 [1] or null  prefill: the B query rows are tokens start .. start + B - 1 of ONE
//                                sequence; swa is then its K = V rows [kv_rows, D] and each query's window
//                                the rows of the W tokens ending at it; comp [C, D] is that sequence's
//                                compressed cache, comp_len and indices are per query (its visible entries)
//   spread    int                with counters: 1 = every split merges a share (the whole grid must be
//                                resident at once), 0 = the last split to arrive merges everything
//   q_pos     int32 [B] or null  given: q is a projection's raw output, and the kernel applies the
//                                RMSNorm (no weight, q_eps) and the RoPE of its last q_rope_dim
//                                channels at position q_pos[b] + q_pos_offset (frequencies q_inv_freq, float64
//                                [q_rope_dim / 2]) to each head as it loads it, with the bits of
//                                elementwise.cu's rmsnorm_rope_bf16 (one launch less); decode only
// Positions, lengths and indices are read on the device only; the grid is sized from shapes.
//
// Launch geometry of sparse_decode_attention: grid (S, ceil(Hq / 16), B), 256 threads (8 warps;
// heads past Hq in the last group are zero queries whose results are not written),
// attn_smem_bytes(D, chunk) bytes of dynamic shared memory (ops/attention.py mirrors the formula;
// a block given less writes NaN instead of running). Split s owns the candidates
// [s * chunk, min((s + 1) * chunk, W + N)) of the list "window slots 0..W-1, then indices[b]".
//   1. Compaction: the block tests its candidates 256 at a time and writes the valid ones, in
//      order, as row codes (slot >= 0, or ~entry for the compressed cache) to shared memory, so
//      invalid candidates cost no loads and no math.
//   2. Rows are streamed 32 per tile into a two-stage cp.async pipeline (16-byte loads, rows
//      padded by 16 bytes so ldmatrix is conflict-free; the rows past the end are zero-filled, so
//      a zero probability never meets stale data). Each row is read from memory once per block
//      and used from shared memory for all 16 heads, for the scores and for the values.
//   3. Scores: D is cut into 16-column chunks, chunk c to warp c % 8; each warp keeps its query
//      fragments in registers and computes partial scores [16 heads x 32 rows] over its columns;
//      the partials are summed in a fixed order through shared memory (deterministic).
//   4. Online softmax in the log2 domain (running max m, running sum l, accumulator rescaled by
//      exp2(m_old - m_new)); the probabilities are rounded to bf16 for the value MMA and l sums the
//      rounded values, so numerator and denominator weigh each row identically.
//   5. Values: each warp accumulates o[16 heads x its D columns] += P[16 x 32] V[32 x cols], V
//      fragments by ldmatrix.trans from the same tile.
//   S == 1: the block folds the sink in (M = max(m, sink), L = l e^(m-M) + e^(sink-M)) and writes
//   o e^(m-M) / L; no valid row gives 0. S > 1: it writes (o, m, l); with counters the S splits
//   of its (row, head group) and the sink are merged in split order (the same arithmetic as
//   sparse_decode_combine, so the same bits) inside this launch: spread, the S blocks wait for each
//   other at the counter and each merges 1/S of the 16 heads x D outputs (one block reading all S
//   partials, 32 KB each at D = 512, took ~40 % of the launch at batch 1); otherwise the last block
//   to arrive merges them all. Either way the counter is back at zero after the launch. Without
//   counters, sparse_decode_combine, grid (Hq, B), 128 threads, does that merge.
#include <cuda_bf16.h>

#include "common/gpu_sync.cuh"
#include "common/pdl.cuh"
#include "common/rope.cuh"
#include "common/status.cuh"

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kHeads = 16;           // query heads per block: the M of one m16n8k16 tile
constexpr int kTileRows = 32;        // candidate rows per pipeline stage
constexpr int kMaxChunksPerWarp = 4; // 16-column chunks of D per warp: D <= 8 * 4 * 16 = 512
constexpr int kMaxDim = kWarps * kMaxChunksPerWarp * 16;
constexpr int kScoreLd = kTileRows + 8;  // fp32 per head row of a warp's partial scores (no bank conflicts)
constexpr int kProbLd = kTileRows + 8;   // bf16 per head row of the probabilities (80-byte rows: conflict-free ldmatrix)
constexpr int kCombineThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
#define ATTN_NEG_INF __int_as_float(0xFF800000)  // NVRTC has no math.h INFINITY

// Dynamic shared memory of one block; the host computes the same number.
__host__ __device__ constexpr unsigned attn_smem_bytes(unsigned D, unsigned chunk) {
    return 2u * kTileRows * (D + 8u) * 2u       // two stages of rows (bf16, rows padded by 16 bytes)
           + kWarps * kHeads * kScoreLd * 4u    // partial scores
           + kHeads * kProbLd * 2u              // probabilities (bf16)
           + kHeads * 4u                        // per-head factor
           + kWarps * 4u                        // compaction counts
           + chunk * 4u;                        // compacted row codes
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, asynchronously; bytes = 0 zero-fills the destination without reading.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, unsigned bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}

// d += a (16x16 bf16, row) * b (16x8 bf16, col), fp32 accumulation.
__device__ __forceinline__ void mma_16816(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned load_pair(const __nv_bfloat16* p, bool valid) {
    return valid ? *reinterpret_cast<const unsigned*>(p) : 0u;
}

__device__ __forceinline__ void store_pair(void* out, size_t offset, float x, float y, int out_f32) {
    if (out_f32) {
        *reinterpret_cast<float2*>(static_cast<float*>(out) + offset) = make_float2(x, y);
    } else {
        *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(out) + offset) = __floats2bfloat162_rn(x, y);
    }
}

// acc += w * v, a column quad of a split's partial output weighted by its merge factor.
__device__ __forceinline__ void add_weighted(float4& acc, float w, const float4& v) {
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
}

// A merged column quad into `out` at element `offset` (two pairs).
__device__ __forceinline__ void store_quad(void* out, size_t offset, const float4& acc, int out_f32) {
    store_pair(out, offset, acc.x, acc.y, out_f32);
    store_pair(out, offset + 2, acc.z, acc.w, out_f32);
}

// The global row of a compacted code: a window slot (>= 0) or ~entry of the compressed cache.
__device__ __forceinline__ const __nv_bfloat16* row_of(int code, const __nv_bfloat16* swa_b,
                                                      const __nv_bfloat16* comp_b, int D) {
    return code >= 0 ? swa_b + (size_t)code * D : comp_b + (size_t)(~code) * D;
}

// Issue the cp.async loads of rows first .. first+31 of the compacted list (count rows in all;
// at least one exists, its address stands in for the zero-filled rows).
__device__ __forceinline__ void issue_tile(__nv_bfloat16* stage, const int* codes, int first, int count,
                                           const __nv_bfloat16* swa_b, const __nv_bfloat16* comp_b, int D) {
    const int pieces_per_row = D / 8;
    const __nv_bfloat16* fallback = row_of(codes[first], swa_b, comp_b, D);
    for (int p = threadIdx.x; p < kTileRows * pieces_per_row; p += kThreads) {
        const int r = p / pieces_per_row, c8 = p - r * pieces_per_row;
        const bool live = first + r < count;
        const __nv_bfloat16* src = (live ? row_of(codes[first + r], swa_b, comp_b, D) : fallback) + c8 * 8;
        cp_async16(stage + r * (D + 8) + c8 * 8, src, live ? 16u : 0u);
    }
}

// The merge of the S splits of one (row, head) and the sink, shared by the fused path and
// sparse_decode_combine so both give the same bits. `first` is the row of split 0 in [B, S, Hq, *],
// consecutive splits Hq rows apart. L2 loads (__ldcg): the fused path reads partials that other
// blocks of the same launch wrote.
struct SplitMerge {
    float M, inv;  // the overall max (log2 domain, sink included) and 1 / the normaliser
};

// The (m, l) pairs of kStatsBatch splits at a time are loaded before any is used: one L2 round trip
// per batch, not one per split (a rolled loop waited for each load before issuing the next).
constexpr int kStatsBatch = 16;

__device__ __forceinline__ void load_stats(const float* part_ml, size_t first, size_t stride, int s0, int splits,
                                           float2 ml[kStatsBatch]) {
#pragma unroll
    for (int j = 0; j < kStatsBatch; ++j)
        ml[j] = s0 + j < splits ? __ldcg(reinterpret_cast<const float2*>(part_ml + (first + (s0 + j) * stride) * 2))
                                : make_float2(ATTN_NEG_INF, 0.0f);
}

__device__ __forceinline__ SplitMerge merge_stats(const float* part_ml, size_t first, size_t stride, int splits,
                                                  float sink) {
    const float s2 = sink * kLog2e;
    float2 ml[kStatsBatch];
    float M = ATTN_NEG_INF;
    for (int s0 = 0; s0 < splits; s0 += kStatsBatch) {
        load_stats(part_ml, first, stride, s0, splits, ml);
#pragma unroll
        for (int j = 0; j < kStatsBatch; ++j)
            if (s0 + j < splits) M = fmaxf(M, ml[j].x);
    }
    M = s2 > M ? s2 : M;
    float inv = 0.0f;  // no valid row anywhere and no sink: the output is 0
    if (M != ATTN_NEG_INF) {
        float L = exp2f(s2 - M);
        for (int s0 = 0; s0 < splits; s0 += kStatsBatch) {
            if (splits > kStatsBatch) load_stats(part_ml, first, stride, s0, splits, ml);  // else still loaded
#pragma unroll
            for (int j = 0; j < kStatsBatch; ++j)
                if (s0 + j < splits) L += ml[j].y * exp2f(ml[j].x - M);
        }
        inv = 1.0f / L;
    }
    return {M, inv};
}

// Columns d0 + step * j .. + 3 (j < kQuads, below D) of the merged output of one (row, head),
// written to `out`: each split's weight exp2(m_s - M) / L times its partial, splits added in order.
// The loop runs over the splits with every column of the thread in flight at once (two splits per
// pass), so a split costs one L2 round trip per two rather than one per column step.
template <int kQuads>
__device__ __forceinline__ void merge_columns(const float* part_o, const float* part_ml, size_t first, size_t stride,
                                              int splits, int D, int d0, int step, SplitMerge st, void* out,
                                              size_t out_row, int out_f32) {
    float4 acc[kQuads];
#pragma unroll
    for (int j = 0; j < kQuads; ++j) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (st.M != ATTN_NEG_INF) {
#pragma unroll 2
        for (int s = 0; s < splits; ++s) {
            const size_t row = first + s * stride;
            const float w = exp2f(__ldcg(part_ml + row * 2) - st.M) * st.inv;
            float4 v[kQuads];
#pragma unroll
            for (int j = 0; j < kQuads; ++j) {
                const int d = d0 + step * j;
                v[j] = d < D ? __ldcg(reinterpret_cast<const float4*>(part_o + row * D + d)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int j = 0; j < kQuads; ++j) add_weighted(acc[j], w, v[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < kQuads; ++j) {
        const int d = d0 + step * j;
        if (d < D) store_quad(out, out_row * D + d, acc[j], out_f32);
    }
}

// Columns d .. d + 3 of the merged output of one (row, head): merge_columns for one column
// quad, with kQuadBatch splits' loads issued before any is used (one L2 round trip per batch).
constexpr int kQuadBatch = 8;

__device__ __forceinline__ void merge_quad(const float* part_o, const float* part_ml, size_t first, size_t stride,
                                           int splits, int D, int d, SplitMerge st, void* out, size_t out_row,
                                           int out_f32) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s0 = 0; s0 < splits; s0 += kQuadBatch) {
        float m[kQuadBatch];
        float4 v[kQuadBatch];
#pragma unroll
        for (int j = 0; j < kQuadBatch; ++j) {
            const size_t row = first + (s0 + j) * stride;
            m[j] = s0 + j < splits ? __ldcg(part_ml + row * 2) : 0.0f;
            v[j] = s0 + j < splits ? __ldcg(reinterpret_cast<const float4*>(part_o + row * D + d))
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        if (st.M == ATTN_NEG_INF) continue;
#pragma unroll
        for (int j = 0; j < kQuadBatch; ++j) {
            if (s0 + j >= splits) break;
            add_weighted(acc, exp2f(m[j] - st.M) * st.inv, v[j]);
        }
    }
    store_quad(out, out_row * D + d, acc, out_f32);
}

// merge_stats and merge_quad in one L2 round trip for up to kItemBatch splits: every split's
// (m, l) and column quad loaded before any is used (the two apart took three dependent round
// trips). The same arithmetic in the same order, so the same bits.
constexpr int kItemBatch = 16;

__device__ __forceinline__ void merge_item(const float* part_o, const float* part_ml, size_t first, size_t stride,
                                           int splits, int D, int d, float sink, void* out, size_t out_row,
                                           int out_f32) {
    if (splits > kItemBatch) {
        const SplitMerge st = merge_stats(part_ml, first, stride, splits, sink);
        merge_quad(part_o, part_ml, first, stride, splits, D, d, st, out, out_row, out_f32);
        return;
    }
    float2 ml[kItemBatch];
    float4 v[kItemBatch];
    // volatile loads, the quads first: left to itself the compiler issued the quads only after the
    // (m, l) maxima, a second round trip
#pragma unroll
    for (int j = 0; j < kItemBatch; ++j) {
        v[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (j < splits)
            asm volatile("ld.volatile.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                         : "=f"(v[j].x), "=f"(v[j].y), "=f"(v[j].z), "=f"(v[j].w)
                         : "l"(part_o + (first + j * stride) * D + d));
    }
#pragma unroll
    for (int j = 0; j < kItemBatch; ++j) {
        ml[j] = make_float2(ATTN_NEG_INF, 0.0f);
        if (j < splits)
            asm volatile("ld.volatile.global.v2.f32 {%0, %1}, [%2];"
                         : "=f"(ml[j].x), "=f"(ml[j].y)
                         : "l"(part_ml + (first + j * stride) * 2));
    }
    const float s2 = sink * kLog2e;
    float M = ATTN_NEG_INF;
#pragma unroll
    for (int j = 0; j < kItemBatch; ++j)
        if (j < splits) M = fmaxf(M, ml[j].x);
    M = s2 > M ? s2 : M;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (M != ATTN_NEG_INF) {
        float L = exp2f(s2 - M);
#pragma unroll
        for (int j = 0; j < kItemBatch; ++j)
            if (j < splits) L += ml[j].y * exp2f(ml[j].x - M);
        const float inv = 1.0f / L;
#pragma unroll
        for (int j = 0; j < kItemBatch; ++j) {
            if (j >= splits) break;
            add_weighted(acc, exp2f(ml[j].x - M) * inv, v[j]);
        }
    }
    store_quad(out, out_row * D + d, acc, out_f32);
}

// ---- the query's RMSNorm + RoPE, applied to the fragments as they are loaded (q_pos given)
constexpr int kQueryPairs = kThreads;  // channel pairs of a head the reduction covers: D / 2 <= 256
static_assert(kHeads * (kQueryPairs + 1) <= kWarps * kHeads * kScoreLd, "the query's squares fit the score partials");
static_assert(kQueryPairs * 2 >= kWarps * kMaxChunksPerWarp * 16, "every pair of D <= 512 has a thread");

// x^2 + y^2 of the bf16 pair (x, y) in the low and high half of u, as the row kernel sums a pair
__device__ __forceinline__ float pair_square(unsigned u) {
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
    return __fadd_rn(__fmul_rn(v.x, v.x), __fmul_rn(v.y, v.y));
}

// The pair (x, y) of u times inv, rotated by (c, s) where rot, rounded back to a bf16 pair.
__device__ __forceinline__ unsigned norm_rope_pair(unsigned u, float inv, bool rot, float c, float s) {
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
    float a = __fmul_rn(v.x, inv), b = __fmul_rn(v.y, inv);
    if (rot) rope_apply(a, b, c, s);
    const __nv_bfloat162 r = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&r);
}

// The block's 16 heads of query row b (this warp's fragments qa, all 8 warps together) through the
// RMSNorm without weight and the RoPE of the last rope_dim channels at position p, with the bits
// elementwise.cu's rmsnorm_rope_bf16 gives a [B, Hq, D] query (one head a block, 256 threads): the
// sum of squares in that kernel's order (pair j's square is thread j's partial, then the xor tree
// over each 32 pairs, then those sums in order), the same products, rotation and rounding.
// scratch: kHeads * (kQueryPairs + 1) floats of shared memory free until the tile loop.
__device__ __forceinline__ void norm_rope_query(unsigned (&qa)[kMaxChunksPerWarp][4], int D, float eps, int rope_dim,
                                                int p, const double* inv_freq, float* scratch) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int dchunks = D / 16, pairs = D / 2;
    float* sq = scratch;                        // [kHeads][kQueryPairs]: each head's pair squares
    float* inv = scratch + kHeads * kQueryPairs;  // [kHeads]
    // fragment i of chunk c holds columns c * 16 + 2t (+ 8): pairs c * 8 + t (+ 4) of heads g, g + 8
#pragma unroll
    for (int i = 0; i < kMaxChunksPerWarp; ++i) {
        const int c = warp + kWarps * i;
        if (c >= dchunks) break;
        const int j = c * 8 + t;
        sq[g * kQueryPairs + j] = pair_square(qa[i][0]);
        sq[(g + 8) * kQueryPairs + j] = pair_square(qa[i][1]);
        sq[g * kQueryPairs + j + 4] = pair_square(qa[i][2]);
        sq[(g + 8) * kQueryPairs + j + 4] = pair_square(qa[i][3]);
    }
    __syncthreads();
    // warp w: heads 2w and 2w + 1, the eight 32-pair sums of each in flight together
    constexpr int kGroups = kQueryPairs / 32;
#pragma unroll
    for (int k = 0; k < kHeads / kWarps; ++k) {
        const int h = (kHeads / kWarps) * warp + k;
        float v[kGroups];
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) {
            const int j = grp * 32 + lane;
            v[grp] = j < pairs ? sq[h * kQueryPairs + j] : 0.0f;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int grp = 0; grp < kGroups; ++grp) v[grp] += __shfl_xor_sync(0xffffffffu, v[grp], o);
        float total = 0.0f;
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) total += v[grp];
        if (lane == 0) inv[h] = __frsqrt_rn(__fadd_rn(__fdiv_rn(total, (float)D), eps));
    }
    __syncthreads();
    const float inv_lo = inv[g], inv_hi = inv[g + 8];
    const int first_rope_pair = (D - rope_dim) / 2;
#pragma unroll
    for (int i = 0; i < kMaxChunksPerWarp; ++i) {
        const int c = warp + kWarps * i;
        if (c >= dchunks) break;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int j = c * 8 + 4 * half + t;
            const bool rot = j >= first_rope_pair;
            float cs = 1.0f, sn = 0.0f;
            if (rot) rope_cos_sin(p, (unsigned)(j - first_rope_pair), inv_freq, cs, sn);
            qa[i][2 * half] = norm_rope_pair(qa[i][2 * half], inv_lo, rot, cs, sn);
            qa[i][2 * half + 1] = norm_rope_pair(qa[i][2 * half + 1], inv_hi, rot, cs, sn);
        }
    }
}

extern "C" __global__ void __launch_bounds__(kThreads, 2)
sparse_decode_attention(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ swa,
                        const int* __restrict__ pos, const __nv_bfloat16* __restrict__ comp,
                        const int* __restrict__ comp_len, const int* __restrict__ indices,
                        const float* __restrict__ sink, void* __restrict__ out, float* __restrict__ part_o,
                        float* __restrict__ part_ml, int Hq, int D, int W, int C, int N, int chunk,
                        float scale_log2, int out_f32, unsigned* __restrict__ status,
                        const int* __restrict__ start, int kv_rows, unsigned* __restrict__ counters,
                        int spread, const int* __restrict__ q_pos, int q_pos_offset,
                        const double* __restrict__ q_inv_freq, int q_rope_dim, float q_eps) {
    pdl::wait_prior();
    extern __shared__ __align__(16) unsigned char smem[];
    const int ld = D + 8;
    __nv_bfloat16* stages = reinterpret_cast<__nv_bfloat16*>(smem);
    float* spart = reinterpret_cast<float*>(smem + 2u * kTileRows * ld * 2u);
    __nv_bfloat16* prob = reinterpret_cast<__nv_bfloat16*>(spart + kWarps * kHeads * kScoreLd);
    float* factor = reinterpret_cast<float*>(prob + kHeads * kProbLd);
    int* warp_counts = reinterpret_cast<int*>(factor + kHeads);
    int* codes = warp_counts + kWarps;

    const int split = blockIdx.x, splits = gridDim.x, h0 = blockIdx.y * kHeads, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int dchunks = D / 16;

    unsigned dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    // a host/device disagreement on the layout must not write out of bounds: the block writes NaN
    const bool bad = dyn_smem < attn_smem_bytes((unsigned)D, (unsigned)chunk);

    // ---- 1. compaction of this split's valid candidates
    const int total = W + N;
    const int begin = min(split * chunk, total), end = bad ? begin : min(begin + chunk, total);
    // prefill (start given): query b is token start + b of one sequence, whose K = V rows are swa
    // [kv_rows, D]; it has written start + b + 1 tokens, and its window is the rows of the last W
    // of them (contiguous rows, not a ring)
    const int pos_in = start ? start[0] + b + 1 : pos[b];
    const int pos_b = start ? min(pos_in, kv_rows) : pos_in;
    const int window_live = min(max(pos_b, 0), W);
    const int comp_live = min(max(comp_len[b], 0), C);
    // positions and lengths outside their range are clamped (above) and reported once per query row
    if (split == 0 && blockIdx.y == 0 && tid == 0 &&
        (pos_in < 0 || pos_in != pos_b || comp_len[b] < 0 || comp_len[b] > C))
        atomicOr(status, FP4_STATUS_KV_INPUT);
    int count = 0;
    for (int base = begin; base < end; base += kThreads) {
        const int c = base + tid;
        bool valid = false;
        int code = 0;
        if (c < end) {
            if (c < W) {
                valid = c < window_live;
                code = c;
            } else {
                const int entry = indices ? indices[(size_t)b * N + (c - W)] : c - W;
                valid = entry >= 0 && entry < comp_live;
                code = ~entry;
            }
        }
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, valid);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, pass = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const int n = warp_counts[w];
            before += w < warp ? n : 0;
            pass += n;
        }
        if (valid) codes[count + before + __popc(ballot & ((1u << lane) - 1u))] = code;
        count += pass;
        __syncthreads();  // warp_counts is rewritten by the next pass; codes are read below
    }

    const __nv_bfloat16* swa_b = start ? swa + (size_t)(pos_b - window_live) * D : swa + (size_t)b * W * D;
    const __nv_bfloat16* comp_b = start ? comp : comp + (size_t)b * C * D;  // prefill: one sequence's entries
    const int ntiles = (count + kTileRows - 1) / kTileRows;
    if (ntiles > 0) issue_tile(stages, codes, 0, count, swa_b, comp_b, D);
    cp_async_commit();

    // ---- query fragments of this warp's D chunks (A operand, rows = heads g and g + 8)
    const __nv_bfloat16* qb = q + (size_t)b * Hq * D;
    const bool head_lo = h0 + g < Hq, head_hi = h0 + g + 8 < Hq;
    unsigned qa[kMaxChunksPerWarp][4];
#pragma unroll
    for (int i = 0; i < kMaxChunksPerWarp; ++i) {
        const int c = warp + kWarps * i;
        const bool active = c < dchunks;
        const __nv_bfloat16* lo = qb + (size_t)(h0 + g) * D + c * 16 + 2 * t;
        const __nv_bfloat16* hi = lo + 8 * (size_t)D;
        qa[i][0] = load_pair(lo, active && head_lo);
        qa[i][1] = load_pair(hi, active && head_hi);
        qa[i][2] = load_pair(lo + 8, active && head_lo);
        qa[i][3] = load_pair(hi + 8, active && head_hi);
    }
    // q_pos given: q is the raw projection, normed and rotated here (spart is free until the tiles)
    if (q_pos != nullptr && !bad) norm_rope_query(qa, D, q_eps, q_rope_dim, q_pos[b] + q_pos_offset, q_inv_freq, spart);

    float oacc[kMaxChunksPerWarp][2][4];
#pragma unroll
    for (int i = 0; i < kMaxChunksPerWarp; ++i)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) oacc[i][n][e] = 0.0f;

    // softmax state of head (tid >> 4), rows 2 * (tid & 15) and +1 of each tile; the 16 threads of a
    // head hold identical copies (xor-butterfly reductions give every lane the same bits)
    const int sh = tid >> 4, sr = 2 * (tid & 15);
    float m_run = ATTN_NEG_INF, l_run = 0.0f;

    for (int tile = 0; tile < ntiles; ++tile) {
        const __nv_bfloat16* stage = stages + (tile & 1) * kTileRows * ld;
        if (tile + 1 < ntiles)
            issue_tile(stages + ((tile + 1) & 1) * kTileRows * ld, codes, (tile + 1) * kTileRows, count, swa_b, comp_b, D);
        cp_async_commit();
        cp_async_wait_one();
        __syncthreads();

        // ---- 3. partial scores over this warp's columns: 4 n-tiles of 8 rows
        float sacc[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) sacc[n][e] = 0.0f;
#pragma unroll
        for (int i = 0; i < kMaxChunksPerWarp; ++i) {
            const int c = warp + kWarps * i;
            if (c < dchunks) {
#pragma unroll
                for (int np = 0; np < 2; ++np) {
                    unsigned kb[4];  // b0, b1 of rows np*16 + 0..7, then of rows np*16 + 8..15
                    ldmatrix_x4(kb, stage + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * ld + c * 16 + (((lane >> 3) & 1) << 3));
                    mma_16816(sacc[2 * np], qa[i], kb[0], kb[1]);
                    mma_16816(sacc[2 * np + 1], qa[i], kb[2], kb[3]);
                }
            }
        }
        float* mine = spart + warp * kHeads * kScoreLd;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            *reinterpret_cast<float2*>(mine + g * kScoreLd + n * 8 + 2 * t) = make_float2(sacc[n][0], sacc[n][1]);
            *reinterpret_cast<float2*>(mine + (g + 8) * kScoreLd + n * 8 + 2 * t) = make_float2(sacc[n][2], sacc[n][3]);
        }
        __syncthreads();

        // ---- 4. online softmax
        {
            float2 s = make_float2(0.0f, 0.0f);
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                const float2 v = *reinterpret_cast<const float2*>(spart + (w * kHeads + sh) * kScoreLd + sr);
                s.x += v.x;
                s.y += v.y;
            }
            const int rows_here = count - tile * kTileRows;
            const float x0 = sr < rows_here ? s.x * scale_log2 : ATTN_NEG_INF;
            const float x1 = sr + 1 < rows_here ? s.y * scale_log2 : ATTN_NEG_INF;
            float tile_max = fmaxf(x0, x1);
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, off));
            const float m_new = fmaxf(m_run, tile_max);
            const float m_use = m_new == ATTN_NEG_INF ? 0.0f : m_new;  // all -inf so far: avoid (-inf) - (-inf)
            const float alpha = exp2f(m_run - m_use);
            const __nv_bfloat162 p = __floats2bfloat162_rn(exp2f(x0 - m_use), exp2f(x1 - m_use));
            const float2 pf = __bfloat1622float2(p);
            float tile_sum = pf.x + pf.y;
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) tile_sum += __shfl_xor_sync(0xFFFFFFFFu, tile_sum, off);
            l_run = l_run * alpha + tile_sum;
            m_run = m_new;
            *reinterpret_cast<__nv_bfloat162*>(prob + sh * kProbLd + sr) = p;
            if ((tid & 15) == 0) factor[sh] = alpha;
        }
        __syncthreads();

        // ---- 5. o = o * alpha + P V over this warp's columns
        {
            const float a_lo = factor[g], a_hi = factor[g + 8];
#pragma unroll
            for (int i = 0; i < kMaxChunksPerWarp; ++i)
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    oacc[i][n][0] *= a_lo;
                    oacc[i][n][1] *= a_lo;
                    oacc[i][n][2] *= a_hi;
                    oacc[i][n][3] *= a_hi;
                }
#pragma unroll
            for (int ks = 0; ks < kTileRows / 16; ++ks) {
                unsigned pa[4];  // P rows 0-7 / 8-15 at columns ks*16 + 0..7, then + 8..15
                ldmatrix_x4(pa, prob + ((lane & 7) + (((lane >> 3) & 1) << 3)) * kProbLd + ks * 16 + ((lane >> 4) << 3));
#pragma unroll
                for (int i = 0; i < kMaxChunksPerWarp; ++i) {
                    const int c = warp + kWarps * i;
                    if (c < dchunks) {
                        unsigned vb[4];  // b0, b1 of columns c*16 + 0..7, then of c*16 + 8..15
                        ldmatrix_x4_trans(vb, stage + (ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * ld + c * 16 + ((lane >> 4) << 3));
                        mma_16816(oacc[i][0], pa, vb[0], vb[1]);
                        mma_16816(oacc[i][1], pa, vb[2], vb[3]);
                    }
                }
            }
        }
        __syncthreads();  // the stage, the scores, P and the factors are rewritten next tile
    }

    // ---- epilogue: per-head factor (S == 1) or the split's (m, l)
    const float poison = bad ? __int_as_float(0x7FC00000) : 1.0f;
    if ((tid & 15) == 0) {
        const int head = h0 + sh;
        if (splits == 1) {
            float f = 0.0f;
            const float s2 = head < Hq ? sink[head] * kLog2e : ATTN_NEG_INF;
            const float M = s2 > m_run ? s2 : m_run;  // a NaN sink is kept out of M and poisons L
            if (M != ATTN_NEG_INF) {
                const float w = exp2f(m_run - M);
                const float L = l_run * w + exp2f(s2 - M);
                f = w / L;
            }
            factor[sh] = f * poison;
        } else if (head < Hq) {
            float* ml = part_ml + (((size_t)b * splits + split) * Hq + head) * 2;
            ml[0] = m_run * poison;
            ml[1] = l_run * poison;
        }
    }
    __syncthreads();
    const int head_g = h0 + g;
    const float f_lo = splits == 1 ? factor[g] : poison, f_hi = splits == 1 ? factor[g + 8] : poison;
#pragma unroll
    for (int i = 0; i < kMaxChunksPerWarp; ++i) {
        const int c = warp + kWarps * i;
        if (c >= dchunks) continue;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            const int d = c * 16 + n * 8 + 2 * t;
            if (splits == 1) {
                const size_t row = (size_t)b * Hq + head_g;
                if (head_lo) store_pair(out, row * D + d, oacc[i][n][0] * f_lo, oacc[i][n][1] * f_lo, out_f32);
                if (head_hi) store_pair(out, (row + 8) * D + d, oacc[i][n][2] * f_hi, oacc[i][n][3] * f_hi, out_f32);
            } else {
                const size_t row = ((size_t)b * splits + split) * Hq + head_g;
                if (head_lo) store_pair(part_o, row * D + d, oacc[i][n][0] * f_lo, oacc[i][n][1] * f_lo, 1);
                if (head_hi) store_pair(part_o, (row + 8) * D + d, oacc[i][n][2] * f_hi, oacc[i][n][3] * f_hi, 1);
            }
        }
    }
    if (splits == 1 || !counters) return;

    // ---- fused combine
    // Thread 0 counts the block's arrival behind a release; the block barrier before it orders the
    // other threads' partial stores ahead of it (common/gpu_sync.cuh).
    unsigned* counter = counters + (size_t)b * gridDim.y + blockIdx.y;
    __syncthreads();
    if (spread) {
        // every split of this (row, head group) waits for all of them, then merges its 1/S share of
        // the (head, column quad) outputs; the host asks for this only when the whole grid is
        // resident at once (ops/attention.py SPREAD_MERGE). The counter counts arrivals, then
        // departures: the block taking it to 2S puts it back to zero for the next launch.
        if (tid == 0) {
            gpu_sync::fence_acq_rel();
            atomicAdd(counter, 1u);
            while (gpu_sync::ld_acquire(counter) < (unsigned)splits) {  // acquires the other splits' partials
            }
        }
        __syncthreads();
        const int quads = D / 4, items = kHeads * quads, share = (items + splits - 1) / splits;
        const int i_end = min(items, (split + 1) * share);
        for (int i = split * share + tid; i < i_end; i += kThreads) {
            const int head = h0 + i / quads;
            if (head >= Hq) break;  // the group's heads past Hq come last
            merge_item(part_o, part_ml, (size_t)b * splits * Hq + head, (size_t)Hq, splits, D, (i % quads) * 4,
                       sink[head], out, (size_t)b * Hq + head, out_f32);
        }
        if (tid == 0 && atomicAdd(counter, 1u) == 2u * (unsigned)splits - 1u) *counter = 0u;
        return;
    }
    // the last split of this (row, head group) to arrive merges all of them
    __shared__ unsigned last_block;
    if (tid == 0) {
        // the last arrival acquires the other splits' partials
        last_block = gpu_sync::arrive_acq_rel(counter) == (unsigned)splits - 1;
    }
    __syncthreads();
    if (!last_block) return;
    // 16 threads per head, each 8 float4 columns 64 apart, as many heads as the group holds
    const int head = h0 + sh;
    if (head < Hq) {
        const size_t first = (size_t)b * splits * Hq + head;
        const SplitMerge st = merge_stats(part_ml, first, (size_t)Hq, splits, sink[head]);
        merge_columns<kMaxDim / 64>(part_o, part_ml, first, (size_t)Hq, splits, D, (tid & 15) * 4, 64, st, out,
                                    (size_t)b * Hq + head, out_f32);
    }
    if (tid == 0) *counter = 0u;  // every split has arrived: zero for the next launch (a graph replay)
}

// Merge the S splits of one (sequence, head) and fold in the sink: grid (Hq, B), 128 threads, each
// thread 4 columns per step. Splits are summed in order (deterministic).
extern "C" __global__ void __launch_bounds__(kCombineThreads)
sparse_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                      const float* __restrict__ sink, void* __restrict__ out, int Hq, int D, int splits, int out_f32) {
    pdl::wait_prior();
    const int h = blockIdx.x, b = blockIdx.y;
    const size_t first = (size_t)b * splits * Hq + h;
    const SplitMerge st = merge_stats(part_ml, first, (size_t)Hq, splits, sink[h]);
    merge_columns<kMaxDim / (kCombineThreads * 4)>(part_o, part_ml, first, (size_t)Hq, splits, D, threadIdx.x * 4,
                                                   kCombineThreads * 4, st, out, (size_t)b * Hq + h, out_f32);
}
