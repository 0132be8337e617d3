"""Benchmark: one MoE layer at DeepSeek-V4-Flash (hidden 4096, 256 experts, top-6, inner 2048, one
shared expert) and V3 (7168, 256, top-8, 2048, one shared) shapes, W4A4, graph-replayed.

The byte floor is the NVFP4 bytes of the experts a call actually touches (routed experts in use
plus the shared expert, packed codes + scales) at the measured copy bandwidth. Each graph holds
several calls on different inputs so that the touched experts change from call to call. Targets:
T = 1 within 1.5x of the floor, T = 64 within 2x. The baseline (V4-Flash shape) is what a user
would write in PyTorch: a per-expert loop of bf16 GEMMs driven by host-side counts (eager).

    .venv/bin/python benchmarks/bench_moe.py
"""

from __future__ import annotations

import cupy as cp
import ml_dtypes
import numpy as np

from fp4kit.layers import MoE, RoutingConfig, SharedExpert

try:
    from benchmarks.common import Table, copy_bandwidth, device_name, events_us, graph_us
except ImportError:
    from common import Table, copy_bandwidth, device_name, events_us, graph_us

BF16 = ml_dtypes.bfloat16
CONFIGS = {
    "V4-Flash": dict(hidden=4096, experts=256, inner=2048, routing=RoutingConfig(top_k=6, score_func="sqrtsoftplus",
                                                                                  routed_scale=1.5), before=True),
    "V3": dict(hidden=7168, experts=256, inner=2048, routing=RoutingConfig(top_k=8, score_func="sigmoid", n_group=8,
                                                                            topk_group=4, routed_scale=2.5), before=False),
}
TOKENS = (1, 8, 64, 512)
ROTATE = 4  # inputs per graph


def build(cfg, seed=0):
    h, e, i = cfg["hidden"], cfg["experts"], cfg["inner"]
    rs = cp.random.RandomState(seed)
    gate = rs.standard_normal((e, h), dtype=cp.float32) / np.float32(np.sqrt(h))
    shared = SharedExpert.from_float(*(rs.standard_normal(s, dtype=cp.float32) / np.float32(np.sqrt(s[1]))
                                       for s in ((i, h), (i, h), (h, i))), limit=10.0)
    shared.gate_up.decode_max_m = shared.down.decode_max_m = 1 << 30  # keep T = 512 capturable

    class Lazy:  # per-expert matrices generated on demand, one at a time
        def __init__(self, rows, cols, seed):
            self.shape, self.seed = (e, rows, cols), seed

        def __getitem__(self, j):
            return cp.random.RandomState(self.seed + j).standard_normal(self.shape[1:], dtype=cp.float32) / np.float32(
                np.sqrt(self.shape[2]))

    layer = MoE.from_float(gate, Lazy(i, h, 1000), Lazy(i, h, 2000), Lazy(h, i, 3000), cfg["routing"], limit=10.0,
                           weight_before_down=cfg["before"], shared=shared)
    return layer, gate


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


def main() -> None:
    try:
        import torch
    except ImportError:
        torch = None
    bw = copy_bandwidth()
    print(f"{device_name()}: device-to-device copy {bw / 1e12:.2f} TB/s (read + write)")
    rng = np.random.default_rng(0)
    table = Table(f"MoE layer, W4A4, graph-replayed ({device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s)",
                  ["shape", "T", "µs", "experts touched", "byte floor µs", "x floor", "target",
                   "PyTorch loop µs", "speedup"])
    for name, cfg in CONFIGS.items():
        layer, _ = build(cfg)
        per_expert, shared_bytes = expert_bytes(layer)
        for t in TOKENS:
            xs = [cp.asarray(rng.standard_normal((t, cfg["hidden"])).astype(BF16)) for _ in range(ROTATE)]
            touched = np.mean([len(np.unique(cp.asnumpy(layer.route(x)[0]))) for x in xs])
            floor_us = (touched * per_expert + shared_bytes) / bw * 1e6
            us = graph_us(lambda j: layer(xs[j % ROTATE]), calls=ROTATE, replays=20)
            ratio = us / floor_us
            goal = {1: 1.5, 64: 2.0}.get(t)
            target = "" if goal is None else f"<= {goal}x floor: " + ("met" if ratio <= goal else "MISSED")
            base = torch_baseline(torch, layer, cfg, t, rng) if (torch is not None and name == "V4-Flash") else None
            table.add(**{"shape": name, "T": t, "µs": us, "experts touched": touched, "byte floor µs": floor_us,
                         "x floor": ratio, "target": target, "PyTorch loop µs": base,
                         "speedup": base / us if base else None})
        del layer
        cp.get_default_memory_pool().free_all_blocks()
    print()
    print(table.markdown())
    meta = {"device": device_name(), "copy_bandwidth_Bps": bw, "cupy": cp.__version__,
            "torch": getattr(torch, "__version__", None)}
    print("saved", table.save("bench_moe", meta))


if __name__ == "__main__":
    main()
