"""The NVFP4 quantization specification, in numpy.

This module is the definition the kernels are tested against bit for bit. The recipe is
Transformer Engine's reference (FlashInfer's exact mode): fp32 throughout, IEEE division,
ties to even, under the kernels' flush-to-zero (see `fp4kit.reference.fp32`).

Recipe, for a tensor ``x`` with encode scale ``S`` and each 16-element block ``b``::

    vmax  = max |x_i| over b                       (a NaN in the block makes vmax NaN)
    sf    = e4m3_rn_satfinite(min(vmax * (S * (1/6)), FLT_MAX))
    enc   = min(1 / (fp32(sf) * (1 / S)), FLT_MAX)
    code  = e2m1_rn(x_i * enc)                     (ties to even, saturating at ±6)

Edge cases, all fixed by the recipe and tested:

* ``amax = 0`` (all-zero tensor): ``S = FLT_MAX``; every block is zero: scale byte 0, codes 0
  (or 0x8 for -0.0).
* non-finite ``amax`` (a NaN or ±Inf in the tensor): ``S = 1``. The ops record the event in the
  device status word (`fp4kit.check_finite`).
* all-zero block: ``sf = 0`` so ``enc = FLT_MAX``; codes 0, or 0x8 for negative zeros.
* a non-zero block whose scale underflows E4M3 (``vmax * S / 6 < 2**-10``): ``sf = 0`` and
  ``enc = FLT_MAX``, so non-zero elements get ±6 (0x7 / 0xF); they dequantize to 0 all the same.
* a block holding ±Inf or NaN: ``vmax`` is non-finite, ``sf = 448`` (0x7E); ±Inf encode as ±6,
  NaN as +6 (0x7, as the hardware ``cvt.rn.satfinite.e2m1x2`` of sm_100a does).
* -0.0 and negatives that round to zero keep their sign: code 0x8.
* subnormal fp32/bf16 inputs are flushed to zero, as every fp32 operation of the kernels is.

Difference from TRT-LLM's default "fast-math" recipe: it uses ``rcp.approx`` where this uses
IEEE division, and ``S * (vmax * rcp(6))`` instead of ``vmax * (S * (1/6))``; about 0.1 % of codes
differ on realistic data, all at exact ties. ModelOpt's weight export divides instead of
multiplying by a reciprocal and clamps block scales to ``[2**-9, 448]`` (an all-zero block gets
scale 1.0, byte 0x38). Its dequantized values are not always these: a block whose scale
underflows E4M3 (``vmax * S / 6 < 2**-10``) is zeroed here (``sf = 0``, every element
dequantizes to 0) while ModelOpt clamps its scale to ``2**-9`` and keeps the values; and an
element at a division tie can round to the neighbouring E2M1 code (``x / scale`` there,
``x * (1 / scale)`` here). Everywhere else codes and dequantized values agree; a ModelOpt file is
read as written, bit for bit.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .. import formats
from ..formats import BLOCK_SIZE, E2M1_VALUES, E4M3_VALUES, Nvfp4Tensor
from . import fp32
from .fp32 import F32, FLT_MAX

#: gate and up alternate in chunks of this many elements in the "interleaved" layout
SWIGLU_INTERLEAVE = formats.ROW_INTERLEAVE
SWIGLU_LAYOUTS = ("interleaved", "concatenated")

_SIGN_MASK = np.uint32(0x7FFFFFFF)
_ONE_SIXTH = F32(1.0 / 6.0)


def to_float32(x) -> np.ndarray:
    """bf16 / fp16 / fp32 values as fp32 (exact), subnormals flushed as the kernels do."""
    return fp32.ftz(np.asarray(x).astype(F32))


def abs_max(xf: np.ndarray, axis=None) -> np.ndarray:
    """max |x| of fp32 values; a NaN anywhere makes the result NaN (NaN bits order above Inf)."""
    bits = np.ascontiguousarray(xf, dtype=F32).view(np.uint32) & _SIGN_MASK
    if bits.size == 0:
        return np.zeros(bits.shape[:-1] if axis is not None else (), dtype=F32)
    return np.asarray(bits.max(axis=axis)).astype(np.uint32).view(F32)


def amax(x) -> np.ndarray:
    """``max |x|`` over the whole tensor as a 0-d fp32 array (0 for an empty tensor)."""
    return abs_max(to_float32(x))


def global_scale_from_amax(amax_value) -> np.ndarray:
    """Encode scale ``S = min(2688 / amax, FLT_MAX)``, 1 where that is 0, 1 for non-finite amax.

    ``amax = 0`` gives ``FLT_MAX`` (2688/0 = inf, clamped). Returns a 0-d fp32 array.
    """
    a = fp32.ftz(amax_value)
    s = fp32.fmin(fp32.div(F32(formats.GLOBAL_SCALE_NUMERATOR), a), FLT_MAX)
    finite = a <= FLT_MAX  # False for NaN and +Inf
    return np.where(finite & (s != 0), s, F32(1)).astype(F32)


def e4m3_encode(v: np.ndarray) -> np.ndarray:
    """fp32 (non-negative, not NaN) to E4M3 bytes: round to nearest even, saturate at 448."""
    return np.minimum(v, F32(formats.E4M3_MAX)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e2m1_encode(y: np.ndarray) -> np.ndarray:
    """fp32 to E2M1 codes: ties to even, saturating at ±6, sign from the sign bit, NaN to 0x7."""
    a = np.abs(y)
    mag = (
        (a > 0.25).astype(np.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).astype(np.uint8)
    sign = np.signbit(y).astype(np.uint8) << 3
    return np.where(np.isnan(y), np.uint8(7), mag | sign).astype(np.uint8)


def block_scales_and_codes(xf: np.ndarray, global_scale) -> tuple[np.ndarray, np.ndarray]:
    """The recipe on fp32 values ``[..., K]``: block scales ``[..., K/16]`` and codes ``[..., K]``."""
    s = F32(global_scale)
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    vmax = abs_max(blocks, axis=-1)
    sf = e4m3_encode(fp32.fmin(fp32.mul(vmax, fp32.mul(s, _ONE_SIXTH)), FLT_MAX))
    enc = fp32.fmin(fp32.div(F32(1), fp32.mul(E4M3_VALUES[sf], fp32.div(F32(1), s))), FLT_MAX)
    codes = e2m1_encode(fp32.mul(blocks, enc[..., None]))
    return sf, codes.reshape(xf.shape)


def quantize(x, global_scale=None, scale_layout: str = "linear") -> Nvfp4Tensor:
    """Quantize ``x`` (``[..., K]``, bf16/fp16/fp32, K a multiple of 16) to NVFP4.

    ``global_scale`` is the encode scale ``S``; ``None`` computes it from ``amax(x)``.
    """
    x = np.ascontiguousarray(x)  # row chunks are views, not copies of the whole tensor each
    _check_quantize_layout(scale_layout)
    if global_scale is None:
        s = global_scale_from_amax(np.maximum.reduce([abs_max(to_float32(_rows(x, r))) for r in _row_chunks(x)]))
    else:
        s = np.asarray(global_scale, F32).reshape(())
    k = x.shape[-1]
    packed = np.empty((*x.shape[:-1], k // 2), np.uint8)
    sf = np.empty((*x.shape[:-1], k // BLOCK_SIZE), np.uint8)
    for r in _row_chunks(x):  # the same values as one pass over the whole tensor, in bounded memory
        sf_rows, codes = block_scales_and_codes(to_float32(_rows(x, r)), s)
        _rows(sf, r)[...] = sf_rows
        _rows(packed, r)[...] = formats.pack_nibbles(codes)
    if scale_layout == "swizzled":
        sf = formats.swizzle_scales(sf.reshape(-1, sf.shape[-1]))
    else:
        formats.block_scale_shape(x.shape, scale_layout)  # validates the name
    return Nvfp4Tensor(packed, sf, np.array(s, F32), scale_layout, x.shape)


#: the numpy quantizer and dequantizer work through a tensor this many elements at a time: its
#: temporaries stay in the cache instead of costing page faults (five times faster at 32M elements)
CHUNK_ELEMENTS = 1 << 18


def _row_chunks(x: np.ndarray) -> list[slice]:
    """Slices of ``x``'s rows (its last axis kept whole, leading axes flattened) of about
    `CHUNK_ELEMENTS` elements each."""
    n = math.prod(x.shape[:-1])
    step = max(1, CHUNK_ELEMENTS // max(x.shape[-1], 1))
    return [slice(r, min(r + step, n)) for r in range(0, n, step)] or [slice(0, 0)]  # an empty one has an amax


def _rows(a: np.ndarray, r: slice) -> np.ndarray:
    """Rows ``r`` of ``a`` viewed as ``[rows, last axis]`` (a view of a contiguous ``a``)."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])[r]


def _check_quantize_layout(scale_layout: str) -> None:
    if scale_layout == "tiled":
        raise ValueError("scale_layout: quantize writes 'linear' or 'swizzled' scales; the tiled GEMM weight layout "
                         "comes from fp4kit.formats.to_tiled(q)")


def dequantize(q: Nvfp4Tensor, dtype=np.float32) -> np.ndarray:
    """``e2m1 * (fp32(block_scale) / S)``, rounded to ``dtype`` (bf16, fp16 or fp32)."""
    packed = np.ascontiguousarray(q.linear_packed)
    sf = np.ascontiguousarray(q.linear_block_scales)
    s = F32(np.asarray(q.global_scale))
    out = np.empty(q.shape, dtype)
    for r in _row_chunks(packed):
        block_decode = fp32.div(E4M3_VALUES[_rows(sf, r)], s)
        vals = E2M1_VALUES[formats.unpack_nibbles(_rows(packed, r))].reshape(*block_decode.shape, BLOCK_SIZE)
        _rows(out, r)[...] = fp32.mul(vals, block_decode[..., None]).reshape(len(vals), q.shape[-1])
    return out


def split_gate_up(h, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """Gate and up halves of a fused ``[..., 2I]`` projection output.

    ``"concatenated"``: ``[gate | up]`` along the last axis.
    ``"interleaved"``: 16-element chunks alternate, ``h[..., 32j : 32j+16]`` is gate
    ``[16j : 16j+16]`` and ``h[..., 32j+16 : 32j+32]`` is up ``[16j : 16j+16]``; one output
    block of 16 comes from one contiguous 32-element chunk, and a GEMM tile of 32 columns
    holds matching gate and up columns (SwiGLU in the epilogue).
    """
    h = np.asarray(h)
    two_i = h.shape[-1]
    if two_i % (2 * BLOCK_SIZE):
        raise ValueError(f"h: last dimension must be a multiple of {2 * BLOCK_SIZE}, got shape {h.shape}")
    if layout == "concatenated":
        return h[..., : two_i // 2], h[..., two_i // 2 :]
    if layout == "interleaved":
        chunks = h.reshape(*h.shape[:-1], two_i // (2 * SWIGLU_INTERLEAVE), 2, SWIGLU_INTERLEAVE)
        flat = (*h.shape[:-1], two_i // 2)
        return chunks[..., 0, :].reshape(flat), chunks[..., 1, :].reshape(flat)
    raise ValueError(f"layout: expected one of {SWIGLU_LAYOUTS}, got {layout!r}")


def interleave_gate_up(gate, up):
    """Inverse of `split_gate_up` for the interleaved layout: ``[..., I]`` x 2 to ``[..., 2I]``."""
    gate, up = np.asarray(gate), np.asarray(up)
    c = gate.shape[-1] // SWIGLU_INTERLEAVE
    g = gate.reshape(*gate.shape[:-1], c, 1, SWIGLU_INTERLEAVE)
    u = up.reshape(*up.shape[:-1], c, 1, SWIGLU_INTERLEAVE)
    return np.concatenate([g, u], axis=-2).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def swiglu(h, layout: str = "interleaved", limit: float | None = None, row_scale=None) -> np.ndarray:
    """SwiGLU of a fused gate|up tensor in fp32: ``silu(gate) * up`` ``[..., I]``.

    ``limit`` (DeepSeek-V4 ``swiglu_limit``): gate clamped to ``<= limit`` and up to
    ``[-limit, limit]`` before the product; a NaN stays NaN. ``row_scale`` (fp32 ``[...]``,
    e.g. the routing weight that V4 applies before the down projection) multiplies each row.
    """
    gate, up = split_gate_up(h, layout)
    g, u = to_float32(gate), to_float32(up)
    if limit is not None:
        lim = F32(limit)
        g = np.where(g > lim, lim, g).astype(F32)
        u = np.where(u > lim, lim, np.where(u < -lim, -lim, u)).astype(F32)
    act = fp32.mul(fp32.silu(g), u)
    if row_scale is not None:
        act = fp32.mul(act, np.asarray(row_scale, F32)[..., None])
    return act


def swiglu_quantize(
    h,
    layout: str = "interleaved",
    limit: float | None = None,
    global_scale=None,
    row_scale=None,
    scale_layout: str = "linear",
) -> Nvfp4Tensor:
    """`swiglu` followed by `quantize` of the fp32 activations (no rounding in between)."""
    return quantize(swiglu(h, layout, limit, row_scale), global_scale, scale_layout)


def has_nonfinite(x) -> bool:
    """Whether ``x`` holds a NaN or ±Inf (what the kernels record in the status word): its max and
    min are both finite exactly when every value is (a NaN propagates through both), two passes
    without a temporary (fp32 input is read in place)."""
    x = np.asarray(x)
    if x.size == 0:
        return False
    xf = x if x.dtype == F32 else x.astype(F32)
    return not (np.isfinite(xf.max()) and np.isfinite(xf.min()))
