"""The sampling kernel on the GPU: greedy against argmax, draw frequencies against the float64
reference distribution, Philox reproducibility, graph replays advancing the device offset, the
status bit for NaN / Inf logits, and large shapes. Token-for-token agreement with the reference
(same Philox numbers) on every row whose draw is not decided by a rounding-level near-tie, over
the kernel's split of a row into blocks (tiny vocabularies, vocabularies that are not a multiple
of a block's share, batch 1 to 256), thresholds that need the refinement passes (ties, large k,
top-p keeping most of the vocabulary), mixed per-row modes; the per-row scratch is zero again
after every call. Kept fast: ~10^6 draws in total."""

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
    # the kernel's draws are the reference's (same Philox numbers): every row not decided by an
    # fp32 near-tie agrees exactly (was: any 3 of the 64 rows could differ)
    assert_matches_reference(x.get(), a, 9, 4, min_robust=0.9, top_p=0.95)


def test_graph_replays_draw_fresh_tokens_and_advance_offset(rng, capture_stream):
    x = cp.asarray(rng.standard_normal((8, 4096)).astype(BF16))
    sampler = Sampler(Generator(3), top_k=100)
    sampler(x)  # compile, allocate
    sampler.generator.set_state(offset=0)
    stream = capture_stream()
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
    assert status.read() & status.SAMPLER_INPUT
    assert got[1] == 5 and got[2] == 0 and got[3] == 0 and 0 <= got[0] < 300 and got[0] != 7
    status.clear()
    draw(cp.asarray(np.where(np.arange(300) % 2, -np.inf, 0).astype(np.float32)[None]), Generator(0))
    assert status.read() & status.SAMPLER_INPUT == 0


def test_invalid_device_rows_are_replaced_and_flagged():
    x = cp.asarray(np.tile(np.arange(16, dtype=np.float32), (2, 1)))
    status.clear()
    got = draw(x, Generator(0), temperature=cp.asarray(np.array([np.nan, 0], np.float32))).get()
    assert got.tolist() == [15, 15] and status.read() & status.SAMPLER_INPUT
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


# ---- token-for-token agreement with the reference


def robust_rows(x, seed, offset, **params):
    """The reference's tokens, and which rows it decides with a margin that fp32 cannot upset:
    the race winner ahead by 1e-3; the tokens on each side of the top-k and top-p boundaries
    apart by more than 5e-7 (relative) in d (or exactly tied: both sides order ties by id); the
    top-p target 5e-7 (relative) away from the cumulative masses around it; no probability
    ratio within 2e-6 (relative) of min-p. The kernel computes d, the Gumbel numbers and the
    masses in fp32 / fixed point from float32 parameters, so such rows must agree exactly."""
    x = np.asarray(x)
    c = ref.canonical(x)
    rows, vocab = c.shape
    full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | params
    t, k, p, m, _ = ref.sanitize(rows, **full)
    prob = ref.probabilities(x, **params)
    g = ref.gumbel(ref.philox_words(seed, offset, rows, vocab))
    want = ref.sample(x, seed, offset, **params)
    ok = np.ones(rows, bool)
    for b in range(rows):
        if t[b] == 0 or not np.isfinite(c[b]).any() or np.isposinf(c[b]).any():
            continue  # greedy: exact
        kept = prob[b] > 0
        if kept.sum() > 1:
            s = np.sort(np.where(kept, np.log(np.where(kept, prob[b], 1.0)) + g[b], -np.inf))
            ok[b] &= s[-1] - s[-2] > 1e-3
        z = (c[b] - c[b].max()) / t[b]
        order = np.lexsort((np.arange(vocab), -z))
        zs = z[order]
        w = np.exp(zs)
        ps = w / w.sum()

        def apart(i):  # positions i-1 and i keep their order in fp32
            if i >= vocab or not np.isfinite(zs[i]):
                return True
            gap = zs[i - 1] - zs[i]
            return gap == 0 or gap > 5e-7 * max(abs(zs[i - 1]), abs(zs[i]))

        n = vocab
        if 0 < k[b] < vocab:
            n = int(k[b])
            ok[b] &= apart(n)
        if p[b] < 1:
            cum = np.cumsum(ps[:n])
            target = p[b] * cum[-1]
            j = min(int(np.searchsorted(cum, target, side="left")), n - 1)
            eps = 5e-7 * cum[-1]
            ok[b] &= cum[j] - target > eps and (j == 0 or target - cum[j - 1] > eps) and apart(j + 1)
        if m[b] > 0:
            ok[b] &= np.abs(w / w.max() - m[b]).min() > 2e-6 * m[b]
    return want, ok


def assert_matches_reference(x_host, got, seed, offset, min_robust=0.8, **params):
    want, ok = robust_rows(x_host, seed, offset, **params)
    got = np.asarray(got)
    vocab = x_host.shape[1]
    assert ((got >= 0) & (got < vocab)).all()
    assert ok.mean() >= min_robust, f"only {ok.sum()} of {ok.size} rows are decided with a margin"
    bad = np.nonzero(ok & (got != want))[0]
    assert bad.size == 0, f"rows {bad[:10]}: kernel {got[bad[:10]]}, reference {want[bad[:10]]}"
    return ok


def scratch_is_clean(gen):
    return not bool(gen.scratch(0).any()) and int(gen.arrivals.get()[0]) == 0


MODES = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=50),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_k=200, top_p=0.8, min_p=0.01),
    dict(temperature=1.2, min_p=0.05),
]


@pytest.mark.parametrize("vocab", [1, 2, 3, 5, 100, 1023, 1025, 2048, 4097, 12289, 129280])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_tokens_match_the_reference_across_block_splits(rng, vocab, dtype):
    """Row lengths around the blocks' shares (1024-token multiples, 4096 per block at most)."""
    batch = 3 if vocab > 4096 else 8
    x = (rng.standard_normal((batch, vocab)) * 3).astype(dtype)
    xd = cp.asarray(x)
    seed = int(rng.integers(2**63))
    gen = Generator(seed, offset=11)
    for i, params in enumerate(MODES):
        got = draw(xd, gen, **params).get()
        assert_matches_reference(x.astype(np.float32), got, seed, 11 + i, min_robust=0.6, **params)
    assert gen.get_state() == (seed, 11 + len(MODES))
    assert scratch_is_clean(gen)


@pytest.mark.parametrize("batch", [1, 2, 8, 64, 256])
def test_tokens_match_the_reference_across_batch_sizes(rng, batch):
    """Batch 1 splits a row over the most blocks; batch 256 loops blocks over rows in rounds."""
    vocab = 6000
    x = (rng.standard_normal((batch, vocab)) * 2).astype(np.float32)
    xd = cp.asarray(x)
    gen = Generator(5)
    ok = []  # rows decided with a margin must agree; the margin count is over every mode's rows
    for i, params in enumerate([dict(top_k=40), dict(top_p=0.9), dict(temperature=0.0)]):
        got = draw(xd, gen, **params).get()
        ok.append(assert_matches_reference(x, got, 5, i, min_robust=0.0, **params))
    assert np.mean(ok) >= 0.8, f"only {np.sum(ok)} of {np.size(ok)} rows are decided with a margin"
    assert scratch_is_clean(gen)


def test_large_k_and_top_p_keeping_most_of_the_vocabulary(rng):
    """Boundary bins beyond the exact-selection capacity: the refinement passes."""
    vocab = 129280
    x = (rng.standard_normal((8, vocab)) * 0.01).astype(np.float32)  # near-flat: p keeps ~95 %
    xd = cp.asarray(x)
    gen = Generator(21)
    cases = [dict(top_p=0.95), dict(top_k=60000), dict(top_k=3000, top_p=0.99),
             dict(top_k=50, temperature=0.01), dict(top_p=0.9, temperature=0.001)]
    for i, params in enumerate(cases):
        got = draw(xd, gen, **params).get()
        assert_matches_reference(x, got, 21, i, min_robust=0.5, **params)
        kept = ref.kept_mask(x, **params)
        assert kept[np.arange(8), got].all()
    assert scratch_is_clean(gen)


@pytest.mark.parametrize("batch", [1, 8])
def test_top_p_after_a_top_k_cut_by_radix_passes_takes_the_whole_top_k_mass(rng, batch):
    """Top-k then top-p on the histogram path: the top-k cut resolved exactly among more than 32
    bucket tokens must carry the mass of every token it keeps, since top-p's target is a share of
    it. It carried only the mass of the last 32 (then top-k 249 + top-p 0.8 on a row of one value
    drew token 0 every time at batch 1, and top-k 1000 + top-p 0.5 kept 385 tokens, not 500). Rows
    of one value (the bucket is all ties) and smooth rows, one launch per row at batch 1; 16 draws
    each, against the reference. The p are chosen so that on the row of one value the top-p target
    (p * k token masses) falls between two tokens' cumulative masses, not on one (199.2, 450.5,
    2700.6), so those draws are decided with a margin."""
    vocab = 129280
    kinds = [np.zeros(vocab), rng.standard_normal(vocab) * 3, rng.standard_normal(vocab) * 0.05]
    rows = [kinds[i % len(kinds)] for i in range(max(batch, len(kinds)))]
    gen = Generator(17)
    decided = []
    for start in range(0, len(rows), batch):
        x = np.stack(rows[start:start + batch]).astype(np.float32)
        xd = cp.asarray(x)
        for params in (dict(top_k=249, top_p=0.8), dict(top_k=1000, top_p=0.4505), dict(top_k=3000, top_p=0.9002)):
            for _ in range(16):
                seed, offset = gen.get_state()
                got = draw(xd, gen, **params).get()
                assert ref.kept_mask(x, **params)[np.arange(x.shape[0]), got].all(), params
                decided.append(assert_matches_reference(x, got, seed, offset, min_robust=0.0, **params))
    assert scratch_is_clean(gen)
    assert np.mean(np.concatenate(decided)) >= 0.8


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_ties_across_blocks(rng, dtype):
    """Many equal logits spread over every block: the kept prefix takes the lower ids first."""
    vocab = 20000
    x = rng.integers(-3, 3, (6, vocab)).astype(dtype)
    x[1] = 0  # one value everywhere
    x[2, ::2] = -np.inf
    xd = cp.asarray(x)
    xf = x.astype(np.float32)
    gen = Generator(8)
    cases = [dict(top_k=7), dict(top_k=777), dict(top_k=15000), dict(top_p=0.5), dict(top_k=2500, top_p=0.3001),
             dict(temperature=0.0)]
    for i, params in enumerate(cases):
        got = draw(xd, gen, **params).get()
        assert_matches_reference(xf, got, 8, i, min_robust=0.5, **params)
        assert ref.kept_mask(xf, **params)[np.arange(6), got].all()
    # a tie at the top-k boundary: only the lowest ids of the tied value can be drawn
    y = np.zeros((1, vocab), np.float32)
    y[0, 5000:] = 1.0
    seen = set()
    for _ in range(40):
        seen.update(draw(cp.asarray(y), gen, top_k=10).get().tolist())
    assert seen <= set(range(5000, 5010)) and len(seen) > 5
    assert scratch_is_clean(gen)


def test_mixed_per_row_modes_and_determinism(rng):
    batch, vocab = 16, 50000
    x = (rng.standard_normal((batch, vocab)) * 2.5).astype(BF16)
    xd = cp.asarray(x)
    params = dict(
        temperature=cp.asarray(rng.choice([0.0, 0.5, 1.0, 1.5], batch).astype(np.float32)),
        top_k=cp.asarray(rng.choice([0, 1, 20, 5000], batch).astype(np.int32)),
        top_p=cp.asarray(rng.choice([1.0, 0.5, 0.95], batch).astype(np.float32)),
        min_p=cp.asarray(rng.choice([0.0, 0.1], batch).astype(np.float32)),
    )
    a = draw(xd, Generator(77, offset=3), **params).get()
    b = draw(xd, Generator(77, offset=3), **params).get()
    assert np.array_equal(a, b)  # bitwise reproducible
    host = {name: v.get() for name, v in params.items()}
    assert_matches_reference(x.astype(np.float32), a, 77, 3, min_robust=0.6, **host)


def test_graph_replays_match_the_reference_at_each_offset(rng, capture_stream):
    x = (rng.standard_normal((8, 129280)) * 3).astype(BF16)
    xd = cp.asarray(x)
    for params in (dict(top_p=0.9), dict(temperature=1.0)):
        sampler = Sampler(Generator(4), **params)
        sampler(xd)  # compile, allocate
        sampler.generator.set_state(offset=0)
        stream = capture_stream()
        seen = []
        with stream:
            stream.begin_capture()
            sampler(xd)
            graph = stream.end_capture()
            for _ in range(3):
                graph.launch(stream)
                seen.append(sampler.buffers(8).get())
        assert sampler.generator.get_state() == (4, 3)
        assert len({s.tobytes() for s in seen}) == 3
        # every row decided with a margin must agree; a few rows per offset may not be (top-p's
        # boundary token among ~10^5 small probabilities), so the 24 rows share the margin count
        ok = [assert_matches_reference(x.astype(np.float32), got, 4, off, min_robust=0.0, **params)
              for off, got in enumerate(seen)]
        assert np.mean(ok) >= 0.75, f"only {np.sum(ok)} of 24 rows are decided with a margin"
        assert scratch_is_clean(sampler.generator)


@pytest.mark.parametrize("batch", [1, 2, 8])  # 4, 8 and 16 tokens per thread at this vocabulary
def test_register_builds_draw_the_same_tokens(rng, batch, monkeypatch):
    """The P = 4 and P = 8 builds (smaller unrolled code) draw the P = 16 build's tokens, bit for
    bit, in every mode, and leave the scratch clean."""
    x = cp.asarray((rng.standard_normal((batch, 129280)) * 3).astype(BF16))
    modes = [dict(temperature=0.0), dict(temperature=1.0), dict(top_k=50), dict(top_p=0.9),
             dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05), dict(top_k=3000)]
    per = ops.geometry(batch, 129280, 264)[0]  # 2 blocks per SM on 132 SMs
    assert per == {1: 4, 2: 8, 8: 16}[batch]
    every_build = ops.PER_BUILDS
    for params in modes:
        got = {}
        for builds in (every_build, (ops._MAX_PER,)):
            monkeypatch.setattr(ops, "PER_BUILDS", builds)
            gen = Generator(11, offset=5)
            got[builds] = [draw(x, gen, **params).get() for _ in range(3)]
            assert scratch_is_clean(gen)
        a, b = got.values()
        assert all(np.array_equal(u, v) for u, v in zip(a, b)), (params, per)


def _bound_rows(rng, vocab):
    """Rows on which the gathered top-k's posted bound is tight, weak or useless."""
    normal = rng.standard_normal(vocab).astype(np.float32) * 3
    low = normal.copy()
    low[:9000] -= 40.0  # a range the context makes unlikely: a few blocks' maxima are low
    masked = normal.copy()
    masked[20000:90000] = -np.inf  # most blocks' maxima are -inf
    few = np.full(vocab, -np.inf, np.float32)
    few[rng.choice(vocab, 30, replace=False)] = rng.standard_normal(30)  # fewer finite tokens than k
    return {"normal": normal, "a low range": low, "a masked range": masked,
            "ties at the top": rng.integers(-50, 3, vocab).astype(np.float32),
            "one value": np.zeros(vocab, np.float32), "sorted by id": np.sort(normal),
            "fewer finite than k": few, "wide (most in the last bin)": normal * 15}


@pytest.mark.parametrize("batch", [1, 8])  # 127 blocks of 1024 tokens a row; 32 of 4096
def test_the_gathered_top_k_matches_the_reference_where_its_bound_is_tight_weak_or_useless(rng, batch):
    """Top-k rows take the gathered cut when k * blocks fits the slots: the blocks' posted thread
    maxima bound the row's k best and each block sends only its tokens above the bound. On every
    kind of row (the bound leaves ~k candidates on smooth rows, many with ties or a sorted row, and
    none past the last bin) and every k around the limits (64 fills the slots at batch 1; 65 takes
    the histogram path there; 249 at batch 8 posts too many maxima), the kernel draws the
    reference's tokens, only kept tokens, and leaves the scratch clean."""
    vocab = 129280
    rows = _bound_rows(rng, vocab)
    names = list(rows)
    modes = [dict(top_k=1), dict(top_k=2), dict(top_k=50), dict(top_k=64, temperature=0.7), dict(top_k=65),
             dict(top_k=50, top_p=0.9), dict(top_k=64, top_p=0.5, min_p=0.05), dict(top_k=200), dict(top_k=249),
             dict(top_k=249, top_p=0.8)]
    gen = Generator(31)
    ok = []
    for group in ([names[i:i + batch] for i in range(0, len(names), batch)]):
        x = np.stack([rows[n] for n in group]).astype(BF16)
        xf = x.astype(np.float32)
        xd = cp.asarray(x)
        for params in modes:
            seed, offset = gen.get_state()
            got = draw(xd, gen, **params).get()
            kept = ref.kept_mask(xf, **params)
            assert kept[np.arange(len(group)), got].all(), (group, params, got)
            ok.append(assert_matches_reference(xf, got, seed, offset, min_robust=0.0, **params))
            assert scratch_is_clean(gen), (group, params)
    assert np.mean(np.concatenate(ok)) >= 0.8, f"only {np.sum(np.concatenate(ok))} rows are decided with a margin"


@pytest.mark.parametrize("batch", [1, 8, 300])  # 300 rows: the blocks loop over rows in rounds
def test_top_p_alone_racing_first_matches_the_reference_decided_or_not(rng, batch):
    """Top-p without top-k races first: the row's last block decides from the row histogram's
    boundary bin and the blocks' per-bin best keys, has the boundary bin cut exactly by the row's
    finisher, or sends the row down the histogram path (a boundary bin of more than 512 ties).
    Rows of every kind, with min-p and temperature: the reference's tokens, only kept tokens, a
    clean scratch, and the same tokens on a repeat."""
    vocab = 129280 if batch < 300 else 4096
    kinds = [lambda: rng.standard_normal(vocab) * 3,
             lambda: np.concatenate([[14.0, 11.0, 10.5], rng.standard_normal(vocab - 3) * 2]),
             lambda: np.concatenate([[30.0], rng.standard_normal(vocab - 1)]),
             lambda: np.zeros(vocab),  # one value: the boundary bin holds every token
             lambda: rng.integers(-40, 3, vocab).astype(np.float64),
             lambda: np.round(rng.standard_normal(vocab) * 32) / 4]
    rows = [kinds[i % len(kinds)]() for i in range(max(batch, len(kinds)))]
    gen = Generator(41)
    ok = []
    for start in range(0, len(rows), batch):  # batch 1: one launch per kind
        x = np.stack(rows[start:start + batch]).astype(BF16)
        xf = x.astype(np.float32)
        xd = cp.asarray(x)
        for params in (dict(top_p=0.9), dict(top_p=0.3), dict(top_p=0.95, min_p=0.02, temperature=0.7)):
            seed, offset = gen.get_state()
            got = draw(xd, gen, **params).get()
            again = draw(xd, Generator(seed, offset=offset), **params).get()
            assert np.array_equal(got, again)
            assert ref.kept_mask(xf, **params)[np.arange(x.shape[0]), got].all(), params
            ok.append(assert_matches_reference(xf, got, seed, offset, min_robust=0.0, **params))
            assert scratch_is_clean(gen), params
    assert np.mean(np.concatenate(ok)) >= 0.7, f"only {np.sum(np.concatenate(ok))} rows are decided with a margin"
