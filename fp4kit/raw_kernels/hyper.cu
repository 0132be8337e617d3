// DeepSeek-V4's manifold-constrained hyper-connections on the device: the residual stream is
// kHc copies x [rows, kHc, D] (fp32), mixed into each sublayer's input and updated with its
// output. fp4kit/reference/hyper_connections.py is the specification (float64); these kernels
// compute in fp32 and agree with it within rounding (tests/test_hyper_gpu.py states the bounds).
//
// One mixing site (before a sublayer, or the head) is two launches. Both compute the copies the
// site mixes, x'[j] = post[j] * y + sum_i comb[i][j] * x[i] (mode 1: after the previous
// sublayer, with its site's post and comb), x'[j] = y (mode 2: the stream's start) or x' = x
// (mode 0), with the same instructions (`mix_channel`), so they agree bit for bit:
//   hc_mix_<M>   columns of D split over blocks, each block one group of the M mixing dots (rows
//                over the grid's y); each thread owns one channel d of every copy: its partial
//                sums of the group's dots (fn [M, kHc * D], held in registers from before the
//                wait: constant weights) and, in group 0, of the copies' Gram matrix
//                G[i][j] = sum_d x'[i][d] x'[j][d]; one partial per column block and row;
//   hc_pre_norm  columns of D split over blocks, rows over the grid's y: every block sums the
//                partials in block order and computes the row's pre (the mixing logits scaled by
//                the copies' RMS, trace(G)); the row's first block also post and comb (sigmoids,
//                a row softmax and the Sinkhorn rounds on one warp, every lane holding the whole
//                4 x 4 comb) for the next site; then each block writes its columns of x' back and
//                of the sublayer input h = sum_j pre[j] x'[j], RMS-normed (bf16):
//                sum_d h[d]^2 = sum_ij pre[i] pre[j] G[i][j], so no block waits for another.
// The head's site has M = kHc and only pre (sigmoid + eps), no post or comb.
//
// Reductions are deterministic: fixed shuffle trees, warps and blocks summed in index order.
#include <cuda_bf16.h>

#include "common/pdl.cuh"

constexpr int kHc = 4;                        // copies of the stream (hc_mult of V4-Flash and V4-Pro)
constexpr int kSiteMixes = (2 + kHc) * kHc;   // pre, post and comb logits of a sublayer's site
constexpr int kSiteGroups = 4;                // hc_mix blocks per column block at a sublayer's site
constexpr int kMixThreads = 128;              // hc_mix: one channel per thread
constexpr int kMixWarps = kMixThreads / 32;
constexpr int kGram = kHc * (kHc + 1) / 2;    // distinct entries of the copies' Gram matrix
constexpr int kPartialWords = 40;             // fp32 words per (block, row) partial: M dots + kGram
constexpr int kNormThreads = 128;             // hc_pre_norm
constexpr int kNormPerThread = 4;             // channels per thread (strided by kNormThreads)
constexpr int kNormChannels = kNormThreads * kNormPerThread;
constexpr int kNormWarps = kNormThreads / 32;
constexpr int kWarpValues = (kPartialWords + kNormWarps - 1) / kNormWarps;  // partial words summed per warp
constexpr unsigned kFull = 0xffffffffu;
static_assert(kHc == 4, "gram_i / gram_j list the pairs of four copies");

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

// Gram entry g of the copies: g < kHc the diagonal (g, g), then (0,1) (0,2) (0,3) (1,2) (1,3) (2,3).
__device__ __forceinline__ constexpr int gram_i(int g) { return g < kHc ? g : g < 7 ? 0 : g < 9 ? 1 : 2; }
__device__ __forceinline__ constexpr int gram_j(int g) { return g < kHc ? g : g < 7 ? g - 3 : g < 9 ? g - 5 : 3; }

// The previous site's post and comb of row r (read in mode 1 only).
struct RowMix {
    float post[kHc];
    float comb[kHc][kHc];
};

__device__ __forceinline__ void load_row_mix(const float* __restrict__ post, const float* __restrict__ comb,
                                             unsigned r, int mode, RowMix& m) {
    if (mode != 1) return;
#pragma unroll
    for (int j = 0; j < kHc; ++j) m.post[j] = post[r * kHc + j];
#pragma unroll
    for (int i = 0; i < kHc; ++i)
#pragma unroll
        for (int j = 0; j < kHc; ++j) m.comb[i][j] = comb[(r * kHc + i) * kHc + j];
}

// Channel d of row r's inputs: the copies (modes 0, 1) and y (modes 1, 2).
__device__ __forceinline__ void load_channel(const float* __restrict__ x, const void* __restrict__ y, int y_f32,
                                             unsigned r, unsigned D, unsigned d, int mode, float (&c)[kHc],
                                             float& yv) {
    if (mode != 2) {
#pragma unroll
        for (int j = 0; j < kHc; ++j) c[j] = x[((size_t)r * kHc + j) * D + d];
    }
    if (mode != 0)
        yv = y_f32 ? reinterpret_cast<const float*>(y)[(size_t)r * D + d]
                   : __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(y)[(size_t)r * D + d]);
}

// The copies this site mixes (see the top of the file), in place of the loaded ones in c.
__device__ __forceinline__ void mix_channel(const RowMix& m, int mode, float yv, float (&c)[kHc]) {
    if (mode == 0) return;
    if (mode == 2) {
#pragma unroll
        for (int j = 0; j < kHc; ++j) c[j] = yv;
        return;
    }
    float n[kHc];
#pragma unroll
    for (int j = 0; j < kHc; ++j) {
        float acc = __fmul_rn(m.post[j], yv);
#pragma unroll
        for (int i = 0; i < kHc; ++i) acc = __fmaf_rn(m.comb[i][j], c[i], acc);
        n[j] = acc;
    }
#pragma unroll
    for (int j = 0; j < kHc; ++j) c[j] = n[j];
}

// Group g = blockIdx.x % G of the M mixing dots (M / G of them) and, in group 0, the Gram entries
// of row r's copies, one partial per column block c = blockIdx.x / G:
// partial[(c * rows + r) * kPartialWords + k], k < M the dots, then the kGram entries.
// hc_mix only reads the copies: hc_pre_norm writes them back.
template <int M, int G>
__device__ __forceinline__ void hc_mix_impl(const float* __restrict__ x, const void* __restrict__ y, int y_f32,
                                            const float* __restrict__ post, const float* __restrict__ comb,
                                            const float* __restrict__ fn, float* __restrict__ partial,
                                            unsigned rows, unsigned D, int mode) {
    static_assert(M % G == 0, "the groups split the dots evenly");
    constexpr int Mg = M / G, K = Mg + kGram;
    static_assert(K <= 32 && M + kGram <= kPartialWords, "a group's dots and the Gram entries fit one reduce-scatter");
    __shared__ float warp_sums[kMixWarps][32];
    const unsigned chunk = blockIdx.x / G, group = blockIdx.x % G;
    const unsigned d = chunk * kMixThreads + threadIdx.x;
    const bool live = d < D;
    const size_t width = (size_t)kHc * D;
    float w[Mg][kHc];
#pragma unroll
    for (int m = 0; m < Mg; ++m)
#pragma unroll
        for (int j = 0; j < kHc; ++j)
            w[m][j] = live ? __ldg(fn + (group * Mg + m) * width + (size_t)j * D + d) : 0.0f;
    pdl::wait_prior();
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (unsigned r = blockIdx.y; r < rows; r += gridDim.y) {  // rows split over the grid's y
        RowMix rm;
        load_row_mix(post, comb, r, mode, rm);
        float c[kHc] = {}, yv = 0.0f;
        if (live) {
            load_channel(x, y, y_f32, r, D, d, mode, c, yv);
            mix_channel(rm, mode, yv, c);
        }
        float v[32];
#pragma unroll
        for (int m = 0; m < Mg; ++m) {
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < kHc; ++j) acc = __fmaf_rn(w[m][j], c[j], acc);
            v[m] = acc;
        }
#pragma unroll
        for (int g = 0; g < kGram; ++g) v[Mg + g] = __fmul_rn(c[gram_i(g)], c[gram_j(g)]);
#pragma unroll
        for (int k = K; k < 32; ++k) v[k] = 0.0f;
        const float mine = warp_reduce_scatter32(v);
        __syncthreads();  // warp_sums of the row before is read
        warp_sums[warp][lane] = mine;
        __syncthreads();
        const unsigned k = threadIdx.x;
        if (k < Mg || (group == 0 && k < K)) {
            float total = 0.0f;
#pragma unroll
            for (int i = 0; i < kMixWarps; ++i) total = __fadd_rn(total, warp_sums[i][k]);
            const unsigned word = k < Mg ? group * Mg + k : M + (k - Mg);
            partial[((size_t)chunk * rows + r) * kPartialWords + word] = total;
        }
    }
}

extern "C" __global__ void __launch_bounds__(kMixThreads) hc_mix_site(
        const float* x, const void* y, int y_f32, const float* post, const float* comb, const float* fn,
        float* partial, unsigned rows, unsigned D, int mode) {
    hc_mix_impl<kSiteMixes, kSiteGroups>(x, y, y_f32, post, comb, fn, partial, rows, D, mode);
}

extern "C" __global__ void __launch_bounds__(kMixThreads) hc_mix_head(
        const float* x, const void* y, int y_f32, const float* post, const float* comb, const float* fn,
        float* partial, unsigned rows, unsigned D, int mode) {
    hc_mix_impl<kHc, 1>(x, y, y_f32, post, comb, fn, partial, rows, D, mode);
}

// 1 / v by the special-function unit (within an ulp; the exact division's slow path is a call
// that serialises the Sinkhorn rounds)
__device__ __forceinline__ float fast_rcp(float v) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

__device__ __forceinline__ float hc_sigmoid(float z) {
    return fast_rcp(__fadd_rn(1.0f, expf(-z)));
}

// comb (4 x 4, in every lane's registers) divided by its row sums + eps (by_rows) or its column
// sums + eps.
__device__ __forceinline__ void sinkhorn_half(float (&cm)[kHc][kHc], bool by_rows, float eps) {
#pragma unroll
    for (int a = 0; a < kHc; ++a) {
        auto e = [&](int b) { return by_rows ? cm[a][b] : cm[b][a]; };
        const float s = __fadd_rn(__fadd_rn(e(0), e(1)), __fadd_rn(e(2), e(3)));  // a tree: half the latency
        const float inv = fast_rcp(__fadd_rn(s, eps));
#pragma unroll
        for (int b = 0; b < kHc; ++b) {
            float& v = by_rows ? cm[a][b] : cm[b][a];
            v = __fmul_rn(v, inv);
        }
    }
}

// The site's second launch: block (bx, r) sums row r's partials and computes pre (and, in the
// row's first block, unless head, post and comb, stored at post_out / comb_out) and the row's
// RMS, then writes its kNormChannels columns of the copies x' back (mode 1, 2) and of the RMSNorm
// (weight norm_w, eps) of h = sum_j pre[j] x'[j] into out [rows, D] bf16. scale, base [M] are
// the site's; chunks: hc_mix's column blocks. release: let the next kernel's blocks start now.
extern "C" __global__ void __launch_bounds__(kNormThreads) hc_pre_norm(
        float* __restrict__ x, const void* __restrict__ y, int y_f32, const float* __restrict__ post,
        const float* __restrict__ comb, int mode, const float* __restrict__ partial, unsigned chunks, unsigned rows,
        unsigned D, const float* __restrict__ scale, const float* __restrict__ base, int head, unsigned iters,
        float hc_eps, float norm_eps, const float* __restrict__ norm_w, float eps, __nv_bfloat16* __restrict__ out,
        float* __restrict__ post_out, float* __restrict__ comb_out, int release) {
    __shared__ float mixes[kPartialWords];
    __shared__ float base_s[kPartialWords];
    __shared__ float pre[kHc];
    __shared__ float inv_rms;
    if (release) pdl::release_next();
    const unsigned M = head ? kHc : kSiteMixes, K = M + kGram;
    const float s0 = __ldg(scale), s1 = head ? 0.0f : __ldg(scale + 1), s2 = head ? 0.0f : __ldg(scale + 2);
    if (threadIdx.x < M) base_s[threadIdx.x] = __ldg(base + threadIdx.x);  // constant: ahead of the wait
    const unsigned d0 = blockIdx.x * kNormChannels + threadIdx.x;
    float wn[kNormPerThread];
#pragma unroll
    for (int k = 0; k < kNormPerThread; ++k) {
        const unsigned d = d0 + k * kNormThreads;
        wn[k] = d < D ? __ldg(norm_w + d) : 0.0f;
    }
    pdl::wait_prior();
    for (unsigned r = blockIdx.y; r < rows; r += gridDim.y) {
        // every load of the row issued at once (one round trip): this block's channels of the
        // copies' inputs, mixed once pre is known, and the partials
        RowMix rm;
        load_row_mix(post, comb, r, mode, rm);
        float c[kNormPerThread][kHc], yv[kNormPerThread];
#pragma unroll
        for (int k = 0; k < kNormPerThread; ++k) {
            const unsigned d = d0 + k * kNormThreads;
            if (d < D) load_channel(x, y, y_f32, r, D, d, mode, c[k], yv[k]);
        }
        // the partials: warp w sums values w, w + kNormWarps, ..., lane l adding column blocks
        // l, l + 32, ... in order, then a butterfly over the lanes (a fixed order)
        const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        float part[kWarpValues];
#pragma unroll
        for (int v = 0; v < kWarpValues; ++v) {
            const unsigned k = warp + v * kNormWarps;
            part[v] = k < K && lane < chunks ? __ldcg(partial + ((size_t)lane * rows + r) * kPartialWords + k) : 0.0f;
        }
        for (unsigned cb = lane + 32; cb < chunks; cb += 32) {
#pragma unroll
            for (int v = 0; v < kWarpValues; ++v) {
                const unsigned k = warp + v * kNormWarps;
                if (k < K) part[v] = __fadd_rn(part[v], __ldcg(partial + ((size_t)cb * rows + r) * kPartialWords + k));
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int v = 0; v < kWarpValues; ++v) part[v] = __fadd_rn(part[v], __shfl_xor_sync(kFull, part[v], o));
        __syncthreads();  // the shared values of the row before are read
        if (lane == 0) {
#pragma unroll
            for (int v = 0; v < kWarpValues; ++v) {
                const unsigned k = warp + v * kNormWarps;
                if (k < K) mixes[k] = part[v];
            }
        }
        __syncthreads();
        if (warp == 0) {
            const float* gram = mixes + M;
            const float trace = __fadd_rn(__fadd_rn(gram[0], gram[1]), __fadd_rn(gram[2], gram[3]));
            // 1 / sqrt(mean of the copies' squares + norm_eps), as the reference's rms
            const float rms = __frsqrt_rn(__fadd_rn(__fdiv_rn(trace, (float)(kHc * D)), norm_eps));
            auto mix = [&](unsigned m, float scale_m) {  // a mixing logit: dot * rms * scale + base
                return __fadd_rn(__fmul_rn(__fmul_rn(mixes[m], rms), scale_m), base_s[m]);
            };
            float p[kHc];
#pragma unroll
            for (int j = 0; j < kHc; ++j) p[j] = __fadd_rn(hc_sigmoid(mix(j, s0)), hc_eps);
            if (lane == 0) {  // sum_d h^2 from the Gram matrix: the diagonal, then twice each pair
#pragma unroll
                for (int j = 0; j < kHc; ++j) pre[j] = p[j];
                float q = 0.0f;
#pragma unroll
                for (int g = 0; g < kGram; ++g) {
                    const float t = __fmul_rn(__fmul_rn(p[gram_i(g)], p[gram_j(g)]), gram[g]);
                    q = __fadd_rn(q, g < kHc ? t : __fmul_rn(2.0f, t));
                }
                inv_rms = __frsqrt_rn(__fadd_rn(__fdiv_rn(fmaxf(q, 0.0f), (float)D), eps));
            }
            if (!head && blockIdx.x == 0) {
                if (lane < kHc) post_out[r * kHc + lane] = __fmul_rn(2.0f, hc_sigmoid(mix(kHc + lane, s1)));
                // comb: the row softmax + eps, the columns divided by their sum + eps, then
                // iters - 1 rounds of rows then columns
                float cm[kHc][kHc];
#pragma unroll
                for (int i = 0; i < kHc; ++i) {
#pragma unroll
                    for (int j = 0; j < kHc; ++j) cm[i][j] = mix(2 * kHc + i * kHc + j, s2);
                    float mx = cm[i][0];
#pragma unroll
                    for (int j = 1; j < kHc; ++j) mx = fmaxf(mx, cm[i][j]);
                    float sum = 0.0f;
#pragma unroll
                    for (int j = 0; j < kHc; ++j) {
                        cm[i][j] = expf(__fsub_rn(cm[i][j], mx));
                        sum = __fadd_rn(sum, cm[i][j]);
                    }
                    const float inv = fast_rcp(sum);
#pragma unroll
                    for (int j = 0; j < kHc; ++j) cm[i][j] = __fadd_rn(__fmul_rn(cm[i][j], inv), hc_eps);
                }
                sinkhorn_half(cm, false, hc_eps);
                for (unsigned it = 1; it < iters; ++it) {
                    sinkhorn_half(cm, true, hc_eps);
                    sinkhorn_half(cm, false, hc_eps);
                }
#pragma unroll
                for (int i = 0; i < kHc * kHc; ++i)
                    if (lane == i) comb_out[r * kHc * kHc + i] = cm[i / kHc][i % kHc];
            }
        }
        __syncthreads();
        const float inv = inv_rms;
        float pj[kHc];
#pragma unroll
        for (int j = 0; j < kHc; ++j) pj[j] = pre[j];
        float* xr = x + (size_t)r * kHc * D;
#pragma unroll
        for (int k = 0; k < kNormPerThread; ++k) {
            const unsigned d = d0 + k * kNormThreads;
            if (d >= D) continue;
            mix_channel(rm, mode, yv[k], c[k]);
            float h = 0.0f;
#pragma unroll
            for (int j = 0; j < kHc; ++j) {
                h = __fmaf_rn(pj[j], c[k][j], h);
                if (mode) xr[(size_t)j * D + d] = c[k][j];
            }
            out[(size_t)r * D + d] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(h, inv), wn[k]));
        }
    }
}
