// The NVFP4 codec on the device: E2M1 and E4M3 encode/decode, the global encode scale, one
// 16-element block quantized, 16-element vector loads and the 128x4 swizzled scale offset.
// Bit for bit the recipe of fp4kit/reference/quant.py (Transformer Engine's reference).
#pragma once

#include "fp32.cuh"
#include "status.cuh"

#define FP4_BLOCK 16

// fp32 to an E2M1 code: round to nearest even, saturate at +-6, sign from the sign bit,
// NaN to 0x7 (+6) as the sm_100a cvt.rn.satfinite.e2m1x2 does. Sm_90 has no such instruction.
// Two exact forms, both checked against the reference's comparison form on 2**25 random and
// every tie bit pattern:
//
// fp4_e2m1_code: any input, on the bits of |y| (non-negative floats order like integers):
//   |y| >= 1: E2M1 keeps one mantissa bit; round the fp32 mantissa at bit 22 to nearest even,
//             then (exponent, bit 22) is the code: 1.0 -> 2, 1.5 -> 3, ..., 6.0 -> 7, capped at 7;
//   |y| <  1: the subnormal step 0.5: 0 up to 0.25 (tie to even), 0.5 below 0.75, else 1.0.
__device__ __forceinline__ unsigned fp4_e2m1_code(float y) {
    const unsigned bits = __float_as_uint(y), a = bits & 0x7FFFFFFFu;
    const unsigned normal = min(((a + 0x1FFFFFu + ((a >> 22) & 1u)) >> 22) - 252u, 7u);
    const unsigned subnormal = (a > 0x3E800000u) + (a >= 0x3F400000u);
    const unsigned sign = a > 0x7F800000u ? 0u : (bits >> 28) & 8u;  // NaN: +6
    return (a >= 0x3F800000u ? normal : subnormal) | sign;
}

// fp4_e2m1_code_not_nan: y must not be NaN; about half the instructions of the integer form,
// so the quantizers use it for every block without a NaN. The E2M1 step is 0.5 below 2, 1 in
// [2, 4) and 2 from 4: adding M = 1.5 * 2**(22 + e) (e = 0, 1, 2 for the three ranges) rounds
// |y| to that step with the fp32 adder's own ties-to-even and leaves n = round(|y| / step) in the
// low mantissa bits of the sum; the code is n + 2e, and 2e = (bits(M) >> 22) - 299.
__device__ __forceinline__ unsigned fp4_e2m1_code_not_nan(float y) {
    const float a = fminf(fabsf(y), 6.0f);  // +-Inf and everything above 6 saturate
    const unsigned m = (__float_as_uint(fmaxf(a, 1.0f)) & 0x7F800000u) + 0x0B400000u;
    const unsigned n_plus_m = __float_as_uint(__fadd_rn(a, __uint_as_float(m)));
    return (n_plus_m - m + (m >> 22) - 299u) | ((__float_as_uint(y) >> 28) & 8u);
}

__device__ __forceinline__ float fp4_e2m1_value(unsigned code) {
    // code = 2e + m: e = 0 gives 0 or 0.5, otherwise (1 + m/2) * 2**(e-1), built from its bits
    const unsigned e = (code >> 1) & 3u, m = code & 1u;
    const float v = e ? __uint_as_float(((e + 126u) << 23) | (m << 22)) : (m ? 0.5f : 0.0f);
    return (code & 8u) ? -v : v;
}

// Non-negative fp32 to E4M3 with round-to-nearest-even and saturation at 448 (sm_89+ cvt).
__device__ __forceinline__ unsigned fp4_e4m3_encode(float v) {
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(v));
    return pair & 0xFFu;
}

// E4M3 byte to fp32, exact; 0x7F / 0xFF are NaN.
__device__ __forceinline__ float fp4_e4m3_value(unsigned byte) {
    const unsigned e = (byte >> 3) & 0xFu, m = byte & 7u;
    float v;
    if ((byte & 0x7Fu) == 0x7Fu) v = __uint_as_float(0x7FC00000u);
    else if (e == 0) v = (float)m * 0.001953125f;  // subnormal: m * 2**-9
    else v = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (byte & 0x80u) ? -v : v;
}

// S = min(2688 / amax, FLT_MAX); 1 if that is 0 or amax is not finite.
__device__ __forceinline__ float fp4_global_scale_from_amax(float amax) {
    amax = fp4_ftz(amax);
    if (!(amax <= FP4_FLT_MAX)) return 1.0f;
    const float s = fminf(__fdiv_rn(2688.0f, amax), FP4_FLT_MAX);
    return s == 0.0f ? 1.0f : s;
}

// |v| as bits, so that an integer max orders finite < Inf < NaN.
__device__ __forceinline__ unsigned fp4_abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

__device__ __forceinline__ unsigned fp4_block_abs_max_bits(const float v[FP4_BLOCK]) {
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < FP4_BLOCK; ++i) m = max(m, fp4_abs_bits(v[i]));
    return m;
}

// Quantize one block whose max |v| has the bits vmax_bits: returns the E4M3 scale byte, writes
// the 16 codes packed into 8 bytes.
__device__ __forceinline__ unsigned fp4_encode_block(const float v[FP4_BLOCK], unsigned vmax_bits, float global_scale,
                                                     uint2& packed) {
    const float vmax = __uint_as_float(vmax_bits);
    const float s = fp4_ftz(global_scale);
    const unsigned sf = fp4_e4m3_encode(fminf(__fmul_rn(vmax, __fmul_rn(s, 1.0f / 6.0f)), FP4_FLT_MAX));
    const float enc = fminf(__fdiv_rn(1.0f, __fmul_rn(fp4_e4m3_value(sf), __fdiv_rn(1.0f, s))), FP4_FLT_MAX);
    unsigned words[2] = {0u, 0u};
    if (!isnan(vmax)) {  // no NaN in the block: the cheaper exact rounding
#pragma unroll
        for (int i = 0; i < FP4_BLOCK; ++i)
            words[i / 8] |= fp4_e2m1_code_not_nan(__fmul_rn(v[i], enc)) << (4 * (i % 8));
    } else {
#pragma unroll
        for (int i = 0; i < FP4_BLOCK; ++i)
            words[i / 8] |= fp4_e2m1_code(__fmul_rn(v[i], enc)) << (4 * (i % 8));
    }
    packed = make_uint2(words[0], words[1]);
    return sf;
}

// 16 consecutive elements of T (16-byte aligned) as 16-byte words, and their fp32 values.
// Fetching and expanding are separate so that a loop can have the next block's loads in flight
// while it works on the current one. Subnormals are not flushed here: every consumer flushes
// them through its -ftz arithmetic (or, for amax, once at the end).
template <typename T>
struct Fp4Raw16 {
    uint4 q[FP4_BLOCK * sizeof(T) / 16];
};

template <typename T>
__device__ __forceinline__ Fp4Raw16<T> fp4_fetch16(const T* p) {
    Fp4Raw16<T> r;
#pragma unroll
    for (int j = 0; j < FP4_BLOCK * (int)sizeof(T) / 16; ++j) r.q[j] = reinterpret_cast<const uint4*>(p)[j];
    return r;
}

template <typename T>
__device__ __forceinline__ void fp4_expand16(const Fp4Raw16<T>& r, float v[FP4_BLOCK]) {
    const T* e = reinterpret_cast<const T*>(r.q);
#pragma unroll
    for (int i = 0; i < FP4_BLOCK; ++i) v[i] = fp4_to_float(e[i]);
}

// max |x| of a fetched block as fp32 bits (finite < Inf < NaN), straight from the 16-bit
// patterns: two elements per instruction (VIMNMX3.U16x2 on sm_90) instead of converting first.
__device__ __forceinline__ unsigned fp4_abs_max_u16x2(const uint4* q) {
    unsigned m = 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        m = __vimax3_u16x2(m, q[j].x & 0x7FFF7FFFu, q[j].y & 0x7FFF7FFFu);
        m = __vimax3_u16x2(m, q[j].z & 0x7FFF7FFFu, q[j].w & 0x7FFF7FFFu);
    }
    return max(m & 0xFFFFu, m >> 16);
}

__device__ __forceinline__ unsigned fp4_raw_abs_max_bits(const Fp4Raw16<__nv_bfloat16>& r) {
    return fp4_abs_max_u16x2(r.q) << 16;
}

__device__ __forceinline__ unsigned fp4_raw_abs_max_bits(const Fp4Raw16<__half>& r) {
    return __float_as_uint(__half2float(__ushort_as_half((unsigned short)fp4_abs_max_u16x2(r.q))));
}

__device__ __forceinline__ unsigned fp4_raw_abs_max_bits(const Fp4Raw16<float>& r) {
    unsigned m = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j)
        m = max(max(m, max(r.q[j].x & 0x7FFFFFFFu, r.q[j].y & 0x7FFFFFFFu)), max(r.q[j].z & 0x7FFFFFFFu, r.q[j].w & 0x7FFFFFFFu));
    return m;
}

template <typename T>
__device__ __forceinline__ void fp4_store16(T* p, const float v[FP4_BLOCK]) {
    constexpr int kPerVec = 16 / sizeof(T);
    uint4* dst = reinterpret_cast<uint4*>(p);
#pragma unroll
    for (int j = 0; j < FP4_BLOCK / kPerVec; ++j) {
        uint4 raw;
        T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int i = 0; i < kPerVec; ++i) e[i] = fp4_from_float<T>(v[j * kPerVec + i]);
        dst[j] = raw;
    }
}

// Byte offset of block scale (row m, block column k) in the 128x4 swizzled layout whose padded
// width is padded_kblocks (a multiple of 4): 512-byte tiles of 128 rows x 4 columns.
__device__ __forceinline__ size_t fp4_swizzled_offset(unsigned m, unsigned k, unsigned padded_kblocks) {
    return ((size_t)(m >> 7) * (padded_kblocks >> 2) + (k >> 2)) * 512 + (m & 31) * 16 + ((m & 127) >> 5) * 4 + (k & 3);
}
