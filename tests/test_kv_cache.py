"""KVCache on the numpy backend: ring contents across wrap-around, compressed entries at exactly
the right positions (ratios 4 and 128) against an independent computation from the full token
history, per-sequence counts, reset, overflow, and bad inputs."""

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.layers.kv_cache import KVCache
from fp4kit.reference import kv_cache as ref

BF16 = ml_dtypes.bfloat16


def bf16_ulp(x):
    """The bf16 spacing at ``|x|`` (8 significant bits; subnormals share the smallest normal's)."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 2.0**-126))) - 7)


def expected_entry(hist_c, hist_z, ape, block, ratio, norm_weight, eps, rope_dim, theta):
    """Entry `block` straight from the whole history (no ring buffer), float64."""
    d = norm_weight.shape[0]
    cur = range(block * ratio, (block + 1) * ratio)
    if ratio == 4:
        zs = [hist_z[p, d:] + ape[p % 4, d:] for p in cur]
        cs = [hist_c[p, d:] for p in cur]
        if block > 0:
            prev = range((block - 1) * 4, block * 4)
            zs += [hist_z[p, :d] + ape[p % 4, :d] for p in prev]
            cs += [hist_c[p, :d] for p in prev]
    else:
        zs = [hist_z[p] + ape[p % ratio] for p in cur]
        cs = [hist_c[p] for p in cur]
    z, c = np.array(zs, np.float64), np.array(cs, np.float64)
    w = np.exp(z - z.max(0))
    e = (w / w.sum(0) * c).sum(0)
    e = e / np.sqrt((e**2).mean() + eps) * norm_weight
    return ref.rope(e, block * ratio, rope_dim, theta)


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("steps", [[1] * 140, [5] * 60, [300, 1, 1, 300]])
def test_appends_match_the_history(rng, ratio, steps):
    b, w, d = 2, 16 if ratio != 128 else 32, 32
    cf = ref.coff(ratio) if ratio else 0
    ape = rng.standard_normal((ratio, cf * d)).astype(np.float32) if ratio else None
    nw = rng.uniform(0.5, 1.5, d).astype(np.float32) if ratio else None
    cache = KVCache(b, window=w, head_dim=d, ratio=ratio, max_comp=64, ape=ape, norm_weight=nw, rope_dim=8,
                    device=False)
    hist = [[] for _ in range(b)]
    hc = [[] for _ in range(b)]
    hz = [[] for _ in range(b)]
    for t in steps:
        kv = rng.standard_normal((b, t, d)).astype(BF16)
        kw = {}
        if ratio:
            kw = dict(comp_kv=rng.standard_normal((b, t, cf * d)).astype(np.float32),
                      comp_score=rng.standard_normal((b, t, cf * d)).astype(np.float32))
        cache.append(kv, **kw)
        for s in range(b):
            hist[s].extend(kv[s])
            if ratio:
                hc[s].extend(kw["comp_kv"][s])
                hz[s].extend(kw["comp_score"][s])
            n = len(hist[s])
            assert cache.pos[s] == n
            for p in range(max(0, n - w), n):  # the ring holds the last W tokens
                assert np.array_equal(cache.swa[s, p % w], hist[s][p])
    if ratio:
        for s in range(b):
            n = len(hist[s])
            assert cache.comp_len[s] == min(n // ratio, 64)
            for blk in range(int(cache.comp_len[s])):
                e = expected_entry(np.array(hc[s]), np.array(hz[s]), ape, blk, ratio, nw, 1e-6, 8, 10000.0)
                # the reference works in float64 and rounds to bf16 through fp32 (ml_dtypes' cast):
                # within half a bf16 ulp plus half an fp32 ulp (2^-16 of a bf16 ulp)
                err = np.abs(cache.comp[s, blk].astype(np.float64) - e)
                assert (err <= 0.5 * bf16_ulp(e) * (1 + 2.0**-16)).all(), (err / bf16_ulp(e)).max()


def test_counts_reset_and_overflow(rng):
    fp4kit.clear_status()
    d = 16
    cache = KVCache(3, window=8, head_dim=d, ratio=4, max_comp=2, rope_dim=0, device=False)
    kv = rng.standard_normal((3, 9, d)).astype(BF16)
    c = rng.standard_normal((3, 9, 2 * d)).astype(np.float32)
    counts = np.array([9, 4, 0], np.int32)
    cache.append(kv, comp_kv=c, comp_score=c, counts=counts)
    assert cache.pos.tolist() == [9, 4, 0] and cache.comp_len.tolist() == [2, 1, 0]
    assert not cache.overflowed()
    first = cache.comp[0].copy()
    cache.append(kv, comp_kv=c, comp_score=c, counts=np.array([4, 0, 0], np.int32))  # block 3 does not fit
    assert cache.comp_len[0] == 2 and np.array_equal(cache.comp[0], first)
    assert cache.overflowed()
    cache.reset(0)
    assert cache.pos[0] == 0 and cache.comp_len[0] == 0
    fp4kit.clear_status()


@pytest.mark.parametrize("ratio", [4, 128])
def test_append_without_window_rows_leaves_the_window(rng, ratio):
    """``append(None, comp_kv, comp_score)``: the compressed entries, lengths, compressor state and
    positions of an append with window rows, the window untouched; a count out of range is still
    recorded."""
    d, b = 32, 2
    caches = [KVCache(b, window=8, head_dim=d, ratio=ratio, max_comp=16, rope_dim=8, device=False) for _ in range(2)]
    window = rng.standard_normal((b, 8, d)).astype(BF16)
    caches[1].swa[...] = window
    for t in (1, 5, 130):
        kv = rng.standard_normal((b, t, d)).astype(BF16)
        c = rng.standard_normal((b, t, caches[0].compress_width)).astype(np.float32)
        caches[0].append(kv, comp_kv=c, comp_score=c)
        caches[1].append(None, comp_kv=c, comp_score=c)
    for name in ("pos", "comp", "comp_len", "kv_state", "score_state"):
        assert np.array_equal(getattr(caches[0], name), getattr(caches[1], name)), name
    assert np.array_equal(caches[1].swa.view(np.uint16), window.view(np.uint16))
    fp4kit.clear_status()
    c = np.ascontiguousarray(c[:, :2])
    caches[1].append(None, comp_kv=c, comp_score=c, counts=np.array([3, 1], np.int32))
    from fp4kit.runtime import status

    assert status.read() & status.KV_INPUT
    fp4kit.clear_status()


def test_window_slots():
    cache = KVCache(2, window=4, head_dim=16, rope_dim=0, device=False)
    cache.pos[:] = [2, 7]
    assert cache.window_slots().tolist() == [[0, 1, -1, -1], [3, 0, 1, 2]]


@pytest.mark.parametrize(
    "make, call, exc, message",
    [
        (dict(ratio=3), None, ValueError, "ratio: expected one of"),
        (dict(head_dim=24), None, ValueError, "head_dim: expected a positive multiple of 16"),
        (dict(rope_dim=3), None, ValueError, "rope_dim: expected an even number"),
        (dict(ratio=4, ape=np.zeros((4, 16), np.float32)), None, ValueError, r"ape: expected float32 \(4, 64\)"),
        (dict(), lambda c: c.append(np.zeros((2, 1, 16), BF16)), ValueError, r"kv: expected shape \(1, T, 32\)"),
        (dict(), lambda c: c.append(np.zeros((1, 1, 32), np.float32)), TypeError, "kv: expected dtype bfloat16"),
        (dict(ratio=4), lambda c: c.append(np.zeros((1, 1, 32), BF16)), ValueError, "comp_kv, comp_score: a compressing cache"),
        (dict(), lambda c: c.append(np.zeros((1, 1, 32), BF16), comp_kv=np.zeros((1, 1, 64), np.float32)), ValueError, "this cache does not compress"),
        (dict(ratio=4), lambda c: c.append(np.zeros((1, 2, 32), BF16), comp_kv=np.zeros((1, 1, 64), np.float32), comp_score=np.zeros((1, 1, 64), np.float32)), ValueError, r"comp_kv: expected shape \(1, 2, 64\)"),
        (dict(), lambda c: c.append(np.zeros((1, 1, 32), BF16), counts=np.zeros(1, np.int64)), TypeError, "counts: expected dtype int32"),
        (dict(), lambda c: c.reset(3), IndexError, "seq: expected 0..0"),
        (dict(), lambda c: c.rewind(np.zeros(2, np.int32)), ValueError, r"tokens: expected shape \(1\)"),
        (dict(), lambda c: c.rewind(np.zeros(1, np.int64)), TypeError, "tokens: expected dtype int32"),
        (dict(), lambda c: c.append(None), ValueError, "kv: None .no window rows. is for a compressing cache"),
        (dict(ratio=4), lambda c: c.append(None), ValueError, "comp_kv, comp_score: a compressing cache"),
        (dict(ratio=4), lambda c: c.append(None, comp_kv=np.zeros((1, 1, 64), np.float32)), ValueError, "comp_kv, comp_score: a compressing cache"),
        (dict(ratio=4), lambda c: c.append(None, comp_kv=np.zeros((1, 1, 32), np.float32), comp_score=np.zeros((1, 1, 32), np.float32)), ValueError, r"comp_kv: expected shape \(1, T, 64\)"),
    ],
)
def test_bad_input(make, call, exc, message):
    kwargs = dict(head_dim=32, window=8, max_comp=4, rope_dim=8, device=False)
    kwargs.update(make)
    if call is None:
        with pytest.raises(exc, match=message):
            KVCache(1, **kwargs)
        return
    cache = KVCache(1, **kwargs)
    with pytest.raises(exc, match=message):
        call(cache)


def test_advance_moves_the_positions_of_a_cache_whose_window_rows_are_written_elsewhere():
    """`KVCache.advance`: the position step of `append` alone (after `rmsnorm_rope_pair(...,
    window=cache.swa)` wrote the rows); a compressing cache and a bad count are refused by name."""
    cache = KVCache(2, window=4, head_dim=16, rope_dim=0, device=False)
    cache.advance(1)
    cache.advance(3)
    assert cache.pos.tolist() == [4, 4]
    with pytest.raises(ValueError, match="tokens: expected a non-negative int"):
        cache.advance(-1)
    with pytest.raises(ValueError, match="tokens: expected a non-negative int"):
        cache.advance(True)
    compressing = KVCache(2, window=4, head_dim=16, ratio=4, max_comp=4, rope_dim=0, device=False)
    with pytest.raises(ValueError, match=r"advance: a compressing cache \(ratio > 0\)"):
        compressing.advance(1)


def test_two_compressors_together_on_numpy_are_two_appends():
    """`append_compressed` on numpy caches (one after the other) = two `append(None, ...)` calls;
    a bad input of either is named before anything moves."""
    from fp4kit.layers.kv_cache import append_compressed

    rng = np.random.default_rng(3)
    caches = [[KVCache(2, ratio=4, head_dim=d, max_comp=8, rope_dim=16, device=False,
                       ape=np.random.default_rng(d).standard_normal((4, 2 * d)).astype(np.float32),
                       norm_weight=np.ones(d, np.float32)) for d in (64, 32)] for _ in range(2)]
    for _ in range(5):
        data = [(rng.standard_normal((2, 1, 2 * d)).astype(np.float32),
                 rng.standard_normal((2, 1, 2 * d)).astype(np.float32)) for d in (64, 32)]
        append_compressed((caches[0][0], *data[0]), (caches[0][1], *data[1]))
        for cache, (kv, score) in zip(caches[1], data):
            cache.append(None, kv, score)
    for a, b in zip(*caches):
        for name in ("pos", "comp_len", "comp", "kv_state"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert caches[0][0].comp_len.max() > 0
    pos = caches[0][0].pos.copy()
    with pytest.raises(ValueError, match="comp_kv"):
        append_compressed((caches[0][0], *data[0]), (caches[0][1], data[0][0], data[0][1]))
    np.testing.assert_array_equal(caches[0][0].pos, pos)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_rewind_takes_back_one_token_as_if_it_was_never_appended(rng, ratio):
    """A token appended and taken back (`KVCache.rewind`, a speculative step's rejected draft)
    leaves a cache that, after the next appends, holds what appending those alone would have left:
    positions, compressed lengths and entries, every window row a query can read, the compressor's
    running state of the groups a later entry reads. Crossing group boundaries (ratio 4: each of
    the four offsets), the window wrapping (W = 8)."""
    d = 32
    kw = dict(window=8, head_dim=d, ratio=ratio, max_comp=64, rope_dim=8, device=False)
    if ratio:
        cf = 2 if ratio == 4 else 1
        kw.update(ape=rng.standard_normal((ratio, cf * d)).astype(np.float32),
                  norm_weight=rng.uniform(0.5, 1.5, d).astype(np.float32))
    plain, spec = KVCache(2, **kw), KVCache(2, **kw)

    def token():
        kv = rng.standard_normal((2, 1, d)).astype(BF16)
        if not ratio:
            return kv, {}
        c = rng.standard_normal((2, 1, spec.compress_width)).astype(np.float32)
        return kv, dict(comp_kv=c, comp_score=c * 0.5)

    steps = 140 if ratio == 128 else 24
    for step in range(steps):
        kv, comp = token()
        plain.append(kv, **comp)
        spec.append(kv, **comp)
        wrong, wrong_comp = token()  # a draft appended, then taken back in one of the two sequences
        spec.append(wrong, **wrong_comp)
        spec.rewind(np.array([1, step % 2], np.int32))
        if step % 2 == 0:  # sequence 1 kept it: the plain cache appends it too (sequence 0 did not)
            plain.append(wrong, counts=np.array([0, 1], np.int32), **wrong_comp)
    assert spec.pos.tolist() == plain.pos.tolist()
    for s in range(2):
        p = int(spec.pos[s])
        live = [q % 8 for q in range(max(0, p - 7), p)]
        assert np.array_equal(spec.swa[s, live], plain.swa[s, live])
        if ratio:
            n = int(plain.comp_len[s])
            assert int(spec.comp_len[s]) == n and n == min(p // ratio, 64)
            assert np.array_equal(spec.comp[s, :n], plain.comp[s, :n])
            slots = spec.kv_state.shape[1]
            rows = [q % slots for q in range(max(0, (p // ratio) * ratio - slots + ratio), p)]
            assert np.array_equal(spec.kv_state[s, rows], plain.kv_state[s, rows])


def test_rewind_clamps_and_reports_counts_outside_0_1():
    fp4kit.clear_status()
    cache = KVCache(3, window=4, head_dim=16, ratio=4, max_comp=8, rope_dim=0, device=False)
    cache.pos[...] = [5, 0, 9]
    cache.comp_len[...] = [1, 0, 2]
    cache.rewind(np.array([1, 1, 0], np.int32))  # at position 0 nothing to take back
    assert cache.pos.tolist() == [4, 0, 9] and cache.comp_len.tolist() == [1, 0, 2]
    assert not fp4kit.read_status()
    cache.rewind(np.array([3, -1, 1], np.int32))
    assert cache.pos.tolist() == [3, 0, 8] and cache.comp_len.tolist() == [0, 0, 2]
    assert fp4kit.read_status()
    fp4kit.clear_status()
