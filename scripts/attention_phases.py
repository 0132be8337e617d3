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

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phase_probe  # noqa: E402

MAX_BLOCKS = phase_probe.MAX_BLOCKS

BF16 = ml_dtypes.bfloat16
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
KERNEL = 'extern "C" __global__ void __launch_bounds__(kThreads, 2)\nsparse_decode_attention('


def instrumented_source(source: str) -> str:
    """``source`` (attention.cu with its headers) with the recorder and every phase mark; raises
    ValueError naming a mark whose text is not found exactly once (the kernel changed)."""
    return phase_probe.instrument(source, MARKS, KERNEL, "attention.cu")


def summary(clock: np.ndarray, time_ns: np.ndarray, blocks: int) -> list[str]:
    """Per phase the median and largest cycle count, and when the blocks finished."""
    return phase_probe.summary(clock, time_ns, blocks, PHASES)


def main(argv: list[str]) -> int:
    import cupy as cp
    from common import graph_us

    from fp4kit.layers.attention import SparseAttention
    from fp4kit.ops import attention as ops
    from fp4kit.runtime import loader

    source = instrumented_source(loader.kernel_source("attention"))
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
        library_us, probed_us, clock, time_ns, sm, blocks = phase_probe.measure("attention", source, call, graph_us)
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
