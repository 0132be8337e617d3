"""DeepSeek-V4 manifold-constrained hyper-connections (mHC) and YaRN RoPE frequencies: the
specification, in float64.

**Hyper-connections.** The residual stream is ``hc`` copies ``X [..., hc, D]`` (the embedding
repeated). Before a sublayer, per token:

* ``mixes = (flatten(X) @ fn^T) * rsqrt(mean(flatten(X)^2) + norm_eps)`` with ``fn
  [(2 + hc) * hc, hc * D]``;
* ``pre = sigmoid(mixes[:hc] * scale[0] + base[:hc]) + eps``;
  ``post = 2 * sigmoid(mixes[hc:2hc] * scale[1] + base[hc:2hc])``;
  ``comb = softmax_rows(mixes[2hc:].view(hc, hc) * scale[2] + base[2hc:]) + eps``, then the columns
  divided by (their sum + eps), then ``iters - 1`` rounds of rows then columns the same way (a
  Sinkhorn projection towards a doubly stochastic matrix);
* the sublayer input is ``sum_i pre[i] * X[i]`` (then the sublayer's RMSNorm).

After the sublayer with output ``y [..., D]``: ``X'[j] = post[j] * y + sum_i comb[i, j] * X[i]``.
The head mixes the copies once more with ``pre = sigmoid(mixes * scale + base) + eps`` (``fn
[hc, hc * D]``) before the final norm.

**YaRN.** The RoPE inverse frequencies ``theta^(-2i / d)`` of the channel pairs below the
correction range keep their value, those above are divided by ``factor``, and a linear ramp blends
the two in between; the range comes from the wavelengths at ``beta_fast`` and ``beta_slow``
rotations over the original context.
"""

from __future__ import annotations

import math

import numpy as np


def hc_mixes(x, fn, norm_eps: float = 1e-6) -> np.ndarray:
    """``[..., M]`` mixing logits of the copies ``x [..., hc, D]`` (``fn [M, hc * D]``)."""
    xf = np.asarray(x, np.float64).reshape(*np.shape(x)[:-2], -1)
    rms = 1.0 / np.sqrt((xf * xf).mean(-1, keepdims=True) + norm_eps)
    return (xf @ np.asarray(fn, np.float64).T) * rms


def split_sinkhorn(mixes, scale, base, hc: int, iters: int = 20, eps: float = 1e-6):
    """``(pre [..., hc], post [..., hc], comb [..., hc, hc])`` from the mixing logits."""
    m = np.asarray(mixes, np.float64)
    scale, base = np.asarray(scale, np.float64), np.asarray(base, np.float64)
    pre = 1.0 / (1.0 + np.exp(-(m[..., :hc] * scale[0] + base[:hc]))) + eps
    post = 2.0 / (1.0 + np.exp(-(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])))
    logits = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    comb = e / e.sum(-1, keepdims=True) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return pre, post, comb


def hc_pre(x, fn, scale, base, *, iters: int = 20, eps: float = 1e-6, norm_eps: float = 1e-6):
    """The sublayer input ``[..., D]`` and the ``(post, comb)`` that `hc_post` needs."""
    x = np.asarray(x, np.float64)
    pre, post, comb = split_sinkhorn(hc_mixes(x, fn, norm_eps), scale, base, x.shape[-2], iters, eps)
    return (pre[..., None] * x).sum(-2), post, comb


def hc_post(y, x, post, comb) -> np.ndarray:
    """The new copies ``[..., hc, D]``: ``post[j] * y + sum_i comb[i, j] * x[i]``."""
    y, x = np.asarray(y, np.float64), np.asarray(x, np.float64)
    return post[..., None] * y[..., None, :] + np.einsum("...ij,...id->...jd", comb, x)


def hc_head(x, fn, scale, base, *, eps: float = 1e-6, norm_eps: float = 1e-6) -> np.ndarray:
    """The head's single mix ``[..., D]`` of the copies (before the final norm)."""
    x = np.asarray(x, np.float64)
    m = hc_mixes(x, fn, norm_eps)
    pre = 1.0 / (1.0 + np.exp(-(m * np.asarray(scale, np.float64).reshape(-1)[0] + np.asarray(base, np.float64)))) + eps
    return (pre[..., None] * x).sum(-2)


def yarn_correction_range(dim: int, original: int, theta: float, beta_fast: float, beta_slow: float):
    """``(low, high)``: the channel pairs ``i < low`` keep ``theta^(-2i/d)``, ``i > high`` are
    divided by the factor (pairs completing ``beta_fast`` / ``beta_slow`` rotations over the
    original context bound the range)."""
    def pair(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = math.floor(pair(beta_fast)), math.ceil(pair(beta_slow))
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, theta: float, factor: float, original: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> np.ndarray:
    """float64 ``[dim / 2]`` RoPE inverse frequencies with YaRN scaling (``factor <= 1``: none)."""
    freqs = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if factor <= 1:
        return freqs
    low, high = yarn_correction_range(dim, original, theta, beta_fast, beta_slow)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / max(high - low, 1e-3), 0.0, 1.0)
    keep = 1.0 - ramp
    return freqs / factor * (1.0 - keep) + freqs * keep
