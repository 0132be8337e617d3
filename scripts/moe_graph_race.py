"""bench_moe's graph timing against its eager first call, on the V3 MoE layer (W4A16) with every
sorted-path fusion (the defect of the benchmark the README's MoE section describes, at T = 4096): each try makes one eager call on the
default stream, captures ``ROTATE`` calls on a non-blocking stream and launches the graph, either at
once (``graph_us`` before its synchronisation) or after ``Device().synchronize()`` (after). It then
reports whether the eager call was still running when the graph was launched, and, once the device
is idle, the layer's dispatch counters, which are zero between serialized calls (``_counts``: the
router's per-expert counts, ``_dispatch_done``: its arrival counter). The synchronised order runs
first: an illegal address ends the process's CUDA context. H100, 2026-12-06, ``--tries=3``: synced
tries clean; unsynced, the first launched the graph while the eager call ran, the second faulted.

    .venv/bin/python scripts/moe_graph_race.py [--tries=5] [--tokens=4096] [--orders=synced,unsynced]
"""

from __future__ import annotations

import os
import sys

import cupy as cp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_moe import CONFIGS, ROTATE, SORTED_EVERY_FUSION, build  # noqa: E402
from fp4kit.layers import moe as moe_layer  # noqa: E402


def one_try(layer, xs, synced: bool) -> tuple[bool, int, int]:
    """(eager call still running at the graph's launch, sum of counts, arrival counter) after one try."""
    layer(xs[0])  # eager, default stream
    eager_done = cp.cuda.Event(disable_timing=True)
    eager_done.record()
    if synced:
        cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for j in range(ROTATE):
            layer(xs[j])
        graph = stream.end_capture()
        overlapped = not eager_done.done
        graph.launch(stream)
    cp.cuda.Device().synchronize()
    return overlapped, int(layer._counts.sum()), int(layer._dispatch_done[0])


def main() -> None:
    tries, t, orders = 5, 4096, ("synced", "unsynced")
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key == "--tries":
            tries = int(value)
        elif key == "--tokens":
            t = int(value)
        elif key == "--orders":
            orders = tuple(value.split(","))
    cfg = CONFIGS["V3"]
    layer, _ = build(cfg, "w4a16")
    layer.small_max_assignments = 0
    for name, value in SORTED_EVERY_FUSION.items():
        setattr(moe_layer, name, value)
    rng = np.random.default_rng(0)
    xs = [cp.asarray(rng.standard_normal((t, cfg["hidden"])).astype(ml_dtypes.bfloat16)) for _ in range(ROTATE)]
    layer(xs[0])  # compile, plan
    cp.cuda.Device().synchronize()
    for order in orders:
        for i in range(tries):
            try:
                overlapped, counts, done = one_try(layer, xs, order == "synced")
            except cp.cuda.runtime.CUDARuntimeError as err:
                print(f"{order} try {i}: {err}", flush=True)
                return
            state = "clean" if counts == 0 and done == 0 else "COUNTERS LEFT NONZERO"
            print(f"{order} try {i}: eager call still running at the graph's launch: {overlapped}; "
                  f"sum(counts) {counts}, arrival counter {done}: {state}", flush=True)


if __name__ == "__main__":
    main()
