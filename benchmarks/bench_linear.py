"""Benchmark: NVFP4 GEMMs against cuBLAS bf16 on DeepSeek-V4-Flash / V3 shapes (N x K).

fp4kit's decode path (M <= 64) is timed as CUDA-graph replays, cuBLAS bf16 as PyTorch CUDA-graph
replays of ``F.linear`` (CuPy's matmul cannot be captured; eager launches would add host time).
Weights rotate among copies larger than 3x L2 together, so each call streams its weight from HBM;
M = 4096 (fp4kit's prefill path: dequantize + cuBLAS) is timed with events.

Rows: µs, TB/s on the NVFP4 weight bytes (packed + scales), TFLOP/s, % of the copy bandwidth on
those bytes, and the speedup over cuBLAS bf16 (its time / ours). Targets (issue): M = 1: >= 2.5x
where the bf16 weight is >= 16 MB and >= 70 % of copy bandwidth for NVFP4 weights >= 32 MB;
M = 16: >= 2x; M = 64: >= 1.5x; M = 4096: >= 0.8x.

    PYTHONPATH=. python benchmarks/bench_linear.py [--quick]
"""

from __future__ import annotations

import sys

import cupy as cp
import ml_dtypes
import numpy as np

import fp4kit
from fp4kit.ops.gemm import gemm

try:
    from benchmarks.common import Table, copy_bandwidth, device_name, events_us, graph_us, l2_bytes, torch_graph_us
except ImportError:
    from common import Table, copy_bandwidth, device_name, events_us, graph_us, l2_bytes, torch_graph_us

BF16 = ml_dtypes.bfloat16
SHAPES = [(2048, 4096), (4096, 2048), (4096, 4096), (1024, 4096), (32768, 1024), (2048, 7168), (7168, 2048),
          (18432, 7168), (129280, 4096)]
MS = (1, 16, 64, 4096)


def copies_for(nbytes: int) -> int:
    return max(1, -(-3 * l2_bytes() // nbytes))


def target(m: int, n: int, k: int, speedup: float, pct: float) -> str:
    bf16_bytes, fp4_bytes = 2 * n * k, n * k // 2 + n * k // 16
    goals = []
    if m == 1:
        if bf16_bytes >= 16e6:
            goals.append(("x", 2.5, speedup))
        if fp4_bytes >= 32e6:
            goals.append(("%", 70, pct))
    else:
        goals.append(("x", {16: 2.0, 64: 1.5, 4096: 0.8}[m], speedup))
    return ", ".join(f">= {g}{u}: " + ("met" if v >= g else "MISSED") for u, g, v in goals)


def main() -> None:
    import torch

    quick = "--quick" in sys.argv
    bw = copy_bandwidth()
    print(f"{device_name()}: device-to-device copy {bw / 1e12:.2f} TB/s (read + write)")
    rng = np.random.default_rng(0)
    table = Table(f"NVFP4 GEMM vs cuBLAS bf16 ({device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s)",
                  ["shape NxK", "M", "path", "µs", "TB/s (weight)", "TFLOP/s", "% of copy BW", "cuBLAS bf16 µs",
                   "speedup", "target"])
    shapes = SHAPES[:3] + SHAPES[-2:] if quick else SHAPES
    for n, k in shapes:
        w_float = cp.asarray(rng.standard_normal((n, k), dtype=np.float32))
        w_q = fp4kit.quantize(w_float)
        fp4_bytes = w_q.packed.nbytes + w_q.block_scales.nbytes
        weights = [w_q] + [fp4kit.Nvfp4Tensor(w_q.packed.copy(), w_q.block_scales.copy(), w_q.global_scale.copy(),
                                              "linear", w_q.shape) for _ in range(copies_for(fp4_bytes) - 1)]
        w_t = torch.from_dlpack(w_float).to(torch.bfloat16)
        t_weights = [w_t] + [w_t.clone() for _ in range(copies_for(w_t.numel() * 2) - 1)]
        del w_float
        for m in MS:
            x = cp.asarray(rng.standard_normal((m, k)).astype(BF16))
            x_t = torch.from_dlpack(x)
            flops = 2 * m * n * k
            if m <= 64:
                out = cp.empty((m, n), BF16)
                xq = fp4kit.quantize(x)
                rows = [("w4a16", graph_us(lambda i: gemm(x, weights[i % len(weights)], out=out), calls=2 * len(weights))),
                        ("w4a4", graph_us(lambda i: gemm(xq, weights[i % len(weights)], out=out), calls=2 * len(weights)))]
                t_ref = torch_graph_us(torch, lambda i: torch.nn.functional.linear(x_t, t_weights[i % len(t_weights)]),
                                       calls=2 * len(t_weights))
            else:
                rows = [("w4a16 prefill", events_us(lambda: gemm(x, w_q), iters=5))]
                t_ref = torch_graph_us(torch, lambda i: torch.nn.functional.linear(x_t, w_t), calls=2, replays=5)
            for path, t in rows:
                pct = 100 * fp4_bytes / (t * 1e-6) / bw
                speedup = t_ref / t
                table.add(**{"shape NxK": f"{n}x{k}", "M": m, "path": path, "µs": t,
                             "TB/s (weight)": fp4_bytes / t / 1e6, "TFLOP/s": flops / t / 1e6,
                             "% of copy BW": pct, "cuBLAS bf16 µs": t_ref, "speedup": speedup,
                             "target": target(m, n, k, speedup, pct) if path.startswith("w4a16") else ""})
        del weights, t_weights, w_t
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    print()
    print(table.markdown())
    meta = {"device": device_name(), "copy_bandwidth_Bps": bw, "cupy": cp.__version__, "torch": torch.__version__}
    print("saved", table.save("bench_linear", meta))


if __name__ == "__main__":
    main()
