"""Formats: code tables against ml_dtypes, nibble packing, the 128x4 swizzle, Nvfp4Tensor checks."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4kit import formats


def test_e2m1_table_matches_ml_dtypes():
    decoded = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(formats.E2M1_VALUES, decoded)
    assert np.array_equal(np.signbit(formats.E2M1_VALUES), np.arange(16) >= 8)


def test_e4m3_table_matches_ml_dtypes_and_spec():
    v = formats.E4M3_VALUES
    assert v[0x7E] == 448 and v[0x01] == 2.0**-9 and v[0x08] == 2.0**-6 and v[0x38] == 1.0
    assert np.isnan(v[list(formats.E4M3_NAN_BYTES)]).all()
    assert np.isfinite(np.delete(v, formats.E4M3_NAN_BYTES)).all()


def test_pack_puts_even_element_in_low_nibble():
    codes = np.array([[0x1, 0xF, 0x7, 0x8]], dtype=np.uint8)
    assert formats.pack_nibbles(codes).tolist() == [[0xF1, 0x87]]


@given(st.lists(st.integers(0, 15), min_size=0, max_size=64).filter(lambda c: len(c) % 2 == 0))
def test_pack_unpack_round_trip(codes):
    codes = np.array(codes, dtype=np.uint8).reshape(1, -1)
    packed = formats.pack_nibbles(codes)
    assert packed.shape == (1, codes.shape[1] // 2)
    assert np.array_equal(formats.unpack_nibbles(packed), codes)


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="codes: last dimension must be even"):
        formats.pack_nibbles(np.zeros((2, 3), np.uint8))


def _swizzle_by_reshape(linear):
    """The same layout written as a reshape/permute of the padded matrix (vLLM's formulation)."""
    rows, cols = linear.shape
    pr, pc = formats.swizzled_shape(rows, cols)
    padded = np.zeros((pr, pc), np.uint8)
    padded[:rows, :cols] = linear
    return padded.reshape(pr // 128, 4, 32, pc // 4, 4).transpose(0, 3, 2, 1, 4).ravel()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 20), st.integers(0, 2**32 - 1))
def test_swizzle_matches_reshape_formulation_and_round_trips(rows, cols, seed):
    linear = np.random.default_rng(seed).integers(1, 256, (rows, cols), dtype=np.uint8)
    swz = formats.swizzle_scales(linear)
    assert np.array_equal(swz, _swizzle_by_reshape(linear))
    assert np.array_equal(formats.unswizzle_scales(swz, rows, cols), linear)
    # every byte that no scale maps to is padding, and padding is zero
    mask = np.ones(swz.size, bool)
    mask[formats.swizzle_offsets(rows, cols).ravel()] = False
    assert (swz[mask] == 0).all()
    assert swz.size == np.prod(formats.swizzled_shape(rows, cols))


def test_swizzle_offsets_hand_values():
    off = formats.swizzle_offsets(200, 13)
    assert off[0, 0] == 0 and off[0, 3] == 3 and off[32, 0] == 4 and off[1, 0] == 16
    assert off[0, 4] == 512  # next tile along K
    assert off[128, 0] == 4 * 512  # padded K/16 = 16 -> 4 tiles per 128-row band
    assert len(np.unique(off)) == off.size


def test_unswizzle_rejects_wrong_size():
    with pytest.raises(ValueError, match="swizzled: expected a 1-D buffer of 512 bytes"):
        formats.unswizzle_scales(np.zeros(100, np.uint8), 3, 4)


def test_block_scale_shape_rules():
    assert formats.block_scale_shape((3, 5, 64), "linear") == (3, 5, 4)
    assert formats.block_scale_shape((3, 64), "swizzled") == (128 * 4,)
    with pytest.raises(ValueError, match="describes 2-D"):
        formats.block_scale_shape((2, 3, 64), "swizzled")
    with pytest.raises(ValueError, match="scale_layout: expected one of"):
        formats.block_scale_shape((3, 64), "blocked")
    # tiled: [N/16] row tiles x [K/256] scale groups x 256 bytes, per leading index
    assert formats.block_scale_shape((3, 17, 272), "tiled") == (3, 2 * 2 * 256)
    with pytest.raises(ValueError, match="tiled' describes"):
        formats.block_scale_shape((64,), "tiled")


def _tensor(**overrides):
    fields = dict(
        packed=np.zeros((2, 16), np.uint8),
        block_scales=np.zeros((2, 2), np.uint8),
        global_scale=np.array(1.0, np.float32),
        scale_layout="linear",
        shape=(2, 32),
    )
    fields.update(overrides)
    return formats.Nvfp4Tensor(**fields)


def test_nvfp4_tensor_validates_fields():
    t = _tensor()
    assert t.rows == 2 and t.linear_block_scales.shape == (2, 2)
    with pytest.raises(ValueError, match=r"packed: expected shape \(2, 16\)"):
        _tensor(packed=np.zeros((2, 8), np.uint8))
    with pytest.raises(ValueError, match="block_scales: expected shape"):
        _tensor(block_scales=np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="global_scale: expected shape"):
        _tensor(global_scale=np.array([1.0], np.float64))
    with pytest.raises(ValueError, match="multiple of 16"):
        _tensor(shape=(2, 30))
    with pytest.raises(TypeError, match="packed: expected an array"):
        _tensor(packed=[1, 2])


def test_fuse_rows_is_the_one_row_fusion(rng):
    """Concatenated (q|k|v shards) and interleaved (gate|up, chunks of 16) fusion keep every byte and
    give each row its part's decode factor; a part's own per-row factors are carried through."""
    from fp4kit.reference import quant as qref

    gate, up = (qref.quantize(rng.standard_normal((32, 64)).astype(np.float32) * s) for s in (5.0, 0.01))
    fused, row_decode = formats.fuse_rows([gate, up], "interleaved")
    assert np.array_equal(fused.packed, formats.interleave_rows(gate.packed, up.packed))
    assert float(fused.global_scale) == 1.0
    expect = formats.interleave_rows(np.full(32, np.float32(1) / gate.global_scale, np.float32),
                                     np.full(32, np.float32(1) / up.global_scale, np.float32))
    assert np.array_equal(row_decode, expect)
    cat, cat_decode = formats.fuse_rows([gate, up], row_decodes=[None, np.arange(32, dtype=np.float32)])
    assert np.array_equal(cat.block_scales, np.concatenate([gate.block_scales, up.block_scales]))
    assert np.array_equal(cat_decode[32:], np.arange(32, dtype=np.float32))
    with pytest.raises(ValueError, match="arrangement: expected one of"):
        formats.fuse_rows([gate, up], "stacked")
    with pytest.raises(ValueError, match="'interleaved' takes two equal weights"):
        formats.fuse_rows([gate, up, up], "interleaved")
