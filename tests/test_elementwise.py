"""The decode-step row kernels' reference and numpy path: RMSNorm, RoPE (the KV cache's
convention), residual add + norm, embedding (out-of-range ids reported), all-entries selection,
prompt tokens and the token log; bad inputs rejected before anything runs."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.ops import elementwise as ew
from fp4kit.reference import elementwise as ref
from fp4kit.reference import kv_cache as kv_ref
from fp4kit.runtime import status

BF16 = ml_dtypes.bfloat16


def test_rmsnorm_of_a_row_has_unit_rms_times_weight(rng):
    x = (rng.standard_normal((3, 2, 64)) * 7).astype(BF16)
    w = rng.uniform(0.5, 2, 64).astype(np.float32)
    y = ew.rmsnorm_rope(x, w, eps=0.0).astype(np.float32)
    x64 = x.astype(np.float64)
    expect = x64 / np.sqrt((x64**2).mean(-1, keepdims=True)) * w
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, expect, rtol=2**-8, atol=0)  # one bf16 rounding


def test_rope_matches_the_kv_cache_convention(rng):
    x = rng.standard_normal((4, 32)).astype(np.float32)
    pos = np.array([0, 1, 17, 4095], np.int32)
    y = ref.rope(x, pos, 16, 10000.0)
    for b in range(4):
        np.testing.assert_allclose(y[b], kv_ref.rope(x[b].astype(np.float64), int(pos[b]), 16, 10000.0),
                                   rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[0], x[0])  # position 0 is the identity
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)  # a rotation


def test_rmsnorm_rope_per_head_positions(rng):
    x = rng.standard_normal((2, 3, 32)).astype(BF16)
    pos = np.array([5, 9], np.int32)
    y = ew.rmsnorm_rope(x, None, pos, rope_dim=8, theta=100.0)
    for b in range(2):
        for h in range(3):
            single = ew.rmsnorm_rope(x[b, h][None], None, pos[b:b + 1], rope_dim=8, theta=100.0)
            assert np.array_equal(single[0].view(np.uint16), y[b, h].view(np.uint16))
    # without the norm, only the last rope_dim channels change
    z = ew.rmsnorm_rope(x, None, pos, normalize=False, rope_dim=8, theta=100.0)
    assert np.array_equal(z[..., :24].view(np.uint16), x[..., :24].view(np.uint16))
    assert not np.array_equal(z[..., 24:].view(np.uint16), x[..., 24:].view(np.uint16))


def test_add_rmsnorm_updates_the_residual_in_place(rng):
    resid = rng.standard_normal((2, 48)).astype(np.float32)
    before = resid.copy()
    delta = rng.standard_normal((2, 48)).astype(BF16)
    w = np.ones(48, np.float32)
    y = ew.add_rmsnorm(resid, delta, w, eps=0.0)
    np.testing.assert_array_equal(resid, before + delta.astype(np.float32))
    np.testing.assert_allclose(y.astype(np.float32), resid / np.sqrt((resid.astype(np.float64) ** 2).mean(-1, keepdims=True)),
                               rtol=2**-8)
    again = resid.copy()
    ew.add_rmsnorm(resid, None, w)  # no delta: the residual is untouched
    np.testing.assert_array_equal(resid, again)


def test_embed_reports_out_of_range_tokens(rng):
    table = rng.standard_normal((10, 8)).astype(BF16)
    rows = ew.embed(table, np.array([3, 9], np.int32))
    np.testing.assert_array_equal(rows, table[[3, 9]].astype(np.float32))
    assert not status.read(None) & status.TOKEN_RANGE
    rows = ew.embed(table, np.array([-1, 10], np.int32))
    np.testing.assert_array_equal(rows, table[[0, 0]].astype(np.float32))
    assert status.read(None) & status.TOKEN_RANGE


def test_embed_rmsnorm_is_the_embedding_then_its_norm(rng):
    table = rng.standard_normal((10, 16)).astype(BF16)
    w = rng.uniform(0.5, 1.5, 16).astype(np.float32)
    tokens = np.array([3, 9, 0], np.int32)
    resid = np.full((3, 16), np.nan, np.float32)
    y = ew.embed_rmsnorm(table, tokens, w, eps=1e-5, resid=resid)
    want_resid = ew.embed(table, tokens)
    np.testing.assert_array_equal(resid, want_resid)
    np.testing.assert_array_equal(y, ew.add_rmsnorm(want_resid.copy(), None, w, eps=1e-5))
    status.clear(None)
    ew.embed_rmsnorm(table, np.array([10], np.int32), w)  # out of range: row 0, reported
    assert status.read(None) & status.TOKEN_RANGE
    status.clear(None)


def test_all_entries_prompt_tokens_and_log():
    np.testing.assert_array_equal(ew.all_entries(np.array([0, 2, 5], np.int32), 4),
                                  [[-1, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, 3]])
    prompt = np.arange(12, dtype=np.int32).reshape(2, 6)
    out = np.zeros(2, np.int32)
    ew.prompt_tokens(prompt, np.array([0, 9], np.int32), out)
    np.testing.assert_array_equal(out, [0, 11])  # a position past the prompt keeps its last token
    history, step = np.zeros((3, 2), np.int32), np.zeros(1, np.int32)
    for t in range(4):
        ew.log_tokens(np.array([t, 10 + t], np.int32), history, step)
    assert step[0] == 4
    np.testing.assert_array_equal(history, [[3, 13], [1, 11], [2, 12]])  # a ring of rows


def test_rmsnorm_rope_pair_is_two_single_calls(rng):
    """Two parts in one call: each what `rmsnorm_rope` gives it (a weighted norm without RoPE beside
    a rotated one; rotated query heads beside RoPE-only heads), written into ``outs`` when given."""
    pos = rng.integers(0, 5000, 3).astype(np.int32)
    a, b = (rng.standard_normal((3, 48)) * 2).astype(BF16), rng.standard_normal((3, 32)).astype(BF16)
    wa, wb = rng.uniform(0.5, 2, 48).astype(np.float32), rng.uniform(0.5, 2, 32).astype(np.float32)
    ya, yb = ew.rmsnorm_rope_pair(ew.NormRope(a, wa), ew.NormRope(b, wb, rope_dim=8), pos, eps=1e-5, theta=50.0)
    assert np.array_equal(ya.view(np.uint16), ew.rmsnorm_rope(a, wa, eps=1e-5).view(np.uint16))
    assert np.array_equal(yb.view(np.uint16), ew.rmsnorm_rope(b, wb, pos, eps=1e-5, rope_dim=8, theta=50.0).view(np.uint16))
    q, iq = rng.standard_normal((3, 4, 32)).astype(BF16), rng.standard_normal((3, 2, 16)).astype(BF16)
    outs = (np.empty_like(q), np.empty_like(iq))
    got = ew.rmsnorm_rope_pair(ew.NormRope(q, rope_dim=8), ew.NormRope(iq, normalize=False, rope_dim=8), pos, outs=outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    assert np.array_equal(got[0].view(np.uint16), ew.rmsnorm_rope(q, None, pos, rope_dim=8).view(np.uint16))
    assert np.array_equal(got[1].view(np.uint16), ew.rmsnorm_rope(iq, None, pos, normalize=False, rope_dim=8).view(np.uint16))


@pytest.mark.parametrize("advance", [False, True])
def test_rmsnorm_rope_pair_writes_the_second_part_into_a_window_ring(rng, advance):
    """``window``: the second part's rows land where `KVCache.append` writes a decode token's row
    (slot position % W of each sequence's ring, the other slots untouched), and advancing the
    cache (or ``advance``: the call itself) leaves it where the append would: a decode step without
    its window-append launch."""
    from fp4kit.layers import KVCache

    b, w, d = 3, 5, 32
    a, kv = (rng.standard_normal((b, 48)) * 2).astype(BF16), rng.standard_normal((b, d)).astype(BF16)
    wkv = rng.uniform(0.5, 2, d).astype(np.float32)
    fused, apart = (KVCache(b, window=w, head_dim=d, rope_dim=8, device=False) for _ in range(2))
    for cache in (fused, apart):
        cache.swa[...] = rng.standard_normal(cache.swa.shape).astype(BF16)
        cache.pos[...] = [0, 7, 123]
    apart.swa[...] = fused.swa
    ya, ring = ew.rmsnorm_rope_pair(ew.NormRope(a), ew.NormRope(kv, wkv, rope_dim=8), fused.pos, window=fused.swa,
                                    advance=advance)
    assert ring is fused.swa
    if not advance:
        fused.advance(1)
    ya2, yk = ew.rmsnorm_rope_pair(ew.NormRope(a), ew.NormRope(kv, wkv, rope_dim=8), apart.pos)
    apart.append(yk[:, None, :])
    assert np.array_equal(ya.view(np.uint16), ya2.view(np.uint16))
    assert np.array_equal(fused.swa.view(np.uint16), apart.swa.view(np.uint16))
    assert np.array_equal(fused.pos, apart.pos) and fused.pos.tolist() == [1, 8, 124]
    for row, slot in enumerate([0, 7 % w, 123 % w]):  # the written rows are the normed, rotated latents
        assert np.array_equal(fused.swa[row, slot].view(np.uint16), yk[row].view(np.uint16))


_X8 = np.zeros((2, 8), BF16)
_RING = np.zeros((2, 4, 8), BF16)
_POS2 = np.zeros(2, np.int32)


@pytest.mark.parametrize("call, match", [
    (lambda: ew.rmsnorm_rope_pair((_X8,), ew.NormRope(_X8)), r"first: expected an elementwise.NormRope"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(_X8.astype(np.float32))), "second.x: expected bfloat16"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8, np.ones(4, np.float32)), ew.NormRope(_X8)), r"first.weight: expected float32 \[8\]"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(_X8, rope_dim=4)), r"positions: RoPE \(second.rope_dim > 0\)"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(_X8, rope_dim=3), np.zeros(2, np.int32)), "second.rope_dim: expected an even"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8, rope_dim=2), ew.NormRope(np.zeros((3, 8), BF16), rope_dim=2), np.zeros(2, np.int32)),
     r"positions: expected int32 \[3\] \(the tokens of second.x\)"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(_X8), outs=[_X8]), "outs: expected two arrays"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(_X8), _POS2, window=np.zeros((2, 4, 6), BF16)),
     r"window: expected bfloat16 \[2, W, 8\]"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(_X8), _POS2, window=_RING.astype(np.float32)),
     "window: expected bfloat16"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(np.zeros((2, 1, 8), BF16)), _POS2, window=_RING),
     r"second.x: a window takes one row per sequence"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(_X8), window=_RING), "positions: a window ring needs"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(_X8), np.zeros(3, np.int32), window=_RING),
     r"positions: expected int32 \[2\] \(the sequences of the window\)"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(_X8), _POS2, outs=(None, _X8), window=_RING),
     r"outs\[1\]: the second part goes into the window"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8), ew.NormRope(_X8, rope_dim=2), _POS2, advance=True),
     r"advance: moves the positions of a window ring \(window=...\) on, .* got window=None"),
    (lambda: ew.rmsnorm_rope_pair(ew.NormRope(_X8, rope_dim=2), ew.NormRope(_X8), _POS2, window=_RING, advance=True),
     r"advance: .* first.rope_dim=2"),
])
def test_rmsnorm_rope_pair_bad_inputs_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("call, match", [
    (lambda: ew.rmsnorm_rope(np.zeros((2, 8), np.float32)), "x: expected bfloat16"),
    (lambda: ew.rmsnorm_rope(np.zeros((2, 8), BF16), np.ones(4, np.float32)), r"weight: expected float32 \[8\]"),
    (lambda: ew.rmsnorm_rope(np.zeros((2, 8), BF16), rope_dim=4), "positions: RoPE"),
    (lambda: ew.rmsnorm_rope(np.zeros((2, 8), BF16), rope_dim=3), "rope_dim"),
    (lambda: ew.rmsnorm_rope(np.zeros((2, 8), BF16), None, np.zeros(3, np.int32), rope_dim=4), r"positions: expected int32 \[2\]"),
    (lambda: ew.add_rmsnorm(np.zeros((2, 8), BF16), None, np.ones(8, np.float32)), "resid: expected float32"),
    (lambda: ew.add_rmsnorm(np.zeros((2, 8), np.float32), np.zeros((2, 4), BF16), np.ones(8, np.float32)), "delta"),
    (lambda: ew.embed(np.zeros((4, 8), BF16), np.zeros(2, np.int64)), "tokens: expected int32"),
    (lambda: ew.embed_rmsnorm(np.zeros((4, 8), BF16), np.zeros(2, np.int32), np.ones(4, np.float32)),
     r"weight: expected float32 \[8\] \(the table's width\)"),
    (lambda: ew.embed_rmsnorm(np.zeros((4, 8), BF16), np.zeros(2, np.int32), np.ones(8, np.float64)),
     "weight: expected float32"),
    (lambda: ew.all_entries(np.zeros(2, np.int32), 0), "n: expected a positive"),
    (lambda: ew.prompt_tokens(np.zeros((2, 0), np.int32), np.zeros(2, np.int32), np.zeros(2, np.int32)), "prompt"),
    (lambda: ew.log_tokens(np.zeros(2, np.int32), np.zeros((3, 4), np.int32), np.zeros(1, np.int32)), "history"),
])
def test_bad_inputs_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_split_columns_on_numpy_are_contiguous_copies(rng):
    y = rng.standard_normal((3, 40)).astype(BF16)
    parts = ew.split_columns(y, [8, 24, 8])
    assert [p.shape for p in parts] == [(3, 8), (3, 24), (3, 8)]
    assert all(p.flags.c_contiguous for p in parts)
    assert np.array_equal(np.concatenate(parts, axis=1), y)


@pytest.mark.parametrize("y, sizes, message", [
    (np.zeros((2, 8), np.float32), [8], "y: expected a bfloat16 \\[rows, cols\\] array"),
    (np.zeros((2, 2, 8), BF16), [8], "y: expected a bfloat16 \\[rows, cols\\] array"),
    (np.zeros((2, 8), BF16), [4, 5], "sizes: expected 1 to 16 positive widths adding up to y's 8 columns"),
    (np.zeros((2, 8), BF16), [8, 0], "sizes: expected 1 to 16 positive widths"),
    (np.zeros((2, 17), BF16), [1] * 17, "sizes: expected 1 to 16 positive widths"),
])
def test_split_columns_bad_inputs(y, sizes, message):
    with pytest.raises(ValueError, match=message):
        ew.split_columns(y, sizes)
