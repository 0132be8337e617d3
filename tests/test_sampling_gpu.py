"""The sampling kernel on the GPU: greedy against argmax, draw frequencies against the float64
reference distribution, Philox reproducibility, graph replays advancing the device offset, the
status bit for NaN / Inf logits, and large shapes. Kept fast: ~10^6 draws in total."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.layers.sampler import Generator, Sampler
from fp4kit.ops import sampling as ops
from fp4kit.reference import sampling as ref
from fp4kit.runtime import status

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16
POISON = -7


def draw(x, gen, **params):
    out = cp.full(x.shape[0], POISON, cp.int32)
    got = ops.sample(x, generator=gen, out=out, **params)
    assert got is out
    return out


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_greedy_is_argmax_with_ties(rng, dtype):
    x = rng.integers(-3, 4, (37, 1001)).astype(dtype)  # many ties
    x[5, :] = -np.inf
    got = draw(cp.asarray(x), Generator(1), temperature=0.0).get()
    assert np.array_equal(got, ref.greedy(x))


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=10),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("params", CASES)
def test_frequencies_match_the_reference(rng, params):
    """4096 copies of one 64-token row x 250 calls = 1,024,000 draws. For n draws over m = 64
    cells, E[TV] <= 0.5 * sqrt(m / n) = 0.004; the bound 0.01 is 2.5x that (TV concentrates
    within ~1/sqrt(n) of its mean by McDiarmid, so a false failure is far below 1e-9)."""
    vocab, rows, calls = 64, 4096, 250
    x = (rng.standard_normal(vocab) * 2).astype(np.float32)
    want = ref.probabilities(x[None], **params)[0]
    xs = cp.asarray(np.tile(x, (rows, 1)))
    gen = Generator(int(rng.integers(2**63)))
    out = cp.empty((calls, rows), cp.int32)
    for c in range(calls):
        ops.sample(xs, generator=gen, out=out[c], **params)
    counts = cp.bincount(out.ravel(), minlength=vocab).get()
    assert counts.sum() == rows * calls and counts.size == vocab
    assert (counts[want == 0] == 0).all(), f"tokens outside the kept set drawn: {np.nonzero(counts * (want == 0))[0]}"
    tv = 0.5 * np.abs(counts / counts.sum() - want).sum()
    assert tv < 0.01, f"total variation {tv:.4f}"
    assert gen.get_state()[1] == calls


def test_same_seed_offset_same_tokens_rows_independent(rng):
    x = cp.asarray(rng.standard_normal((64, 5000)).astype(np.float32))
    a = draw(x, Generator(9, offset=4), top_p=0.95).get()
    b = draw(x, Generator(9, offset=4), top_p=0.95).get()
    c = draw(x, Generator(9, offset=5), top_p=0.95).get()
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    same = cp.asarray(np.tile(np.zeros(5000, np.float32), (64, 1)))
    d = draw(same, Generator(9)).get()
    assert len(set(d.tolist())) > 50  # identical rows, different draws
    # the kernel's draws are the reference's (same Philox numbers) except for fp32 near-ties
    host = x.get()
    want = ref.sample(host, 9, 4, top_p=0.95)
    assert np.mean(a == want) >= 0.95


def test_graph_replays_draw_fresh_tokens_and_advance_offset(rng):
    x = cp.asarray(rng.standard_normal((8, 4096)).astype(BF16))
    sampler = Sampler(Generator(3), top_k=100)
    sampler(x)  # compile, allocate
    sampler.generator.set_state(offset=0)
    stream = cp.cuda.Stream(non_blocking=True)
    seen = []
    with stream:
        stream.begin_capture()
        sampler(x)
        graph = stream.end_capture()
        for _ in range(5):
            graph.launch(stream)
            seen.append(sampler.buffers(8).get())
    assert sampler.generator.get_state() == (3, 5)
    assert len({s.tobytes() for s in seen}) == 5
    g = Generator(3, offset=2)
    assert np.array_equal(draw(x, g, top_k=100).get(), seen[2])


def test_nan_inf_set_the_status_bit_and_ids_stay_in_range():
    x = np.zeros((4, 300), np.float32)
    x[0, 7] = np.nan
    x[1, [5, 9]] = np.inf
    x[2, :] = -np.inf
    x[3, :] = np.nan
    status.clear()
    got = draw(cp.asarray(x), Generator(0), top_p=0.5).get()
    assert status.read() & ops.STATUS_SAMPLER
    assert got[1] == 5 and got[2] == 0 and got[3] == 0 and 0 <= got[0] < 300 and got[0] != 7
    status.clear()
    draw(cp.asarray(np.where(np.arange(300) % 2, -np.inf, 0).astype(np.float32)[None]), Generator(0))
    assert status.read() & ops.STATUS_SAMPLER == 0


def test_invalid_device_rows_are_replaced_and_flagged():
    x = cp.asarray(np.tile(np.arange(16, dtype=np.float32), (2, 1)))
    status.clear()
    got = draw(x, Generator(0), temperature=cp.asarray(np.array([np.nan, 0], np.float32))).get()
    assert got.tolist() == [15, 15] and status.read() & ops.STATUS_SAMPLER
    status.clear()


def test_large_vocab_and_batch():
    x = cp.random.standard_normal((256, 262144), dtype=cp.float32)
    got = draw(x, Generator(1), top_k=50, top_p=0.9)
    assert bool(((got >= 0) & (got < 262144)).all())
    kth = -cp.partition(-x, 49, axis=1)[:, 49]  # the 50th largest logit of each row
    assert bool((x[cp.arange(256), got] >= kth).all())
    y = cp.ascontiguousarray(x[:4, :129279])  # vocab not a multiple of 4: the scalar-load path
    got = draw(y, Generator(1), top_p=0.9, temperature=0.8)
    assert bool(((got >= 0) & (got < 129279)).all())
