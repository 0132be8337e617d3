"""The lightning indexer on the numpy backend: the reference on hand-computed cases (ties, lengths
below, at and above k, -1 padding, NaN, infinities and signed zeros), the op and the layer
against it, the status word, and every bad input getting a clear error before anything runs.
(The kernels compile for sm_90a and sm_100a in tests/test_compile.py.)"""

import re

import ml_dtypes
import numpy as np
import pytest

from fp4kit.layers.indexer import Indexer
from fp4kit.ops import indexer as ops
from fp4kit.reference import indexer as ref
from fp4kit.runtime import loader, status

BF16 = ml_dtypes.bfloat16
INF = np.float32(np.inf)


def host_flags() -> int:
    return status.read(device=-1)  # the host word only


def exact_inputs(rng, bsz, heads, dim, capacity):
    """Small integers and weights m/16: every score is exact in fp32 in any summation order."""
    q = rng.integers(-4, 5, (bsz, heads, dim), dtype=np.int8).astype(BF16)
    keys = rng.integers(-4, 5, (bsz, capacity, dim), dtype=np.int8).astype(BF16)
    w = (rng.integers(-8, 9, (bsz, heads)) / 16).astype(np.float32)
    return q, w, keys


# ---- reference: scores


def test_scores_hand_computed():
    q = np.array([[[1, 2], [1, -1]]], BF16)  # B=1, H=2, D=2
    keys = np.array([[[1, 1], [2, -1], [-1, -1], [3, 0]]], BF16)
    # head 0 dots [3, 0, -3, 3] -> ReLU [3, 0, 0, 3]; head 1 dots [0, 3, 0, 3] -> [0, 3, 0, 3]
    s = ref.scores(q, np.array([[0.5, 2.0]], np.float32), keys, np.array([4]))
    assert s.dtype == np.float32 and s.shape == (1, 4)
    assert s.tolist() == [[1.5, 6.0, 0.0, 7.5]]
    s = ref.scores(q, np.array([[-1.0, 1.0]], np.float32), keys, np.array([3]))
    assert s.tolist() == [[-3.0, 3.0, 0.0, -INF]]  # negative weights; past the live length: -inf


def test_scores_relu_keeps_nan_and_lengths_are_clamped():
    q = np.array([[[1, 1]], [[1, 1]]], BF16)
    keys = np.array([[[np.nan, 0], [1, 1]], [[-1, -1], [2, 2]]], BF16)
    s = ref.scores(q, np.ones((2, 1), np.float32), keys, np.array([-3, 7]))
    assert s[0].tolist() == [-INF, -INF]  # length -3 -> 0
    assert s[1].tolist() == [0.0, 4.0]  # length 7 -> capacity 2
    s = ref.scores(q, np.ones((2, 1), np.float32), keys, np.array([2, 2]))
    assert np.isnan(s[0, 0]) and s[0, 1] == 2  # a NaN dot product is not ReLU'd away
    assert ref.has_nan(s, [2, 2]) and not ref.has_nan(s, [0, 2])
    assert ref.lengths_out_of_range([-1, 2], 2) and ref.lengths_out_of_range([3], 2)
    assert not ref.lengths_out_of_range([0, 2], 2)


def test_scores_float64_then_one_rounding(rng):
    q = rng.standard_normal((2, 8, 32)).astype(BF16)
    keys = rng.standard_normal((2, 50, 32)).astype(BF16)
    w = rng.standard_normal((2, 8)).astype(np.float32)
    dots = np.einsum("bhd,btd->bht", q.astype(np.float64), keys.astype(np.float64))
    want = (w.astype(np.float64)[:, :, None] * np.maximum(dots, 0)).sum(1).astype(np.float32)
    assert ref.scores(q, w, keys, [50, 50]).tobytes() == want.tobytes()


# ---- reference: top-k


def test_topk_ties_take_the_lower_index():
    s = np.array([[5, 1, 5, 3, 5]], np.float32)
    idx, val = ref.topk(s, [5], 2)
    assert idx.tolist() == [[0, 2]] and val.tolist() == [[5, 5]]
    idx, val = ref.topk(s, [5], 4)
    assert idx.tolist() == [[0, 2, 3, 4]] and val.tolist() == [[5, 5, 3, 5]]  # ascending index order
    idx, _ = ref.topk(np.full((1, 6), 2.5, np.float32), [6], 3)
    assert idx.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize(
    "length, want",
    [
        (0, [-1, -1, -1, -1]),
        (1, [0, -1, -1, -1]),
        (3, [0, 1, 2, -1]),  # below k
        (4, [0, 1, 2, 3]),  # at k
        (5, [0, 1, 3, 4]),  # above k: 0.5 at index 2 is the smallest
        (6, [0, 1, 3, 4]),
        (-2, [-1, -1, -1, -1]),  # clamped to 0
        (99, [0, 1, 3, 4]),  # clamped to the capacity
    ],
)
def test_topk_lengths_below_at_above_k(length, want):
    s = np.array([[4, 3, 0.5, 2, 1, 0.25]], np.float32)
    idx, val = ref.topk(s, [length], 4)
    assert idx.dtype == np.int32 and val.dtype == np.float32
    assert idx.tolist() == [want]
    live = [s[0, i] for i in want if i >= 0]
    assert val.tolist() == [live + [-INF] * (4 - len(live))]


def test_topk_ignores_entries_past_the_live_length():
    s = np.array([[1, 2, 100, 200]], np.float32)
    assert ref.topk(s, [2], 1)[0].tolist() == [[1]]


def test_topk_nan_is_minus_inf_and_signed_zeros_tie():
    s = np.array([[np.nan, 1, -INF, 2]], np.float32)
    idx, val = ref.topk(s, [4], 3)
    assert idx.tolist() == [[0, 1, 3]]  # NaN and -inf tie at -inf: the lower index wins
    assert val.tolist() == [[-INF, 1, 2]]
    idx, val = ref.topk(np.array([[-0.0, 0.0, -1.0]], np.float32), [3], 1)
    assert idx.tolist() == [[0]] and not np.signbit(val[0, 0])  # -0 ties with +0 and is reported as +0
    idx, val = ref.topk(np.array([[1, INF, 2, -INF]], np.float32), [4], 2)
    assert idx.tolist() == [[1, 2]] and val.tolist() == [[INF, 2]]


def test_topk_equals_a_full_stable_sort(rng):
    s = rng.integers(0, 20, (3, 500)).astype(np.float32)  # many ties
    lengths = [500, 321, 64]
    idx, val = ref.topk(s, lengths, 64)
    for b, n in enumerate(lengths):
        order = sorted(range(n), key=lambda t: (-s[b, t], t))[:64]
        assert idx[b].tolist() == sorted(order)
        assert val[b].tolist() == s[b, sorted(order)].tolist()


# ---- the op on numpy arrays


def test_score_topk_matches_reference_with_outputs(rng):
    q, w, keys = exact_inputs(rng, 3, 16, 64, 300)
    lengths = np.array([300, 40, 0], np.int32)
    out_i = np.full((3, 50), -7, np.int32)
    out_s = np.full((3, 50), np.nan, np.float32)
    work = np.full((3, 300), np.nan, np.float32)
    idx, val = ops.score_topk(q, w, keys, lengths, 50, out_indices=out_i, out_scores=out_s, workspace=work)
    assert idx is out_i and val is out_s
    ri, rv = ref.score_topk(q, w, keys, lengths, 50)
    assert np.array_equal(idx, ri) and val.tobytes() == rv.tobytes()
    s = ref.scores(q, w, keys, lengths)
    assert work[0].tobytes() == s[0].tobytes() and work[1, :40].tobytes() == s[1, :40].tobytes()
    assert np.isnan(work[1, 40:]).all() and np.isnan(work[2]).all()  # entries past the length untouched
    assert (idx[1, 40:] == -1).all() and (idx[2] == -1).all()
    assert host_flags() & status.INDEXER_INPUT == 0


def test_one_key_cache_shared_by_every_row_is_the_cache_repeated(rng):
    """keys [1, C, D]: the query positions of one sequence's prefill score its one cache, each up
    to its own length; the same as giving every row a copy."""
    q, w, keys = exact_inputs(rng, 4, 16, 64, 120)
    shared = keys[:1]
    lengths = np.array([120, 7, 0, 64], np.int32)
    got = ops.score_topk(q, w, shared, lengths, 16)
    want = ops.score_topk(q, w, np.repeat(shared, 4, axis=0), lengths, 16)
    assert np.array_equal(got[0], want[0]) and got[1].tobytes() == want[1].tobytes()


def test_bf16_head_weights_with_a_scale_are_the_fp32_product(rng):
    """w in bf16 times ``w_scale`` scores as the fp32 weights ``float32(w) * float32(w_scale)`` do
    (the product the kernel forms; the example's indexer passes its projection's bf16 output)."""
    q, _, keys = exact_inputs(rng, 3, 16, 64, 90)
    w16 = rng.standard_normal((3, 16)).astype(BF16)
    scale = float(np.float32(1 / 32.0**0.5))
    lengths = np.array([90, 5, 47], np.int32)
    got = ops.score_topk(q, w16, keys, lengths, 12, w_scale=scale)
    want = ops.score_topk(q, w16.astype(np.float32) * np.float32(scale), keys, lengths, 12)
    assert np.array_equal(got[0], want[0]) and got[1].tobytes() == want[1].tobytes()
    plain = ops.score_topk(q, w16.astype(np.float32), keys, lengths, 12)
    assert not np.array_equal(got[1], plain[1])  # the scale is applied


def test_score_topk_allocates_outputs_and_accepts_an_empty_batch(rng):
    q, w, keys = exact_inputs(rng, 2, 8, 32, 20)
    idx, val = ops.score_topk(q, w, keys, np.array([20, 5], np.int32), 8)
    assert idx.shape == (2, 8) and idx.dtype == np.int32 and val.dtype == np.float32
    idx, val = ops.score_topk(q[:0], w[:0], keys[:0], np.zeros(0, np.int32), 8)
    assert idx.shape == (0, 8) and val.shape == (0, 8)


def test_status_word_records_nan_scores_and_bad_lengths(rng):
    q, w, keys = exact_inputs(rng, 2, 8, 32, 20)
    ok = np.array([20, 3], np.int32)
    ops.score_topk(q, w, keys, ok, 4)
    assert host_flags() & status.INDEXER_INPUT == 0
    bad_keys = keys.copy()
    bad_keys[1, 10, 0] = np.nan
    ops.score_topk(q, w, bad_keys, ok, 4)  # index 10 is past row 1's live length: no NaN score
    assert host_flags() & status.INDEXER_INPUT == 0
    idx, val = ops.score_topk(q, w, bad_keys, np.array([20, 12], np.int32), 4)
    assert host_flags() & status.INDEXER_INPUT
    assert 10 not in idx[1].tolist() and np.isfinite(val).all()  # NaN ranks as -inf
    status.clear(device=-1)
    ops.score_topk(q, w, keys, np.array([21, 3], np.int32), 4)
    assert host_flags() & status.INDEXER_INPUT
    status.clear(device=-1)
    idx, _ = ops.score_topk(q, w, keys, np.array([-1, 3], np.int32), 4)
    assert host_flags() & status.INDEXER_INPUT and (idx[0] == -1).all()


# ---- the layer


def test_the_top_k_kernel_rule(monkeypatch):
    """The cluster select for long caches while the clusters fit in one wave (sm_90+), in blocks of
    256 threads up to 32768 entries, one block per row otherwise; the knobs force a path, and refuse
    the cluster where it cannot run."""
    pick = ops.select_kernel
    # clusters of 256-thread blocks up to 32768 entries, of 1024-thread blocks beyond
    assert pick(1, 32768, 132) == pick(16, 8193, 132) == "indexer_topk_cluster_small"
    assert pick(1, 32769, 132) == pick(1, 131072, 132) == "indexer_topk_cluster"
    assert pick(16, 8192, 132) == "indexer_topk_registers_small"  # 256 threads: faster than the cluster
    assert pick(1, ops.CLUSTER_MIN_CAPACITY - 1, 132) == "indexer_topk_registers_small"  # 256 threads
    assert pick(17, 8192, 132) == "indexer_topk_registers_small"  # 136 clusters: more than one wave
    assert pick(17, 8193, 132) == pick(17, 32768, 132) == "indexer_topk_registers"
    assert pick(17, 65536, 132) == "indexer_topk_global"
    assert pick(1, 131073, 132) == "indexer_topk_global"  # beyond the cluster's registers
    assert pick(1, 32768, 132, compute_capability=80) == "indexer_topk_registers"
    monkeypatch.setattr(ops, "TOPK_SELECT", "block")
    assert pick(1, 32768, 132) == "indexer_topk_registers" and pick(1, 40000, 132) == "indexer_topk_global"
    assert pick(1, 8192, 132) == "indexer_topk_registers_small"
    monkeypatch.setattr(ops, "TOPK_SMALL_MAX_CAPACITY", 0)
    assert pick(1, 2048, 132) == "indexer_topk_registers"
    monkeypatch.setattr(ops, "TOPK_SELECT", "cluster")
    monkeypatch.setattr(ops, "TOPK_SMALL_MAX_CAPACITY", 0)
    assert pick(64, 100, 132) == "indexer_topk_cluster_small"
    monkeypatch.setattr(ops, "CLUSTER_SMALL_MAX_CAPACITY", 0)
    assert pick(64, 100, 132) == pick(1, 32768, 132) == "indexer_topk_cluster"
    with pytest.raises(ValueError, match="capacity up to 131072"):
        pick(1, 131073, 132)
    with pytest.raises(ValueError, match="compute capability 80"):
        pick(1, 4096, 132, compute_capability=80)
    monkeypatch.setattr(ops, "TOPK_SELECT", "fast")
    with pytest.raises(ValueError, match="TOPK_SELECT"):
        pick(1, 4096, 132)
    source = loader.kernel_source("indexer")
    for name in ("indexer_topk_cluster", "indexer_topk_registers", "indexer_topk_global"):
        assert re.search(rf'extern "C" __global__ void [^;{{]*\b{name}\(', source), name


def test_layer_matches_reference(rng):
    layer = Indexer(16, capacity=100, heads=8, head_dim=32)
    q, w, keys = exact_inputs(rng, 2, 8, 32, 100)
    lengths = np.array([100, 9], np.int32)
    idx = layer.score_topk(q, w, keys, lengths)
    ri, rv = ref.score_topk(q, w, keys, lengths, 16)
    assert np.array_equal(idx, ri)
    idx, val = layer.score_topk(q, w, keys, lengths, return_scores=True)
    assert np.array_equal(idx, ri) and val.tobytes() == rv.tobytes()


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(k=0), ValueError, r"k: expected 1 <= k <= 4096, got 0"),
        (dict(k=2.0), TypeError, "k: expected an integer, got float"),
        (dict(capacity=0), ValueError, "capacity: expected 1 <= capacity"),
        (dict(heads=12), ValueError, "heads: expected a multiple of 8"),
        (dict(heads=72), ValueError, "heads: expected 1 <= heads <= 64"),
        (dict(head_dim=48), ValueError, "head_dim: expected a multiple of 32"),
        (dict(head_dim=True), TypeError, "head_dim: expected an integer, got bool"),
    ],
)
def test_layer_bad_config(kwargs, exc, message):
    args = dict(k=16, capacity=100, heads=8, head_dim=32) | kwargs
    with pytest.raises(exc, match=message):
        Indexer(args.pop("k"), **args)


def test_layer_checks_shapes_against_its_config(rng):
    layer = Indexer(16, capacity=100, heads=8, head_dim=32)
    q, w, keys = exact_inputs(rng, 2, 8, 32, 100)
    lengths = np.array([1, 2], np.int32)
    with pytest.raises(ValueError, match=r"q: expected shape \(B, 8, 32\) for this Indexer"):
        layer.score_topk(q[:, :4], w, keys, lengths)
    with pytest.raises(ValueError, match=r"keys: expected shape \(B, 100, 32\) for this Indexer"):
        layer.score_topk(q, w, keys[:, :50], lengths)


# ---- bad inputs


def _good(bsz=2, heads=8, dim=32, capacity=16):
    return dict(
        q=np.ones((bsz, heads, dim), BF16),
        w=np.ones((bsz, heads), np.float32),
        keys=np.ones((bsz, capacity, dim), BF16),
        lengths=np.full(bsz, capacity, np.int32),
        k=4,
    )


def _call(**changes):
    args = _good() | changes
    return ops.score_topk(args.pop("q"), args.pop("w"), args.pop("keys"), args.pop("lengths"), args.pop("k"), **args)


@pytest.mark.parametrize(
    "changes, exc, message",
    [
        (dict(q=[[[1.0]]]), TypeError, "q: expected a numpy, CuPy or DLPack array, got list"),
        (dict(q=np.ones((2, 8, 32), np.float32)), TypeError, "q: expected dtype bfloat16, got float32"),
        (dict(q=np.ones((2, 256), BF16)), ValueError, r"q: expected a 3-D array, got shape \(2, 256\)"),
        (dict(q=np.ones((2, 12, 32), BF16)), ValueError, r"q: expected a multiple of 8 in \[8, 64\] heads"),
        (dict(q=np.ones((2, 72, 32), BF16)), ValueError, r"q: expected a multiple of 8 in \[8, 64\] heads"),
        (dict(q=np.ones((2, 8, 48), BF16)), ValueError, "q: expected a head dimension that is a multiple of 32"),
        (dict(q=np.ones((2, 8, 256), BF16)), ValueError, "q: expected a head dimension"),
        (dict(q=np.ones((2, 32, 8), BF16).transpose(0, 2, 1)), ValueError, "q: expected a C-contiguous array"),
        (dict(w=np.ones((2, 8), np.float16)), TypeError, "w: expected dtype float32 or bfloat16, got float16"),
        (dict(w_scale=float("nan")), ValueError, "w_scale: expected a finite number, got nan"),
        (dict(w_scale="2"), TypeError, "w_scale: expected a real number, got str"),
        (dict(w=np.ones((2, 16), np.float32)), ValueError, r"w: expected shape \(2, 8\) to match q"),
        (dict(w=np.ones(16, np.float32)), ValueError, "w: expected a 2-D array"),
        (dict(w=np.ones((8, 2), np.float32).T), ValueError, "w: expected a C-contiguous array"),
        (dict(keys=np.ones((2, 16, 32), np.float32)), TypeError, "keys: expected dtype bfloat16, got float32"),
        (dict(keys=np.ones((3, 16, 32), BF16)), ValueError, r"keys: expected shape \(2, C, 32\) or \(1, C, 32\) \(shared by every row\) to match q"),
        (dict(keys=np.ones((2, 16, 64), BF16)), ValueError, r"keys: expected shape \(2, C, 32\)"),
        (dict(keys=np.ones((2, 0, 32), BF16)), ValueError, r"keys: expected a capacity C in \[1, "),
        (dict(keys=np.ones((2, 32, 16), BF16).transpose(0, 2, 1)), ValueError, "keys: expected a C-contiguous array"),
        (dict(keys=np.ones((2, 16), BF16)), ValueError, "keys: expected a 3-D array"),
        (dict(lengths=np.full(2, 3, np.int64)), TypeError, "lengths: expected dtype int32, got int64"),
        (dict(lengths=np.full(3, 3, np.int32)), ValueError, r"lengths: expected shape \(2,\) to match q"),
        (dict(lengths=np.full((2, 1), 3, np.int32)), ValueError, "lengths: expected a 1-D array"),
        (dict(lengths=3), TypeError, "lengths: expected a numpy, CuPy or DLPack array, got int"),
        (dict(k=0), ValueError, r"k: expected 1 <= k <= 4096, got 0"),
        (dict(k=4097), ValueError, r"k: expected 1 <= k <= 4096, got 4097"),
        (dict(k=-1), ValueError, r"k: expected 1 <= k <= 4096, got -1"),
        (dict(k=4.0), TypeError, "k: expected an integer, got float"),
        (dict(k=True), TypeError, "k: expected an integer, got bool"),
        (dict(k=np.array(4)), TypeError, "k: expected an integer, got ndarray"),
        (dict(out_indices=np.zeros((2, 4), np.int64)), ValueError, r"out_indices: expected shape \(2, 4\) and dtype int32"),
        (dict(out_indices=np.zeros((2, 5), np.int32)), ValueError, r"out_indices: expected shape \(2, 4\)"),
        (dict(out_indices=[0] * 8), TypeError, "out_indices: expected a numpy or CuPy array, got list"),
        (dict(out_indices=np.zeros((4, 2), np.int32).T), ValueError, "out_indices: expected a C-contiguous array"),
        (dict(out_scores=np.zeros((2, 4), np.float64)), ValueError, r"out_scores: expected shape \(2, 4\) and dtype float32"),
        (dict(out_scores=np.zeros((1, 4), np.float32)), ValueError, r"out_scores: expected shape \(2, 4\)"),
        (dict(workspace=np.zeros((2, 15), np.float32)), ValueError, r"workspace: expected shape \(2, 16\) and dtype float32"),
        (dict(workspace=np.zeros((2, 16), BF16)), ValueError, r"workspace: expected shape \(2, 16\) and dtype float32"),
        (dict(workspace=np.zeros((16, 2), np.float32).T), ValueError, "workspace: expected a C-contiguous array"),
        (dict(key_range=np.zeros((2, 3), np.uint32)), ValueError, r"key_range: expected shape \(2, 2\) and dtype uint32"),
        (dict(key_range=np.zeros((2, 2), np.int32)), ValueError, r"key_range: expected shape \(2, 2\) and dtype uint32"),
        (dict(key_range=[0, 0, 0, 0]), TypeError, "key_range: expected a numpy or CuPy array, got list"),
    ],
)
def test_bad_inputs_are_clear_errors(changes, exc, message):
    with pytest.raises(exc, match=message):
        _call(**changes)


def test_bad_input_writes_nothing():
    out = np.full((2, 4), -7, np.int32)
    with pytest.raises(ValueError, match="out_scores"):
        _call(out_indices=out, out_scores=np.zeros((2, 3), np.float32))
    assert (out == -7).all()


def test_query_rope_rotates_the_raw_query_first(rng):
    """``query_rope``: the raw index query's last ``rope_dim`` channels are rotated at ``positions +
    offset`` as `fp4kit.ops.elementwise.rmsnorm_rope` (``normalize=False``) rotates them, then scored."""
    from fp4kit.ops import elementwise as ew

    q, w, keys = exact_inputs(rng, 3, 16, 64, 120)
    lengths = np.array([120, 40, 7], np.int32)
    positions = np.array([9, 1, 100000], np.int32)
    rotated = ew.rmsnorm_rope(q, None, positions - 1, normalize=False, rope_dim=32, theta=10000.0)
    want = ops.score_topk(rotated, w, keys, lengths, 20)
    got = ops.score_topk(q, w, keys, lengths, 20, query_rope=ops.QueryRope(positions, 32, 10000.0, offset=-1))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want))
    assert ops.score_topk(q, w, keys, lengths, 20)[1].tobytes() != want[1].tobytes()


@pytest.mark.parametrize("rope, exc, message", [
    ("a tuple", TypeError, "query_rope: expected a fp4kit.ops.indexer.QueryRope"),
    (dict(positions=np.zeros(3, np.int32)), ValueError, r"query_rope.positions: expected int32 \[2\]"),
    (dict(positions=np.zeros(2, np.int64)), TypeError, r"query_rope.positions: expected int32 \[2\]"),
    (dict(offset=2**31), ValueError, "query_rope.offset: expected a small integer"),
    (dict(rope_dim=0), ValueError, r"query_rope.rope_dim: expected an even number in \[2, 32\]"),
    (dict(rope_dim=33), ValueError, r"query_rope.rope_dim: expected an even number in \[2, 32\]"),
    (dict(offset=True), ValueError, "query_rope.offset: expected a small integer"),
])
def test_bad_query_rope(rng, rope, exc, message):
    q, w, keys = exact_inputs(rng, 2, 8, 32, 40)
    query_rope = (np.zeros(2, np.int32), 8) if rope == "a tuple" else ops.QueryRope(
        **{"positions": np.zeros(2, np.int32), "rope_dim": 8, **rope})
    with pytest.raises(exc, match=message):
        ops.score_topk(q, w, keys, np.array([40, 3], np.int32), 4, query_rope=query_rope)
