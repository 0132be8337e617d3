// Prefix sums over one block of up to 1024 threads (32 warps): a shuffle scan within each warp,
// then one over the warp totals. The order of additions is fixed, so results are deterministic. Every
// thread of the block must call; each call ends with a barrier, so its scratch can be reused at once.
#pragma once

// Inclusive scan of v without the closing barrier; warp_totals ([32], shared) then holds the
// inclusive sums of the warps.
template <typename T>
__device__ __forceinline__ T block_scan_open(T v, T* warp_totals) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const T x = __shfl_up_sync(0xFFFFFFFFu, v, off);
        if (lane >= (unsigned)off) v += x;
    }
    if (lane == 31) warp_totals[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T x = lane < blockDim.x / 32 ? warp_totals[lane] : T(0);  // blocks of fewer than 32 warps
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const T y = __shfl_up_sync(0xFFFFFFFFu, x, off);
            if (lane >= (unsigned)off) x += y;
        }
        warp_totals[lane] = x;
    }
    __syncthreads();
    return warp ? v + warp_totals[warp - 1] : v;
}

// Inclusive scan of v; warp_totals is [32] of shared memory.
template <typename T>
__device__ __forceinline__ T block_inclusive_scan(T v, T* warp_totals) {
    const T r = block_scan_open(v, warp_totals);
    __syncthreads();
    return r;
}

// Exclusive scan of v; `total` receives the sum over the block.
__device__ __forceinline__ unsigned block_exclusive_scan(unsigned v, unsigned& total) {
    __shared__ unsigned warp_totals[32];
    const unsigned before = block_scan_open(v, warp_totals) - v;
    total = warp_totals[31];
    __syncthreads();
    return before;
}
