// DeepSeek-V4's manifold-constrained hyper-connections on the device: the residual stream is
// kHc copies x [rows, kHc, D] (fp32), mixed into each sublayer's input and updated with its
// output. fp4kit/reference/hyper_connections.py is the specification (float64); these kernels
// compute in fp32 and agree with it within rounding (tests/test_hyper_gpu.py states the bounds).
//
// One mixing site (before a sublayer, or the head) is two launches:
//   hc_mix_<M>   columns of D split over blocks (and rows over the grid's y); each thread owns one
//                channel d of every copy:
//                (mode 1) the copies after the previous sublayer, x'[j] = post[j] * y +
//                sum_i comb[i][j] * x[i], written back; (mode 2) x[j] = y, the stream's start;
//                then its partial sums of the M mixing dots (fn [M, kHc * D], held in registers
//                from before the wait: constant weights) and of x'^2, one partial per block
//                and row;
//   hc_pre_norm  one block per row: the partials summed in block order, the mixing logits
//                scaled by the copies' RMS, pre / post / comb (sigmoids, a row softmax and
//                the Sinkhorn rounds on one warp, lane 4 i + j holding comb[i][j]), post and
//                comb stored for the next site's hc_mix, then the sublayer input
//                sum_j pre[j] x'[j] and its RMSNorm (bf16), computed as add_rmsnorm_bf16 does.
// The head's site has M = kHc and only pre (sigmoid + eps), no post or comb.
//
// Reductions are deterministic: fixed shuffle trees, warps and blocks summed in index order.
#include <cuda_bf16.h>

#include "common/pdl.cuh"

constexpr int kHc = 4;                        // copies of the stream (hc_mult of V4-Flash and V4-Pro)
constexpr int kSiteMixes = (2 + kHc) * kHc;   // pre, post and comb logits of a sublayer's site
constexpr int kMixThreads = 128;              // hc_mix: one channel per thread
constexpr int kMixWarps = kMixThreads / 32;
constexpr int kNormThreads = 256;             // hc_pre_norm
constexpr int kNormWarps = kNormThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// One butterfly step: lanes with bit S set keep the upper S of their 2S values, the others the
// lower S, each adding its partner's copy of the half it keeps.
template <int S>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[32], unsigned lane) {
    const bool upper = lane & S;
#pragma unroll
    for (int i = 0; i < S; ++i) {
        const float send = upper ? v[i] : v[i + S];
        const float keep = upper ? v[i + S] : v[i];
        v[i] = __fadd_rn(keep, __shfl_xor_sync(kFull, send, S));
    }
    if constexpr (S > 1) reduce_scatter_step<S / 2>(v, lane);
}

// v[0..31] of every lane -> lane l returns the sum over the warp of v[l] (a butterfly
// reduce-scatter: 31 shuffles where 32 reductions would take 160).
__device__ __forceinline__ float warp_reduce_scatter32(float (&v)[32]) {
    reduce_scatter_step<16>(v, threadIdx.x & 31);
    return v[0];
}

// The M mixing dots and the sum of squares of row r's copies, one partial per block:
// partial[(blockIdx.x * rows + r) * 32 + m], m < M dots, m = M the sum of squares.
template <int M>
__device__ __forceinline__ void hc_mix_impl(float* __restrict__ x, const void* __restrict__ y, int y_f32,
                                            const float* __restrict__ post, const float* __restrict__ comb,
                                            const float* __restrict__ fn, float* __restrict__ partial,
                                            unsigned rows, unsigned D, int mode) {
    static_assert(M + 1 <= 32, "the dots and the sum of squares share one 32-value reduce-scatter");
    __shared__ float warp_sums[kMixWarps][32];
    const unsigned d = blockIdx.x * kMixThreads + threadIdx.x;
    const bool live = d < D;
    const size_t width = (size_t)kHc * D;
    float w[M][kHc];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int j = 0; j < kHc; ++j) w[m][j] = live ? __ldg(fn + m * width + (size_t)j * D + d) : 0.0f;
    pdl::wait_prior();
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (unsigned r = blockIdx.y; r < rows; r += gridDim.y) {  // rows split over the grid's y
        float* xr = x + r * width;
        float c[kHc] = {};
        if (live) {
#pragma unroll
            for (int j = 0; j < kHc; ++j) c[j] = xr[(size_t)j * D + d];
            if (mode) {
                const float yv = y_f32 ? reinterpret_cast<const float*>(y)[(size_t)r * D + d]
                                       : __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(y)[(size_t)r * D + d]);
                float n[kHc];
#pragma unroll
                for (int j = 0; j < kHc; ++j) {
                    if (mode == 2) {
                        n[j] = yv;
                        continue;
                    }
                    float acc = __fmul_rn(post[r * kHc + j], yv);
#pragma unroll
                    for (int i = 0; i < kHc; ++i) acc = __fmaf_rn(comb[(r * kHc + i) * kHc + j], c[i], acc);
                    n[j] = acc;
                }
#pragma unroll
                for (int j = 0; j < kHc; ++j) {
                    c[j] = n[j];
                    xr[(size_t)j * D + d] = n[j];
                }
            }
        }
        float v[32];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < kHc; ++j) acc = __fmaf_rn(w[m][j], c[j], acc);
            v[m] = acc;
        }
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < kHc; ++j) ss = __fmaf_rn(c[j], c[j], ss);
        v[M] = ss;
#pragma unroll
        for (int m = M + 1; m < 32; ++m) v[m] = 0.0f;
        const float mine = warp_reduce_scatter32(v);
        __syncthreads();  // warp_sums of the row before is read
        warp_sums[warp][lane] = mine;
        __syncthreads();
        if (threadIdx.x <= M) {
            float total = 0.0f;
#pragma unroll
            for (int k = 0; k < kMixWarps; ++k) total = __fadd_rn(total, warp_sums[k][threadIdx.x]);
            partial[((size_t)blockIdx.x * rows + r) * 32 + threadIdx.x] = total;
        }
    }
}

extern "C" __global__ void __launch_bounds__(kMixThreads) hc_mix_site(
        float* x, const void* y, int y_f32, const float* post, const float* comb, const float* fn,
        float* partial, unsigned rows, unsigned D, int mode) {
    hc_mix_impl<kSiteMixes>(x, y, y_f32, post, comb, fn, partial, rows, D, mode);
}

extern "C" __global__ void __launch_bounds__(kMixThreads) hc_mix_head(
        float* x, const void* y, int y_f32, const float* post, const float* comb, const float* fn,
        float* partial, unsigned rows, unsigned D, int mode) {
    hc_mix_impl<kHc>(x, y, y_f32, post, comb, fn, partial, rows, D, mode);
}

__device__ __forceinline__ float hc_sigmoid(float z) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-z)));
}

// Row r's site: pre (and, unless head, post and comb: stored at post_out / comb_out), then the
// RMSNorm (weight norm_w, eps) of sum_j pre[j] x[r][j] into out [rows, D] bf16, by a block of
// kThreadsT threads. s0..s2 and base [M] are the site's; chunks: hc_mix's blocks. The copies and
// the partials are read through L2 (another block, or the kernel before, wrote them).
template <int kThreadsT>
__device__ __forceinline__ void site_row(const float* __restrict__ x, const float* __restrict__ partial,
                                         unsigned chunks, unsigned rows, unsigned D, unsigned r, int head,
                                         float s0, float s1, float s2, const float* __restrict__ base,
                                         unsigned iters, float hc_eps, float norm_eps,
                                         const float* __restrict__ norm_w, float eps, __nv_bfloat16* __restrict__ out,
                                         float* __restrict__ post_out, float* __restrict__ comb_out, float* mixes,
                                         float* pre, float* smem) {
    constexpr int kWarpsT = kThreadsT / 32;
    const unsigned M = head ? kHc : kSiteMixes;
    __syncthreads();  // the shared arrays of the row before are read
    if (threadIdx.x <= M) {
        float total = 0.0f;
        for (unsigned c = 0; c < chunks; ++c)
            total = __fadd_rn(total, __ldcg(partial + ((size_t)c * rows + r) * 32 + threadIdx.x));
        mixes[threadIdx.x] = total;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const unsigned lane = threadIdx.x;
        // 1 / sqrt(mean of the copies' squares + norm_eps), as the reference's rms
        const float rms = __frsqrt_rn(__fadd_rn(__fdiv_rn(mixes[M], (float)(kHc * D)), norm_eps));
        auto mix = [&](unsigned m, float scale_m) {  // a mixing logit: dot * rms * scale + base
            return __fadd_rn(__fmul_rn(__fmul_rn(mixes[m], rms), scale_m), __ldg(base + m));
        };
        if (lane < kHc) pre[lane] = __fadd_rn(hc_sigmoid(mix(lane, s0)), hc_eps);
        if (!head) {
            if (lane < kHc) post_out[r * kHc + lane] = __fmul_rn(2.0f, hc_sigmoid(mix(kHc + lane, s1)));
            // comb[i][j] on lane 4 i + j (lanes 16..31 mirror 0..15 and are not stored): the row
            // softmax + eps, the columns divided by their sum + eps, then iters - 1 rounds of
            // rows then columns
            const float logit = mix(2 * kHc + (lane & 15), s2);
            float mx = logit;
            mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
            const float e = expf(__fsub_rn(logit, mx));
            float sum = __fadd_rn(e, __shfl_xor_sync(kFull, e, 1));
            sum = __fadd_rn(sum, __shfl_xor_sync(kFull, sum, 2));
            float cv = __fadd_rn(__fdiv_rn(e, sum), hc_eps);
            auto row_sum = [&](float v) {
                v = __fadd_rn(v, __shfl_xor_sync(kFull, v, 1));
                return __fadd_rn(v, __shfl_xor_sync(kFull, v, 2));
            };
            auto col_sum = [&](float v) {
                v = __fadd_rn(v, __shfl_xor_sync(kFull, v, 4));
                return __fadd_rn(v, __shfl_xor_sync(kFull, v, 8));
            };
            cv = __fdiv_rn(cv, __fadd_rn(col_sum(cv), hc_eps));
            for (unsigned it = 1; it < iters; ++it) {
                cv = __fdiv_rn(cv, __fadd_rn(row_sum(cv), hc_eps));
                cv = __fdiv_rn(cv, __fadd_rn(col_sum(cv), hc_eps));
            }
            if (lane < 16) comb_out[r * kHc * kHc + lane] = cv;
        }
    }
    __syncthreads();
    const float* xr = x + (size_t)r * kHc * D;
    float ss = 0.0f;
    for (unsigned d = threadIdx.x; d < D; d += kThreadsT) {
        float h = 0.0f;
#pragma unroll
        for (int j = 0; j < kHc; ++j) h = __fmaf_rn(pre[j], __ldcg(xr + (size_t)j * D + d), h);
        ss = __fmaf_rn(h, h, ss);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(kFull, ss, o));
    if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarpsT; ++w) total = __fadd_rn(total, smem[w]);
    const float inv = __frsqrt_rn(__fadd_rn(__fdiv_rn(total, (float)D), eps));
    for (unsigned d = threadIdx.x; d < D; d += kThreadsT) {
        float h = 0.0f;
#pragma unroll
        for (int j = 0; j < kHc; ++j) h = __fmaf_rn(pre[j], __ldcg(xr + (size_t)j * D + d), h);
        out[(size_t)r * D + d] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(h, inv), __ldg(norm_w + d)));
    }
}

// The site's second launch: one block per row.
extern "C" __global__ void __launch_bounds__(kNormThreads) hc_pre_norm(
        const float* __restrict__ x, const float* __restrict__ partial, unsigned chunks, unsigned rows, unsigned D,
        const float* __restrict__ scale, const float* __restrict__ base, int head, unsigned iters, float hc_eps,
        float norm_eps, const float* __restrict__ norm_w, float eps, __nv_bfloat16* __restrict__ out,
        float* __restrict__ post_out, float* __restrict__ comb_out) {
    __shared__ float mixes[32];
    __shared__ float pre[kHc];
    __shared__ float smem[kNormWarps];
    const float s0 = __ldg(scale), s1 = head ? 0.0f : __ldg(scale + 1), s2 = head ? 0.0f : __ldg(scale + 2);
    pdl::wait_prior();
    site_row<kNormThreads>(x, partial, chunks, rows, D, blockIdx.x, head, s0, s1, s2, base, iters, hc_eps, norm_eps,
                           norm_w, eps, out, post_out, comb_out, mixes, pre, smem);
}

// A whole site in one launch, for few rows: hc_mix, then the last of its blocks to arrive (a
// counter, left at zero for the next launch) runs every row's site_row. *arrivals is 0 on entry.
template <int M>
__device__ __forceinline__ void hc_site_impl(float* x, const void* y, int y_f32, const float* post,
                                             const float* comb, const float* fn, float* partial, unsigned rows,
                                             unsigned D, int mode, unsigned* arrivals, const float* scale,
                                             const float* base, unsigned iters, float hc_eps, float norm_eps,
                                             const float* norm_w, float eps, __nv_bfloat16* out, float* post_out,
                                             float* comb_out) {
    __shared__ float mixes[32];
    __shared__ float pre[kHc];
    __shared__ float smem[kMixWarps];
    __shared__ bool last;
    constexpr int head = M == kHc;
    hc_mix_impl<M>(x, y, y_f32, post, comb, fn, partial, rows, D, mode);
    __threadfence();  // this block's copies and partials, before its arrival
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(arrivals, 1u) == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float s0 = __ldg(scale), s1 = head ? 0.0f : __ldg(scale + 1), s2 = head ? 0.0f : __ldg(scale + 2);
    for (unsigned r = 0; r < rows; ++r)
        site_row<kMixThreads>(x, partial, gridDim.x, rows, D, r, head, s0, s1, s2, base, iters, hc_eps, norm_eps,
                              norm_w, eps, out, post_out, comb_out, mixes, pre, smem);
    if (threadIdx.x == 0) *arrivals = 0u;
}

extern "C" __global__ void __launch_bounds__(kMixThreads) hc_site_fused(
        float* x, const void* y, int y_f32, const float* post, const float* comb, const float* fn, float* partial,
        unsigned rows, unsigned D, int mode, unsigned* arrivals, const float* scale, const float* base,
        unsigned iters, float hc_eps, float norm_eps, const float* norm_w, float eps, __nv_bfloat16* out,
        float* post_out, float* comb_out) {
    hc_site_impl<kSiteMixes>(x, y, y_f32, post, comb, fn, partial, rows, D, mode, arrivals, scale, base, iters,
                             hc_eps, norm_eps, norm_w, eps, out, post_out, comb_out);
}

extern "C" __global__ void __launch_bounds__(kMixThreads) hc_head_fused(
        float* x, const void* y, int y_f32, const float* post, const float* comb, const float* fn, float* partial,
        unsigned rows, unsigned D, int mode, unsigned* arrivals, const float* scale, const float* base,
        unsigned iters, float hc_eps, float norm_eps, const float* norm_w, float eps, __nv_bfloat16* out,
        float* post_out, float* comb_out) {
    hc_site_impl<kHc>(x, y, y_f32, post, comb, fn, partial, rows, D, mode, arrivals, scale, base, iters, hc_eps,
                      norm_eps, norm_w, eps, out, post_out, comb_out);
}
