// Asking the L2 to fetch byte ranges ahead of their use (cp.async.bulk.prefetch.L2, sm_90+).
//
// A decode step has stretches where HBM idles (the attention's latency chain between the query
// projection and the output projection); a kernel in such a stretch can start the next weights on
// their way into the L2, so the GEMM that reads them finds them there. The ranges come in a table
// (fp4kit/runtime/prefetch.py builds it): u64 [2 + 2 * n] = n, chunk bytes, then (address, bytes)
// per range, addresses and sizes multiples of 16, n <= kMaxRanges.
//
// The work is spread over every thread of the launch: chunk c of the ranges laid end to end goes
// to block c % gridDim.x, thread (c / gridDim.x) % blockDim.x (consecutive chunks on different
// SMs, so every SM's bulk-copy unit takes a share). A prefetch is a hint: nothing waits for it,
// nothing is written, and a block does not wait for its prefetches to land before it exits.
#pragma once

namespace l2 {

constexpr int kMaxRanges = 4;

struct Ranges {
    unsigned long long addr[kMaxRanges];
    unsigned long long bytes[kMaxRanges];
    unsigned long long chunk;
    unsigned n;
};

// The table's entries (read-only loads: the table is a constant of the layer, so a kernel may load
// it before it waits for the kernel before it). A null table is no ranges.
__device__ __forceinline__ Ranges load_ranges(const unsigned long long* __restrict__ table) {
    Ranges r;
    r.n = 0;
    r.chunk = 1;
    if (table) {
        r.n = (unsigned)__ldg(table);
        r.chunk = __ldg(table + 1);
#pragma unroll
        for (int i = 0; i < kMaxRanges; ++i) {  // entries past n are never used (the table has them zeroed)
            r.addr[i] = __ldg(table + 2 + 2 * i);
            r.bytes[i] = __ldg(table + 3 + 2 * i);
        }
    }
    return r;
}

__device__ __forceinline__ void prefetch_bytes(unsigned long long addr, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(addr), "r"(bytes) : "memory");
#endif
}

// Issue this thread's chunks of the ranges.
__device__ __forceinline__ void prefetch_share(const Ranges& r) {
    const unsigned long long threads = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long me = (unsigned long long)threadIdx.x * gridDim.x + blockIdx.x;
    unsigned long long first = 0;  // the index of the range's first chunk among all chunks
#pragma unroll
    for (int i = 0; i < kMaxRanges; ++i) {
        if ((unsigned)i >= r.n) break;
        const unsigned long long chunks = (r.bytes[i] + r.chunk - 1) / r.chunk;
        // this thread's first chunk of range i: the smallest c >= first with c = me (mod threads)
        unsigned long long c = first + (me + threads - first % threads) % threads;
        for (; c < first + chunks; c += threads) {
            const unsigned long long offset = (c - first) * r.chunk;
            const unsigned long long left = r.bytes[i] - offset;
            prefetch_bytes(r.addr[i] + offset, (unsigned)(left < r.chunk ? left : r.chunk));
        }
        first += chunks;
    }
}

}  // namespace l2
