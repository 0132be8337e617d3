#!/usr/bin/env python3
"""Where the cluster select of `score_topk` spends its time (`indexer_topk_cluster[_small]`: one
cluster of 8 blocks of 1024 [256] threads per row for caches of more than 8192 entries): an
instrumented copy of ``raw_kernels/indexer.cu`` (`phase_probe`) in which thread 0 of each block
stamps the entry (after the wait for the scoring launch), the scores loaded into registers, the
status barrier, each radix pass's histogram (before its cluster barrier) and decision, the output
positions' block scan, the exchange of the blocks' counts, the writes and the exit;
graph-replayed on the scores of one row (the select alone, on non-negative scores as the
indexer's weighted ReLU sums are). Needs a GPU.

    PYTHONPATH=. python3 scripts/topk_phases.py [--live=32768] [--k=512,2048] [--threads=256,1024] [--rounds=2]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phase_probe  # noqa: E402

phase_probe.PHASE_SLOTS = 16  # 4 passes of two stamps each, and 7 more
PASSES = 4
PHASES = ("entry", "loaded", "flagged", *(f"pass {p} {s}" for p in range(PASSES) for s in ("histogram", "decided")),
          "counted", "totals", "written", "end")
_WRITE = "    cluster_wait();  // the peers are done with this block's shared memory\n}"
# (text in the kernel, the text with marks around it); each text occurs exactly once
MARKS = (
    ("    constexpr unsigned kClusterThreads = kClusterBlocks * kThreads;\n",
     "    constexpr unsigned kClusterThreads = kClusterBlocks * kThreads;\n    PHASE(0);\n"),
    ("    bool flag = keys.load_by_capacity(scores + (size_t)b * C, n, C, vec4 != 0, rank * kThreads + tid, kClusterThreads);\n",
     "    bool flag = keys.load_by_capacity(scores + (size_t)b * C, n, C, vec4 != 0, rank * kThreads + tid, kClusterThreads);\n"
     "    PHASE(1);\n"),
    ("    if (__syncthreads_or(flag) && tid == 0) atomicOr(status, FP4_STATUS_INDEXER_INPUT);\n\n    // As in topk_row",
     "    if (__syncthreads_or(flag) && tid == 0) atomicOr(status, FP4_STATUS_INDEXER_INPUT);\n    PHASE(2);\n\n"
     "    // As in topk_row"),
    ("            cluster_sync();  // every block's histogram of this pass is complete\n",
     "            PHASE(3 + 2 * pass);\n            cluster_sync();  // every block's histogram of this pass is complete\n"),
    ("                    above += c[j];\n                }\n            }\n            __syncthreads();\n",
     "                    above += c[j];\n                }\n            }\n            __syncthreads();\n"
     "            PHASE(4 + 2 * pass);\n"),
    ("    const unsigned long long inclusive = block_inclusive_scan(mine, scan64);\n",
     "    const unsigned long long inclusive = block_inclusive_scan(mine, scan64);\n    PHASE(11);\n"),
    ("    __syncthreads();\n    cluster_arrive();  // no more reads of the peers' shared memory\n",
     "    __syncthreads();\n    PHASE(12);\n    cluster_arrive();  // no more reads of the peers' shared memory\n"),
    (_WRITE, "    PHASE(13);\n" + _WRITE.replace("\n}", "\n    PHASE(14);\n}")),
)
ANCHOR = "// One row's select on the cluster of 8 blocks of kThreads threads this block belongs to.\n"


def instrumented_source(source: str) -> str:
    """``source`` (indexer.cu with its headers) with the recorder and every phase mark; raises
    ValueError naming a mark whose text is not found exactly once (the kernel changed)."""
    return phase_probe.instrument(source, MARKS, ANCHOR, "indexer.cu")


def main(argv: list[str]) -> int:
    import cupy as cp

    from benchmarks.common import graph_us
    from fp4kit.runtime import loader, status

    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    live = int(opts.get("live", 32768))
    ks = [int(v) for v in opts.get("k", "512,2048").split(",")]
    rounds = int(opts.get("rounds", 2))
    builds = {256: "indexer_topk_cluster_small", 1024: "indexer_topk_cluster"}
    threads_list = [int(v) for v in opts.get("threads", "256,1024").split(",")]
    rng = np.random.default_rng(0)
    # scores as the indexer makes them: sums of weighted ReLUs, non-negative
    scores = cp.asarray(np.maximum(rng.standard_normal((1, live)) * 40 + 60, 0).astype(np.float32))
    lengths = cp.full(1, live, cp.int32)
    source = instrumented_source(loader.kernel_source("indexer"))
    for k, threads in ((k, t) for k in ks for t in threads_list):
        indices, values = cp.empty((1, k), cp.int32), cp.empty((1, k), cp.float32)
        args = (scores, lengths, np.uint32(live), np.uint32(k), np.int32(live % 4 == 0), indices, values,
                status.device_word(), np.uint64(0))

        def call(i):
            loader.get_kernel("indexer", builds[threads], block=threads)(8, threads, args)

        for _ in range(rounds):
            library_us, probed_us, clock, time_ns, sm, blocks = phase_probe.measure("indexer", source, call, graph_us)
            print(f"live {live}, k = {k}, {threads} threads a block: {library_us:.2f} us a launch "
                  f"({probed_us:.2f} instrumented), {blocks} blocks")
            print("\n".join(phase_probe.summary(clock, time_ns, blocks, PHASES)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
