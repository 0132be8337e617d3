// NVFP4 GEMM on Hopper, which has no FP4 tensor cores: y[M, N] = alpha * A @ W^T (+ bias).
// The weight is dequantized to bf16 in registers (e2m1 * fp32(block scale) is exact in bf16) and
// multiplied on the bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation).
//
// Arguments (row-major, contiguous):
//   w_packed   uint8 [N, K/2]     E2M1 codes, element 2i in the low nibble; w_scales uint8 [N, K/16] (linear E4M3)
//   w_global   fp32 [1]           encode scale S_w; or w_row_decode fp32 [N]: a decode factor per output row
//                                 (fused weights whose shards had different global scales)
//   act        bf16 [M, K] (W4A16), or uint8 [M, K/2] with act_scales uint8 [M, K/16] and act_global fp32 [1]
//              (W4A4: the activation quantized by quant.cu)
//   bias       fp32 or bf16 [N], optional;  out  bf16 or fp32 [M, N]
//   alpha = (w_row_decode[n] or 1/S_w) * (1/S_a for W4A4), computed on the device.
//
// gemm_decode_*: small M; larger M loops over groups of 8 * kTokenTiles tokens, re-reading the weight. "Swap AB": weight rows are the MMA's M dimension (16
// per block), tokens its N dimension (8 per tile), so one pass streams the weight once. Launch: grid
// ceil(N/16) blocks of 8 warps; warp w takes the 128-wide K chunks w, w+8, ...; partial sums are
// reduced across warps in shared memory (deterministic). The dot product does not depend on the
// order of k, so each thread reads 16 contiguous weight bytes per row (32 k) and the activation is
// read in the same permuted order: nibbles (i, i+4) of a 32-bit word form one bf16x2 operand.
//
// Nibble to bf16: (q & 0x80008000) | ((q >> 6) & 0x01C001C0) turns the nibbles at bits 12-15 and
// 28-31 into bf16 values e2m1 * 2^-126 (0.5 becomes a subnormal, exact; bf16 arithmetic keeps
// subnormals). One bf16x2 multiply by fp32(scale) * 2^100 gives e2m1 * scale * 2^-26, a normal bf16,
// exactly; the epilogue multiplies by 2^26 per dequantized operand.
//
// dequantize_unscaled_bf16 / epilogue_*: the large-M path dequantizes into a bf16 workspace for a
// cuBLAS bf16 GEMM with fp32 output, then applies alpha, bias and the output cast.
#include "common/gemm_decode.cuh"

#define FP4_GEMM_EPILOGUE_ARGS                                                                            \
    const float *w_global, const float *w_row_decode, const void *bias, int bias_kind, void *out, int out_f32, \
        unsigned M, unsigned N, unsigned K

#define FP4_DEFINE_GEMM_DECODE(TILES)                                                                     \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) gemm_decode_bf16_##TILES(                   \
        const unsigned char* w_packed, const unsigned char* w_scales, const __nv_bfloat16* act,           \
        FP4_GEMM_EPILOGUE_ARGS) {                                                                         \
        for (unsigned m0 = 0; m0 < M; m0 += 8 * TILES) {                                                 \
            Epilogue ep{w_global, w_row_decode, nullptr, bias, bias_kind, out, out_f32};                  \
            ep.out_row_base = m0;                                                                         \
            gemm_decode<TILES>(w_packed, w_scales, ActBf16{act, RowMap{nullptr, m0}}, ep, min(M - m0, 8u * TILES), N, K); \
        }                                                                                                 \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) gemm_decode_nvfp4_##TILES(                  \
        const unsigned char* w_packed, const unsigned char* w_scales, const unsigned char* act_packed,    \
        const unsigned char* act_scales, const float* act_global, FP4_GEMM_EPILOGUE_ARGS) {               \
        for (unsigned m0 = 0; m0 < M; m0 += 8 * TILES) {                                                 \
            Epilogue ep{w_global, w_row_decode, act_global, bias, bias_kind, out, out_f32};               \
            ep.out_row_base = m0;                                                                         \
            gemm_decode<TILES>(w_packed, w_scales, ActNvfp4{act_packed, act_scales, RowMap{nullptr, m0}}, ep, \
                               min(M - m0, 8u * TILES), N, K);                                            \
        }                                                                                                 \
    }

FP4_DEFINE_GEMM_DECODE(1)
FP4_DEFINE_GEMM_DECODE(2)
FP4_DEFINE_GEMM_DECODE(4)
FP4_DEFINE_GEMM_DECODE(8)

// e2m1 * fp32(scale) as bf16 [rows, K] (exact), the operand of the large-M cuBLAS path. One
// 16-element block per thread per step.
extern "C" __global__ void __launch_bounds__(256) dequantize_unscaled_bf16(const unsigned char* packed,
                                                                           const unsigned char* scales,
                                                                           __nv_bfloat16* out, unsigned rows,
                                                                           unsigned kblocks) {
    const size_t nblocks = (size_t)rows * kblocks;
    for (size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks; b += (size_t)gridDim.x * blockDim.x) {
        const uint2 codes = reinterpret_cast<const uint2*>(packed)[b];
        const float sf = fp4_e4m3_value(scales[b]);
        float v[FP4_BLOCK];
#pragma unroll
        for (int i = 0; i < FP4_BLOCK; ++i)
            v[i] = __fmul_rn(fp4_e2m1_value(((i < 8 ? codes.x : codes.y) >> (4 * (i % 8))) & 0xFu), sf);
        fp4_store16(out + b * FP4_BLOCK, v);
    }
}

// out[m, n] = acc[m, n] * alpha(n) (+ bias[n]), acc fp32 [M, N] from cuBLAS.
extern "C" __global__ void __launch_bounds__(256) gemm_epilogue(const float* acc, const float* act_global,
                                                                FP4_GEMM_EPILOGUE_ARGS) {
    Epilogue ep{w_global, w_row_decode, act_global, bias, bias_kind, out, out_f32};
    ep.init();
    const size_t total = (size_t)M * N;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const unsigned n = (unsigned)(i % N);
        ep.store(i, n, __fmul_rn(acc[i], ep.alpha(n, 1.0f)));
    }
}

// alpha_beta[0] = alpha (w_row_decode unused), alpha_beta[1] = 0: device-side alpha and beta for a
// cuBLAS call in device pointer mode, so no host ever reads the global scales.
extern "C" __global__ void gemm_alpha(const float* w_global, const float* act_global, float* alpha_beta) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        Epilogue ep{w_global, nullptr, act_global, nullptr, 0, nullptr, 0};
        ep.init();
        alpha_beta[0] = ep.alpha(0, 1.0f);
        alpha_beta[1] = 0.0f;
    }
}
