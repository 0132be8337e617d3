"""NVFP4 GEMM specification: ``y[M, N] = alpha * A_vals @ W_vals.T (+ bias)``.

* ``W`` is an `Nvfp4Tensor` ``[N, K]`` (any layout: the tiled GEMM layout is read through
  `Nvfp4Tensor.linear_packed`); its values are ``e2m1 * fp32(block_scale)`` (exact in
  bf16, fp16 and fp32) and its decode factor is ``1 / S_w`` — or, for a fused weight whose row
  ranges came from shards with different global scales, a per-row decode vector ``[N]``.
* ``A`` is an `Nvfp4Tensor` ``[M, K]`` (W4A4: values ``e2m1 * fp32(block_scale)``, decode
  factor ``1 / S_a``) or a bf16 ``[M, K]`` array (W4A16: the values themselves, factor 1).
* ``alpha = fp32(w_decode) * fp32(a_decode)``, each decode factor an IEEE fp32 division.

The product of two dequantized operands is exact in fp32, so a GEMM that accumulates in fp32
differs from this float64 reference only by summation order; the kernels are tested with
`calc_diff` against it.
"""

from __future__ import annotations

import numpy as np

from ..formats import BLOCK_SIZE, E2M1_VALUES, E4M3_VALUES, Nvfp4Tensor, unpack_nibbles
from . import fp32
from .fp32 import F32


def unscaled_values(q: Nvfp4Tensor) -> np.ndarray:
    """``e2m1 * fp32(block_scale)`` as float64 ``[..., K]`` (the global scale left out)."""
    codes = unpack_nibbles(np.asarray(q.linear_packed))
    sf = E4M3_VALUES[np.asarray(q.linear_block_scales)].astype(np.float64)
    vals = E2M1_VALUES[codes].astype(np.float64).reshape(*sf.shape, BLOCK_SIZE)
    return (vals * sf[..., None]).reshape(q.shape)


def decode_factor(global_scale) -> np.float32:
    """``1 / S`` in fp32, as the kernels compute it."""
    return fp32.div(F32(1), F32(np.asarray(global_scale))).astype(F32)[()]


def alpha(w: Nvfp4Tensor, a=None, row_decode=None) -> np.ndarray:
    """The fp32 output factor: per tensor (0-d) or per output row ``[N]``."""
    w_dec = np.asarray(row_decode, F32) if row_decode is not None else decode_factor(w.global_scale)
    if isinstance(a, Nvfp4Tensor):
        return fp32.mul(w_dec, decode_factor(a.global_scale))
    return np.asarray(w_dec, F32)


def gemm(a, w: Nvfp4Tensor, bias=None, row_decode=None, out_dtype=np.float32) -> np.ndarray:
    """``alpha * A_vals @ W_vals.T (+ bias)`` in float64, rounded once to ``out_dtype``."""
    a_vals = unscaled_values(a) if isinstance(a, Nvfp4Tensor) else np.asarray(a).astype(np.float64)
    y = a_vals.reshape(-1, w.shape[-1]) @ unscaled_values(w).T
    y = y * alpha(w, a, row_decode).astype(np.float64)
    if bias is not None:
        y = y + np.asarray(bias).astype(np.float64)
    return y.reshape(*np.shape(a_vals)[:-1], w.shape[0]).astype(out_dtype)


def calc_diff(x, y) -> float:
    """``1 - 2<x,y> / (|x|^2 + |y|^2)`` in float64: 0 for equal tensors, about the squared
    relative error otherwise (the GEMM test metric)."""
    x = np.asarray(x).astype(np.float64)
    y = np.asarray(y).astype(np.float64)
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)
