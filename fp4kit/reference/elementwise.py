"""Specification of the row-wise kernels of a decode step (``raw_kernels/elementwise.cu``).

* ``rmsnorm_rope``: ``y = rope(x * rsqrt(mean(x^2) + eps) * w)`` per row, in fp32, rounded to bf16
  once; the norm and the weight are optional. RoPE rotates adjacent channel pairs of the last
  ``rope_dim`` channels by ``pos * theta^(-2i / rope_dim)`` (the convention of the KV cache's
  compressor, `fp4kit.reference.kv_cache.rope`), with cos and sin computed in float64 and rounded
  to fp32. ``theta`` is the base, or the pairs' inverse frequencies themselves, e.g. YaRN-scaled
  ones (`rope_inv_freq`; the kernels read them from a table, `fp4kit.ops.elementwise.rope_table`).
* ``add_rmsnorm``: the residual stream (fp32) gains ``delta`` (bf16), then its RMSNorm in bf16.
* ``embed``: rows of a bf16 table as fp32; a token outside ``[0, vocab)`` reads row 0 and is
  reported (`fp4kit.runtime.status.TOKEN_RANGE`).
* ``all_entries``: ``i if i < comp_len[b] else -1`` for ``i < n``.

The kernels sum squares in fp32 in a different order than numpy, so results agree to within a
bf16 rounding step, not bit for bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def _rsqrt_mean_square(x32: np.ndarray, eps: float) -> np.ndarray:
    mean = np.mean(x32.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (1.0 / np.sqrt(mean.astype(np.float32).astype(np.float64) + np.float32(eps))).astype(np.float32)


def rope_inv_freq(rope_dim: int, theta, name: str = "theta") -> np.ndarray:
    """float64 ``[rope_dim / 2]``: the inverse frequency of each channel pair, ``theta^(-2i / rope_dim)``
    for a base ``theta``, or ``theta`` itself where it is already those (a 1-D array, e.g. YaRN's:
    `fp4kit.reference.hyper_connections.yarn_inv_freq`)."""
    if np.ndim(theta):
        freqs = np.asarray(theta, np.float64)
        if freqs.shape != (rope_dim // 2,):
            raise ValueError(f"{name}: expected a RoPE base or {rope_dim // 2} inverse frequencies (one per channel "
                             f"pair of rope_dim {rope_dim}), got shape {freqs.shape}")
        return freqs
    i = np.arange(rope_dim // 2, dtype=np.float64)
    return float(theta) ** (-2.0 * i / rope_dim)


def rope(x32: np.ndarray, positions: np.ndarray, rope_dim: int, theta) -> np.ndarray:
    """Rotate the last ``rope_dim`` channels of fp32 ``x [..., D]`` in adjacent pairs; ``positions``
    broadcasts against ``x``'s leading dimensions; ``theta`` as `rope_inv_freq` takes it."""
    if rope_dim == 0:
        return x32
    y = x32.copy()
    d = x32.shape[-1]
    angle = np.asarray(positions, np.float64)[..., None] * rope_inv_freq(rope_dim, theta)
    c, s = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    a, b = x32[..., d - rope_dim :: 2], x32[..., d - rope_dim + 1 :: 2]
    y[..., d - rope_dim :: 2] = a * c - b * s
    y[..., d - rope_dim + 1 :: 2] = a * s + b * c
    return y


def rmsnorm_rope(x, weight=None, positions=None, *, eps: float = 1e-6, normalize: bool = True, rope_dim: int = 0,
                 theta=10000.0) -> np.ndarray:
    """bf16 ``[B, H, D]`` (or ``[B, D]``) -> bf16; ``positions`` int ``[B]`` (needed with RoPE)."""
    x32 = np.asarray(x).astype(np.float32)
    y = x32 * _rsqrt_mean_square(x32, eps) if normalize else x32
    if weight is not None:
        y = y * np.asarray(weight, np.float32)
    if rope_dim:
        pos = np.asarray(positions).reshape((-1,) + (1,) * (x32.ndim - 2))
        y = rope(y, pos, rope_dim, theta)
    return y.astype(BF16)


def add_rmsnorm(resid, delta, weight, *, eps: float = 1e-6) -> np.ndarray:
    """Adds bf16 ``delta [B, D]`` (or None) into fp32 ``resid`` in place; returns its bf16 RMSNorm."""
    if delta is not None:
        resid += np.asarray(delta).astype(np.float32)
    return (resid * _rsqrt_mean_square(resid, eps) * np.asarray(weight, np.float32)).astype(BF16)


def token_rows(tokens, vocab: int) -> tuple[np.ndarray, bool]:
    """The rows a table of ``vocab`` rows is read at for ``tokens`` (an id outside ``[0, vocab)``
    reads row 0, as the kernels do) and whether any id was out of range."""
    tokens = np.asarray(tokens).astype(np.int64)
    bad = (tokens < 0) | (tokens >= vocab)
    return np.where(bad, 0, tokens), bool(bad.any())


def embed(table, tokens) -> tuple[np.ndarray, bool]:
    """fp32 rows ``[B, H]`` of ``table [V, H]`` and whether a token was out of range (read as 0)."""
    rows, bad = token_rows(tokens, np.shape(table)[0])
    return np.asarray(table)[rows].astype(np.float32), bad


def all_entries(comp_len, n: int) -> np.ndarray:
    """int32 ``[B, n]``: ``i`` for the live entries ``i < comp_len[b]``, -1 after."""
    i = np.arange(n, dtype=np.int32)[None, :]
    return np.where(i < np.asarray(comp_len, np.int32)[:, None], i, np.int32(-1)).astype(np.int32)
