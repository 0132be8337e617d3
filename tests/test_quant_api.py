"""The public quantization API on the numpy backend: results, out=, status, and every bad input
getting a clear error before anything runs."""

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit import formats
from fp4kit.ops.quant import swiglu
from fp4kit.reference import quant as ref

BF16 = ml_dtypes.bfloat16


def test_quantize_matches_reference_with_leading_dims(rng):
    x = rng.standard_normal((2, 3, 64)).astype(BF16)
    q = fp4kit.quantize(x)
    r = ref.quantize(x)
    assert isinstance(q, fp4kit.Nvfp4Tensor) and q.shape == (2, 3, 64)
    assert np.array_equal(q.packed, r.packed) and np.array_equal(q.block_scales, r.block_scales)
    assert q.global_scale == r.global_scale
    d = fp4kit.dequantize(q, BF16)
    assert d.dtype == BF16 and d.shape == x.shape


def test_static_scale_swizzled_and_out(rng):
    x = rng.standard_normal((5, 32)).astype(np.float16)
    s = np.array(300.0, np.float32)
    out = fp4kit.Nvfp4Tensor(
        np.full((5, 16), 0xAB, np.uint8), np.full(128 * 4, 0xAB, np.uint8), np.zeros((), np.float32), "swizzled", (5, 32)
    )
    q = fp4kit.quantize(x, global_scale=s, scale_layout="swizzled", out=out)
    assert q is out and out.global_scale == 300
    r = ref.quantize(x, s, "swizzled")
    assert np.array_equal(out.packed, r.packed) and np.array_equal(out.block_scales, r.block_scales)


def test_amax_and_global_scale(rng):
    x = rng.standard_normal((4, 48)).astype(np.float32)
    x[3, 47] = -9.5
    a = fp4kit.amax(x)
    assert a == 9.5 and a.dtype == np.float32 and a.shape == ()
    assert fp4kit.global_scale_from_amax(a) == np.float32(2688) / np.float32(9.5)
    out = np.zeros((), np.float32)
    assert fp4kit.amax(x, out=out) is out and out == 9.5


def test_swiglu_quantize_matches_reference(rng):
    h = rng.standard_normal((3, 128)).astype(BF16)
    w = rng.uniform(0.1, 1, 3).astype(np.float32)
    q = fp4kit.swiglu_quantize(h, layout="concatenated", limit=2.0, row_scale=w)
    r = ref.swiglu_quantize(h, "concatenated", 2.0, None, w)
    assert q.shape == (3, 64)
    assert np.array_equal(q.packed, r.packed) and q.global_scale == r.global_scale


def test_empty_tensor_is_valid():
    q = fp4kit.quantize(np.zeros((0, 64), np.float32))
    assert q.packed.shape == (0, 32) and q.block_scales.shape == (0, 4)
    assert q.global_scale == np.finfo(np.float32).max  # amax of nothing is 0
    assert fp4kit.dequantize(q).shape == (0, 64)


def test_status_word_records_nonfinite_input():
    fp4kit.clear_status()
    assert fp4kit.check_finite()
    x = np.ones((1, 16), np.float32)
    fp4kit.quantize(x)
    assert fp4kit.check_finite()
    x[0, 3] = np.inf
    fp4kit.quantize(x)
    assert not fp4kit.check_finite()
    with pytest.raises(FloatingPointError, match="non-finite"):
        fp4kit.check_finite(raise_error=True)
    fp4kit.clear_status()
    assert fp4kit.check_finite()


class _CpuDLPack:
    """A foreign CPU array that only speaks DLPack."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_cpu_producer_runs_the_reference(rng):
    x = rng.standard_normal((2, 32)).astype(np.float32)
    q = fp4kit.quantize(_CpuDLPack(x))
    assert np.array_equal(q.packed, ref.quantize(x).packed)


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda: fp4kit.quantize(np.zeros((2, 24), np.float32)), ValueError, r"x: last dimension must be a multiple of 16, got shape \(2, 24\)"),
        (lambda: fp4kit.quantize(np.zeros((2, 32), np.int32)), TypeError, "x: expected dtype bfloat16, float16 or float32, got int32"),
        (lambda: fp4kit.quantize(np.zeros((2, 32), np.float64)), TypeError, "got float64"),
        (lambda: fp4kit.quantize(np.zeros((32, 4), np.float32).T), ValueError, "x: expected a C-contiguous array"),
        (lambda: fp4kit.quantize([[1.0] * 16]), TypeError, "x: expected a numpy, CuPy or DLPack array, got list"),
        (lambda: fp4kit.quantize(np.zeros(()), ), TypeError, "x: expected dtype"),
        (lambda: fp4kit.quantize(np.zeros((), np.float32)), ValueError, "x: last dimension must be a multiple of 16"),
        (lambda: fp4kit.quantize(np.zeros((2, 32), np.float32), global_scale=1.0), TypeError, "global_scale: expected a 0-d float32 array"),
        (lambda: fp4kit.quantize(np.zeros((2, 32), np.float32), global_scale=np.array(1.0)), ValueError, "global_scale: expected a 0-d .* float32 array, got shape \\(\\), dtype float64"),
        (lambda: fp4kit.quantize(np.zeros((2, 32), np.float32), global_scale=np.ones(2, np.float32)), ValueError, "global_scale: expected a 0-d"),
        (lambda: fp4kit.quantize(np.zeros((2, 2, 32), np.float32), scale_layout="swizzled"), ValueError, "scale_layout='swizzled' describes 2-D"),
        (lambda: fp4kit.quantize(np.zeros((2, 32), np.float32), scale_layout="blocked"), ValueError, "scale_layout: expected one of"),
        (lambda: fp4kit.quantize(np.zeros((2, 32), np.float32), out=np.zeros(3)), TypeError, "out: expected an Nvfp4Tensor, got ndarray"),
        (lambda: fp4kit.quantize(np.zeros((2, 32), np.float32), out=ref.quantize(np.zeros((3, 32), np.float32))), ValueError, r"out: expected an Nvfp4Tensor of shape \(2, 32\)"),
        (lambda: fp4kit.quantize(np.zeros((2, 32), np.float32), out=ref.quantize(np.zeros((2, 32), np.float32), scale_layout="swizzled")), ValueError, "with scale_layout 'linear'"),
        (lambda: fp4kit.swiglu_quantize(np.zeros((2, 48), np.float32)), ValueError, "h: last dimension must be a multiple of 32"),
        (lambda: fp4kit.swiglu_quantize(np.zeros((2, 64), np.float32), layout="pairs"), ValueError, "layout: expected one of"),
        (lambda: fp4kit.swiglu_quantize(np.zeros((2, 64), np.float32), limit=-1.0), ValueError, "limit: expected a positive finite float"),
        (lambda: fp4kit.swiglu_quantize(np.zeros((2, 64), np.float32), row_scale=np.ones(3, np.float32)), ValueError, r"row_scale: expected float32 of shape \(2,\)"),
        (lambda: fp4kit.dequantize(np.zeros((2, 16), np.uint8)), TypeError, "q: expected an Nvfp4Tensor"),
        (lambda: fp4kit.dequantize(ref.quantize(np.zeros((2, 32), np.float32)), np.int8), TypeError, "dtype: expected bfloat16, float16 or float32, got int8"),
        (lambda: fp4kit.dequantize(ref.quantize(np.zeros((2, 32), np.float32)), out=np.zeros((2, 16), np.float32)), ValueError, r"out: expected shape \(2, 32\) and dtype float32"),
        (lambda: fp4kit.amax(np.zeros((2, 32), np.float32), out=np.zeros(1, np.float64)), ValueError, r"out: expected shape \(\) and dtype float32"),
        (lambda: fp4kit.global_scale_from_amax(np.float32(2.0)), TypeError, "amax: expected a 0-d float32 array"),
    ],
)
def test_bad_input_gets_a_clear_error(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


# -- ops.quant.swiglu: the bf16 SwiGLU of the W4A16 down-projection input ---------------------------

def _swiglu_float64(h, layout, limit, row_scale):
    """silu(gate) * up from the definition, in float64: the layouts written out independently."""
    h = np.asarray(h).astype(np.float64)
    if layout == "interleaved":  # 16-element chunks alternate gate, up
        chunks = h.reshape(*h.shape[:-1], -1, 2, 16)
        g, u = chunks[..., 0, :].reshape(*h.shape[:-1], -1), chunks[..., 1, :].reshape(*h.shape[:-1], -1)
    else:
        g, u = np.split(h, 2, axis=-1)
    if limit is not None:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    act = g / (1 + np.exp(-g)) * u
    return act if row_scale is None else act * row_scale[..., None]


@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32])
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_swiglu_is_silu_gate_times_up_rounded_once_to_bf16(rng, dtype, layout):
    h = (rng.standard_normal((2, 3, 128)) * 4).astype(dtype)
    rs = rng.uniform(0.1, 2, (2, 3)).astype(np.float32)
    for limit, row_scale in ((None, None), (5.0, None), (5.0, rs)):
        y = swiglu(h, layout=layout, limit=limit, row_scale=row_scale)
        assert y.shape == (2, 3, 64) and y.dtype == BF16
        exact = _swiglu_float64(h, layout, limit, row_scale)
        # one bf16 rounding of an fp32 result a few fp32 ulps from exact (silu's exp ~2 ulp)
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 2.0**-126))) - 7)
        err = np.abs(y.astype(np.float64) - exact)
        assert (err <= 0.5 * ulp + 8 * 2.0**-24 * np.abs(exact)).all(), (err / ulp).max()
        # and the swapped halves (a layout bug) are far outside that
        swapped = _swiglu_float64(np.concatenate(np.split(np.asarray(h, np.float64), 2, -1)[::-1], -1)
                                  if layout == "concatenated" else
                                  np.asarray(h, np.float64).reshape(2, 3, -1, 2, 16)[..., ::-1, :].reshape(2, 3, 128),
                                  layout, limit, row_scale)
        assert np.abs(y.astype(np.float64) - swapped).max() > 1.0


def test_swiglu_nan_stays_nan_and_out_is_written_in_place(rng):
    h = rng.standard_normal((4, 64)).astype(np.float32)
    h[1, 3] = np.nan  # gate element 3 of row 1 (interleaved: the first 16 are gate)
    out = np.full((4, 32), np.inf, BF16)
    y = swiglu(h, limit=1.0, out=out)
    assert y is out
    assert np.isnan(out[1, 3].astype(np.float32)) and np.isfinite(np.delete(out.astype(np.float32).ravel(), 35)).all()
    assert np.array_equal(out.view(np.uint16), swiglu(h, limit=1.0).view(np.uint16))


@pytest.mark.parametrize("call, exc, message", [
    (lambda h: swiglu(h[:, :48]), ValueError, "h: last dimension must be a multiple of 32"),
    (lambda h: swiglu(h, layout="blocked"), ValueError, "layout: expected one of"),
    (lambda h: swiglu(h, limit=-1.0), ValueError, "limit: expected a positive finite float"),
    (lambda h: swiglu(h, row_scale=np.ones(3, np.float32)), ValueError, r"row_scale: expected float32 of shape \(4,\)"),
    (lambda h: swiglu(h, out=np.empty((4, 32), np.float32)), ValueError, "out: expected shape"),
    (lambda h: swiglu(h.astype(np.int32)), TypeError, "h: expected dtype bfloat16, float16 or float32"),
])
def test_swiglu_bad_input(call, exc, message):
    with pytest.raises(exc, match=message):
        call(np.zeros((4, 64), np.float32))
