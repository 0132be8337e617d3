"""`fp4kit.reference.fp32.ftz` (the kernels' -ftz=true) against its definition: a subnormal fp32
becomes a zero of its sign, every other value (zeros, normals, infinities, NaN payloads) keeps its
bits."""

import numpy as np

from fp4kit.reference import fp32


def definition(bits: np.ndarray) -> np.ndarray:
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    return np.where((exponent == 0) & (mantissa != 0), bits & 0x80000000, bits).astype(np.uint32)


def test_ftz_flushes_exactly_the_subnormals():
    rng = np.random.default_rng(0)
    edges = np.array([0, 1, 2, 0x7FFFFF, 0x800000, 0x800001, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF],
                     np.uint32)
    bits = np.concatenate([edges, edges | 0x80000000, rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32),
                           rng.integers(0, 0x800000, 1 << 16, dtype=np.uint32) | 0x80000000])
    got = fp32.ftz(bits.view(np.float32))
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), definition(bits))
    normal = np.array([1.0, -2.5, np.inf], np.float32)
    assert fp32.ftz(normal) is normal  # nothing to flush: the array itself
