#!/usr/bin/env python3
"""Each kernel of the graph-replayed decode step on the GPU's clock (needs a GPU and PyTorch).

The replays run under `torch.profiler` (CUPTI records every kernel a graph launches, whichever
library captured it); the trace's kernel records are cut into steps of the captured graph's
kernel count. Prints, per kernel in launch order, the median start (from the step's first
kernel's start), duration and the gap after the kernel before (negative: the two overlapped,
as programmatic dependent launch lets them), then the time by kernel name. Unlike `ncu`, this is
the step as it runs: clocks unlocked, caches warm, launches overlapped. The benchmark's model
(v4-flash-slice, 4 layers, context 4096, W4A16); ``--hc-mult=4`` with DeepSeek-V4's four copies
of the residual stream.

    PYTHONPATH=. python3 scripts/trace_step.py [--batch=1] [--replays=20] [--hc-mult=1] [--out=trace.json]
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import cupy as cp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from benchmarks.common import graph_kernels  # noqa: E402
from dsv4 import config as configs  # noqa: E402
from dsv4 import runner  # noqa: E402


def kernel_records(trace_path: str) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of every kernel record of a Chrome trace, by start."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [(float(e["ts"]), float(e["dur"]), e["name"]) for e in events
               if e.get("cat") == "kernel" and "ts" in e and "dur" in e]
    return sorted(kernels)


def per_position(steps: list[list[tuple[float, float, str]]]) -> list[dict]:
    """Median start offset, duration and gap of each kernel position over the steps."""
    rows = []
    for i in range(len(steps[0])):
        starts = [s[i][0] - s[0][0] for s in steps]
        durs = [s[i][1] for s in steps]
        gaps = [s[i][0] - (s[i - 1][0] + s[i - 1][1]) for s in steps] if i else [0.0] * len(steps)
        rows.append({"kernel": steps[0][i][2], "start": statistics.median(starts), "us": statistics.median(durs),
                     "gap": statistics.median(gaps)})
    return rows


def main() -> None:
    batch, replays, hc, out = 1, 20, 1, None
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key == "--batch":
            batch = int(value)
        elif key == "--replays":
            replays = int(value)
        elif key == "--hc-mult":
            hc = int(value)
        elif key == "--out":
            out = value
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg = configs.v4_flash_slice(4, max_context=8192, hc_mult=hc)
    model, _ = runner.build(cfg, device=True, seed=0)
    state = model.new_state(batch, history_rows=64)
    runner.fill_context(model, state, 4096, seed=batch)
    dec = runner.Decoder(model, state, cp.zeros((batch, 1), cp.int32))
    for _ in range(3):  # compile, capture, warm up
        dec.decode_step()
    dec.synchronize()
    names = graph_kernels(dec.decode_graph.graph)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            dec.decode_step()
        dec.synchronize()
        torch.cuda.synchronize()
    path = out or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    records = kernel_records(path)
    k = len(names)
    if len(records) < replays * k:
        raise SystemExit(f"the trace holds {len(records)} kernel records, fewer than {replays} steps of {k} kernels: "
                         "this profiler does not record the kernels inside graph launches")
    records = records[-replays * k:]
    steps = [records[i * k:(i + 1) * k] for i in range(replays)]
    spans = [s[-1][0] + s[-1][1] - s[0][0] for s in steps]
    rows = per_position(steps)
    print(f"batch {batch}: {k} kernels per step, step span {statistics.median(spans):.1f} µs (median of {replays}); "
          f"kernel time summed {sum(r['us'] for r in rows):.1f} µs")
    print("| # | kernel | start µs | µs | gap µs |")
    print("| --- | --- | --- | --- | --- |")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['kernel'][:60]} | {r['start']:.1f} | {r['us']:.2f} | {r['gap']:.2f} |")
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        by_name[r["kernel"]][0] += 1
        by_name[r["kernel"]][1] += r["us"]
    print()
    print("| kernel | launches | µs |")
    print("| --- | --- | --- |")
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name[:60]} | {count} | {us:.1f} |")


if __name__ == "__main__":
    main()
