"""Sparse decode attention on the CPU: the reference on hand cases (one row, sink only, window
wrap-around, ignored indices, duplicates, the sink's share of the normaliser), the op and the
layer on the numpy backend, every bad input getting a clear error, the launch plan, and a model of
the kernel's arithmetic that sizes the GPU tests' bounds."""

import math

import ml_dtypes
import numpy as np
import pytest

from fp4kit.layers.attention import SparseAttention
from fp4kit.ops import attention as ops
from fp4kit.ops.attention import sparse_decode_attention
from fp4kit.reference import attention as ref
from fp4kit.reference import kv_cache as kvref
from fp4kit.reference.gemm import calc_diff
from fp4kit.runtime import loader

BF16 = ml_dtypes.bfloat16
NEG_INF = np.float32(-np.inf)


def case(rng, b=2, hq=3, d=16, w=4, c=8, n=5):
    """Random valid inputs (all positions / lengths in range)."""
    return dict(
        q=rng.standard_normal((b, hq, d)).astype(BF16),
        swa=rng.standard_normal((b, w, d)).astype(BF16),
        pos=rng.integers(0, 2 * w, b).astype(np.int32),
        comp=rng.standard_normal((b, c, d)).astype(BF16),
        comp_len=rng.integers(0, c + 1, b).astype(np.int32),
        indices=rng.integers(-1, c, (b, n)).astype(np.int32),
        sink=rng.uniform(-1, 1, hq).astype(np.float32),
    )


def manual(q, rows, sink, scale):
    """softmax([logits, sink]) without the sink's value, written out for one head."""
    q = np.asarray(q, np.float64)
    rows = np.asarray(rows, np.float64)
    e = np.exp(scale * rows @ q)
    return (e[:, None] * rows).sum(0) / (np.exp(float(sink)) + e.sum())


def one_sequence(q, swa, pos, comp, comp_len, indices, sink, scale=None):
    """The reference for a single sequence given as unbatched arrays."""
    return ref.sparse_decode_attention(
        np.asarray(q, BF16)[None], np.asarray(swa, BF16)[None], np.array([pos], np.int32),
        np.asarray(comp, BF16)[None], np.array([comp_len], np.int32), np.asarray(indices, np.int32)[None],
        np.asarray(sink, np.float32), scale)[0]


# ---- the reference on hand cases


def test_one_valid_row_gives_that_row():
    q = np.ones((2, 16), BF16)
    swa = np.arange(4 * 16).reshape(4, 16).astype(BF16) / 64
    comp = np.full((8, 16), 100, BF16)
    # only window slot 0 is valid: pos 1; index -1 is padding and 5 is beyond comp_len 3
    o = one_sequence(q, swa, 1, comp, 3, [-1, 5], np.full(2, -np.inf, np.float32))
    assert np.array_equal(o, np.broadcast_to(swa[0].astype(np.float64), (2, 16)))
    # the same row reached through the compressed cache
    o = one_sequence(q, swa, 0, swa, 4, [-1, 2, -1], np.full(2, -np.inf, np.float32))
    assert np.array_equal(o, np.broadcast_to(swa[2].astype(np.float64), (2, 16)))


def test_one_row_with_a_sink_is_scaled_by_its_probability():
    q = np.zeros((1, 16), BF16)
    q[0, 0] = 2
    row = np.zeros((1, 16), BF16)
    row[0, :2] = [1.5, -3]
    sink = np.array([0.25], np.float32)
    o = one_sequence(q, row, 1, np.zeros((1, 16), BF16), 0, [-1], sink, scale=1.0)
    logit = 2 * 1.5
    assert np.allclose(o[0], row[0].astype(np.float64) * np.exp(logit) / (np.exp(logit) + np.exp(0.25)), rtol=1e-15)


@pytest.mark.parametrize("sink", [0.0, 7.5, -np.inf])
def test_no_valid_row_gives_zero(rng, sink):
    args = case(rng, b=3)
    args["pos"][:] = [0, -4, 0]  # a negative position counts as 0
    args["comp_len"][:] = [5, 0, -1]
    args["indices"][0] = -1  # sequence 0: a live compressed cache but nothing selected
    args["sink"][:] = sink
    o = ref.sparse_decode_attention(**args)
    assert np.array_equal(o, np.zeros_like(o))


def test_window_wraps_around(rng):
    w, d = 4, 16
    q = rng.standard_normal((2, d)).astype(BF16)
    swa = rng.standard_normal((w, d)).astype(BF16)
    comp = np.zeros((1, d), BF16)
    sink = np.array([0.5, -1.0], np.float32)
    scale = d**-0.5
    for pos, slots in [(1, [0]), (3, [0, 1, 2]), (4, [0, 1, 2, 3]), (6, [0, 1, 2, 3]), (10**9, [0, 1, 2, 3])]:
        o = one_sequence(q, swa, pos, comp, 0, [-1], sink)
        want = np.stack([manual(q[h], swa[slots], sink[h], scale) for h in range(2)])
        assert np.allclose(o, want, rtol=1e-12, atol=0), pos
    # slots at or beyond pos are not read before the ring has wrapped: their contents do not matter
    poisoned = swa.copy()
    poisoned[2:] = np.nan
    assert np.array_equal(one_sequence(q, poisoned, 2, comp, 0, [-1], sink), one_sequence(q, swa, 2, comp, 0, [-1], sink))


def test_invalid_indices_are_ignored(rng):
    d, c = 16, 8
    q = rng.standard_normal((2, d)).astype(BF16)
    comp = rng.standard_normal((c, d)).astype(BF16)
    swa = np.zeros((1, d), BF16)
    sink = np.array([0.0, 1.0], np.float32)
    scale = d**-0.5
    indices = [-1, 2, 7, 9, -5, 8]
    # comp_len 8: entries 2 and 7 are live; 9 and 8 are beyond the live length, -1 / -5 are padding
    want = np.stack([manual(q[h], comp[[2, 7]], sink[h], scale) for h in range(2)])
    assert np.allclose(one_sequence(q, swa, 0, comp, 8, indices, sink), want, rtol=1e-12, atol=0)
    # comp_len 7: entry 7 is not live yet
    want = np.stack([manual(q[h], comp[[2]], sink[h], scale) for h in range(2)])
    assert np.allclose(one_sequence(q, swa, 0, comp, 7, indices, sink), want, rtol=1e-12, atol=0)
    # a comp_len beyond the capacity is clamped to it: index 8 / 9 stay ignored (no out-of-bounds read)
    want = np.stack([manual(q[h], comp[[2, 7]], sink[h], scale) for h in range(2)])
    assert np.allclose(one_sequence(q, swa, 0, comp, 100, indices, sink), want, rtol=1e-12, atol=0)


def test_duplicate_indices_count_twice(rng):
    d = 16
    q = rng.standard_normal((1, d)).astype(BF16)
    comp = rng.standard_normal((4, d)).astype(BF16)
    sink = np.array([0.3], np.float32)
    scale = d**-0.5
    o = one_sequence(q, np.zeros((1, d), BF16), 0, comp, 4, [3, 1, 3], sink)
    assert np.allclose(o[0], manual(q[0], comp[[3, 1, 3]], sink[0], scale), rtol=1e-12, atol=0)
    assert not np.allclose(o[0], manual(q[0], comp[[3, 1]], sink[0], scale), rtol=1e-6, atol=0)


def test_sink_takes_its_share_of_the_normaliser():
    # logits 1 and 2 (q picks coordinate 0, scale 1); the sink adds e^s to the denominator only
    q = np.zeros((3, 16), BF16)
    q[:, 0] = 1
    rows = np.zeros((2, 16), BF16)
    rows[:, 0] = [1, 2]
    rows[:, 1] = [5, -7]
    sink = np.array([-np.inf, 0.0, 3.0], np.float32)
    o = one_sequence(q, rows, 2, np.zeros((1, 16), BF16), 0, [-1], sink, scale=1.0)
    for h, s in enumerate([-np.inf, 0.0, 3.0]):
        p = np.exp([1.0, 2.0]) / (np.exp(s) + np.exp(1.0) + np.exp(2.0))
        assert np.allclose(o[h, :2], [p @ [1, 2], p @ [5, -7]], rtol=1e-14), s
        assert np.array_equal(o[h, 2:], np.zeros(14))
    # a large sink leaves almost nothing; the weights never depend on the order of the rows
    assert np.abs(one_sequence(q, rows, 2, rows, 0, [-1], np.full(3, 60, np.float32), scale=1.0)).max() < 1e-20
    swapped = one_sequence(q, rows[::-1], 2, rows, 0, [-1], sink, scale=1.0)
    assert np.allclose(swapped, o, rtol=1e-14)


def test_window_and_entries_share_one_softmax(rng):
    d = 32
    q = rng.standard_normal((4, d)).astype(BF16)
    swa = rng.standard_normal((5, d)).astype(BF16)
    comp = rng.standard_normal((6, d)).astype(BF16)
    sink = rng.uniform(-1, 1, 4).astype(np.float32)
    o = one_sequence(q, swa, 7, comp, 6, [4, -1, 0, 5], sink, scale=0.3)
    rows = np.concatenate([swa, comp[[4, 0, 5]]])
    assert np.allclose(o, np.stack([manual(q[h], rows, sink[h], 0.3) for h in range(4)]), rtol=1e-12)


def test_default_scale_is_inverse_sqrt_head_dim(rng):
    args = case(rng, d=64)
    assert ref.default_scale(64) == 0.125
    assert np.array_equal(ref.sparse_decode_attention(**args), ref.sparse_decode_attention(**args, scale=0.125))


# ---- the op and the layer on the numpy backend


def test_op_runs_the_reference_and_writes_out(rng):
    args = case(rng, b=3, hq=5, d=48, w=6, c=9, n=7)
    want = ref.sparse_decode_attention(**args)
    got = sparse_decode_attention(**args)
    assert got.dtype == BF16 and got.shape == (3, 5, 48)
    assert np.array_equal(got, want.astype(BF16))
    got32 = sparse_decode_attention(**args, out_dtype=np.float32)
    assert got32.dtype == np.float32 and np.array_equal(got32, want.astype(np.float32))
    out = np.full((3, 5, 48), np.nan, np.float32)
    assert sparse_decode_attention(**args, out=out) is out and np.array_equal(out, got32)
    assert np.array_equal(sparse_decode_attention(**args, scale=0.5), ref.sparse_decode_attention(**args, scale=0.5).astype(BF16))


def test_layer_on_the_numpy_backend(rng):
    args = case(rng, b=2, hq=4, d=32)
    sink = args.pop("sink")
    layer = SparseAttention(4, 32, sink=sink)
    want = ref.sparse_decode_attention(**args, sink=sink).astype(BF16)
    assert np.array_equal(layer(**args), want)
    assert layer.scale == 32**-0.5 and np.array_equal(layer.sink, sink)
    layer = SparseAttention(4, 32, scale=0.2, out_dtype=np.float32)  # default sink: zeros
    got = layer(**args)
    assert got.dtype == np.float32
    assert np.array_equal(got, ref.sparse_decode_attention(**args, sink=np.zeros(4, np.float32), scale=0.2).astype(np.float32))
    with pytest.raises(ValueError, match=r"q: expected \[B, heads=4, head_dim=32\]"):
        layer(args["q"][:, :3], *list(args.values())[1:])
    with pytest.raises(ValueError, match=r"sink: expected float32 \[heads=4\]"):
        layer.sink = np.zeros(5, np.float32)


def test_indices_none_is_every_live_entry(rng):
    """``indices=None``: every live compressed entry, as the list 0 .. C-1 selects them (decode, the
    layer and prefill; N = C in the launch plan)."""
    args = case(rng, b=3, hq=4, d=32, w=4, c=9)
    args["comp_len"][:] = [0, 5, 20]  # none, some, beyond the capacity (clamped)
    every = np.broadcast_to(np.arange(9, dtype=np.int32), (3, 9)).copy()
    want = sparse_decode_attention(**dict(args, indices=every), out_dtype=np.float32)
    assert np.array_equal(sparse_decode_attention(**dict(args, indices=None), out_dtype=np.float32), want)
    sink = args.pop("sink")
    layer = SparseAttention(4, 32, sink=sink)
    assert np.array_equal(layer(**dict(args, indices=None)), layer(**dict(args, indices=every)))
    with pytest.raises(ValueError, match=r"num_splits: expected 1 <= num_splits <= 13 for W \+ N = 13 candidates"):
        sparse_decode_attention(**dict(args, indices=None, sink=sink), num_splits=14)
    a = _prefill_inputs(rng)
    every = np.broadcast_to(np.arange(8, dtype=np.int32), (23, 8)).copy()
    got, want = (ops.sparse_prefill_attention(a["q"], a["kv"], a["start"], 4, a["comp"], a["comp_len"], i, a["sink"],
                                              out_dtype=np.float32) for i in (None, every))
    assert np.array_equal(got, want)


def _good(**over):
    rng = np.random.default_rng(0)
    args = case(rng, b=2, hq=3, d=16, w=4, c=8, n=5)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, kwargs, exc, message",
    [
        (dict(q=np.zeros((2, 3, 16), np.float32)), {}, TypeError, r"q: expected dtype bfloat16 \[B, Hq, D\], got shape \(2, 3, 16\), dtype float32"),
        (dict(q=np.zeros((3, 16), BF16)), {}, ValueError, r"q: expected bfloat16 \[B, Hq, D\]"),
        (dict(q=np.zeros((2, 3, 24), BF16)), {}, ValueError, r"q: head dimension D must be a multiple of 16 in \[16, 512\]"),
        (dict(q=np.zeros((2, 3, 528), BF16)), {}, ValueError, "q: head dimension D must be a multiple of 16"),
        (dict(q=np.zeros((2, 3, 0), BF16)), {}, ValueError, "q: head dimension D must be a multiple of 16"),
        (dict(q=np.zeros((65536, 3, 16), BF16)), {}, ValueError, "q: at most 65535 sequences per call"),
        (dict(q=np.zeros((2, 6, 16), BF16)[:, ::2]), {}, ValueError, "q: expected a C-contiguous array"),
        (dict(q=[[[1.0] * 16]]), {}, TypeError, "q: expected a numpy, CuPy or DLPack array, got list"),
        (dict(swa=np.zeros((2, 4, 16), np.float16)), {}, TypeError, r"swa: expected dtype bfloat16 \[B=2, W, D=16\]"),
        (dict(swa=np.zeros((2, 4, 32), BF16)), {}, ValueError, r"swa: expected bfloat16 \[B=2, W, D=16\], got shape \(2, 4, 32\)"),
        (dict(swa=np.zeros((1, 4, 16), BF16)), {}, ValueError, r"swa: expected bfloat16 \[B=2, W, D=16\]"),
        (dict(swa=np.zeros((2, 8, 16), BF16)[:, ::2]), {}, ValueError, "swa: expected a C-contiguous array"),
        (dict(pos=np.zeros(2, np.int64)), {}, TypeError, r"pos: expected dtype int32 \[B=2\], got shape \(2,\), dtype int64"),
        (dict(pos=np.zeros((2, 1), np.int32)), {}, ValueError, r"pos: expected int32 \[B=2\]"),
        (dict(pos=np.zeros(3, np.int32)), {}, ValueError, r"pos: expected int32 \[B=2\]"),
        (dict(comp=np.zeros((2, 8, 16), np.float32)), {}, TypeError, r"comp: expected dtype bfloat16 \[B=2, C, D=16\]"),
        (dict(comp=np.zeros((2, 8, 48), BF16)), {}, ValueError, r"comp: expected bfloat16 \[B=2, C, D=16\]"),
        (dict(comp=np.zeros((2, 8, 16), BF16).transpose(1, 0, 2)), {}, ValueError, r"comp: expected bfloat16 \[B=2, C, D=16\]"),
        (dict(comp_len=np.zeros(2, np.uint32)), {}, TypeError, r"comp_len: expected dtype int32 \[B=2\]"),
        (dict(comp_len=np.zeros(1, np.int32)), {}, ValueError, r"comp_len: expected int32 \[B=2\]"),
        (dict(indices=np.zeros((2, 5), np.int64)), {}, TypeError, r"indices: expected dtype int32 \[B=2, N\]"),
        (dict(indices=np.zeros(5, np.int32)), {}, ValueError, r"indices: expected int32 \[B=2, N\]"),
        (dict(indices=np.zeros((5, 2), np.int32).T), {}, ValueError, "indices: expected a C-contiguous array"),
        (dict(sink=np.zeros(3, np.float64)), {}, TypeError, r"sink: expected dtype float32 \[Hq=3\]"),
        (dict(sink=np.zeros(4, np.float32)), {}, ValueError, r"sink: expected float32 \[Hq=3\], got shape \(4,\)"),
        (dict(sink=np.float32(0)), {}, TypeError, "sink: expected a numpy, CuPy or DLPack array"),
        ({}, dict(scale=0.0), ValueError, "scale: expected a positive finite number, got 0.0"),
        ({}, dict(scale=float("nan")), ValueError, "scale: expected a positive finite number"),
        ({}, dict(scale=-1), ValueError, "scale: expected a positive finite number"),
        ({}, dict(scale=True), TypeError, "scale: expected a positive finite Python or numpy number"),
        ({}, dict(scale=np.ones(1)), TypeError, "scale: expected a positive finite Python or numpy number"),
        ({}, dict(out=np.zeros((2, 3, 16), np.float16)), ValueError, "out: expected dtype bfloat16 or float32, got float16"),
        ({}, dict(out=np.zeros((2, 3, 32), BF16)), ValueError, r"out: expected shape \(2, 3, 16\) and dtype bfloat16"),
        ({}, dict(out=np.zeros((2, 3, 16), np.float32), out_dtype=BF16), ValueError, "out: expected dtype bfloat16 .out_dtype., got float32"),
        ({}, dict(out=[0.0]), TypeError, "out: expected a numpy or CuPy array, got list"),
        ({}, dict(out_dtype=np.float16), TypeError, "out_dtype: expected bfloat16 or float32, got float16"),
        ({}, dict(num_splits=0), ValueError, r"num_splits: expected 1 <= num_splits <= 9 for W \+ N = 9 candidates"),
        ({}, dict(num_splits=10), ValueError, "num_splits: expected 1 <= num_splits <= 9"),
        ({}, dict(num_splits=2.0), TypeError, "num_splits: expected a positive int or None, got float"),
        ({}, dict(workspace=np.zeros(4, np.float64)), ValueError, "workspace: expected a 1-D float32 array"),
    ],
)
def test_bad_input_gets_a_clear_error(over, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        sparse_decode_attention(**_good(**over), **kwargs)


def test_too_few_splits_for_many_candidates_is_an_error():
    args = _good(indices=np.full((2, 5000), -1, np.int32))
    with pytest.raises(ValueError, match=r"num_splits: expected 3 <= num_splits <= 5004 .* at most 2048"):
        sparse_decode_attention(**args, num_splits=2)
    assert np.array_equal(sparse_decode_attention(**args, num_splits=3), sparse_decode_attention(**args))


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(heads=0, head_dim=512), ValueError, "heads: expected a positive int, got 0"),
        (dict(heads=64, head_dim=520), ValueError, "head_dim: expected a multiple of 16 up to 512, got 520"),
        (dict(heads=64, head_dim=1024), ValueError, "head_dim: expected a multiple of 16 up to 512"),
        (dict(heads=64.0, head_dim=512), ValueError, "heads: expected a positive int"),
        (dict(heads=64, head_dim=512, scale=-0.1), ValueError, "scale: expected a positive finite number"),
        (dict(heads=64, head_dim=512, sink=np.zeros(64, np.float64)), ValueError, r"sink: expected float32 \[heads=64\]"),
        (dict(heads=64, head_dim=512, out_dtype=np.float16), TypeError, "out_dtype: expected bfloat16 or float32"),
    ],
)
def test_layer_bad_configuration(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        SparseAttention(**kwargs)


def test_empty_inputs_are_valid():
    args = _good(swa=np.zeros((2, 0, 16), BF16), indices=np.zeros((2, 0), np.int32), comp=np.zeros((2, 0, 16), BF16))
    assert np.array_equal(sparse_decode_attention(**args), np.zeros((2, 3, 16), BF16))
    args = _good(q=np.zeros((0, 3, 16), BF16), swa=np.zeros((0, 4, 16), BF16), pos=np.zeros(0, np.int32),
                 comp=np.zeros((0, 8, 16), BF16), comp_len=np.zeros(0, np.int32), indices=np.zeros((0, 5), np.int32))
    assert sparse_decode_attention(**args).shape == (0, 3, 16)


# ---- the launch plan


def test_launch_plan(monkeypatch):
    # V4-Flash decode on an H200 (132 SMs): 64 heads, 128 window slots + 512 selected entries
    assert ops.default_num_splits(32, 64, 640, 132) == 1  # 128 blocks already fill the GPU
    assert ops.default_num_splits(1, 64, 640, 132) == 12  # 20 tiles, at most MAX_DEFAULT_SPLITS splits
    assert ops.default_num_splits(3, 64, 640, 132) == 11  # one wave of 12 blocks per split
    assert ops.default_num_splits(8, 64, 640, 132) == 4  # one wave of 32 blocks
    assert ops.default_num_splits(1, 64, 384, 132) == 12  # one 32-row tile per split
    # 5 and 6 tiles: raised to the spread merge's 8 splits, while one wave holds them
    assert ops.default_num_splits(1, 64, 129, 132) == 8
    assert ops.default_num_splits(4, 64, 192, 132) == 8
    assert ops.default_num_splits(8, 64, 192, 132) == 4  # 8 splits of 32 blocks: more than one wave
    assert ops.default_num_splits(1, 64, 127, 132) == 4  # fewer than 16 rows per split: not raised
    monkeypatch.setattr(ops, "RAISE_TO_SPREAD", False)
    assert ops.default_num_splits(1, 64, 129, 132) == 5
    assert ops.default_num_splits(1, 64, 192, 132) == 6
    monkeypatch.undo()
    assert ops.default_num_splits(1, 64, 31, 132) == 1
    assert ops.default_num_splits(1, 64, 0, 132) == 1
    assert ops.default_num_splits(64, 64, 128 + 8192, 132) == 5  # a block compacts at most 2048 candidates
    assert ops.workspace_size(1, 64, 512, 10) == 10 * 64 * 514 and ops.workspace_size(32, 64, 512, 1) == 0
    # two blocks per SM fit the H200's 228 KB of shared memory at D = 512; the largest split fits one
    assert 2 * (ops.smem_bytes(512, 640) + 1024) <= 228 * 1024
    assert ops.smem_bytes(512, ops.MAX_CANDIDATES_PER_SPLIT) <= 227 * 1024


def test_spread_merge_rule(monkeypatch):
    """Every split merges a share from SPREAD_MIN_SPLITS splits on grids of at most one block per
    SM (waiting blocks need the whole grid resident; the kernel fits two per SM)."""
    assert ops.spreads_merge((10, 4, 1), 132)  # batch 1 of the decode step: 40 blocks
    assert ops.spreads_merge((8, 4, 4), 132)  # 128 blocks
    assert not ops.spreads_merge((4, 4, 8), 132)  # 4 splits: the last block reads only four partials
    assert not ops.spreads_merge((10, 4, 4), 132)  # 160 blocks: more than one per SM
    assert not ops.spreads_merge((10, 4, 1), 32)
    monkeypatch.setattr(ops, "SPREAD_MERGE", False)
    assert not ops.spreads_merge((10, 4, 1), 132)
    # two blocks per SM at the largest split and head dimension: registers (launch bounds) and shared memory
    assert "__launch_bounds__(kThreads, 2)\nsparse_decode_attention" in loader.kernel_source("attention")
    assert 2 * (ops.smem_bytes(ops.MAX_HEAD_DIM, ops.MAX_CANDIDATES_PER_SPLIT) + 1040) <= 228 * 1024


def test_shared_memory_formula_matches_the_kernel_source():
    """The host mirrors attn_smem_bytes of attention.cu; check the constants it is built from."""
    from fp4kit.runtime import loader

    src = loader.kernel_source("attention")
    for name, value in [("kThreads", ops._THREADS), ("kHeads", ops.HEADS_PER_BLOCK), ("kTileRows", ops._TILE_ROWS),
                        ("kCombineThreads", ops._COMBINE_THREADS)]:
        assert f"constexpr int {name} = {value};" in src, name
    assert "constexpr int kScoreLd = kTileRows + 8;" in src and "constexpr int kProbLd = kTileRows + 8;" in src
    assert "D <= 8 * 4 * 16 = 512" in src and ops.MAX_HEAD_DIM == 512
    body = src[src.index("attn_smem_bytes(unsigned D, unsigned chunk) {"):]
    body = body[: body.index("}")]
    terms = ["2u * kTileRows * (D + 8u) * 2u", "kWarps * kHeads * kScoreLd * 4u", "kHeads * kProbLd * 2u",
             "kHeads * 4u", "kWarps * 4u", "chunk * 4u"]
    assert all(t in body for t in terms) and body.count("+") == len(terms) - 1 + body.count("(D + 8u)")


# ---- a model of the kernel's arithmetic: sizes the GPU bounds (tests/test_attention_gpu.py)


def kernel_model(q, swa, pos, comp, comp_len, indices, sink, scale, splits, out_dtype):
    """The kernel's arithmetic in numpy: candidates compacted in order per split, 32-row tiles, fp32
    scores, online softmax in the log2 domain, probabilities rounded to bf16 (and summed rounded),
    fp32 accumulation, splits merged with the sink. Summation order inside a tile differs."""
    f32 = np.float32
    batch, heads, d = q.shape
    w, c, n = swa.shape[1], comp.shape[1], indices.shape[1]
    chunk = -(-(w + n) // splits)
    scale_log2 = f32(scale * math.log2(math.e))
    out = np.zeros(q.shape, f32)
    for b in range(batch):
        qb = q[b].astype(f32)
        live_w, live_c = min(max(int(pos[b]), 0), w), min(max(int(comp_len[b]), 0), c)
        parts = []
        for s in range(splits):
            begin, end = min(s * chunk, w + n), min((s + 1) * chunk, w + n)
            slots = np.arange(begin, min(end, w))
            entries = indices[b, max(begin - w, 0): max(end - w, 0)]
            rows = np.concatenate([swa[b, slots[slots < live_w]], comp[b, entries[(entries >= 0) & (entries < live_c)]]])
            rows = rows.astype(f32)
            m, l, o = np.full(heads, -np.inf, f32), np.zeros(heads, f32), np.zeros((heads, d), f32)
            for t in range(0, len(rows), 32):
                k = rows[t: t + 32]
                x = (qb @ k.T).astype(f32) * scale_log2
                m_new = np.maximum(m, x.max(1))
                alpha = np.exp2(m - m_new).astype(f32)
                p = np.exp2(x - m_new[:, None]).astype(BF16).astype(f32)
                l = (l * alpha + p.sum(1, dtype=f32)).astype(f32)
                o = (o * alpha[:, None] + p @ k).astype(f32)
                m = m_new
            parts.append((m, l, o))
        s2 = sink.astype(f32) * f32(math.log2(math.e))
        big = np.maximum(np.max([p[0] for p in parts], axis=0), s2)
        empty = big == -np.inf  # no row and no sink: 0
        big = np.where(empty, f32(0), big)
        total = np.exp2(s2 - big) + sum(p[1] * np.exp2(p[0] - big) for p in parts)
        with np.errstate(invalid="ignore", divide="ignore"):
            merged = sum(np.exp2(p[0] - big)[:, None] / total[:, None] * p[2] for p in parts)
        out[b] = np.where(empty[:, None], f32(0), merged)
    return out.astype(out_dtype)


@pytest.mark.parametrize("q_scale", [1.0, 4.0, 12.0])
def test_kernel_arithmetic_model_is_within_the_gpu_bounds(rng, q_scale):
    b, hq, d, w, n, c = 2, 64, 512, 128, 512, 1024
    q = (rng.standard_normal((b, hq, d)) * q_scale).astype(BF16)
    swa = rng.standard_normal((b, w, d)).astype(BF16)
    comp = rng.standard_normal((b, c, d)).astype(BF16)
    pos = np.array([w + 77, 40], np.int32)
    comp_len = np.array([c, 300], np.int32)
    indices = rng.integers(0, c, (b, n)).astype(np.int32)
    indices[rng.random((b, n)) < 0.1] = -1
    sink = rng.uniform(-2, 4, hq).astype(np.float32)
    want = ref.sparse_decode_attention(q, swa, pos, comp, comp_len, indices, sink)
    row_max = np.maximum(np.abs(swa.astype(np.float64)).max(axis=(1, 2)), np.abs(comp.astype(np.float64)).max(axis=(1, 2)))
    for splits in (1, 10):
        for dtype in (BF16, np.float32):
            got = kernel_model(q, swa, pos, comp, comp_len, indices, sink, d**-0.5, splits, dtype).astype(np.float64)
            assert calc_diff(got, want) < 1e-5  # measured: about 2e-6 (bf16 out), 1e-6 (fp32 out)
            # bf16 output: half an ulp (2^-8 relative); bf16 probabilities: 2^-9 relative per weight
            assert np.all(np.abs(got - want) <= 2.0**-8 * (np.abs(want) + row_max[:, None, None]))


@pytest.mark.parametrize("window", [1, 4, 16])
def test_prefill_attention_is_token_by_token_decoding(rng, window):
    """The batched-prompt specification gives each query what the decode reference gives it after
    the tokens up to it were appended to the ring one by one (the window wraps, entries complete
    as the prompt advances, selections differ per query)."""
    t, heads, d, cap, start = 23, 3, 16, 8, 5
    kv = rng.standard_normal((start + t, d)).astype(BF16)
    q = rng.standard_normal((t, heads, d)).astype(BF16)
    comp = rng.standard_normal((cap, d)).astype(BF16)
    sink = rng.standard_normal(heads).astype(np.float32)
    comp_len = np.minimum((start + np.arange(t) + 1) // 4, cap)  # ratio 4: an entry per 4 tokens
    indices = rng.integers(-1, cap + 2, (t, 5))
    got = ref.prefill_attention(q, kv, start, window, comp, comp_len, indices, sink)
    swa = np.zeros((1, window, d), BF16)
    for i in range(start + t):
        kvref.append_swa(swa, np.array([i]), kv[None, i:i + 1])
        if i >= start:
            j = i - start
            want = ref.sparse_decode_attention(q[None, j], swa, np.array([i + 1]), comp[None], comp_len[None, j],
                                               indices[None, j], sink)
            np.testing.assert_allclose(got[j], want[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="kv: expected at least start \\+ T = 28 rows, got 27"):
        ref.prefill_attention(q, kv[:-1], start, window, comp, comp_len, indices, sink)


def _prefill_inputs(rng, t=23, heads=3, d=16, cap=8, start=5, n=5):
    return dict(q=rng.standard_normal((t, heads, d)).astype(BF16), kv=rng.standard_normal((start + t, d)).astype(BF16),
                start=np.array([start], np.int32), comp=rng.standard_normal((cap, d)).astype(BF16),
                comp_len=np.minimum((start + np.arange(t) + 1) // 4, cap).astype(np.int32),
                indices=rng.integers(-1, cap + 2, (t, n)).astype(np.int32),
                sink=rng.standard_normal(heads).astype(np.float32))


def test_prefill_op_runs_the_reference_and_writes_out(rng):
    a = _prefill_inputs(rng)
    want = ref.prefill_attention(a["q"], a["kv"], 5, 4, a["comp"], a["comp_len"], a["indices"], a["sink"])
    out = np.full(a["q"].shape, np.nan, np.float32)
    got = ops.sparse_prefill_attention(a["q"], a["kv"], a["start"], 4, a["comp"], a["comp_len"], a["indices"],
                                       a["sink"], out=out)
    assert got is out and np.array_equal(out, want.astype(np.float32))


@pytest.mark.parametrize("change, exc, message", [
    (dict(q=np.zeros((2, 16), BF16)), ValueError, r"q: expected bfloat16 \[T, Hq, D\]"),
    (dict(kv=np.zeros((28, 32), BF16)), ValueError, r"kv: expected bfloat16 \[L, D=16\]"),
    (dict(start=np.array(5, np.int32)), ValueError, r"start: expected int32 \[1\]"),
    (dict(start=np.array([5], np.int64)), TypeError, r"start: expected dtype int32"),
    (dict(start=np.array([-1], np.int32)), ValueError, "start: expected a non-negative position, got -1"),
    (dict(window=0), ValueError, "window: expected a positive int"),
    (dict(comp_len=np.zeros(3, np.int32)), ValueError, r"comp_len: expected int32 \[T=23\]"),
    (dict(indices=np.zeros((22, 5), np.int32)), ValueError, r"indices: expected int32 \[T=23, N\]"),
    (dict(kv=np.zeros((27, 16), BF16)), ValueError, r"kv: expected at least start \+ T = 28 rows, got 27"),
])
def test_prefill_bad_input_gets_a_clear_error(rng, change, exc, message):
    a = {**_prefill_inputs(rng), "window": 4, **change}
    with pytest.raises(exc, match=message):
        ops.sparse_prefill_attention(a["q"], a["kv"], a["start"], a["window"], a["comp"], a["comp_len"],
                                     a["indices"], a["sink"])


# -- the query's RMSNorm + RoPE in the attention call (QueryNorm) -------------------------------------

def test_query_norm_is_rmsnorm_rope_of_the_raw_query_first(rng):
    """``query_norm``: the raw projection ``q`` is normed and rotated at ``positions + offset`` by
    `fp4kit.ops.elementwise.rmsnorm_rope` before the attention (numpy: literally that)."""
    from fp4kit.ops import elementwise as ew

    args = case(rng, b=3, hq=4, d=32)
    positions = np.array([5, 0, 1000], np.int32)
    raw = (args["q"].astype(np.float32) * 7).astype(BF16)
    normed = ew.rmsnorm_rope(raw, None, positions - 1, eps=1e-5, rope_dim=8, theta=500.0)
    want = sparse_decode_attention(**{**args, "q": normed})
    got = sparse_decode_attention(**{**args, "q": raw},
                                  query_norm=ops.QueryNorm(positions, 1e-5, 8, 500.0, offset=-1))
    assert np.array_equal(got, want)
    assert not np.array_equal(sparse_decode_attention(**{**args, "q": raw}), want)


@pytest.mark.parametrize("norm, exc, message", [
    ("a tuple", TypeError, "query_norm: expected a fp4kit.ops.attention.QueryNorm"),
    (dict(positions=np.zeros(3, np.int32)), ValueError, r"query_norm.positions"),
    (dict(positions=np.zeros(2, np.int64)), TypeError, r"query_norm.positions"),
    (dict(rope_dim=7), ValueError, r"query_norm.rope_dim: expected an even number in \[0, 16\]"),
    (dict(rope_dim=18), ValueError, r"query_norm.rope_dim: expected an even number in \[0, 16\]"),
    (dict(offset=0.5), ValueError, "query_norm.offset: expected a small integer"),
    (dict(offset=True), ValueError, "query_norm.offset: expected a small integer"),
    (dict(positions=np.zeros((2, 1), np.int32)), ValueError, r"query_norm.positions: expected int32 \[2\]"),
])
def test_bad_query_norm(rng, norm, exc, message):
    args = case(rng, b=2, hq=3, d=16)
    query_norm = (np.zeros(2, np.int32),) if norm == "a tuple" else ops.QueryNorm(
        **{"positions": np.zeros(2, np.int32), "rope_dim": 4, **norm})
    with pytest.raises(exc, match=message):
        sparse_decode_attention(**args, query_norm=query_norm)
