"""Benchmark: NVFP4 GEMMs against cuBLAS bf16 and FP8 (the formats a Hopper user picks instead).

Shapes N x K from DeepSeek-V4-Flash / V3 and common dense layers, M in {1, 16, 64, 256, 4096}. In one
run, graph-replayed on all sides:

* fp4kit W4A16 (bf16 activation) and W4A4 (NVFP4 activation, already quantized), tiled weights;
* cuBLAS bf16 ``F.linear`` and ``torch._scaled_mm`` FP8 E4M3 with row-wise fp32 scales (activation
  rows padded to 16), as PyTorch CUDA-graph replays;
* the floor: a plain streaming read of the same number of bytes as the NVFP4 weight (one kernel,
  16-byte ``ld.global.nc.L1::no_allocate`` loads), measured here, for M <= 64.

Weights rotate among copies larger than 3x L2, so each call streams its weight from HBM. At
M > 64 fp4kit is timed on both of its paths (the engine and the dequantize + cuBLAS path, both
captured) and the op's default for that M is marked.

Targets (not tests): M = 1: >= 85 % of the read floor, >= 1.6x FP8 and >= 2.4x bf16 on the lm_head
shape; M = 16: >= 70 % of the read floor, >= 1.5x FP8; M = 64: >= 1.3x FP8 and >= 2x bf16;
M >= 256: >= 0.9x bf16; W4A4 <= 1.15x W4A16 at M <= 64.

    .venv/bin/python benchmarks/bench_linear.py [--quick] [--sweep] [--sass] [--shapes=NxK,...] [--ms=1,16,...]

``--sweep`` also times every launch shape (row tiles per warp, weight tiles per fetch, blocks per
SM; up to 8 rows the GEMV kernels' fetch size, K split and 8- or 16-warp blocks) at M <= 64 and prints the best; ``--sass`` adds the mainloop's instructions per weight (scripts/gemm_sass.py).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import fp4kit
from fp4kit.formats import to_tiled
from fp4kit.ops import gemm as gemm_ops
from fp4kit.ops.gemm import gemm

try:
    from benchmarks.common import (Table, command_line, copy_bandwidth, device_name, events_us, graph_us, int_list,
                                   l2_bytes, read_floor_us, torch_graph_us)
except ImportError:
    from common import (Table, command_line, copy_bandwidth, device_name, events_us, graph_us, int_list, l2_bytes,
                        read_floor_us, torch_graph_us)

BF16 = ml_dtypes.bfloat16
SHAPES = [(2048, 4096), (4096, 2048), (4096, 4096), (1024, 4096), (32768, 1024), (2048, 7168), (7168, 2048),
          (18432, 7168), (129280, 4096)]
MS = (1, 16, 64, 128, 256, 512, 1024, 4096)
LM_HEAD = (129280, 4096)


def copies_for(nbytes: int) -> int:
    return max(1, -(-3 * l2_bytes() // nbytes))


def targets(m, shape, floor_pct, vs_fp8, vs_bf16, a4_ratio) -> str:
    goals = []
    if m == 1:
        goals += [("% floor", 85, floor_pct)]
        if shape == LM_HEAD:
            goals += [("x FP8", 1.6, vs_fp8), ("x bf16", 2.4, vs_bf16)]
    elif m == 16:
        goals += [("% floor", 70, floor_pct), ("x FP8", 1.5, vs_fp8)]
    elif m == 64:
        goals += [("x FP8", 1.3, vs_fp8), ("x bf16", 2.0, vs_bf16)]
    elif m >= 256:
        goals += [("x bf16", 0.9, vs_bf16)]
    text = [f">= {g}{u}: " + ("met" if v >= g else "MISSED") for u, g, v in goals]
    if m <= 64 and a4_ratio is not None:
        text.append("W4A4 <= 1.15x: " + ("met" if a4_ratio <= 1.15 else "MISSED"))
    return ", ".join(text)


def fp8_rowwise(torch, x_t, w_t):
    """FP8 E4M3 operands with row-wise fp32 scales, as a Hopper user would feed ``_scaled_mm``."""
    def quant(t):
        scale = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        return (t.float() / scale).to(torch.float8_e4m3fn), scale
    m = x_t.shape[0]
    pad = -(-m // 16) * 16
    xp = torch.zeros((pad, x_t.shape[1]), dtype=x_t.dtype, device=x_t.device)
    xp[:m] = x_t
    xq, xs = quant(xp)
    wq, ws = quant(w_t)
    return xq, xs, wq, ws.t().contiguous()


def replayed_us(fn, calls: int) -> float:
    """``graph_us`` of ``fn``; where the cuBLAS library refuses capture (CuPy's binding does), the
    events around ``calls`` back-to-back eager calls, per call: the host's work for one call
    overlaps the GPU's on the previous ones, as in a model whose layers are queued."""
    try:
        return graph_us(fn, calls=calls, replays=5)
    except Exception as e:  # noqa: BLE001 (the cuBLAS and CUDA runtime errors have no common base)
        cp.cuda.Device().synchronize()
        if not replayed_us.warned:
            print(f"  capture failed ({e}); timing {calls} back-to-back eager calls with events", flush=True)
            replayed_us.warned = True
        return events_us(lambda: [fn(i) for i in range(calls)], iters=5) / calls


replayed_us.warned = False


def sweep(table, w_list, x, out, m, n, k):
    """Every launch shape of the engine for this (M, N, K): µs of W4A16 per variant (mma.sync: row
    tiles per warp, weight tiles per fetch, blocks per SM; wgmma on Hopper: row tiles per warp, blocks
    per SM; each with the split-K reduction in a cluster and in global memory); returns the best
    (µs, label)."""
    knobs = (gemm_ops.ROW_TILES_PER_WARP, gemm_ops.FETCH_TILES, gemm_ops.BLOCKS_PER_SM, gemm_ops.WGMMA_BLOCKS_PER_SM,
             gemm_ops.WGMMA_ROW_TILES_PER_WARP)
    saved = [dict(d) for d in knobs] + [gemm_ops.WGMMA_MIN_M, gemm_ops.USE_CLUSTERS]
    saved_gemv = (gemm_ops.USE_GEMV, gemm_ops.GEMV_FETCH_TILES, gemm_ops.GEMV_SPLIT_BELOW_BLOCKS_PER_SM,
                  gemm_ops.GEMV_MAX_BLOCKS_PER_SM, gemm_ops.GEMV_WIDE_MAX_BLOCKS_PER_SM)
    results = []
    if m <= gemm_ops.GEMV_MAX_M:  # the GEMV kernels at any grid size: fetch size, K split over blocks too, 8 or 16 warps
        try:
            gemm_ops.USE_GEMV, gemm_ops.GEMV_MAX_BLOCKS_PER_SM = True, {gemm_ops.GEMV_MAX_M: float("inf")}
            for f, split_below, wide in itertools.product((4, 8), (0, 0.5, 1, 2), (0.0, float("inf"))):
                gemm_ops.GEMV_FETCH_TILES, gemm_ops.GEMV_SPLIT_BELOW_BLOCKS_PER_SM = f, split_below
                gemm_ops.GEMV_WIDE_MAX_BLOCKS_PER_SM = wide
                shape = gemm_ops.gemv_config(m, n, k)
                if wide and shape.warps == 8:
                    continue  # no 16-warp build for this K or M: the 8-warp row above
                t = graph_us(lambda i: gemm(x, w_list[i % len(w_list)], out=out), calls=2 * len(w_list))
                results.append((t, f"{shape.kernel}, split below {split_below} blocks/SM, {shape.splits} splits"))
                table.add(**{"shape NxK": f"{n}x{k}", "M": m, "kernel": shape.kernel,
                             "blocks/SM": f"split below {split_below}", "splits": shape.splits, "µs": t})
        finally:
            (gemm_ops.USE_GEMV, gemm_ops.GEMV_FETCH_TILES, gemm_ops.GEMV_SPLIT_BELOW_BLOCKS_PER_SM,
             gemm_ops.GEMV_MAX_BLOCKS_PER_SM, gemm_ops.GEMV_WIDE_MAX_BLOCKS_PER_SM) = saved_gemv
    if cp.cuda.Device().compute_capability == "90" and m > 8:  # wgmma at forced split counts
        try:
            gemm_ops.USE_GEMV, gemm_ops.WGMMA_MIN_M = False, 1
            for splits, clusters in itertools.product((1, 2, 3, 4, 6, 8, 16), (True, False)):
                gemm_ops.WGMMA_SPLITS, gemm_ops.USE_CLUSTERS = splits, clusters
                shape = gemm_ops.launch_config(m, n, k, wgmma=True)
                if shape.splits != splits or (clusters and not shape.cluster):
                    continue  # K does not split that way, or no cluster kernel for it
                t = graph_us(lambda i: gemm(x, w_list[i % len(w_list)], out=out), calls=2 * len(w_list))
                results.append((t, f"{shape.kernel}, {splits} splits (forced)"))
                table.add(**{"shape NxK": f"{n}x{k}", "M": m, "kernel": shape.kernel,
                             "blocks/SM": "forced", "splits": shape.splits, "µs": t})
        finally:
            gemm_ops.WGMMA_SPLITS, gemm_ops.USE_GEMV = None, saved_gemv[0]
            gemm_ops.WGMMA_MIN_M, gemm_ops.USE_CLUSTERS = saved[-2], saved[-1]
    if m > 64:  # one wgmma launch of up to 128 rows: only its split counts
        return min(results)
    tiles = gemm_ops.token_tiles(m)
    shapes = [(1, 4), (2, 4), (1, 8)] if tiles <= 2 else [(1, 4)]
    # blocks per SM 0: the balanced split count
    variants = [("mma.sync", r, f, per_sm) for (r, f), per_sm in itertools.product(shapes, (0, 1, 2, 4, 8))]
    if cp.cuda.Device().compute_capability == "90":
        wg_tiles = gemm_ops.launch_config(m, n, k, wgmma=True).token_tiles
        wg_rows = (1, 2) if wg_tiles in (4, 8) else (1,)
        variants += [("wgmma", r, 4, per_sm) for r, per_sm in itertools.product(wg_rows, (1, 2, 4, 8))]
    try:
        gemm_ops.USE_GEMV = False
        for (engine, r, f, per_sm), clusters in itertools.product(variants, (True, False)):
            wgmma = engine == "wgmma"
            gemm_ops.USE_CLUSTERS = clusters
            gemm_ops.WGMMA_MIN_M = 1 if wgmma else 1 << 30
            if wgmma:
                gemm_ops.WGMMA_BLOCKS_PER_SM[wg_tiles], gemm_ops.WGMMA_ROW_TILES_PER_WARP[wg_tiles] = per_sm, r
            else:
                gemm_ops.ROW_TILES_PER_WARP[tiles], gemm_ops.FETCH_TILES[tiles], gemm_ops.BLOCKS_PER_SM[tiles] = r, f, per_sm
            t = graph_us(lambda i: gemm(x, w_list[i % len(w_list)], out=out), calls=2 * len(w_list))
            shape = gemm_ops.launch_config(m, n, k, wgmma=wgmma)
            label = f"{shape.kernel}, {per_sm} blocks/SM, {shape.splits} splits"
            results.append((t, label))
            table.add(**{"shape NxK": f"{n}x{k}", "M": m, "kernel": shape.kernel,
                         "blocks/SM": per_sm, "splits": shape.splits, "µs": t})
    finally:
        for d, old in zip(knobs, saved):
            d.clear()
            d.update(old)
        gemm_ops.WGMMA_MIN_M, gemm_ops.USE_CLUSTERS = saved[-2:]
        gemm_ops.USE_GEMV = saved_gemv[0]
    return min(results)


def shape_list(text: str) -> list[tuple[int, int]]:
    """``2048x4096,4096x4096`` -> [(2048, 4096), (4096, 4096)]: the ``--shapes`` flag."""
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected comma-separated NxK shapes, got {text!r}")
    return shapes


def flags(parser) -> None:
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sass", action="store_true")
    parser.add_argument("--shapes", type=shape_list)
    parser.add_argument("--ms", type=int_list)


def main() -> None:
    args = command_line(__doc__, flags)
    import torch

    quick, do_sweep = args.quick, args.sweep
    bw = copy_bandwidth()
    print(f"{device_name()}: device-to-device copy {bw / 1e12:.2f} TB/s (read + write)")
    rng = np.random.default_rng(0)
    title = f"NVFP4 GEMM vs cuBLAS bf16 and FP8 row-wise ({device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s)"
    table = Table(title, ["shape NxK", "M", "path", "µs", "read floor µs", "% of read floor", "% of copy BW",
                          "TFLOP/s", "cuBLAS bf16 µs", "FP8 µs", "x bf16", "x FP8", "W4A4 / W4A16", "target"])
    sweep_table = Table(f"Decode GEMM launch shapes ({device_name()})",
                        ["shape NxK", "M", "kernel", "blocks/SM", "splits", "µs"])
    shapes = args.shapes or ([SHAPES[0], SHAPES[5], SHAPES[7], SHAPES[8]] if quick else SHAPES)
    ms = args.ms or ((1, 16, 64, 256) if quick else MS)
    for n, k in shapes:
        w_float = cp.asarray(rng.standard_normal((n, k), dtype=np.float32))
        w_q = to_tiled(fp4kit.quantize(w_float))
        fp4_bytes = w_q.packed.nbytes + w_q.block_scales.nbytes
        weights = [w_q] + [fp4kit.Nvfp4Tensor(w_q.packed.copy(), w_q.block_scales.copy(), w_q.global_scale.copy(),
                                              "tiled", w_q.shape) for _ in range(copies_for(fp4_bytes) - 1)]
        w_t = torch.from_dlpack(w_float).to(torch.bfloat16)
        t_weights = [w_t] + [w_t.clone() for _ in range(copies_for(w_t.numel() * 2) - 1)]
        del w_float
        floor = read_floor_us(fp4_bytes)
        for m in ms:
            x = cp.asarray(rng.standard_normal((m, k)).astype(BF16))
            xq = fp4kit.quantize(x)
            x_t = torch.from_dlpack(x)
            xq8, xs8, wq8, ws8 = fp8_rowwise(torch, x_t, w_t)
            w8 = [wq8] + [wq8.clone() for _ in range(copies_for(wq8.numel()) - 1)]
            flops = 2 * m * n * k
            out = cp.empty((m, n), BF16)
            nw = len(weights)
            torch.cuda.synchronize()  # the baselines' setup above runs on PyTorch's stream: let it finish first
            cp.cuda.Device().synchronize()
            rows = []
            if do_sweep and m <= 128:
                best = sweep(sweep_table, weights, x, out, m, n, k)
                print(f"  best launch shape {n}x{k} M={m}: {best[0]:.1f} µs, {best[1]}", flush=True)
            if m <= 64:
                t16 = graph_us(lambda i: gemm(x, weights[i % nw], out=out), calls=2 * nw)
                t4 = graph_us(lambda i: gemm(xq, weights[i % nw], out=out), calls=2 * nw)
                rows = [("w4a16", t16, t4 / t16), ("w4a4", t4, None)]
                t_bf16 = torch_graph_us(torch, lambda i: torch.nn.functional.linear(x_t, t_weights[i % len(t_weights)]),
                                        calls=2 * len(t_weights))
                t_fp8 = torch_graph_us(torch, lambda i: torch._scaled_mm(xq8, w8[i % len(w8)].t(), scale_a=xs8, scale_b=ws8,
                                                                         out_dtype=torch.bfloat16),
                                       calls=2 * len(w8))
            else:
                # both paths graph-replayed: the engine (wgmma token chunks on Hopper) and the
                # dequantize + cuBLAS path; the op's default for this M is marked
                t_dec = graph_us(lambda i: gemm(x, weights[i % nw], out=out, decode_max_m=1 << 30), calls=nw, replays=5)
                t_dec4 = graph_us(lambda i: gemm(xq, weights[i % nw], out=out, decode_max_m=1 << 30), calls=nw, replays=5)
                t_pre = replayed_us(lambda i: gemm(x, weights[i % nw], out=out, decode_max_m=0), calls=nw)
                t_pre4 = replayed_us(lambda i: gemm(xq, weights[i % nw], out=out, decode_max_m=0), calls=nw)
                engine_default = m <= gemm_ops.default_decode_max_m(cp.cuda.Device().compute_capability)
                mark = {True: " (default)", False: ""}
                rows = [("w4a16 engine" + mark[engine_default], t_dec, t_dec4 / t_dec),
                        ("w4a4 engine" + mark[engine_default], t_dec4, None),
                        ("w4a16 dequantize + cuBLAS" + mark[not engine_default], t_pre, t_pre4 / t_pre),
                        ("w4a4 dequantize + cuBLAS" + mark[not engine_default], t_pre4, None)]
                t_bf16 = torch_graph_us(torch, lambda i: torch.nn.functional.linear(x_t, w_t), calls=2, replays=5)
                t_fp8 = torch_graph_us(torch, lambda i: torch._scaled_mm(xq8, wq8.t(), scale_a=xs8, scale_b=ws8,
                                                                         out_dtype=torch.bfloat16), calls=2, replays=5)
            for path, t, a4 in rows:
                floor_pct = 100 * floor / t if m <= 64 else None
                table.add(**{"shape NxK": f"{n}x{k}", "M": m, "path": path, "µs": t,
                             "read floor µs": floor if m <= 64 else "", "% of read floor": floor_pct if m <= 64 else "",
                             "% of copy BW": 100 * fp4_bytes / (t * 1e-6) / bw, "TFLOP/s": flops / t / 1e6,
                             "cuBLAS bf16 µs": t_bf16, "FP8 µs": t_fp8, "x bf16": t_bf16 / t, "x FP8": t_fp8 / t,
                             "W4A4 / W4A16": a4 if a4 is not None else "",
                             "target": targets(m, (n, k), floor_pct or 0, t_fp8 / t, t_bf16 / t, a4)
                             if path.startswith("w4a16") else ""})
            del w8
        del weights, t_weights, w_t
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    print()
    print(table.markdown())
    meta = {"device": device_name(), "copy_bandwidth_Bps": bw, "cupy": cp.__version__, "torch": torch.__version__}
    if args.sass:
        sys.path.insert(0, "scripts")
        import gemm_sass

        meta["mainloop_sass"] = gemm_sass.report("sm_90a")
        for row in meta["mainloop_sass"]:
            print(f"  {row['kernel']}: {row['instructions_per_weight']:.2f} instructions/weight, "
                  f"{row['alu_int_logic_per_weight']:.2f} ALU integer/logic + {row['imad_per_weight']:.2f} IMAD")
    print("saved", table.save("bench_linear", meta))
    if do_sweep:
        print(sweep_table.markdown())


if __name__ == "__main__":
    main()
