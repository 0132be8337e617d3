#!/usr/bin/env python3
"""Where a sampler launch's time goes, block by block: an instrumented copy of
``raw_kernels/sampling.cu`` (`phase_probe`) in which thread 0 of each block stamps the phases of
its row (the tokens' load and block maximum, the first row barrier, the histogram pass's local
histogram, its merge and the row barrier after it, the narrowed cut, the race, the finish),
graph-replayed on `benchmarks/bench_sampling.py`'s logits; the library's kernel is timed beside
it. Needs a GPU.

    PYTHONPATH=. python3 scripts/sampler_phases.py [--batches=1,8]

The histogram and merge stamps are the last histogram pass's (a cut with radix passes, or top-k
then top-p, overwrites the first's), and the finish stamp of the row's last block includes the
finisher's work.
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

BF16 = ml_dtypes.bfloat16
VOCAB = 129280
MODES = {"temperature 1.0": dict(temperature=1.0), "top-k 50": dict(top_k=50), "top-p 0.9": dict(top_p=0.9),
         "top-k 50, top-p 0.9": dict(top_k=50, top_p=0.9)}
PHASES = ("entry", "max", "barrier", "histogram", "merged", "narrowed", "raced", "finished")
# (text in the kernel, the text with a mark before or after it); each text occurs exactly once
MERGE = "    smp_merge(sm, cx, nb, kLevel0 ? smp_merge_bound(sm, limit, rem) : nb - 1);\n"
MARKS = (
    ("    const bool odd = smp_load_tile(", "    PHASE(0);\n    const bool odd = smp_load_tile("),
    ("    best = smp_block_max(best, sm);\n", "    best = smp_block_max(best, sm);\n    PHASE(1);\n"),
    ("    smp_barrier(cx);\n    const unsigned nposts", "    smp_barrier(cx);\n    PHASE(2);\n    const unsigned nposts"),
    (MERGE + "    smp_barrier(cx);\n", "    PHASE(3);\n" + MERGE + "    smp_barrier(cx);\n    PHASE(4);\n"),
    ("    // 3. the race over the kept tokens", "    PHASE(5);\n    // 3. the race over the kept tokens"),
    ("    if (tid == 0 && win) atomicMax(cx.rs.race, win);\n",
     "    PHASE(6);\n    if (tid == 0 && win) atomicMax(cx.rs.race, win);\n"),
    ("    smp_finish(sm, cx, b, V, round, next, defer, nr, defer_by_mass, out, status);\n}",
     "    smp_finish(sm, cx, b, V, round, next, defer, nr, defer_by_mass, out, status);\n    PHASE(7);\n}"),
    # the gathered top-k: its own cut (as narrowed) and finish
    ("        smp_gather(sm, t, cx, (unsigned)p.top_k, d_bound);\n",
     "        smp_gather(sm, t, cx, (unsigned)p.top_k, d_bound);\n        PHASE(5);\n"),
    ("p.min_p, ctr, k0, k1});\n        return;", "p.min_p, ctr, k0, k1});\n        PHASE(7);\n        return;"),
    # top-p alone, racing first: its race and front (as raced), and a decided row's finish
    ("        smp_race_front(sm, t, cx, p.min_p, ctr, k0, k1);\n",
     "        smp_race_front(sm, t, cx, p.min_p, ctr, k0, k1);\n        PHASE(6);\n"),
    ("            return smp_finish(sm, cx, b, V, round, next, true, nb, true, out, status);\n",
     "            smp_finish(sm, cx, b, V, round, next, true, nb, true, out, status);\n            PHASE(7);\n            return;\n"),
    ("        if (verdict == kVerdictDecided) return;\n",
     "        if (verdict == kVerdictDecided) {\n            PHASE(7);\n            return;\n        }\n"),
)
ANCHOR = "// One histogram pass: local histogram, merge"


def instrumented_source(source: str) -> str:
    """``source`` (sampling.cu with its headers) with the recorder and every phase mark; raises
    ValueError naming a mark whose text is not found exactly once (the kernel changed)."""
    return phase_probe.instrument(source, MARKS, ANCHOR, "sampling.cu")


def main(argv: list[str]) -> int:
    import cupy as cp
    from common import graph_us

    from fp4kit.layers.sampler import Generator, Sampler
    from fp4kit.runtime import loader

    batches = next((tuple(int(v) for v in a.split("=", 1)[1].split(",")) for a in argv if a.startswith("--batches=")),
                   (1, 8))
    source = instrumented_source(loader.kernel_source("sampling"))
    rng = np.random.default_rng(0)
    for b in batches:
        logits = cp.asarray((rng.standard_normal((b, VOCAB)) * 3).astype(BF16))
        for mode, params in MODES.items():
            sampler = Sampler(Generator(1), **params)
            call = lambda i: sampler(logits)  # noqa: E731
            library_us, probed_us, clock, time_ns, sm, blocks = phase_probe.measure(
                "sampling", source, call, graph_us, cooperative=True)
            print(f"batch {b}, {mode}: {library_us:.2f} us a launch ({probed_us:.2f} instrumented), "
                  f"{blocks} blocks on {len(set(sm[:blocks].tolist()))} SMs")
            print("\n".join(phase_probe.summary(clock, time_ns, blocks, PHASES)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
