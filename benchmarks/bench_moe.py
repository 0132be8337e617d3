"""Benchmark: one MoE layer at DeepSeek-V4-Flash (hidden 4096, 256 experts, top-6, inner 2048, one
shared expert) and V3 (7168, 256, top-8, 2048, one shared) shapes, W4A4 and W4A16, graph-replayed.

The byte floor is the NVFP4 bytes of the experts a call actually touches (routed experts in use
plus the shared expert, packed codes + scales) at the measured copy bandwidth. Each graph holds
several calls on different inputs so that the touched experts change from call to call. Where a
token count can take both device paths (T * top_k up to 128), both are timed: the small-T GEMVs
over the (token, slot) assignments and the expert-sorted grouped GEMMs; the layer's default is
marked. "launches" counts the kernels of one call in a captured graph. Targets: T = 1 within 1.5x
of the floor, T = 8 within 2x, T = 64 within 1.5x. Peers, with PyTorch: what a user would write, a
per-expert loop of bf16 GEMMs driven by host-side counts (eager; V4-Flash shape, W4A4 rows), and
up to 64 tokens the same layer in FP8 (`fp8_peer.py`: `torch._scaled_mm` with row-wise scales per
expert, graph-replayed, dispatched by the ids fp4kit's layer chose), with fp4kit's speedup over
each.

    .venv/bin/python benchmarks/bench_moe.py [--tokens=1,8,...] [--modes=w4a4,w4a16] [--configs=V4-Flash,V3]
        [--router-warps=N] [--whole-fetches=0]
"""

from __future__ import annotations

import argparse

import cupy as cp
import ml_dtypes
import numpy as np

from fp4kit.formats import interleave_rows
from fp4kit.layers import ExpertStack, MoE, RoutingConfig, SharedExpert
from fp4kit.layers import moe as moe_layer
from fp4kit.ops import moe as moe_ops
from fp4kit.ops.quant import quantize

try:
    from benchmarks.common import (Table, command_line, copy_bandwidth, device_name, events_us, graph_kernel_nodes,
                                   graph_us, int_list, torch_graph_us)
    from benchmarks.fp8_peer import Fp8MoePeer, random_weights
except ImportError:
    from common import (Table, command_line, copy_bandwidth, device_name, events_us, graph_kernel_nodes, graph_us,
                        int_list, torch_graph_us)
    from fp8_peer import Fp8MoePeer, random_weights

BF16 = ml_dtypes.bfloat16
CONFIGS = {
    "V4-Flash": dict(hidden=4096, experts=256, inner=2048, routing=RoutingConfig(top_k=6, score_func="sqrtsoftplus",
                                                                                  routed_scale=1.5), before=True),
    "V3": dict(hidden=7168, experts=256, inner=2048, routing=RoutingConfig(top_k=8, score_func="sigmoid", n_group=8,
                                                                            topk_group=4, routed_scale=2.5), before=False),
}
TOKENS = (1, 2, 4, 8, 16, 64, 512, 4096)
GOALS = {1: 1.5, 8: 2.0, 64: 1.5}  # x byte floor
FP8_PEER_MAX_TOKENS = 64
# the expert-sorted path's fusion settings (`fp4kit.layers.moe`) of the W4A16 comparison rows
SORTED_NO_FUSION = {"GROUPED_SWIGLU_EPILOGUE": False, "GROUPED_FOLD_SHARED": False, "ROUTER_DISPATCH_MAX_PAIRS": 0,
                    "GROUPED_COMBINE_IN_GEMM": False, "GROUPED_FOLD_SHARED_MAX_TOKENS": 0}
SORTED_EVERY_FUSION = {"GROUPED_SWIGLU_EPILOGUE": True, "GROUPED_FOLD_SHARED": True, "ROUTER_DISPATCH_MAX_PAIRS": 1 << 30,
                       "GROUPED_COMBINE_IN_GEMM": True, "GROUPED_FOLD_SHARED_MAX_TOKENS": 1 << 30}
ROTATE = 4  # inputs per graph


def build(cfg, mode: str, seed=0):
    """The layer with random weights, quantized one expert at a time (256 experts in fp32 at once
    would need tens of GB)."""
    h, e, i = cfg["hidden"], cfg["experts"], cfg["inner"]
    rs = cp.random.RandomState(seed)
    gate = rs.standard_normal((e, h), dtype=cp.float32) / np.float32(np.sqrt(h))
    shared = SharedExpert.from_float(*(rs.standard_normal(s, dtype=cp.float32) / np.float32(np.sqrt(s[1]))
                                       for s in ((i, h), (i, h), (h, i))), limit=10.0, mode=mode)
    shared.gate_up.decode_max_m = shared.down.decode_max_m = 1 << 30  # keep T = 4096 capturable

    def matrix(seed_base, j, rows, cols):
        return cp.random.RandomState(seed_base + j).standard_normal((rows, cols), dtype=cp.float32) / np.float32(np.sqrt(cols))

    w13 = ExpertStack.from_tensors([quantize(interleave_rows(matrix(1000, j, i, h), matrix(2000, j, i, h)))
                                    for j in range(e)])
    w2 = ExpertStack.from_tensors([quantize(matrix(3000, j, h, i)) for j in range(e)])
    layer = MoE(gate, w2, cfg["routing"], w13=w13, limit=10.0, weight_before_down=cfg["before"], shared=shared,
                mode=mode)
    return layer, gate


def launches(fn) -> int:
    """Kernels of one ``fn()`` captured in a graph."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        fn()
        return graph_kernel_nodes(stream.end_capture())


def expert_bytes(layer: MoE) -> tuple[int, int]:
    per_expert = sum(s.packed[0].nbytes + s.block_scales[0].nbytes for s in (layer.w13, layer.w2))
    shared = sum(l.weight.packed.nbytes + l.weight.block_scales.nbytes for l in (layer.shared.gate_up, layer.shared.down))
    return per_expert, shared


def torch_baseline(torch, layer: MoE, cfg, t: int, rng) -> float:
    """Per-expert loop of bf16 GEMMs with host-side counts (eager), PyTorch."""
    h, e, i, k = cfg["hidden"], cfg["experts"], cfg["inner"], cfg["routing"].top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(e, i, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    w3 = torch.randn(e, i, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate = torch.from_dlpack(layer.gate_weight)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)

    def forward():
        scores = torch.sqrt(torch.nn.functional.softplus(x.float() @ gate.T))
        w, idx = scores.topk(k, dim=-1)
        w = w / w.sum(-1, keepdim=True) * 1.5
        out = torch.zeros(t, h, device="cuda", dtype=torch.float32)
        counts = torch.bincount(idx.flatten(), minlength=e).tolist()
        for j in range(e):
            if counts[j] == 0:
                continue
            tok, slot = torch.where(idx == j)
            xs = x[tok]
            a = torch.nn.functional.silu(xs @ w1[j].T) * (xs @ w3[j].T)
            out.index_add_(0, tok, ((a * w[tok, slot, None].to(a.dtype)) @ w2[j].T).float())
        return out

    ms = events_us(forward, warmup=2, iters=5)
    del w1, w3, w2
    torch.cuda.empty_cache()
    return ms


def fp8_peer_us(torch, layer: MoE, cfg, xs) -> float:
    """`Fp8MoePeer` on the inputs ``xs``, routed as ``layer`` routes them, graph-replayed: µs per call."""
    ids = [cp.asnumpy(layer.route(x)[0]) for x in xs]
    xs_t = [torch.from_dlpack(x) for x in xs]
    weights = random_weights(torch, cfg["hidden"], cfg["inner"], xs_t[0].device, seed=0)
    peer = Fp8MoePeer(torch, xs_t, ids, torch.from_dlpack(layer.gate_weight), cfg["routing"], weights,
                      random_weights(torch, cfg["hidden"], cfg["inner"], xs_t[0].device, seed=1 << 20)(0),
                      limit=10.0, before=cfg["before"])
    us = torch_graph_us(torch, lambda j: peer.forward(j % len(xs)), calls=len(xs), replays=10)
    del peer
    torch.cuda.empty_cache()
    return us


def flags(parser) -> None:
    def names(allowed):
        def parse(text: str) -> tuple[str, ...]:
            values = tuple(text.split(","))
            unknown = [v for v in values if v not in allowed]
            if unknown:
                raise argparse.ArgumentTypeError(f"unknown {unknown}; expected some of {list(allowed)}")
            return values
        return parse

    parser.add_argument("--tokens", type=int_list, default=TOKENS)
    parser.add_argument("--modes", type=names(("w4a4", "w4a16")), default=("w4a4", "w4a16"))
    parser.add_argument("--configs", type=names(tuple(CONFIGS)), default=tuple(CONFIGS))
    # warps per expert of the router's logits (default: moe.py's rule)
    parser.add_argument("--router-warps", type=int)
    # 0: the small-T builds with per-tile bounds tests (moe.py SMALL_WHOLE_FETCHES)
    parser.add_argument("--whole-fetches", type=int, choices=(0, 1))
    # the sorted path's 8- and 16-row passes: 3 (default) or 2 blocks per SM
    parser.add_argument("--grouped-blocks-per-sm", type=int)


def main() -> None:
    args = command_line(__doc__, flags)
    try:
        import torch
    except ImportError:
        torch = None
    tokens, modes, configs = args.tokens, args.modes, args.configs
    if args.router_warps is not None:
        moe_ops.ROUTER_WARPS_PER_EXPERT = args.router_warps
    if args.whole_fetches is not None:
        moe_ops.SMALL_WHOLE_FETCHES = args.whole_fetches != 0
    if args.grouped_blocks_per_sm is not None:
        moe_ops.GROUPED_BLOCKS_PER_SM = args.grouped_blocks_per_sm
    bw = copy_bandwidth()
    print(f"{device_name()}: device-to-device copy {bw / 1e12:.2f} TB/s (read + write)")
    rng = np.random.default_rng(0)
    table = Table(f"MoE layer, graph-replayed ({device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s)",
                  ["shape", "mode", "T", "path", "µs", "launches", "experts touched", "byte floor µs", "x floor",
                   "TFLOP/s", "target", "PyTorch loop µs", "speedup", "PyTorch FP8 µs", "x FP8"])
    fp8_us = {}  # (shape, T) -> the FP8 peer's µs (one per shape and T: both modes' layers route alike)
    for name in configs:
        cfg = CONFIGS[name]
        for mode in modes:
            layer, _ = build(cfg, mode)
            per_expert, shared_bytes = expert_bytes(layer)
            k = cfg["routing"].top_k
            for t in tokens:
                xs = [cp.asarray(rng.standard_normal((t, cfg["hidden"])).astype(BF16)) for _ in range(ROTATE)]
                touched = np.mean([len(np.unique(cp.asnumpy(layer.route(x)[0]))) for x in xs])
                floor_us = (touched * per_expert + shared_bytes) / bw * 1e6
                flops = 2 * t * (k + 1) * 3 * cfg["hidden"] * cfg["inner"]
                default_small = t * k <= layer.small_max_assignments
                # (path, small-T limit, the sorted path's fusion settings: None = the layer's defaults).
                # W4A16 adds the sorted path with no fusion and with every fusion at any T, in the same run
                paths = [("small", 1 << 30, None), ("sorted", 0, None)] if t * k <= 128 else [("sorted", 0, None)]
                if mode == "w4a16" and layer.fused:
                    paths += [("sorted, no fusion", 0, SORTED_NO_FUSION), ("sorted, every fusion", 0, SORTED_EVERY_FUSION)]
                base = None
                if torch is not None and name == "V4-Flash" and mode == "w4a4" and t <= 512:
                    base = torch_baseline(torch, layer, cfg, t, rng)
                if torch is not None and t <= FP8_PEER_MAX_TOKENS and (name, t) not in fp8_us:
                    fp8_us[name, t] = fp8_peer_us(torch, layer, cfg, xs)
                fp8 = fp8_us.get((name, t))
                saved = layer.small_max_assignments, {n: getattr(moe_layer, n) for n in SORTED_NO_FUSION}
                for path, limit, setting in paths:
                    layer.small_max_assignments = limit
                    for n, v in (setting or saved[1]).items():
                        setattr(moe_layer, n, v)
                    us = graph_us(lambda j: layer(xs[j % ROTATE]), calls=ROTATE, replays=20)
                    n_launch = launches(lambda: layer(xs[0]))
                    ratio = us / floor_us
                    goal = GOALS.get(t)
                    is_default = setting is None and (path == "small") == default_small
                    target = "" if goal is None or not is_default else (
                        f"<= {goal}x floor: " + ("met" if ratio <= goal else "MISSED"))
                    table.add(**{"shape": name, "mode": mode, "T": t, "path": path + (" (default)" if is_default else ""),
                                 "µs": us, "launches": n_launch, "experts touched": touched, "byte floor µs": floor_us,
                                 "x floor": ratio, "TFLOP/s": flops / us / 1e6, "target": target,
                                 "PyTorch loop µs": base, "speedup": base / us if base else None,
                                 "PyTorch FP8 µs": fp8, "x FP8": fp8 / us if fp8 else None})
                layer.small_max_assignments = saved[0]
                for n, v in saved[1].items():
                    setattr(moe_layer, n, v)
            del layer
            cp.get_default_memory_pool().free_all_blocks()
    print()
    print(table.markdown())
    meta = {"device": device_name(), "copy_bandwidth_Bps": bw, "cupy": cp.__version__,
            "torch": getattr(torch, "__version__", None)}
    print("saved", table.save("bench_moe", meta))


if __name__ == "__main__":
    main()
