"""The QAT simulations and the Hadamard rotation of `fp4kit.reference.qat` against their formulas
written out value by value (Python floats, `math.frexp` for the power-of-two scale, an explicit
nearest-grid-point search with ties to the even code), and their algebraic properties."""

import math

import ml_dtypes
import numpy as np
import pytest

from fp4kit.reference import qat

BF16 = ml_dtypes.bfloat16
E4M3_GRID = sorted({float(v) for v in np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
                    if np.isfinite(v) and v >= 0})
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_even(v: float, grid: list[float]) -> float:
    """The grid point nearest |v| (a tie to the one with the even code: even index), signed as v."""
    a = abs(v)
    best = min(range(len(grid)), key=lambda i: (abs(a - grid[i]), i % 2))
    return math.copysign(grid[best], v)


def pow2_at_least(r: float) -> float:
    mantissa, exponent = math.frexp(r)  # r = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return 2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0 ** exponent


def simulate_by_hand(x: np.ndarray, block: int, fmt_max: float, floor: float, grid: list[float]) -> np.ndarray:
    out = np.empty(x.shape, np.float64)
    flat, res = x.reshape(-1, block).astype(np.float64), out.reshape(-1, block)
    for row, dst in zip(flat, res):
        amax = max(float(np.float32(max(abs(v) for v in row))), floor)
        s = pow2_at_least(float(np.float32(np.float32(amax) * np.float32(1.0 / fmt_max))))
        for i, v in enumerate(row):
            dst[i] = nearest_even(min(max(v / s, -fmt_max), fmt_max), grid) * s
    return out


@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0, 1e-7])
def test_fp8_simulation_equals_the_formula(rng, scale):
    x = (rng.standard_normal((3, 256)) * scale * rng.lognormal(0, 2, (3, 1))).astype(BF16)
    x[0, :64] = 0  # an all-zero block keeps a finite scale and stays zero
    # a block spanning E4M3's subnormals: x / s below 2**-6 rounds on the 2**-9 grid, so the scale matters
    x[1, 64:128] = (scale * 2.0**-15 * np.linspace(0.1, 7.9, 64)).astype(BF16)
    x[1, 64] = scale
    got = qat.fp8_simulate(x, 64)
    assert got.dtype == BF16
    want = simulate_by_hand(x.astype(np.float32), 64, 448.0, qat.FP8_AMAX_FLOOR, E4M3_GRID)
    np.testing.assert_array_equal(got.astype(np.float64), want)
    assert not got[0, :64].astype(np.float32).any()


@pytest.mark.parametrize("scale", [1.0, 5e-3, 1e4])
def test_fp4_simulation_equals_the_formula(rng, scale):
    x = (rng.standard_normal((4, 128)) * scale).astype(np.float32)
    x[1, 32:64] = 0
    # every tie between E2M1 points, both signs, at scale 1 (amax 6: s = 1)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x[2, :32] = np.array([6.0] + ties + [-t for t in ties] + [0.0] * 17, np.float32) * scale
    got = qat.fp4_simulate(x, 32)
    want = simulate_by_hand(x, 32, 6.0, qat.FP4_AMAX_FLOOR, E2M1_GRID)
    np.testing.assert_array_equal(got.astype(np.float64), want)


def test_simulations_are_idempotent_and_bounded(rng):
    x = (rng.standard_normal((8, 512)) * rng.lognormal(0, 3, (8, 1))).astype(np.float32)
    for simulate, block, rel in ((qat.fp8_simulate, 64, 2.0**-4), (qat.fp4_simulate, 32, 0.5)):
        once = simulate(x, block)
        np.testing.assert_array_equal(simulate(once, block), once)
        blocks, err = x.reshape(-1, block), np.abs(once - x).reshape(-1, block)
        # within half a grid step at the top of the block's range
        assert (err <= rel * np.abs(blocks).max(axis=1, keepdims=True) + 1e-30).all()


def test_scale_is_the_smallest_power_of_two_covering_the_block():
    amax = np.array([448.0, 449.0, 1.0, 0.0, 3.0e-5], np.float32)
    s = qat.pow2_scale(amax, 448.0, qat.FP8_AMAX_FLOOR)
    assert s.tolist() == [1.0, 2.0, 2.0**-8, 2.0**-22, 2.0**-22]  # 1e-4 / 448 = 2.2e-7: 2**-22 covers it
    assert qat.pow2_scale(np.float32(6.0), 6.0, qat.FP4_AMAX_FLOOR) == 1.0


@pytest.mark.parametrize("d", [1, 2, 8, 128])
def test_hadamard_is_the_sylvester_matrix_scaled(rng, d):
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    x = rng.standard_normal((5, d))
    np.testing.assert_allclose(qat.hadamard(x), x @ h / math.sqrt(d), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(qat.hadamard(qat.hadamard(x)), x, rtol=1e-12, atol=1e-12)  # its own inverse
    xb = x.astype(BF16)
    assert qat.hadamard(xb).dtype == BF16


@pytest.mark.parametrize("call, match", [
    (lambda: qat.fp8_simulate(np.zeros((2, 48), np.float32), 64), "multiple of 64"),
    (lambda: qat.fp4_simulate(np.zeros(30, np.float32), 32), "multiple of 32"),
    (lambda: qat.hadamard(np.zeros((2, 96))), "power of two"),
])
def test_bad_shapes_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
