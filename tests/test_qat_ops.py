"""`fp4kit.ops.qat` on numpy: each function rounds exactly the rows it names, in place, as the
reference specifies (`fp4kit.reference.qat`), and refuses bad input by name before touching
anything."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.ops import qat
from fp4kit.reference import qat as ref

BF16 = ml_dtypes.bfloat16


def rows(rng, *shape):
    return (rng.standard_normal(shape) * 3).astype(BF16)


def test_latent_rows_round_the_channels_outside_rope_in_place(rng):
    x = rows(rng, 3, 4, 192)
    want = x.copy()
    want[..., :128] = ref.fp8_simulate(x[..., :128], 64)
    assert qat.latent_rows(x, 64) is x
    assert np.array_equal(x.view(np.uint16), want.view(np.uint16))


def test_latent_window_rounds_the_row_each_sequence_wrote(rng):
    swa = rows(rng, 3, 8, 128)
    positions = np.array([0, 9, 23], np.int32)  # slots 0, 1, 7
    before = swa.copy()
    qat.latent_window(swa, positions, 64)
    for b, slot in enumerate((0, 1, 7)):
        want = before[b, slot].copy()
        want[:64] = ref.fp8_simulate(before[b, slot, :64], 64)
        assert np.array_equal(swa[b, slot].view(np.uint16), want.view(np.uint16))
        others = [s for s in range(8) if s != slot]
        assert np.array_equal(swa[b, others].view(np.uint16), before[b, others].view(np.uint16))


def test_entries_between_the_counts_below_the_capacity(rng):
    comp = rows(rng, 3, 5, 128)
    keys = rows(rng, 3, 5, 64)
    before_counts, after_counts = np.array([0, 2, 4], np.int32), np.array([1, 4, 7], np.int32)
    new = {0: [0], 1: [2, 3], 2: [4]}  # sequence 2: entries 5, 6 past the capacity are not stored
    c0, k0 = comp.copy(), keys.copy()
    qat.latent_entries(comp, before_counts, after_counts, 64, max_new=3)
    qat.index_entries(keys, before_counts, after_counts, max_new=3)
    for b in range(3):
        for e in range(5):
            want_c, want_k = c0[b, e].copy(), k0[b, e]
            if e in new[b]:
                want_c[:64] = ref.fp8_simulate(c0[b, e, :64], 64)
                want_k = ref.fp4_simulate(ref.hadamard(k0[b, e]), 32)
            assert np.array_equal(comp[b, e].view(np.uint16), want_c.view(np.uint16)), (b, e)
            assert np.array_equal(keys[b, e].view(np.uint16), want_k.view(np.uint16)), (b, e)


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_index_rows_rotate_then_round(rng, d):
    x = rows(rng, 5, 2, d)
    want = ref.fp4_simulate(ref.hadamard(x), 32)
    assert qat.index_rows(x) is x
    assert np.array_equal(x.view(np.uint16), want.view(np.uint16))


def test_bad_inputs_are_refused_by_name(rng):
    x = rows(rng, 2, 192)
    untouched = x.copy()
    with pytest.raises(ValueError, match="x: the channels outside RoPE"):
        qat.latent_rows(x, 32)  # 160 channels: not a multiple of 64
    with pytest.raises(ValueError, match="rope_dim: expected an int"):
        qat.latent_rows(x, 200)
    with pytest.raises(ValueError, match="x: expected a bfloat16"):
        qat.latent_rows(x.astype(np.float32), 64)
    with pytest.raises(ValueError, match="x: expected rows of 32, 64, 128 or 256"):
        qat.index_rows(rows(rng, 2, 48))
    with pytest.raises(ValueError, match="positions: expected int32"):
        qat.latent_window(rows(rng, 2, 4, 128), np.zeros(3, np.int32), 64)
    with pytest.raises(ValueError, match="after: expected int32"):
        qat.latent_entries(rows(rng, 2, 4, 128), np.zeros(2, np.int32), np.zeros(2, np.int64), 64)
    with pytest.raises(ValueError, match="max_new: expected a positive int"):
        qat.index_entries(rows(rng, 2, 4, 64), np.zeros(2, np.int32), np.ones(2, np.int32), max_new=0)
    assert np.array_equal(x.view(np.uint16), untouched.view(np.uint16))
