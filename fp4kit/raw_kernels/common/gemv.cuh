// The engine's decode-size kernels (M <= 8): the same tiled weight, dequantization and mma.sync as
// gemm_block, with the K split inside the block instead of across blocks. A block of 8 warps owns
// RT row tiles (16 rows each); the 8 / RT warps of a row tile each take a slice of the block's K
// range in whole scale groups (256 k), stage their own activation slice F tiles at a time in a
// private double buffer (no block barrier in the mainloop), and the slices are added in shared
// memory in slice order. Each warp keeps two groups of F weight tiles in flight. A global split-K (the last block of a row group adds the splits in order) is
// left for weights with too few row tiles to fill the GPU.
//
// Why: with the K split across blocks, an M = 1 call ends in a chain of global round trips (the
// partials, a fence, a counter, the last block's reads of every split) that costs more than
// streaming a small weight; here a row tile's 16 rows x K are read by one block, so the whole
// weight is in flight at once and the sum is one shared-memory step.
#pragma once

#include "gemm_engine.cuh"

namespace gemm {

// Wait until at most n of this thread's cp.async commit groups are pending (n past 7: 7, i.e.
// waits for more than asked, never fewer).
__device__ __forceinline__ void cp_async_wait_pending(unsigned n) {
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
        case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
        case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
        case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    }
}

// A warp's activation buffer: token rows of F tiles (F * 64 bf16) plus 16 bytes of padding; only
// the M rows that exist are stored (lanes of tokens past M multiply zeros without reading).
template <int F>
struct GemvSlot {
    static constexpr int kStride = F * kTileK + 8;
};

// bf16 activation [M, K] (row stride `ld`, 0: K): the F tiles from chunk c of tokens 0 .. M-1 into
// a slot with 16-byte cp.async copies, zero past the slice (c_end chunks) and past K. Grouped
// (`group_rows` > 0): weight rows [g group_rows, (g + 1) group_rows) read columns [g K, (g + 1) K)
// of an activation [M, G K] (`for_tile` moves x to the tile's group; a block's row tiles share one).
template <int F>
struct WarpActBf16 {
    const __nv_bfloat16* x;
    unsigned ld = 0, group_rows = 0;
    struct Pending {};
    static constexpr bool kAsyncCopies = true;  // one finish completes every start before it
    __device__ __forceinline__ void for_tile(unsigned tile, unsigned K) {
        if (group_rows) x += (size_t)(tile * 16 / group_rows) * K;
    }
    __device__ __forceinline__ void init(unsigned*) {}
    __device__ __forceinline__ void start(Pending&, __nv_bfloat16* slot, unsigned M, unsigned c, unsigned c_end,
                                          unsigned K, unsigned lane) const {
        constexpr unsigned kPerRow = F * kTileK / 8;  // copies per token row
        const unsigned k_end = min(K, c_end * kTileK), stride = ld ? ld : K;
        for (unsigned i = lane; i < M * kPerRow; i += 32) {
            const unsigned m = i / kPerRow, col = i % kPerRow * 8, k = c * kTileK + col;
            const bool valid = k < k_end;  // K and k_end are multiples of 16, k of 8: all 8 in or all out
            cp_async16(slot + m * GemvSlot<F>::kStride + col, valid ? x + (size_t)m * stride + k : x, valid);
        }
        asm volatile("cp.async.commit_group;");
    }
    __device__ __forceinline__ void finish(Pending&, __nv_bfloat16*, unsigned) const {
        asm volatile("cp.async.wait_all;" ::: "memory");
    }
};

// NVFP4 activation (linear layout): the code bytes and scale of each 16-element block are loaded
// into registers by `start` and decoded into the slot by `finish` (the shared decode table of
// ActNvfp4), so the loads of the next tiles are in flight while the current ones are multiplied.
template <int F>
struct WarpActNvfp4 {
    const unsigned char* packed;  // [M, K/2]
    const unsigned char* scales;  // [M, K/16]
    const unsigned* table;
    static constexpr int kBlocks = 8 * F * 4 / 32;  // per lane: 8 tokens x 4F blocks of 16
    using Pending = Nvfp4Blocks<kBlocks>;
    static constexpr bool kAsyncCopies = false;  // each start needs its own finish
    __device__ __forceinline__ void for_tile(unsigned, unsigned) {}  // not grouped
    __device__ __forceinline__ void init(unsigned* shared_table) {
        table = shared_table;
        fill_code_table(shared_table);
    }
    __device__ __forceinline__ void start(Pending& pd, __nv_bfloat16*, unsigned M, unsigned c, unsigned c_end,
                                          unsigned K, unsigned lane) const {
        const unsigned k_end = min(K, c_end * kTileK);
#pragma unroll
        for (int p = 0; p < kBlocks; ++p) {
            const unsigned i = p * 32 + lane, m = i / (4 * F), k = c * kTileK + i % (4 * F) * 16;
            pd.codes[p] = make_uint2(0u, 0u);
            pd.scale[p] = 0u;
            if (m < M && k < k_end) {
                pd.codes[p] = *reinterpret_cast<const uint2*>(packed + (size_t)m * (K / 2) + k / 2);
                pd.scale[p] = scales[(size_t)m * (K / 16) + k / 16];
            }
        }
    }
    __device__ __forceinline__ void finish(Pending& pd, __nv_bfloat16* slot, unsigned M) const {
        const unsigned lane = threadIdx.x % 32;
#pragma unroll
        for (int p = 0; p < kBlocks; ++p) {
            const unsigned i = p * 32 + lane, m = i / (4 * F), b = i % (4 * F);
            if (m >= M) continue;
            unsigned h[8];
            decode_block16(pd.codes[p], pd.scale[p], table, h);
            uint4* dst = reinterpret_cast<uint4*>(slot + m * GemvSlot<F>::kStride + 16 * b);
            dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
            dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
        }
    }
};

// One block of the GEMV: row tiles RT * block_row .. + RT - 1 times tokens 0 .. M - 1 (M <= 8) over
// the K range of split `split` (sk.chunks_per_split, a multiple of the 4 tiles of a scale group),
// by W warps (8, or 16 where a grid of 8-warp blocks would leave an SM with 8 warps: the mainloop
// is issue-bound there, and twice the warps give each scheduler four to interleave).
// Dynamic shared memory: W warps x 2 slots x M rows (gemm.py `gemv_shared_bytes`).
//
// kResident (with kWhole): the activation is staged once, before the mainloop, as one slot per
// scale group of M + 1 token rows (row M zero, read by the lanes of tokens past M): by the block
// for all its warps where it has several row tiles, else by each warp for its own K slice. The
// mainloop then has no staging, no slot hand-over and no zeroing of absent tokens. Dynamic shared
// memory: gemm.py `gemv_resident_bytes`. kPipelined (one row tile per block, bf16 activation): each
// group's copies are a commit group of their own and the mainloop waits for a group's just before
// multiplying it, so a slice of several groups overlaps their arrival with the first groups' work.
template <int RT, int F, class Act, int W = kWarps, bool kWhole = false, bool kResident = false,
          bool kPipelined = false>
__device__ void gemv_block(const uint4* w_codes, const uint2* w_scales, Act act, const Epilogue& ep_in, unsigned M,
                           unsigned N, unsigned K, unsigned block_row, unsigned split, const SplitK& sk,
                           bool release) {
    static_assert(W % RT == 0 && W >= kWarps, "whole K slices per row tile; the code table needs 256 threads");
    // kWhole: the launcher guarantees that every slice is whole fetches (F = 4 tiles, one scale
    // group, over a K of whole groups), so no tile of a fetch is past the slice's end and the
    // per-tile bounds tests go (gemm.py `GEMV_WHOLE_FETCHES`); the same arithmetic in the same order
    static_assert(!kWhole || F == kGroupChunks, "whole fetches are one scale group");
    static_assert(!kResident || kWhole, "the resident activation is staged in whole scale groups");
    constexpr int kSlices = W / RT;
    constexpr int kStride = GemvSlot<F>::kStride;
    static_assert(F % kGroupChunks == 0, "a fetch is whole scale words");
    extern __shared__ uint4 smem_raw[];
    __shared__ unsigned code_table[32 * W];  // the 256 codes; a 16-warp block's upper threads fill a copy nobody reads
    __shared__ float red[W][4][32];  // each warp's accumulator fragment, for the slice sum
    __shared__ unsigned last_block;

    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const unsigned rt = warp / kSlices, slice = warp % kSlices;
    const unsigned row_tiles = (N + 15) / 16, chunks = (K + kTileK - 1) / kTileK;
    const unsigned groups = (chunks + kGroupChunks - 1) / kGroupChunks;
    const unsigned tile = block_row * RT + rt;
    const bool active = tile < row_tiles;  // warp-uniform
    // this warp's slice of the split's scale groups (balanced; a slice may be empty)
    const unsigned s_begin = split * (sk.chunks_per_split / kGroupChunks);
    const unsigned s_count = min(groups, s_begin + sk.chunks_per_split / kGroupChunks) - s_begin;
    const unsigned c_begin = (s_begin + slice * s_count / kSlices) * kGroupChunks;
    const unsigned c_end = min(chunks, (s_begin + (slice + 1) * s_count / kSlices) * kGroupChunks);
    const bool works = active && c_begin < c_end;
    const unsigned long long policy = evict_first_policy();
    act.for_tile(min(tile, row_tiles - 1), K);

    const uint4* code_next = w_codes + ((size_t)min(tile, row_tiles - 1) * chunks + c_begin) * 32 + lane;
    const uint2* scale_next = w_scales + ((size_t)min(tile, row_tiles - 1) * groups + c_begin / kGroupChunks) * 32 + lane;
    auto fetch = [&](unsigned c, WeightGroup<1, F>& wg) {
#pragma unroll
        for (int j = 0; j < F; ++j)
            wg.codes[0][j] = kWhole || c + j < c_end ? load_stream(code_next + j * 32, policy) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int w = 0; w < F / kGroupChunks; ++w)
            wg.scales[0][w] = kWhole || c + w * kGroupChunks < c_end ? load_stream(scale_next + w * 32, policy)
                                                                     : make_uint2(0u, 0u);
        code_next += F * 32;
        scale_next += F / kGroupChunks * 32;
    };

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    // tiles j < valid of a fetched group against the slot's activation (token g of this lane)
    auto compute = [&](const WeightGroup<1, F>& wg, const __nv_bfloat16* slot, unsigned valid) {
        const bool has_token = g < M;
        const unsigned row = kResident ? min(g, M) : g;  // resident slots: row M is zero
#pragma unroll
        for (int j = 0; j < F; ++j) {
            if (!kWhole && j >= valid) break;
            unsigned sc_g, sc_g8;
            const uint2 sw = wg.scales[0][j / kGroupChunks];
            if (j % 4 == 0) scale_pairs<0>(sw, sc_g, sc_g8);
            if (j % 4 == 1) scale_pairs<1>(sw, sc_g, sc_g8);
            if (j % 4 == 2) scale_pairs<2>(sw, sc_g, sc_g8);
            if (j % 4 == 3) scale_pairs<3>(sw, sc_g, sc_g8);
            const uint4 q4 = wg.codes[0][j];
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // steps 2h, 2h + 1 share one 16-byte activation load
                const uint4* src = reinterpret_cast<const uint4*>(slot + row * kStride + j * kTileK + 16 * t + 8 * h);
                const uint4 b = kResident || has_token ? *src : make_uint4(0u, 0u, 0u, 0u);
                unsigned a[4];
                dequant_step(h ? q4.z : q4.x, sc_g, sc_g8, a);
                mma_bf16(acc, a, b.x, b.y);
                dequant_step(h ? q4.w : q4.y, sc_g, sc_g8, a);
                mma_bf16(acc, a, b.z, b.w);
            }
        }
    };

    // two groups in flight from the start (the second is not held back behind the activation's
    // arrival); each group's buffer is refilled with the group after next once it is multiplied
    WeightGroup<1, F> first_group, second;
    if (works) {
        fetch(c_begin, first_group);
        if (c_begin + F < c_end) fetch(c_begin + F, second);
    }
    // a single-wave launch may let the next kernel's blocks in now (common/pdl.cuh): they take the SMs
    // this grid leaves free or frees, and issue their own weights while this one drains
    if (release) pdl::release_next();
    pdl::wait_prior();  // the weights are in flight; everything below may depend on the kernel before
    // The raw output factors and bias of this lane's two rows (g, g + 8), loaded now so that their
    // round trip overlaps the mainloop instead of following it (`Epilogue::preload`)
    // (4-tile fetches only: the 8-tile builds would spill the registers)
    constexpr bool kPreload = F == kGroupChunks;
    Epilogue ep = ep_in;
    Epilogue::Row out_rows[2] = {};
    if constexpr (kPreload) {
        ep.preload();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned n = tile * 16 + g + 8 * h;
            if (sk.splits == 1 && active && n < N) out_rows[h] = ep.row(n);
        }
    }
    // the mainloop: the two groups in turn, `step(group, c, s)` multiplying tiles c .. c + F - 1 held
    // in `group` (s: its parity) and refilling it
    auto each_group = [&](auto&& step) {
        for (unsigned c = c_begin; c < c_end; c += 2 * F) {
            step(first_group, c, 0u);
            if (c + F < c_end) step(second, c + F, 1u);
        }
    };
    typename Act::Pending pending;
    act.init(code_table);
    __syncthreads();  // the decode table
    if constexpr (kResident) {
        // Slots of M + 1 token rows (row M zero), one per scale group. With several row tiles per
        // block their warps share one staging of the split's K range (block barrier); with one, a
        // warp's slice is read by it alone, so each warp stages its own slice (no block barrier:
        // with every warp waiting for the whole block's copies, measured slower than the double
        // buffer at one row tile per block).
        constexpr bool kPerWarp = RT == 1;
        constexpr bool kPipe = kPipelined && kPerWarp && Act::kAsyncCopies;
        const unsigned blk_begin = s_begin * kGroupChunks, blk_end = min(chunks, (s_begin + s_count) * kGroupChunks);
        const unsigned slot_elems = (M + 1) * kStride;
        const unsigned first = kPerWarp ? c_begin : blk_begin, last = kPerWarp ? c_end : blk_end;
        const unsigned count = last > first ? (last - first) / kGroupChunks : 0u;
        __nv_bfloat16* base = reinterpret_cast<__nv_bfloat16*>(smem_raw) +
                              (kPerWarp ? (size_t)warp * ((s_count + kSlices - 1) / kSlices) * slot_elems : 0);
        const unsigned stager = kPerWarp ? 0u : warp, stagers = kPerWarp ? 1u : W;
        const unsigned tid = kPerWarp ? lane : threadIdx.x, threads = kPerWarp ? 32u : 32u * W;
        constexpr unsigned kRowVecs = kStride / 8;  // 16-byte words per token row
        for (unsigned i = tid; i < count * kRowVecs; i += threads)
            reinterpret_cast<uint4*>(base + (i / kRowVecs) * slot_elems + M * kStride)[i % kRowVecs] = make_uint4(0u, 0u, 0u, 0u);
        for (unsigned i = stager; i < count; i += stagers) {
            act.start(pending, base + i * slot_elems, M, first + i * kGroupChunks, last, K, lane);
            if constexpr (!Act::kAsyncCopies) act.finish(pending, base + i * slot_elems, M);
        }
        if constexpr (Act::kAsyncCopies && !kPipe) act.finish(pending, base, M);
        if constexpr (kPerWarp) __syncwarp();  // the warp's slots (pipelined: its zero rows), seen by all its lanes
        else __syncthreads();  // every slot staged, seen by every warp
        if (works) {
            auto slot_of = [&](unsigned c) { return base + (c - first) / F * slot_elems; };
            auto arrived = [&](unsigned c) {  // pipelined: the group at chunk c has landed, for every lane
                if constexpr (kPipe) {
                    cp_async_wait_pending(count - 1 - (c - first) / F);
                    __syncwarp();
                }
            };
            each_group([&](WeightGroup<1, F>& cur, unsigned c, unsigned) {
                arrived(c);
                compute(cur, slot_of(c), F);
                if (c + 2 * F < c_end) fetch(c + 2 * F, cur);
            });
        }
        if constexpr (kPipe) asm volatile("cp.async.wait_all;" ::: "memory");  // none left in flight at exit
    } else {
        __nv_bfloat16* slots = reinterpret_cast<__nv_bfloat16*>(smem_raw) + (size_t)warp * 2 * M * kStride;
        auto slot = [&](unsigned s) { return slots + s * M * kStride; };
        if (works) {
            act.start(pending, slot(0), M, c_begin, c_end, K, lane);
            act.finish(pending, slot(0), M);
            __syncwarp();
            // group `cur` (tiles c .. c + F - 1) against slot s while the next group's activation loads
            each_group([&](WeightGroup<1, F>& cur, unsigned c, unsigned s) {
                const bool more = c + F < c_end;
                if (more) act.start(pending, slot(s ^ 1), M, c + F, c_end, K, lane);
                compute(cur, slot(s), kWhole ? F : min(c_end - c, (unsigned)F));
                if (c + 2 * F < c_end) fetch(c + 2 * F, cur);
                if (more) act.finish(pending, slot(s ^ 1), M);
                __syncwarp();  // every lane is done with slot s and sees slot s ^ 1
            });
        }
    }

    // the slices of each row tile, added in slice order by its first warp
#pragma unroll
    for (int v = 0; v < 4; ++v) red[warp][v][lane] = acc[v];
    __syncthreads();
    if (slice == 0) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            float sum = red[warp][v][lane];
#pragma unroll
            for (int s = 1; s < kSlices; ++s) sum = __fadd_rn(sum, red[warp + s][v][lane]);
            acc[v] = sum;
        }
    }
    if constexpr (kPreload) ep.init_preloaded();
    else ep.init();
    ep.select_column_block(block_row * RT * 16);  // here, not before the mainloop: its registers
    // D fragment: acc = (row g, tokens 2t, 2t + 1), (row g + 8, the same tokens)
    if (sk.splits == 1) {
        if (slice != 0 || !active) return;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const unsigned n = tile * 16 + g + 8 * (v >> 1), token = 2 * t + (v & 1);
            if (token < M && n < N) ep.store_row(token, n, N, acc[v], kPreload ? out_rows[v >> 1] : ep.row(n));
        }
        return;
    }
    const unsigned ld = row_tiles * 16;
    if (slice == 0 && active) {
        float* part = sk.partials + (size_t)split * M * ld;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const unsigned n = tile * 16 + g + 8 * (v >> 1), token = 2 * t + (v & 1);
            if (token < M) __stcg(part + (size_t)token * ld + n, acc[v]);
        }
    }
    if (!arrive_last(sk, block_row, &last_block)) return;
    if (W == kWarps || threadIdx.x < kThreads) reduce_splits_each(sk, ep, block_row * RT * 16, RT * 16, M, N, ld);  // its stride
    if (threadIdx.x == 0) sk.counters[block_row] = 0u;
}

}  // namespace gemm
