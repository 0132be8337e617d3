"""The MoE layer's FP8 peer for `bench_moe.py`: the same layer as a Hopper user would write it in
PyTorch with FP8 weights, to be captured in a CUDA graph.

Every expert's gate|up ``[2I, H]`` and down ``[H, I]`` weights are FP8 E4M3 with one fp32 scale
per output row; the activation rows are quantized to FP8 E4M3 with one scale per row (amax /
448) before each GEMM, which is ``torch._scaled_mm`` with row-wise scales (rows padded to 16, as
cuBLAS wants). The routing runs in the graph (logits, scores, top-k, the weights of the chosen
experts); which rows go to which expert is fixed when the peer is built, from the ids the fp4kit
layer chose for the same inputs (a graph cannot branch on device values, and a per-expert loop
over every expert would read weights the call does not need): a static dispatch, the peer's best
case. Per expert: gather its rows, gate|up GEMM, SwiGLU (+ clamp), routing weight, quantize, down
GEMM, add into the output; the shared expert likewise over every token.
"""

from __future__ import annotations

import math

import numpy as np

FP8_MAX = 448.0


def quantize_rows(torch, t):
    """FP8 E4M3 rows of ``t`` and their fp32 scales ``[rows, 1]`` (amax / 448; all-zero rows scale 1e-12 / 448)."""
    scale = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def scaled_mm(torch, a, a_scale, w, w_scale):
    """``(a * a_scale) @ (w * w_scale)^T`` in bf16: ``a [M, K]`` FP8 with ``a_scale [M, 1]``, ``w [N, K]``
    FP8 with ``w_scale [1, N]``; cuBLAS FP8 with row-wise scales on a GPU, the same product in fp32
    on the CPU (for tests)."""
    if a.is_cuda:
        return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
    return ((a.float() * a_scale) @ (w.float() * w_scale.t()).t()).to(torch.bfloat16)


class Fp8MoePeer:
    """``forward(j)``: the layer on input ``xs[j]`` (bf16 ``[T, H]`` torch tensors), routed statically by
    ``ids[j]`` (int ``[T, top_k]``, host arrays); experts' FP8 weights made from ``weights(e)``, a
    function returning fp32/bf16 ``(gate_up [2I, H] with gate rows first, down [H, I])``."""

    def __init__(self, torch, xs, ids, gate, routing, weights, shared, *, limit=None, before=True):
        self.torch, self.xs, self.gate = torch, xs, gate.float()
        self.routing, self.limit, self.before = routing, limit, before
        self.inner = shared[1].shape[1]
        self.experts = {}
        for e in sorted({int(v) for a in ids for v in a.ravel()}):
            self.experts[e] = self._quantized(*weights(e))
        self.shared = self._quantized(*shared)
        device = xs[0].device
        # per input: for each expert, its (token, slot) pairs, and those rows padded to 16
        self.plans = []
        for a in ids:
            plan = []
            for e in sorted({int(v) for v in a.ravel()}):
                tok, slot = (v.tolist() for v in np.nonzero(a == e))  # token-major, as the rows of ids
                pad = -(-len(tok) // 16) * 16
                plan.append((e, len(tok), torch.tensor(tok, device=device),
                             torch.tensor(tok + [tok[0]] * (pad - len(tok)), device=device),
                             torch.tensor([t * a.shape[1] + s for t, s in zip(tok, slot)], device=device)))
            self.plans.append((torch.tensor(a, dtype=torch.long, device=device), plan))
        t = xs[0].shape[0]
        self.all_rows = torch.tensor(list(range(t)) + [0] * (-(-t // 16) * 16 - t), device=device)

    def _quantized(self, gate_up, down):
        torch = self.torch
        w13, s13 = quantize_rows(torch, gate_up)
        w2, s2 = quantize_rows(torch, down)
        return w13, s13.t().contiguous(), w2, s2.t().contiguous()

    def _route(self, x, ids):
        """The routing weights of the static ids (the top-k runs for its cost, as a user's layer has it)."""
        torch, r = self.torch, self.routing
        logits = x.float() @ self.gate.t()
        if r.score_func == "sqrtsoftplus":
            scores = torch.sqrt(torch.nn.functional.softplus(logits))
        elif r.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1)
        scores.topk(r.top_k, dim=-1)
        w = scores.gather(1, ids)
        if r.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w * r.routed_scale

    def _expert(self, xq, xs, rows, weights, row_factor=None):
        """SwiGLU expert on the FP8 rows ``rows`` of the layer input: bf16 ``[len(rows), H]``."""
        torch = self.torch
        w13, s13, w2, s2 = weights
        h = scaled_mm(torch, xq.index_select(0, rows), xs.index_select(0, rows), w13, s13)
        g, u = h[:, :self.inner], h[:, self.inner:]
        if self.limit is not None:
            g, u = g.clamp(max=self.limit), u.clamp(min=-self.limit, max=self.limit)
        a = torch.nn.functional.silu(g) * u
        if row_factor is not None:
            a = a * row_factor[:, None].to(a.dtype)
        aq, a_scale = quantize_rows(torch, a)
        return scaled_mm(torch, aq, a_scale, w2, s2)

    def forward(self, j: int):
        torch = self.torch
        x = self.xs[j]
        ids, plan = self.plans[j]
        w = self._route(x, ids).flatten()
        xq, xs = quantize_rows(torch, x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, n, tok, rows, pair in plan:
            factor = w.index_select(0, pair)
            padded = torch.nn.functional.pad(factor, (0, rows.shape[0] - n)) if self.before else None
            y = self._expert(xq, xs, rows, self.experts[e], padded)[:n].float()
            out.index_add_(0, tok, y if self.before else y * factor[:, None])
        shared = self._expert(xq, xs, self.all_rows, self.shared)[:x.shape[0]].float()
        return (out + shared).to(torch.bfloat16)


def random_weights(torch, hidden: int, inner: int, device, seed: int):
    """``weights(e)`` for `Fp8MoePeer`: expert e's random bf16 weights (scaled by 1 / sqrt(fan-in))."""
    def weights(e: int):
        gen = torch.Generator(device=device).manual_seed(seed + e)
        gate_up = torch.randn(2 * inner, hidden, device=device, dtype=torch.bfloat16, generator=gen) / math.sqrt(hidden)
        down = torch.randn(hidden, inner, device=device, dtype=torch.bfloat16, generator=gen) / math.sqrt(inner)
        return gate_up, down
    return weights
