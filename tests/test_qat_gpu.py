"""raw_kernels/qat.cu through `fp4kit.ops.qat` against the numpy path (the reference) bit for bit:
values spread over many binades, all-zero blocks, blocks whose amax sits on a power of two,
bf16 subnormals and huge values, exact E4M3 / E2M1 ties; only the rows each call names change;
a captured graph replays the eager bits."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.ops import qat

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16


def hard_rows(rng, shape, block: int):
    """bf16 rows whose blocks of ``block`` mix the cases the rounding has to get right."""
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    flat = x.reshape(-1, block)
    kinds = rng.integers(0, 6, len(flat))
    for i, kind in enumerate(kinds):
        if kind == 0:
            flat[i] = 0.0  # an all-zero block: the amax floor's scale
        elif kind == 1:
            flat[i, 0] = np.float32(2.0 ** rng.integers(-8, 8)) * 448  # amax exactly fmt_max times a power of two
        elif kind == 2:
            flat[i] = np.float32(2.0**-130) * rng.integers(-3, 4, block)  # bf16 subnormals
        elif kind == 3:
            flat[i] *= np.float32(2.0**100)  # huge values
        elif kind == 4:  # halfway between grid points once scaled: ties to even
            flat[i] = rng.choice(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]), block) * rng.choice([-1, 1], block)
    return x.astype(BF16)


def same(got, want):
    assert np.array_equal(cp.asnumpy(got).view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.mark.parametrize("d,rope_dim", [(512, 64), (192, 64), (128, 0)])
def test_latent_rows(rng, d, rope_dim):
    x = hard_rows(rng, (37, d), 64)
    dev = cp.asarray(x)
    qat.latent_rows(dev, rope_dim)
    same(dev, qat.latent_rows(x.copy(), rope_dim))


def test_latent_window_and_entries_touch_only_their_rows(rng):
    swa = hard_rows(rng, (4, 16, 512), 64)
    positions = np.array([0, 15, 16, 1000], np.int32)
    dev = cp.asarray(swa)
    qat.latent_window(dev, cp.asarray(positions), 64)
    same(dev, qat.latent_window(swa.copy(), positions, 64))
    comp = hard_rows(rng, (4, 6, 512), 64)
    before, after = np.array([0, 2, 5, 6], np.int32), np.array([1, 5, 9, 6], np.int32)
    dev = cp.asarray(comp)
    qat.latent_entries(dev, cp.asarray(before), cp.asarray(after), 64, max_new=4)
    want = qat.latent_entries(comp.copy(), before, after, 64, max_new=4)
    same(dev, want)
    assert not np.array_equal(want.view(np.uint16), comp.view(np.uint16))  # something was rounded


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_index_rows_and_entries(rng, d):
    x = hard_rows(rng, (19, 3, d), 32)
    dev = cp.asarray(x)
    qat.index_rows(dev)
    same(dev, qat.index_rows(x.copy()))
    comp = hard_rows(rng, (3, 20, d), 32)
    before, after = np.array([0, 3, 18], np.int32), np.array([9, 4, 25], np.int32)  # 9 entries: two blocks of 8
    dev = cp.asarray(comp)
    qat.index_entries(dev, cp.asarray(before), cp.asarray(after), max_new=9)
    same(dev, qat.index_entries(comp.copy(), before, after, max_new=9))


def test_graph_replay_gives_the_eager_bits(rng):
    swa = hard_rows(rng, (2, 8, 192), 64)
    keys = hard_rows(rng, (2, 4, 128), 32)
    q = hard_rows(rng, (2, 8, 128), 32)
    positions, before, after = (cp.asarray(np.array(v, np.int32)) for v in ([3, 9], [0, 1], [1, 2]))

    def step(a, k, qq):
        qat.latent_window(a, positions, 64)
        qat.index_entries(k, before, after)
        qat.index_rows(qq)

    eager = [cp.asarray(a) for a in (swa, keys, q)]
    step(*eager)
    replayed = [cp.asarray(a) for a in (swa, keys, q)]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        step(*replayed)
        graph = stream.end_capture()
    for a, b in zip(replayed, (swa, keys, q)):
        a[...] = cp.asarray(b)
    cp.cuda.Device().synchronize()  # the refills (default stream) before the non-blocking stream's replay
    graph.launch(stream)
    stream.synchronize()
    for a, b in zip(replayed, eager):
        assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))
