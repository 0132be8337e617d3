#!/usr/bin/env python3
"""Where a decode-size GEMM's time goes: fixed cost against per-byte cost (needs a GPU).

For M in ``--ms`` (default 1, 8) and a grid of weights N x K, times the engine's default launch
(graph-replayed, weights rotated past L2) with every GEMV variant named in ``--variants`` and the
plain streaming read of the same bytes (`benchmarks.common.read_floor_us`). A line fitted through
the times of one N against K separates the fixed cost of a call (launch, first loads, slice sum,
stores: the intercept) from its cost per byte (the slope, against the read's). Prints a table, and
writes JSON rows to ``$FP4KIT_BENCH_OUT/gemv_probe.json`` when that is set.

    PYTHONPATH=. python3 scripts/gemv_probe.py [--ms=1,8] [--variants=default,whole] [--act=nvfp4] [--ns=..] [--ks=..]
"""

from __future__ import annotations

import json
import os
import sys

import cupy as cp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp4kit  # noqa: E402
from benchmarks.common import copy_bandwidth, graph_us, l2_bytes, read_floor_us  # noqa: E402
from fp4kit.formats import to_tiled  # noqa: E402
from fp4kit.ops import gemm as gemm_ops  # noqa: E402
from fp4kit.ops.gemm import gemm  # noqa: E402

NS = (1024, 2048, 4096, 7168)
KS = (1024, 2048, 4096, 7168)
# each variant: module-level settings of fp4kit.ops.gemm for its duration
VARIANTS = {
    "default": {},
    "whole": {"GEMV_WHOLE_FETCHES": True},
    "resident": {"GEMV_RESIDENT_ACTIVATION": True},
    "resident+whole": {"GEMV_RESIDENT_ACTIVATION": True, "GEMV_WHOLE_FETCHES": True},
    "8warps": {"GEMV_WIDE_MAX_BLOCKS_PER_SM": 0.0},
    "no-resident": {"GEMV_RESIDENT_ACTIVATION": False},
    "resident-nvfp4": {"GEMV_RESIDENT_NVFP4_ACTIVATION": True},
    "pipelined": {"GEMV_RESIDENT_PIPELINED": True},
    "pipelined-8warps": {"GEMV_RESIDENT_PIPELINED": True, "GEMV_RESIDENT_PIPELINED_WARPS": (8, 16)},
    "not-pipelined": {"GEMV_RESIDENT_PIPELINED": False},
}


def fit(xs, ys):
    """Least-squares (intercept, slope) of ys against xs."""
    a = np.vstack([np.ones(len(xs)), np.asarray(xs, float)]).T
    (b0, b1), *_ = np.linalg.lstsq(a, np.asarray(ys, float), rcond=None)
    return b0, b1


def main() -> None:
    ms, names, act, ns, ks = (1, 8), ["default", "whole"], "bf16", NS, KS
    for arg in sys.argv[1:]:
        if arg.startswith("--act="):
            act = arg.split("=", 1)[1]
        if arg.startswith("--ns="):
            ns = tuple(int(v) for v in arg.split("=", 1)[1].split(","))
        if arg.startswith("--ks="):
            ks = tuple(int(v) for v in arg.split("=", 1)[1].split(","))
        if arg.startswith("--ms="):
            ms = tuple(int(v) for v in arg.split("=", 1)[1].split(","))
        if arg.startswith("--variants="):
            names = arg.split("=", 1)[1].split(",")
    variants = {name: VARIANTS[name] for name in names if all(hasattr(gemm_ops, key) for key in VARIANTS[name])}
    print(f"copy bandwidth {copy_bandwidth() / 1e12:.2f} TB/s; variants {list(variants)}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for n in ns:
        for k in ks:
            w = to_tiled(fp4kit.quantize(cp.asarray(rng.standard_normal((n, k), dtype=np.float32))))
            nbytes = w.packed.nbytes + w.block_scales.nbytes
            copies = max(1, -(-3 * l2_bytes() // nbytes))
            ws = [w] + [fp4kit.Nvfp4Tensor(w.packed.copy(), w.block_scales.copy(), w.global_scale.copy(), "tiled",
                                           w.shape) for _ in range(copies - 1)]
            floor = read_floor_us(nbytes)
            for m in ms:
                x = cp.asarray(rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16))
                if act == "nvfp4":
                    x = fp4kit.quantize(x)
                out = cp.empty((m, n), ml_dtypes.bfloat16)
                row = {"N": n, "K": k, "M": m, "bytes": nbytes, "floor_us": floor}
                for name, settings in variants.items():
                    saved = {key: getattr(gemm_ops, key) for key in settings}
                    try:
                        for key, value in settings.items():
                            setattr(gemm_ops, key, value)
                        shape = gemm_ops.gemv_launch(m, n, k, nvfp4_act=act == "nvfp4")
                        row[name] = graph_us(lambda i: gemm(x, ws[i % len(ws)], out=out), calls=2 * len(ws))
                        row[name + "_kernel"] = shape.kernel if shape else "tiled"
                    finally:
                        for key, value in saved.items():
                            setattr(gemm_ops, key, value)
                rows.append(row)
                print(" ".join(f"{key}={value:.2f}" if isinstance(value, float) else f"{key}={value}"
                               for key, value in row.items()), flush=True)
            del ws, w
            cp.get_default_memory_pool().free_all_blocks()
    print()
    print("| N | M | variant | fixed µs (read) | ns per MB (read) | fixed µs | ns per MB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in ns:
        for m in ms:
            sel = [r for r in rows if r["N"] == n and r["M"] == m]
            mb = [r["bytes"] / 1e6 for r in sel]
            f0, f1 = fit(mb, [r["floor_us"] for r in sel])
            for name in variants:
                g0, g1 = fit(mb, [r[name] for r in sel])
                print(f"| {n} | {m} | {name} | {f0:.2f} | {1e3 * f1:.0f} | {g0:.2f} | {1e3 * g1:.0f} |")
    out_dir = os.environ.get("FP4KIT_BENCH_OUT")
    if out_dir:
        with open(os.path.join(out_dir, "gemv_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
