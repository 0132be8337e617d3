// The residual stream step of a decode step, shared by its own launch (elementwise.cu
// add_rmsnorm_bf16) and the MoE launch that ends with it (moe.cu moe_combine, one block per token):
// resid[r] += delta[r], then
// y[r] = bf16(resid[r] * rsqrt(mean(resid[r]^2) + eps) * w), one row per block of kThreads threads.
// fp4kit/reference/elementwise.py add_rmsnorm is the specification; every variant here does the same
// arithmetic in the same order, so the fused step gives the bits of the launch of its own.
//
// Two thread layouts, chosen on the host (ops/elementwise.py `quad_rows`): rows of D = 4 * kThreads
// * q channels (q <= kRowQuads, 16-byte aligned) as quads, thread t owning quads t, t + kThreads, ...
// (each thread sums its channels in index order); other rows channel by channel, thread t owning
// channels t, t + kThreads, .... The partial sums then meet in a fixed shuffle tree and in warp order.
#pragma once

#include <cuda_bf16.h>

namespace rownorm {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowQuads = 8;  // D <= 8192 on the quad path

// Sum of v over the block, the same value in every thread.
__device__ __forceinline__ float block_sum(float v, float* smem) {
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

struct RowQuads {
    float4 q[kRowQuads];
};

__device__ __forceinline__ bool quad_live(int i, unsigned D) { return 4u * (threadIdx.x + i * kThreads) < D; }

// The weight's quads of this thread, unpredicated and in a branch of their own (a quad past the
// row re-reads the last one, then reads as zero): predicated loads in straight-line code were
// scheduled after the wait by the compiler (tests/test_compile.py reads where they land).
__device__ __forceinline__ RowQuads load_weight_quads(const float* __restrict__ w, unsigned D) {
    RowQuads wq;
    const unsigned last = D / 4 - 1;
    if (D >= 4) {
#pragma unroll
        for (int i = 0; i < kRowQuads; ++i)
            wq.q[i] = __ldg(reinterpret_cast<const float4*>(w) + min(threadIdx.x + i * kThreads, last));
    }
#pragma unroll
    for (int i = 0; i < kRowQuads; ++i)
        if (!quad_live(i, D)) wq.q[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    return wq;
}

__device__ __forceinline__ float4 bf16x4_to_float4(uint2 raw) {
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}

__device__ __forceinline__ float4 add4(float4 x, float4 d) {
    return make_float4(__fadd_rn(x.x, d.x), __fadd_rn(x.y, d.y), __fadd_rn(x.z, d.z), __fadd_rn(x.w, d.w));
}

// ss += x.x^2 + x.y^2 + x.z^2 + x.w^2, in that order
__device__ __forceinline__ float add_squares(float ss, float4 x) {
    ss = __fadd_rn(ss, __fmul_rn(x.x, x.x));
    ss = __fadd_rn(ss, __fmul_rn(x.y, x.y));
    ss = __fadd_rn(ss, __fmul_rn(x.z, x.z));
    return __fadd_rn(ss, __fmul_rn(x.w, x.w));
}

// 1 / sqrt(mean + eps) of the row from this thread's partial sum of squares
__device__ __forceinline__ float inverse_rms(float ss, unsigned D, float eps, float* smem) {
    return __frsqrt_rn(__fadd_rn(__fdiv_rn(block_sum(ss, smem), (float)D), eps));
}

// The bf16 quad bf16(x * inv * g) at quad index j of y_row.
__device__ __forceinline__ void store_normed_quad(__nv_bfloat16* y_row, unsigned j, float4 x, float4 g, float inv) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(__fmul_rn(__fmul_rn(x.x, inv), g.x), __fmul_rn(__fmul_rn(x.y, inv), g.y));
    const __nv_bfloat162 hi = __floats2bfloat162_rn(__fmul_rn(__fmul_rn(x.z, inv), g.z), __fmul_rn(__fmul_rn(x.w, inv), g.w));
    uint2 packed;
    packed.x = *reinterpret_cast<const unsigned*>(&lo);
    packed.y = *reinterpret_cast<const unsigned*>(&hi);
    reinterpret_cast<uint2*>(y_row)[j] = packed;
}

// This thread's quads of the row r (v) and of row `delta_row` of delta (d; zero where delta is
// null), every load in flight at once. delta: coherent loads through L2 (the kernel before, or other
// threads of this one, wrote it; a read-only load could be scheduled ahead of a wait).
__device__ __forceinline__ void load_row_quads(const float* r, const __nv_bfloat16* delta, size_t delta_row, unsigned D,
                                               RowQuads& v, uint2 (&d)[kRowQuads]) {
#pragma unroll
    for (int i = 0; i < kRowQuads; ++i) {
        const unsigned j = threadIdx.x + i * kThreads;
        const bool live = quad_live(i, D);
        v.q[i] = live ? reinterpret_cast<const float4*>(r)[j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        d[i] = live && delta ? __ldcg(reinterpret_cast<const uint2*>(delta + delta_row * D) + j) : make_uint2(0u, 0u);
    }
}

// y_row = bf16(v * rsqrt(mean(v^2) + eps) * w) for a row held as quads.
__device__ __forceinline__ void norm_store_quads(const RowQuads& v, const RowQuads& wq, __nv_bfloat16* y_row,
                                                 unsigned D, float eps, float* smem) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowQuads; ++i) {
        if (!quad_live(i, D)) break;
        ss = add_squares(ss, v.q[i]);
    }
    const float inv = inverse_rms(ss, D, eps, smem);
#pragma unroll
    for (int i = 0; i < kRowQuads; ++i) {
        if (!quad_live(i, D)) break;
        store_normed_quad(y_row, threadIdx.x + i * kThreads, v.q[i], wq.q[i], inv);
    }
}

// The quad layout's step with the row's loads all in flight at once (one round trip), the weight's
// after the sum (the launch of its own loads it before its wait instead): for a kernel that ends
// with the step. delta: read through L2 (a kernel's own stores of it are not in its L1).
__device__ __forceinline__ void add_rmsnorm_quads(float* r, const __nv_bfloat16* delta, const float* w,
                                                  __nv_bfloat16* y_row, unsigned D, float eps, float* smem) {
    RowQuads v;
    uint2 d[kRowQuads];
    load_row_quads(r, delta, 0, D, v, d);
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowQuads; ++i) {
        if (!quad_live(i, D)) break;
        if (delta) {
            v.q[i] = add4(v.q[i], bf16x4_to_float4(d[i]));
            reinterpret_cast<float4*>(r)[threadIdx.x + i * kThreads] = v.q[i];
        }
        ss = add_squares(ss, v.q[i]);
    }
    const float inv = inverse_rms(ss, D, eps, smem);
#pragma unroll
    for (int i = 0; i < kRowQuads; ++i) {
        if (!quad_live(i, D)) break;
        const unsigned j = threadIdx.x + i * kThreads;
        store_normed_quad(y_row, j, v.q[i], __ldg(reinterpret_cast<const float4*>(w) + j), inv);
    }
}

// The channel layout (rows off the quad path). delta as above.
__device__ __forceinline__ void add_rmsnorm_channels(float* r, const __nv_bfloat16* delta, const float* w,
                                                     __nv_bfloat16* y_row, unsigned D, float eps, float* smem) {
    float ss = 0.0f;
    for (unsigned j = threadIdx.x; j < D; j += kThreads) {
        float v = r[j];
        if (delta) {
            v = __fadd_rn(v, __bfloat162float(__ldcg(delta + j)));
            r[j] = v;  // re-read below by this same thread only
        }
        ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
    const float inv = inverse_rms(ss, D, eps, smem);
    for (unsigned j = threadIdx.x; j < D; j += kThreads) y_row[j] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(r[j], inv), w[j]));
}

// The step on one row by the whole block (kThreads threads), in the layout its launcher chose.
__device__ __forceinline__ void add_rmsnorm_row(float* r, const __nv_bfloat16* delta, const float* w,
                                                __nv_bfloat16* y_row, unsigned D, float eps, int quads) {
    __shared__ float smem[kWarps];
    if (quads)
        add_rmsnorm_quads(r, delta, w, y_row, D, eps, smem);
    else
        add_rmsnorm_channels(r, delta, w, y_row, D, eps, smem);
}

}  // namespace rownorm
