#!/usr/bin/env python3
"""The small-T router launch (`moe_route_*`) alone, graph-replayed, over tokens x warps per expert
(needs a GPU): V4-Flash routing (256 experts, H = 4096, top-6, sqrt-softplus, selection bias), the
gate weight in bf16 (the example model's) and fp32 (bench_moe's), against the read of the gate
weight at copy bandwidth.

    PYTHONPATH=. python3 scripts/router_probe.py [--tokens=1,2,4,8,16] [--wpe=0,1,2,4,8] [--once=T]

``--wpe`` 0 is the launcher's rule (`router_warps_per_expert`). ``--once=T`` makes one call of T
tokens after a warm-up, between cudaProfilerStart/Stop, for ``ncu --profile-from-start off``.
"""

from __future__ import annotations

import sys

import cupy as cp
import ml_dtypes
import numpy as np

from benchmarks.common import copy_bandwidth, graph_us
from fp4kit.layers.moe import RoutingConfig
from fp4kit.ops import moe as moe_ops

E, H = 256, 4096
ROUTING = RoutingConfig(top_k=6, score_func="sqrtsoftplus", routed_scale=1.5)


def buffers(t: int, gate_dtype, rng):
    gate = cp.asarray((rng.standard_normal((E, H)) / np.sqrt(H)).astype(gate_dtype))
    x = cp.asarray(rng.standard_normal((t, H)).astype(ml_dtypes.bfloat16))
    bias = cp.asarray(rng.standard_normal(E).astype(np.float32) * 0.01)
    out = dict(ids=cp.empty((t, ROUTING.top_k), np.int32), weights=cp.empty((t, ROUTING.top_k), np.float32),
               logits=cp.empty((t, E), np.float32), done=cp.zeros(t, np.uint32))
    return x, gate, bias, out


def call(x, gate, bias, out):
    moe_ops.route_small(x, gate, bias, None, None, ROUTING, out["ids"], out["weights"], out["logits"], out["done"], None)


def main() -> None:
    tokens, wpes, once = (1, 2, 4, 8, 16), (0, 1, 2, 4, 8), None
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key == "--tokens":
            tokens = tuple(int(v) for v in value.split(","))
        elif key == "--wpe":
            wpes = tuple(int(v) for v in value.split(","))
        elif key == "--once":
            once = int(value)
    rng = np.random.default_rng(0)
    if once is not None:
        args = buffers(once, ml_dtypes.bfloat16, rng)
        for _ in range(3):
            call(*args)
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.start()
        call(*args)
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.stop()
        return
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| gate | T | warps per expert | µs | gate read floor µs |")
    print("| --- | --- | --- | --- | --- |")
    for gate_dtype in (ml_dtypes.bfloat16, np.float32):
        for t in tokens:
            args = buffers(t, gate_dtype, rng)
            for wpe in wpes:
                moe_ops.ROUTER_WARPS_PER_EXPERT = wpe or None
                used = moe_ops.router_warps_per_expert(H, E, t, 132) if not wpe else wpe
                us = graph_us(lambda j: call(*args), calls=8)
                name = np.dtype(gate_dtype).name
                print(f"| {name} | {t} | {wpe or f'rule ({used})'} | {us:.1f} | {args[1].nbytes / bw * 1e6:.1f} |",
                      flush=True)
            moe_ops.ROUTER_WARPS_PER_EXPERT = None


if __name__ == "__main__":
    main()
