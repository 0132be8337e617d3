// The small row-wise kernels between the GEMMs of a decode step: RMSNorm (+ RoPE, of one array or
// of two in one launch), the residual
// add fused with the next RMSNorm, the token-embedding gather, the "every compressed entry"
// selection of ratio-128 layers, the token log and the split of a concatenated GEMM's output. fp4kit/reference/elementwise.py is the
// specification. Every kernel reads positions, lengths and tokens on the device, so a decode step
// that uses them can be captured in a CUDA graph.
//
// Reductions are deterministic: each thread sums its elements in index order, then a fixed
// shuffle tree and the warps' partial sums in warp order.
#include <cuda_bf16.h>

#include "common/status.cuh"
#include "common/pdl.cuh"

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Sum of v over the block, the same value in every thread.
__device__ __forceinline__ float ew_block_sum(float v, float* smem) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();  // smem may still be read by a previous call
    if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += smem[w];
    return total;
}

// Rotation of the pair (a, b) at channel pair i of the last rope_dim channels by position p:
// angle = p * theta^(-2i / rope_dim), in double as in kv_cache.cu, then fp32.
__device__ __forceinline__ void ew_rope(float& a, float& b, int p, unsigned i, unsigned rope_dim, float theta) {
    const double angle = (double)p * pow((double)theta, -2.0 * (double)i / (double)rope_dim);
    double sn, cs;
    sincos(angle, &sn, &cs);
    const float c = (float)cs, s = (float)sn;
    const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    const float rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    a = ra, b = rb;
}

// y_row = rope(x[r] * rsqrt(mean(x[r]^2) + eps) * w) for row r of D channels (D even), one block.
// normalize = 0 skips the norm (RoPE only); w may be null (no weight); rope_dim = 0 skips RoPE,
// else the row's position is pos[r / heads] (the token's index in its sequence).
__device__ __forceinline__ void rmsnorm_rope_row(const __nv_bfloat16* x, const float* w, const int* pos,
                                                 __nv_bfloat16* y_row, size_t row, unsigned heads, unsigned D,
                                                 float eps, int normalize, unsigned rope_dim, float theta,
                                                 float* smem) {
    const __nv_bfloat162* xr = reinterpret_cast<const __nv_bfloat162*>(x + row * D);
    __nv_bfloat162* yr = reinterpret_cast<__nv_bfloat162*>(y_row);
    const unsigned pairs = D / 2;
    float inv = 1.0f;
    if (normalize) {
        float ss = 0.0f;
        for (unsigned j = threadIdx.x; j < pairs; j += kThreads) {
            const float2 v = __bfloat1622float2(xr[j]);
            ss = __fadd_rn(ss, __fadd_rn(__fmul_rn(v.x, v.x), __fmul_rn(v.y, v.y)));
        }
        const float mean = __fdiv_rn(ew_block_sum(ss, smem), (float)D);
        inv = __frsqrt_rn(__fadd_rn(mean, eps));
    }
    const int p = rope_dim ? pos[row / heads] : 0;
    const unsigned first_rope_pair = (D - rope_dim) / 2;
    for (unsigned j = threadIdx.x; j < pairs; j += kThreads) {
        const float2 v = __bfloat1622float2(xr[j]);
        float a = __fmul_rn(v.x, inv), b = __fmul_rn(v.y, inv);
        if (w) a = __fmul_rn(a, w[2 * j]), b = __fmul_rn(b, w[2 * j + 1]);
        if (j >= first_rope_pair) ew_rope(a, b, p, j - first_rope_pair, rope_dim, theta);
        yr[j] = __floats2bfloat162_rn(a, b);
    }
}

// rmsnorm_rope_row over the rows of x [rows, D] (rows = tokens * heads): grid rows.
extern "C" __global__ void __launch_bounds__(kThreads) rmsnorm_rope_bf16(
        const __nv_bfloat16* __restrict__ x, const float* __restrict__ w, const int* __restrict__ pos,
        __nv_bfloat16* __restrict__ y, unsigned heads, unsigned D, float eps, int normalize, unsigned rope_dim,
        float theta) {
    pdl::wait_prior();
    __shared__ float smem[kWarps];
    rmsnorm_rope_row(x, w, pos, y + (size_t)blockIdx.x * D, blockIdx.x, heads, D, eps, normalize, rope_dim, theta,
                     smem);
}

// Two parts in one launch (e.g. two outputs of one concatenated projection), each as
// rmsnorm_rope_bf16 runs it, with the same positions, eps and theta: grid rows0 + rows1, block r
// < rows0 takes row r of part 0, the others row r - rows0 of part 1. window1 > 0: part 1 is one row
// per sequence (heads1 = 1) and y1 a sliding-window ring [rows1, window1, D1]: row b goes to slot
// pos[b] % window1, the slot kv_append_swa writes a decode token's row to (one launch less).
extern "C" __global__ void __launch_bounds__(kThreads) rmsnorm_rope2_bf16(
        const __nv_bfloat16* x0, const float* w0, __nv_bfloat16* y0, unsigned rows0, unsigned heads0, unsigned D0,
        int normalize0, unsigned rope_dim0, const __nv_bfloat16* x1, const float* w1, __nv_bfloat16* y1,
        unsigned heads1, unsigned D1, int normalize1, unsigned rope_dim1, const int* pos, float eps, float theta,
        unsigned window1) {
    pdl::wait_prior();
    __shared__ float smem[kWarps];
    const unsigned r = blockIdx.x;
    if (r < rows0) {
        rmsnorm_rope_row(x0, w0, pos, y0 + (size_t)r * D0, r, heads0, D0, eps, normalize0, rope_dim0, theta, smem);
    } else {
        const unsigned r1 = r - rows0;
        const size_t dst = window1 ? (size_t)r1 * window1 + (unsigned)pos[r1] % window1 : r1;
        rmsnorm_rope_row(x1, w1, pos, y1 + dst * D1, r1, heads1, D1, eps, normalize1, rope_dim1, theta, smem);
    }
}

// The residual stream step: resid[r] += delta[r] (delta may be null), then
// y[r] = bf16(resid[r] * rsqrt(mean(resid[r]^2) + eps) * w).
// A row of up to kRowRegs * kThreads channels is loaded into registers at once (the loads issued
// together, not one latency per loop trip; the sum in the same order as the loop below).
constexpr int kRowRegs = 32;

extern "C" __global__ void __launch_bounds__(kThreads) add_rmsnorm_bf16(
        float* __restrict__ resid, const __nv_bfloat16* __restrict__ delta, const float* __restrict__ w,
        __nv_bfloat16* __restrict__ y, unsigned D, float eps) {
    pdl::wait_prior();
    __shared__ float smem[kWarps];
    const size_t row = blockIdx.x;
    float* r = resid + row * D;
    float ss = 0.0f;
    if (D <= kRowRegs * kThreads) {
        float v[kRowRegs], d[kRowRegs];
#pragma unroll
        for (int i = 0; i < kRowRegs; ++i) {
            const unsigned j = threadIdx.x + i * kThreads;
            v[i] = j < D ? r[j] : 0.0f;
            d[i] = delta && j < D ? __bfloat162float(delta[row * D + j]) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < kRowRegs; ++i) {
            const unsigned j = threadIdx.x + i * kThreads;
            if (j >= D) break;
            if (delta) {
                v[i] = __fadd_rn(v[i], d[i]);
                r[j] = v[i];
            }
            ss = __fadd_rn(ss, __fmul_rn(v[i], v[i]));
        }
        const float mean = __fdiv_rn(ew_block_sum(ss, smem), (float)D);
        const float inv = __frsqrt_rn(__fadd_rn(mean, eps));
#pragma unroll
        for (int i = 0; i < kRowRegs; ++i) {
            const unsigned j = threadIdx.x + i * kThreads;
            if (j >= D) break;
            y[row * D + j] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(v[i], inv), w[j]));
        }
        return;
    }
    for (unsigned j = threadIdx.x; j < D; j += kThreads) {
        float v = r[j];
        if (delta) {
            v = __fadd_rn(v, __bfloat162float(delta[row * D + j]));
            r[j] = v;  // re-read below by this same thread only
        }
        ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
    const float mean = __fdiv_rn(ew_block_sum(ss, smem), (float)D);
    const float inv = __frsqrt_rn(__fadd_rn(mean, eps));
    for (unsigned j = threadIdx.x; j < D; j += kThreads)
        y[row * D + j] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(r[j], inv), w[j]));
}

// resid[b] = float(table[tokens[b]]); a token outside [0, vocab) reads row 0 and records
// FP4_STATUS_TOKEN_RANGE.
extern "C" __global__ void __launch_bounds__(kThreads) embed_bf16(
        const __nv_bfloat16* __restrict__ table, const int* __restrict__ tokens, float* __restrict__ resid,
        unsigned H, unsigned vocab, unsigned* status) {
    pdl::wait_prior();
    const size_t b = blockIdx.x;
    int t = tokens[b];
    if (t < 0 || (unsigned)t >= vocab) {
        if (threadIdx.x == 0) atomicOr(status, FP4_STATUS_TOKEN_RANGE);
        t = 0;
    }
    const __nv_bfloat16* src = table + (size_t)t * H;
    for (unsigned j = threadIdx.x; j < H; j += kThreads) resid[b * H + j] = __bfloat162float(src[j]);
}

// The column blocks [bounds[p], bounds[p + 1]) of y [rows, cols] (bf16), each made a contiguous
// [rows, width_p] block of out, one after another (part p at out + bounds[p] * rows): the parts of
// a concatenated projection in one launch instead of one copy each (bounds: parts + 1 ascending
// column indices, in device memory). With every bound a multiple of 8 and 16-byte aligned rows, one
// thread moves 8 values (16 bytes).
extern "C" __global__ void __launch_bounds__(kThreads) split_columns_bf16(
        const __nv_bfloat16* __restrict__ y, __nv_bfloat16* __restrict__ out, unsigned rows, unsigned cols,
        unsigned parts, const unsigned* __restrict__ bounds, int vec8) {
    pdl::wait_prior();
    const unsigned per = vec8 ? 8u : 1u, per_row = cols / per;
    const size_t i = (size_t)blockIdx.x * kThreads + threadIdx.x;
    if (i >= (size_t)rows * per_row) return;
    const unsigned r = (unsigned)(i / per_row), c = (unsigned)(i % per_row) * per;
    unsigned p = 0;
    while (p + 1 < parts && c >= bounds[p + 1]) ++p;
    const unsigned lo = bounds[p], width = bounds[p + 1] - lo;
    __nv_bfloat16* dst = out + (size_t)lo * rows + (size_t)r * width + (c - lo);
    const __nv_bfloat16* src = y + (size_t)r * cols + c;
    if (vec8) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    else *dst = *src;
}

// indices[b, i] = i < comp_len[b] ? i : -1 for i < n: every live compressed entry, -1 padded.
extern "C" __global__ void __launch_bounds__(kThreads) all_entries(
        const int* __restrict__ comp_len, int* __restrict__ indices, unsigned n) {
    pdl::wait_prior();
    const unsigned i = blockIdx.x * kThreads + threadIdx.x;
    const unsigned b = blockIdx.y;
    if (i < n) indices[(size_t)b * n + i] = (int)i < comp_len[b] ? (int)i : -1;
}

// history[step[0] % rows, b] = tokens[b] for b < B, then step[0] += 1 (one block).
extern "C" __global__ void __launch_bounds__(kThreads) log_tokens(
        const int* __restrict__ tokens, int* __restrict__ history, int* __restrict__ step, unsigned B,
        unsigned rows) {
    pdl::wait_prior();
    const unsigned s = (unsigned)step[0] % rows;
    for (unsigned b = threadIdx.x; b < B; b += kThreads) history[(size_t)s * B + b] = tokens[b];
    __syncthreads();  // every thread has read step[0]
    if (threadIdx.x == 0) step[0] += 1;
}

// tokens[b] = prompt[b, min(pos[b], P - 1)]: the next prompt token of every sequence, chosen on the
// device from its position (a captured prefill step follows the positions as they advance).
extern "C" __global__ void __launch_bounds__(kThreads) prompt_tokens(
        const int* __restrict__ prompt, const int* __restrict__ pos, int* __restrict__ tokens, unsigned B,
        unsigned P) {
    pdl::wait_prior();
    const unsigned b = blockIdx.x * kThreads + threadIdx.x;
    if (b < B) tokens[b] = prompt[(size_t)b * P + min((unsigned)max(pos[b], 0), P - 1)];
}
