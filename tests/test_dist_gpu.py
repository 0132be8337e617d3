"""fp4kit.distributed on one GPU: the dist.cu kernels against their numpy specification (multi-rank
plans included), the tensor-parallel Linear and the expert-parallel MoE at world size 1 through
the same code path as on several GPUs (LocalCommunicator) against the single-device layers, the
multi-rank device path with ranks simulated on one GPU, and CUDA-graph capture of a TP Linear
pair and an EP MoE step. Multi-GPU runs: tests/multigpu/check_dist.py."""

import copy
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from fp4kit import distributed as dist
from fp4kit.distributed import kernels
from fp4kit.layers import Linear, MoE, RoutingConfig, SharedExpert
from fp4kit.reference import dist as ref
from fp4kit.reference import gemm as gref
from fp4kit.runtime import status

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16
V4 = RoutingConfig(top_k=6, score_func="sqrtsoftplus", routed_scale=1.5)
V3 = RoutingConfig(top_k=8, score_func="sigmoid", n_group=8, topk_group=4, routed_scale=2.5)


def bits(a):
    a = cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.asarray(a)
    return a.view(np.uint16)


def poison(a):
    a.view(cp.uint8).fill(0xFF)  # NaN patterns for floats, huge values for integers


# -- kernels against the specification --------------------------------------------------------------
@pytest.mark.parametrize("world, per_rank, t, k, capacity", [
    (1, 256, 1, 6, 6), (2, 128, 64, 6, 384), (4, 64, 17, 8, 9), (8, 32, 512, 8, 200), (2, 4, 30, 3, 5)])
def test_plan_kernels_match_reference(rng, world, per_rank, t, k, capacity):
    e = world * per_rank
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    ids[: t // 2, 0] = 0  # a hot expert
    w = rng.random((t, k)).astype(np.float32)
    counts, tickets = ref.tickets(ids, e)
    slot, sent, sw, overflow = ref.plan_send(counts, tickets, ids, w, per_rank, world, capacity)
    d_counts = cp.asarray(counts)
    d_slot, d_sent = cp.empty(t * k, cp.uint32), cp.empty((world, per_rank), cp.uint32)
    d_sw = cp.zeros(world * capacity, cp.float32)
    poison(d_slot), poison(d_sent)
    status.clear()
    kernels.plan_send(d_counts, cp.asarray(tickets), cp.asarray(ids), cp.asarray(w), per_rank, world, capacity,
                      d_slot, d_sent, d_sw)
    assert np.array_equal(cp.asnumpy(d_slot), slot) and np.array_equal(cp.asnumpy(d_sent), sent)
    assert np.array_equal(cp.asnumpy(d_sw), sw) and int(d_counts.sum()) == 0
    assert bool(status.read() & dist.EP_CAPACITY_OVERFLOW) == overflow
    status.clear()

    recv_counts = np.stack([np.roll(sent, s, axis=0)[0] for s in range(world)])  # any consistent counts
    recv_weight = rng.random((world, capacity)).astype(np.float32)
    for use_weight in (True, False):
        expected = ref.plan_recv(recv_counts, recv_weight, capacity, use_weight)

        plan = SimpleNamespace(offsets=cp.empty(per_rank + 1, cp.uint32), active=cp.empty(per_rank, cp.uint32),
                               num_active=cp.empty(1, cp.uint32), row_token=cp.empty(world * capacity, cp.uint32),
                               row_weight=cp.empty(world * capacity, cp.float32))
        for a in vars(plan).values():
            poison(a)
        kernels.plan_recv(cp.asarray(recv_counts), cp.asarray(recv_weight), capacity, use_weight, plan)
        n_active = int(expected[2][0])
        assert np.array_equal(cp.asnumpy(plan.offsets), expected[0]) and int(plan.num_active[0]) == n_active
        assert np.array_equal(cp.asnumpy(plan.active)[:n_active], expected[1][:n_active])
        assert np.array_equal(cp.asnumpy(plan.row_token), expected[3])
        assert np.array_equal(cp.asnumpy(plan.row_weight), expected[4])


@pytest.mark.parametrize("row_shape, dtype", [((2048,), np.uint8), ((4,), np.uint8), ((3,), np.uint8),
                                              ((4096,), np.float32), ((7,), BF16)])
def test_copy_rows_matches_reference(rng, row_shape, dtype):
    if dtype == np.uint8:
        src = rng.integers(0, 256, (40, *row_shape)).astype(np.uint8)
    else:
        src = rng.standard_normal((40, *row_shape)).astype(dtype)
    dst_rows = rng.permutation(64)[:40].astype(np.uint32)
    dst_rows[::7] = 64  # dropped
    for kwargs in (dict(src_div=3, dst_rows=dst_rows, dst_limit=64, n=40),
                   dict(src_rows=rng.integers(0, 40, 64).astype(np.uint32), n=64, n_limit=np.array([50], np.uint32))):
        host = np.zeros((64, *row_shape), dtype)
        dev = cp.zeros((64, *row_shape), dtype)
        n = kwargs.pop("n")
        ref.copy_rows(src, host, n, **kwargs)
        kernels.copy_rows(cp.asarray(src), dev, n, **{k: cp.asarray(v) if isinstance(v, np.ndarray) else v
                                                        for k, v in kwargs.items()})
        assert np.array_equal(cp.asnumpy(dev).view(np.uint8), host.view(np.uint8))


def test_bias_to_bf16_matches_reference(rng):
    acc = rng.standard_normal((5, 300)).astype(np.float32)
    for bias in (None, rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(BF16)):
        out = cp.empty((5, 300), BF16)
        kernels.bias_to_bf16(cp.asarray(acc), None if bias is None else cp.asarray(bias), out)
        assert np.array_equal(bits(out), bits(ref.bias_to_bf16(acc, bias)))


# -- layers at world size 1 (the multi-GPU code path) ----------------------------------------------
@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("t", [1, 3, 64])
def test_tensor_parallel_world_one_equals_linear(rng, mode, t):
    w = cp.asarray(rng.standard_normal((2056, 1024)).astype(np.float32))
    b = cp.asarray(rng.standard_normal(2056).astype(np.float32))
    full = Linear.from_float(w, bias=b, mode=mode)
    x = cp.asarray(rng.standard_normal((t, 1024)).astype(BF16))
    comm = dist.LocalCommunicator()
    expected = full(x).copy()
    col = dist.ColumnParallelLinear.shard(full, comm)(x)
    assert np.array_equal(bits(col), bits(expected))
    row = cp.asnumpy(dist.RowParallelLinear.shard(full, comm)(x)).astype(np.float32)
    ref = cp.asnumpy(expected).astype(np.float32)
    assert (np.abs(row - ref) <= np.spacing(np.abs(ref)) * 2**16).all()  # one bf16 ulp


def _moe(rng, e, h, i, routing, **kwargs):
    gate = cp.asarray((rng.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32))
    w1 = cp.asarray((rng.standard_normal((e, i, h)) / np.sqrt(h)).astype(np.float32))
    w3 = cp.asarray((rng.standard_normal((e, i, h)) / np.sqrt(h)).astype(np.float32))
    w2 = cp.asarray((rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32))
    shared = SharedExpert.from_float(*(cp.asarray((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32))
                                       for s in ((i, h), (i, h), (h, i))), limit=10.0)
    return MoE.from_float(gate, w1, w3, w2, routing, limit=10.0, shared=shared, **kwargs)


@pytest.mark.parametrize("routing, before", [(V4, True), (V3, False)])
@pytest.mark.parametrize("t", [1, 5, 64, 300])
def test_expert_parallel_world_one_equals_moe(rng, routing, before, t):
    moe = _moe(rng, 64, 512, 256, routing, weight_before_down=before)
    ep = dist.ExpertParallelMoE.shard(moe, dist.LocalCommunicator())
    x = cp.asarray(rng.standard_normal((t, 512)).astype(BF16))
    expected = moe(x).copy()
    got = ep(x)
    assert np.array_equal(bits(got), bits(expected))  # the same operations on every row


@pytest.mark.parametrize("t", [1, 64])
def test_expert_parallel_replicated_tokens_world_one_equals_moe(rng, t):
    moe = _moe(rng, 64, 512, 256, V4)
    ep = dist.ExpertParallelMoE.shard(moe, dist.LocalCommunicator(), tokens="replicated")
    x = cp.asarray(rng.standard_normal((t, 512)).astype(BF16))
    expected = moe(x).copy()
    assert np.array_equal(bits(ep(x)), bits(expected))


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_ranks_simulated_on_one_gpu(rng, world):
    """The multi-rank device path (plans, packing, exchange, local experts, return, combine) with
    the ranks as threads on one GPU, against the single-device layer on all ranks' tokens."""
    moe = _moe(rng, 32, 256, 128, V4)
    t = 9
    hosts = [rng.standard_normal((t, 256)).astype(BF16) for _ in range(world)]
    hosts[-1][0] *= 30  # the largest input amax on the last rank
    xs = [cp.asarray(a) for a in hosts]
    expected = cp.asnumpy(moe(cp.asarray(np.concatenate(hosts))))
    # each rank its own copy of the replicated parts (the layers own per-shape buffers)
    outs = dist.SimulatedGroup(world).run(
        lambda c: cp.asnumpy(dist.ExpertParallelMoE.shard(copy.deepcopy(moe), c)(xs[c.rank])))
    got = np.concatenate(outs)
    assert gref.calc_diff(got.astype(np.float32), expected.astype(np.float32)) < 1e-6
    assert np.array_equal(bits(got), bits(expected))
    # replicated tokens: every rank gets the single-device output on them
    expected = moe(xs[0]).copy()
    outs = dist.SimulatedGroup(world).run(
        lambda c: cp.asnumpy(dist.ExpertParallelMoE.shard(copy.deepcopy(moe), c, tokens="replicated")(xs[0])))
    cp.cuda.Device().synchronize()
    for y in outs:
        assert np.array_equal(bits(y), bits(expected))


def test_capacity_overflow_recorded_on_the_device(rng):
    bias = np.zeros(32, np.float32)
    bias[:6] = 100.0  # every token to experts 0..5
    moe = _moe(rng, 32, 256, 128, V4, bias=cp.asarray(bias))
    x = cp.asarray(rng.standard_normal((16, 256)).astype(BF16))
    status.clear()
    dist.ExpertParallelMoE.shard(moe, dist.LocalCommunicator())(x)
    assert not status.read() & dist.EP_CAPACITY_OVERFLOW
    small = dist.ExpertParallelMoE.shard(moe, dist.LocalCommunicator(), capacity_factor=0.5)
    y = small(x)
    assert status.read() & dist.EP_CAPACITY_OVERFLOW
    assert np.isfinite(cp.asnumpy(y).astype(np.float32)).all()
    status.clear()


# -- CUDA graphs --------------------------------------------------------------------------------------
def _capture(fn, capture_stream):
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
    return graph, stream


def test_tensor_parallel_pair_in_a_cuda_graph(rng, capture_stream):
    comm = dist.LocalCommunicator()
    up = dist.ColumnParallelLinear.from_float(cp.asarray(rng.standard_normal((1024, 512)).astype(np.float32)), comm,
                                              gather_output=False)
    down = dist.RowParallelLinear.from_float(cp.asarray(rng.standard_normal((512, 1024)).astype(np.float32)), comm)
    gathered = dist.ColumnParallelLinear.from_float(cp.asarray(rng.standard_normal((256, 512)).astype(np.float32)),
                                                    comm)
    x = cp.zeros((4, 512), BF16)

    def step():
        return down(up(x)), gathered(x)

    y, g = step()  # eager first call: compiles, allocates the layers' buffers
    graph, stream = _capture(step, capture_stream)
    for _ in range(3):
        xn = rng.standard_normal((4, 512)).astype(BF16)
        x.set(xn, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        got_y, got_g = cp.asnumpy(y).copy(), cp.asnumpy(g).copy()
        with cp.cuda.Stream(non_blocking=True) as s:
            ey, eg = (cp.asnumpy(a.copy()) for a in step())
            s.synchronize()
        assert np.array_equal(got_y.view(np.uint16), ey.view(np.uint16))
        assert np.array_equal(got_g.view(np.uint16), eg.view(np.uint16))


@pytest.mark.parametrize("t", [1, 16])
def test_expert_parallel_step_in_a_cuda_graph(rng, t, capture_stream):
    moe = _moe(rng, 64, 512, 256, V4)
    ep = dist.ExpertParallelMoE.shard(moe, dist.LocalCommunicator())
    x = cp.zeros((t, 512), BF16)
    y = ep(x)
    graph, stream = _capture(lambda: ep(x), capture_stream)
    for _ in range(3):
        xn = rng.standard_normal((t, 512)).astype(BF16)
        x.set(xn, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        got = cp.asnumpy(y).copy()
        with cp.cuda.Stream(non_blocking=True) as s:
            expect = cp.asnumpy(moe(cp.asarray(xn)).copy())
            s.synchronize()
        assert np.array_equal(got.view(np.uint16), expect.view(np.uint16))


@pytest.mark.parametrize("world, per_rank, t, k", [(2, 4, 1, 3), (2, 128, 64, 6), (4, 16, 33, 8)])
def test_owner_slots_matches_reference(rng, world, per_rank, t, k):
    ids = np.stack([rng.choice(world * per_rank, k, replace=False) for _ in range(t)]).astype(np.int32)
    slot_all = rng.integers(0, 1 << 20, (world, t * k)).astype(np.uint32)
    out = cp.zeros(t * k, cp.uint32)
    kernels.owner_slots(cp.asarray(slot_all), cp.asarray(ids), per_rank, out)
    assert np.array_equal(out.get(), ref.owner_slots(slot_all, ids, per_rank))
