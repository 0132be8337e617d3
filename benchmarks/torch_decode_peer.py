"""The decode step's peer for `bench_decode.py`: the example model (examples/dsv4) written in
PyTorch with bf16 weights and cuBLAS GEMMs, as a user would write it, to be captured in a CUDA graph.

The weights are the model's NVFP4 weights dequantized to bf16 (the same model); the state (KV
rings, compressor slots, compressed entries, positions, the residual stream, the tokens) is a
copy of a `DecodeState`, so both run the same step from the same context. Per layer: RMSNorm,
the concatenated input projections, the query and latent norms with RoPE, the latent into the
window ring, the compressors (every step computes the block's entry; it is stored where the step
completes a block), on ratio-4 layers the indexer's scores and top-k over its own compressed
keys, attention with the sink over the window and the selected (ratio 4), every (ratio 128) or no
(ratio 0) compressed entry, the grouped output projection as one batched GEMM, RMSNorm, the MoE
(router with hash routing on the first layers; the routed experts as two `torch._grouped_mm`
over the assignments sorted by expert, no host sync; the shared expert), then the final norm, the
lm_head and a Gumbel-max sample at temperature 1. Rounding follows the model where it is cheap
(bf16 GEMM outputs and norms, fp32 residual and softmax), not bit for bit. Nothing in a step reads
a value back to the host, so it can be captured.
"""

from __future__ import annotations

import numpy as np

from fp4kit.reference.elementwise import rope_inv_freq


def _tensor(torch, a, device):
    """A numpy or CuPy array as a torch tensor on ``device`` (a copy: the peer owns its state)."""
    bf16 = a.dtype.name == "bfloat16"  # through int16: DLPack and numpy know no bfloat16
    if isinstance(a, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(a.view(np.int16) if bf16 else a))
    else:
        t = torch.from_dlpack(a.view("int16") if bf16 else a)
    return (t.view(torch.bfloat16) if bf16 else t).to(device).clone()


def peer_weights(torch, model, ckpt, device) -> dict:
    """The model's weights for `TorchDecodePeer`: every NVFP4 weight of ``ckpt`` dequantized to
    bf16 (the routed experts as ``[E, K, N]`` stacks of K-major matrices for `torch._grouped_mm`),
    the norms, router and attention constants; built once, shared by peers of any batch."""
    from fp4kit.ops.quant import dequantize

    cfg = model.cfg
    bf16 = ckpt.extra["embed"].dtype

    def dense(name):  # NVFP4 [N, K] -> bf16
        return _tensor(torch, dequantize(ckpt.weights[name], bf16), device)

    def extra(name):
        return _tensor(torch, ckpt.extra[name], device)

    layers = []
    for i, blk in enumerate(model.blocks):
        p, f = f"layers.{i}.attn", f"layers.{i}.ffn"
        of_h = blk.attn.of_h.names
        experts = range(cfg.experts)
        gate_up = torch.stack([torch.cat([dense(f"{f}.experts.{e}.gate_proj"), dense(f"{f}.experts.{e}.up_proj")])
                               for e in experts])
        layers.append({
            "ratio": cfg.compress_ratios[i], "theta": blk.attn.theta, "of_h": of_h,
            "sizes": [ckpt.weights[f"{p}.{n}"].shape[0] for n in of_h],
            "w_h": torch.cat([dense(f"{p}.{n}") for n in of_h]),
            "w_qr": torch.cat([dense(f"{p}.{n}") for n in blk.attn.of_qr.names]),
            "w_o": torch.stack([dense(f"{p}.wo_a.{g}") for g in range(cfg.o_groups)]),  # [G, o_lora, K / G]
            "wo_b": dense(f"{p}.wo_b"), "q_norm": extra(f"{p}.q_norm").float(),
            "kv_norm": extra(f"{p}.kv_norm").float(), "sink": extra(f"{p}.sink").float(),
            "attn_norm": extra(f"layers.{i}.attn_norm").float(), "ffn_norm": extra(f"layers.{i}.ffn_norm").float(),
            "gate": extra(f"{f}.gate.weight").float(), "bias": extra(f"{f}.gate.bias").float(),
            "tid2eid": extra(f"{f}.tid2eid").long() if f"{f}.tid2eid" in ckpt.extra else None,
            "w13": gate_up.transpose(1, 2),  # [E, H, 2I], gate columns first
            "w2": torch.stack([dense(f"{f}.experts.{e}.down_proj") for e in experts]).transpose(1, 2),
            "s13": torch.cat([dense(f"{f}.shared.gate_proj"), dense(f"{f}.shared.up_proj")]),
            "s2": dense(f"{f}.shared.down_proj")})
    return {"embed": extra("embed"), "norm": extra("norm").float(), "lm_head": dense("lm_head"), "layers": layers}


class TorchDecodePeer:
    """``step()``: one decode step of the model in PyTorch (weights from `peer_weights`) from a copy
    of ``state``; the logits (bf16 ``[B, V]``) are kept in ``logits`` and the samples replace
    ``tokens``."""

    def __init__(self, torch, cfg, weights: dict, state, device):
        self.torch, self.cfg, self.device = torch, cfg, device
        self.embed, self.norm, self.lm_head = weights["embed"], weights["norm"], weights["lm_head"]
        self.layers = [{**w, "kv": self._cache(caches["kv"]), "index": self._cache(caches.get("index"))}
                       for w, caches in zip(weights["layers"], state.layers)]
        self.resid = _tensor(torch, state.resid, device)
        self.tokens = _tensor(torch, state.tokens, device).long()
        self.logits = None

    def _cache(self, c):
        if c is None:
            return None
        torch = self.torch
        out = {"swa": _tensor(torch, c.swa, self.device), "pos": _tensor(torch, c.pos, self.device).long(),
               "window": c.window, "ratio": c.ratio, "eps": c.eps, "rope_dim": c.rope_dim}
        if c.ratio:
            for name in ("comp", "comp_len", "kv_state", "score_state", "ape", "norm_weight"):
                out[name] = _tensor(torch, getattr(c, name), self.device)
            out["comp_len"] = out["comp_len"].long()
        return out

    # --- row kernels -------------------------------------------------------------------------
    def _rms(self, x32, weight=None):
        y = x32 * self.torch.rsqrt((x32 ** 2).mean(-1, keepdim=True) + self.cfg.eps)
        return y if weight is None else y * weight

    def _rope(self, x32, pos, rope_dim: int, theta):
        """RoPE of the last ``rope_dim`` channels (adjacent pairs) of ``x32 [B, ..., D]`` at ``pos [B]``;
        ``theta`` the base or the pairs' inverse frequencies (YaRN's), as the model's layers hold it."""
        torch = self.torch
        if not rope_dim:
            return x32
        d = x32.shape[-1]
        freqs = torch.as_tensor(rope_inv_freq(rope_dim, theta), device=x32.device)  # float64
        angle = pos.double()[:, None] * freqs  # [B, rope_dim / 2]
        shape = (x32.shape[0],) + (1,) * (x32.dim() - 2) + (rope_dim // 2,)
        c, s = torch.cos(angle).float().reshape(shape), torch.sin(angle).float().reshape(shape)
        a, b = x32[..., d - rope_dim::2], x32[..., d - rope_dim + 1::2]
        y = x32.clone()
        y[..., d - rope_dim::2] = a * c - b * s
        y[..., d - rope_dim + 1::2] = a * s + b * c
        return y

    def _add_rmsnorm(self, delta, weight):
        if delta is not None:
            self.resid += delta.float()
        return self._rms(self.resid, weight).to(self.torch.bfloat16)

    # --- the compressor ----------------------------------------------------------------------
    def _compress(self, cache, c, z, theta: float):
        """Feed one token's ``c, z [B, coff*D]`` (bf16) to the compressor of ``cache`` at its position,
        store the block's entry where the token completes one, advance the position."""
        torch = self.torch
        r, pos = cache["ratio"], cache["pos"]
        kv_state, score_state, ape = cache["kv_state"], cache["score_state"], cache["ape"]
        slots, width = kv_state.shape[1], kv_state.shape[2]
        d = cache["comp"].shape[2]
        bsz = torch.arange(c.shape[0], device=c.device)
        slot = pos % slots
        kv_state[bsz, slot] = c.float()
        score_state[bsz, slot] = z.float()
        # the block ending at this token: its R rows (channels d.. with the overlap of ratio 4),
        # and for ratio 4 past the first block the previous block's R rows (channels ..d)
        end = pos
        offsets = torch.arange(r, device=c.device)
        rows = end[:, None] - r + 1 + offsets  # [B, R]
        if width == 2 * d:  # ratio 4: overlapping windows
            prev = rows - r
            all_rows = torch.cat([rows, prev], dim=1)
            chan = torch.cat([torch.full((r,), d, device=c.device), torch.zeros(r, device=c.device, dtype=torch.long)])
            valid = torch.cat([torch.ones_like(rows, dtype=torch.bool), (end + 1 >= 2 * r)[:, None].expand(-1, r)], dim=1)
        else:
            all_rows, chan, valid = rows, torch.zeros(r, device=c.device, dtype=torch.long), torch.ones_like(rows, dtype=torch.bool)
        idx = (all_rows % slots).clamp(min=0)
        cols = chan[None, :, None] + torch.arange(d, device=c.device)[None, None, :]  # [1, n, d]
        zz = score_state[bsz[:, None, None], idx[:, :, None], cols] + ape[(all_rows % r)[:, :, None], cols]
        vv = kv_state[bsz[:, None, None], idx[:, :, None], cols]
        zz = zz.double().masked_fill(~valid[:, :, None], -float("inf"))
        w = torch.softmax(zz, dim=1)
        entry = (w * vv.double()).sum(1)
        entry = entry / torch.sqrt((entry ** 2).mean(-1, keepdim=True) + cache["eps"]) * cache["norm_weight"].double()
        entry = self._rope(entry, end - r + 1, cache["rope_dim"], theta).to(torch.bfloat16)
        emits = ((pos + 1) % r == 0) & (cache["comp_len"] < cache["comp"].shape[1])
        at = cache["comp_len"].clamp(max=cache["comp"].shape[1] - 1)
        old = cache["comp"][bsz, at]
        cache["comp"][bsz, at] = torch.where(emits[:, None], entry, old)
        cache["comp_len"] += emits.long()
        cache["pos"] += 1

    # --- attention ---------------------------------------------------------------------------
    def _attend(self, q, swa, pos, comp, comp_len, indices, sink):
        """Attention with the sink of ``q [B, Hq, D]`` over the window rows and the chosen entries."""
        torch = self.torch
        b_, w_ = swa.shape[0], swa.shape[1]
        win_valid = torch.arange(w_, device=q.device)[None, :] < pos.clamp(max=w_)[:, None]
        rows, valid = [swa], [win_valid]
        if comp is not None:
            live = comp_len.clamp(max=comp.shape[1])
            if indices is None:  # every live entry
                rows.append(comp)
                valid.append(torch.arange(comp.shape[1], device=q.device)[None, :] < live[:, None])
            else:
                rows.append(comp[torch.arange(b_, device=q.device)[:, None], indices.clamp(min=0)])
                valid.append((indices >= 0) & (indices < live[:, None]))
        kv = torch.cat(rows, dim=1)  # [B, n, D]
        mask = torch.cat(valid, dim=1)
        logits = torch.einsum("bhd,bnd->bhn", q.float(), kv.float()) * q.shape[-1] ** -0.5
        logits = logits.masked_fill(~mask[:, None, :], -float("inf"))
        m = torch.maximum(logits.amax(-1), sink[None, :])
        e = torch.exp(logits - m[..., None])
        den = e.sum(-1) + torch.exp(sink[None, :] - m)
        return (torch.einsum("bhn,bnd->bhd", e, kv.float()) / den[..., None]).to(torch.bfloat16)

    def _attention(self, L, h):
        torch, cfg = self.torch, self.cfg
        bsz = h.shape[0]
        parts = dict(zip(L["of_h"], torch.split(h @ L["w_h"].t(), L["sizes"], dim=1)))
        cache, theta = L["kv"], L["theta"]
        pos = cache["pos"]
        qr = self._rms(parts["wq_a"].float(), L["q_norm"]).to(torch.bfloat16)
        kv = self._rope(self._rms(parts["wkv"].float(), L["kv_norm"]), pos, cfg.rope_dim, theta).to(torch.bfloat16)
        cache["swa"][torch.arange(bsz, device=h.device), pos % cache["window"]] = kv
        of_qr = qr @ L["w_qr"].t()
        q = of_qr[:, :cfg.heads * cfg.head_dim].reshape(bsz, cfg.heads, cfg.head_dim).float()
        q = self._rope(self._rms(q), pos, cfg.rope_dim, theta).to(torch.bfloat16)
        indices = comp = comp_len = None
        if L["ratio"] == 4:
            iq = of_qr[:, cfg.heads * cfg.head_dim:].reshape(bsz, cfg.index_heads, cfg.index_head_dim).float()
            iq = self._rope(iq, pos, cfg.rope_dim, theta).to(torch.bfloat16)
        if L["ratio"]:
            self._compress(cache, parts["compressor.wkv"], parts["compressor.wgate"], theta)
            comp, comp_len = cache["comp"], cache["comp_len"]
        else:
            cache["pos"] += 1
        if L["ratio"] == 4:
            keys = L["index"]
            self._compress(keys, parts["indexer.compressor.wkv"], parts["indexer.compressor.wgate"], theta)
            w = parts["indexer.weights_proj"].float() * float(np.float32((cfg.index_head_dim * cfg.index_heads) ** -0.5))
            dots = torch.einsum("bhd,bcd->bhc", iq.float(), keys["comp"].float()).clamp(min=0)
            scores = (w[:, :, None] * dots).sum(1)  # [B, C]
            live = keys["comp_len"].clamp(max=keys["comp"].shape[1])
            scores = scores.masked_fill(torch.arange(scores.shape[1], device=h.device)[None, :] >= live[:, None],
                                        -float("inf"))
            k = min(cfg.index_topk, scores.shape[1])
            vals, indices = scores.topk(k, dim=1)
            indices = torch.where(torch.isinf(vals), torch.full_like(indices, -1), indices)
        o = self._attend(q, cache["swa"], cache["pos"], comp, comp_len, indices, L["sink"])
        groups = L["w_o"].shape[0]
        o = torch.bmm(o.reshape(bsz, groups, -1).transpose(0, 1), L["w_o"].transpose(1, 2))  # [G, B, o_lora]
        return o.transpose(0, 1).reshape(bsz, -1) @ L["wo_b"].t()

    # --- MoE ---------------------------------------------------------------------------------
    def _swiglu(self, hgu, limit):
        torch = self.torch
        inner = hgu.shape[1] // 2
        g, u = hgu[:, :inner].float(), hgu[:, inner:].float()
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        return torch.nn.functional.silu(g) * u

    def _moe(self, L, h, layer: int):
        torch, cfg = self.torch, self.cfg
        t, k = h.shape[0], cfg.top_k
        scores = torch.sqrt(torch.nn.functional.softplus(h.float() @ L["gate"].t()))
        if L["tid2eid"] is not None and layer < cfg.hash_layers:
            ids = L["tid2eid"][self.tokens.clamp(0, L["tid2eid"].shape[0] - 1)]
        else:
            ids = (scores + L["bias"]).topk(k, dim=1).indices
        w = scores.gather(1, ids)
        w = w / w.sum(1, keepdim=True) * cfg.routed_scale
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = (torch.arange(t * k, device=h.device) // k)[order]
        counts = torch.zeros(cfg.experts, dtype=torch.long, device=h.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)  # (bincount would read its size back: no graph)
        hgu = torch._grouped_mm(h[token], L["w13"], offs=offs)
        act = (self._swiglu(hgu, cfg.swiglu_limit) * w.reshape(-1)[order][:, None]).to(torch.bfloat16)
        y = torch._grouped_mm(act, L["w2"], offs=offs)
        out = torch.zeros((t, h.shape[1]), dtype=torch.float32, device=h.device).index_add_(0, token, y.float())
        shared = (self._swiglu(h @ L["s13"].t(), cfg.swiglu_limit).to(torch.bfloat16) @ L["s2"].t())
        return (out + shared.float()).to(torch.bfloat16)

    def forward(self):
        """Logits bf16 ``[B, V]`` of the current tokens; the caches advance."""
        delta = None
        self.resid.copy_(self.embed[self.tokens.clamp(0, self.embed.shape[0] - 1)].float())
        for i, L in enumerate(self.layers):
            h = self._add_rmsnorm(delta, L["attn_norm"])
            h = self._add_rmsnorm(self._attention(L, h), L["ffn_norm"])
            delta = self._moe(L, h, i)
        h = self._add_rmsnorm(delta, self.norm)
        self.logits = h @ self.lm_head.t()
        return self.logits

    def step(self):
        """One decode step: the sample (Gumbel-max at temperature 1) replaces the tokens."""
        torch = self.torch
        logits = self.forward().float()
        u = torch.rand(logits.shape, device=logits.device).clamp(min=1e-20)
        self.tokens.copy_((logits - torch.log(-torch.log(u))).argmax(1))
        return self.tokens

