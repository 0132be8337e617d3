#!/usr/bin/env python3
"""GEMV grids held to a wave: row tiles per block against the default launch (needs a GPU).

For the grouped GEMV (`gemm_grouped`: 8 groups of 1024 x 4096, the example's ``wo_a``) and for
dense weights N x K at M = 1 and 8, times (graph-replayed, weights rotated past L2) the launch the
engine picks and GEMV launches held to 1, 2 and 4 blocks per SM (`gemv_config(max_blocks=...)`,
with up to 8 row tiles per block), beside the plain streaming read of the same bytes. This is the
measurement behind `fp4kit.ops.gemm.GEMV_HELD_MAX_ROW_TILES`, `GEMV_HELD_MAX_M` and
`GROUPED_GEMV_MAX_BLOCKS_PER_SM`.

    PYTHONPATH=. python3 scripts/gemv_grid_probe.py [--shapes=4096x8192,7168x2048] [--ms=1,8]
"""

from __future__ import annotations

import os
import sys

import cupy as cp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp4kit  # noqa: E402
from benchmarks.common import graph_us, l2_bytes, read_floor_us  # noqa: E402
from fp4kit.formats import to_tiled  # noqa: E402
from fp4kit.ops import gemm as gemm_ops  # noqa: E402

#: the decode step's weights at V4-Flash widths: wo_b, a dense wo_a, the query projections, the
#: ratio-4 / ratio-128 / ratio-0 input projections, and one benchmark shape
SHAPES = [(4096, 8192), (8192, 4096), (7168, 2048), (32768, 1024), (40960, 1024), (4160, 4096), (2560, 4096),
          (1536, 4096)]
HELD_PER_SM = (1, 2, 4)


def rotated_weights(rng, n: int, k: int):
    """Copies of one tiled weight filling 3x the L2, so each call streams its weight from HBM."""
    w = to_tiled(fp4kit.quantize(cp.asarray(rng.standard_normal((n, k), dtype=np.float32))))
    nbytes = w.packed.nbytes + w.block_scales.nbytes
    copies = max(1, -(-3 * l2_bytes() // nbytes))
    return [w] + [fp4kit.Nvfp4Tensor(w.packed.copy(), w.block_scales.copy(), w.global_scale.copy(), "tiled", w.shape)
                  for _ in range(copies - 1)], nbytes


def held(per_sm: int, sms: int):
    """A `gemv_launch` that holds every GEMV grid to ``per_sm`` blocks per SM (up to 8 row tiles per block)."""
    def launch(m, n, k, sms_=None, nvfp4_act=False):
        return gemm_ops.gemv_config(m, n, k, sms_, nvfp4_act, max_blocks=per_sm * sms) if m <= gemm_ops.GEMV_MAX_M else None
    return launch


def main() -> None:
    ms, shapes = (1, 8), SHAPES
    for arg in sys.argv[1:]:
        if arg.startswith("--shapes="):
            shapes = [tuple(int(v) for v in s.split("x")) for s in arg.split("=", 1)[1].split(",")]
        elif arg.startswith("--ms="):
            ms = tuple(int(v) for v in arg.split("=", 1)[1].split(","))
        else:
            raise SystemExit(f"unknown argument {arg!r}; see the docstring")
    rng = np.random.default_rng(0)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    saved = (gemm_ops.gemv_launch, gemm_ops.GEMV_HELD_MAX_ROW_TILES, dict(gemm_ops.GROUPED_GEMV_MAX_BLOCKS_PER_SM))
    print("| weight | M | read floor µs | default (grouped: 8 K slices): kernel, blocks, µs | " +
          " | ".join(f"held to {p}/SM: kernel, blocks, µs" for p in HELD_PER_SM) + " |")
    print("| --- " * (4 + len(HELD_PER_SM)) + "|")
    try:
        groups, n_g, k = 8, 1024, 4096  # the grouped GEMV
        ws, nbytes = rotated_weights(rng, groups * n_g, k)
        for m in ms:
            a = cp.asarray(rng.standard_normal((m, groups * k)).astype(ml_dtypes.bfloat16))
            out = cp.empty((m, groups * n_g), ml_dtypes.bfloat16)
            cells = []
            for per_sm in (0, *HELD_PER_SM):  # 0: 8 K slices per row tile, as before the grid was held
                gemm_ops.GEMV_HELD_MAX_ROW_TILES = 8
                gemm_ops.GROUPED_GEMV_MAX_BLOCKS_PER_SM = {1: per_sm, 8: per_sm}
                shape = gemm_ops.gemv_config(m, groups * n_g, k, sms, max_blocks=gemm_ops.grouped_gemv_max_blocks(m, sms))
                t = graph_us(lambda i: gemm_ops.gemm_grouped(a, ws[i % len(ws)], groups, out=out), calls=2 * len(ws))
                cells.append(f"{shape.kernel}, {shape.row_groups}, {t:.2f}")
            print(f"| grouped {groups}x{n_g}x{k} | {m} | {read_floor_us(nbytes):.2f} | " + " | ".join(cells) + " |", flush=True)
        gemm_ops.GROUPED_GEMV_MAX_BLOCKS_PER_SM = saved[2]
        del ws
        for n, k in shapes:
            ws, nbytes = rotated_weights(rng, n, k)
            for m in ms:
                x = cp.asarray(rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16))
                out = cp.empty((m, n), ml_dtypes.bfloat16)
                cells = []
                for per_sm in (0, *HELD_PER_SM):  # 0: the engine's own pick
                    gemm_ops.GEMV_HELD_MAX_ROW_TILES = saved[1] if per_sm == 0 else 8
                    gemm_ops.gemv_launch = saved[0] if per_sm == 0 else held(per_sm, sms)
                    shape = gemm_ops.gemv_launch(m, n, k) or gemm_ops.launch_config(m, n, k)
                    t = graph_us(lambda i: gemm_ops.gemm(x, ws[i % len(ws)], out=out), calls=2 * len(ws))
                    cells.append(f"{shape.kernel}, {shape.row_groups * shape.splits}, {t:.2f}")
                print(f"| {n}x{k} | {m} | {read_floor_us(nbytes):.2f} | " + " | ".join(cells) + " |", flush=True)
            del ws
    finally:
        gemm_ops.gemv_launch, gemm_ops.GEMV_HELD_MAX_ROW_TILES = saved[:2]
        gemm_ops.GROUPED_GEMV_MAX_BLOCKS_PER_SM = saved[2]


if __name__ == "__main__":
    main()
