#!/usr/bin/env python3
"""Where a small-T MoE layer call's time goes inside a graph replay (needs a GPU).

Times graph replays of the layer's launch chain cut after each launch (the router alone; router +
gate|up; the whole call) and of each launch alone over a fixed routing, so each launch's cost in
the chain (with programmatic dependent launch overlapping it with the one before) is the
difference between two prefixes, set beside its cost alone and its byte floor. Where the shared
expert is not folded into the GEMV launches (more than `FOLD_SHARED_MAX_TOKENS` tokens), its own
launches run after the router and count in the first stage. V4-Flash widths by default, W4A16, T = 1.

    PYTHONPATH=. python3 scripts/moe_stages.py [--config=V4-Flash] [--mode=w4a16] [--tokens=1,8]
"""

from __future__ import annotations

import sys

import cupy as cp
import ml_dtypes
import numpy as np

from benchmarks.bench_moe import CONFIGS, ROTATE, build, expert_bytes
from benchmarks.common import copy_bandwidth, graph_us
from fp4kit.ops import moe as moe_ops


def main() -> None:
    config, mode, tokens = "V4-Flash", "w4a16", (1,)
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key == "--config":
            config = value
        elif key == "--mode":
            mode = value
        elif key == "--tokens":
            tokens = tuple(int(v) for v in value.split(","))
    cfg = CONFIGS[config]
    layer, _ = build(cfg, mode)
    bw = copy_bandwidth()
    routed_bytes, shared_bytes = expert_bytes(layer)  # per routed expert, the shared expert
    rng = np.random.default_rng(0)
    real = moe_ops.small_gate_up, moe_ops.small_down
    print(f"{config} {mode}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| T | stage | µs in the chain | µs alone | byte floor µs |")
    print("| --- | --- | --- | --- | --- |")
    for t in tokens:
        xs = [cp.asarray(rng.standard_normal((t, cfg["hidden"])).astype(ml_dtypes.bfloat16)) for _ in range(ROTATE)]
        if not layer._small(t):
            print(f"| {t} | (not the small-T path) | | | |")
            continue
        calls = {}  # the arguments of the last gate_up and down launches, for the launches alone

        def recording(name, fn):
            def launch(*args, **kwargs):
                calls[name] = (args, kwargs)
                return fn(*args, **kwargs)
            return launch

        moe_ops.small_gate_up, moe_ops.small_down = recording("gate_up", real[0]), recording("down", real[1])
        try:
            layer(xs[0])
            full = graph_us(lambda j: layer(xs[j % ROTATE]), calls=ROTATE)
            moe_ops.small_down = lambda *a, **k: None
            upto_gate_up = graph_us(lambda j: layer(xs[j % ROTATE]), calls=ROTATE)
            moe_ops.small_gate_up = lambda *a, **k: (1, 1)
            router = graph_us(lambda j: layer(xs[j % ROTATE]), calls=ROTATE)
        finally:
            moe_ops.small_gate_up, moe_ops.small_down = real
        alone = {name: graph_us(lambda j, name=name: getattr(moe_ops, f"small_{name}")(*calls[name][0], **calls[name][1]),
                                calls=ROTATE) for name in ("gate_up", "down")}
        touched = len(set(cp.asnumpy(layer.routed_ids(t)).ravel().tolist()))
        folded = shared_bytes if layer._folds_shared(t) else 0
        gate_up_bytes = (touched * routed_bytes + folded) * 2 / 3  # gate|up: two of an expert's three matrices
        floor = {"gate_up": gate_up_bytes / bw * 1e6, "down": gate_up_bytes / 2 / bw * 1e6,
                 "router": layer.gate_weight.nbytes / bw * 1e6}
        # the shared expert rides in the GEMV launches where it is folded, else it runs on its own
        # between the router and gate|up, and the first stage carries it
        first = "router" if layer._folds_shared(t) else "router + shared expert apart"
        floor[first] = floor["router"] if layer._folds_shared(t) else floor["router"] + shared_bytes / bw * 1e6
        rows = [(first, router, None), ("gate_up", upto_gate_up - router, alone["gate_up"]),
                ("down", full - upto_gate_up, alone["down"]), ("whole call", full, None)]
        for name, chain, own in rows:
            fl = floor[name] if name in floor else floor["gate_up"] * 1.5 + floor[first]
            print(f"| {t} | {name} | {chain:.1f} | {'' if own is None else f'{own:.1f}'} | {fl:.1f} |", flush=True)


if __name__ == "__main__":
    main()
