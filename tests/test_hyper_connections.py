"""The mHC and YaRN specification (`fp4kit.reference.hyper_connections`) against the published
formulas written out token by token in plain Python, and the properties they promise: positive
pre weights, post weights in (0, 2), a nearly doubly stochastic mixing matrix after the Sinkhorn
rounds, and YaRN frequencies equal to the plain ones below the correction range and divided by the
factor above it."""

import math

import numpy as np
import pytest

from fp4kit.reference import hyper_connections as hc

HC, D = 4, 32
M = (2 + HC) * HC


def params(rng):
    return (rng.standard_normal((M, HC * D)) * 0.05, rng.standard_normal(3) * 0.5 + 1.0, rng.standard_normal(M) * 0.3)


def loop_split(mix, scale, base, n, iters, eps):
    """The published split, one token, lists of floats."""
    sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
    pre = [sig(mix[i] * scale[0] + base[i]) + eps for i in range(n)]
    post = [2.0 * sig(mix[n + i] * scale[1] + base[n + i]) for i in range(n)]
    c = [[mix[2 * n + r * n + k] * scale[2] + base[2 * n + r * n + k] for k in range(n)] for r in range(n)]
    for r in range(n):
        top = max(c[r])
        ex = [math.exp(v - top) for v in c[r]]
        c[r] = [v / sum(ex) + eps for v in ex]

    def cols():
        sums = [sum(c[r][k] for r in range(n)) + eps for k in range(n)]
        for r in range(n):
            c[r] = [c[r][k] / sums[k] for k in range(n)]

    def rows():
        for r in range(n):
            s = sum(c[r]) + eps
            c[r] = [v / s for v in c[r]]

    cols()
    for _ in range(iters - 1):
        rows()
        cols()
    return pre, post, c


def test_split_sinkhorn_follows_the_published_rule(rng):
    fn, scale, base = params(rng)
    x = rng.standard_normal((3, HC, D))
    mixes = hc.hc_mixes(x, fn)
    for t in range(3):
        flat = x[t].reshape(-1)
        rms = 1.0 / math.sqrt(sum(v * v for v in flat) / flat.size + 1e-6)
        want = [sum(float(a) * float(b) for a, b in zip(row, flat)) * rms for row in fn]
        assert np.allclose(mixes[t], want, rtol=1e-12, atol=1e-12)
    pre, post, comb = hc.split_sinkhorn(mixes, scale, base, HC, 20, 1e-6)
    for t in range(3):
        p, q, c = loop_split(list(mixes[t]), list(scale), list(base), HC, 20, 1e-6)
        assert np.allclose(pre[t], p, rtol=1e-12) and np.allclose(post[t], q, rtol=1e-12)
        assert np.allclose(comb[t], c, rtol=1e-12)
    assert (pre > 0).all() and ((post > 0) & (post < 2)).all()
    assert np.allclose(comb.sum(-2), 1.0, atol=1e-5) and np.allclose(comb.sum(-1), 1.0, atol=1e-3)


def test_pre_post_and_head_mix_the_copies(rng):
    fn, scale, base = params(rng)
    x = rng.standard_normal((2, HC, D))
    inp, post, comb = hc.hc_pre(x, fn, scale, base)
    pre, _, _ = hc.split_sinkhorn(hc.hc_mixes(x, fn), scale, base, HC)
    for t in range(2):
        assert np.allclose(inp[t], sum(pre[t, i] * x[t, i] for i in range(HC)))
    y = rng.standard_normal((2, D))
    new = hc.hc_post(y, x, post, comb)
    for t in range(2):
        for j in range(HC):
            want = post[t, j] * y[t] + sum(comb[t, i, j] * x[t, i] for i in range(HC))
            assert np.allclose(new[t, j], want)
    head_fn, head_base = rng.standard_normal((HC, HC * D)) * 0.05, rng.standard_normal(HC)
    mix = hc.hc_mixes(x, head_fn)
    weights = 1.0 / (1.0 + np.exp(-(mix * 1.3 + head_base))) + 1e-6
    assert np.allclose(hc.hc_head(x, head_fn, np.array([1.3]), head_base),
                       (weights[..., None] * x).sum(-2))


@pytest.mark.parametrize("dim, theta, factor, original", [(64, 10000.0, 16.0, 65536), (64, 160000.0, 16.0, 65536),
                                                          (128, 10000.0, 40.0, 4096)])
def test_yarn_keeps_high_frequencies_and_scales_low_ones(dim, theta, factor, original):
    plain = theta ** (-np.arange(0, dim, 2) / dim)
    freqs = hc.yarn_inv_freq(dim, theta, factor, original, 32.0, 1.0)
    low, high = hc.yarn_correction_range(dim, original, theta, 32.0, 1.0)
    assert 0 <= low <= high <= dim - 1
    i = np.arange(dim // 2)
    assert np.allclose(freqs[i <= low], plain[i <= low])                       # fast pairs: unchanged
    assert np.allclose(freqs[i >= high], plain[i >= high] / factor)            # slow pairs: interpolated
    ratio = freqs / plain
    assert (np.diff(ratio) <= 1e-12).all() and ratio.min() >= 1 / factor - 1e-12  # a monotone blend between
    # the range: pair i completes 2 pi * original / wavelength_i rotations over the original context
    rotations = original * plain / (2 * math.pi)
    assert rotations[max(low - 1, 0)] >= 32.0 * 0.5 and rotations[min(high + 1, dim // 2 - 1)] <= 1.0 * 2
    assert np.array_equal(hc.yarn_inv_freq(dim, theta, 1.0, original), plain)
