"""fp4kit.distributed on the CPU: the communicators (local, simulated, the NCCL loader's error), the
launcher's environment and failure propagation, the kernels' numpy specification on hand cases,
and the sharded layers at world sizes 1, 2 and 4 against the single-device layers.

Tolerances. Column-parallel Linear and expert-parallel MoE compute every output element with the
same operations as the single-device layer (rows are independent; activation scales are the
group's): they are compared **bit for bit**. Row-parallel Linear sums fp32 partial outputs in rank
order where the single-device layer rounds one float64 sum: an element may differ by one bf16 ulp
of the result plus the fp32 rounding of the partial sums, ``4 * world * 2^-24 * sum_r |partial_r|``.
"""

import os
import re
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from fp4kit import distributed as dist
from fp4kit.distributed import env as dist_env
from fp4kit.distributed import kernels as dist_kernels
from fp4kit.distributed import launch
from fp4kit.formats import Nvfp4Tensor
from fp4kit.layers import ExpertStack, Linear, MoE, RoutingConfig, SharedExpert
from fp4kit.layers import moe as moe_layer
from fp4kit.reference import dist as ref
from fp4kit.reference import gemm as gref
from fp4kit.reference import quant as qref
from fp4kit.runtime import status

BF16 = ml_dtypes.bfloat16
WORLDS = (1, 2, 4)


def bits(a):
    return np.asarray(a).view(np.uint16)


# -- communicators ---------------------------------------------------------------------------------
@pytest.mark.parametrize("world", WORLDS)
def test_simulated_collectives(world):
    group = dist.SimulatedGroup(world)

    def step(comm):
        r = comm.rank
        s = np.array([r + 1.5, -r], np.float32)
        mx, mn = s.copy(), s.copy()
        comm.all_reduce(s, "sum")
        comm.all_reduce(mx, "max")
        comm.all_reduce(mn, "min")
        gathered = np.empty((world, 3), np.int32)
        comm.all_gather(np.full(3, r, np.int32), gathered)
        inplace = np.zeros((world, 2), np.float32)
        inplace[r] = r * 10
        comm.all_gather(inplace[r], inplace)
        send_a = np.array([[100 * r + d] for d in range(world)], np.int64)  # to rank d: 100 r + d
        send_b = np.arange(world * 4, dtype=np.uint8).reshape(world, 4) + r
        recv_a, recv_b = np.empty_like(send_a), np.empty_like(send_b)
        comm.all_to_all([send_a, send_b], [recv_a, recv_b])
        comm.barrier()
        return s, mx, mn, gathered, inplace, recv_a, recv_b

    for r, (s, mx, mn, gathered, inplace, recv_a, recv_b) in enumerate(group.run(step)):
        assert s.tolist() == [sum(q + 1.5 for q in range(world)), -sum(range(world))]
        assert mx.tolist() == [world + 0.5, 0] and mn.tolist() == [1.5, -(world - 1)]
        assert gathered.tolist() == [[q] * 3 for q in range(world)]
        assert inplace[:, 0].tolist() == [10 * q for q in range(world)]
        assert recv_a[:, 0].tolist() == [100 * q + r for q in range(world)]  # from rank q, its chunk for r
        assert recv_b.tolist() == [list(range(4 * r + q, 4 * r + q + 4)) for q in range(world)]


def test_simulated_sum_is_in_rank_order_in_the_arrays_dtype():
    vals = [np.float32(1.0), np.float32(2.0**-24), np.float32(2.0**-24)]
    out = dist.SimulatedGroup(3).run(lambda c: c.all_reduce(np.array([vals[c.rank]], np.float32)))
    assert out[0][0] == np.float32(1.0)  # (1 + 2^-24) + 2^-24 rounds to 1 twice in fp32


def test_simulated_group_reports_mismatches_and_errors():
    group = dist.SimulatedGroup(2, timeout=10)
    with pytest.raises(RuntimeError, match=r"collective mismatch: rank \d called all_reduce"):
        group.run(lambda c: c.all_reduce(np.zeros(2 + c.rank, np.float32)))
    with pytest.raises(ZeroDivisionError):
        group.run(lambda c: 1 / 0 if c.rank == 1 else c.barrier())
    assert group.run(lambda c: (c.barrier(), c.rank)[1]) == [0, 1]  # usable again after a failure
    with pytest.raises(TypeError, match=r"x: the simulated communicator takes numpy \(or CuPy\) arrays"):
        group.run(lambda c: c.all_reduce([1.0]))
    with pytest.raises(ValueError, match="world_size: expected a positive int"):
        dist.SimulatedGroup(0)


def test_collective_argument_errors():
    comm = dist.LocalCommunicator()
    with pytest.raises(ValueError, match="op: expected one of"):
        comm.all_reduce(np.zeros(2, np.float32), "mean")
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 3\)"):
        comm.all_gather(np.zeros(3, np.float32), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="sends\\[0\\]: expected axis 0 of length world_size=1"):
        comm.all_to_all(np.zeros((2, 3)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="recvs\\[0\\]: expected shape"):
        comm.all_to_all(np.zeros((1, 3)), np.zeros((1, 4)))
    with pytest.raises(ValueError, match="recvs: expected 2 arrays"):
        comm.all_to_all([np.zeros((1, 3)), np.zeros((1, 3))], [np.zeros((1, 3))])
    x = np.arange(3.0)
    out = np.zeros((1, 3))
    assert comm.all_reduce(x, "sum") is x and comm.all_gather(x, out)[0].tolist() == [0, 1, 2]


# -- init, rendezvous, NCCL loading ------------------------------------------------------------------
def test_init_without_launcher_is_world_size_one(monkeypatch):
    for key in (dist_env.WORLD_SIZE, dist_env.RANK, dist_env.RENDEZVOUS):
        monkeypatch.delenv(key, raising=False)
    comm = dist.init()
    assert isinstance(comm, dist.LocalCommunicator) and (comm.rank, comm.world_size) == (0, 1)
    monkeypatch.setenv(dist_env.WORLD_SIZE, "1")
    assert isinstance(dist.init(), dist.LocalCommunicator)


@pytest.mark.parametrize("env, message", [
    ({"FP4KIT_WORLD_SIZE": "two"}, "FP4KIT_WORLD_SIZE: expected an integer, got 'two'"),
    ({"FP4KIT_WORLD_SIZE": "0"}, "FP4KIT_WORLD_SIZE: expected >= 1"),
    ({"FP4KIT_WORLD_SIZE": "2", "FP4KIT_RANK": "2"}, "FP4KIT_RANK: expected 0 <= rank < 2"),
    ({"FP4KIT_WORLD_SIZE": "2", "FP4KIT_RANK": "1", "FP4KIT_RENDEZVOUS": "/nonexistent/dir"},
     "FP4KIT_RENDEZVOUS: expected an existing directory"),
])
def test_init_bad_environment(monkeypatch, env, message):
    for key in (dist_env.WORLD_SIZE, dist_env.RANK, dist_env.RENDEZVOUS):
        monkeypatch.delenv(key, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        dist.init()


def test_unique_id_rendezvous(tmp_path):
    uid = tuple(range(-64, 64))
    dist_env.publish_unique_id(str(tmp_path), uid)
    assert dist_env.read_unique_id(str(tmp_path)) == uid
    assert [p.name for p in tmp_path.iterdir()] == [dist_env.ID_FILE]  # no temporary left behind
    with pytest.raises(TimeoutError, match="no NCCL unique id appeared"):
        dist_env.read_unique_id(str(tmp_path / "empty"), timeout=0.1)


def _cupy_without_nccl(monkeypatch):
    """A CuPy whose NCCL binding could not load libnccl.so.2, whether CuPy and NCCL are installed
    here or not: the loader's failure path runs on every machine."""
    import types

    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = False
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, module)


def test_nccl_loader_fails_with_a_clear_message(monkeypatch, tmp_path):
    from fp4kit.distributed import nccl_lib

    _cupy_without_nccl(monkeypatch)
    monkeypatch.setenv("FP4KIT_NCCL_LIBRARY", str(tmp_path / "libnccl.so.2"))
    with pytest.raises(RuntimeError) as e:
        nccl_lib.load()
    message = str(e.value)
    assert "CuPy could not load libnccl.so.2" in message and str(tmp_path / "libnccl.so.2") in message  # what it tried
    assert "FP4KIT_NCCL_LIBRARY" in message and "nccl.available" in message  # how to fix and check it


def test_nccl_loader_without_cupy_raises_its_documented_error(monkeypatch):
    from fp4kit.distributed import nccl_lib

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "cupy.cuda.nccl", raising=False)
    monkeypatch.setattr(nccl_lib, "candidate_paths", lambda: [])
    with pytest.raises(RuntimeError, match="CuPy"):
        nccl_lib.load()


# -- launcher ---------------------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import json, os, sys, time
    keys = ["FP4KIT_RANK", "FP4KIT_WORLD_SIZE", "FP4KIT_LOCAL_RANK", "FP4KIT_DEVICE", "FP4KIT_RENDEZVOUS",
            "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "CUDA_VISIBLE_DEVICES"]
    rank = int(os.environ["FP4KIT_RANK"])
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[2:]}, f)
    if sys.argv[2] == "fail" and rank == 1:
        sys.exit(3)
    if sys.argv[2] == "raise" and rank == 1:
        raise RuntimeError("injected fault")
    if sys.argv[2] == "killed" and rank == 1:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[2] in ("fail", "raise", "killed"):
        time.sleep(60)  # the launcher must stop this rank
    if sys.argv[2] == "hang_at_exit" and rank == 1:
        time.sleep(60)  # finished its work but never exits: the launcher must report and stop it
""")


def _launch(tmp_path, *args, mode="ok"):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, NCCL_NVLS_ENABLE="1")  # the launcher must override it
    return subprocess.run([sys.executable, "-m", "fp4kit.distributed.launch", *args, str(script), str(tmp_path), mode,
                           "--flag"], env=env, capture_output=True, text=True, timeout=50,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_launcher_sets_the_environment_of_every_rank(tmp_path):
    import json

    result = _launch(tmp_path, "--nproc", "3", "--devices", "2,0,1")
    assert result.returncode == 0, result.stderr
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for r, s in enumerate(seen):
        e = s["env"]
        assert (e["FP4KIT_RANK"], e["FP4KIT_WORLD_SIZE"], e["FP4KIT_LOCAL_RANK"]) == (str(r), "3", str(r))
        assert e["FP4KIT_DEVICE"] == ["2", "0", "1"][r]
        assert (e["NCCL_NVLS_ENABLE"], e["TORCH_SYMM_MEM_DISABLE_MULTICAST"], e["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")
        assert s["argv"] == ["ok", "--flag"]
    assert len({s["env"]["FP4KIT_RENDEZVOUS"] for s in seen}) == 1
    assert not os.path.exists(seen[0]["env"]["FP4KIT_RENDEZVOUS"])  # removed afterwards


def test_launcher_isolates_devices(tmp_path):
    import json

    assert _launch(tmp_path, "--nproc", "2", "--isolate").returncode == 0
    for r in range(2):
        e = json.loads((tmp_path / f"rank{r}.json").read_text())["env"]
        assert (e["CUDA_VISIBLE_DEVICES"], e["FP4KIT_DEVICE"]) == (str(r), "0")


def test_launcher_propagates_a_failure_and_stops_the_others(tmp_path):
    import time

    start = time.monotonic()
    result = _launch(tmp_path, "--nproc", "2", "--grace", "2", mode="fail")
    assert result.returncode == 3
    assert "rank 1 exited with code 3; stopping the other ranks" in result.stderr
    assert time.monotonic() - start < 30  # rank 0's 60 s sleep was cut short


@pytest.mark.parametrize("mode, code, message", [
    ("raise", 1, "rank 1 exited with code 1; stopping the other ranks"),
    ("killed", 128 + 9, "rank 1 exited with code 137; stopping the other ranks"),
    ("hang_at_exit", 124, "rank(s) [1] still running 2 s after rank ")])  # rank 0 or 2, whichever exited first
def test_launcher_stops_every_rank_within_seconds_on_a_fault(tmp_path, mode, code, message):
    """An injected fault (one rank raising, one rank killed, one rank that never exits after the
    others finished): every rank is stopped within seconds and the launcher says why."""
    import time

    start = time.monotonic()
    result = _launch(tmp_path, "--nproc", "3", "--grace", "2", "--exit-timeout", "2", mode=mode)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert time.monotonic() - start < 20  # the 60 s sleeps were cut short


def test_launcher_argument_errors():
    for argv, message in ((["--nproc", "0", "x.py"], "--nproc: expected a positive integer"),
                          (["--nproc", "2", "--devices", "0", "x.py"], "--devices: expected 2 indices"),
                          (["--nproc", "2"], "expected a script")):
        with pytest.raises(SystemExit):
            launch.parse_args(argv)
    args = launch.parse_args(["--nproc", "2", "-m", "pkg.mod", "a"])
    assert (args.module, args.script_and_args, args.devices) == ("pkg.mod", ["a"], [0, 1])


# -- kernels' specification -------------------------------------------------------------------------
def test_tickets_count_pairs_per_expert_in_pair_order():
    counts, t = ref.tickets(np.array([[3, 1], [1, 0], [3, 1]]), 4)
    assert counts.tolist() == [1, 3, 0, 2]
    assert t.tolist() == [[0, 0], [1, 0], [1, 2]]


def test_plan_send_by_hand():
    # 4 experts over 2 ranks; pairs (token, slot): t0 -> [3, 0], t1 -> [1, 2], t2 -> [0, 1]
    ids = np.array([[3, 0], [1, 2], [0, 1]])
    w = np.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], np.float32)
    counts, t = ref.tickets(ids, 4)
    slot, sent, sw, overflow = ref.plan_send(counts, t, ids, w, per_rank=2, world=2, capacity=4)
    # rank 0 chunk (experts 0, 1) sorted by expert: e0 [t0, t2], e1 [t1, t2]; rank 1: e2 [t1], e3 [t0]
    assert slot.tolist() == [4 + 1, 0, 2, 4 + 0, 1, 3]
    assert sent.tolist() == [[2, 2], [1, 1]] and not overflow
    assert sw[[0, 1, 2, 3, 4, 5]].tolist() == pytest.approx([0.2, 0.5, 0.3, 0.6, 0.4, 0.1])
    # capacity 1: only the first row of each chunk fits
    slot, sent, _, overflow = ref.plan_send(counts, t, ids, w, per_rank=2, world=2, capacity=1)
    assert slot.tolist() == [2, 0, 2, 1, 2, 2] and sent.tolist() == [[1, 0], [1, 0]] and overflow


def test_plan_recv_by_hand():
    # 2 sources, 2 local experts, capacity 3: source 0 sent [e0, e1, e1], source 1 sent [e0]
    counts = np.array([[1, 2], [1, 0]])
    weight = np.array([0.1, 0.2, 0.3, 0.4, 9, 9], np.float32)
    offsets, active, num_active, row_token, row_weight = ref.plan_recv(counts, weight, 3, True)
    assert offsets.tolist() == [0, 2, 4] and active.tolist() == [0, 1] and num_active.tolist() == [2]
    assert row_token.tolist() == [0, 3, 1, 2, 0, 0]  # e0: (s0, 0), (s1, 0); e1: (s0, 1), (s0, 2)
    assert row_weight.tolist() == pytest.approx([0.1, 0.4, 0.2, 0.3, 0, 0])
    _, active, num_active, _, row_weight = ref.plan_recv(np.array([[0, 2], [0, 1]]), weight, 3, False)
    assert active[:1].tolist() == [1] and num_active.tolist() == [1] and row_weight.tolist() == [1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("world, per_rank, capacity", [(1, 8, 12), (2, 4, 12), (4, 2, 3), (4, 2, 1)])
def test_send_and_receive_plans_cover_every_kept_pair_once(rng, world, per_rank, capacity):
    """Rank-to-rank: every kept pair arrives once, at a row of its expert, with its weight."""
    e, t, k = world * per_rank, 6, 2
    plans = []
    for _ in range(world):
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
        w = rng.random((t, k)).astype(np.float32)
        counts, tk = ref.tickets(ids, e)
        plans.append((ids, w, *ref.plan_send(counts, tk, ids, w, per_rank, world, capacity)))
    for dest in range(world):
        recv_counts = np.stack([p[3][dest] for p in plans])
        recv_weight = np.stack([p[4].reshape(world, capacity)[dest] for p in plans])
        offsets, active, num_active, row_token, row_weight = ref.plan_recv(recv_counts, recv_weight, capacity, True)
        expected = sorted((int(src), int(p), ) for src, pl in enumerate(plans)
                          for p in np.nonzero((pl[2] // capacity == dest) & (pl[2] < world * capacity))[0])
        got = []
        for le in range(per_rank):
            for row in range(offsets[le], offsets[le + 1]):
                src, pos = divmod(int(row_token[row]), capacity)
                p = int(np.nonzero(plans[src][2] == dest * capacity + pos)[0][0])
                assert plans[src][0].reshape(-1)[p] == dest * per_rank + le  # the right expert
                assert row_weight[row] == plans[src][1].reshape(-1)[p]
                got.append((src, p))
        assert sorted(got) == expected
        assert offsets[-1] == len(expected) and (row_weight[offsets[-1]:] == 0).all()


def test_copy_rows_and_bias_cast():
    src = np.arange(12, dtype=np.float32).reshape(6, 2)
    dst = np.full((4, 2), -1, np.float32)
    ref.copy_rows(src, dst, 6, src_div=2, dst_rows=np.array([3, 9, 0, 1, 9, 2]), dst_limit=4)
    assert dst[:, 0].tolist() == [2, 2, 4, 0]  # rows i // 2; destinations >= 4 skipped
    dst[...] = -1
    ref.copy_rows(src, dst, 4, n_limit=np.array([2], np.uint32), src_rows=np.array([5, 4, 3, 2]))
    assert dst[:, 0].tolist() == [10, 8, -1, -1]
    y = ref.bias_to_bf16(np.array([[1.0, 2.0]], np.float32), np.array([0.5, -2.0], BF16))
    assert y.dtype == BF16 and y.astype(np.float32).tolist() == [[1.5, 0.0]]


# -- tensor-parallel Linear --------------------------------------------------------------------------
def _linear_weights(rng, n=64, k=128):
    w = (rng.standard_normal((n, k)) * np.exp(rng.standard_normal((n, 1)))).astype(np.float32)
    return w, rng.standard_normal(n).astype(np.float32)


def _row_tolerance(x_act, full: Linear, world: int, bias) -> np.ndarray:
    """One bf16 ulp of the reference plus the fp32 rounding of the rank-order partial sums."""
    k = full.in_features // world
    partial_abs = 0
    for r in range(world):
        w = full.weight
        part = Nvfp4Tensor(w.packed[:, r * k // 2:(r + 1) * k // 2], w.block_scales[:, r * k // 16:(r + 1) * k // 16],
                           w.global_scale, "linear", (w.shape[0], k))
        a = x_act if not isinstance(x_act, Nvfp4Tensor) else Nvfp4Tensor(
            x_act.packed[:, r * k // 2:(r + 1) * k // 2], x_act.block_scales[:, r * k // 16:(r + 1) * k // 16],
            x_act.global_scale, "linear", (x_act.shape[0], k))
        if not isinstance(a, Nvfp4Tensor):
            a = np.asarray(a)[:, r * k:(r + 1) * k]
        partial_abs = partial_abs + np.abs(gref.gemm(a, part, None, full.row_decode, np.float64))
    if bias is not None:
        partial_abs = partial_abs + np.abs(bias)
    return partial_abs * 4 * world * 2.0**-24


def _ulp_bf16(y):
    y = np.abs(np.asarray(y).astype(np.float32))
    return np.maximum(np.spacing(y.astype(BF16).astype(np.float32) * 0 + y) * 2**16, 2.0**-133)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_column_parallel_shard_is_bit_exact(rng, world, mode):
    w, b = _linear_weights(rng)
    full = Linear.from_float(w, bias=b, mode=mode)
    for lead in ((5,), (1,), (2, 3)):
        x = rng.standard_normal((*lead, 128)).astype(BF16)
        expected = full(x)
        gathered = dist.SimulatedGroup(world).run(lambda c: dist.ColumnParallelLinear.shard(full, c)(x))
        for y in gathered:
            assert y.shape == (*lead, 64) and np.array_equal(bits(y), bits(expected))
        shards = dist.SimulatedGroup(world).run(
            lambda c: dist.ColumnParallelLinear.shard(full, c, gather_output=False)(x))
        assert np.array_equal(bits(np.concatenate(shards, axis=-1)), bits(expected))


@pytest.mark.parametrize("world", WORLDS)
def test_column_parallel_from_float_has_a_global_scale_per_shard(rng, world):
    w, b = _linear_weights(rng)
    layers = dist.SimulatedGroup(world).run(lambda c: dist.ColumnParallelLinear.from_float(w, c, bias=b))
    n = 64 // world
    for r, layer in enumerate(layers):
        assert layer.local.weight.global_scale == qref.quantize(w[r * n:(r + 1) * n]).global_scale
    # the same numbers as one layer over the concatenated shards with a decode factor per row
    packed = np.concatenate([lay.local.weight.packed for lay in layers])
    scales = np.concatenate([lay.local.weight.block_scales for lay in layers])
    row_decode = np.concatenate([np.full(n, gref.decode_factor(lay.local.weight.global_scale), np.float32)
                                 for lay in layers])
    single = Linear(Nvfp4Tensor(packed, scales, layers[0].local.weight.global_scale, "linear", (64, 128)), bias=b,
                    row_decode=row_decode)
    x = rng.standard_normal((7, 128)).astype(BF16)
    outs = dist.SimulatedGroup(world).run(lambda c: layers[c.rank](x))
    for y in outs:
        assert np.array_equal(bits(y), bits(single(x)))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_row_parallel_shard_equals_the_single_layer(rng, world, mode, with_bias):
    k = 256
    w, b = _linear_weights(rng, n=48, k=k)
    b = b[:48] if with_bias else None
    full = Linear.from_float(w, bias=b, mode=mode)
    x = rng.standard_normal((9, k)).astype(BF16)
    x[3] *= 40  # the largest amax on one rank only: the group's scale must come from it
    expected = full(x).astype(np.float32)
    part = k // world
    outs = dist.SimulatedGroup(world).run(
        lambda c: dist.RowParallelLinear.shard(full, c)(np.ascontiguousarray(x[:, c.rank * part:(c.rank + 1) * part])))
    act = qref.quantize(x) if mode == "w4a4" else x
    tol = _ulp_bf16(expected) + _row_tolerance(act, full, world, b)
    for y in outs:
        assert np.array_equal(bits(y), bits(outs[0]))  # every rank holds the same result
        assert (np.abs(y.astype(np.float32) - expected) <= tol).all()
    full_input = dist.SimulatedGroup(world).run(lambda c: dist.RowParallelLinear.shard(full, c, input_is_sharded=False)(x))
    assert np.array_equal(bits(full_input[0]), bits(outs[0]))


def test_row_parallel_local_scales_differ_but_stay_close(rng):
    w, _ = _linear_weights(rng, n=32, k=128)
    full = Linear.from_float(w)
    x = rng.standard_normal((4, 128)).astype(BF16)
    x[:, :64] *= 50
    outs = dist.SimulatedGroup(2).run(
        lambda c: dist.RowParallelLinear.shard(full, c, activation_scale="local", input_is_sharded=False)(x))
    expected = full(x).astype(np.float32)
    assert gref.calc_diff(outs[0].astype(np.float32), expected) < 1e-2


@pytest.mark.parametrize("world", WORLDS)
def test_row_parallel_from_float_matches_float64(rng, world):
    k = 128
    w, b = _linear_weights(rng, n=32, k=k)
    layers = dist.SimulatedGroup(world).run(lambda c: dist.RowParallelLinear.from_float(w, c, bias=b[:32]))
    x = rng.standard_normal((3, k)).astype(BF16)
    act = qref.quantize(x)
    part = k // world
    exact = sum(gref.gemm(Nvfp4Tensor(act.packed[:, r * part // 2:(r + 1) * part // 2],
                                      act.block_scales[:, r * part // 16:(r + 1) * part // 16], act.global_scale,
                                      "linear", (3, part)), layers[r].local.weight, None, None, np.float64)
                for r in range(world)) + b[:32]
    outs = dist.SimulatedGroup(world).run(
        lambda c: layers[c.rank](np.ascontiguousarray(x[:, c.rank * part:(c.rank + 1) * part])))
    assert gref.calc_diff(outs[0].astype(np.float32), exact) < 1e-5


def test_tensor_parallel_bad_inputs(rng):
    w, b = _linear_weights(rng, n=48, k=96)
    group = dist.SimulatedGroup(4)
    with pytest.raises(ValueError, match="weight: out_features N: 46 is not divisible by comm.world_size=4"):
        group.run(lambda c: dist.ColumnParallelLinear.from_float(w[:46], c))
    with pytest.raises(ValueError, match="weight: in_features K: 96 is not divisible by comm.world_size=4 times 16"):
        group.run(lambda c: dist.RowParallelLinear.from_float(w, c))
    with pytest.raises(ValueError, match=r"bias: expected \[48\]"):
        group.run(lambda c: dist.ColumnParallelLinear.from_float(w, c, bias=b[:5]))
    with pytest.raises(TypeError, match="comm: expected an fp4kit.distributed Communicator"):
        dist.ColumnParallelLinear.from_float(w, "nccl")
    full = Linear.from_float(w[:, :64].copy(), bias=b)
    with pytest.raises(ValueError, match="local: the local Linear must have no bias"):
        dist.RowParallelLinear(full, dist.LocalCommunicator())
    with pytest.raises(ValueError, match="activation_scale: expected one of"):
        dist.RowParallelLinear.shard(full, dist.LocalCommunicator(), activation_scale="max")
    layers = dist.SimulatedGroup(2).run(lambda c: (dist.RowParallelLinear.shard(full, c),
                                                   dist.ColumnParallelLinear.shard(full, c)))
    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., 32\] \(this rank's slice\)"):
        layers[0][0](np.zeros((2, 64), BF16))
    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., 64\]"):
        layers[0][1](np.zeros((2, 32), BF16))


# -- expert-parallel MoE -----------------------------------------------------------------------------
def _moe_weights(rng, e=8, h=64, i=32):
    return ((rng.standard_normal((e, h)) / 8).astype(np.float32), rng.standard_normal((e, i, h)).astype(np.float32),
            rng.standard_normal((e, i, h)).astype(np.float32) * 0.1, rng.standard_normal((e, h, i)).astype(np.float32))


def _shared(rng, h=64, i=32, mode="w4a4"):
    return SharedExpert.from_float(*(rng.standard_normal(s).astype(np.float32) for s in ((i, h), (i, h), (h, i))),
                                   limit=10.0, mode=mode)


def _check_ep_equals_single(rng, moe, world, t, token_ids=None, **ep_kwargs):
    xs = [rng.standard_normal((t, moe.hidden)).astype(BF16) for _ in range(world)]
    xs[world - 1][0] *= 30  # the largest input amax on the last rank
    ids = None if token_ids is None else [token_ids[r * t:(r + 1) * t] for r in range(world)]
    expected = moe(np.concatenate(xs), None if token_ids is None else token_ids[:world * t])
    outs = dist.SimulatedGroup(world).run(
        lambda c: dist.ExpertParallelMoE.shard(moe, c, **ep_kwargs)(xs[c.rank], None if ids is None else ids[c.rank]))
    assert np.array_equal(bits(np.concatenate(outs)), bits(expected))
    return outs


V4 = RoutingConfig(top_k=3, score_func="sqrtsoftplus", routed_scale=1.5)
V3 = RoutingConfig(top_k=4, score_func="sigmoid", n_group=4, topk_group=2, routed_scale=2.5)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("routing, before", [(V4, True), (V3, False)])
@pytest.mark.parametrize("fused", [True, False])
def test_expert_parallel_equals_the_single_layer_on_all_tokens(rng, world, routing, before, fused):
    gate, w1, w3, w2 = _moe_weights(rng)
    bias = rng.standard_normal(8).astype(np.float32) * 0.1
    moe = MoE.from_float(gate, w1, w3, w2, routing, fused=fused, limit=10.0, weight_before_down=before,
                         bias=bias, shared=_shared(rng))
    for t in (1, 5):
        _check_ep_equals_single(rng, moe, world, t)
    status.clear(device=-1)
    assert not status.read(device=-1) & dist.EP_CAPACITY_OVERFLOW


@pytest.mark.parametrize("world", WORLDS)
def test_expert_parallel_w4a16_hash_routing_and_no_shared(rng, world):
    gate, w1, w3, w2 = _moe_weights(rng)
    tid2eid = rng.integers(0, 8, (50, 3)).astype(np.int32)
    tid2eid[:, 1] = (tid2eid[:, 0] + 1) % 8
    tid2eid[:, 2] = (tid2eid[:, 0] + 2) % 8
    tokens = rng.integers(0, 50, 4 * world).astype(np.int32)
    hashed = MoE.from_float(gate, w1, w3, w2, V4, limit=10.0, tid2eid=tid2eid, mode="w4a16",
                            shared=_shared(rng, mode="w4a16"))
    _check_ep_equals_single(rng, hashed, world, 4, token_ids=tokens)
    plain = MoE.from_float(gate, w1, w3, w2, V4, limit=10.0)
    _check_ep_equals_single(rng, plain, world, 3)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("routing, before", [(V4, True), (V3, False)])
def test_expert_parallel_swiglu_in_the_gemm_epilogue(rng, monkeypatch, swiglu_epilogue_launches, world, routing,
                                                     before):
    """With GROUPED_SWIGLU_EPILOGUE a W4A16 rank's gate|up grouped GEMM writes the SwiGLU output
    itself (no h, no SwiGLU launch): the same bits as the single layer."""
    gate, w1, w3, w2 = _moe_weights(rng)
    moe = MoE.from_float(gate, w1, w3, w2, routing, limit=10.0, weight_before_down=before, mode="w4a16",
                         shared=_shared(rng, mode="w4a16"))
    epilogues = swiglu_epilogue_launches(dist_kernels)
    monkeypatch.setattr(moe_layer, "GROUPED_SWIGLU_EPILOGUE", True)
    _check_ep_equals_single(rng, moe, world, 5)
    # per rank (the simulated ranks run side by side): gate|up with the SwiGLU, then down
    assert epilogues.count(True) == epilogues.count(False) == world


def test_expert_parallel_with_static_shared_scales(rng):
    gate, w1, w3, w2 = _moe_weights(rng)
    sh = _shared(rng)
    static = SharedExpert(Linear(sh.gate_up.weight, input_scale=np.array(np.float32(300.0))),
                          Linear(sh.down.weight, input_scale=np.array(np.float32(50.0))), limit=10.0)
    moe = MoE.from_float(gate, w1, w3, w2, V4, limit=10.0, shared=static)
    _check_ep_equals_single(rng, moe, 2, 4)


def test_expert_parallel_from_float_equals_shard(rng):
    gate, w1, w3, w2 = _moe_weights(rng)
    moe = MoE.from_float(gate, w1, w3, w2, V4, limit=10.0)
    x = rng.standard_normal((4, 64)).astype(BF16)
    group = dist.SimulatedGroup(2)
    a = group.run(lambda c: dist.ExpertParallelMoE.shard(moe, c)(x))
    b = group.run(lambda c: dist.ExpertParallelMoE.from_float(gate, w1, w3, w2, V4, c, limit=10.0)(x))
    layers = group.run(lambda c: dist.ExpertParallelMoE.from_float(gate, w1, w3, w2, V4, c, limit=10.0))
    assert [layer.experts for layer in layers] == [range(0, 4), range(4, 8)]
    assert layers[1].w13.packed.shape[0] == 4
    for ya, yb in zip(a, b):
        assert np.array_equal(bits(ya), bits(yb))


def test_capacity_overflow_is_recorded_and_default_capacity_never_overflows(rng):
    gate, w1, w3, w2 = _moe_weights(rng)
    bias = np.zeros(8, np.float32)
    bias[[0, 1, 2]] = 100.0  # every token picks experts 0, 1, 2: all on rank 0 of 2
    moe = MoE.from_float(gate, w1, w3, w2, V4, limit=10.0, bias=bias)
    layers = dist.SimulatedGroup(2).run(lambda c: dist.ExpertParallelMoE.shard(moe, c))
    assert layers[0].capacity(16) == 48  # T * min(top_k, experts per rank)
    status.clear(device=-1)
    _check_ep_equals_single(rng, moe, 2, 16)  # everything fits
    assert not status.read(device=-1) & dist.EP_CAPACITY_OVERFLOW
    small = dist.SimulatedGroup(2).run(lambda c: dist.ExpertParallelMoE.shard(moe, c, capacity_factor=1.0))
    assert small[0].capacity(16) == 24  # ceil(1.0 * 16 * 3 / 2)
    x = rng.standard_normal((16, 64)).astype(BF16)
    outs = dist.SimulatedGroup(2).run(lambda c: small[c.rank](x))
    assert status.read(device=-1) & dist.EP_CAPACITY_OVERFLOW
    assert "all-to-all capacity" in " ".join(status.describe(status.read(device=-1)))
    assert all(np.isfinite(o.astype(np.float32)).all() for o in outs)
    # the last 24 pairs of each rank (experts 1 and 2 sort last) were dropped: those tokens lost them
    full = moe(x).astype(np.float32)
    assert not np.array_equal(outs[0].astype(np.float32), full)


def test_expert_parallel_bad_inputs(rng):
    gate, w1, w3, w2 = _moe_weights(rng, e=6)
    moe = MoE.from_float(gate, w1, w3, w2, V4, limit=10.0)
    with pytest.raises(ValueError, match="comm: world_size 4 must divide the number of experts 6"):
        dist.SimulatedGroup(4).run(lambda c: dist.ExpertParallelMoE.shard(moe, c))
    with pytest.raises(ValueError, match="comm: world_size 4 must divide the number of experts 6"):
        dist.SimulatedGroup(4).run(lambda c: dist.ExpertParallelMoE.from_float(gate, w1, w3, w2, V4, c))
    with pytest.raises(ValueError, match=r"w2: expected \[6 experts, rows, cols\]"):
        dist.ExpertParallelMoE.from_float(gate, w1, w3, w2[:5], V4, dist.LocalCommunicator())
    comm = dist.SimulatedGroup(2).comms[0]
    with pytest.raises(ValueError, match="w2: expected this rank's 3 experts .6 experts over world_size 2., got a stack of 6"):
        dist.ExpertParallelMoE(gate, moe.w2, V4, comm, w13=moe.w13)
    with pytest.raises(ValueError, match="capacity_factor: expected a positive number"):
        dist.ExpertParallelMoE.shard(moe, dist.LocalCommunicator(), capacity_factor=0)
    with pytest.raises(TypeError, match="comm: expected an fp4kit.distributed Communicator"):
        dist.ExpertParallelMoE(gate, moe.w2, V4, None, w13=moe.w13)
    with pytest.raises(TypeError, match="moe: expected an fp4kit.layers.MoE"):
        dist.ExpertParallelMoE.shard(object(), dist.LocalCommunicator())
    with pytest.raises(ValueError, match="top_k: expected 1..6"):
        dist.ExpertParallelMoE(gate, moe.w2, RoutingConfig(top_k=7), dist.LocalCommunicator(), w13=moe.w13)
    ep = dist.ExpertParallelMoE.shard(moe, dist.LocalCommunicator())
    with pytest.raises(ValueError, match=r"x: expected \[tokens, 64\]"):
        ep(np.zeros((2, 32), BF16))
    with pytest.raises(TypeError, match="x: expected bfloat16"):
        ep(np.zeros((2, 64), np.float32))
    hashed = dist.ExpertParallelMoE.shard(
        MoE(gate, moe.w2, V4, w13=moe.w13, tid2eid=np.zeros((5, 3), np.int32)), dist.LocalCommunicator())
    with pytest.raises(ValueError, match="token_ids: hash routing needs"):
        hashed(np.zeros((2, 64), BF16))
    with pytest.raises(ValueError, match=r"token_ids: expected int32 \[2\]"):
        hashed(np.zeros((2, 64), BF16), np.zeros(3, np.int32))


def test_kernel_module_constants():
    assert dist.EP_CAPACITY_OVERFLOW not in (status.NONFINITE_INPUT, status.INDEXER_INPUT, status.KV_COMP_OVERFLOW,
                                              status.SAMPLER_INPUT, getattr(status, "TOKEN_RANGE", 0))
    assert dist.EP_CAPACITY_OVERFLOW is status.EP_CAPACITY_OVERFLOW  # re-exported, named once (test_status_flags)


def test_multigpu_scripts_use_only_what_fp4kit_has():
    """Both scripts need several GPUs to run; here every fp4kit module they import or launch
    (``-m fp4kit...``), every name they import from one, and every attribute they take of an
    imported fp4kit module must exist, so a renamed or removed API fails here rather than on the
    multi-GPU machine."""
    import ast
    import importlib
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in ("tests/multigpu/check_dist.py", "benchmarks/bench_dist.py"):
        source = open(os.path.join(root, path)).read()
        tree = ast.parse(source, path)
        modules = {}  # local name -> fp4kit module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp4kit"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    value = getattr(module, alias.name, None)
                    if value is None:  # a submodule not imported by its package yet
                        value = importlib.import_module(f"{node.module}.{alias.name}")
                    if isinstance(value, type(os)):
                        modules[alias.asname or alias.name] = value
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("fp4kit"):
                        modules[alias.asname or alias.name.split(".")[0]] = importlib.import_module(alias.name)
        assert modules, f"{path}: no fp4kit import found"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                assert hasattr(modules[node.value.id], node.attr), f"{path}:{node.lineno}: {node.value.id}.{node.attr}"
        for launched in re.findall(r"-m[\s\",']+(fp4kit(?:\.\w+)+)", source):
            assert importlib.util.find_spec(launched) is not None, f"{path}: launches {launched}, which does not exist"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_expert_parallel_replicated_tokens_equal_the_single_layer(rng, world, mode):
    """Every rank passes the same tokens (after tensor-parallel attention): no dispatch all-to-all,
    one all-gather of the results; every rank gets the single-device output."""
    gate, w1, w3, w2 = _moe_weights(rng)
    for routing, before in ((V4, True), (V3, False)):
        moe = MoE.from_float(gate, w1, w3, w2, routing, limit=10.0, weight_before_down=before, mode=mode,
                             shared=_shared(rng, mode=mode))
        for t in (1, 6):
            x = rng.standard_normal((t, 64)).astype(BF16)
            expected = moe(x)
            outs = dist.SimulatedGroup(world).run(lambda c: dist.ExpertParallelMoE.shard(moe, c, tokens="replicated")(x))
            for y in outs:
                assert np.array_equal(bits(y), bits(expected))
    with pytest.raises(ValueError, match="tokens: expected one of"):
        dist.ExpertParallelMoE.shard(moe, dist.LocalCommunicator(), tokens="split")


def test_init_at_world_size_two_needs_nccl(monkeypatch, tmp_path):
    _cupy_without_nccl(monkeypatch)
    monkeypatch.setenv(dist_env.WORLD_SIZE, "2")
    monkeypatch.setenv(dist_env.RANK, "0")
    monkeypatch.setenv(dist_env.RENDEZVOUS, str(tmp_path))
    for key in dist_env.NO_MULTICAST:
        monkeypatch.setenv(key, "7")  # restored after the test; init must override it
    with pytest.raises(RuntimeError, match="NCCL: CuPy could not load libnccl.so.2"):
        dist.init()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # set before NCCL is touched
    assert not list(tmp_path.iterdir())  # no id published without NCCL


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sharded", [False, True])
def test_expert_parallel_ignores_the_ticket_order_of_each_rank(rng, world, sharded, monkeypatch):
    """On the GPU the router draws tickets from atomics: the order of an expert's pairs differs
    between ranks (and calls). Replicated tokens once combined their own slots with the owner's rows
    (wrong rows on real GPUs, invisible with the reference's pair-order tickets): here every rank but
    0 reverses its tickets within each expert, and the result must not change."""
    real_route = dist.kernels.route

    def route(x, layer, token_ids, ids, weights, counts, tickets, logits):
        real_route(x, layer, token_ids, ids, weights, counts, tickets, logits)
        if layer.comm.rank % 2:  # reversed within every expert
            per_expert = np.bincount(ids.reshape(-1), minlength=layer.num_experts)
            tickets[...] = (per_expert[ids] - 1 - tickets).astype(np.uint32)
        elif layer.comm.rank:  # rotated by one within every expert
            per_expert = np.bincount(ids.reshape(-1), minlength=layer.num_experts)
            tickets[...] = ((tickets.astype(np.int64) + 1) % per_expert[ids]).astype(np.uint32)

    monkeypatch.setattr(dist.kernels, "route", route)
    gate, w1, w3, w2 = _moe_weights(rng)
    moe = MoE.from_float(gate, w1, w3, w2, V4, limit=10.0, shared=_shared(rng))
    t = 16  # 48 pairs on 8 experts: many experts get several pairs
    if sharded:
        _check_ep_equals_single(rng, moe, world, t)
        return
    x = rng.standard_normal((t, 64)).astype(BF16)
    expected = moe(x)
    outs = dist.SimulatedGroup(world).run(lambda c: dist.ExpertParallelMoE.shard(moe, c, tokens="replicated")(x))
    for y in outs:
        assert np.array_equal(bits(y), bits(expected))


def test_owner_slots_reference():
    slot_all = np.array([[0, 1, 2, 3], [10, 11, 12, 13]], np.uint32)
    ids = np.array([[0, 3], [2, 1]], np.int32)  # per_rank 2: owners 0, 1, 1, 0
    out = np.empty(4, np.uint32)
    dist.kernels.owner_slots(slot_all, ids, 2, out)
    assert out.tolist() == [0, 11, 12, 3]


def test_shutdown_meets_every_rank_then_releases():
    """`dist.shutdown`, the end of a run on every rank: a barrier of all ranks, then close()."""
    closed = []

    def end(comm):
        comm.close = lambda: closed.append(comm.rank)
        dist.shutdown(comm)
        return comm.rank

    assert dist.SimulatedGroup(4).run(end) == [0, 1, 2, 3]
    assert sorted(closed) == [0, 1, 2, 3]
    dist.shutdown(dist.LocalCommunicator())  # world size 1: nothing to meet, nothing to release
