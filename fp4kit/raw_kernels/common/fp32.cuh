// fp32 helpers whose results the numpy reference (fp4kit/reference/fp32.py) reproduces bit for
// bit. Every operation is a single correctly rounded __f*_rn call, so the compiler cannot fuse a
// multiply and an add into an FMA; CuPy compiles with -ftz=true, so subnormals flush to zero.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define FP4_FLT_MAX 3.402823466e+38f
#define FP4_FLT_MIN 1.175494351e-38f

// Flush a subnormal to a zero of the same sign. The -ftz arithmetic does this on every
// operation already; loads and comparisons go through it explicitly so nothing depends on
// which instruction the compiler picks.
__device__ __forceinline__ float fp4_ftz(float v) {
    return fabsf(v) < FP4_FLT_MIN ? copysignf(0.0f, v) : v;
}

__device__ __forceinline__ float fp4_to_float(float v) { return v; }
__device__ __forceinline__ float fp4_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float fp4_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T fp4_from_float(float v);
template <> __device__ __forceinline__ float fp4_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half fp4_from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 fp4_from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// 2**k as fp32 for k in [-126, 127], from its bits.
__device__ __forceinline__ float fp4_pow2(int k) { return __uint_as_float((unsigned)(k + 127) << 23); }

// exp(x): 2**k * p(r), r = x - k*ln2 with ln2 split so that k*LN2_HI is exact, p of degree 7.
// The input is clamped to [-104, 89]: below, the result flushes to zero; above, it overflows.
// A NaN input becomes -104 (fmaxf drops NaN); callers keep NaN through their own arithmetic.
__device__ __forceinline__ float fp4_exp(float x) {
    x = fminf(fmaxf(fp4_ftz(x), -104.0f), 89.0f);
    const int k = __float2int_rn(__fmul_rn(x, 1.44269504088896341f));
    const float kf = (float)k;
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(kf, 0.693145751953125f)), __fmul_rn(kf, 1.42860682030941723e-06f));
    float p = 1.0f / 5040.0f;
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 720.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 120.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 24.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 6.0f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    const int k1 = k >> 1;  // two normal powers of two cover k in [-150, 128]
    return __fmul_rn(__fmul_rn(p, fp4_pow2(k1)), fp4_pow2(k - k1));
}

__device__ __forceinline__ float fp4_silu(float g) {
    g = fp4_ftz(g);
    return __fdiv_rn(g, __fadd_rn(1.0f, fp4_exp(-g)));
}

// SwiGLU of one gate/up pair, silu(gate) * up, with DeepSeek-V4's optional clamp (gate <= limit,
// up in [-limit, limit]; the comparisons keep a NaN a NaN). Every SwiGLU of the kernels is this one.
__device__ __forceinline__ float fp4_swiglu(float g, float u, float limit, int has_limit) {
    if (has_limit) {
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
    }
    return __fmul_rn(fp4_silu(g), u);
}
