"""The hyper-connection site op (`fp4kit.ops.hyper.hc_site`) on numpy arrays: the reference's
composition (update or start of the copies, mix, RMSNorm), and its refusals before any work."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.ops import hyper
from fp4kit.reference import elementwise as ew_ref
from fp4kit.reference import hyper_connections as ref

BF16 = ml_dtypes.bfloat16


def site_params(rng, d, head=False, hc=4):
    m = hc if head else (2 + hc) * hc
    fn = (rng.standard_normal((m, hc * d)) * (hc * d) ** -0.5).astype(np.float32)
    scale = (rng.standard_normal(1 if head else 3) * 0.1 + 1.0).astype(np.float32)
    base = (rng.standard_normal(m) * 0.5).astype(np.float32)
    norm = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    return fn, scale, base, norm


def test_site_on_numpy_is_the_reference(rng):
    rows, d = 3, 64
    fn, scale, base, norm = site_params(rng, d)
    emb = rng.standard_normal((rows, d)).astype(np.float32)
    x = np.empty((rows, 4, d), np.float32)
    h, post, comb = hyper.hc_site(x, fn, scale, base, norm, y=emb, start=True, iters=7)
    assert np.array_equal(x, np.repeat(emb[:, None], 4, axis=1))
    mixed, want_post, want_comb = ref.hc_pre(x, fn, scale, base, iters=7)
    assert np.array_equal(h, ew_ref.add_rmsnorm(mixed.astype(np.float32), None, norm))
    assert np.array_equal(post, want_post.astype(np.float32)) and np.array_equal(comb, want_comb.astype(np.float32))
    y = rng.standard_normal((rows, d)).astype(BF16)
    before = x.copy()
    h2, _, _ = hyper.hc_site(x, fn, scale, base, norm, y=y, post=post, comb=comb)
    assert np.array_equal(x, ref.hc_post(y.astype(np.float32), before, post, comb).astype(np.float32))
    fn_h, scale_h, base_h, norm_h = site_params(rng, d, head=True)
    head, p, c = hyper.hc_site(x, fn_h, scale_h, base_h, norm_h, head=True)
    assert p is None and c is None
    want = ew_ref.add_rmsnorm(ref.hc_head(x, fn_h, scale_h, base_h).astype(np.float32), None, norm_h)
    assert np.array_equal(head, want)


def test_bad_inputs_name_the_argument(rng):
    d = 32
    fn, scale, base, norm = site_params(rng, d)
    x = np.zeros((2, 4, d), np.float32)
    y = np.zeros((2, d), np.float32)
    with pytest.raises(ValueError, match="x: expected the copies"):
        hyper.hc_site(np.zeros((2, 4 * d), np.float32), fn, scale, base, norm)
    with pytest.raises(ValueError, match="fn: expected float32 \\[24x128\\]"):
        hyper.hc_site(x, fn[:4], scale, base, norm)
    with pytest.raises(ValueError, match="scale: expected float32 \\[1\\]"):
        hyper.hc_site(x, fn[:4], scale, base[:4], norm, head=True)
    with pytest.raises(ValueError, match="norm: expected float32"):
        hyper.hc_site(x, fn, scale, base, norm[:-1])
    with pytest.raises(ValueError, match="post, comb"):
        hyper.hc_site(x, fn, scale, base, norm, y=y)
    with pytest.raises(ValueError, match="comb: expected float32 \\[2x4x4\\]"):
        hyper.hc_site(x, fn, scale, base, norm, y=y, post=np.zeros((2, 4), np.float32),
                      comb=np.zeros((2, 16), np.float32))
    with pytest.raises(ValueError, match="y: expected bfloat16 or float32"):
        hyper.hc_site(x, fn, scale, base, norm, y=y[:1], start=True)
    with pytest.raises(ValueError, match="start: needs y"):
        hyper.hc_site(x, fn, scale, base, norm, start=True)
    with pytest.raises(ValueError, match="iters"):
        hyper.hc_site(x, fn, scale, base, norm, iters=0)
