#!/usr/bin/env python3
"""How fast one SM pulls L2-resident bytes, by bytes in flight: a probe for the ≈ 12-14 bytes a
cycle that the attention's first tile (two 32 KB tiles of gathered rows) and the sampler's
finisher (50 KB of candidates) measured with `clock64` stamps. Needs a GPU.

    PYTHONPATH=. python3 scripts/sm_read_rate.py

Each block of the probe kernel reads its own 256 KB region of a buffer that a previous launch left
in the L2: every thread issues `loads` independent loads of `width` bytes (`ld.global.cg`, the L2
path the library's kernels use for data other blocks wrote), waits for them, and repeats until the
region is read; thread 0 stamps `clock64` around the whole read (after a block barrier). Printed
per setting: the bytes in flight per SM (threads x loads x width), the cycles, bytes per cycle per
SM, and the same with one block on every SM at once (the L2's share per SM under full load).
If the rate grows with the bytes in flight up to the largest setting, the first-tile and
finisher reads are latency x concurrency bound (more loads in flight per thread would pay); if it
flattens near 13 bytes a cycle, the limit is per SM.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REGION = 256 * 1024  # bytes read by each block
WIDTHS = (8, 16)
THREADS = (256, 1024)
LOADS = (1, 2, 4, 8, 16)

SOURCE = r"""
template <int kWidth, int kLoads>
__device__ __forceinline__ void read_region(const char* base, unsigned bytes, float& acc) {
    const unsigned step = blockDim.x * kWidth * kLoads;
    for (unsigned at = threadIdx.x * kWidth; at < bytes; at += step) {
        float v[kLoads];
#pragma unroll
        for (int l = 0; l < kLoads; ++l) {
            const char* p = base + at + l * blockDim.x * kWidth;
            if (kWidth == 16) {
                float4 x;
                asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "l"(p));
                v[l] = x.x + x.w;
            } else {
                float2 x;
                asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(x.x), "=f"(x.y) : "l"(p));
                v[l] = x.x + x.y;
            }
        }
#pragma unroll
        for (int l = 0; l < kLoads; ++l) acc += v[l];
    }
}

#define PROBE(W, L)                                                                                   \
    extern "C" __global__ void read_w##W##_l##L(const char* src, unsigned region, long long* cycles,  \
                                                 float* sink) {                                      \
        const char* base = src + (size_t)blockIdx.x * region;                                        \
        float acc = 0.0f;                                                                            \
        __syncthreads();                                                                             \
        const long long t0 = clock64();                                                              \
        read_region<W, L>(base, region, acc);                                                        \
        __syncthreads();                                                                             \
        const long long t1 = clock64();                                                              \
        if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;                                          \
        if (acc == 1.2345f) sink[0] = acc; /* keeps the loads */                                     \
    }
PROBE(8, 1) PROBE(8, 2) PROBE(8, 4) PROBE(8, 8) PROBE(8, 16)
PROBE(16, 1) PROBE(16, 2) PROBE(16, 4) PROBE(16, 8) PROBE(16, 16)
"""


def kernel_names() -> list[str]:
    """Every probe kernel of `SOURCE`, one per (width, loads in flight per thread)."""
    return [f"read_w{w}_l{n}" for w in WIDTHS for n in LOADS]


def main() -> int:
    import cupy as cp
    import numpy as np

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    module = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    src = cp.ones(REGION * sms // 4, cp.float32)  # one region per SM; the whole buffer fits the L2
    cycles = cp.zeros(sms, cp.int64)
    sink = cp.zeros(1, cp.float32)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: {REGION // 1024} KB per block, from the L2")
    print("| width B | threads | loads a thread | KB in flight | 1 block: cycles | B/cycle | every SM: median B/cycle |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for width in WIDTHS:
        for threads in THREADS:
            for loads in LOADS:
                fn = module.get_function(f"read_w{width}_l{loads}")
                args = (src, np.uint32(REGION), cycles, sink)
                fn((sms,), (threads,), args)  # warms the L2 with every region
                fn((1,), (threads,), args)
                fn((1,), (threads,), args)
                one = int(cycles[0].get())
                fn((sms,), (threads,), args)
                every = np.median(REGION / cycles.get().astype(np.float64))
                flight = threads * loads * width / 1024
                print(f"| {width} | {threads} | {loads} | {flight:.0f} | {one} | {REGION / one:.1f} | {every:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
