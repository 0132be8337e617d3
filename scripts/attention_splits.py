#!/usr/bin/env python3
"""The decode attention at the example model's shapes (64 heads of 512, a 128-slot window; the
ratio-0, ratio-4 and ratio-128 layers' candidate lists) for every split count, graph-replayed, in
interleaved rounds (the median is printed), beside the count `default_num_splits` picks. Needs a GPU.

    PYTHONPATH=. python3 scripts/attention_splits.py [--batches=1,8] [--rounds=2] [--entries=32,256]

``--entries``: more cases of the ratio-128 kind (the window and every one of C live entries).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BF16 = ml_dtypes.bfloat16
HEADS, DIM, WINDOW = 64, 512, 128
SPLITS = tuple(range(1, 17)) + (20, 24, 32)
# (name, compressed capacity, live entries, selected entries or None for "every live entry")
LAYERS = (("ratio-0", 1, 0, 1), ("ratio-4", 2048, 1024, 512), ("ratio-128", 64, 32, None))


def inputs(cp, rng, b: int, capacity: int, live: int, n):
    """The attention's arguments for ``b`` sequences whose windows are full."""
    q = cp.asarray(rng.standard_normal((b, HEADS, DIM)).astype(BF16))
    swa = cp.asarray(rng.standard_normal((b, WINDOW, DIM)).astype(BF16))
    comp = cp.asarray(rng.standard_normal((b, capacity, DIM)).astype(BF16))
    if n is None:
        idx = None
    elif live == 0:
        idx = cp.full((b, n), -1, cp.int32)
    else:
        idx = cp.asarray(np.sort(np.stack([rng.choice(live, n, replace=False) for _ in range(b)]), 1).astype(np.int32))
    sink = cp.asarray(rng.standard_normal(HEADS).astype(np.float32))
    return q, swa, cp.full(b, 4096, cp.int32), comp, cp.full(b, live, cp.int32), idx, sink


def main() -> None:
    import cupy as cp

    from benchmarks.common import graph_us
    from fp4kit.ops import attention as at

    batches, rounds, layers = (1, 8), 2, LAYERS
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key == "--batches":
            batches = tuple(int(v) for v in value.split(","))
        elif key == "--rounds":
            rounds = int(value)
        elif key == "--entries":
            layers += tuple((f"{c} entries", c, c, None) for c in (int(v) for v in value.split(",")))
    rng = np.random.default_rng(0)
    cases = [(b, name, inputs(cp, rng, b, capacity, live, n)) for b in batches for name, capacity, live, n in layers]
    times: dict = {}
    for _ in range(rounds):
        for b, name, (q, swa, pos, comp, comp_len, idx, sink) in cases:
            candidates = WINDOW + (comp.shape[1] if idx is None else idx.shape[1])
            out = cp.empty((b, HEADS, DIM), BF16)
            for s in SPLITS:
                if s > candidates:
                    continue
                ws = cp.empty(max(1, at.workspace_size(b, HEADS, DIM, s)), cp.float32)
                us = graph_us(lambda i: at.sparse_decode_attention(q, swa, pos, comp, comp_len, idx, sink, out=out,
                                                                   num_splits=s, workspace=ws))
                times.setdefault((b, name, candidates), {}).setdefault(s, []).append(us)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    for (b, name, candidates), by_split in times.items():
        pick = at.default_num_splits(b, HEADS, candidates, sms)
        best = min(by_split, key=lambda s: statistics.median(by_split[s]))
        cells = ", ".join(f"{s}{'*' if s == pick else ''}: {statistics.median(v):.2f}" for s, v in by_split.items())
        print(f"B={b} {name} ({candidates} candidates; default {pick}, best {best}) µs by splits: {cells}")


if __name__ == "__main__":
    main()
