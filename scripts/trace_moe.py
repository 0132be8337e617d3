#!/usr/bin/env python3
"""Each kernel of a graph-replayed MoE layer call on the GPU's clock (needs a GPU and PyTorch).

`benchmarks/bench_moe.py`'s layer (random weights, V4-Flash or V3 widths) is called on 4 rotated
inputs inside one captured graph; the replays run under `torch.profiler` (CUPTI records the
kernels a graph launches) and the records are cut into calls of the graph's kernel count / 4.
Prints, per kernel of a call in launch order, the median duration and the gap after the kernel
before (negative: overlapped by programmatic dependent launch), and the call's median span: where
a layer call's time goes on the expert-sorted path (T > the small path's limit) or the small one.

    PYTHONPATH=. python3 scripts/trace_moe.py [--config=V4-Flash] [--mode=w4a16] [--tokens=512,4096] [--replays=8]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import cupy as cp
import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_moe import CONFIGS, ROTATE, build  # noqa: E402
from benchmarks.common import graph_kernels  # noqa: E402
from scripts.trace_step import kernel_records  # noqa: E402


def trace(layer, cfg, t: int, replays: int, rng) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    xs = [cp.asarray(rng.standard_normal((t, cfg["hidden"])).astype(ml_dtypes.bfloat16)) for _ in range(ROTATE)]
    layer(xs[0])  # eager first call: compile, allocate
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for x in xs:
            layer(x)
        graph = stream.end_capture()
        names = graph_kernels(graph)
        for _ in range(3):
            graph.launch(stream)
        stream.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.launch(stream)
            stream.synchronize()
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    per = len(names) // ROTATE
    records = kernel_records(path)
    if len(records) < replays * len(names):
        raise SystemExit(f"the trace holds {len(records)} kernel records, fewer than {replays} replays of "
                         f"{len(names)} kernels: this profiler does not record the kernels inside graph launches")
    records = records[-replays * len(names):]
    calls = [records[i * per:(i + 1) * per] for i in range(replays * ROTATE)]
    spans = [c[-1][0] + c[-1][1] - c[0][0] for c in calls]
    print(f"T = {t}: {per} kernels per call, span {statistics.median(spans):.1f} µs (median of {len(calls)})")
    print("| # | kernel | µs | gap µs |")
    print("| --- | --- | --- | --- |")
    for i in range(per):
        us = statistics.median(c[i][1] for c in calls)
        gap = statistics.median(c[i][0] - (c[i - 1][0] + c[i - 1][1]) for c in calls) if i else 0.0
        print(f"| {i} | {calls[0][i][2][:70]} | {us:.1f} | {gap:.1f} |")
    print()


def main() -> None:
    config, mode, tokens, replays = "V4-Flash", "w4a16", (512, 4096), 8
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key == "--config":
            config = value
        elif key == "--mode":
            mode = value
        elif key == "--tokens":
            tokens = tuple(int(v) for v in value.split(","))
        elif key == "--replays":
            replays = int(value)
        else:
            raise SystemExit(f"unknown argument {arg!r} (see the docstring)")
    cfg = CONFIGS[config]
    layer, _ = build(cfg, mode)
    print(f"{config} {mode}")
    rng = np.random.default_rng(0)
    for t in tokens:
        trace(layer, cfg, t, replays, rng)


if __name__ == "__main__":
    main()
