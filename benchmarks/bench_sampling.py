"""Benchmark: token sampling, graph-replayed, vocab 129280, batch 1, 8, 64.

Modes: greedy, temperature 1.0, top-k 50, top-p 0.9. Targets per call: <= 10 µs at batch 1 and
<= 15 µs at batch 8, in every mode.
Baseline, measured in the same run: top-p written in PyTorch (sort, cumsum, mask, then the
exponential race argmax(p / Exp(1)), which is capturable), graph-replayed.

    .venv/bin/python benchmarks/bench_sampling.py
"""

from __future__ import annotations

import cupy as cp
import ml_dtypes
import numpy as np

from fp4kit.layers.sampler import Generator, Sampler

try:
    from benchmarks.common import Table, command_line, device_name, graph_us, torch_graph_us
except ImportError:
    from common import Table, command_line, device_name, graph_us, torch_graph_us

BF16 = ml_dtypes.bfloat16
VOCAB = 129280
# the target holds in every mode: top-k then top-p (a common default pair) takes a path of its own
# in raw_kernels/sampling.cu (the gathered cut), and a small top-p keeps only a few tokens
MODES = {"greedy": dict(temperature=0.0), "temperature 1.0": dict(temperature=1.0), "top-k 50": dict(top_k=50),
         "top-p 0.9": dict(top_p=0.9), "top-k 50 + top-p 0.9": dict(top_k=50, top_p=0.9),
         "top-p 0.3": dict(top_p=0.3)}


def main() -> None:
    command_line(__doc__)  # no flags: --help, or a stray flag stops here
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    table = Table(f"Sampling, vocab {VOCAB}, bf16 logits, graph-replayed ({device_name()})",
                  ["mode", "batch", "µs", "target", "PyTorch top-p µs", "speedup"])
    for b in (1, 8, 64):
        logits = cp.asarray((rng.standard_normal((b, VOCAB)) * 3).astype(BF16))
        tt = None
        if torch is not None:
            lt = torch.from_dlpack(logits)

            def torch_top_p():
                p = torch.softmax(lt.float(), dim=-1)
                sp, si = torch.sort(p, dim=-1, descending=True)
                cum = torch.cumsum(sp, dim=-1)
                sp = sp.masked_fill(cum - sp >= 0.9, 0.0)
                q = torch.empty_like(sp).exponential_()
                return si.gather(-1, (sp / q).argmax(-1, keepdim=True))

            tt = torch_graph_us(torch, lambda i: torch_top_p())
        for mode, params in MODES.items():
            sampler = Sampler(Generator(1), **params)
            us = graph_us(lambda i: sampler(logits))
            bound = {1: 10, 8: 15}.get(b)
            target = f"<= {bound} µs " + ("met" if us <= bound else "MISSED") if bound else ""
            row = {"mode": mode, "batch": b, "µs": us, "target": target}
            if mode == "top-p 0.9" and tt is not None:
                row.update({"PyTorch top-p µs": tt, "speedup": tt / us})
            table.add(**row)
    print()
    print(table.markdown())
    meta = {"device": device_name(), "vocab": VOCAB, "cupy": cp.__version__, "torch": getattr(torch, "__version__", None)}
    print("saved", table.save("bench_sampling", meta))


if __name__ == "__main__":
    main()
