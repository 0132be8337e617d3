// Mixture-of-Experts kernels: DeepSeek routing, dispatch without the host, grouped NVFP4 expert
// GEMMs, and the weighted combine. fp4kit/reference/moe.py is the specification.
//
//   moe_router_logits_*  grid (ceil(E / 8), T), 256 threads: logits [T, E] fp32 = x [T, H] (bf16 or
//                  fp32) . gate weight [E, H] (bf16 or fp32), one warp per (token, expert).
//   moe_router     grid T (one block per token), 256 threads: from the logits, bias [E] (selection
//                  only, optional), hash routing
//                  (tid2eid [V, top_k], token_ids [T]) optional: an id outside [0, V) reads row 0
//                  and or-s FP4_STATUS_TOKEN_RANGE into status [1]. Writes ids [T, top_k] (int32),
//                  weights [T, top_k] (fp32), and for each (token, slot) a ticket: its position
//                  among the pairs routed to the same expert, from an atomic increment of
//                  counts [E] (zero on entry).
//   moe_dispatch   one block of 1024 threads. Exclusive scan of counts into offsets [E + 1],
//                  the active experts in id order (active [E], num_active [1]), each pair's row in
//                  expert-sorted order (slot_row [T * top_k]), the token and weight of every sorted
//                  row (row_token, row_weight); then zeroes counts for the next call.
//   moe_gemm_*_<T> grid (ceil(N / 128), min(E, T * top_k)), 256 threads, the GEMM engine's shared
//                  memory: block (i, s) computes weight rows 128i .. 128i+127 of active expert
//                  active[s] for all its rows, 8T at a time; blocks with s >= num_active exit at once.
//                  The weights are stacked tiled experts (fp4kit/formats.py to_tiled, one after
//                  another) with a decode factor per expert [E] (or per row [E, N]); the activation
//                  rows are gathered through row_token (from the token order) or taken in sorted
//                  order; the output is written in sorted order.
//   moe_combine    grid T, 256 threads: out[t] = sum over slots of y[slot_row] (times the routing
//                  weight unless it was applied before the down projection) + shared[t], in slot order.
//
// Every grid is sized for the worst case and exits early, so nothing depends on a count read back.
#include "common/block_scan.cuh"
#include "common/gemm_engine.cuh"

constexpr int kRouterThreads = 256;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 16;
#define FP4_INF __int_as_float(0x7F800000)
#include "common/status.cuh"

enum ScoreFunc { kSqrtSoftplus = 0, kSigmoid = 1, kSoftmax = 2 };

__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// Larger value first; equal values: lower index first.
__device__ __forceinline__ bool better(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float w = __shfl_xor_sync(0xFFFFFFFFu, v, off);
        const int j = __shfl_xor_sync(0xFFFFFFFFu, i, off);
        if (better(w, j, v, i)) v = w, i = j;
    }
}

// Block-wide argmax of vals[0, n); all threads get (value, index).
__device__ void block_argmax(const float* vals, int n, float& best_v, int& best_i) {
    __shared__ float wv[kRouterThreads / 32];
    __shared__ int wi[kRouterThreads / 32];
    float v = -FP4_INF;
    int i = 0x7FFFFFFF;
    for (int e = threadIdx.x; e < n; e += blockDim.x)
        if (better(vals[e], e, v, i)) v = vals[e], i = e;
    warp_argmax(v, i);
    if ((threadIdx.x & 31) == 0) wv[threadIdx.x >> 5] = v, wi[threadIdx.x >> 5] = i;
    __syncthreads();
    v = -FP4_INF, i = 0x7FFFFFFF;
    for (int w = 0; w < kRouterThreads / 32; ++w)
        if (better(wv[w], wi[w], v, i)) v = wv[w], i = wi[w];
    __syncthreads();
    best_v = v, best_i = i;
}

__device__ float block_sum(float v) {
    __shared__ float ws[kRouterThreads / 32];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    if ((threadIdx.x & 31) == 0) ws[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < kRouterThreads / 32; ++w) s += ws[w];
    __syncthreads();
    return s;
}

// logits[t, e] = x[t] . gate_w[e] in fp32: grid (ceil(E / 8), T), one warp per expert, lanes
// stride over H, a fixed-order warp reduction. Spread over many blocks so that even one token
// reads the gate weight at full bandwidth.
template <typename XT, typename WT>
__device__ void router_logits(const XT* x, const WT* gate_w, unsigned E, unsigned H, float* logits) {
    const unsigned t = blockIdx.y, lane = threadIdx.x & 31;
    const unsigned e = blockIdx.x * (kRouterThreads / 32) + (threadIdx.x >> 5);
    if (e >= E) return;
    const XT* xt = x + (size_t)t * H;
    const WT* we = gate_w + (size_t)e * H;
    float acc = 0.0f;
    for (unsigned k = lane; k < H; k += 32) acc = fmaf(load_f32(xt + k), load_f32(we + k), acc);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, off);
    if (lane == 0) logits[(size_t)t * E + e] = acc;
}

__device__ void router(const float* logits, const float* bias, const int* token_ids, const int* tid2eid,
                       unsigned vocab, unsigned* status, unsigned E, unsigned top_k, int score_func, unsigned n_group, unsigned topk_group,
                       int renormalize, float routed_scale, int* ids, float* weights, unsigned* counts,
                       unsigned* tickets) {
    __shared__ float score[kMaxExperts];
    __shared__ float select[kMaxExperts];
    __shared__ int chosen[kMaxTopK];
    const unsigned t = blockIdx.x;
    for (unsigned e = threadIdx.x; e < E; e += blockDim.x) score[e] = logits[(size_t)t * E + e];
    __syncthreads();
    float mx = 0.0f, denom = 1.0f;
    if (score_func == kSoftmax) {
        float best;
        int at;
        block_argmax(score, E, best, at);
        mx = best;
        float part = 0.0f;
        for (unsigned e = threadIdx.x; e < E; e += blockDim.x) part += expf(score[e] - mx);
        denom = block_sum(part);
    }
    for (unsigned e = threadIdx.x; e < E; e += blockDim.x) {
        const float l = score[e];
        if (!(fabsf(l) <= 3.402823466e38f)) atomicOr(status, FP4_STATUS_NONFINITE_INPUT);  // NaN/Inf input
        float s;
        if (score_func == kSqrtSoftplus) s = sqrtf(l > 20.0f ? l : log1pf(expf(l)));
        else if (score_func == kSigmoid) s = 1.0f / (1.0f + expf(-l));
        else s = expf(l - mx) / denom;
        score[e] = s;
        // a NaN never wins a comparison, so block_argmax would return no index: rank it last
        const float sel = s + (bias ? bias[e] : 0.0f);
        select[e] = isnan(sel) ? -FP4_INF : sel;
    }
    __syncthreads();
    if (tid2eid) {
        // An id outside [0, vocab) reads row 0 (as the embedding gather does) and is recorded.
        const int tok = token_ids[t];
        const bool in_range = tok >= 0 && (unsigned)tok < vocab;
        if (threadIdx.x == 0 && !in_range) atomicOr(status, FP4_STATUS_TOKEN_RANGE);
        if (threadIdx.x < top_k) chosen[threadIdx.x] = tid2eid[(size_t)(in_range ? tok : 0) * top_k + threadIdx.x];
    } else {
        if (n_group > 1) {  // V3: keep the topk_group groups with the best top-2 sums
            __shared__ float group_score[32];
            const unsigned per = E / n_group;
            if (threadIdx.x < n_group) {
                float a = -FP4_INF, b = -FP4_INF;
                for (unsigned j = 0; j < per; ++j) {
                    const float v = select[threadIdx.x * per + j];
                    if (v > a) b = a, a = v;
                    else if (v > b) b = v;
                }
                group_score[threadIdx.x] = a + b;
            }
            __syncthreads();
            __shared__ int keep[32];
            if (threadIdx.x == 0) {
                for (unsigned g = 0; g < n_group; ++g) keep[g] = 0;
                for (unsigned r = 0; r < topk_group; ++r) {
                    int bi = -1;
                    for (unsigned g = 0; g < n_group; ++g)
                        if (!keep[g] && (bi < 0 || group_score[g] > group_score[bi])) bi = g;
                    keep[bi] = 1;
                }
            }
            __syncthreads();
            for (unsigned e = threadIdx.x; e < E; e += blockDim.x)
                if (!keep[e / per]) select[e] = -FP4_INF;
            __syncthreads();
        }
        for (unsigned j = 0; j < top_k; ++j) {
            float v;
            int at;
            block_argmax(select, E, v, at);
            if (threadIdx.x == 0) chosen[j] = at, select[at] = -FP4_INF;
            __syncthreads();
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (unsigned j = 0; j < top_k; ++j) sum += score[chosen[j]];
        for (unsigned j = 0; j < top_k; ++j) {
            const int e = chosen[j];
            const float w = renormalize ? score[e] / sum : score[e];
            ids[(size_t)t * top_k + j] = e;
            weights[(size_t)t * top_k + j] = w * routed_scale;
        }
    }
    if (threadIdx.x < top_k) tickets[(size_t)t * top_k + threadIdx.x] = atomicAdd(counts + chosen[threadIdx.x], 1u);
}

#define FP4_DEFINE_ROUTER_LOGITS(SUFFIX, XT, WT)                                                          \
    extern "C" __global__ void __launch_bounds__(kRouterThreads)                                          \
        moe_router_logits_##SUFFIX(const XT* x, const WT* gate_w, unsigned E, unsigned H, float* logits) { \
        router_logits<XT, WT>(x, gate_w, E, H, logits);                                                   \
    }

FP4_DEFINE_ROUTER_LOGITS(bf16_bf16, __nv_bfloat16, __nv_bfloat16)
FP4_DEFINE_ROUTER_LOGITS(bf16_f32, __nv_bfloat16, float)
FP4_DEFINE_ROUTER_LOGITS(f32_f32, float, float)
FP4_DEFINE_ROUTER_LOGITS(f32_bf16, float, __nv_bfloat16)

extern "C" __global__ void __launch_bounds__(kRouterThreads) moe_router(
    const float* logits, const float* bias, const int* token_ids, const int* tid2eid, unsigned vocab, unsigned* status,
    unsigned E, unsigned top_k, int score_func, unsigned n_group, unsigned topk_group, int renormalize, float routed_scale, int* ids,
    float* weights, unsigned* counts, unsigned* tickets) {
    router(logits, bias, token_ids, tid2eid, vocab, status, E, top_k, score_func, n_group, topk_group, renormalize, routed_scale,
           ids, weights, counts, tickets);
}

extern "C" __global__ void __launch_bounds__(1024) moe_dispatch(unsigned* counts, const unsigned* tickets, const int* ids,
                                                               const float* weights, unsigned E, unsigned pairs,
                                                               unsigned top_k, unsigned* offsets, unsigned* active,
                                                               unsigned* num_active, unsigned* slot_row,
                                                               unsigned* row_token, float* row_weight) {
    const unsigned e = threadIdx.x;
    const unsigned c = e < E ? counts[e] : 0u;
    unsigned total, n_active;
    const unsigned start = block_exclusive_scan(c, total);
    const unsigned rank = block_exclusive_scan(c > 0 ? 1u : 0u, n_active);
    if (e < E) {
        offsets[e] = start;
        if (c > 0) active[rank] = e;
        counts[e] = 0;  // ready for the next call (every reader of counts ran before this kernel)
    }
    if (e == 0) offsets[E] = total, *num_active = n_active;
    __syncthreads();
    __shared__ unsigned sh_offsets[kMaxExperts];
    if (e < E) sh_offsets[e] = start;
    __syncthreads();
    for (unsigned p = threadIdx.x; p < pairs; p += blockDim.x) {
        const unsigned row = sh_offsets[ids[p]] + tickets[p];
        slot_row[p] = row;
        row_token[row] = p / top_k;
        row_weight[row] = weights[p];
    }
}

// Grouped GEMM over the active experts on the GEMM engine (common/gemm_engine.cuh): block (i, s)
// multiplies row group i (128 weight rows) of expert active[s] with that expert's rows, 8T at a
// time (the weight tile is re-read per 8T rows; T is chosen by the host from the token count, so
// at decode every expert's rows fit in one pass). Weights: tiled stacks, one expert after another.
template <int T, class Act>
__device__ void moe_gemm(const uint4* w_codes, const uint2* w_scales, const float* w_decode, const float* row_decode,
                         Act act, const unsigned* gather, const float* act_global, void* out, int out_f32,
                         unsigned out_ld, unsigned out_col, const unsigned* offsets, const unsigned* active,
                         const unsigned* num_active, unsigned N, unsigned K) {
    if (blockIdx.y >= *num_active) return;  // block-uniform: no barrier is skipped by part of a block
    const unsigned e = active[blockIdx.y];
    const unsigned row0 = offsets[e], rows = offsets[e + 1] - row0;
    const unsigned row_tiles = (N + 15) / 16, chunks = (K + gemm::kTileK - 1) / gemm::kTileK;
    const unsigned groups = (chunks + gemm::kGroupChunks - 1) / gemm::kGroupChunks;
    const uint4* codes = w_codes + (size_t)e * row_tiles * chunks * 32;
    const uint2* scales = w_scales + (size_t)e * row_tiles * groups * 32;
    for (unsigned m0 = 0; m0 < rows; m0 += 8 * T) {
        act.row = gemm::RowMap{gather, row0 + m0};
        gemm::Epilogue ep{nullptr, row_decode ? row_decode + (size_t)e * N : nullptr, act_global, nullptr, 0, out,
                          out_f32};
        ep.w_decode = w_decode + e;
        ep.out_ld = out_ld;
        ep.out_row_base = row0 + m0;
        ep.out_col = out_col;
        gemm::gemm_block<1, gemm::kGroupChunks>(codes, scales, act, ep, min(rows - m0, 8u * T), N, K, blockIdx.x, 0,
                               gemm::SplitK{nullptr, nullptr, 1, chunks});
        __syncthreads();  // the next rows reuse the shared activation buffers
    }
}

#define FP4_MOE_GEMM_ARGS                                                                                 \
    const uint4 *w_codes, const uint2 *w_scales, const float *w_decode, const float *row_decode,        \
        const unsigned *gather, void *out, int out_f32, unsigned out_ld, unsigned out_col, const unsigned *offsets, \
        const unsigned *active, const unsigned *num_active, unsigned N, unsigned K

#define FP4_DEFINE_MOE_GEMM(T)                                                                            \
    extern "C" __global__ void __launch_bounds__(gemm::kThreads, 2) moe_gemm_bf16_##T(                     \
        const __nv_bfloat16* act, FP4_MOE_GEMM_ARGS) {                                                    \
        moe_gemm<T>(w_codes, w_scales, w_decode, row_decode, gemm::ActBf16<gemm::Window<T>>{act, gemm::RowMap{nullptr, 0}}, \
                    gather, nullptr, out, out_f32, out_ld, out_col, offsets, active, num_active, N, K);   \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(gemm::kThreads, 2) moe_gemm_nvfp4_##T(                    \
        const unsigned char* act_packed, const unsigned char* act_scales, const float* act_global,        \
        FP4_MOE_GEMM_ARGS) {                                                                              \
        moe_gemm<T>(w_codes, w_scales, w_decode, row_decode,                                            \
                    gemm::ActNvfp4<gemm::Window<T>>{act_packed, act_scales, gemm::RowMap{nullptr, 0}}, gather, act_global, out, \
                    out_f32, out_ld, out_col, offsets, active, num_active, N, K);                         \
    }

FP4_DEFINE_MOE_GEMM(1)
FP4_DEFINE_MOE_GEMM(2)
FP4_DEFINE_MOE_GEMM(4)
FP4_DEFINE_MOE_GEMM(8)

// out[t, :] = sum_j y[slot_row[t, j], :] * (weighted ? weight[t, j] : 1) (+ shared[t, :]), slot order.
extern "C" __global__ void __launch_bounds__(256) moe_combine(const float* y, const unsigned* slot_row,
                                                              const float* weights, int weighted,
                                                              const __nv_bfloat16* shared, __nv_bfloat16* out,
                                                              unsigned H, unsigned top_k) {
    const unsigned t = blockIdx.x;
    for (unsigned c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.0f;
        for (unsigned j = 0; j < top_k; ++j) {
            const float v = y[(size_t)slot_row[t * top_k + j] * H + c];
            acc = weighted ? fmaf(v, weights[t * top_k + j], acc) : __fadd_rn(acc, v);
        }
        if (shared) acc = __fadd_rn(acc, __bfloat162float(shared[(size_t)t * H + c]));
        out[(size_t)t * H + c] = __float2bfloat16_rn(acc);
    }
}
