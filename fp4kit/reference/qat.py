"""DeepSeek-V4's simulated activation quantization and the indexer's Hadamard rotation: the
specification, in numpy.

The model was trained with some activations rounded through a low-precision format and back
(quantization-aware training), and its inference does the same, in place, so that the values a
layer sees are those it was trained on:

* the latent KV's channels outside RoPE: E4M3 with one power-of-two scale per block of 64
  (`fp8_simulate`);
* the lightning indexer's queries and compressed keys, after a Hadamard rotation (`hadamard`):
  E2M1 with one power-of-two scale per block of 32 (`fp4_simulate`).

A block's scale is the smallest power of two ``s`` with ``amax * (1 / fmt_max) <= s`` (the
exponent of that fp32 product, plus one unless its mantissa is zero), where ``amax`` is the
block's largest magnitude, raised to a floor first (``1e-4`` for E4M3, ``fmt_max * 2**-126`` for
E2M1) so that an all-zero block has a finite scale. Each value becomes ``code(clamp(x / s,
-fmt_max, fmt_max)) * s`` (round to nearest, ties to even), in fp32, then rounded to the input's
dtype (exact for bf16: a code times a power of two has at most 3 significant bits and stays in
range). A power-of-two scale makes ``x / s`` exact, so the result does not depend on dividing or
multiplying by ``1 / s``.

`hadamard` is ``x @ H / sqrt(d)`` over the last axis, ``H`` the Sylvester Hadamard matrix of
order ``d`` (a power of two): orthonormal and its own inverse. Computed in float64 and rounded
once to the input's dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..formats import E2M1_MAX, E2M1_VALUES, E4M3_MAX
from .fp32 import F32
from .quant import e2m1_encode

#: the amax floor of each format (an all-zero block keeps a finite power-of-two scale)
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126


def pow2_scale(amax, fmt_max: float, floor: float) -> np.ndarray:
    """The smallest power of two ``>= max(amax, floor) * fp32(1 / fmt_max)`` (fp32 arithmetic)."""
    r = np.maximum(np.asarray(amax, F32), F32(floor)) * F32(1.0 / fmt_max)
    bits = r.astype(F32).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int64) - 127 + ((bits & 0x7FFFFF) != 0)
    return np.ldexp(F32(1), exponent).astype(F32)


def _blocks(x, block: int) -> np.ndarray:
    xf = np.asarray(x).astype(F32)
    if xf.ndim == 0 or xf.shape[-1] % block:
        raise ValueError(f"x: expected a last dimension that is a multiple of {block}, got shape {np.shape(x)}")
    return xf.reshape(*xf.shape[:-1], xf.shape[-1] // block, block)


def fp8_simulate(x, block: int = 64) -> np.ndarray:
    """``x`` rounded through E4M3 with a power-of-two scale per ``block`` values along the last
    axis, in ``x``'s dtype (see the module docstring)."""
    b = _blocks(x, block)
    s = pow2_scale(np.abs(b).max(axis=-1), E4M3_MAX, FP8_AMAX_FLOOR)[..., None]
    q = np.clip(b / s, -F32(E4M3_MAX), F32(E4M3_MAX)).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    return (q * s).reshape(np.shape(x)).astype(np.asarray(x).dtype)


def fp4_simulate(x, block: int = 32) -> np.ndarray:
    """``x`` rounded through E2M1 with a power-of-two scale per ``block`` values along the last
    axis, in ``x``'s dtype (see the module docstring)."""
    b = _blocks(x, block)
    s = pow2_scale(np.abs(b).max(axis=-1), E2M1_MAX, FP4_AMAX_FLOOR)[..., None]
    q = E2M1_VALUES[e2m1_encode(np.clip(b / s, -F32(E2M1_MAX), F32(E2M1_MAX)))]
    return (q * s).reshape(np.shape(x)).astype(np.asarray(x).dtype)


def hadamard(x) -> np.ndarray:
    """``x @ H / sqrt(d)`` over the last axis (Sylvester ``H`` of order ``d``, a power of two), in
    float64 by butterflies, rounded once to ``x``'s dtype."""
    a = np.asarray(x)
    d = a.shape[-1] if a.ndim else 0
    if d < 1 or d & (d - 1):
        raise ValueError(f"x: expected a last dimension that is a power of two, got shape {a.shape}")
    y = a.astype(np.float64).reshape(-1, d)
    h = 1
    while h < d:  # pairs (i, i + h) inside each block of 2h: (u + v, u - v)
        y = y.reshape(-1, d // (2 * h), 2, h)
        y = np.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), axis=2).reshape(-1, d)
        h *= 2
    return (y / np.sqrt(d)).reshape(a.shape).astype(a.dtype)
