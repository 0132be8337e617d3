"""The numpy reference is the specification: hand vectors for every edge case, independent
encoders (ml_dtypes casts), and property tests for the error bound and the SwiGLU layouts."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4kit import formats
from fp4kit.reference import fp32
from fp4kit.reference import quant as ref

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def one_block(values, s):
    """Scale byte and codes of one 16-element block quantized with encode scale ``s``."""
    x = np.zeros(16, F32)
    x[: len(values)] = values
    q = ref.quantize(x, np.array(s, F32))
    return int(q.block_scales[0]), formats.unpack_nibbles(q.packed).tolist()


def test_unit_encode_scale_setup():
    # vmax = 6 with S = 64: sf = e4m3(64) exactly and enc = 1/(64 * 2**-6) = 1, so every code
    # below is the plain E2M1 rounding of the value itself.
    sf, codes = one_block([6.0], 64.0)
    assert formats.E4M3_VALUES[sf] == 64.0 and codes[0] == 7


def test_all_seven_ties_round_to_even():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    _, codes = one_block([6.0, *ties], 64.0)
    assert codes[1:8] == [0, 2, 2, 4, 4, 6, 6]
    above = [np.nextafter(F32(t), F32(9)) for t in ties]
    _, codes = one_block([6.0, *above], 64.0)
    assert codes[1:8] == [1, 2, 3, 4, 5, 6, 7]
    below = [np.nextafter(F32(t), F32(0)) for t in ties]
    _, codes = one_block([6.0, *below], 64.0)
    assert codes[1:8] == [0, 1, 2, 3, 4, 5, 6]


def test_signs_negative_zero_and_small_negatives():
    _, codes = one_block([6.0, -6.0, -0.0, -0.1, 0.1, -1.0, -3.0], 64.0)
    assert codes[:7] == [0x7, 0xF, 0x8, 0x8, 0x0, 0xA, 0xD]


def test_saturation_at_six():
    # S = 512: vmax * S / 6 overflows E4M3, so sf saturates to 448 and enc = 512/448 > 1
    sf, codes = one_block([6.0, -6.0, 5.9, 1e30], 512.0)
    assert sf == 0x7E
    assert codes[:4] == [0x7, 0xF, 0x7, 0x7]


def test_global_scale_policy():
    g = ref.global_scale_from_amax
    assert g(F32(0)) == FLT_MAX
    assert g(F32(np.inf)) == 1 and g(F32(np.nan)) == 1
    assert g(F32(2688)) == 1 and g(F32(1.0)) == 2688
    assert g(F32(1e-40)) == FLT_MAX  # a subnormal amax flushes to zero
    a = F32(3.7)
    assert g(a) == F32(2688) / a


def test_all_zero_tensor():
    x = np.zeros((2, 32), F32)
    x[1, 3] = -0.0
    q = ref.quantize(x)
    assert q.global_scale == FLT_MAX
    assert (q.block_scales == 0).all()
    codes = formats.unpack_nibbles(q.packed)
    assert codes[1, 3] == 0x8 and codes.sum() == 0x8
    assert np.array_equal(ref.dequantize(q), x)


def test_all_zero_block_in_nonzero_tensor():
    x = np.zeros((1, 32), F32)
    x[0, :16] = np.linspace(-3, 3, 16)
    q = ref.quantize(x)
    assert q.block_scales[0, 1] == 0
    assert (formats.unpack_nibbles(q.packed)[0, 16:] == 0).all()


def test_block_scale_underflow_gives_saturated_codes_that_dequantize_to_zero():
    x = np.zeros((1, 32), F32)
    x[0, 0] = 1e6  # amax: S = 2688e-6
    x[0, 16:] = [1e-3, -1e-3] * 8  # vmax * S / 6 = 4.5e-10 < 2**-10: sf underflows
    q = ref.quantize(x)
    assert q.block_scales[0, 1] == 0
    assert formats.unpack_nibbles(q.packed)[0, 16:].tolist() == [0x7, 0xF] * 8
    assert (ref.dequantize(q)[0, 16:] == 0).all()


def test_nan_and_inf():
    x = np.linspace(-1, 1, 64).astype(F32).reshape(1, 64)
    x[0, 5] = np.nan
    x[0, 20] = np.inf
    x[0, 40] = -np.inf
    assert np.isnan(ref.amax(x))
    q = ref.quantize(x)
    assert q.global_scale == 1  # non-finite amax
    codes = formats.unpack_nibbles(q.packed)[0]
    assert codes[5] == 0x7 and codes[20] == 0x7 and codes[40] == 0xF
    assert q.block_scales[0, :3].tolist() == [0x7E, 0x7E, 0x7E]
    assert ref.has_nonfinite(x) and not ref.has_nonfinite(np.ones(3))
    # with a static scale the finite block is unaffected by the others
    q2 = ref.quantize(x, np.array(100.0, F32))
    q3 = ref.quantize(x[:, 48:].copy(), np.array(100.0, F32))
    assert np.array_equal(q2.packed[:, 24:], q3.packed)


def test_subnormal_inputs_flush_to_zero():
    x = np.zeros((1, 16), F32)
    x[0, 0], x[0, 1] = 1e-40, -1e-40
    assert ref.amax(x) == 0
    q = ref.quantize(x)
    assert formats.unpack_nibbles(q.packed)[0, :2].tolist() == [0x0, 0x8]
    xb = np.full((1, 16), 2.0**-130, ml_dtypes.bfloat16)  # a bf16 subnormal
    assert ref.amax(xb) == 0


def test_codes_match_ml_dtypes_e2m1_cast(rng):
    x = (rng.standard_normal((64, 256)) * rng.lognormal(0, 2, (64, 1))).astype(F32)
    q = ref.quantize(x)
    s = q.global_scale
    sf = q.block_scales.reshape(64, 16)
    with np.errstate(divide="ignore"):  # a zero block scale encodes with FLT_MAX, as the recipe does
        enc = np.fmin(F32(1) / (formats.E4M3_VALUES[sf] * (F32(1) / s)), FLT_MAX).astype(F32)
    y = (x.reshape(64, 16, 16) * enc[..., None]).astype(F32)
    independent = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    assert np.array_equal(formats.unpack_nibbles(q.packed).reshape(64, 16, 16), independent)
    # and the block scales are the ml_dtypes E4M3 rounding of vmax * (S/6)
    vmax = np.abs(x).reshape(64, 16, 16).max(-1)
    sf_ind = (vmax * (s * F32(1 / 6))).astype(F32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(sf, sf_ind)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16]))
def test_dequantize_error_bound(seed, dtype):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((8, 64)) * rng.lognormal(0, 1, (8, 1))).astype(dtype)
    q = ref.quantize(x)
    d = ref.dequantize(q, np.float32)
    xf = x.astype(F32).reshape(8, 4, 16)
    vmax = np.abs(xf).max(-1, keepdims=True)
    # scaled error <= 1 (half the widest E2M1 gap) in units of 1/enc ~ vmax/6 * (1 + 2**-4)
    assert (np.abs(d.reshape(8, 4, 16) - xf) <= vmax * 0.18 + 1e-30).all()


def test_dequantize_dtypes_and_swizzled_layout(rng):
    x = rng.standard_normal((130, 48)).astype(F32)
    lin, swz = ref.quantize(x), ref.quantize(x, scale_layout="swizzled")
    assert np.array_equal(lin.packed, swz.packed)
    assert np.array_equal(swz.linear_block_scales, lin.block_scales)
    d32 = ref.dequantize(lin)
    assert np.array_equal(ref.dequantize(swz), d32)
    assert ref.dequantize(lin, ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16
    assert np.array_equal(ref.dequantize(lin, np.float16), d32.astype(np.float16))


def test_fp32_exp_accuracy():
    x = np.linspace(-87, 88, 200001).astype(F32)
    e = fp32.exp(x).astype(np.float64)
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(e - exact) / exact) < 4 * 2.0**-24
    assert fp32.exp(F32(-200)) == 0 and np.isinf(fp32.exp(F32(200)))


def test_swiglu_matches_float64(rng):
    h = rng.standard_normal((5, 128)).astype(F32) * 4
    g, u = h[:, :64].astype(np.float64), h[:, 64:].astype(np.float64)
    exact = g / (1 + np.exp(-g)) * u
    got = ref.swiglu(h, "concatenated")
    assert np.allclose(got, exact, rtol=4e-7, atol=1e-30)


def test_swiglu_clamp_and_nan():
    g = np.array([[20.0, -20.0, 5.0, np.nan] + [0.0] * 12], F32)
    u = np.array([[1.0, 1.0, -50.0, 1.0] + [0.0] * 12], F32)
    act = ref.swiglu(np.concatenate([g, u], -1), "concatenated", limit=10.0)
    assert act[0, 0] == pytest.approx(10.0 / (1 + np.exp(-10.0)), rel=1e-6)  # gate clamped to 10
    assert act[0, 1] == pytest.approx(-20.0 / (1 + np.exp(20.0)), rel=1e-5)  # no lower clamp on gate
    assert act[0, 2] == pytest.approx(5.0 / (1 + np.exp(-5.0)) * -10.0, rel=1e-6)  # up clamped to -10
    assert np.isnan(act[0, 3])  # the clamp keeps a NaN a NaN


def test_swiglu_layouts_agree_and_row_scale(rng):
    gate = rng.standard_normal((3, 4, 64)).astype(ml_dtypes.bfloat16)
    up = rng.standard_normal((3, 4, 64)).astype(ml_dtypes.bfloat16)
    inter = ref.interleave_gate_up(gate, up)
    assert inter.shape == (3, 4, 128)
    assert np.array_equal(inter[..., :16], gate[..., :16]) and np.array_equal(inter[..., 16:32], up[..., :16])
    g2, u2 = ref.split_gate_up(inter, "interleaved")
    assert np.array_equal(g2, gate) and np.array_equal(u2, up)
    cat = np.concatenate([gate, up], -1)
    a = ref.swiglu_quantize(inter, "interleaved", limit=7.0)
    b = ref.swiglu_quantize(cat, "concatenated", limit=7.0)
    assert np.array_equal(a.packed, b.packed) and np.array_equal(a.block_scales, b.block_scales)
    w = rng.uniform(0.1, 1, (3, 4)).astype(F32)
    scaled = ref.swiglu(cat, "concatenated", row_scale=w)
    assert np.array_equal(scaled, fp32.mul(ref.swiglu(cat, "concatenated"), w[..., None]))
    with pytest.raises(ValueError, match="layout: expected one of"):
        ref.split_gate_up(cat, "pairs")


def _e2m1_inputs(rng):
    """Random fp32 bit patterns plus every rounding boundary and its neighbours, both signs."""
    bits = rng.integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0.125, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 6.5, 7, 8], F32).view(np.uint32)
    near = (edges[:, None].astype(np.int64) + np.arange(-3, 4)[None, :]).astype(np.uint32).ravel()
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0, 0x80000000, 1, 0x807FFFFF], np.uint32)
    y = np.concatenate([bits, near, near | np.uint32(0x80000000), special]).view(F32)
    return fp32.ftz(y)  # the kernels encode products of -ftz multiplies


def test_device_integer_e2m1_form_matches_reference(rng):
    """fp4_e2m1_code in raw_kernels/common/nvfp4.cuh, emulated bit for bit."""
    y = _e2m1_inputs(rng)
    b = y.view(np.uint32).astype(np.int64)
    a = b & 0x7FFFFFFF
    normal = np.minimum(((a + 0x1FFFFF + ((a >> 22) & 1)) >> 22) - 252, 7)
    subnormal = (a > 0x3E800000).astype(np.int64) + (a >= 0x3F400000)
    sign = np.where(a > 0x7F800000, 0, (b >> 28) & 8)
    code = np.where(a >= 0x3F800000, normal, subnormal) | sign
    assert np.array_equal(code.astype(np.uint8), ref.e2m1_encode(y))


def test_device_add_magic_e2m1_form_matches_reference(rng):
    """fp4_e2m1_code_not_nan in raw_kernels/common/nvfp4.cuh, emulated bit for bit (no NaN)."""
    y = _e2m1_inputs(rng)
    y = y[~np.isnan(y)]
    a = np.fmin(np.abs(y), F32(6))
    m = (np.fmax(a, F32(1)).view(np.uint32) & np.uint32(0x7F800000)) + np.uint32(0x0B400000)
    n_plus_m = (a + m.view(F32)).astype(F32).view(np.uint32)
    code = (n_plus_m - m + (m >> 22) - np.uint32(299)) | ((y.view(np.uint32) >> 28) & 8)
    assert np.array_equal(code.astype(np.uint8), ref.e2m1_encode(y))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_has_nonfinite_sees_every_nan_and_inf(dtype):
    """The host status check: any NaN or ±Inf anywhere (first, last, alone), none in finite or
    empty arrays, in every input dtype."""
    assert not ref.has_nonfinite(np.zeros(0, dtype)) and not ref.has_nonfinite(np.zeros((3, 0), dtype))
    x = np.linspace(-1000, 1000, 257).astype(dtype)
    assert not ref.has_nonfinite(x) and not ref.has_nonfinite(np.asarray(x[3]))
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 128, 256):
            y = x.copy()
            y[at] = bad
            assert ref.has_nonfinite(y), (bad, at)
        assert ref.has_nonfinite(np.asarray(bad, dtype))


@pytest.mark.parametrize("dtype", [F32, ml_dtypes.bfloat16])
def test_quantize_and_dequantize_in_row_chunks_equal_one_pass(rng, monkeypatch, dtype):
    """The reference works through a tensor in row chunks (bounded memory); a chunk of a few rows
    must give the bytes and values of one chunk holding the whole tensor, with the global scale
    from the whole tensor (the largest value sits in the last chunk), for leading axes, a NaN and
    swizzled scales."""
    x = (rng.standard_normal((3, 37, 64)) * np.exp(rng.uniform(-4, 4, (3, 37, 1)))).astype(dtype)
    x[2, 36, 5] = 900.0
    with_nan = x.copy()
    with_nan[1, 3, 7] = np.nan

    def quantize_all(layout: str, values, chunk: int):
        monkeypatch.setattr(ref, "CHUNK_ELEMENTS", chunk)
        q = ref.quantize(values, scale_layout=layout)
        return q, ref.dequantize(q)

    for values, layout in ((x, "linear"), (with_nan, "linear"), (x.reshape(111, 64), "swizzled")):
        whole, whole_d = quantize_all(layout, values, 1 << 30)
        chunked, chunked_d = quantize_all(layout, values, 200)  # 3 rows of 64 per chunk
        for name in ("packed", "block_scales", "global_scale"):
            np.testing.assert_array_equal(getattr(chunked, name), getattr(whole, name))
        np.testing.assert_array_equal(chunked_d.view(np.uint32), whole_d.view(np.uint32))
        assert float(whole.global_scale) != 1.0 or np.isnan(values.astype(F32)).any()
    # a strided view is quantized as its contiguous copy
    view = np.ascontiguousarray(np.swapaxes(x, 1, 2)).swapaxes(1, 2)
    assert not view.flags.c_contiguous
    np.testing.assert_array_equal(ref.quantize(view).packed, ref.quantize(np.ascontiguousarray(view)).packed)


def test_row_chunks_of_empty_and_zero_width_tensors():
    for shape in ((0, 32), (4, 0), (16,)):
        q = ref.quantize(np.zeros(shape, F32))
        assert q.shape == shape and ref.dequantize(q).shape == shape
