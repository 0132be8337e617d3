"""Seeded random weights, the same numbers on numpy and on the GPU.

Each tensor's values come from an integer hash of (seed, tensor name, element index), so they do
not depend on the backend or on the order tensors are made in: a model built on the GPU and the
same model built on numpy hold identical bf16/fp32 weights, and identical NVFP4 codes (the
quantizers are bit-exact). Values are uniform with the standard deviation asked for.

The weights are returned as a `fp4kit.checkpoint.Checkpoint` (quantized tensors in `weights`,
the rest in `extra`), the same object `fp4kit.load_nvfp4` returns for a saved model, so building
from random weights and loading from a checkpoint share one code path. Quantized tensors follow
the ModelOpt naming (``<prefix>.weight`` codes, scales and global scale per prefix); gate and up
projections of each expert are quantized separately and fused exactly when the layer is built.
"""

from __future__ import annotations

import zlib

import numpy as np

import fp4kit
from fp4kit.checkpoint import Checkpoint
from fp4kit.runtime.arrays import BF16

from .config import ModelConfig

_U32 = np.uint32


def _mix(xp, h):
    """A 32-bit integer finaliser (xorshift-multiply); uint32 arithmetic wraps on both backends."""
    h = h ^ (h >> _U32(16))
    h = h * _U32(0x7FEB352D)
    h = h ^ (h >> _U32(15))
    h = h * _U32(0x846CA68B)
    return h ^ (h >> _U32(16))


def uniform(xp, seed: int, name: str, shape: tuple[int, ...], std: float, dtype=np.float32):
    """Values uniform in ``[-a, a)`` with ``a = std * sqrt(3)``, from (seed, name, index)."""
    n = int(np.prod(shape))
    if n >= 2**32:
        raise ValueError(f"{name}: {n} elements exceed the 32-bit index of the generator")
    key = _U32(zlib.crc32(f"{seed}:{name}".encode()))
    h = _mix(xp, xp.arange(n, dtype=_U32) * _U32(0x9E3779B9) + key)
    h = _mix(xp, h ^ _U32((int(key) * 0x85EBCA6B) & 0xFFFFFFFF))
    u = (h >> _U32(8)).astype(np.float32) * np.float32(2.0**-24)  # exact, in [0, 1)
    a = np.float32(std * 3.0**0.5)
    return ((u * np.float32(2.0) - np.float32(1.0)) * a).astype(dtype).reshape(shape)


def linear_shapes(cfg: ModelConfig, block: str, ratio: int) -> dict[str, tuple[int, int]]:
    """Quantized linear weights ``{prefix: (out, in)}`` of the block at checkpoint prefix ``block``
    (``layers.{i}``, or ``mtp.{j}`` with its two input projections; the routed experts too)."""
    p = f"{block}.attn"
    d, hd = cfg.hidden, cfg.heads * cfg.head_dim
    shapes = {f"{p}.wq_a": (cfg.q_lora, d), f"{p}.wq_b": (hd, cfg.q_lora), f"{p}.wkv": (cfg.head_dim, d),
              f"{p}.wo_b": (d, cfg.o_groups * cfg.o_lora)}
    for g in range(cfg.o_groups):
        shapes[f"{p}.wo_a.{g}"] = (cfg.o_lora, hd // cfg.o_groups)
    coff = 2 if ratio == 4 else 1
    if ratio:
        shapes[f"{p}.compressor.wkv"] = (coff * cfg.head_dim, d)
        shapes[f"{p}.compressor.wgate"] = (coff * cfg.head_dim, d)
    if ratio == 4:
        shapes[f"{p}.indexer.wq"] = (cfg.index_heads * cfg.index_head_dim, cfg.q_lora)
        shapes[f"{p}.indexer.weights_proj"] = (cfg.index_heads, d)
        shapes[f"{p}.indexer.compressor.wkv"] = (coff * cfg.index_head_dim, d)
        shapes[f"{p}.indexer.compressor.wgate"] = (coff * cfg.index_head_dim, d)
    expert = {"gate_proj": (cfg.inner, d), "up_proj": (cfg.inner, d), "down_proj": (d, cfg.inner)}
    for owner in ["shared"] + [f"experts.{e}" for e in range(cfg.experts)]:
        shapes.update({f"{block}.ffn.{owner}.{proj}": shape for proj, shape in expert.items()})
    if block.startswith("mtp."):  # the next token's embedding and the hidden state, each to the block's input
        shapes[f"{block}.e_proj"] = shapes[f"{block}.h_proj"] = (d, d)
    return shapes


def hc_shapes(cfg: ModelConfig, prefix: str, head: bool = False) -> dict[str, tuple[int, ...]]:
    """The hyper-connection parameters ``{name: shape}`` of one mixing site (the official names:
    ``layers.{i}.hc_attn_*``, ``layers.{i}.hc_ffn_*``, ``hc_head_*``); none for ``hc_mult == 1``.
    A sublayer's site has ``(2 + hc) * hc`` mixes (pre, post, the hc x hc combination), the head's hc."""
    hc = cfg.hc_mult
    if hc == 1:
        return {}
    mixes = hc if head else (2 + hc) * hc
    return {f"{prefix}_fn": (mixes, hc * cfg.hidden), f"{prefix}_scale": (1 if head else 3,), f"{prefix}_base": (mixes,)}


# (std, mean) of the random hyper-connection parameters: the mixes O(1) on a unit-RMS stream
_HC_INIT = {"fn": lambda cfg: ((cfg.hc_mult * cfg.hidden) ** -0.5,), "scale": lambda cfg: (0.1, 1.0),
            "base": lambda cfg: (0.5,)}


def random_checkpoint(cfg: ModelConfig, seed: int, *, device: bool) -> Checkpoint:
    """All weights of a model with config ``cfg`` (CuPy arrays on the current device, or numpy)."""
    if device:
        import cupy as xp
    else:
        xp = np
    ckpt = Checkpoint(layout="modelopt")

    def quantized(name: str, shape: tuple[int, int]) -> None:
        ckpt.weights[name] = fp4kit.quantize(uniform(xp, seed, name, shape, shape[1] ** -0.5))

    def extra(name: str, shape, std: float, mean: float = 0.0, dtype=np.float32) -> None:
        v = uniform(xp, seed, name, shape, std)
        ckpt.extra[name] = (v + np.float32(mean)).astype(dtype) if mean else v.astype(dtype)

    extra("embed", (cfg.vocab, cfg.hidden), 1.0, dtype=BF16)
    for p, ratio in cfg.blocks():
        for name, shape in linear_shapes(cfg, p, ratio).items():
            quantized(name, shape)
        extra(f"{p}.attn_norm", (cfg.hidden,), 0.1, 1.0)
        extra(f"{p}.ffn_norm", (cfg.hidden,), 0.1, 1.0)
        extra(f"{p}.attn.q_norm", (cfg.q_lora,), 0.1, 1.0)
        extra(f"{p}.attn.kv_norm", (cfg.head_dim,), 0.1, 1.0)
        extra(f"{p}.attn.sink", (cfg.heads,), 0.5)
        if ratio:
            coff = 2 if ratio == 4 else 1
            extra(f"{p}.attn.compressor.ape", (ratio, coff * cfg.head_dim), 0.1)
            extra(f"{p}.attn.compressor.norm", (cfg.head_dim,), 0.1, 1.0)
        if ratio == 4:
            extra(f"{p}.attn.indexer.compressor.ape", (ratio, 2 * cfg.index_head_dim), 0.1)
            extra(f"{p}.attn.indexer.compressor.norm", (cfg.index_head_dim,), 0.1, 1.0)
        f = f"{p}.ffn"
        extra(f"{f}.gate.weight", (cfg.experts, cfg.hidden), cfg.hidden**-0.5, dtype=BF16)
        extra(f"{f}.gate.bias", (cfg.experts,), 0.01)
        if cfg.hashed(p):
            ckpt.extra[f"{f}.tid2eid"] = _hash_table(xp, seed, f"{f}.tid2eid", cfg)
        if p.startswith("mtp."):
            for norm in ("enorm", "hnorm", "norm"):
                extra(f"{p}.{norm}", (cfg.hidden,), 0.1, 1.0)
    sites = [(f"{p}.hc_{part}", False) for p, _ in cfg.blocks() for part in ("attn", "ffn")]
    sites += [(f"{p}.hc_head", True) for p, _ in cfg.blocks() if p.startswith("mtp.")]
    for site, head in sites + [("hc_head", True)]:
        for name, shape in hc_shapes(cfg, site, head).items():
            extra(name, shape, *_HC_INIT[name.rpartition("_")[2]](cfg))
    extra("norm", (cfg.hidden,), 0.1, 1.0)
    quantized("lm_head", (cfg.vocab, cfg.hidden))
    return ckpt


def _hash_table(xp, seed: int, name: str, cfg: ModelConfig):
    """int32 ``[vocab, top_k]``: distinct experts per token (a random rotation of a fixed stride)."""
    start = (uniform(xp, seed, name, (cfg.vocab,), 1.0) + np.float32(3.0**0.5)) * np.float32(cfg.experts / (2 * 3.0**0.5))
    start = xp.minimum(start.astype(np.int32), np.int32(cfg.experts - 1))
    stride = max(1, cfg.experts // cfg.top_k)
    return ((start[:, None] + stride * xp.arange(cfg.top_k, dtype=np.int32)[None, :]) % cfg.experts).astype(np.int32)
