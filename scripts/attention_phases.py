#!/usr/bin/env python3
"""Where a batch-1 decode attention launch's time goes, block by block: an instrumented copy of
``raw_kernels/attention.cu`` in which thread 0 of each block records ``clock64`` and
``%globaltimer`` at the phase boundaries (PDL wait, compaction, the first tile's rows, the tiles'
math, the partial stores, the arrival, the merge) into ``__device__`` arrays, graph-replayed like
`benchmarks/bench_attention.py`; the library's own kernel is timed beside it. Prints per phase the
median and the largest cycle count over the blocks, and when the blocks finished. Needs a GPU.

    PYTHONPATH=. python3 scripts/attention_phases.py [--blocks]     # --blocks: every block's line

Cycle counts are of each block's own SM clock; a phase a block does not run (the merge of a block
that is not the last to arrive) is left out. The last-block merge path records its merge only in
the block that ran it in the last launch replayed, so its "merge" statistics mix launches.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

BF16 = ml_dtypes.bfloat16
MAX_BLOCKS = 256
PHASES = ("entry", "wait", "compacted", "first tile", "tiles", "stored", "arrived", "merged")
# (text in the kernel, the text with a mark before or after it); each text occurs exactly once
MARKS = (
    ("    pdl::wait_prior();\n    extern __shared__", "    PHASE(0);\n    pdl::wait_prior();\n    PHASE(1);\n    extern __shared__"),
    ("    const __nv_bfloat16* swa_b = start ?", "    PHASE(2);\n    const __nv_bfloat16* swa_b = start ?"),
    ("        cp_async_wait_one();\n        __syncthreads();\n",
     "        cp_async_wait_one();\n        __syncthreads();\n        if (tile == 0) PHASE(3);\n"),
    ("    // ---- epilogue: per-head factor", "    PHASE(4);\n    // ---- epilogue: per-head factor"),
    ("    if (splits == 1 || !counters) return;", "    PHASE(5);\n    if (splits == 1 || !counters) return;"),
    ("        const int quads = D / 4, items", "        PHASE(6);\n        const int quads = D / 4, items"),
    ("        if (tid == 0 && atomicAdd(counter, 1u) == 2u", "        PHASE(7);\n        if (tid == 0 && atomicAdd(counter, 1u) == 2u"),
    ("    if (!last_block) return;", "    PHASE(6);\n    if (!last_block) return;"),
    ("    if (tid == 0) *counter = 0u;", "    PHASE(7);\n    if (tid == 0) *counter = 0u;"),
)
RECORDER = f"""
__device__ unsigned long long attn_phase_clock[{MAX_BLOCKS}][8];
__device__ unsigned long long attn_phase_time[{MAX_BLOCKS}][8];
__device__ unsigned attn_phase_sm[{MAX_BLOCKS}];
#define PHASE(i) do {{ if (threadIdx.x == 0) {{                                                   \\
    unsigned long long t_; unsigned sm_;                                                        \\
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                      \\
    asm("mov.u32 %0, %%smid;" : "=r"(sm_));                                                     \\
    const unsigned b_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);         \\
    if (b_ < {MAX_BLOCKS}) {{ attn_phase_clock[b_][i] = clock64(); attn_phase_time[b_][i] = t_; attn_phase_sm[b_] = sm_; }} \\
}} }} while (0)
"""


def instrumented_source(source: str) -> str:
    """``source`` (attention.cu with its headers) with the recorder and every phase mark; raises
    ValueError naming a mark whose text is not found exactly once (the kernel changed)."""
    for text, marked in MARKS:
        if source.count(text) != 1:
            raise ValueError(f"attention.cu: expected the text {text.strip()!r} once, found it {source.count(text)} times")
        source = source.replace(text, marked)
    kernel = source.index('extern "C" __global__ void __launch_bounds__(kThreads, 2)\nsparse_decode_attention(')
    return source[:kernel] + RECORDER + source[kernel:]


def summary(clock: np.ndarray, time_ns: np.ndarray, blocks: int) -> list[str]:
    """Per phase the median and largest cycle count from the phase before, over the blocks that
    recorded both, and when the blocks finished (µs after the first block's entry)."""
    lines = []
    for i in range(1, len(PHASES)):
        both = [int(clock[b, i] - clock[b, i - 1]) for b in range(blocks) if clock[b, i] and clock[b, i - 1]]
        both = [c for c in both if c >= 0]  # a stamp left by an earlier launch precedes this one's
        if both:
            lines.append(f"  {PHASES[i - 1]} -> {PHASES[i]}: median {statistics.median(both):.0f} cycles, "
                         f"max {max(both)} ({len(both)} blocks)")
    start = time_ns[:blocks, 0].min()
    ends = sorted(float(time_ns[b][time_ns[b] > 0].max() - start) / 1e3 for b in range(blocks))
    lines.append(f"  blocks finished: first {ends[0]:.2f} us, median {ends[len(ends) // 2]:.2f}, last {ends[-1]:.2f}")
    return lines


def main(argv: list[str]) -> int:
    import cupy as cp
    from common import graph_us

    from fp4kit.layers.attention import SparseAttention
    from fp4kit.ops import attention as ops
    from fp4kit.runtime import loader

    source = instrumented_source(loader.kernel_source("attention"))
    library_source = loader.kernel_source
    rng = np.random.default_rng(0)
    heads, dim, window, selected = 64, 512, 128, 512
    for capacity, live, spread in ((4096, 4096, True), (4096, 4096, False), (2048, 1024, True)):
        ops.SPREAD_MERGE = spread
        att = SparseAttention(heads, dim)
        q = cp.asarray(rng.standard_normal((1, heads, dim)).astype(BF16))
        swa = cp.asarray(rng.standard_normal((1, window, dim)).astype(BF16))
        pos = cp.full(1, 1000, cp.int32)
        comp = cp.asarray(rng.standard_normal((1, capacity, dim)).astype(BF16))
        comp_len = cp.full(1, live, cp.int32)
        idx = cp.asarray(rng.choice(live, selected, replace=False)[None].astype(np.int32))
        call = lambda i: att(q, swa, pos, comp, comp_len, idx)  # noqa: E731
        library_us = graph_us(call)
        loader.kernel_source = lambda name: source if name == "attention" else library_source(name)
        loader._kernels = type(loader._kernels)()  # the next launch builds the instrumented copy
        try:
            module = loader.get_module("attention")
            arrays = {name: cp.ndarray(shape, dtype, module.get_global(name)) for name, shape, dtype in (
                ("attn_phase_clock", (MAX_BLOCKS, 8), cp.uint64), ("attn_phase_time", (MAX_BLOCKS, 8), cp.uint64),
                ("attn_phase_sm", (MAX_BLOCKS,), cp.uint32))}
            for a in arrays.values():
                a.fill(0)
            probed_us = graph_us(call)
            clock, time_ns, sm = (arrays[n].get().astype(np.int64) for n in
                                  ("attn_phase_clock", "attn_phase_time", "attn_phase_sm"))
        finally:
            loader.kernel_source = library_source
            loader._kernels = type(loader._kernels)()
        blocks = int((clock[:, 0] > 0).sum())
        print(f"capacity {capacity}, {live} live, spread merge {spread}: {library_us:.2f} us a launch "
              f"({probed_us:.2f} instrumented), {blocks} blocks on {len(set(sm[:blocks].tolist()))} SMs")
        print("\n".join(summary(clock, time_ns, blocks)))
        for b in range(blocks if "--blocks" in argv else 0):
            steps = " ".join(f"{PHASES[i]}={clock[b, i] - clock[b, i - 1]}" for i in range(1, 8)
                             if clock[b, i] and clock[b, i - 1])
            print(f"  block {b:3d} SM {sm[b]:3d}: {steps}")
    ops.SPREAD_MERGE = True
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
