#!/usr/bin/env python3
"""The MoE layer with its shared expert folded into the small-T launches against run apart
(`fp4kit.layers.moe.FOLD_SHARED_MAX_TOKENS`'s measurement): V4-Flash widths (`benchmarks/bench_moe.py`
builds the layer), graph-replayed, the two settings alternating round by round, the median of the
rounds per token count. Needs a GPU.

    .venv/bin/python scripts/fold_probe.py [--tokens=1,2,4,6,8] [--modes=w4a16,w4a4] [--rounds=3]
"""

from __future__ import annotations

import os
import statistics
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main(argv: list[str]) -> None:
    import cupy as cp
    import numpy as np
    from bench_moe import CONFIGS, ROTATE, build, launches
    from common import graph_us

    from fp4kit.layers import moe as moe_layer
    from fp4kit.runtime.arrays import BF16

    opts = dict(a.lstrip("-").split("=", 1) for a in argv)
    tokens = tuple(int(v) for v in opts.get("tokens", "1,2,4,6,8").split(","))
    modes = tuple(opts.get("modes", "w4a16,w4a4").split(","))
    rounds = int(opts.get("rounds", "3"))
    moe_layer.FOLD_SHARED_MAX_TOKENS = 1 << 30  # the layer's `fold_shared` switch alone decides
    cfg = CONFIGS["V4-Flash"]
    rng = np.random.default_rng(0)
    print("| mode | T | apart µs (launches) | folded µs (launches) | folded / apart |")
    print("| --- | --- | --- | --- | --- |")
    for mode in modes:
        layer, _ = build(cfg, mode)
        layer.small_max_assignments = 1 << 30  # the small-T path at every T asked for
        for t in tokens:
            xs = [cp.asarray(rng.standard_normal((t, cfg["hidden"])).astype(BF16)) for _ in range(ROTATE)]
            times = {False: [], True: []}
            for _ in range(rounds):
                for fold in (False, True):
                    layer.fold_shared = fold
                    times[fold].append(graph_us(lambda j: layer(xs[j % ROTATE]), calls=ROTATE, replays=20))
            counts = {}
            for fold in (False, True):
                layer.fold_shared = fold
                counts[fold] = launches(lambda: layer(xs[0]))
            apart, folded = statistics.median(times[False]), statistics.median(times[True])
            print(f"| {mode} | {t} | {apart:.1f} ({counts[False]}) | {folded:.1f} ({counts[True]}) | {folded / apart:.3f} |",
                  flush=True)
        del layer
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(sys.argv[1:])
