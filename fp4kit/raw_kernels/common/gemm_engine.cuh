// The NVFP4 GEMM engine, shared by gemm.cu (dense) and moe.cu (grouped experts): the tiled weight
// layout's fragment loads, the E2M1 -> bf16 conversion, the block-scale application, the mainloop
// and the epilogue with its deterministic split-K reduction. The weight must be in the tiled
// layout of fp4kit/formats.py (`to_tiled`); the activation is bf16 (W4A16) or NVFP4 (W4A4, linear
// layout), read through a row map (identity, or the rows routed to one expert).
//
// Method. Hopper has no FP4 tensor cores: the weight is dequantized in registers to bf16 and
// multiplied on the bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation) with weight rows in
// the MMA's 16-row slot and tokens in its 8-wide slot, so one pass streams the weight once for up
// to 8 * T tokens. A block of 8 warps owns 8 * R row tiles (16 rows each) and a K range (its
// split); each warp streams its R row tiles through registers one group (4 tiles of 64 k) ahead,
// with an L2 evict-first policy, and every dequantized fragment is used for all T token tiles.
// The activation of the block's K range is staged in shared memory one window (512 k) at a time as
// exact bf16 values (an NVFP4 activation is dequantized there, once per block, not per warp).
//
// Numerics. A tile word gives a bf16 pair e2m1 * 2^-126 per mask and shift (see formats.py); the
// block scale byte b shifted left by 4 is the bf16 of s * 2^-120 (E4M3 subnormals included), and
// two exact bf16 multiplies make it s * 2^100, so one multiply per pair gives e2m1 * s * 2^-26, a
// normal bf16, exactly. Products with the bf16 activation are exact in fp32; the epilogue
// multiplies by alpha * 2^26. Splits write fp32 partials; the last block of a row group to finish
// (an atomic counter it then resets) adds them in split order, so results do not depend on timing.
#pragma once

#include "gpu_sync.cuh"
#include "nvfp4.cuh"
#include "pdl.cuh"

namespace gemm {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileK = 64;         // k of one tile
constexpr int kGroupChunks = 4;    // tiles per scale load

// The staged activation window of a kernel with T token tiles, in the layout its MMA reads.
// mma.sync (kWg false): token rows of kK bf16 plus 16 bytes of padding, so the 8 lanes of a 16-byte
// shared load phase hit 8 different banks; 8 tiles (512 k) for T <= 2, 4 tiles for more tokens, so
// that two windows stay small enough for several blocks per SM.
// wgmma (kWg true): the canonical K-major operand layout without swizzle, core matrices of 8 tokens
// x 8 k (128 B): K-column (c, s, h) holds, for all 8T tokens, the k of MMA step s of tile c, half h,
// in the order the tiled weight's fragments use (lane t's pair of step s is actual k 16t + 4s + 2h
// of the tile, see formats.py), so the staging scatters 4-byte pairs. Token-adjacent cores are 128
// bytes apart (the descriptor's stride offset), K-adjacent ones 128 T + 16 (its leading offset):
// the 16 bytes of padding put the 8 columns of a tile 4 banks apart, so the 32 pairs of a token's
// tile, and the (8 tokens x 4 t) pairs of one column, are each stored without bank conflicts.
template <int T, bool kWg = false>
struct Window {
    static constexpr int kTiles = T;
    static constexpr bool kWarpgroup = kWg;
    static constexpr int kChunks = kWg || T > 2 ? 4 : 8;
    static constexpr int kK = kChunks * kTileK;
    static constexpr int kStride = kK + 8;                  // bf16 per token row (mma.sync)
    static constexpr int kColumn = 64 * T + 8;              // bf16 per K-column (wgmma)
    static constexpr int kBytes = (kWg ? kK / 8 * kColumn : 8 * T * kStride) * 2;  // one buffer
    static constexpr int kTokenStride = kWg ? 8 : kStride;  // bf16 between the same k of adjacent tokens
    // element offset of the bf16 pair at window position kk (even) of token m
    __device__ __forceinline__ static unsigned pair(unsigned m, unsigned kk) {
        if (!kWg) return m * kStride + kk;
        const unsigned c = kk / kTileK, t = kk / 16 % 4, s = kk / 4 % 4, h = kk / 2 % 2;
        return m * kTokenStride + ((c * 4 + s) * 2 + h) * kColumn + 2 * t;
    }
    // The 16-element block a thread stages in its p-th turn (token m, window position kk): mma.sync,
    // consecutive blocks per thread; wgmma, per warp 8 tokens x the 4 blocks of one tile (lane =
    // 4 * token + block), the order whose pair stores are free of bank conflicts.
    __device__ __forceinline__ static void block16(int p, unsigned& m, unsigned& kk) {
        if (kWg) {
            const unsigned u = p * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
            m = u / 4 * 8 + lane / 4;
            kk = u % 4 * kTileK + lane % 4 * 16;
        } else {
            const unsigned i = p * kThreads + threadIdx.x;
            m = i / (kK / 16);
            kk = i % (kK / 16) * 16;
        }
    }
};
constexpr float kWeightUnscale = 67108864.0f;  // 2^26

__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {
    unsigned d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ void mma_bf16(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    // not volatile: the compiler may schedule the next step's dequantization around it
}

__device__ __forceinline__ unsigned long long evict_first_policy() {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// A weight stream load: read once, so it neither stays in L1 nor pushes reused data out of L2.
__device__ __forceinline__ uint4 load_stream(const uint4* p, unsigned long long policy) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(policy));
    return v;
}

__device__ __forceinline__ uint2 load_stream(const uint2* p, unsigned long long policy) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;"
        : "=r"(v.x), "=r"(v.y)
        : "l"(p), "l"(policy));
    return v;
}

// A request for the line holding p into L2, without waiting for it (no register written).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// The A fragment of one MMA step from its tile word q: a0 (row g) and a2 (row g) scaled by sc_g,
// a1 and a3 (row g + 8) by sc_g8. 0x81C081C0 keeps sign and e1 e0 m of both halves.
__device__ __forceinline__ void dequant_step(unsigned q, unsigned sc_g, unsigned sc_g8, unsigned a[4]) {
    constexpr unsigned kMask = 0x81C081C0u;
    a[0] = bf16x2_mul(q & kMask, sc_g);
    a[1] = bf16x2_mul((q << 6) & kMask, sc_g8);
    a[2] = bf16x2_mul((q << 3) & kMask, sc_g);
    a[3] = bf16x2_mul(((q >> 4) & 0x00C000C0u) | ((q >> 5) & 0x01000100u) | ((q << 1) & 0x80008000u), sc_g8);
}

// Block scales of tile j (0..3) of a group: (s_g, s_g) and (s_g8, s_g8) times 2^100 as bf16 pairs.
// The scale word holds bytes (row g, row g + 8) of tiles 0, 1 (x) and 2, 3 (y); sign bits are
// dropped (block scales are non-negative; the layout converter refuses negative ones).
template <int j>
__device__ __forceinline__ void scale_pairs(uint2 sw, unsigned& sc_g, unsigned& sc_g8) {
    constexpr unsigned b = 2 * (j & 1);
    const unsigned w = (j < 2 ? sw.x : sw.y) & 0x7F7F7F7Fu;
    // bytes (b_g, 0, b_g8, 0): selector 4 reads byte 0 of the zero operand
    const unsigned v = prmt(w, 0u, b | (4u << 4) | ((b + 1) << 8) | (4u << 12));
    const unsigned s = bf16x2_mul(bf16x2_mul(v << 4, 0x7B807B80u), 0x71807180u);  // * 2^120 * 2^100
    sc_g = prmt(s, s, 0x1010u);
    sc_g8 = prmt(s, s, 0x3232u);
}

// Activation row of local token i: rows[base + i] (e.g. the tokens routed to one expert) or base + i.
struct RowMap {
    const unsigned* rows;
    unsigned base;
    __device__ __forceinline__ size_t operator()(unsigned i) const { return rows ? rows[base + i] : base + i; }
};

// Activation staging: the window k0 .. k0 + Win::kK of tokens 0 .. 8T - 1 into a shared buffer in
// the layout of `Win` as exact bf16 values, zero past M and past K (K is a multiple of 16, so a
// 16-element block is either inside K or past it). `start` issues the loads, `finish` completes
// the buffer; the mainloop multiplies the current window between the two, so the loads of the
// next window are in flight meanwhile.
__device__ __forceinline__ void cp_async16(void* smem, const void* global, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async4(void* smem, const void* global, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(global), "r"(valid ? 4 : 0));
}

// bf16: copied straight into shared memory (cp.async, zero-filled where invalid); no registers.
// 16-byte copies in the mma.sync layout, 4-byte pairs in the wgmma layout.
template <class W>
struct ActBf16 {
    using Win = W;
    const __nv_bfloat16* x;  // [rows, K]
    RowMap row;
    struct Pending {};
    __device__ __forceinline__ void init(unsigned*) {}
    __device__ __forceinline__ void start(Pending&, __nv_bfloat16* act_s, unsigned M, unsigned k0, unsigned K) const {
        constexpr int kStep = Win::kWarpgroup ? 2 : 8;   // bf16 per copy
        constexpr int kPerRow = Win::kK / kStep;          // copies per token row
        constexpr int kRows = kThreads / kPerRow;         // token rows per pass
        static_assert(kThreads % kPerRow == 0, "a thread keeps its column of the window");
        // this thread: column kk of tokens hi, hi + kRows, ...; the addresses advance by constants
        const unsigned kk = threadIdx.x % kPerRow * kStep, hi = threadIdx.x / kPerRow;
        const bool k_ok = k0 + kk < K;
        __nv_bfloat16* dst = act_s + Win::pair(hi, kk);
        auto copy = [&](int p, const __nv_bfloat16* src, bool valid) {
            if (Win::kWarpgroup) cp_async4(dst + p * kRows * Win::kTokenStride, valid ? src : x, valid);
            else cp_async16(dst + p * kRows * Win::kTokenStride, valid ? src : x, valid);
        };
        if (!row.rows) {  // consecutive rows
            const __nv_bfloat16* src = x + (size_t)(row.base + hi) * K + k0 + kk;
#pragma unroll
            for (int p = 0; p < 8 * Win::kTiles / kRows; ++p, src += (size_t)kRows * K)
                copy(p, src, k_ok && p * kRows + hi < M);
        } else {
#pragma unroll
            for (int p = 0; p < 8 * Win::kTiles / kRows; ++p) {
                const unsigned m = p * kRows + hi;
                const bool valid = k_ok && m < M;
                copy(p, valid ? x + row(m) * K + k0 + kk : x, valid);
            }
        }
        asm volatile("cp.async.commit_group;");
    }
    __device__ __forceinline__ void finish(Pending&, __nv_bfloat16*, unsigned, unsigned, unsigned) const {
        asm volatile("cp.async.wait_all;" ::: "memory");
    }
};

// The NVFP4 activation decode table (256 entries in shared memory, one per thread of a 256-thread
// block; the block synchronises before use): the bf16 pair (e2m1 * 2^-100) of a code byte.
__device__ __forceinline__ void fill_code_table(unsigned* table) {
    const unsigned b = threadIdx.x;
    const __nv_bfloat162 v = __floats2bfloat162_rn(__fmul_rn(fp4_e2m1_value(b & 0xFu), 7.8886090522101181e-31f),
                                                   __fmul_rn(fp4_e2m1_value(b >> 4), 7.8886090522101181e-31f));
    table[b] = *reinterpret_cast<const unsigned*>(&v);  // 7.88e-31 = 2^-100
}

// One 16-element NVFP4 block (8 code bytes, its E4M3 scale byte) as 8 exact bf16 pairs e2m1 * s:
// the table's e2m1 * 2^-100 times s * 2^100 (the weight's scale conversion), one multiply per pair.
__device__ __forceinline__ void decode_block16(uint2 codes, unsigned scale, const unsigned* table, unsigned h[8]) {
    const unsigned b = scale & 0x7Fu;
    const unsigned sc = bf16x2_mul(bf16x2_mul((b << 4) | (b << 20), 0x7B807B80u), 0x71807180u);  // s * 2^100
#pragma unroll
    for (int q = 0; q < 8; ++q) h[q] = bf16x2_mul(table[((q < 4 ? codes.x : codes.y) >> (8 * (q % 4))) & 0xFFu], sc);
}

// NVFP4 activation blocks in flight: loaded into registers by an activation's `start`, decoded by
// its `finish` (N blocks of 16 per thread).
template <int N>
struct Nvfp4Blocks {
    uint2 codes[N];
    unsigned scale[N];
};

// NVFP4 (linear layout): the codes and scale bytes of one 16-element block per thread and token
// tile are loaded into registers, then dequantized into the buffer, once per block rather than once
// per warp: a 256-entry table in shared memory gives the bf16 pair (e2m1 * 2^-100) of a code byte,
// and one exact bf16 multiply by s * 2^100 (the weight's scale conversion) makes e2m1 * s.
template <class W>
struct ActNvfp4 {
    using Win = W;
    const unsigned char* packed;  // [rows, K/2]
    const unsigned char* scales;  // [rows, K/16]
    RowMap row;
    unsigned* table;              // [256] in shared memory, filled by init()
    static constexpr int kBlocks = Win::kTiles * 8 * (Win::kK / 16) / kThreads;  // per thread and window
    using Pending = Nvfp4Blocks<kBlocks>;
    __device__ __forceinline__ void init(unsigned* shared_table) {
        table = shared_table;
        fill_code_table(table);
    }
    __device__ __forceinline__ void start(Pending& pd, __nv_bfloat16*, unsigned M, unsigned k0, unsigned K) const {
#pragma unroll
        for (int p = 0; p < kBlocks; ++p) {  // blocks of 16 per thread
            unsigned m, kk;
            Win::block16(p, m, kk);
            pd.codes[p] = make_uint2(0u, 0u);
            pd.scale[p] = 0u;
            if (m < M && k0 + kk < K) {
                const size_t r = row(m);
                pd.codes[p] = *reinterpret_cast<const uint2*>(packed + r * (K / 2) + (k0 + kk) / 2);
                pd.scale[p] = scales[r * (K / 16) + (k0 + kk) / 16];
            }
        }
    }
    __device__ __forceinline__ void finish(Pending& pd, __nv_bfloat16* act_s, unsigned M, unsigned, unsigned) const {
#pragma unroll
        for (int p = 0; p < kBlocks; ++p) {
            unsigned m, kk;
            Win::block16(p, m, kk);
            unsigned h[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
            if (m < M) decode_block16(pd.codes[p], pd.scale[p], table, h);  // rows past M stay zero
            if (Win::kWarpgroup) {
#pragma unroll
                for (int q = 0; q < 8; ++q) *reinterpret_cast<unsigned*>(act_s + Win::pair(m, kk + 2 * q)) = h[q];
            } else {
                uint4* dst = reinterpret_cast<uint4*>(act_s + Win::pair(m, kk));
                dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
                dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
            }
        }
    }
};

// The wgmma kernels' activation: window images prepared by a staging launch (gemm.cu
// `gemm_stage_*`), the exact bytes of each shared-memory window (layout `Win`, wgmma's canonical
// K-major layout in the weight's k order) one after another in global memory, [window][Win::kBytes]
// per token chunk. A window is then one bulk copy (cp.async.bulk, issued by one thread) that
// completes on an mbarrier, instead of 4-byte copies or a dequantization by every block: the
// scatter into the permuted layout, and for W4A4 the E2M1 decode, are done once per call. The two
// buffers alternate, so the i-th window staged lands in buffer i % 2 and completes phase i / 2 % 2
// of that buffer's mbarrier.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP4_SM90A(...) asm volatile(__VA_ARGS__)
#else
#define FP4_SM90A(...) __trap()
#endif
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

template <class W>
struct ActImage {
    using Win = W;
    const __nv_bfloat16* image;  // this token chunk's windows
    unsigned long long* bars;    // two mbarriers in shared memory (init)
    unsigned issued = 0, done = 0;
    struct Pending {};
    __device__ __forceinline__ void init(unsigned* shared_words) {
        bars = reinterpret_cast<unsigned long long*>(shared_words);
        if (threadIdx.x == 0) {
            FP4_SM90A("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bars)));
            FP4_SM90A("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bars + 1)));
            FP4_SM90A("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
    }
    __device__ __forceinline__ void start(Pending&, __nv_bfloat16* act_s, unsigned, unsigned k0, unsigned) {
        const unsigned bar = shared_address(bars + (issued++ & 1));
        if (threadIdx.x == 0) {
            const __nv_bfloat16* src = image + (size_t)(k0 / Win::kK) * (Win::kBytes / 2);
            FP4_SM90A("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(Win::kBytes) : "memory");
            FP4_SM90A("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                      ::"r"(shared_address(act_s)), "l"(src), "r"(Win::kBytes), "r"(bar) : "memory");
        }
    }
    __device__ __forceinline__ void finish(Pending&, __nv_bfloat16*, unsigned, unsigned, unsigned) {
        const unsigned bar = shared_address(bars + (done & 1)), parity = (done >> 1) & 1;
        ++done;
        unsigned ready = 1;
        do {
            FP4_SM90A("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                      : "=r"(ready) : "r"(bar), "r"(parity) : "memory");
        } while (!ready);
    }
};

// Warpgroup MMA (wgmma, sm_90a): D[64 x N] += A[64 x 16] * B[16 x N] with fp32 accumulation, A
// (the dequantized weight, bf16) in registers in the mma.sync fragment layout of each warp's 16
// rows, B (the activation) read from shared memory through a descriptor. The accumulator layout
// per warp is that of N / 8 mma.sync m16n8 tiles, so the epilogue is shared.
__device__ __forceinline__ unsigned long long wgmma_descriptor(const void* smem, unsigned leading_bytes,
                                                               unsigned stride_bytes) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (unsigned long long)(leading_bytes >> 4) << 16 |
           (unsigned long long)(stride_bytes >> 4) << 32;  // no swizzle, base offset 0
}

// wgmma exists on sm_90a only; elsewhere (Blackwell) the host launches the mma.sync kernels, and
// the wgmma kernels compile to a trap.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP4_WGMMA(...) asm volatile(__VA_ARGS__)
#else
#define FP4_WGMMA(...) __trap()
#endif
__device__ __forceinline__ void wgmma_fence() { FP4_WGMMA("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { FP4_WGMMA("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>  // until at most N committed groups are pending
__device__ __forceinline__ void wgmma_wait() { FP4_WGMMA("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// generic-proxy writes to shared memory (st.shared, cp.async) made visible to wgmma's reads (the
// bulk copies of ActImage are async-proxy writes already; the fence costs one instruction per window)
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Thread-block clusters (sm_90): a barrier of all threads of the cluster (release / acquire), and a
// 16-byte load from the shared memory of block `rank` of the cluster at the offset of `p` here.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// A cluster barrier that orders nothing but arrival: for keeping a block's shared memory until its
// peers have read it. Their reads have returned (their values were used) before they arrive, so no
// release is needed, and a release would wait for this block's global stores as well.
__device__ __forceinline__ void cluster_sync_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

__device__ __forceinline__ float4 load_cluster(const float4* p, unsigned rank) {
    unsigned remote;
    asm("mapa.shared::cluster.u32 %0, %1, %2;"
        : "=r"(remote) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))), "r"(rank));
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
    return v;
}

template <int N>
__device__ void wgmma_rs(float* d, const unsigned a[4], unsigned long long desc);

#define FP4_ACC8(i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
// operand lists written out: PTX takes them literally
template <>
__device__ __forceinline__ void wgmma_rs<16>(float* d, const unsigned a[4], unsigned long long desc) {
    FP4_WGMMA(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7}, "
        "{%8,%9,%10,%11}, %12, 1, 1, 1, 0;"
        : FP4_ACC8(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wgmma_rs<32>(float* d, const unsigned a[4], unsigned long long desc) {
    FP4_WGMMA(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "{%16,%17,%18,%19}, %20, 1, 1, 1, 0;"
        : FP4_ACC8(0), FP4_ACC8(8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wgmma_rs<64>(float* d, const unsigned a[4], unsigned long long desc) {
    FP4_WGMMA(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%32,%33,%34,%35}, %36, 1, 1, 1, 0;"
        : FP4_ACC8(0), FP4_ACC8(8), FP4_ACC8(16), FP4_ACC8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wgmma_rs<128>(float* d, const unsigned a[4], unsigned long long desc) {
    FP4_WGMMA(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "{%64,%65,%66,%67}, %68, 1, 1, 1, 0;"
        : FP4_ACC8(0), FP4_ACC8(8), FP4_ACC8(16), FP4_ACC8(24), FP4_ACC8(32), FP4_ACC8(40), FP4_ACC8(48), FP4_ACC8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
#undef FP4_ACC8

struct Epilogue {
    // gemm_block may split K (the reductions below store through this type); a stand-in that
    // stores elsewhere (moe.cu SwigluStage) sets it false and is only used unsplit
    static constexpr bool kSplitK = true;
    const float* w_global;      // encode scale S_w (unused with w_decode or row_decode)
    const float* row_decode;  // nullptr: one decode factor for every row
    const float* act_global;    // nullptr: W4A16
    const void* bias;
    int bias_kind;  // 0 none, 1 fp32, 2 bf16
    void* out;
    int out_f32;
    const float* w_decode = nullptr;  // a precomputed decode factor 1/S_w (per-expert weights)
    unsigned out_ld = 0;              // output row stride (0: N)
    unsigned out_row_base = 0;        // output row of local token 0
    unsigned out_col = 0;             // output column of weight row 0
    // column blocks (nullptr: none): boundaries 0 = b_0 < ... < b_P = N in device memory; block p
    // (columns b_p .. b_{p+1} - 1) is its own row-major [out_rows, b_{p+1} - b_p] matrix starting at
    // element out_rows * b_p, so a concatenated projection's parts come out C-contiguous
    const unsigned* out_parts = nullptr;
    unsigned out_rows = 0;

    // Points the stores at the column block holding column `col`, for a thread block whose columns
    // all lie in that block (the launcher keeps the interior boundaries multiples of every kernel's
    // column span): element (row, n) is row * width + n + b_p * (out_rows - 1). Once per thread
    // block, so the stores stay the plain ones.
    __device__ __forceinline__ void select_column_block(unsigned col) {
        if (!out_parts) return;
        unsigned lo = 0, hi = __ldg(out_parts + 1);
        for (unsigned p = 2; col >= hi; ++p) lo = hi, hi = __ldg(out_parts + p);
        out_ld = hi - lo;
        out_col = lo * (out_rows - 1);
    }

    float w_dec, a_dec;  // 1 / S_w (unused with row_decode) and 1 / S_a (1 for W4A16)

    __device__ __forceinline__ void init() {
        preload();
        init_preloaded();
    }

    __device__ __forceinline__ float alpha(unsigned n, float unscale) const {
        return row_alpha(row_decode ? row_decode[n] : 0.0f, unscale);
    }
    // alpha of a row whose row_decode entry (ignored without row_decode) is `decode`
    __device__ __forceinline__ float row_alpha(float decode, float unscale) const {
        return __fmul_rn(__fmul_rn(row_decode ? decode : w_dec, a_dec), unscale);
    }

    // y = sum * alpha * unscale (+ bias) into out[token, n]
    __device__ __forceinline__ void store(unsigned token, unsigned n, unsigned N, float sum,
                                          float unscale = kWeightUnscale) const {
        store_row(token, n, N, sum, row(n), unscale);
    }

    // Loads ahead of the sums they scale: `preload` the operands of `init`, `row` those of row n's
    // factor and bias, and `init_preloaded` / `store_row` do the arithmetic of `init` / `store` on
    // them at the end. A kernel that issues these before its mainloop keeps their round trip off the
    // end of a block's life (the GEMV: ~5 % of its warps' samples under `ncu`); nothing depends on
    // the loads until the end, so the mainloop does not wait for them.
    float w_raw = 0.0f, a_raw = 1.0f;
    __device__ __forceinline__ void preload() {
        w_raw = row_decode ? 0.0f : (w_decode ? *w_decode : *w_global);
        a_raw = act_global ? *act_global : 1.0f;
    }
    __device__ __forceinline__ void init_preloaded() {
        w_dec = row_decode ? 0.0f : (w_decode ? w_raw : __fdiv_rn(1.0f, w_raw));
        a_dec = act_global ? __fdiv_rn(1.0f, a_raw) : 1.0f;
    }
    struct Row {
        float decode, bias;  // row_decode[n] (0 without), bias[n] (0 without)
    };
    __device__ __forceinline__ Row row(unsigned n) const {
        Row r{row_decode ? row_decode[n] : 0.0f, 0.0f};
        if (bias_kind == 1) r.bias = static_cast<const float*>(bias)[n];
        if (bias_kind == 2) r.bias = __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[n]);
        return r;
    }
    __device__ __forceinline__ void store_row(unsigned token, unsigned n, unsigned N, float sum, Row r,
                                              float unscale = kWeightUnscale) const {
        float y = __fmul_rn(sum, row_alpha(r.decode, unscale));
        if (bias_kind) y = __fadd_rn(y, r.bias);
        const size_t index = (size_t)(out_row_base + token) * (out_ld ? out_ld : N) + out_col + n;
        if (out_f32) static_cast<float*>(out)[index] = y;
        else static_cast<__nv_bfloat16*>(out)[index] = __float2bfloat16_rn(y);
    }
};

// Split-K scratch: fp32 partials [splits][M][row_tiles * 16] and one counter per row group (zero
// between launches: the last block of a group resets it).
struct SplitK {
    float* partials;
    unsigned* counters;
    unsigned splits;
    unsigned chunks_per_split;  // a multiple of the window (Win::kChunks)
};

// The weight tiles a warp fetches at once: F tiles (a multiple of the 4 of a scale word) of each of
// its R row tiles, and their F/4 scale words.
template <int R, int F>
struct WeightGroup {
    uint4 codes[R][F];
    uint2 scales[R][F / kGroupChunks];
};

// Called by every thread after its block's partials are written: whether this block is the last
// split of row group `group` to arrive (it then sees every partial); `flag` is a shared word.
__device__ __forceinline__ bool arrive_last(const SplitK& sk, unsigned group, unsigned* flag) {
    return gpu_sync::last_to_arrive(sk.counters + group, sk.splits, flag);
}

// out = sum over splits (in order) of the fp32 partials, for the outputs of one row group: each
// thread takes kQuads groups of 4 adjacent columns (float4) and loads kAtOnce splits of each at a time.
template <int kQuads, int kAtOnce>
__device__ __forceinline__ void reduce_splits(const SplitK& sk, const Epilogue& ep, unsigned group, unsigned rows,
                                              unsigned quads, unsigned M, unsigned N, unsigned ld) {
    const unsigned n0 = group * rows;
    for (unsigned q0 = threadIdx.x; q0 < quads; q0 += kThreads * kQuads) {
        float4 sum[kQuads];
#pragma unroll
        for (int u = 0; u < kQuads; ++u) sum[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (unsigned s0 = 0; s0 < sk.splits; s0 += kAtOnce) {
            float4 part[kAtOnce][kQuads];
#pragma unroll
            for (int v = 0; v < kAtOnce; ++v)
#pragma unroll
                for (int u = 0; u < kQuads; ++u) {
                    const unsigned q = q0 + u * kThreads, token = q / (rows / 4), n = n0 + q % (rows / 4) * 4;
                    part[v][u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (s0 + v < sk.splits && q < quads && n < ld)
                        part[v][u] = __ldcg(reinterpret_cast<const float4*>(sk.partials + ((size_t)(s0 + v) * M + token) * ld + n));
                }
#pragma unroll
            for (int v = 0; v < kAtOnce; ++v)
#pragma unroll
                for (int u = 0; u < kQuads; ++u)
                    if (s0 + v < sk.splits) {
                        sum[u].x = __fadd_rn(sum[u].x, part[v][u].x);
                        sum[u].y = __fadd_rn(sum[u].y, part[v][u].y);
                        sum[u].z = __fadd_rn(sum[u].z, part[v][u].z);
                        sum[u].w = __fadd_rn(sum[u].w, part[v][u].w);
                    }
        }
#pragma unroll
        for (int u = 0; u < kQuads; ++u) {
            const unsigned q = q0 + u * kThreads, token = q / (rows / 4), n = n0 + q % (rows / 4) * 4;
            if (q >= quads) continue;
            const float v[4] = {sum[u].x, sum[u].y, sum[u].z, sum[u].w};
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (n + c < N) ep.store(token, n + c, N, v[c]);
        }
    }
}

// The same sum for few outputs (rows x M, from row n0): one output per thread, whose split loads
// the compiler issues together.
__device__ __forceinline__ void reduce_splits_each(const SplitK& sk, const Epilogue& ep, unsigned n0, unsigned rows,
                                                   unsigned M, unsigned N, unsigned ld) {
    for (unsigned i = threadIdx.x; i < rows * M; i += kThreads) {
        const unsigned n = n0 + i % rows, token = i / rows;
        if (n >= N) continue;
        float sum = 0.0f;
        for (unsigned s = 0; s < sk.splits; ++s) sum = __fadd_rn(sum, __ldcg(sk.partials + ((size_t)s * M + token) * ld + n));
        ep.store(token, n, N, sum);
    }
}

// One block: weight rows of row group `group` (8 * R row tiles) times tokens 0 .. M-1 (M <= 8T),
// fetching F weight tiles per row tile at once, over the K range of split `split`. w_codes /
// w_scales point at one [N, K] weight. Dynamic shared memory: two activation buffers
// (2 * Act::Win::kBytes). With a wgmma window (Act::Win::kWarpgroup) each warpgroup (4 warps) issues
// R warpgroup MMAs per step, one per row tile of each warp; otherwise each warp issues R * T mma.sync.
// kPdl: the kernel's first global reads are these weights, so it waits for the kernel before it
// (common/pdl.cuh) only after issuing the first group's loads; without it, the caller waits.
// kSkipEmpty (mma.sync): the token tiles at or past M are not multiplied; for a caller whose M
// varies per block below 8T (the grouped expert GEMM: T sized to the mean rows per expert, so
// many experts' passes hold fewer rows).
template <int R, int F, int kCluster = 0, bool kPdl = false, bool kSkipEmpty = false, class Act, class Ep>
__device__ void gemm_block(const uint4* w_codes, const uint2* w_scales, Act act, const Ep& ep_in,
                           unsigned M, unsigned N, unsigned K, unsigned group, unsigned split, const SplitK& sk) {
    using Win = typename Act::Win;
    constexpr int T = Win::kTiles;
    constexpr bool kWg = Win::kWarpgroup;
    extern __shared__ uint4 smem_raw[];
    __nv_bfloat16* act_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    __shared__ unsigned last_block;
    __shared__ __align__(16) unsigned code_table[256];  // the NVFP4 decode table, or ActImage's mbarriers

    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const unsigned row_tiles = (N + 15) / 16, chunks = (K + kTileK - 1) / kTileK;
    const unsigned groups = (chunks + kGroupChunks - 1) / kGroupChunks;
    const unsigned tile0 = (group * kWarps + warp) * R;
    // warp-uniform (warpgroup-uniform with wgmma: a warp past N computes its clamped tile and stores
    // nothing); idle warps still take part in the barriers
    const bool active = (kWg ? (group * kWarps + (warp & ~3u)) * R : tile0) < row_tiles;
    const unsigned c_begin = split * sk.chunks_per_split, c_end = min(chunks, c_begin + sk.chunks_per_split);
    const unsigned long long policy = evict_first_policy();

    // per row tile: the next tile and scale group to fetch; tiles past N repeat the last one
    const uint4* code_next[R];
    const uint2* scale_next[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const size_t tile = min(tile0 + r, row_tiles - 1);
        code_next[r] = w_codes + (tile * chunks + c_begin) * 32 + lane;
        scale_next[r] = w_scales + (tile * groups + c_begin / kGroupChunks) * 32 + lane;
    }
    // the group of tiles c .. c + 3 (those at or past c_end read as zero); c advances by 4 per call
    static_assert(F % kGroupChunks == 0 && Win::kChunks % F == 0, "a fetch is whole scale words within a window");
    auto fetch = [&](unsigned c, WeightGroup<R, F>& wg) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int j = 0; j < F; ++j)
                wg.codes[r][j] = c + j < c_end ? load_stream(code_next[r] + j * 32, policy) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int w = 0; w < F / kGroupChunks; ++w) wg.scales[r][w] = load_stream(scale_next[r] + w * 32, policy);
            code_next[r] += F * 32;
            scale_next[r] += F / kGroupChunks * 32;
        }
    };

    float acc[R][T][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < T; ++i) acc[r][i][0] = acc[r][i][1] = acc[r][i][2] = acc[r][i][3] = 0.0f;

    // tiles j < valid of a group whose activation starts at window tile `first` of buffer `buf`
    auto compute = [&](const WeightGroup<R, F>& wg, const __nv_bfloat16* buf, unsigned first, unsigned valid) {
#pragma unroll
        for (int j = 0; j < F; ++j) {
            if (j >= valid) break;
            unsigned sc_g[R], sc_g8[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint2 sw = wg.scales[r][j / kGroupChunks];
                if (j % 4 == 0) scale_pairs<0>(sw, sc_g[r], sc_g8[r]);
                if (j % 4 == 1) scale_pairs<1>(sw, sc_g[r], sc_g8[r]);
                if (j % 4 == 2) scale_pairs<2>(sw, sc_g[r], sc_g8[r]);
                if (j % 4 == 3) scale_pairs<3>(sw, sc_g[r], sc_g8[r]);
            }
            if constexpr (kWg) {
                // step s of the tile: K-columns (tile, s, 0) and (tile, s, 1), 8 T tokens. One MMA per
                // row tile of the warp (R rows of 64 across the warpgroup), one commit group per step.
                const __nv_bfloat16* tile_b = buf + (first + j) * 4 * 2 * Win::kColumn;
#pragma unroll
                for (int step = 0; step < 4; ++step) {
                    unsigned a[R][4];
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const uint4 q4 = wg.codes[r][j];
                        const unsigned q = step == 0 ? q4.x : step == 1 ? q4.y : step == 2 ? q4.z : q4.w;
                        dequant_step(q, sc_g[r], sc_g8[r], a[r]);
                    }
                    wgmma_fence();  // a was written by ordinary instructions
                    const unsigned long long desc = wgmma_descriptor(tile_b + step * 2 * Win::kColumn, 2 * Win::kColumn, 128);
#pragma unroll
                    for (int r = 0; r < R; ++r) wgmma_rs<8 * T>(&acc[r][0][0], a[r], desc);
                    wgmma_commit();
                    // one step in flight while the next is dequantized: the registers of older ones
                    // can be reused (more in flight made ptxas serialize them all)
                    wgmma_wait<1>();
                }
            } else {
                const __nv_bfloat16* act_tile = buf + 16 * t + (first + j) * kTileK;
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // steps 2h, 2h + 1 share one 16-byte activation load per token tile
                    uint4 b[T];
#pragma unroll
                    for (int i = 0; i < T; ++i)
                        if (!kSkipEmpty || 8u * i < M)  // warp-uniform
                            b[i] = *reinterpret_cast<const uint4*>(act_tile + (8 * i + g) * Win::kStride + 8 * h);
#pragma unroll
                    for (int ss = 0; ss < 2; ++ss) {
#pragma unroll
                        for (int r = 0; r < R; ++r) {
                            const uint4 q4 = wg.codes[r][j];
                            const unsigned step = 2 * h + ss;
                            const unsigned q = step == 0 ? q4.x : step == 1 ? q4.y : step == 2 ? q4.z : q4.w;
                            unsigned a[4];
                            dequant_step(q, sc_g[r], sc_g8[r], a);
#pragma unroll
                            for (int i = 0; i < T; ++i)
                                if (!kSkipEmpty || 8u * i < M)
                                    mma_bf16(acc[r][i], a, ss ? b[i].z : b[i].x, ss ? b[i].w : b[i].y);
                        }
                    }
                }
            }
        }
    };
    // a staged window complete: visible to the async proxy (wgmma), and wgmma done with the other buffer
    auto window_done = [&]() {
        if constexpr (kWg) {
            fence_async_shared();
            wgmma_wait<0>();
        }
    };

    // Two register groups of weights and two activation buffers: while one group is multiplied,
    // the next group's weights and the next window's activations are in flight.
    WeightGroup<R, F> first, second;
    if (active && c_begin < c_end) fetch(c_begin, first);
    if constexpr (kPdl) pdl::wait_prior();  // the activation, the split-K scratch and the output are read or written below
    // activation buffer `slot` (0 or 1); arithmetic rather than an array, which would live in local memory
    auto act_buf = [&](unsigned slot) { return act_s + slot * (Win::kBytes / 2); };
    typename Act::Pending pending;
    act.init(code_table);
    __syncthreads();
    if (c_begin < c_end) {
        act.start(pending, act_buf(0), M, c_begin * kTileK, K);
        act.finish(pending, act_buf(0), M, c_begin * kTileK, K);
        window_done();
    }
    // multiply group `cur` (tiles c .. c + F - 1, `valid` of them) while `nxt` fetches tiles c + F ..
    auto group_step = [&](WeightGroup<R, F>& cur, WeightGroup<R, F>& nxt, unsigned c, const __nv_bfloat16* buf,
                          unsigned first_tile, unsigned valid) {
        if (c + F < c_end) fetch(c + F, nxt);
        compute(cur, buf, first_tile, valid);
    };
    constexpr int kGroups = Win::kChunks / F;  // per window: 1 or 2
    unsigned cw = c_begin, slot = 0, odd = 0;  // odd: the current group is in `second`
    for (; cw + Win::kChunks <= c_end; cw += Win::kChunks, slot ^= 1, odd ^= kGroups & 1) {  // full windows
        __syncthreads();  // this window's activation is in place; every warp is done with the other buffer
        const bool more = cw + Win::kChunks < c_end;
        const unsigned k_next = (cw + Win::kChunks) * kTileK;
        if (more) act.start(pending, act_buf(slot ^ 1), M, k_next, K);
        if (active) {
#pragma unroll
            for (int gi = 0; gi < kGroups; ++gi) {
                if ((odd ^ gi) & 1) group_step(second, first, cw + gi * F, act_buf(slot), gi * F, F);
                else group_step(first, second, cw + gi * F, act_buf(slot), gi * F, F);
            }
        }
        if (more) act.finish(pending, act_buf(slot ^ 1), M, k_next, K);
        window_done();
    }
    if (cw < c_end) {  // the last, partial window
        __syncthreads();
        if (active) {
#pragma unroll
            for (int gi = 0; gi < kGroups; ++gi) {
                const unsigned c = cw + gi * F;
                if (c < c_end) {
                    const unsigned valid = min(c_end - c, (unsigned)F);
                    if ((odd ^ gi) & 1) group_step(second, first, c, act_buf(slot), gi * F, valid);
                    else group_step(first, second, c, act_buf(slot), gi * F, valid);
                }
            }
        }
        window_done();
    }

    Ep ep = ep_in;
    ep.init();  // every thread of the block calls it (a stand-in may hold a barrier)
    ep.select_column_block(group * kWarps * R * 16);
    // D fragment: acc[r][i] = (row g, tokens 8i + 2t, 8i + 2t + 1), (row g + 8, the same tokens)
    if (sk.splits == 1 || !Ep::kSplitK) {
        if (!active) return;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < T; ++i)
#pragma unroll
                for (int v = 0; v < 4; ++v) {
                    const unsigned n = (tile0 + r) * 16 + g + 8 * (v >> 1), token = 8 * i + 2 * t + (v & 1);
                    if (token < M && n < N) ep.store(token, n, N, acc[r][i][v]);
                }
        return;
    }
    if constexpr (kCluster > 1) {
        // The splits of this row group are the kCluster blocks of one thread-block cluster (grid y):
        // each leaves its fp32 partial in its own shared memory, and each adds up a kCluster-th of
        // the outputs from all of them through distributed shared memory, in split order.
        constexpr unsigned kRows = kWarps * R * 16;
        static_assert(kRows * 8 * T * 4 <= 2 * Win::kBytes, "the partial fits in the activation buffers");
        float* red = reinterpret_cast<float*>(smem_raw);  // [token][kRows]
        __syncthreads();  // every warp is done with the activation buffers
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < T; ++i)
#pragma unroll
                for (int v = 0; v < 4; ++v) {
                    const unsigned n = (warp * R + r) * 16 + g + 8 * (v >> 1), token = 8 * i + 2 * t + (v & 1);
                    if (token < M) red[token * kRows + n] = acc[r][i][v];
                }
        cluster_sync();
        const unsigned quads = kRows / 4 * M, share = (quads + kCluster - 1) / kCluster;
        const unsigned q_end = min(quads, (split + 1) * share);
        for (unsigned q = split * share + threadIdx.x; q < q_end; q += kThreads) {
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int s = 0; s < kCluster; ++s) {
                const float4 p = load_cluster(reinterpret_cast<const float4*>(red) + q, s);
                sum = make_float4(__fadd_rn(sum.x, p.x), __fadd_rn(sum.y, p.y), __fadd_rn(sum.z, p.z), __fadd_rn(sum.w, p.w));
            }
            const unsigned token = q / (kRows / 4), n = group * kRows + q % (kRows / 4) * 4;
            const float v[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (n + c < N) ep.store(token, n + c, N, v[c]);
        }
        cluster_sync_relaxed();  // the peers' shared memory stays until every block has read it
        return;
    }
    const unsigned ld = row_tiles * 16;
    if (active) {
        float* part = sk.partials + (size_t)split * M * ld;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < T; ++i)
#pragma unroll
                for (int v = 0; v < 4; ++v) {
                    const unsigned n = (tile0 + r) * 16 + g + 8 * (v >> 1), token = 8 * i + 2 * t + (v & 1);
                    if (token < M && tile0 + r < row_tiles) __stcg(part + (size_t)token * ld + n, acc[r][i][v]);
                }
    }
    if (!arrive_last(sk, group, &last_block)) return;
    // The reduction is latency-bound. Few outputs (small M): one output per thread, whose split loads
    // the compiler issues together. More: 4 groups of 4 adjacent outputs (float4) per thread with 4
    // splits of each in flight. Either way the splits are added in order.
    const unsigned rows = kWarps * R * 16, n0 = group * rows, quads = rows / 4 * M;
    if (rows * M <= kThreads) {
        reduce_splits_each(sk, ep, n0, rows, M, N, ld);
    } else {
        reduce_splits<4, 4>(sk, ep, group, rows, quads, M, N, ld);
    }
    if (threadIdx.x == 0) sk.counters[group] = 0u;
}

}  // namespace gemm
