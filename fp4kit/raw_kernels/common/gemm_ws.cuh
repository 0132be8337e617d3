// The warp-specialized wgmma mainloop for many tokens (prefill): 128 weight rows x 8T tokens per
// block (T = 16 or 32), one block per SM, in clusters of C blocks along the row groups (C = 1, 2,
// 4) that share one token chunk. Warps 0-7 (two warpgroups) multiply; warps 8-11 (the copy
// warpgroup, which gives its registers to the multiplying ones) copy, S stages ahead. A stage is
// one 64-k chunk: the chunk's slice of the window image (gemm.cu `gemm_stage_<T>`, wgmma's K-major
// layout), the block's 8 code tiles and, at the first chunk of a scale group, their scale words.
// Each block of a cluster copies a C-th of the activation slice with one bulk copy multicast into
// every block of the cluster (`cp.async.bulk ... .multicast::cluster`), so the L2 serves each slice
// once per cluster; the copy warpgroup's 128 threads copy the weight tiles with 16-byte `cp.async`
// (L2 evict-first), which the stage's `full` mbarrier tracks beside the bulk copies' bytes. A
// multiplying warp reads its tile's codes and scales from the stage, dequantizes the 4 steps into
// registers and issues the stage's 4 MMAs (m64n<8T>k16) as one commit group; once the group of the
// stage before is done (one group stays in flight while the next is dequantized) it frees that
// stage in every block of the cluster (`empty`: one arrival per warp and block).
//
// Why these copies (H100, 4096 x 4096 x 4096, the mainloop without MMAs): one bulk copy per code
// tile and scale word (8-16 per stage) held the copy engine to about one stage per microsecond
// even without the activation, and the activation slices of every block, each read from the L2,
// alone took 196 us against cuBLAS's 177 for the whole GEMM (the L2 serving ~5.5 TB/s).
// The sums are the same per-chunk products in the same order; the end of the block is
// gemm_block's (store_block).
#pragma once

#include "gemm_engine.cuh"

namespace gemm {

constexpr int kWsThreads = kThreads + 128;  // the multiplying warpgroups and the copy warpgroup

// Registers per thread after the copy warpgroup hands its own over (setmaxnreg; the launch gives
// every thread 65536 / 384 = 168): 40 for the copy warpgroup, 232 for the multiplying ones, so a
// 64 x 256 fp32 accumulator (128 registers) and two stages' fragments fit without spilling.
// (Each call sits on its own path to the end of the kernel: ptxas ignores a setmaxnreg whose
// register counts meet again where branches join.) 128 * 56 + 256 * 224 <= 65536.
template <int T>
__device__ __forceinline__ void ws_copier_registers() {
    if constexpr (T > 16) FP4_SM90A("setmaxnreg.dec.sync.aligned.u32 56;");
}
template <int T>
__device__ __forceinline__ void ws_multiplier_registers() {
    if constexpr (T > 16) FP4_SM90A("setmaxnreg.inc.sync.aligned.u32 224;");
}

// One stage of shared memory: the activation slice (8 K-columns of the window layout), the code
// tiles of the block's 8 row tiles (512 B each) and their scale words (256 B each).
template <int T>
struct WsStage {
    static constexpr unsigned kActBytes = 8 * (64 * T + 8) * 2;
    static constexpr unsigned kCodeBytes = kWarps * 512;
    static constexpr unsigned kScaleBytes = kWarps * 256;
    static constexpr unsigned kBytes = kActBytes + kCodeBytes + kScaleBytes;
};

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    FP4_SM90A("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    FP4_SM90A("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    FP4_SM90A("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned ready = 1;
    do {
        FP4_SM90A("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                  : "=r"(ready) : "r"(bar), "r"(parity) : "memory");
    } while (!ready);
}
// global -> shared bulk copy completing on `bar`
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    FP4_SM90A("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
              ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// arrival on the mbarrier at shared address `bar` of block `rank` of the cluster
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar, unsigned rank) {
    FP4_SM90A("{\n\t.reg .b32 remote;\n\tmapa.shared::cluster.u32 remote, %0, %1;\n\t"
              "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n\t}" ::"r"(bar), "r"(rank) : "memory");
}
// global -> shared bulk copy into the same offset of every block in `mask`, completing on the
// mbarrier at the same offset in each
__device__ __forceinline__ void bulk_copy_multicast(unsigned dst, const void* src, unsigned bytes, unsigned bar,
                                                    unsigned short mask) {
    FP4_SM90A("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
              ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(mask) : "memory");
}
__device__ __forceinline__ void cp_async16_hint(unsigned dst, const void* src, unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "l"(policy) : "memory");
}
// this thread's cp.async copies so far arrive on `bar` when complete (counted in its init count)
__device__ __forceinline__ void cp_async_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Block (group, split) of one token chunk: row tiles group * 8 .. + 7, tokens 0 .. M-1 (M <= 8T) of
// the chunk, whose window images start at `image`; the C blocks of a cluster are consecutive row
// groups of the same token chunk and split. Dynamic shared memory: S * WsStage<T>::kBytes.
template <int T, int S, int C, class Ep>
__device__ void gemm_ws_block(const uint4* w_codes, const uint2* w_scales, const __nv_bfloat16* image,
                              const Ep& ep, unsigned M, unsigned N, unsigned K, unsigned group, unsigned split,
                              const SplitK& sk) {
    using Win = Window<T, true>;
    using St = WsStage<T>;
    static_assert(St::kActBytes % (16 * C) == 0, "a block's share of a slice is whole 16-byte units");
    extern __shared__ uint4 smem_raw[];
    __shared__ __align__(8) unsigned long long bars[2 * S];  // full[S], then empty[S]
    __shared__ unsigned last_block;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned row_tiles = (N + 15) / 16, chunks = (K + kTileK - 1) / kTileK;
    const unsigned groups = (chunks + kGroupChunks - 1) / kGroupChunks;
    const unsigned c_begin = split * sk.chunks_per_split, c_end = min(chunks, c_begin + sk.chunks_per_split);
    const unsigned stages0 = shared_address(smem_raw), full0 = shared_address(bars), empty0 = full0 + 8 * S;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(full0 + 8 * s, 1 + 128);  // the bulk copies' expect_tx and the copy threads' cp.async
            mbar_init(empty0 + 8 * s, kWarps * C);
        }
        FP4_SM90A("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if constexpr (C > 1) cluster_sync();  // no block copies into or frees a stage of one not yet set up
    else __syncthreads();

    if (warp >= kWarps) {  // the copy warpgroup: stage i holds chunk c_begin + i in slot i % S
        ws_copier_registers<T>();
        const unsigned ct = threadIdx.x - kThreads, rank = C > 1 ? cluster_rank() : 0u;
        const unsigned long long policy = evict_first_policy();
        // this thread's 16-byte units: code units ct and ct + 128 (tile u / 32), scale unit ct (tile ct / 16)
        auto copy_weights = [&](unsigned i) {
            const unsigned c = c_begin + i, st = stages0 + (i % S) * St::kBytes;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned u = ct + 128 * h;
                const size_t tile = min(group * kWarps + u / 32, row_tiles - 1);  // past N: the last tile again
                cp_async16_hint(st + St::kActBytes + 16 * u, w_codes + (tile * chunks + c) * 32 + u % 32, policy);
            }
            if (c % kGroupChunks == 0) {  // c_begin is a whole scale group
                const size_t tile = min(group * kWarps + ct / 16, row_tiles - 1);
                cp_async16_hint(st + St::kActBytes + St::kCodeBytes + 16 * ct,
                                w_scales + (tile * groups + c / kGroupChunks) * 32 + 2 * (ct % 16), policy);
            }
            cp_async_arrive(full0 + 8 * (i % S));
        };
        auto copy_activation = [&](unsigned i) {  // thread 0 of the copy warpgroup
            const unsigned c = c_begin + i, slot = i % S, bar = full0 + 8 * slot;
            mbar_expect_tx(bar, St::kActBytes);
            constexpr unsigned kShare = St::kActBytes / C;
            const unsigned char* src = reinterpret_cast<const unsigned char*>(
                image + (size_t)(c / Win::kChunks) * (Win::kBytes / 2) + (c % Win::kChunks) * 8 * Win::kColumn);
            const unsigned dst = stages0 + slot * St::kBytes + rank * kShare;
            if constexpr (C > 1) bulk_copy_multicast(dst, src + rank * kShare, kShare, bar, (1u << C) - 1u);
            else bulk_copy(dst, src, kShare, bar);
        };
        const unsigned n = c_end - c_begin, first = min(n, (unsigned)S);
        for (unsigned i = 0; i < first; ++i) copy_weights(i);  // the weights need nothing from before
        if (ct == 0) {
            pdl::wait_prior();  // the images are the staging launch's
            for (unsigned i = 0; i < first; ++i) copy_activation(i);
        }
        for (unsigned i = S; i < n; ++i) {
            mbar_wait(empty0 + 8 * (i % S), (i / S - 1) & 1);  // freed in every block of the cluster
            copy_weights(i);
            if (ct == 0) copy_activation(i);
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        return;  // the copies complete on the stages' barriers, which the multiplying warps wait for
    }
    ws_multiplier_registers<T>();
    float acc[1][T][4];
#pragma unroll
    for (int i = 0; i < T; ++i) acc[0][i][0] = acc[0][i][1] = acc[0][i][2] = acc[0][i][3] = 0.0f;
    {
        pdl::wait_prior();  // the outputs and the split-K scratch are the earlier launches'
        const unsigned code_at = St::kActBytes + threadIdx.x * 16, scale_at = St::kActBytes + St::kCodeBytes + threadIdx.x * 8;
        const unsigned char* stages = reinterpret_cast<const unsigned char*>(smem_raw);
        uint2 sw = make_uint2(0u, 0u);
        // stage i (chunk c): into fragments a (two sets alternate: one stage's MMAs stay in flight)
        auto stage = [&](unsigned i, unsigned c, unsigned (&a)[4][4]) {
            const unsigned slot = i % S;
            const unsigned char* st = stages + slot * St::kBytes;
            mbar_wait(full0 + 8 * slot, (i / S) & 1);
            if (c % kGroupChunks == 0) sw = *reinterpret_cast<const uint2*>(st + scale_at);
            const uint4 q4 = *reinterpret_cast<const uint4*>(st + code_at);
            unsigned sc_g, sc_g8;
            scale_pairs_at(sw, c % kGroupChunks, sc_g, sc_g8);
            dequant_step(q4.x, sc_g, sc_g8, a[0]);
            dequant_step(q4.y, sc_g, sc_g8, a[1]);
            dequant_step(q4.z, sc_g, sc_g8, a[2]);
            dequant_step(q4.w, sc_g, sc_g8, a[3]);
            wgmma_fence();  // a was written by ordinary instructions
            const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(st);
#pragma unroll
            for (int step = 0; step < 4; ++step)
                wgmma_rs<8 * T>(&acc[0][0][0], a[step], wgmma_descriptor(b + step * 2 * Win::kColumn, 2 * Win::kColumn, 128));
            wgmma_commit();
            wgmma_wait<1>();  // the stage before is multiplied: free its slot in every block
            if (i > 0 && lane < C) {
                if constexpr (C > 1) mbar_arrive_cluster(empty0 + 8 * ((i - 1) % S), lane);
                else mbar_arrive(empty0 + 8 * ((i - 1) % S));
            }
        };
        unsigned a0[4][4], a1[4][4];
        unsigned i = 0, c = c_begin;
        for (; c + 1 < c_end; c += 2, i += 2) {
            stage(i, c, a0);
            stage(i + 1, c + 1, a1);
        }
        if (c < c_end) stage(i, c, a0);
        wgmma_wait<0>();
    }
    // every block of the cluster is done copying into and arriving on this one's shared memory
    if constexpr (C > 1) cluster_sync();
    const bool active = (group * kWarps + (warp & ~3u)) < row_tiles;  // warpgroup-uniform
    store_block<1, T, 0>(acc, ep, M, N, group, split, sk, active, reinterpret_cast<float*>(smem_raw), &last_block);
}

}  // namespace gemm
