// NVFP4 quantization kernels: amax -> global encode scale on the device, quantize reading the
// scale from device memory, the single-launch fused amax+quantize, the fused deinterleave +
// SwiGLU(+clamp) + amax + quantize, and dequantize. Bit for bit fp4kit/reference/quant.py.
//
// Arguments (all row-major, contiguous, 16-byte aligned):
//   x        T [rows, K]                   bf16 / fp16 / fp32 input, K = 16 * kblocks
//   h        T [rows, 2I]                  fused gate|up input of the SwiGLU kernels, I = 16 * kblocks
//   packed   uint8 [rows, K/2]             E2M1 codes, element 2i in the low nibble
//   scales   uint8 [rows, kblocks]         linear E4M3 block scales, or when swizzled the flat
//                                          128x4-tiled buffer of round_up(rows,128) x padded_kblocks
//   global_scale / scale_out  fp32 [1]     encode scale S = 2688 / amax
//   amax_out fp32 [1]
//   partials uint32 [gridDim.x]            per-block maxima (scratch, overwritten each launch)
//   status   uint32 [1]                    FP4_STATUS_NONFINITE_INPUT is or-ed in on a NaN/Inf input
//
// Launch geometry: 1-D grids of kThreads threads, grid-stride over 16-element blocks, one block
// per thread per step. The module is loaded for cooperative launch: the amax kernels reduce
// per-block maxima across the whole grid with cooperative_groups grid.sync(), so the host sizes
// every grid to at most the co-resident block count. When every 16-element block fits in one
// pass of the grid (decode sizes), each thread keeps its block in registers across the barrier.
#include <cooperative_groups.h>

#include "common/nvfp4.cuh"

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kMinBlocksPerSM = 4;  // <= 64 registers: 1024 threads per SM keep enough loads in flight

// Max over the thread block; every thread gets the result.
__device__ __forceinline__ unsigned block_max(unsigned v) {
    __shared__ unsigned warp_max[kThreads / 32];
    v = __reduce_max_sync(0xFFFFFFFFu, v);
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = v;
    __syncthreads();
    v = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
    if (threadIdx.x < 32) v = __reduce_max_sync(0xFFFFFFFFu, v);
    __shared__ unsigned result;
    if (threadIdx.x == 0) result = v;
    __syncthreads();
    v = result;
    __syncthreads();  // warp_max and result are reused by the next call
    return v;
}

// Sources produce the fp32 values of output block b in two steps, so that the loop can issue the
// loads of the next block before it encodes the current one: fetch (global loads into registers)
// and expand (to fp32, plus the SwiGLU arithmetic). Block indices are 32-bit: the host checks
// that rows * kblocks < 2**31.
template <typename T>
struct PlainSource {
    using Raw = Fp4Raw16<T>;
    const T* x;
    __device__ __forceinline__ Raw fetch(unsigned b) const { return fp4_fetch16(x + (size_t)b * FP4_BLOCK); }
    __device__ __forceinline__ void expand(const Raw& r, unsigned, float v[FP4_BLOCK]) const { fp4_expand16(r, v); }
    // max |value| of a block as fp32 bits: from the fetched words, or from its expanded values
    __device__ __forceinline__ unsigned abs_max_bits(const Raw& r, unsigned) const { return fp4_raw_abs_max_bits(r); }
    __device__ __forceinline__ unsigned abs_max_bits(const Raw& r, const float*) const { return fp4_raw_abs_max_bits(r); }
};

template <typename T, bool kInterleaved>
struct SwigluSource {
    struct Raw {
        Fp4Raw16<T> gate, up;
    };
    const T* h;
    const float* row_scale;  // nullptr: no per-row factor
    float limit;             // gate <= limit, up in [-limit, limit]; no clamp when has_limit == 0
    int has_limit;
    unsigned kblocks;        // output blocks per row

    __device__ __forceinline__ Raw fetch(unsigned b) const {
        const unsigned row = b / kblocks, kb = b % kblocks;
        const T* base = h + (size_t)row * kblocks * 2 * FP4_BLOCK;
        // interleaved: 16 gate then 16 up per 32-element chunk; concatenated: [gate | up]
        const T* gate = kInterleaved ? base + kb * 2 * FP4_BLOCK : base + kb * FP4_BLOCK;
        const T* up = kInterleaved ? gate + FP4_BLOCK : base + (size_t)(kblocks + kb) * FP4_BLOCK;
        return Raw{fp4_fetch16(gate), fp4_fetch16(up)};
    }

    __device__ __forceinline__ void expand(const Raw& r, unsigned b, float v[FP4_BLOCK]) const {
        float g[FP4_BLOCK], u[FP4_BLOCK];
        fp4_expand16(r.gate, g);
        fp4_expand16(r.up, u);
        const float rs = row_scale ? fp4_ftz(row_scale[b / kblocks]) : 1.0f;
#pragma unroll
        for (int i = 0; i < FP4_BLOCK; ++i) {
            v[i] = fp4_swiglu(g[i], u[i], limit, has_limit);
            if (row_scale) v[i] = __fmul_rn(v[i], rs);
        }
    }

    __device__ __forceinline__ unsigned abs_max_bits(const Raw&, const float v[FP4_BLOCK]) const {
        return fp4_block_abs_max_bits(v);
    }
    __device__ __forceinline__ unsigned abs_max_bits(const Raw& r, unsigned b) const {
        float v[FP4_BLOCK];
        expand(r, b, v);
        return fp4_block_abs_max_bits(v);
    }
};

struct QuantOut {
    unsigned char* packed;
    unsigned char* scales;
    unsigned rows;
    unsigned kblocks;
    int swizzled;
    unsigned padded_kblocks;
};

// The 128x4 layout is padded to whole tiles; GEMMs read the padding, so it must be zero.
__device__ void zero_swizzle_padding(const QuantOut& o, unsigned first, unsigned stride) {
    const unsigned padded_rows = (o.rows + 127) / 128 * 128;
    for (unsigned p = first; p < padded_rows * o.padded_kblocks; p += stride) {
        const unsigned m = p / o.padded_kblocks, k = p % o.padded_kblocks;
        if (m >= o.rows || k >= o.kblocks) o.scales[fp4_swizzled_offset(m, k, o.padded_kblocks)] = 0;
    }
}

__device__ __forceinline__ void store_block(const QuantOut& o, unsigned b, const float v[FP4_BLOCK], unsigned vmax_bits,
                                            float s) {
    uint2 codes;
    const unsigned sf = fp4_encode_block(v, vmax_bits, s, codes);
    reinterpret_cast<uint2*>(o.packed)[b] = codes;
    const size_t at = o.swizzled ? fp4_swizzled_offset(b / o.kblocks, b % o.kblocks, o.padded_kblocks) : b;
    o.scales[at] = (unsigned char)sf;
}

// kAmax: reduce max|value| over the grid, derive S, write amax_out / scale_out.
// kQuantize: quantize with S (from the reduction, or read from static_scale).
template <bool kAmax, bool kQuantize, class Source>
__device__ void amax_quantize(const Source& src, unsigned nblocks, const QuantOut& o, const float* static_scale,
                              float* amax_out, float* scale_out, unsigned* partials, unsigned* status) {
    const unsigned stride = gridDim.x * blockDim.x;
    const unsigned first = blockIdx.x * blockDim.x + threadIdx.x;
    const bool resident = nblocks <= stride;  // at most one block per thread: keep it in registers
    float v[FP4_BLOCK];
    unsigned vmax_bits = 0;
    float s;
    if (kAmax) {
        unsigned m = 0;
        unsigned b = first;
        for (; b + stride < nblocks; b += 2 * stride) {  // two blocks per step: more loads in flight
            const typename Source::Raw r0 = src.fetch(b), r1 = src.fetch(b + stride);
            m = max(m, max(src.abs_max_bits(r0, b), src.abs_max_bits(r1, b + stride)));
        }
        if (b < nblocks) {  // when resident, this is the thread's only block: v keeps it
            const typename Source::Raw r = src.fetch(b);
            src.expand(r, b, v);
            vmax_bits = src.abs_max_bits(r, v);
            m = max(m, vmax_bits);
        }
        m = block_max(m);
        if (threadIdx.x == 0) partials[blockIdx.x] = m;
        cg::this_grid().sync();
        unsigned a = 0;
        for (int i = threadIdx.x; i < gridDim.x; i += blockDim.x) a = max(a, __ldcg(partials + i));
        a = block_max(a);
        if (a < 0x00800000u) a = 0;  // a subnormal maximum flushes to zero, as in the reference
        const float amax = __uint_as_float(a);
        s = fp4_global_scale_from_amax(amax);
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            *amax_out = amax;
            *scale_out = s;
            if (a >= 0x7F800000u) atomicOr(status, FP4_STATUS_NONFINITE_INPUT);
        }
    } else {
        s = *static_scale;
        // a static encode scale is data: one outside (0, FLT_MAX] is recorded like a non-finite input
        if (blockIdx.x == 0 && threadIdx.x == 0 && !(s > 0.0f && s <= FP4_FLT_MAX))
            atomicOr(status, FP4_STATUS_NONFINITE_INPUT);
    }
    if (!kQuantize) return;
    if (kAmax && resident) {
        if (first < nblocks) store_block(o, first, v, vmax_bits, s);
    } else {
        // software pipeline: the loads of block b + stride are in flight while block b is encoded
        typename Source::Raw next;
        if (first < nblocks) next = src.fetch(first);
        for (unsigned b = first; b < nblocks; b += stride) {
            const typename Source::Raw cur = next;
            if (b + stride < nblocks) next = src.fetch(b + stride);
            src.expand(cur, b, v);
            vmax_bits = src.abs_max_bits(cur, v);
            if (!kAmax && vmax_bits >= 0x7F800000u) atomicOr(status, FP4_STATUS_NONFINITE_INPUT);
            store_block(o, b, v, vmax_bits, s);
        }
    }
    if (o.swizzled) zero_swizzle_padding(o, first, stride);
}

#define FP4_QUANT_ARGS                                                                                    \
    unsigned char *packed, unsigned char *scales, unsigned rows, unsigned kblocks, int swizzled,          \
        unsigned padded_kblocks, unsigned *status
#define FP4_QUANT_OUT QuantOut{packed, scales, rows, kblocks, swizzled, padded_kblocks}

#define FP4_DEFINE_QUANT(SUFFIX, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)                                                \
        amax_##SUFFIX(const T* x, unsigned nblocks, float* amax_out, float* scale_out, unsigned* partials, \
                      unsigned* status) {                                                                 \
        amax_quantize<true, false>(PlainSource<T>{x}, nblocks, QuantOut{}, nullptr, amax_out, scale_out,  \
                                   partials, status);                                                     \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) amax_quantize_##SUFFIX(                       \
        const T* x, float* amax_out, float* scale_out, unsigned* partials, FP4_QUANT_ARGS) {              \
        amax_quantize<true, true>(PlainSource<T>{x}, rows * kblocks, FP4_QUANT_OUT, nullptr, amax_out,    \
                                  scale_out, partials, status);                                           \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)                                                \
        quantize_##SUFFIX(const T* x, const float* global_scale, FP4_QUANT_ARGS) {                        \
        amax_quantize<false, true>(PlainSource<T>{x}, rows * kblocks, FP4_QUANT_OUT, global_scale,        \
                                   nullptr, nullptr, nullptr, status);                                    \
    }

#define FP4_DEFINE_SWIGLU(SUFFIX, T, INTERLEAVED)                                                         \
    extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) swiglu_amax_quantize_##SUFFIX(                \
        const T* h, const float* row_scale, float limit, int has_limit, float* amax_out, float* scale_out, \
        unsigned* partials, FP4_QUANT_ARGS) {                                                             \
        const SwigluSource<T, INTERLEAVED> src{h, row_scale, limit, has_limit, kblocks};                  \
        amax_quantize<true, true>(src, rows * kblocks, FP4_QUANT_OUT, nullptr, amax_out, scale_out,       \
                                  partials, status);                                                      \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) swiglu_quantize_##SUFFIX(                     \
        const T* h, const float* row_scale, float limit, int has_limit, const float* global_scale,        \
        FP4_QUANT_ARGS) {                                                                                 \
        const SwigluSource<T, INTERLEAVED> src{h, row_scale, limit, has_limit, kblocks};                  \
        amax_quantize<false, true>(src, rows * kblocks, FP4_QUANT_OUT, global_scale, nullptr, nullptr,    \
                                   nullptr, status);                                                      \
    }

// SwiGLU alone, rounded to bf16: the down-projection input of the W4A16 path (and the unfused
// reference path of the MoE). One 16-element output block per thread per step.
#define FP4_DEFINE_SWIGLU_BF16(SUFFIX, T, INTERLEAVED)                                                    \
    extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) swiglu_##SUFFIX(              \
        const T* h, const float* row_scale, float limit, int has_limit, __nv_bfloat16* out, unsigned rows, \
        unsigned kblocks) {                                                                               \
        const SwigluSource<T, INTERLEAVED> src{h, row_scale, limit, has_limit, kblocks};                  \
        float v[FP4_BLOCK];                                                                               \
        for (unsigned b = blockIdx.x * blockDim.x + threadIdx.x; b < rows * kblocks; b += gridDim.x * blockDim.x) { \
            src.expand(src.fetch(b), b, v);                                                               \
            fp4_store16(out + (size_t)b * FP4_BLOCK, v);                                                  \
        }                                                                                                 \
    }

FP4_DEFINE_QUANT(bf16, __nv_bfloat16)
FP4_DEFINE_QUANT(f16, __half)
FP4_DEFINE_QUANT(f32, float)
FP4_DEFINE_SWIGLU(bf16_interleaved, __nv_bfloat16, true)
FP4_DEFINE_SWIGLU(f16_interleaved, __half, true)
FP4_DEFINE_SWIGLU(f32_interleaved, float, true)
FP4_DEFINE_SWIGLU(bf16_concatenated, __nv_bfloat16, false)
FP4_DEFINE_SWIGLU(f16_concatenated, __half, false)
FP4_DEFINE_SWIGLU(f32_concatenated, float, false)
FP4_DEFINE_SWIGLU_BF16(bf16_interleaved, __nv_bfloat16, true)
FP4_DEFINE_SWIGLU_BF16(f16_interleaved, __half, true)
FP4_DEFINE_SWIGLU_BF16(f32_interleaved, float, true)
FP4_DEFINE_SWIGLU_BF16(bf16_concatenated, __nv_bfloat16, false)
FP4_DEFINE_SWIGLU_BF16(f16_concatenated, __half, false)
FP4_DEFINE_SWIGLU_BF16(f32_concatenated, float, false)

// out = e2m1 * (fp32(scale) / S), one 16-element block per thread per step.
template <typename T>
__device__ void dequantize_blocks(const unsigned char* packed, const unsigned char* scales, const float* global_scale,
                                  T* out, unsigned rows, unsigned kblocks, int swizzled, unsigned padded_kblocks,
                                  unsigned* status) {
    const unsigned nblocks = rows * kblocks;
    const float s = fp4_ftz(*global_scale);
    if (blockIdx.x == 0 && threadIdx.x == 0 && !(s > 0.0f && s <= FP4_FLT_MAX)) atomicOr(status, FP4_STATUS_NONFINITE_INPUT);
    for (unsigned b = blockIdx.x * blockDim.x + threadIdx.x; b < nblocks; b += gridDim.x * blockDim.x) {
        const uint2 codes = reinterpret_cast<const uint2*>(packed)[b];
        const size_t at = swizzled ? fp4_swizzled_offset(b / kblocks, b % kblocks, padded_kblocks) : b;
        const float decode = __fdiv_rn(fp4_e4m3_value(scales[at]), s);
        float v[FP4_BLOCK];
#pragma unroll
        for (int i = 0; i < FP4_BLOCK; ++i)
            v[i] = __fmul_rn(fp4_e2m1_value(((i < 8 ? codes.x : codes.y) >> (4 * (i % 8))) & 0xFu), decode);
        fp4_store16(out + (size_t)b * FP4_BLOCK, v);
    }
}

#define FP4_DEFINE_DEQUANT(SUFFIX, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)                               \
        dequantize_##SUFFIX(const unsigned char* packed, const unsigned char* scales, const float* global_scale, \
                            T* out, unsigned rows, unsigned kblocks, int swizzled, unsigned padded_kblocks, \
                            unsigned* status) {                                                           \
        dequantize_blocks(packed, scales, global_scale, out, rows, kblocks, swizzled, padded_kblocks, status); \
    }

FP4_DEFINE_DEQUANT(bf16, __nv_bfloat16)
FP4_DEFINE_DEQUANT(f16, __half)
FP4_DEFINE_DEQUANT(f32, float)

extern "C" __global__ void global_scale_from_amax(const float* amax, float* scale_out, unsigned* status) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        // the sign is tested on the stored bits: an amax is |x|, so even -0.0 is not one
        const unsigned bits = *reinterpret_cast<const unsigned*>(amax);
        const float a = __uint_as_float(bits);
        *scale_out = fp4_global_scale_from_amax(a);
        if ((bits & 0x7FFFFFFFu) > 0x7F7FFFFFu || (bits >> 31)) atomicOr(status, FP4_STATUS_NONFINITE_INPUT);
    }
}
