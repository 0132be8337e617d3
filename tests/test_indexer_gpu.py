"""Lightning indexer kernels on the GPU against the numpy reference.

Two kinds of data:

* exact data (small integers, weights m/16): every score is exact in fp32 whatever the summation
  order, so the scores must equal the reference bit for bit and the selection (with its many
  ties) must equal the reference's full stable sort exactly, indices, order and values;
* random normal data (the realistic case): the scores must lie within a rounding bound of the
  float64 reference, the selection must be exactly the top-k of the kernel's own scores, and it
  may differ from the reference's only by entries within that bound of the boundary.

Outputs are poisoned before every launch; lengths stay on the device (a graph replay after
changing them on the device gives the new result). The top-k has two paths, one block per row and
a cluster of 8 blocks per row (`ops.TOPK_SELECT` forces either): the `select_path` tests run both at
the same shapes, each against the reference.
"""

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.layers.indexer import Indexer
from fp4kit.ops import indexer as ops
from fp4kit.reference import indexer as ref
from fp4kit.runtime import status

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16
C = 32768
H, D = 64, 128
POISON_INDEX = -7
FLAG = status.INDEXER_INPUT


@pytest.fixture(params=["block", "small-block", "cluster", "small-cluster"])
def select_path(request, monkeypatch):
    """Runs the test with the top-k forced onto one path (the rule in `ops.select_kernel` picks the
    cluster for the long caches of most tests here, one block for short ones; "small-block": one
    block of 256 threads wherever the capacity is at most 8192; "small-cluster": the cluster of
    256-thread blocks wherever the capacity is at most 32768, "cluster" the 1024-thread one)."""
    cluster = request.param.endswith("cluster")
    monkeypatch.setattr(ops, "TOPK_SELECT", "cluster" if cluster else "block")
    monkeypatch.setattr(ops, "TOPK_SMALL_MAX_CAPACITY", 8192 if request.param == "small-block" else 0)
    monkeypatch.setattr(ops, "CLUSTER_SMALL_MAX_CAPACITY", 32768 if request.param == "small-cluster" else 0)
    return request.param


def exact_inputs(rng, bsz, capacity, heads=H, dim=D):
    """|q . k| <= 2048 and weights m/16 with |m| <= 8: every partial sum is a multiple of 1/16
    below 2**17, exact in fp32 (and in the tensor cores' fp32 accumulation)."""
    q = rng.integers(-4, 5, (bsz, heads, dim), dtype=np.int8).astype(BF16)
    keys = rng.integers(-4, 5, (bsz, capacity, dim), dtype=np.int8).astype(BF16)
    w = (rng.integers(-8, 9, (bsz, heads)) / 16).astype(np.float32)
    return q, w, keys


def float_inputs(rng, bsz, capacity, heads=H, dim=D):
    q = rng.standard_normal((bsz, heads, dim), dtype=np.float32).astype(BF16)
    keys = rng.standard_normal((bsz, capacity, dim), dtype=np.float32).astype(BF16)
    w = (rng.standard_normal((bsz, heads)) * (dim**-0.5 * heads**-0.5)).astype(np.float32)
    return q, w, keys


def run(q, w, keys, lengths, k):
    """score_topk on the device into poisoned outputs; host copies of (indices, scores, workspace)."""
    bsz, capacity = q.shape[0], keys.shape[1]
    idx = cp.full((bsz, k), POISON_INDEX, cp.int32)
    val = cp.full((bsz, k), np.nan, cp.float32)
    work = cp.full((bsz, capacity), np.nan, cp.float32)
    lengths_d = cp.asarray(np.asarray(lengths, np.int32))
    key_range = cp.zeros((bsz, 2), cp.uint32)  # the radix passes from each row's varying bits
    got_i, got_v = ops.score_topk(cp.asarray(q), cp.asarray(w), cp.asarray(keys), lengths_d, k,
                                  out_indices=idx, out_scores=val, workspace=work, key_range=key_range)
    assert got_i is idx and got_v is val
    assert not key_range.any()  # left zero for the next call
    return idx.get(), val.get(), work.get()


def assert_live_scores(work, want, lengths):
    """Every live score written and bit-equal to the reference (-0 and +0 are the same score)."""
    n = ref.live_lengths(lengths, want.shape[1])
    for b in range(want.shape[0]):
        got, exp = work[b, : n[b]] + np.float32(0), want[b, : n[b]] + np.float32(0)
        bad = np.nonzero(~((got == exp) | (np.isnan(got) & np.isnan(exp))))[0]
        assert bad.size == 0, f"row {b}: {bad.size} scores differ, first at {bad[:5]}: {got[bad[:5]]} vs {exp[bad[:5]]}"


def assert_exact(q, w, keys, lengths, k, got):
    idx, val, work = got
    want_s = ref.scores(q, w, keys, lengths)
    assert_live_scores(work, want_s, lengths)
    want_i, want_v = ref.topk(want_s, lengths, k)
    for b in range(idx.shape[0]):
        assert np.array_equal(idx[b], want_i[b]), (
            f"row {b} (length {lengths[b]}): {np.count_nonzero(idx[b] != want_i[b])} indices differ")
    assert val.tobytes() == want_v.tobytes()


def mixed_lengths(rng, k, capacity, bsz=8):
    """Lengths below, at and above k, empty, one entry, and the whole capacity."""
    pool = [0, 1, k - 1, k, k + 1, int(rng.integers(k + 2, capacity - 1)), capacity - 1, capacity]
    lengths = np.array([min(x, capacity) for x in pool[:bsz]], np.int32)
    rng.shuffle(lengths)
    return lengths


@pytest.mark.parametrize("k", [512, 2048])
def test_exact_batch1_lengths_below_at_above_k(select_path, rng, k):
    fp4kit.clear_status()
    q, w, keys = exact_inputs(rng, 1, C)
    for n in [0, 1, k - 1, k, k + 1, int(rng.integers(k + 2, C)), C - 1, C]:
        lengths = np.array([n], np.int32)
        assert_exact(q, w, keys, lengths, k, run(q, w, keys, lengths, k))
    assert fp4kit.read_status() & FLAG == 0


@pytest.mark.parametrize("k", [512, 2048])
def test_exact_batch8_mixed_lengths(select_path, rng, k):
    fp4kit.clear_status()
    q, w, keys = exact_inputs(rng, 8, C)
    lengths = mixed_lengths(rng, k, C)
    assert_exact(q, w, keys, lengths, k, run(q, w, keys, lengths, k))
    assert fp4kit.read_status() & FLAG == 0


@pytest.mark.parametrize("k", [512, 2048])
def test_one_key_cache_shared_by_every_row(rng, k):
    """keys [1, C, D] (the query positions of one sequence's prefill): every row scores the one
    cache up to its own length, exactly as the reference does on the cache repeated per row."""
    fp4kit.clear_status()
    q, w, keys = exact_inputs(rng, 8, C)
    shared = keys[:1]
    lengths = mixed_lengths(rng, k, C)
    assert_exact(q, w, np.repeat(shared, 8, axis=0), lengths, k, run(q, w, shared, lengths, k))
    assert fp4kit.read_status() & FLAG == 0


def test_bf16_head_weights_with_a_scale(rng):
    """bf16 head weights times ``w_scale`` in the kernel: bit-equal to the reference on the fp32
    product (exact data: weights m/16 and a power-of-two scale keep every score exact)."""
    q, w, keys = exact_inputs(rng, 8, 4096)
    lengths = mixed_lengths(rng, 512, 4096)
    w16 = (w * 4).astype(BF16)  # m/4: exact in bf16
    idx, val = cp.full((8, 512), POISON_INDEX, cp.int32), cp.full((8, 512), np.nan, cp.float32)
    work = cp.full((8, 4096), np.nan, cp.float32)
    ops.score_topk(cp.asarray(q), cp.asarray(w16), cp.asarray(keys), cp.asarray(lengths), 512, w_scale=0.25,
                   out_indices=idx, out_scores=val, workspace=work)
    assert_exact(q, w16.astype(np.float32) * np.float32(0.25), keys, lengths, 512, (idx.get(), val.get(), work.get()))


def rounding_bound(q, w, keys, lengths):
    """|fp32 score - exact score| bound per entry, valid for any summation order (and generous for
    the tensor cores' accumulation): (2(D + H) + 8) u * sum_h |w_h| |q_h| . |k_t|."""
    bsz, heads, dim = q.shape
    n = ref.live_lengths(lengths, keys.shape[1])
    out = np.zeros(keys.shape[:2], np.float64)
    for b in range(bsz):
        absdot = np.abs(q[b].astype(np.float64)) @ np.abs(keys[b, : n[b]].astype(np.float64)).T
        out[b, : n[b]] = (np.abs(w[b].astype(np.float64))[:, None] * absdot).sum(0)
    return (2 * (dim + heads) + 8) * 2.0**-24 * out


@pytest.mark.parametrize("k", [512, 2048])
def test_random_data_scores_and_top_k_sets(select_path, rng, k):
    fp4kit.clear_status()
    q, w, keys = float_inputs(rng, 8, C)
    lengths = mixed_lengths(rng, k, C)
    idx, val, work = run(q, w, keys, lengths, k)
    want_s = ref.scores(q, w, keys, lengths)
    bound = rounding_bound(q, w, keys, lengths)
    n = ref.live_lengths(lengths, C)
    for b in range(8):
        err = np.abs(work[b, : n[b]].astype(np.float64) - want_s[b, : n[b]])
        assert np.all(err <= bound[b, : n[b]]), f"row {b}: score error {err.max()} above the bound"
    # the selection is exact with respect to the kernel's own scores
    own_i, own_v = ref.topk(work, lengths, k)
    assert np.array_equal(idx, own_i) and val.tobytes() == own_v.tobytes()
    # and equals the reference's set up to entries within rounding of the boundary
    want_i, want_v = ref.topk(want_s, lengths, k)
    for b in range(8):
        m = min(int(n[b]), k)
        assert (idx[b, m:] == -1).all() and np.isneginf(val[b, m:]).all()
        if n[b] <= k:
            assert np.array_equal(idx[b], want_i[b])
            continue
        kth = want_v[b].min()  # the reference's k-th largest score
        tol = 2 * bound[b, : n[b]].max()
        diff = np.setxor1d(idx[b], want_i[b])
        assert np.all(np.abs(want_s[b, diff] - kth) <= tol), f"row {b}: sets differ away from the boundary"
        assert abs(float(val[b].min()) - float(kth)) <= tol  # the boundary value
    assert fp4kit.read_status() & FLAG == 0


def _pool_rows_by_score(rng, q, w, count=4):
    """``count`` key rows with strictly decreasing scores for (q, w) (exact data)."""
    while True:
        rows = rng.integers(-4, 5, (count, q.shape[-1]), dtype=np.int8).astype(BF16)
        s = ref.scores(q[None], w[None], rows[None], np.array([count]))[0]
        order = np.argsort(-s.astype(np.float64), kind="stable")
        if np.unique(s).size == count:
            return rows[order]


@pytest.mark.parametrize("k", [512, 2048])
def test_ties_at_the_boundary_take_the_lowest_indices(select_path, rng, k):
    q, w, _ = exact_inputs(rng, 2, 1)
    keys = np.empty((2, C, D), BF16)
    lengths = np.array([C, 20000], np.int32)
    expected = []
    for b in range(2):
        pool = _pool_rows_by_score(rng, q[b], w[b])
        choice = rng.integers(2, 4, C)
        pos = rng.permutation(C)
        choice[pos[: k // 2 + 37]] = 0  # the best score, fewer than k times
        choice[pos[k // 2 + 37: k // 2 + 5037]] = 1  # the second best, straddling the boundary
        keys[b] = pool[choice]
        live = choice[: lengths[b]]
        top, second = np.nonzero(live == 0)[0], np.nonzero(live == 1)[0]
        assert top.size < k < top.size + second.size  # ties at the boundary by construction
        expected.append(np.sort(np.concatenate([top, second[: k - top.size]])))
    got = run(q, w, keys, lengths, k)
    for b in range(2):
        assert np.array_equal(got[0][b], expected[b])
    assert_exact(q, w, keys, lengths, k, got)
    # every score equal: the first k indices
    keys[:] = keys[:, :1]
    got = run(q, w, keys, lengths, k)
    assert np.array_equal(got[0], np.broadcast_to(np.arange(k, dtype=np.int32), (2, k)))
    assert_exact(q, w, keys, lengths, k, got)


def test_nan_scores_and_bad_lengths_set_the_status_word(select_path, rng):
    k, capacity = 512, 4096
    q, w, keys = exact_inputs(rng, 3, capacity)
    keys[0, 7, 3] = np.nan  # row 0: length 300 < k, the NaN entry is selected with score -inf
    keys[1, 100, :] = np.nan  # row 1: length > k, never selected
    lengths = np.array([300, capacity, 100], np.int32)
    fp4kit.clear_status()
    got = run(q, w, keys, lengths, k)
    assert fp4kit.read_status() & FLAG
    assert_exact(q, w, keys, lengths, k, got)
    assert 7 in got[0][0].tolist() and got[1][0, 7] == -np.inf
    assert 100 not in got[0][1].tolist()
    # a NaN key past the live length is never read
    fp4kit.clear_status()
    lengths = np.array([7, 100, 100], np.int32)
    assert_exact(q, w, keys, lengths, k, run(q, w, keys, lengths, k))
    assert fp4kit.read_status() & FLAG == 0
    # lengths outside [0, capacity] are clamped and recorded
    for bad in ([-5, 10, 10], [10, capacity + 100, 10]):
        fp4kit.clear_status()
        lengths = np.array(bad, np.int32)
        q2, w2, keys2 = exact_inputs(rng, 3, capacity)
        got = run(q2, w2, keys2, lengths, k)
        assert fp4kit.read_status() & FLAG
        assert_exact(q2, w2, keys2, lengths, k, got)
    fp4kit.clear_status()


def test_deterministic_across_runs(rng):
    q, w, keys = float_inputs(rng, 8, C)
    lengths = mixed_lengths(rng, 2048, C)
    a, b = run(q, w, keys, lengths, 2048), run(q, w, keys, lengths, 2048)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


def test_capacity_above_the_register_path(rng, monkeypatch):
    monkeypatch.setattr(ops, "TOPK_SELECT", "block")
    capacity, k = 40000, 2048  # indexer_topk_global
    q, w, keys = exact_inputs(rng, 2, capacity)
    for lengths in ([capacity, 33001], [1500, capacity - 1], [k, k + 1]):
        lengths = np.array(lengths, np.int32)
        assert_exact(q, w, keys, lengths, k, run(q, w, keys, lengths, k))


@pytest.mark.parametrize("heads, dim, capacity, k", [(8, 32, 1001, 100), (16, 64, 1003, 512), (24, 96, 130, 1),
                                                     (64, 128, 129, 4096), (56, 128, 4099, 2048)])
def test_odd_shapes(select_path, rng, heads, dim, capacity, k):
    q, w, keys = exact_inputs(rng, 3, capacity, heads, dim)
    lengths = np.array([capacity, capacity // 2, 7], np.int32)
    assert_exact(q, w, keys, lengths, k, run(q, w, keys, lengths, k))
    q, w, keys = float_inputs(rng, 3, capacity, heads, dim)
    idx, val, work = run(q, w, keys, lengths, k)
    own_i, own_v = ref.topk(work, lengths, k)
    assert np.array_equal(idx, own_i) and val.tobytes() == own_v.tobytes()


def test_graph_replay_follows_lengths_and_keys_on_the_device(select_path, rng, capture_stream):
    bsz, k = 4, 2048
    layer = Indexer(k, capacity=C, heads=H, head_dim=D)
    q, w, keys = exact_inputs(rng, bsz, C)
    lengths = np.array([1000, 2046, 2048, 30000], np.int32)
    qd, wd, keys_d, lengths_d = cp.asarray(q), cp.asarray(w), cp.asarray(keys), cp.asarray(lengths)
    first = layer.score_topk(qd, wd, keys_d, lengths_d)  # eager: compiles, creates the buffers
    assert first is layer.buffers(bsz).indices
    assert np.array_equal(first.get(), ref.score_topk(q, w, keys, lengths, k)[0])
    cp.cuda.Device().synchronize()
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        out = layer.score_topk(qd, wd, keys_d, lengths_d)
        graph = stream.end_capture()
    assert out is first
    with stream:  # the replays run on this stream: poison on it too
        layer.buffers(bsz).indices.fill(POISON_INDEX)
        layer.buffers(bsz).scores.fill(np.nan)
    for step in range(1, 4):
        q, w, keys = exact_inputs(rng, bsz, C)
        with stream:
            lengths_d += 1  # on the device, outside the graph: the replay must see it
            keys_d.set(keys, stream=stream)
            qd.set(q, stream=stream)
            wd.set(w, stream=stream)
            graph.launch(stream)
        stream.synchronize()
        want_i, want_v = ref.score_topk(q, w, keys, lengths + step, k)
        assert np.array_equal(out.get(), want_i), f"step {step}"
        assert layer.buffers(bsz).scores.get().tobytes() == want_v.tobytes()


# ---- the cluster select (indexer_topk_cluster) on long rows, against the one-block kernels and the reference


def test_the_rule_picks_the_cluster_for_long_rows_at_small_batch():
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    assert ops.select_kernel(1, C, sms) == "indexer_topk_cluster_small"
    assert ops.select_kernel(8, C, sms) == "indexer_topk_cluster_small"
    assert ops.select_kernel(1, 2 * C, sms) == "indexer_topk_cluster"
    assert ops.select_kernel(1, 1024, sms) == "indexer_topk_registers_small"


LONG = 65536  # above the one-block register kernel: its global-memory twin runs on the block path


@pytest.mark.parametrize("capacity", [C, LONG])
@pytest.mark.parametrize("k", [1, 512, 2048])
def test_long_rows_exact_batch1(select_path, rng, capacity, k):
    """Lengths across the cluster's block boundaries (4096 entries per block at 32768): just past
    one block's share, whole, odd and full rows."""
    fp4kit.clear_status()
    q, w, keys = exact_inputs(rng, 1, capacity)
    for n in [0, 1, k - 1, k, k + 1, 4095, 4097, 8193, 32767, 32768, 40001, capacity - 1, capacity]:
        if not 0 <= n <= capacity:
            continue
        lengths = np.array([n], np.int32)
        assert_exact(q, w, keys, lengths, k, run(q, w, keys, lengths, k))
    assert fp4kit.read_status() & FLAG == 0


@pytest.mark.parametrize("capacity", [C, LONG])
@pytest.mark.parametrize("k", [1, 512, 2048])
def test_long_rows_exact_batch8(select_path, rng, capacity, k):
    fp4kit.clear_status()
    q, w, keys = exact_inputs(rng, 8, capacity)
    lengths = np.array([capacity, 4097, 32768, 0, k, k + 1, int(rng.integers(k + 2, capacity)), capacity - 3],
                       np.int32)
    rng.shuffle(lengths)
    assert_exact(q, w, keys, lengths, k, run(q, w, keys, lengths, k))
    assert fp4kit.read_status() & FLAG == 0


def test_k_equal_to_the_live_length(select_path, rng):
    """k = n (everything taken, no radix pass) and k = n - 1 (one entry dropped) at the largest k."""
    k = ops.MAX_K
    q, w, keys = exact_inputs(rng, 4, C)
    lengths = np.array([k, k - 1, k + 1, C], np.int32)
    assert_exact(q, w, keys, lengths, k, run(q, w, keys, lengths, k))


@pytest.mark.parametrize("capacity, k", [(2048, 512), (8192, 2048), (1000, 7)])
def test_the_small_block_agrees_bit_for_bit_with_the_block(rng, monkeypatch, capacity, k):
    """The 256-thread select (`indexer_topk_registers_small`) and the 1024-thread one on random
    data with live lengths below, at and above k: identical indices and values."""
    q, w, keys = float_inputs(rng, 5, capacity)
    lengths = np.array([capacity, capacity // 2 + 1, k, k + 1, 0], np.int32)
    monkeypatch.setattr(ops, "TOPK_SELECT", "block")
    got = {}
    for small in (0, 8192):
        monkeypatch.setattr(ops, "TOPK_SMALL_MAX_CAPACITY", small)
        assert ops.select_kernel(5, capacity, 132) == ("indexer_topk_registers_small" if small else "indexer_topk_registers")
        got[small] = run(q, w, keys, lengths, k)
    for x, y in zip(got[0], got[8192]):
        assert x.tobytes() == y.tobytes()


def test_the_two_paths_agree_bit_for_bit_on_random_data(rng, monkeypatch):
    """Random normal data (the realistic case, few ties): the cluster and the one-block kernel
    select from the same scores, so indices and values are identical, and equal to the reference
    top-k of those scores."""
    q, w, keys = float_inputs(rng, 8, LONG)
    lengths = np.array([LONG, 32768, 4097, 2049, 2048, 60001, 1, 0], np.int32)
    got = {}
    for path in ("block", "cluster"):
        monkeypatch.setattr(ops, "TOPK_SELECT", path)
        got[path] = run(q, w, keys, lengths, 2048)
    for x, y in zip(got["block"], got["cluster"]):
        assert x.tobytes() == y.tobytes()
    own_i, own_v = ref.topk(got["cluster"][2], lengths, 2048)
    assert np.array_equal(got["cluster"][0], own_i) and got["cluster"][1].tobytes() == own_v.tobytes()


@pytest.mark.parametrize("k", [512, 2048])
def test_long_rows_ties_straddle_the_blocks(select_path, rng, k):
    """Two best scores spread over the whole row: the boundary's ties lie in every block of the
    cluster, and the lowest indices must win across block boundaries."""
    q, w, _ = exact_inputs(rng, 2, 1)
    keys = np.empty((2, LONG, D), BF16)
    lengths = np.array([LONG, 50001], np.int32)
    expected = []
    for b in range(2):
        pool = _pool_rows_by_score(rng, q[b], w[b])
        choice = rng.integers(2, 4, LONG)
        pos = rng.permutation(lengths[b])  # among the live entries
        choice[pos[: k // 2 + 11]] = 0
        choice[pos[k // 2 + 11: k // 2 + 20011]] = 1
        keys[b] = pool[choice]
        live = choice[: lengths[b]]
        top, second = np.nonzero(live == 0)[0], np.nonzero(live == 1)[0]
        assert top.size < k < top.size + second.size
        expected.append(np.sort(np.concatenate([top, second[: k - top.size]])))
    got = run(q, w, keys, lengths, k)
    for b in range(2):
        assert np.array_equal(got[0][b], expected[b])
    assert_exact(q, w, keys, lengths, k, got)
    keys[:] = keys[:, :1]  # every score equal: the first k indices
    got = run(q, w, keys, lengths, k)
    assert np.array_equal(got[0], np.broadcast_to(np.arange(k, dtype=np.int32), (2, k)))
    assert_exact(q, w, keys, lengths, k, got)


def test_long_rows_nan_scores_rank_last_and_set_the_status_word(select_path, rng):
    """NaN scores are -inf: in a row where they must fill the selection they are taken in index
    order across the blocks; elsewhere they are never taken; both record the status bit."""
    k = 2048
    q, w, keys = exact_inputs(rng, 3, C)
    nan_rows = rng.permutation(4097)[:3000]
    keys[0, nan_rows] = np.nan  # 1097 finite entries, then the first 951 NaN ones (as -inf)
    keys[1, [5, 4100, 20000, 32767]] = np.nan  # one NaN in several blocks' shares, never selected
    lengths = np.array([4097, C, 9000], np.int32)
    fp4kit.clear_status()
    got = run(q, w, keys, lengths, k)
    assert fp4kit.read_status() & FLAG
    assert_exact(q, w, keys, lengths, k, got)
    taken_nan = np.isin(got[0][0], nan_rows)
    assert taken_nan.sum() == k - (4097 - 3000) and np.isneginf(got[1][0][taken_nan]).all()
    assert not np.isin(got[0][1], [5, 4100, 20000, 32767]).any()
    fp4kit.clear_status()  # NaN keys past the live length are never read
    lengths = np.array([0, 5, 9000], np.int32)
    assert_exact(q, w, keys, lengths, k, run(q, w, keys, lengths, k))
    assert fp4kit.read_status() & FLAG == 0
    for bad in ([-5, 10, 10], [10, C + 100, 10]):  # clamped and recorded
        fp4kit.clear_status()
        lengths = np.array(bad, np.int32)
        q2, w2, keys2 = exact_inputs(rng, 3, C)
        got = run(q2, w2, keys2, lengths, k)
        assert fp4kit.read_status() & FLAG
        assert_exact(q2, w2, keys2, lengths, k, got)
    fp4kit.clear_status()


@pytest.mark.parametrize("k", [512, 2048])
def test_the_small_cluster_agrees_bit_for_bit_with_the_cluster(rng, monkeypatch, k):
    """The cluster of 256-thread blocks and that of 1024-thread blocks run the same passes on the
    same scores: identical indices and values, equal to the reference top-k of those scores, on
    random data with lengths across the blocks' boundaries."""
    q, w, keys = float_inputs(rng, 8, C)
    lengths = np.array([C, C - 1, 4097, 2049, 2048, 30001, 1, 0], np.int32)
    monkeypatch.setattr(ops, "TOPK_SELECT", "cluster")
    got = {}
    for small in (0, C):
        monkeypatch.setattr(ops, "CLUSTER_SMALL_MAX_CAPACITY", small)
        got[small] = run(q, w, keys, lengths, k)
    for x, y in zip(got[0], got[C]):
        assert x.tobytes() == y.tobytes()
    own_i, own_v = ref.topk(got[C][2], lengths, k)
    assert np.array_equal(got[C][0], own_i) and got[C][1].tobytes() == own_v.tobytes()


def test_cluster_deterministic_across_runs(rng, monkeypatch):
    monkeypatch.setattr(ops, "TOPK_SELECT", "cluster")
    for bsz in (1, 8):
        q, w, keys = float_inputs(rng, bsz, C)
        lengths = np.full(bsz, C, np.int32)
        lengths[::2] = rng.integers(2049, C, lengths[::2].size)
        a, b = run(q, w, keys, lengths, 2048), run(q, w, keys, lengths, 2048)
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()


def test_layer_reuses_its_buffers(rng):
    layer = Indexer(512, capacity=4096, heads=H, head_dim=D)
    q, w, keys = exact_inputs(rng, 2, 4096)
    lengths = cp.asarray(np.array([4096, 300], np.int32))
    a = layer.score_topk(cp.asarray(q), cp.asarray(w), cp.asarray(keys), lengths)
    b, scores = layer.score_topk(cp.asarray(q), cp.asarray(w), cp.asarray(keys), lengths, return_scores=True)
    assert a is b and scores is layer.buffers(2).scores
    assert np.array_equal(a.get(), ref.score_topk(q, w, keys, [4096, 300], 512)[0])


def test_device_bad_inputs():
    q = cp.zeros((2, 8, 32), BF16)
    w = cp.zeros((2, 8), cp.float32)
    keys = cp.zeros((2, 16, 32), BF16)
    lengths = cp.zeros(2, cp.int32)
    with pytest.raises(ValueError, match="arrays must live on one device"):
        ops.score_topk(q, w, keys, np.zeros(2, np.int32), 4)
    with pytest.raises(ValueError, match="q: expected a 16-byte aligned device pointer"):
        ops.score_topk(cp.zeros(2 * 8 * 32 + 1, BF16)[1:].reshape(2, 8, 32), w, keys, lengths, 4)
    with pytest.raises(ValueError, match="out_indices: expected an array on the same device"):
        ops.score_topk(q, w, keys, lengths, 4, out_indices=np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="workspace: expected an array on the same device"):
        ops.score_topk(q, w, keys, lengths, 4, workspace=np.zeros((2, 16), np.float32))


@pytest.mark.parametrize("kind", ["float", "exact", "negative", "equal", "nan"])
def test_key_range_gives_the_same_selection_and_is_left_zero(rng, select_path, kind):
    """With a key_range buffer the select's passes start at the highest bit in which a row's scores
    differ: the same indices and values, bit for bit, as the passes over every bit, on every path;
    the buffer is zero again after each call, and repeated calls (the range gathered afresh) agree."""
    bsz, capacity, k = 8, 8192, 512
    q, w, keys = (exact_inputs if kind == "exact" else float_inputs)(rng, bsz, capacity)
    if kind == "negative":  # scores of both signs: every bit may vary
        w = -np.abs(w) * np.where(np.arange(H) % 2, 1, -1).astype(np.float32)
    if kind == "equal":  # every live score the same: no pass at all
        keys[:] = keys[:, :1]
    if kind == "nan":
        keys[:, 7, 0] = np.nan
    lengths = mixed_lengths(rng, k, capacity, bsz)
    args = [cp.asarray(a) for a in (q, w, keys, lengths)]
    plain = [o.get() for o in ops.score_topk(*args, k)]
    key_range = cp.zeros((bsz, 2), cp.uint32)
    for _ in range(2):
        got = [o.get() for o in ops.score_topk(*args, k, key_range=key_range)]
        assert np.array_equal(got[0], plain[0]), f"{np.count_nonzero(got[0] != plain[0])} indices differ"
        assert got[1].tobytes() == plain[1].tobytes()
        assert not key_range.any()
    fp4kit.clear_status()  # the NaN case records an event


def test_indexer_layer_uses_its_key_range(rng):
    """The layer's buffers carry a key_range (used up to `ops.KEY_RANGE_MAX_CAPACITY`), zero between
    calls; its selection equals the op's without one."""
    bsz, capacity, k = 2, ops.KEY_RANGE_MAX_CAPACITY, 2048
    q, w, keys = float_inputs(rng, bsz, capacity)
    lengths = np.array([capacity, capacity // 2 + 3], np.int32)
    args = [cp.asarray(a) for a in (q, w, keys, lengths)]
    layer = Indexer(k, capacity=capacity, heads=H, head_dim=D)
    got = layer.score_topk(*args).get()
    assert not layer.buffers(bsz).key_range.any()
    assert np.array_equal(got, ops.score_topk(*args, k)[0].get())


@pytest.mark.parametrize("bsz, heads, dim, rope_dim", [(1, 64, 128, 64), (8, 64, 128, 64), (3, 8, 32, 32), (2, 16, 64, 2)])
def test_query_rope_in_the_scoring_gives_the_bits_of_the_rope_launch(rng, bsz, heads, dim, rope_dim):
    """``query_rope``: the scoring launch's RoPE of the raw index query (as it stages it) gives the
    scores, indices and values of `rmsnorm_rope` (``normalize=False``) then `score_topk`, at
    positions up to 2**30 (the sine and cosine's slow path)."""
    from fp4kit.ops import elementwise as ew

    q, w, keys = float_inputs(rng, bsz, 2048, heads, dim)
    lengths = rng.integers(0, 2049, bsz).astype(np.int32)
    positions = cp.asarray(rng.integers(1, 2**30, bsz).astype(np.int32))
    qd, wd, kd, ld = cp.asarray(q), cp.asarray(w), cp.asarray(keys), cp.asarray(lengths)
    rotated = ew.rmsnorm_rope(qd, None, positions - 1, normalize=False, rope_dim=rope_dim, theta=10000.0)
    work_a, work_b = cp.full((bsz, 2048), np.nan, cp.float32), cp.full((bsz, 2048), np.nan, cp.float32)
    want = ops.score_topk(rotated, wd, kd, ld, 100, workspace=work_a)
    got = ops.score_topk(qd, wd, kd, ld, 100, workspace=work_b,
                         query_rope=ops.QueryRope(positions, rope_dim, 10000.0, offset=-1))
    for a, b in zip(got, want):
        assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes()
    assert cp.asnumpy(work_a).tobytes() == cp.asnumpy(work_b).tobytes()
