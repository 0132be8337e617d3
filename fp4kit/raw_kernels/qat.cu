// DeepSeek-V4's simulated activation quantization on the device, in place and bit for bit as
// fp4kit/reference/qat.py specifies it (the official inference rounds these activations where
// they are stored, so that a layer sees the values it was trained on):
//   latent   a KV latent row's channels outside RoPE (the first D - rope_dim) through E4M3 with a
//            power-of-two scale per 64: one warp per block of 64, two channels per lane;
//   index    an indexer row (a query head, or a compressed key) rotated by the Hadamard matrix of
//            its width d (float64 butterflies, then / sqrt(d), rounded once to bf16), then
//            through E2M1 with a power-of-two scale per 32: one warp per row, d / 32 channels
//            per lane (template V), d = 32 .. 256.
// Which rows: every row of an array (the prefill's latents, the queries), the row a decode step
// wrote into a sliding-window ring (slot pos % window), or the compressed entries a step emitted
// (entries before[b] .. after[b] - 1 of sequence b: the compressor's counts around its append).
//
// The format constants arrive as fp32 arguments computed on the host as the reference computes
// them (fp32(1 / fmt_max), the amax floors), so no compile-time rounding can differ.
#include <cuda_bf16.h>

#include "common/nvfp4.cuh"

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// The smallest power of two >= max(amax, floor) * inv_max (fp32), as the reference's pow2_scale:
// the exponent of the product, plus one unless its mantissa is zero (at least 2^-126).
__device__ __forceinline__ float pow2_scale(float amax, float inv_max, float floor) {
    const unsigned bits = __float_as_uint(__fmul_rn(fmaxf(amax, floor), inv_max));
    const int e = (int)((bits >> 23) & 0xFFu) - 127 + ((bits & 0x7FFFFFu) != 0u);
    return __uint_as_float((unsigned)(max(e, -126) + 127) << 23);
}

// One latent row: warp w rounds the blocks of 64 channels w, w + kWarps, ... below D - rope_dim.
__device__ __forceinline__ void latent_row(__nv_bfloat16* __restrict__ row, unsigned D, unsigned rope_dim,
                                           float inv_max, float floor) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, blocks = (D - rope_dim) / 64;
    for (unsigned blk = warp; blk < blocks; blk += kWarps) {
        __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(row + blk * 64) + lane;
        const float2 v = __bfloat1622float2(*p);
        float amax = fmaxf(fabsf(v.x), fabsf(v.y));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
        const float s = pow2_scale(amax, inv_max, floor), inv_s = __fdiv_rn(1.0f, s);  // exact powers of two
        auto round = [&](float x) {  // E4M3 of clamp(x / s), times s: exact in bf16
            const float y = fminf(fmaxf(__fmul_rn(x, inv_s), -448.0f), 448.0f);
            const float q = fp4_e4m3_value(fp4_e4m3_encode(fabsf(y)) | (__float_as_uint(y) >> 24 & 0x80u));
            return __fmul_rn(q, s);
        };
        *p = __floats2bfloat162_rn(round(v.x), round(v.y));
    }
}

extern "C" __global__ void __launch_bounds__(kThreads) qat_latent_rows(
        __nv_bfloat16* x, unsigned D, unsigned rope_dim, float inv_max, float floor) {
    latent_row(x + (size_t)blockIdx.x * D, D, rope_dim, inv_max, floor);
}

// swa [B, window, D]: row pos[b] % window of sequence b = blockIdx.x.
extern "C" __global__ void __launch_bounds__(kThreads) qat_latent_window(
        __nv_bfloat16* swa, const int* __restrict__ pos, unsigned window, unsigned D, unsigned rope_dim, float inv_max,
        float floor) {
    const unsigned b = blockIdx.x, slot = (unsigned)pos[b] % window;
    latent_row(swa + ((size_t)b * window + slot) * D, D, rope_dim, inv_max, floor);
}

// comp [B, cap, D]: entry before[b] + blockIdx.y of sequence b = blockIdx.x, if it is below
// min(after[b], cap).
extern "C" __global__ void __launch_bounds__(kThreads) qat_latent_entries(
        __nv_bfloat16* comp, const int* __restrict__ before, const int* __restrict__ after, unsigned cap, unsigned D,
        unsigned rope_dim, float inv_max, float floor) {
    const unsigned b = blockIdx.x, e = (unsigned)before[b] + blockIdx.y;
    if (e >= min((unsigned)after[b], cap)) return;
    latent_row(comp + ((size_t)b * cap + e) * D, D, rope_dim, inv_max, floor);
}

// A bf16 value as a double, from its bits: exact for subnormals too (the module compiles with
// -ftz=true, which would flush them in a float conversion; the reference keeps them).
__device__ __forceinline__ double bf16_to_double(unsigned short h) {
    const unsigned e = (h >> 7) & 0xFFu, m = h & 0x7Fu;
    double v;
    if (e == 0u) v = (double)m * 0x1p-133;  // m * 2^-133
    else if (e == 0xFFu) v = __longlong_as_double(m ? 0x7FF8000000000000ll : 0x7FF0000000000000ll);
    else v = __longlong_as_double((long long)(e + 896u) << 52 | (long long)m << 45);  // e - 127 + 1023
    return (h & 0x8000u) ? -v : v;
}

__device__ __forceinline__ unsigned short double_to_bf16_bits(double v) {
    unsigned short h;
    asm("cvt.rn.bf16.f64 %0, %1;" : "=h"(h) : "d"(v));  // one rounding, as the reference's cast
    return h;
}

// The Hadamard rotation and E2M1 rounding of one row of d = 32 V channels, by one warp (lane l
// holds channels l V .. l V + V - 1). sqrt_d: the host's float64 sqrt(d).
template <int V>
__device__ __forceinline__ void index_row(__nv_bfloat16* __restrict__ row, double sqrt_d, float inv_max,
                                          float floor) {
    const unsigned lane = threadIdx.x & 31;
    double y[V];
#pragma unroll
    for (int i = 0; i < V; ++i) y[i] = bf16_to_double(__bfloat16_as_ushort(row[lane * V + i]));
    // butterflies (u, v) -> (u + v, u - v) over pairs (i, i + h), h = 1, 2, ..., d / 2
#pragma unroll
    for (int h = 1; h < V; h *= 2) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
            if (i & h) continue;
            const double u = y[i], v = y[i + h];
            y[i] = __dadd_rn(u, v);
            y[i + h] = __dsub_rn(u, v);
        }
    }
#pragma unroll
    for (int h = V; h < 32 * V; h *= 2) {
        const unsigned partner = (unsigned)(h / V);
        const bool lower = (lane & partner) == 0u;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const double other = __shfl_xor_sync(kFull, y[i], partner);
            y[i] = lower ? __dadd_rn(y[i], other) : __dsub_rn(other, y[i]);
        }
    }
    // the rotated row in bf16 (held as exact doubles), then E2M1 with a power-of-two scale per 32
    // channels (32 / V lanes); the scaling and the scale's product in double, where no subnormal
    // is flushed (a bf16 subnormal over the smallest scale can be an E2M1 half)
    double r[V];
    double amax = 0.0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        r[i] = bf16_to_double(double_to_bf16_bits(__ddiv_rn(y[i], sqrt_d)));
        amax = fmax(amax, fabs(r[i]));
    }
#pragma unroll
    for (int o = 1; o < 32 / V; o *= 2) amax = fmax(amax, __shfl_xor_sync(kFull, amax, o));
    // amax is a bf16 value: as a float it is exact, or a subnormal below the floor either way
    const float s = pow2_scale((float)amax, inv_max, floor);
    const double s_d = (double)s, inv_s = 1.0 / s_d;  // powers of two: exact
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const float v = fminf(fmaxf((float)(r[i] * inv_s), -6.0f), 6.0f);
        const double q = (double)fp4_e2m1_value(fp4_e2m1_code(v));
        row[lane * V + i] = __ushort_as_bfloat16(double_to_bf16_bits(q * s_d));
    }
}

// x [rows, d]: row blockIdx.x * kWarps + warp.
template <int V>
__device__ __forceinline__ void index_rows(__nv_bfloat16* x, unsigned rows, double sqrt_d, float inv_max,
                                           float floor) {
    const unsigned r = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (r < rows) index_row<V>(x + (size_t)r * 32 * V, sqrt_d, inv_max, floor);
}

// comp [B, cap, d]: entry before[b] + blockIdx.y * kWarps + warp of sequence b = blockIdx.x, if it
// is below min(after[b], cap).
template <int V>
__device__ __forceinline__ void index_entries(__nv_bfloat16* comp, const int* before, const int* after,
                                              unsigned cap, double sqrt_d, float inv_max, float floor) {
    const unsigned b = blockIdx.x, e = (unsigned)before[b] + blockIdx.y * kWarps + (threadIdx.x >> 5);
    if (e < min((unsigned)after[b], cap)) index_row<V>(comp + ((size_t)b * cap + e) * 32 * V, sqrt_d, inv_max, floor);
}

// The entry points, one pair per width d = 32 V (ops/qat.py picks by d).

extern "C" __global__ void __launch_bounds__(kThreads) qat_index_rows_v1(
        __nv_bfloat16* x, unsigned rows, double sqrt_d, float inv_max, float floor) {
    index_rows<1>(x, rows, sqrt_d, inv_max, floor);
}

extern "C" __global__ void __launch_bounds__(kThreads) qat_index_entries_v1(
        __nv_bfloat16* comp, const int* before, const int* after, unsigned cap, double sqrt_d, float inv_max,
        float floor) {
    index_entries<1>(comp, before, after, cap, sqrt_d, inv_max, floor);
}

extern "C" __global__ void __launch_bounds__(kThreads) qat_index_rows_v2(
        __nv_bfloat16* x, unsigned rows, double sqrt_d, float inv_max, float floor) {
    index_rows<2>(x, rows, sqrt_d, inv_max, floor);
}

extern "C" __global__ void __launch_bounds__(kThreads) qat_index_entries_v2(
        __nv_bfloat16* comp, const int* before, const int* after, unsigned cap, double sqrt_d, float inv_max,
        float floor) {
    index_entries<2>(comp, before, after, cap, sqrt_d, inv_max, floor);
}

extern "C" __global__ void __launch_bounds__(kThreads) qat_index_rows_v4(
        __nv_bfloat16* x, unsigned rows, double sqrt_d, float inv_max, float floor) {
    index_rows<4>(x, rows, sqrt_d, inv_max, floor);
}

extern "C" __global__ void __launch_bounds__(kThreads) qat_index_entries_v4(
        __nv_bfloat16* comp, const int* before, const int* after, unsigned cap, double sqrt_d, float inv_max,
        float floor) {
    index_entries<4>(comp, before, after, cap, sqrt_d, inv_max, floor);
}

extern "C" __global__ void __launch_bounds__(kThreads) qat_index_rows_v8(
        __nv_bfloat16* x, unsigned rows, double sqrt_d, float inv_max, float floor) {
    index_rows<8>(x, rows, sqrt_d, inv_max, floor);
}

extern "C" __global__ void __launch_bounds__(kThreads) qat_index_entries_v8(
        __nv_bfloat16* comp, const int* before, const int* after, unsigned cap, double sqrt_d, float inv_max,
        float floor) {
    index_entries<8>(comp, before, after, cap, sqrt_d, inv_max, floor);
}
