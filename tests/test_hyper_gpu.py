"""The hyper-connection kernels (raw_kernels/hyper.cu through `fp4kit.ops.hyper.hc_site`) against
the float64 reference: the copies after an update within fp32 rounding, post and comb within
1e-5, the normed sublayer input within one bf16 rounding step, bitwise the same on a repeat and
when replayed from a CUDA graph."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.ops import hyper
from test_hyper import site_params

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16


def close_bf16(got, want):
    """Within one bf16 step of the value (the fp32 sums round to bf16 on either side), or 1e-5 of
    the unit-RMS row where a value is near zero."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.abs(got - want) <= 2.0 ** -7 * np.abs(want) + 1e-5), np.abs(got - want).max()


# 8320 channels: more hc_mix blocks (65) than hc_pre_norm stages at once, and a partial last block
@pytest.mark.parametrize("rows,d", [(1, 4096), (3, 200), (8, 1024), (2, 8320)])
@pytest.mark.parametrize("y_dtype", [BF16, np.float32])
def test_sites_against_the_reference(rng, rows, d, y_dtype):
    fn, scale, base, norm = site_params(rng, d)
    emb = rng.standard_normal((rows, d)).astype(np.float32)
    x_host = np.empty((rows, 4, d), np.float32)
    x_dev = cp.empty((rows, 4, d), cp.float32)
    dev = [cp.asarray(a) for a in (fn, scale, base, norm)]
    want = hyper.hc_site(x_host, fn, scale, base, norm, y=emb, start=True)
    got = hyper.hc_site(x_dev, *dev, y=cp.asarray(emb), start=True)
    assert np.array_equal(x_dev.get(), x_host)
    close_bf16(got[0].get(), want[0])
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g.get(), w, rtol=1e-5, atol=1e-6)
    # the update with a sublayer's output, from the same copies and the reference's post / comb
    y = (rng.standard_normal((rows, d)) * 3).astype(y_dtype)
    post, comb = want[1], want[2]
    x_dev[...] = cp.asarray(x_host)
    want = hyper.hc_site(x_host, fn, scale, base, norm, y=y, post=post, comb=comb, iters=20)
    got = hyper.hc_site(x_dev, *dev, y=cp.asarray(y), post=cp.asarray(post), comb=cp.asarray(comb), iters=20)
    np.testing.assert_allclose(x_dev.get(), x_host, rtol=1e-6, atol=1e-5)  # fp32 FMAs of terms up to ~10
    x_dev[...] = cp.asarray(x_host)  # the mix on equal copies
    fn_h, scale_h, base_h, norm_h = site_params(rng, d, head=True)
    want_h = hyper.hc_site(x_host.copy(), fn_h, scale_h, base_h, norm_h, head=True)[0]
    got_h = hyper.hc_site(x_dev, *(cp.asarray(a) for a in (fn_h, scale_h, base_h, norm_h)), head=True)[0]
    close_bf16(got_h.get(), want_h)
    close_bf16(got[0].get(), want[0])
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g.get(), w, rtol=1e-5, atol=1e-6)


def test_repeat_and_graph_replay_are_bitwise_equal(rng):
    rows, d = 4, 4096
    fn, scale, base, norm = (cp.asarray(a) for a in site_params(rng, d))
    y = cp.asarray(rng.standard_normal((rows, d)).astype(BF16))
    x0 = cp.asarray(rng.standard_normal((rows, 4, d)).astype(np.float32))
    post0 = cp.asarray(rng.random((rows, 4)).astype(np.float32) * 2)
    comb0 = cp.asarray(np.full((rows, 4, 4), 0.25, np.float32))
    outs = [cp.empty((rows, d), BF16), cp.empty((rows, 4), cp.float32), cp.empty((rows, 4, 4), cp.float32)]
    scratch = cp.empty(hyper.scratch_words(rows, d), cp.float32)
    x = x0.copy()
    first = [a.get() for a in hyper.hc_site(x, fn, scale, base, norm, y=y, post=post0, comb=comb0, scratch=scratch)]
    x_first = x.get()
    x[...] = x0
    again = [a.get() for a in hyper.hc_site(x, fn, scale, base, norm, y=y, post=post0, comb=comb0, out=outs[0],
                                            post_out=outs[1], comb_out=outs[2], scratch=scratch)]
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(first, again))
    x[...] = x0
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        hyper.hc_site(x, fn, scale, base, norm, y=y, post=post0, comb=comb0, out=outs[0], post_out=outs[1],
                      comb_out=outs[2], scratch=scratch)
        graph = stream.end_capture()
    for a in outs:
        a.fill(0)
    cp.cuda.Device().synchronize()  # the resets (default stream) before the non-blocking stream's replay
    graph.launch(stream)
    stream.synchronize()
    assert np.array_equal(x.get(), x_first)
    assert all(np.array_equal(a.get().view(np.uint8), b.view(np.uint8)) for a, b in zip(outs, first))


def test_other_copy_counts_are_refused_on_the_device(rng):
    fn, scale, base, norm = (cp.asarray(a) for a in site_params(rng, 16, hc=2))
    with pytest.raises(ValueError, match="built for 4 copies"):
        hyper.hc_site(cp.zeros((1, 2, 16), cp.float32), fn, scale, base, norm)


def test_post_and_comb_are_not_updated_in_place(rng):
    """The row's first block writes this site's post / comb while the other blocks still read the
    previous site's: outputs over the inputs are refused before any launch, the copies untouched."""
    d = 1024
    fn, scale, base, norm = (cp.asarray(a) for a in site_params(rng, d))
    x = cp.asarray(rng.standard_normal((1, 4, d)).astype(np.float32))
    x0 = x.copy()
    y = cp.asarray(rng.standard_normal((1, d)).astype(BF16))
    post, comb = cp.ones((1, 4), cp.float32), cp.full((1, 4, 4), 0.25, cp.float32)
    for kw, name in ((dict(post_out=post), "post_out"), (dict(comb_out=comb), "comb_out")):
        with pytest.raises(ValueError, match=name):
            hyper.hc_site(x, fn, scale, base, norm, y=y, post=post, comb=comb, **kw)
    assert cp.array_equal(x, x0)
