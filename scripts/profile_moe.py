"""Device time of each stage of one MoE layer call (V4-Flash shape), with CUDA events.

    .venv/bin/python scripts/profile_moe.py
"""

import cupy as cp
import ml_dtypes
import numpy as np

from benchmarks.bench_moe import CONFIGS, build
from benchmarks.common import events_us
from fp4kit.ops import moe as moe_ops
from fp4kit.ops import quant as quant_ops


cfg = CONFIGS["V4-Flash"]
layer, _ = build(cfg, "w4a4")
layer.small_max_assignments = 0  # the stages below are those of the expert-sorted path
rng = np.random.default_rng(0)
for t in (1, 64):
    x = cp.asarray(rng.standard_normal((t, cfg["hidden"])).astype(ml_dtypes.bfloat16))
    layer(x)
    plan = layer._plan(x)
    k = cfg["routing"].top_k
    stages = {
        "router+dispatch": lambda: layer._route_device(x, None, plan),
        "quantize x": lambda: quant_ops.quantize(x, out=plan.x_act),
        "L1 grouped GEMM": lambda: moe_ops.grouped_gemm(plan.x_act, layer.w13, plan.h, plan=plan, gather=True),
        "swiglu+quantize": lambda: quant_ops.swiglu_quantize(plan.h, limit=10.0, row_scale=plan.row_weight,
                                                             out=plan.h_act),
        "L2 grouped GEMM": lambda: moe_ops.grouped_gemm(plan.h_act, layer.w2, plan.y, plan=plan, gather=False),
        "shared expert": lambda: layer.shared(x),
        "combine": lambda: moe_ops.combine(plan.y, plan.slot_row, plan.weights, False, None, plan.out),
        "whole layer": lambda: layer(x),
    }
    for name, fn in stages.items():
        print(f"T={t:4d} {name:18s} {events_us(fn, warmup=1, iters=10):9.1f} us")

# the small-T path (T * top_k <= layer.small_max_assignments): router, L1 GEMV + SwiGLU, the
# amax + quantize of its output, the shared expert, L2 GEMV + combine
layer.small_max_assignments = 1 << 30
layer.quantize_in_blocks_max_tokens = 0  # the stages below include the quantize launches
layer.fold_shared = False  # ... and the shared expert apart
for t in (1, 8):
    x = cp.asarray(rng.standard_normal((t, cfg["hidden"])).astype(ml_dtypes.bfloat16))
    layer(x)
    plan = layer._plan(x)
    gate_up = ((layer.w13, 2, 0), (layer.w13, 2, 1))
    stages = {
        "router (one launch)": lambda: layer._route_device(x, None, plan),
        "quantize x": lambda: quant_ops.quantize(x, out=plan.x_act),
        "L1 GEMV+SwiGLU": lambda: moe_ops.small_gate_up(plan.x_act, *gate_up, plan.ids, plan.weights, 10.0, plan.h_f32),
        "quantize h": lambda: quant_ops.quantize(plan.h_f32, out=plan.h_act),
        "shared expert": lambda: layer.shared(x),
        "L2 GEMV+combine": lambda: moe_ops.small_down(plan.h_act, layer.w2, plan.ids, plan.weights, False, None, plan.out),
        "whole layer": lambda: layer(x),
    }
    for name, fn in stages.items():
        print(f"small T={t:4d} {name:18s} {events_us(fn, warmup=1, iters=10):9.1f} us")
    layer.quantize_in_blocks_max_tokens = 1 << 30
    print(f"small T={t:4d} {'whole layer, W4A4 quantized in the GEMV blocks':18s} "
          f"{events_us(lambda: layer(x), warmup=1, iters=10):9.1f} us")
    layer.quantize_in_blocks_max_tokens = 0
