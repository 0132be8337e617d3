// NVFP4 GEMM on Hopper, which has no FP4 tensor cores: y[M, N] = alpha * A @ W^T (+ bias), with W
// in the tiled weight layout (fp4kit/formats.py `to_tiled`). The method is in common/gemm_engine.cuh.
//
// Arguments (row-major, contiguous):
//   w_codes    uint8 tiled codes, [N/16 * K/64 * 512];  w_scales uint8 tiled E4M3 scales [N/16 * K/256 * 256]
//   w_global   fp32 [1]           encode scale S_w; or row_decode fp32 [N]: a decode factor per output row
//                                 (fused weights whose shards had different global scales)
//   act        bf16 [M, K] (W4A16), or uint8 [M, K/2] with act_scales uint8 [M, K/16] and act_global fp32 [1]
//              (W4A4: the activation quantized by quant.cu, linear layout)
//   bias       fp32 or bf16 [N], optional;  out  bf16 or fp32 [M, N]
//   alpha = (row_decode[n] or 1/S_w) * (1/S_a for W4A4), computed on the device.
//
// gemm_tiled_<T>x<R>[f8]_{bf16,nvfp4} (mma.sync) and gemm_wgmma_<T>x<R>[_c<C>] (warpgroup MMA,
//   sm_90a, on the window images of gemm_stage_<T>_{bf16,nvfp4}, below): T token tiles of 8 rows,
//   R row tiles of 16 weight rows per warp, f8: 8 weight tiles per fetch. Grid (ceil(N / (128 R)), splits[, token chunks]), 256 threads, dynamic
//   shared memory gemm.py `shared_bytes`. With splits > 1, block (i, s) covers tiles
//   [s * chunks_per_split, ...) of K; the blocks of row group i meet through counters[i] (zero on
//   entry, zero again on exit) and partials [splits][M][N rounded to 16], or, with _c<C>, as one
//   cluster of C blocks (grid y = C) through distributed shared memory.
//
// dequantize_tiled_unscaled_bf16 / dequantize_unscaled_bf16 / gemm_epilogue: the large-M path
// dequantizes the weight (and an NVFP4 activation) exactly into bf16 workspaces for a cuBLAS bf16
// GEMM with fp32 output, then applies alpha, bias and the output cast.
#include "common/gemm_engine.cuh"
#include "common/gemv.cuh"
#include "common/pdl.cuh"

using namespace gemm;

#define FP4_GEMM_EPILOGUE_ARGS                                                                            \
    const float *w_global, const float *row_decode, const void *bias, int bias_kind, void *out, int out_f32, \
        unsigned M, unsigned N, unsigned K, const unsigned *out_parts

// The epilogue of a kernel with FP4_GEMM_EPILOGUE_ARGS (out_parts: column blocks of M rows, or null).
__device__ __forceinline__ Epilogue kernel_epilogue(const float* w_global, const float* row_decode,
                                                    const float* act_global, const void* bias, int bias_kind,
                                                    void* out, int out_f32, const unsigned* out_parts, unsigned M) {
    Epilogue ep{w_global, row_decode, act_global, bias, bias_kind, out, out_f32};
    ep.out_parts = out_parts;
    ep.out_rows = M;
    return ep;
}
#define FP4_EPILOGUE kernel_epilogue(w_global, row_decode, act_global, bias, bias_kind, out, out_f32, out_parts, M)

#define FP4_GEMM_SPLIT_ARGS float *partials, unsigned *counters, unsigned splits, unsigned chunks_per_split

// The kernels on gemm_block<R, F, C> that stage their activation themselves: bf16 (act_global: nullptr,
// or the NVFP4 global scale of an activation the host dequantized exactly first) and NVFP4. C > 1 is
// a cluster of the C split blocks of a row group (grid y = C) that reduce through distributed
// shared memory.
#define FP4_DEFINE_GEMM_BF16(NAME, WINDOW, R, F, C, MIN_BLOCKS, ATTRS, M0, SPLIT)                         \
    extern "C" __global__ void ATTRS __launch_bounds__(kThreads, MIN_BLOCKS) gemm_##NAME##_bf16(          \
        const uint4* w_codes, const uint2* w_scales, const __nv_bfloat16* act, const float* act_global,   \
        FP4_GEMM_EPILOGUE_ARGS, FP4_GEMM_SPLIT_ARGS) {                                                    \
        Epilogue ep = FP4_EPILOGUE;                                                                       \
        ep.out_row_base = M0;                                                                             \
        gemm_block<R, F, C, true>(w_codes, w_scales, ActBf16<WINDOW>{act, RowMap{nullptr, M0}}, ep,              \
                            min(M - (M0), 8u * WINDOW::kTiles), N, K, blockIdx.x, blockIdx.y, SPLIT);    \
    }
#define FP4_DEFINE_GEMM_KERNELS(NAME, WINDOW, R, F, C, MIN_BLOCKS, ATTRS, M0, SPLIT)                      \
    FP4_DEFINE_GEMM_BF16(NAME, WINDOW, R, F, C, MIN_BLOCKS, ATTRS, M0, SPLIT)                             \
    extern "C" __global__ void ATTRS __launch_bounds__(kThreads, MIN_BLOCKS) gemm_##NAME##_nvfp4(         \
        const uint4* w_codes, const uint2* w_scales, const unsigned char* act_packed,                     \
        const unsigned char* act_scales, const float* act_global, FP4_GEMM_EPILOGUE_ARGS,                 \
        FP4_GEMM_SPLIT_ARGS) {                                                                            \
        Epilogue ep = FP4_EPILOGUE;                                                                       \
        ep.out_row_base = M0;                                                                             \
        gemm_block<R, F, C, true>(w_codes, w_scales, ActNvfp4<WINDOW>{act_packed, act_scales, RowMap{nullptr, M0}}, ep, \
                            min(M - (M0), 8u * WINDOW::kTiles), N, K, blockIdx.x, blockIdx.y, SPLIT);    \
    }

#define FP4_SPLIT (SplitK{partials, counters, splits, chunks_per_split})  // parenthesized: forwarded as one macro argument
#define FP4_CLUSTER(C) __cluster_dims__(1, C, 1)

// mma.sync kernels gemm_tiled_<T>x<R>[f8]_{bf16,nvfp4}: T token tiles (M <= 8T), R row tiles per warp,
// weight tiles fetched 4 (or 8) at a time.
#define FP4_DEFINE_GEMM_TILED(T, R, F, NAME) FP4_DEFINE_GEMM_KERNELS(tiled_##NAME, Window<T>, R, F, 0, 2, , 0, FP4_SPLIT)

FP4_DEFINE_GEMM_TILED(1, 1, 4, 1x1)
FP4_DEFINE_GEMM_TILED(1, 2, 4, 1x2)
FP4_DEFINE_GEMM_TILED(1, 1, 8, 1x1f8)
FP4_DEFINE_GEMM_TILED(2, 1, 4, 2x1)
FP4_DEFINE_GEMM_TILED(2, 2, 4, 2x2)
FP4_DEFINE_GEMM_TILED(2, 1, 8, 2x1f8)
FP4_DEFINE_GEMM_TILED(4, 1, 4, 4x1)
FP4_DEFINE_GEMM_TILED(8, 1, 4, 8x1)

// The decode-size kernels gemm_gemv_<RT>f<F>[w16]_{bf16,nvfp4} (M <= 8, common/gemv.cuh): RT row
// tiles per block, the K range split over its W / RT warps per row tile (W = 8, or 16 with "w16"),
// F weight tiles per fetch. Grid (ceil(N / (16 RT)), splits), 32 W threads, dynamic shared memory
// gemm.py `gemv_shared_bytes`; the same arguments as the tiled kernels, and for bf16 the
// activation's row stride (0: K) and the weight rows per group of a grouped GEMM (0: none; gemm.py
// `gemm_grouped`); last, `release`: let the next kernel launch once the first weights are in flight
// (a single-wave grid only: gemm.py `GEMV_EARLY_RELEASE`).
#define FP4_DEFINE_GEMV_W(RT, F, W, NAME) FP4_DEFINE_GEMV_KERNELS(RT, F, W, false, false, false, NAME)
#define FP4_DEFINE_GEMV_KERNELS(RT, F, W, WHOLE, RES, PIPE, NAME)                                                       \
    extern "C" __global__ void __launch_bounds__(32 * W, 16 / W) gemm_gemv_##NAME##_bf16(                      \
        const uint4* w_codes, const uint2* w_scales, const __nv_bfloat16* act, const float* act_global,        \
        FP4_GEMM_EPILOGUE_ARGS, FP4_GEMM_SPLIT_ARGS, unsigned act_ld, unsigned group_rows, int release) {      \
        Epilogue ep = FP4_EPILOGUE;                                                                            \
        gemv_block<RT, F, WarpActBf16<F>, W, WHOLE, RES, PIPE>(w_codes, w_scales, WarpActBf16<F>{act, act_ld, group_rows}, \
                                                    ep, M, N, K, blockIdx.x, blockIdx.y, FP4_SPLIT, release);  \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * W, 16 / W) gemm_gemv_##NAME##_nvfp4(                     \
        const uint4* w_codes, const uint2* w_scales, const unsigned char* act_packed,                          \
        const unsigned char* act_scales, const float* act_global, FP4_GEMM_EPILOGUE_ARGS, FP4_GEMM_SPLIT_ARGS,  \
        int release) {                                                                                         \
        Epilogue ep = FP4_EPILOGUE;                                                                              \
        gemv_block<RT, F, WarpActNvfp4<F>, W, WHOLE, RES, PIPE>(w_codes, w_scales,                                      \
                                                     WarpActNvfp4<F>{act_packed, act_scales, nullptr}, ep, M, N, K, \
                                                     blockIdx.x, blockIdx.y, FP4_SPLIT, release);              \
    }
#define FP4_DEFINE_GEMV(RT, F) FP4_DEFINE_GEMV_W(RT, F, 8, RT##f##F)

FP4_DEFINE_GEMV(1, 4)
FP4_DEFINE_GEMV(2, 4)
FP4_DEFINE_GEMV(4, 4)
FP4_DEFINE_GEMV(8, 4)
FP4_DEFINE_GEMV(1, 8)
FP4_DEFINE_GEMV(2, 8)
FP4_DEFINE_GEMV(4, 8)
FP4_DEFINE_GEMV(8, 8)
FP4_DEFINE_GEMV_W(1, 4, 16, 1f4w16)
FP4_DEFINE_GEMV_W(1, 8, 16, 1f8w16)
// "whole": the mainloop without per-tile bounds tests, for K of whole scale groups (gemm.py
// `GEMV_WHOLE_FETCHES`; 4-tile fetches only)
FP4_DEFINE_GEMV_KERNELS(1, 4, 8, true, false, false, 1f4whole)
FP4_DEFINE_GEMV_KERNELS(2, 4, 8, true, false, false, 2f4whole)
FP4_DEFINE_GEMV_KERNELS(4, 4, 8, true, false, false, 4f4whole)
FP4_DEFINE_GEMV_KERNELS(8, 4, 8, true, false, false, 8f4whole)
FP4_DEFINE_GEMV_KERNELS(1, 4, 16, true, false, false, 1f4w16whole)
// "res": whole fetches against an activation staged once, before the mainloop, and resident in
// shared memory: by the block for its warps with 2+ row tiles, else by each warp for its K slice
// (gemm.py `GEMV_RESIDENT_ACTIVATION`)
FP4_DEFINE_GEMV_KERNELS(1, 4, 8, true, true, false, 1f4res)
FP4_DEFINE_GEMV_KERNELS(2, 4, 8, true, true, false, 2f4res)
FP4_DEFINE_GEMV_KERNELS(4, 4, 8, true, true, false, 4f4res)
FP4_DEFINE_GEMV_KERNELS(8, 4, 8, true, true, false, 8f4res)
FP4_DEFINE_GEMV_KERNELS(1, 4, 16, true, true, false, 1f4w16res)
// "resp": the per-warp resident activation with a wait per group (gemm.py `GEMV_RESIDENT_PIPELINED`)
FP4_DEFINE_GEMV_KERNELS(1, 4, 8, true, true, true, 1f4resp)
FP4_DEFINE_GEMV_KERNELS(1, 4, 16, true, true, true, 1f4w16resp)

// The split-K scratch of this block's token chunk (blockIdx.z).
__device__ __forceinline__ SplitK chunk_split(float* partials, unsigned* counters, unsigned splits,
                                              unsigned chunks_per_split, unsigned chunk_tokens, unsigned N) {
    const size_t ld = (N + 15) / 16 * 16;
    return SplitK{partials + blockIdx.z * splits * chunk_tokens * ld, counters + blockIdx.z * gridDim.x, splits,
                  chunks_per_split};
}

// The warpgroup-MMA (wgmma) kernels gemm_wgmma_<T>x<R>[_c<C>]: T in {2, 4, 8, 16} token tiles (8T
// tokens per block), R row tiles per warp (128 R rows per block, R MMAs m64n<8T>k16 per warpgroup
// and step). Their activation is the window images of gemm_stage_<T>_{bf16,nvfp4} (`image`, per
// token chunk [windows][WgmmaWindow<T>::kBytes]), with act_global for W4A4 (nullptr for W4A16).
// gemm_wgmma_<T>x<R>[_c<C>]_bf16 stage a bf16 activation themselves, with 4-byte copies (small
// weights at decode sizes, where the staging launch costs more than it saves).
// Grid (ceil(N / (128 R)), splits, token chunks): block (i, s, z) takes tokens [8T z, 8T z + 8T) of
// the M rows; each token chunk has its own split-K scratch (partials [chunks][splits][8T][N rounded
// to 16], counters [chunks][row groups]); _c<C>: the C splits of a row group and token chunk are one
// cluster and reduce in distributed shared memory (no scratch).
// Dynamic shared memory: gemm.py `shared_bytes`.
template <int T>
using WgmmaWindow = Window<T, true>;  // one macro argument (a template-id with a comma would be two)

__device__ __forceinline__ unsigned windows_of(unsigned K, unsigned window_k) { return (K + window_k - 1) / window_k; }

#define FP4_DEFINE_GEMM_WGMMA_KERNEL(NAME, T, R, C, MIN_BLOCKS, ATTRS, M0, SPLIT)                           \
    extern "C" __global__ void ATTRS __launch_bounds__(kThreads, MIN_BLOCKS) gemm_##NAME(                  \
        const uint4* w_codes, const uint2* w_scales, const __nv_bfloat16* image, const float* act_global,  \
        FP4_GEMM_EPILOGUE_ARGS, FP4_GEMM_SPLIT_ARGS) {                                                     \
        using Win = WgmmaWindow<T>;                                                                         \
        Epilogue ep = FP4_EPILOGUE;                                                                         \
        ep.out_row_base = M0;                                                                               \
        const __nv_bfloat16* chunk_image = image + (size_t)blockIdx.z * windows_of(K, Win::kK) * (Win::kBytes / 2); \
        gemm_block<R, 4, C, true>(w_codes, w_scales, ActImage<Win>{chunk_image, nullptr}, ep,                     \
                            min(M - (M0), 8u * T), N, K, blockIdx.x, blockIdx.y, SPLIT);                   \
    }
#define FP4_WGMMA_CHUNK_M0(T) min(blockIdx.z * 8u * T, M)
#define FP4_WGMMA_CHUNK_SPLIT(T) chunk_split(partials, counters, splits, chunks_per_split, 8 * T, N)
#define FP4_DEFINE_GEMM_WGMMA(T, R, MIN_BLOCKS)                                                               \
    FP4_DEFINE_GEMM_WGMMA_KERNEL(wgmma_##T##x##R, T, R, 0, MIN_BLOCKS, , FP4_WGMMA_CHUNK_M0(T),              \
                                 FP4_WGMMA_CHUNK_SPLIT(T))                                                    \
    FP4_DEFINE_GEMM_BF16(wgmma_##T##x##R, WgmmaWindow<T>, R, 4, 0, MIN_BLOCKS, , FP4_WGMMA_CHUNK_M0(T),      \
                         FP4_WGMMA_CHUNK_SPLIT(T))
#define FP4_DEFINE_GEMM_WGMMA_CLUSTER(T, R, C, MIN_BLOCKS)                                                        \
    FP4_DEFINE_GEMM_WGMMA_KERNEL(wgmma_##T##x##R##_c##C, T, R, C, MIN_BLOCKS, FP4_CLUSTER(C), FP4_WGMMA_CHUNK_M0(T), \
                                 FP4_SPLIT)                                                                        \
    FP4_DEFINE_GEMM_BF16(wgmma_##T##x##R##_c##C, WgmmaWindow<T>, R, 4, C, MIN_BLOCKS, FP4_CLUSTER(C),             \
                         FP4_WGMMA_CHUNK_M0(T), FP4_SPLIT)

FP4_DEFINE_GEMM_WGMMA(2, 1, 2)
FP4_DEFINE_GEMM_WGMMA(4, 1, 2)
FP4_DEFINE_GEMM_WGMMA(8, 1, 2)
FP4_DEFINE_GEMM_WGMMA(16, 1, 1)
FP4_DEFINE_GEMM_WGMMA(4, 2, 1)
FP4_DEFINE_GEMM_WGMMA(8, 2, 1)
FP4_DEFINE_GEMM_WGMMA(16, 2, 1)  // 256 weight rows x 128 tokens: half the activation bytes per FLOP of 16x1
FP4_DEFINE_GEMM_WGMMA_CLUSTER(4, 1, 2, 2)
FP4_DEFINE_GEMM_WGMMA_CLUSTER(4, 1, 4, 2)
FP4_DEFINE_GEMM_WGMMA_CLUSTER(4, 1, 8, 2)
FP4_DEFINE_GEMM_WGMMA_CLUSTER(8, 1, 2, 2)
FP4_DEFINE_GEMM_WGMMA_CLUSTER(8, 1, 4, 2)
FP4_DEFINE_GEMM_WGMMA_CLUSTER(8, 1, 8, 2)
FP4_DEFINE_GEMM_WGMMA_CLUSTER(16, 1, 2, 1)  // 65-128 rows: one block per SM, as gemm_wgmma_16x1
FP4_DEFINE_GEMM_WGMMA_CLUSTER(16, 1, 4, 1)
FP4_DEFINE_GEMM_WGMMA_CLUSTER(16, 1, 8, 1)
FP4_DEFINE_GEMM_WGMMA_CLUSTER(16, 2, 2, 1)
FP4_DEFINE_GEMM_WGMMA_CLUSTER(16, 2, 4, 1)

// gemm_stage_<T>_{bf16,nvfp4}: the window images of the wgmma kernels with T token tiles. Block
// (w, z) stages window w of token chunk z in shared memory exactly as those kernels' mainloop did
// (4-byte pairs scattered into the permuted layout; NVFP4 decoded to exact bf16 e2m1 * s), then
// writes the buffer out with 16-byte stores. Grid (windows, token chunks), 256 threads, dynamic
// shared memory one window (gemm.py `shared_bytes` / 2). `release`: the launch is a single wave and
// lets its GEMM be scheduled right after the wait (gemm.py `STAGE_EARLY_RELEASE`), so the GEMM's
// blocks take the SMs and issue their first weight loads while the images are written; the GEMM's
// own wait still waits for this grid to complete.
template <class Act>
__device__ __forceinline__ void stage_image(Act act, __nv_bfloat16* image, unsigned M, unsigned K) {
    using Win = typename Act::Win;
    extern __shared__ uint4 smem_raw[];
    __shared__ unsigned code_table[256];
    __nv_bfloat16* buf = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    typename Act::Pending pending;
    act.init(code_table);
    __syncthreads();
    const unsigned k0 = blockIdx.x * Win::kK;
    act.start(pending, buf, M, k0, K);
    act.finish(pending, buf, M, k0, K);
    __syncthreads();
    uint4* dst = reinterpret_cast<uint4*>(image) + ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * (Win::kBytes / 16);
    for (unsigned i = threadIdx.x; i < Win::kBytes / 16; i += kThreads) dst[i] = smem_raw[i];
}

#define FP4_DEFINE_GEMM_STAGE(T)                                                                              \
    extern "C" __global__ void __launch_bounds__(kThreads) gemm_stage_##T##_bf16(                            \
        const __nv_bfloat16* act, __nv_bfloat16* image, unsigned M, unsigned K, int release) {                \
        pdl::wait_prior();                                                                                         \
        if (release) pdl::release_next();                                                                     \
        const unsigned m0 = blockIdx.y * 8u * T;                                                              \
        stage_image(ActBf16<WgmmaWindow<T>>{act, RowMap{nullptr, m0}}, image, min(M - m0, 8u * T), K);       \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(kThreads) gemm_stage_##T##_nvfp4(                           \
        const unsigned char* act_packed, const unsigned char* act_scales, __nv_bfloat16* image, unsigned M,   \
        unsigned K, int release) {                                                                            \
        pdl::wait_prior();                                                                                         \
        if (release) pdl::release_next();                                                                     \
        const unsigned m0 = blockIdx.y * 8u * T;                                                              \
        stage_image(ActNvfp4<WgmmaWindow<T>>{act_packed, act_scales, RowMap{nullptr, m0}}, image,             \
                    min(M - m0, 8u * T), K);                                                                  \
    }

FP4_DEFINE_GEMM_STAGE(2)
FP4_DEFINE_GEMM_STAGE(4)
FP4_DEFINE_GEMM_STAGE(8)
FP4_DEFINE_GEMM_STAGE(16)

// e2m1 * fp32(scale) of a tiled weight as bf16 [N, K] (exact), the weight operand of the large-M
// cuBLAS path. One warp per (row tile, 64-k chunk): lane (g, t)'s 16 bytes are rows g and g + 8 at
// the 16 consecutive k from 64 chunk + 16 t, so each lane writes two 32-byte row segments with
// 16-byte stores and a warp writes its tile's 16 rows x 128 bytes. Unit indices fit 32 bits (a
// unit is 512 bytes of codes).
extern "C" __global__ void __launch_bounds__(256) dequantize_tiled_unscaled_bf16(const uint4* codes,
                                                                                 const uint2* scales,
                                                                                 __nv_bfloat16* out, unsigned N,
                                                                                 unsigned K) {
    pdl::wait_prior();
    const unsigned row_tiles = (N + 15) / 16, chunks = (K + kTileK - 1) / kTileK;
    const unsigned groups = (chunks + kGroupChunks - 1) / kGroupChunks, units = row_tiles * chunks;
    const unsigned lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const unsigned warps = gridDim.x * (blockDim.x / 32);
    for (unsigned u = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; u < units; u += warps) {
        const unsigned tile = u / chunks, chunk = u - tile * chunks, k0 = chunk * kTileK + 16 * t;
        if (k0 >= K) continue;  // K is a multiple of 16: a lane's 16 k are all inside or all past it
        const uint4 q4 = codes[(size_t)u * 32 + lane];
        const uint2 sw = scales[((size_t)tile * groups + chunk / kGroupChunks) * 32 + lane];
        unsigned sc_g, sc_g8;
        switch (chunk % kGroupChunks) {
            case 0: scale_pairs<0>(sw, sc_g, sc_g8); break;
            case 1: scale_pairs<1>(sw, sc_g, sc_g8); break;
            case 2: scale_pairs<2>(sw, sc_g, sc_g8); break;
            default: scale_pairs<3>(sw, sc_g, sc_g8); break;
        }
        const unsigned q[4] = {q4.x, q4.y, q4.z, q4.w};
        unsigned row_g[8], row_g8[8];  // bf16 pairs at k0 + 2i
#pragma unroll
        for (int s = 0; s < 4; ++s) {  // a0: row g, k0 + 4s + 0/1; a1: row g + 8; a2: row g, k0 + 4s + 2/3; a3: row g + 8
            unsigned a[4];
            dequant_step(q[s], sc_g, sc_g8, a);
            row_g[2 * s] = bf16x2_mul(a[0], 0x4C804C80u);  // * 2^26
            row_g8[2 * s] = bf16x2_mul(a[1], 0x4C804C80u);
            row_g[2 * s + 1] = bf16x2_mul(a[2], 0x4C804C80u);
            row_g8[2 * s + 1] = bf16x2_mul(a[3], 0x4C804C80u);
        }
        const unsigned n = tile * 16 + g;
        if (n < N) {
            uint4* dst = reinterpret_cast<uint4*>(out + (size_t)n * K + k0);
            dst[0] = make_uint4(row_g[0], row_g[1], row_g[2], row_g[3]);
            dst[1] = make_uint4(row_g[4], row_g[5], row_g[6], row_g[7]);
        }
        if (n + 8 < N) {
            uint4* dst = reinterpret_cast<uint4*>(out + (size_t)(n + 8) * K + k0);
            dst[0] = make_uint4(row_g8[0], row_g8[1], row_g8[2], row_g8[3]);
            dst[1] = make_uint4(row_g8[4], row_g8[5], row_g8[6], row_g8[7]);
        }
    }
}

// e2m1 * fp32(scale) of a linear NVFP4 tensor as bf16 [rows, K] (exact): the activation operand of
// the large-M path. One 16-element block per thread per step.
extern "C" __global__ void __launch_bounds__(256) dequantize_unscaled_bf16(const unsigned char* packed,
                                                                           const unsigned char* scales,
                                                                           __nv_bfloat16* out, unsigned rows,
                                                                           unsigned kblocks) {
    pdl::wait_prior();
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
    pdl::wait_prior();
    Epilogue ep = FP4_EPILOGUE;
    ep.init();
    const size_t total = (size_t)M * N;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        Epilogue at = ep;
        at.select_column_block((unsigned)(i % N));
        at.store((unsigned)(i / N), (unsigned)(i % N), N, acc[i], 1.0f);
    }
}

// alpha_beta[0] = alpha (row_decode unused), alpha_beta[1] = 0: device-side alpha and beta for a
// cuBLAS call in device pointer mode, so no host ever reads the global scales.
extern "C" __global__ void gemm_alpha(const float* w_global, const float* act_global, float* alpha_beta) {
    pdl::wait_prior();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        Epilogue ep{w_global, nullptr, act_global, nullptr, 0, nullptr, 0};
        ep.init();
        alpha_beta[0] = ep.alpha(0, 1.0f);
        alpha_beta[1] = 0.0f;
    }
}
