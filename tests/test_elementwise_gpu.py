"""The decode-step row kernels on the GPU against their reference: RMSNorm (+ RoPE) and the residual
add + norm within one bf16 rounding (the fp32 sums run in another order), the rest exactly; the
out-of-range embedding flag in the device status word."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.ops import elementwise as ew
from fp4kit.runtime import status

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16


def close_bf16(dev, host):
    a, b = cp.asnumpy(dev).astype(np.float32), np.asarray(host).astype(np.float32)
    np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-6)
    assert (a.view(np.uint32) != b.view(np.uint32)).mean() < 0.02  # almost all bit-identical


@pytest.mark.parametrize("shape, rope_dim, weight, normalize", [
    ((3, 1024), 0, True, True), ((2, 64, 512), 64, False, True), ((5, 1, 512), 64, True, True),
    ((2, 8, 32), 16, False, False), ((1, 4096), 0, True, True), ((7, 3, 258), 2, True, True)])
def test_rmsnorm_rope(rng, shape, rope_dim, weight, normalize):
    x = (rng.standard_normal(shape) * 3).astype(BF16)
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32) if weight else None
    pos = rng.integers(0, 100000, shape[0]).astype(np.int32)
    kw = dict(eps=1e-6, normalize=normalize, rope_dim=rope_dim, theta=10000.0)
    host = ew.rmsnorm_rope(x, w, pos if rope_dim else None, **kw)
    dev = ew.rmsnorm_rope(cp.asarray(x), None if w is None else cp.asarray(w), cp.asarray(pos) if rope_dim else None, **kw)
    close_bf16(dev, host)


def test_rope_frequencies_from_a_table(rng):
    """The kernels rotate by a float64 table of the channel pairs' inverse frequencies: a base's
    table holds the reference's frequencies bit for bit; YaRN-scaled frequencies (a host array, or a
    device table taken as is) rotate as the reference rotates by them."""
    from fp4kit.reference.elementwise import rope_inv_freq
    from fp4kit.reference.hyper_connections import yarn_inv_freq

    x = (rng.standard_normal((4, 8, 512)) * 3).astype(BF16)
    xd = cp.asarray(x)
    pos = rng.integers(0, 100000, 4).astype(np.int32)
    table = ew.rope_table(160000.0, 64, xd)
    assert table.dtype == np.float64 and np.array_equal(cp.asnumpy(table), rope_inv_freq(64, 160000.0))
    assert ew.rope_table(160000.0, 64, xd) is table and ew.rope_table(160000.0, 0, xd) == 0
    yarn = yarn_inv_freq(64, 160000.0, 16.0, 65536)
    host = ew.rmsnorm_rope(x, None, pos, rope_dim=64, theta=yarn)
    close_bf16(ew.rmsnorm_rope(xd, None, cp.asarray(pos), rope_dim=64, theta=yarn), host)
    close_bf16(ew.rmsnorm_rope(xd, None, cp.asarray(pos), rope_dim=64, theta=cp.asarray(yarn)), host)
    with pytest.raises(ValueError, match=r"theta: expected a float64 \[32\] array"):
        ew.rmsnorm_rope(xd, None, cp.asarray(pos), rope_dim=64, theta=cp.asarray(yarn, np.float32))
    with pytest.raises(ValueError, match="theta: expected a RoPE base or 32 inverse frequencies"):
        ew.rmsnorm_rope(xd, None, cp.asarray(pos), rope_dim=64, theta=yarn[:5])


def test_a_new_rope_table_is_refused_inside_a_capture(rng, capture_stream):
    x = cp.asarray(rng.standard_normal((2, 64)).astype(BF16))
    pos = cp.zeros(2, np.int32)
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="theta: the first call with these RoPE frequencies"):
                ew.rmsnorm_rope(x, None, pos, rope_dim=16, theta=123.0)
        finally:
            stream.end_capture()
    assert cp.asnumpy(ew.rmsnorm_rope(x, None, pos, rope_dim=16, theta=123.0)).shape == (2, 64)  # outside: fine


@pytest.mark.parametrize("rows", [1, 5])
def test_rmsnorm_rope_pair_is_bit_identical_to_two_launches(rng, rows, capture_stream):
    """The two-part launch gives the bits of two `rmsnorm_rope` launches (the decode step's pairs:
    the query's low rank normed beside the latent normed and rotated; the query heads beside the
    indexer's rotated heads), and is one kernel in a captured graph."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from common import graph_kernels

    pos = cp.asarray(rng.integers(0, 100000, rows).astype(np.int32))
    d = {k: cp.asarray((rng.standard_normal(shape) * 3).astype(BF16)) for k, shape in
         [("qr", (rows, 1024)), ("kv", (rows, 512)), ("q", (rows, 64, 512)), ("iq", (rows, 64, 128))]}
    wq, wkv = (cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32)) for n in (1024, 512))
    kw = dict(eps=1e-6, theta=10000.0)
    pairs = [((ew.NormRope(d["qr"], wq), ew.NormRope(d["kv"], wkv, rope_dim=64)),
              (ew.rmsnorm_rope(d["qr"], wq, eps=1e-6), ew.rmsnorm_rope(d["kv"], wkv, pos, rope_dim=64, **kw))),
             ((ew.NormRope(d["q"], rope_dim=64), ew.NormRope(d["iq"], normalize=False, rope_dim=64)),
              (ew.rmsnorm_rope(d["q"], None, pos, rope_dim=64, **kw),
               ew.rmsnorm_rope(d["iq"], None, pos, normalize=False, rope_dim=64, **kw)))]
    for (first, second), want in pairs:
        outs = (cp.full(first.x.shape, np.nan, BF16), cp.full(second.x.shape, np.nan, BF16))
        got = ew.rmsnorm_rope_pair(first, second, pos, outs=outs, **kw)
        assert got[0] is outs[0] and got[1] is outs[1]
        for g, w in zip(got, want):
            assert cp.array_equal(g.view(cp.uint16), w.view(cp.uint16))
        stream = capture_stream()
        with stream:
            stream.begin_capture()
            ew.rmsnorm_rope_pair(first, second, pos, outs=outs, **kw)
            graph = stream.end_capture()
        assert graph_kernels(graph) == ["rmsnorm_rope2_bf16"]


@pytest.mark.parametrize("advance", [False, True])
def test_rmsnorm_rope_pair_into_a_window_equals_the_window_append(rng, advance):
    """``window=cache.swa``: the latent rows written by the norm kernel itself are the bits the
    separate window append writes (every slot of the ring compared, positions past the window);
    ``advance``: the kernel moves the positions on itself, as the cache's advance launch would."""
    from fp4kit.layers import KVCache

    b, w, d = 5, 128, 512
    pos = rng.integers(0, 100000, b).astype(np.int32)
    qr, kv = (cp.asarray((rng.standard_normal((b, n)) * 3).astype(BF16)) for n in (1024, d))
    wq, wkv = (cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32)) for n in (1024, d))
    fill = rng.standard_normal((b, w, d)).astype(BF16)
    fused, apart = (KVCache(b, window=w, head_dim=d, rope_dim=64) for _ in range(2))
    for cache in (fused, apart):
        cache.swa[...] = cp.asarray(fill)
        cache.pos[...] = cp.asarray(pos)
    kw = dict(eps=1e-6, theta=10000.0)
    parts = (ew.NormRope(qr, wq), ew.NormRope(kv, wkv, rope_dim=64))
    y0, ring = ew.rmsnorm_rope_pair(*parts, fused.pos, window=fused.swa, advance=advance, **kw)
    assert ring is fused.swa
    if not advance:
        fused.advance(1)
    z0, z1 = ew.rmsnorm_rope_pair(*parts, apart.pos, **kw)
    apart.append(z1[:, None, :])
    assert cp.array_equal(y0.view(cp.uint16), z0.view(cp.uint16))
    assert cp.array_equal(fused.swa.view(cp.uint16), apart.swa.view(cp.uint16))
    assert cp.array_equal(fused.pos, apart.pos)


@pytest.mark.parametrize("rows, width, offset", [
    (4, 4096, 0), (3, 8192, 0), (2, 7168, 0),  # the quad path (16-byte rows held in registers)
    (2, 4100, 0), (2, 9000, 0), (3, 4096, 1),  # the loop: a row past 8192, a misaligned view
    (2, 6, 0)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rmsnorm(rng, rows, width, offset, with_delta):
    resid = rng.standard_normal((rows, width)).astype(np.float32)
    delta = rng.standard_normal((rows, width)).astype(BF16) if with_delta else None
    w = rng.uniform(0.5, 1.5, width).astype(np.float32)
    dres = cp.asarray(np.concatenate([np.zeros(offset, np.float32), resid.ravel()]))[offset:].reshape(rows, width)
    before = resid.copy()
    dev = ew.add_rmsnorm(dres, None if delta is None else cp.asarray(delta), cp.asarray(w))
    host = ew.add_rmsnorm(resid, delta, w)
    np.testing.assert_array_equal(cp.asnumpy(dres), resid)  # the add is exact and in place
    if delta is None:
        np.testing.assert_array_equal(resid, before)
    close_bf16(dev, host)


@pytest.mark.parametrize("width", [4096, 96, 8192, 4100])
def test_embed_rmsnorm_equals_the_two_launches(rng, width):
    table = rng.standard_normal((50, width)).astype(BF16)
    w = rng.uniform(0.5, 1.5, width).astype(np.float32)
    tokens = cp.asarray(np.array([0, 49, 7, 7], np.int32))
    dtable, dw = cp.asarray(table), cp.asarray(w)
    resid = cp.full((4, width), np.nan, np.float32)
    status.clear(device=0)
    y = ew.embed_rmsnorm(dtable, tokens, dw, eps=1e-5, resid=resid)
    want_resid = ew.embed(dtable, tokens)
    np.testing.assert_array_equal(cp.asnumpy(resid), cp.asnumpy(want_resid))
    # the same kernels' arithmetic (quad path, or the two launches it falls back to): the same bits
    np.testing.assert_array_equal(cp.asnumpy(y).view(np.uint16),
                                  cp.asnumpy(ew.add_rmsnorm(want_resid, None, dw, eps=1e-5)).view(np.uint16))
    close_bf16(y, ew.add_rmsnorm(table[[0, 49, 7, 7]].astype(np.float32), None, w, eps=1e-5))
    assert not status.read(0) & status.TOKEN_RANGE
    ew.embed_rmsnorm(dtable, cp.asarray(np.array([50, -3], np.int32)), dw, resid=resid[:2])
    np.testing.assert_array_equal(cp.asnumpy(resid[:2]), table[[0, 0]].astype(np.float32))
    assert status.read(0) & status.TOKEN_RANGE
    status.clear(device=0)


@pytest.mark.parametrize("width", [96, 4096, 100])
def test_embed_and_status(rng, width):
    table = rng.standard_normal((50, width)).astype(BF16)
    tokens = np.array([0, 49, 7], np.int32)
    status.clear(device=0)
    out = ew.embed(cp.asarray(table), cp.asarray(tokens))
    np.testing.assert_array_equal(cp.asnumpy(out), table[tokens].astype(np.float32))
    assert not status.read(0) & status.TOKEN_RANGE
    out = ew.embed(cp.asarray(table), cp.asarray(np.array([50, -3], np.int32)))
    np.testing.assert_array_equal(cp.asnumpy(out), table[[0, 0]].astype(np.float32))
    assert status.read(0) & status.TOKEN_RANGE
    status.clear(device=0)


def test_all_entries_prompt_tokens_and_log(rng):
    comp_len = rng.integers(0, 700, 5).astype(np.int32)
    np.testing.assert_array_equal(cp.asnumpy(ew.all_entries(cp.asarray(comp_len), 600)),
                                  ew.all_entries(comp_len, 600))
    prompt = rng.integers(0, 1000, (3, 9)).astype(np.int32)
    pos = np.array([0, 4, 20], np.int32)
    dev, host = cp.zeros(3, np.int32), np.zeros(3, np.int32)
    ew.prompt_tokens(cp.asarray(prompt), cp.asarray(pos), dev)
    ew.prompt_tokens(prompt, pos, host)
    np.testing.assert_array_equal(cp.asnumpy(dev), host)
    hist, step = cp.zeros((4, 3), np.int32), cp.zeros(1, np.int32)
    hhist, hstep = np.zeros((4, 3), np.int32), np.zeros(1, np.int32)
    for t in range(6):
        tok = rng.integers(0, 9, 3).astype(np.int32)
        ew.log_tokens(cp.asarray(tok), hist, step)
        ew.log_tokens(tok, hhist, hstep)
    np.testing.assert_array_equal(cp.asnumpy(hist), hhist)
    assert int(step[0]) == 6


@pytest.mark.parametrize("rows, sizes", [(1, [64, 128]), (8, [1024, 512, 1024, 1024, 128, 128, 64]), (5, [3, 8, 5]),
                                         (32, [4096])])
def test_split_columns_in_one_launch_equals_slices(rng, rows, sizes):
    """Every part equals its column block of y, bit for bit, C-contiguous: one row as views, more
    rows through the one-launch split (16-byte moves when the widths allow, else element by element)."""
    y = cp.asarray(rng.standard_normal((rows, sum(sizes))).astype(BF16))
    out = cp.full(y.size, np.nan, BF16) if rows > 1 and len(sizes) > 1 else None
    parts = ew.split_columns(y, sizes, out=out)
    at = 0
    for p, s in zip(parts, sizes):
        assert p.shape == (rows, s) and p.flags.c_contiguous
        assert cp.array_equal(p.view(cp.uint16), y[:, at:at + s].view(cp.uint16))
        at += s


def test_early_release_in_a_graph_gives_the_same_bits(rng, capture_stream, monkeypatch):
    """With `EARLY_RELEASE` the row kernels let the next kernel launch at their start (common/pdl.cuh):
    a captured chain embedding + norm -> GEMM -> residual add + norm -> GEMM -> norm + RoPE, replayed,
    gives the bits of the same chain launched eagerly (the next kernel still waits for each row
    kernel's results)."""
    import fp4kit
    from fp4kit.ops.gemm import gemm
    from fp4kit.formats import to_tiled
    from fp4kit.reference import quant as qref

    h, v = 4096, 64
    table = cp.asarray((rng.standard_normal((v, h)) * 0.5).astype(BF16))
    w1, w2 = (cp.asarray(rng.uniform(0.5, 1.5, h).astype(np.float32)) for _ in range(2))
    wr = cp.asarray(rng.uniform(0.5, 1.5, 512).astype(np.float32))
    weights = []
    for n in (h, 512):
        q = qref.quantize((rng.standard_normal((n, h)) * 0.05).astype(np.float32))
        weights.append(to_tiled(fp4kit.Nvfp4Tensor(cp.asarray(q.packed), cp.asarray(q.block_scales),
                                                   cp.asarray(q.global_scale), q.scale_layout, q.shape)))
    tokens = cp.asarray(rng.integers(0, v, 2).astype(np.int32))
    pos = cp.asarray(rng.integers(0, 5000, 2).astype(np.int32))
    bufs = {name: cp.empty(shape, dtype) for name, shape, dtype in [
        ("resid", (2, h), np.float32), ("x", (2, h), BF16), ("y", (2, h), BF16), ("z", (2, h), BF16),
        ("u", (2, 512), BF16), ("out", (2, 512), BF16)]}

    def chain():
        x = ew.embed_rmsnorm(table, tokens, w1, resid=bufs["resid"], out=bufs["x"])
        y = gemm(x, weights[0], out=bufs["y"])
        z = ew.add_rmsnorm(bufs["resid"], y, w2, out=bufs["z"])
        u = gemm(z, weights[1], out=bufs["u"])
        return ew.rmsnorm_rope(u, wr, pos, rope_dim=64, out=bufs["out"])

    chain()
    want = cp.asnumpy(bufs["out"]).view(np.uint16).copy()
    monkeypatch.setattr(ew, "EARLY_RELEASE", True)
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        chain()
        graph = stream.end_capture()
    for _ in range(3):
        bufs["out"].fill(0)
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(bufs["out"]).view(np.uint16), want)
