"""Device memory the example model needs for a configuration, counted from its shapes without
building anything: the weights as the model holds them (NVFP4 linears: packed codes, one E4M3
scale per 16 and an fp32 global scale; the embedding and routers in bf16; norms, sinks, the
compressors' position biases and the hyper-connections' mixing weights in fp32), with the routed
experts split over expert-parallel ranks, and the KV caches of ``batch`` sequences at the
configuration's ``max_context`` (preallocated: the window ring, every compressed entry, the
compressors' running state, the indexer's key cache). tests/test_memory_plan.py checks both against
a built model's arrays. A decode step's intermediates come on top (`benchmarks/bench_decode.py`
measures them).
"""

from __future__ import annotations

import math

import numpy as np

from fp4kit.reference.kv_cache import coff

from . import official
from .config import ModelConfig
from .init import linear_shapes


def nvfp4_bytes(n: int, k: int) -> int:
    """Bytes of one NVFP4 weight ``[n, k]``: codes, block scales, global scale."""
    return n * k // 2 + n * (k // 16) + 4


def weight_bytes(cfg: ModelConfig, ep: int = 1) -> dict[str, int]:
    """Bytes of ``cfg``'s weights on each GPU of ``ep`` expert-parallel ranks (each holds
    ``ceil(experts / ep)`` routed experts of every layer and everything else whole), by part."""
    if ep < 1 or ep > cfg.experts:
        raise ValueError(f"ep: expected 1 to {cfg.experts} expert-parallel ranks, got {ep}")
    per_rank = -(-cfg.experts // ep)
    routed = dense = 0
    for block, ratio in cfg.blocks():
        for name, (n, k) in linear_shapes(cfg, block, ratio).items():
            if ".experts." in name:
                if int(name.split(".experts.")[1].split(".")[0]) < per_rank:
                    routed += nvfp4_bytes(n, k)
            else:
                dense += nvfp4_bytes(n, k)
    others = {ours: math.prod(shape) * np.dtype(dtype or np.float16).itemsize  # dtype None: the router, bf16
              for ours, shape, dtype in official._others(cfg).values()}
    embed = others.pop("embed")
    return {"routed experts": routed, "attention and shared experts": dense,
            "lm_head": nvfp4_bytes(cfg.vocab, cfg.hidden), "embedding": embed,
            "norms, routers, mixing": sum(others.values())}


def _cache_bytes(batch: int, window: int, head_dim: int, ratio: int, max_comp: int) -> int:
    """One `fp4kit.KVCache` (``KVCache._allocate``): the window ring and positions, and with a
    compressor its entries, lengths and running state (its parameters are the weights' arrays)."""
    total = batch * (window * head_dim * 2 + 4)
    if ratio:
        width = coff(ratio) * head_dim
        total += batch * (max_comp * head_dim * 2 + 4 + 2 * coff(ratio) * ratio * width * 4)
    return total


def kv_cache_bytes(cfg: ModelConfig, batch: int) -> int:
    """Bytes of the caches of ``batch`` sequences (`dsv4.model.Attention.caches`)."""
    total = 0
    for _, ratio in cfg.blocks():
        total += _cache_bytes(batch, cfg.window, cfg.head_dim, ratio, max(1, cfg.max_comp(ratio)))
        if ratio == 4:  # the indexer's key cache
            total += _cache_bytes(batch, 1, cfg.index_head_dim, 4, cfg.max_comp(4))
        elif not ratio:  # no compressed entries: one empty entry, its index and length
            total += batch * (4 + cfg.head_dim * 2 + 4)
    return total
