"""fp32 arithmetic exactly as the kernels do it.

The kernels are compiled with ``-ftz=true`` (CuPy always appends it): every fp32 operation
flushes subnormal inputs and results to a zero of the same sign. numpy does IEEE fp32 with
subnormals, so the reference flushes explicitly around each operation. Each helper is one
correctly rounded fp32 operation (what ``__fmul_rn`` / ``__fadd_rn`` / ``__fdiv_rn`` compile to),
never a fused multiply-add, so numpy reproduces the device bit for bit.

``exp`` and ``silu`` are written out of those operations (range reduction by powers of two,
a degree-7 polynomial) because libm's ``expf`` and CUDA's ``expf`` differ in the last bit.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
FLT_MIN = F32(np.finfo(np.float32).tiny)  # smallest normal, 2**-126
FLT_MAX = F32(np.finfo(np.float32).max)


def ftz(x):
    """Flush fp32 subnormals to a zero of the same sign (the kernels' ``-ftz=true``). Returns an
    fp32 array: ``x`` itself when it holds no subnormal (the common case, checked on the bits)."""
    x = np.asarray(x, dtype=F32)
    bits = x.reshape(-1).view(np.uint32)  # 1-d (x may be 0-d), so the arithmetic below stays in arrays
    # subnormal: exponent bits zero, mantissa not, i.e. bits << 1 (the sign shifted out) in
    # [2, 0x00FFFFFE]: one unsigned comparison after subtracting 2 (0 and -0 wrap to the top)
    shifted = np.left_shift(bits, np.uint32(1))
    np.subtract(shifted, np.uint32(2), out=shifted)
    tiny = shifted < np.uint32(0x00FFFFFE)
    if not tiny.any():
        return x
    return np.where(tiny, bits & np.uint32(0x80000000), bits).astype(np.uint32).view(F32).reshape(x.shape)


def mul(a, b):
    """``__fmul_rn`` under ftz."""
    with np.errstate(over="ignore", invalid="ignore"):
        return ftz(ftz(a) * ftz(b))


def add(a, b):
    """``__fadd_rn`` under ftz."""
    with np.errstate(over="ignore", invalid="ignore"):
        return ftz(ftz(a) + ftz(b))


def sub(a, b):
    """``__fsub_rn`` under ftz."""
    with np.errstate(over="ignore", invalid="ignore"):
        return ftz(ftz(a) - ftz(b))


def div(a, b):
    """``__fdiv_rn`` under ftz (IEEE division; x/0 = ±inf, 0/0 = NaN)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return ftz(ftz(a) / ftz(b))


def fmin(a, b):
    """``fminf``: the smaller of two, a NaN operand is ignored."""
    return np.fmin(ftz(a), ftz(b)).astype(F32)


def fmax(a, b):
    """``fmaxf``: the larger of two, a NaN operand is ignored."""
    return np.fmax(ftz(a), ftz(b)).astype(F32)


# exp(x) = 2**k * p(r), r = x - k*ln2 split into two constants so that k*LN2_HI is exact.
_LOG2E = F32(1.44269504088896341)
_LN2_HI = F32(0.693145751953125)  # 16 significant bits: k * _LN2_HI is exact for |k| < 2**8
_LN2_LO = F32(1.42860682030941723e-06)
_EXP_POLY = [F32(1.0 / 5040.0), F32(1.0 / 720.0), F32(1.0 / 120.0), F32(1.0 / 24.0), F32(1.0 / 6.0), F32(0.5), F32(1.0), F32(1.0)]
_EXP_LO = F32(-104.0)  # below: the result flushes to zero anyway
_EXP_HI = F32(89.0)  # above: the result overflows to +inf anyway


def _pow2(k):
    """2**k as fp32 for integer k in [-126, 127], built from its bits."""
    return ((k.astype(np.int32) + 127) << 23).astype(np.uint32).view(F32)


def exp(x):
    """fp32 ``exp`` as the kernels compute it (``fp4_exp`` in raw_kernels/common/fp32.cuh).

    Input clamped to [-104, 89] (a NaN becomes -104: callers carry NaN separately);
    relative error about 2 ulp.
    """
    x = fmin(fmax(x, _EXP_LO), _EXP_HI)
    k = np.rint(mul(x, _LOG2E)).astype(np.int32)  # round half to even, as __float2int_rn
    kf = k.astype(F32)
    r = sub(sub(x, mul(kf, _LN2_HI)), mul(kf, _LN2_LO))
    p = _EXP_POLY[0]
    for c in _EXP_POLY[1:]:
        p = add(mul(p, r), c)
    # scale in two steps so that each power of two is a normal number
    k1 = k >> 1  # floor, as the arithmetic shift in the kernel
    return mul(mul(p, _pow2(k1)), _pow2(k - k1))


def silu(g):
    """``g / (1 + exp(-g))`` in fp32, as the kernels compute it."""
    return div(g, add(F32(1), exp(-ftz(g))))
