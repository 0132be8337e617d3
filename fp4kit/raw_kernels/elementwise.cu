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
#include "common/residual_norm.cuh"
#include "common/rope.cuh"

// the block sum, the quad layout of rows and the residual step (shared with moe.cu)
using namespace rownorm;

// y_row = rope(x[r] * rsqrt(mean(x[r]^2) + eps) * w) for row r of D channels (D even), one block.
// normalize = 0 skips the norm (RoPE only); w may be null (no weight); rope_dim = 0 skips RoPE,
// else the row's position is pos[r / heads] (the token's index in its sequence).
__device__ __forceinline__ void rmsnorm_rope_row(const __nv_bfloat16* x, const float* w, const int* pos,
                                                 __nv_bfloat16* y_row, size_t row, unsigned heads, unsigned D,
                                                 float eps, int normalize, unsigned rope_dim,
                                                 const double* inv_freq, float* smem) {
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
        const float mean = __fdiv_rn(block_sum(ss, smem), (float)D);
        inv = __frsqrt_rn(__fadd_rn(mean, eps));
    }
    const int p = rope_dim ? pos[row / heads] : 0;
    const unsigned first_rope_pair = (D - rope_dim) / 2;
#pragma unroll 1  // the rotation's double sincos is long: one copy of the loop body (code fetched at every launch)
    for (unsigned j = threadIdx.x; j < pairs; j += kThreads) {
        const float2 v = __bfloat1622float2(xr[j]);
        float a = __fmul_rn(v.x, inv), b = __fmul_rn(v.y, inv);
        if (w) a = __fmul_rn(a, w[2 * j]), b = __fmul_rn(b, w[2 * j + 1]);
        if (j >= first_rope_pair) rope_rotate(a, b, p, j - first_rope_pair, inv_freq);
        yr[j] = __floats2bfloat162_rn(a, b);
    }
}

// rmsnorm_rope_row over the rows of x [rows, D] (rows = tokens * heads): grid rows.
extern "C" __global__ void __launch_bounds__(kThreads) rmsnorm_rope_bf16(
        const __nv_bfloat16* __restrict__ x, const float* __restrict__ w, const int* __restrict__ pos,
        __nv_bfloat16* __restrict__ y, unsigned heads, unsigned D, float eps, int normalize, unsigned rope_dim,
        const double* __restrict__ inv_freq, int release) {
    if (release) pdl::release_next();
    pdl::wait_prior();
    __shared__ float smem[kWarps];
    rmsnorm_rope_row(x, w, pos, y + (size_t)blockIdx.x * D, blockIdx.x, heads, D, eps, normalize, rope_dim, inv_freq,
                     smem);
}

// Two parts in one launch (e.g. two outputs of one concatenated projection), each as
// rmsnorm_rope_bf16 runs it, with the same positions and eps: grid rows0 + rows1, block r
// < rows0 takes row r of part 0, the others row r - rows0 of part 1. window1 > 0: part 1 is one row
// per sequence (heads1 = 1) and y1 a sliding-window ring [rows1, window1, D1]: row b goes to slot
// pos[b] % window1, the slot kv_append_swa writes a decode token's row to (one launch less); with
// advance1, that row's block then moves pos[b] on by one as kv_advance does (another launch less;
// part 0 must not read positions: rope_dim0 = 0, checked on the host).
extern "C" __global__ void __launch_bounds__(kThreads) rmsnorm_rope2_bf16(
        const __nv_bfloat16* x0, const float* w0, __nv_bfloat16* y0, unsigned rows0, unsigned heads0, unsigned D0,
        int normalize0, unsigned rope_dim0, const __nv_bfloat16* x1, const float* w1, __nv_bfloat16* y1,
        unsigned heads1, unsigned D1, int normalize1, unsigned rope_dim1, int* pos, float eps,
        const double* inv_freq0, const double* inv_freq1, unsigned window1, int advance1, int release) {
    if (release) pdl::release_next();
    pdl::wait_prior();
    __shared__ float smem[kWarps];
    const unsigned r = blockIdx.x;
    if (r < rows0) {
        rmsnorm_rope_row(x0, w0, pos, y0 + (size_t)r * D0, r, heads0, D0, eps, normalize0, rope_dim0, inv_freq0, smem);
    } else {
        const unsigned r1 = r - rows0;
        const size_t dst = window1 ? (size_t)r1 * window1 + (unsigned)pos[r1] % window1 : r1;
        rmsnorm_rope_row(x1, w1, pos, y1 + dst * D1, r1, heads1, D1, eps, normalize1, rope_dim1, inv_freq1, smem);
        if (advance1) {  // no other block reads pos[r1]
            __syncthreads();  // every thread of the block has read it
            if (threadIdx.x == 0) pos[r1] += 1;
        }
    }
}

// The residual stream step: resid[r] += delta[r] (delta may be null), then
// y[r] = bf16(resid[r] * rsqrt(mean(resid[r]^2) + eps) * w) (common/residual_norm.cuh). On the quad
// path (`vec`) the row is held in registers: every load of the row is one 16-byte (fp32) or 8-byte
// (bf16) load, all in flight at once, and the weight's quads are loaded before the wait for the
// kernel before (a constant of the layer: its DRAM round trip overlaps that kernel).
extern "C" __global__ void __launch_bounds__(kThreads) add_rmsnorm_bf16(
        float* __restrict__ resid, const __nv_bfloat16* __restrict__ delta, const float* __restrict__ w,
        __nv_bfloat16* __restrict__ y, unsigned D, float eps, int vec, int release) {
    __shared__ float smem[kWarps];
    if (release) pdl::release_next();
    const size_t row = blockIdx.x;
    float* r = resid + row * D;
    if (vec) {
        const RowQuads wq = load_weight_quads(w, D);
        pdl::wait_prior();
        RowQuads v;
        uint2 d[kRowQuads];
        load_row_quads(r, delta, row, D, v, d);
        if (delta) {
#pragma unroll
            for (int i = 0; i < kRowQuads; ++i) {
                if (!quad_live(i, D)) break;
                v.q[i] = add4(v.q[i], bf16x4_to_float4(d[i]));
                reinterpret_cast<float4*>(r)[threadIdx.x + i * kThreads] = v.q[i];
            }
        }
        norm_store_quads(v, wq, y + row * D, D, eps, smem);
        return;
    }
    pdl::wait_prior();
    add_rmsnorm_channels(r, delta ? delta + row * D : nullptr, w, y + row * D, D, eps, smem);
}

// The table row of token b (an id outside [0, vocab) reads row 0 and records
// FP4_STATUS_TOKEN_RANGE).
__device__ __forceinline__ const __nv_bfloat16* token_row(const __nv_bfloat16* table, const int* tokens, unsigned b,
                                                          unsigned H, unsigned vocab, unsigned* status) {
    int t = __ldcg(tokens + b);  // a coherent load: a read-only one may be scheduled ahead of the wait
    if (t < 0 || (unsigned)t >= vocab) {
        if (threadIdx.x == 0) atomicOr(status, FP4_STATUS_TOKEN_RANGE);
        t = 0;
    }
    return table + (size_t)t * H;
}

// resid[b] = float(table[tokens[b]]). vec (H a multiple of 8, 16-byte aligned rows): 16-byte
// loads, all of a thread's issued at once.
extern "C" __global__ void __launch_bounds__(kThreads) embed_bf16(
        const __nv_bfloat16* __restrict__ table, const int* __restrict__ tokens, float* __restrict__ resid,
        unsigned H, unsigned vocab, unsigned* status, int vec) {
    pdl::wait_prior();
    const size_t b = blockIdx.x;
    const __nv_bfloat16* src = token_row(table, tokens, b, H, vocab, status);
    if (vec) {
#pragma unroll 4
        for (unsigned j = threadIdx.x; j < H / 8; j += kThreads) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src) + j);
            float4* dst = reinterpret_cast<float4*>(resid + b * H) + 2 * j;
            dst[0] = bf16x4_to_float4(make_uint2(raw.x, raw.y));
            dst[1] = bf16x4_to_float4(make_uint2(raw.z, raw.w));
        }
        return;
    }
    for (unsigned j = threadIdx.x; j < H; j += kThreads) resid[b * H + j] = __bfloat162float(src[j]);
}

// The first layer's input in one launch: resid[b] = float(table[tokens[b]]) as embed_bf16 writes
// it, and y[b] its RMSNorm as add_rmsnorm_bf16 (no delta) computes it; rows on the quad path only
// (H a multiple of 4, H <= 4 * kThreads * kRowQuads, 16-byte aligned rows of resid, w and y).
extern "C" __global__ void __launch_bounds__(kThreads) embed_rmsnorm_bf16(
        const __nv_bfloat16* __restrict__ table, const int* __restrict__ tokens, float* __restrict__ resid,
        const float* __restrict__ w, __nv_bfloat16* __restrict__ y, unsigned H, unsigned vocab, float eps,
        unsigned* status, int release) {
    __shared__ float smem[kWarps];
    if (release) pdl::release_next();
    const RowQuads wq = load_weight_quads(w, H);
    pdl::wait_prior();
    const unsigned b = blockIdx.x;
    const __nv_bfloat16* src = token_row(table, tokens, b, H, vocab, status);
    RowQuads v;
#pragma unroll
    for (int i = 0; i < kRowQuads; ++i)
        v.q[i] = quad_live(i, H) ? bf16x4_to_float4(__ldg(reinterpret_cast<const uint2*>(src) + threadIdx.x + i * kThreads))
                                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < kRowQuads; ++i)
        if (quad_live(i, H)) reinterpret_cast<float4*>(resid + (size_t)b * H)[threadIdx.x + i * kThreads] = v.q[i];
    norm_store_quads(v, wq, y + (size_t)b * H, H, eps, smem);
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
