"""Benchmark: the attention-side components, graph-replayed.

* `KVCache.append` (sliding window only), T = 1 and T = 4096 tokens, batch 1, latent 512;
* `score_topk` at live compressed lengths 1K, 8K, 32K with k = 512 and 2048, batch 1 and 8
  (64 index heads x 128): target <= 20 µs at 32K, batch 1; against `torch.topk` on the same scores
  and against scoring + top-k written with PyTorch, both graph-replayed;
* sparse decode attention, 64 heads over a 512-d latent, 128 window + 512 selected entries,
  batch 1 and 32: µs and % of the byte floor (every candidate row and the queries read once).

    .venv/bin/python benchmarks/bench_attention.py
"""

from __future__ import annotations

import cupy as cp
import ml_dtypes
import numpy as np

from fp4kit.layers.kv_cache import KVCache

try:
    from benchmarks.common import Table, command_line, copy_bandwidth, device_name, graph_us, torch_graph_us
except ImportError:
    from common import Table, command_line, copy_bandwidth, device_name, graph_us, torch_graph_us

BF16 = ml_dtypes.bfloat16


def main() -> None:
    command_line(__doc__)  # no flags: --help, or a stray flag stops here
    try:
        import torch
    except ImportError:
        torch = None
    bw = copy_bandwidth()
    print(f"{device_name()}: device-to-device copy {bw / 1e12:.2f} TB/s (read + write)")
    rng = np.random.default_rng(0)
    table = Table(f"Attention-side components, graph-replayed ({device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s)",
                  ["op", "shape", "µs", "GB/s", "% of copy BW", "target", "PyTorch µs", "speedup"])

    for t in (1, 4096):
        cache = KVCache(1, head_dim=512, ratio=0)
        kv = cp.asarray(rng.standard_normal((1, t, 512)).astype(BF16))
        us = graph_us(lambda i: cache.append(kv))
        moved = 2 * min(t, 128) * 512 * 2
        table.add(op="KVCache.append (window)", shape=f"B=1, T={t}", **{"µs": us, "GB/s": moved / us / 1e3,
                                                                        "% of copy BW": 100 * moved / us / 1e-6 / bw})

    from fp4kit.layers.indexer import Indexer

    heads, dim, capacity = 64, 128, 32768
    for b in (1, 8):
        q = cp.asarray(rng.standard_normal((b, heads, dim)).astype(BF16))
        w = cp.asarray(rng.uniform(0, 1, (b, heads)).astype(np.float32))
        keys = cp.asarray(rng.standard_normal((b, capacity, dim)).astype(BF16))
        for live in (1024, 8192, 32768):
            lengths = cp.full(b, live, cp.int32)
            for k in (512, 2048):
                indexer = Indexer(k, capacity=capacity, heads=heads, head_dim=dim)
                us = graph_us(lambda i: indexer.score_topk(q, w, keys, lengths))
                moved = b * (live * dim * 2 + heads * dim * 2) + b * k * 4
                target = ""
                if b == 1 and live == 32768:
                    target = "<= 20 µs " + ("met" if us <= 20 else "MISSED")
                tt = None
                if torch is not None:
                    qt, wt, kt = (torch.from_dlpack(a) for a in (q, w, keys))

                    def torch_score_topk():
                        s = torch.einsum("bhd,btd->bht", qt.float(), kt[:, :live].float())
                        return (torch.relu(s) * wt[..., None]).sum(1).topk(min(k, live), dim=-1)

                    tt = torch_graph_us(torch, lambda i: torch_score_topk())
                table.add(op=f"score_topk k={k}", shape=f"B={b}, live={live}",
                          **{"µs": us, "GB/s": moved / us / 1e3, "% of copy BW": 100 * moved / us / 1e-6 / bw,
                             "target": target, "PyTorch µs": tt, "speedup": tt / us if tt else None})
                if torch is not None and b == 1 and live == 32768 and k == 2048:
                    scores = torch.randn(1, live, device="cuda")
                    table.add(op="torch.topk alone k=2048", shape=f"B=1, live={live}",
                              **{"µs": torch_graph_us(torch, lambda i: scores.topk(k, dim=-1))})

    from fp4kit.layers.attention import SparseAttention

    hq, d, window, n_sel, cap = 64, 512, 128, 512, 4096
    for b in (1, 32):
        att = SparseAttention(hq, d)
        q = cp.asarray(rng.standard_normal((b, hq, d)).astype(BF16))
        swa = cp.asarray(rng.standard_normal((b, window, d)).astype(BF16))
        pos = cp.full(b, 1000, cp.int32)
        comp = cp.asarray(rng.standard_normal((b, cap, d)).astype(BF16))
        comp_len = cp.full(b, cap, cp.int32)
        idx = cp.asarray(np.stack([rng.choice(cap, n_sel, replace=False) for _ in range(b)]).astype(np.int32))
        us = graph_us(lambda i: att(q, swa, pos, comp, comp_len, idx))
        moved = b * ((window + n_sel) * d * 2 + 2 * hq * d * 2 + n_sel * 4)
        table.add(op="sparse attention", shape=f"B={b}, Hq={hq}, {window}+{n_sel} entries",
                  **{"µs": us, "GB/s": moved / us / 1e3, "% of copy BW": 100 * moved / us / 1e-6 / bw})

    print()
    print(table.markdown())
    meta = {"device": device_name(), "copy_bandwidth_Bps": bw, "cupy": cp.__version__,
            "torch": getattr(torch, "__version__", None)}
    print("saved", table.save("bench_attention", meta))


if __name__ == "__main__":
    main()
