"""Multi-GPU check of fp4kit.distributed over NCCL: collectives, tensor-parallel Linear and
expert-parallel MoE against the single-GPU layers, capacity overflow, and a sharded step captured
in a CUDA graph. Run by the launcher (one process per GPU):

    .venv/bin/python -m fp4kit.distributed.launch --nproc 2 tests/multigpu/check_dist.py

Every rank builds the same full layers from the same seed, shards them, and compares its sharded
result with the single-GPU layer on its own GPU. Rank 0 prints one PASS/FAIL line per check (the
group's verdict); a failing rank prints its details. Exits non-zero on any failure (an exception
ends the process at once, so the launcher stops the other ranks instead of leaving them waiting in
a collective).
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from fp4kit import distributed as dist  # noqa: E402
from fp4kit.layers import Linear, MoE, RoutingConfig, SharedExpert  # noqa: E402
from fp4kit.reference.gemm import calc_diff  # noqa: E402
from fp4kit.runtime import status  # noqa: E402

BF16 = ml_dtypes.bfloat16
V4 = RoutingConfig(top_k=6, score_func="sqrtsoftplus", routed_scale=1.5)
V3 = RoutingConfig(top_k=8, score_func="sigmoid", n_group=8, topk_group=4, routed_scale=2.5)
TOLERANCE = 1e-6  # calc_diff bound where fp32 sums run in another order (row-parallel); others: bit-exact

comm = dist.init()
rank, world = comm.rank, comm.world_size
failures: list[str] = []


def host(a):
    return cp.asnumpy(a).astype(np.float32)


def same_bits(a, b) -> bool:
    return np.array_equal(cp.asnumpy(a).view(np.uint16), cp.asnumpy(b).view(np.uint16))


def describe_diff(got, ref) -> str:
    """Where two arrays differ: worst |difference|, calc_diff, differing elements (bitwise), the
    first differing [row, col] and the worst row, with both values there (empty when identical)."""
    g, r = cp.asnumpy(got), cp.asnumpy(ref)
    if g.shape != r.shape:
        return f"shape {g.shape} != {r.shape}"
    width = g.dtype.itemsize
    differ = g.view(f"u{width}") != r.view(f"u{width}") if width in (1, 2, 4, 8) else g != r
    if not differ.any():
        return ""
    gf, rf = g.astype(np.float64), r.astype(np.float64)
    delta = np.abs(gf - rf)
    delta[np.isnan(delta)] = np.inf
    worst = np.unravel_index(int(np.argmax(delta)), delta.shape)
    first = np.unravel_index(int(np.argmax(differ)), differ.shape)
    rows = sorted({int(i) for i in np.nonzero(differ.reshape(differ.shape[0], -1).any(1))[0]})
    return (f"max|diff| {delta[worst]:.4g} at {tuple(map(int, worst))} (got {gf[worst]:.6g}, ref {rf[worst]:.6g}), "
            f"calc_diff {calc_diff(gf.astype(np.float32), rf.astype(np.float32)):.3e}, "
            f"{int(differ.sum())}/{differ.size} elements differ, first at {tuple(map(int, first))}, "
            f"rows {rows[:12]}{'...' if len(rows) > 12 else ''} of {g.shape[0]}")


def ranks_agree(a) -> str:
    """Empty when every rank holds the same bits of ``a``, else which ranks differ from rank 0."""
    a = cp.ascontiguousarray(a)
    everything = cp.empty((world, *a.shape), a.dtype)
    comm.all_gather(a, everything)
    cp.cuda.get_current_stream().synchronize()
    bad = [r for r in range(1, world) if not same_bits(everything[r], everything[0])]
    return "" if not bad else f"ranks {bad} differ from rank 0: {describe_diff(everything[bad[0]], everything[0])}"


def report(name: str, ok: bool, detail: str) -> None:
    """The group's verdict: all ranks must pass."""
    flag = cp.array([0.0 if ok else 1.0], cp.float32)
    comm.all_reduce(flag, "max")
    group_ok = float(flag.get()[0]) == 0.0
    if not ok:
        print(f"[rank {rank}] FAIL {name}: {detail}", flush=True)
    if rank == 0:
        print(f"{'PASS' if group_ok else 'FAIL'} {name}: {detail}" if group_ok else f"FAIL {name}", flush=True)
    if not group_ok:
        failures.append(name)


def check(name):
    def wrap(fn):
        try:
            ok, detail = fn()
        except Exception:  # noqa: BLE001 - any error ends the rank; the launcher stops the others
            print(f"[rank {rank}] FAIL {name}: exception\n{traceback.format_exc()}", flush=True)
            sys.stdout.flush()
            os._exit(1)
        report(name, ok, detail)
        return fn
    return wrap


def dev(a):
    return cp.asarray(a)


@check("collectives: all_reduce sum/max/min (fp32, bf16), all_gather, all_to_all (grouped)")
def _collectives():
    x = cp.arange(5, dtype=cp.float32) + rank
    s, mx, mn = x.copy(), x.copy(), x.copy()
    comm.all_reduce(s, "sum"), comm.all_reduce(mx, "max"), comm.all_reduce(mn, "min")
    b = cp.full(8, rank + 1, BF16)
    comm.all_reduce(b, "sum")
    g = cp.empty((world, 3), cp.int32)
    comm.all_gather(cp.full(3, rank, cp.int32), g)
    send_a = cp.asarray([[100 * rank + d] * 4 for d in range(world)], cp.int64)
    send_b = cp.arange(world * 16, dtype=cp.uint8).reshape(world, 16) + rank
    recv_a, recv_b = cp.empty_like(send_a), cp.empty_like(send_b)
    comm.all_to_all([send_a, send_b], [recv_a, recv_b])
    cp.cuda.get_current_stream().synchronize()
    base = np.arange(5)
    ok = (np.array_equal(s.get(), world * base + sum(range(world))) and np.array_equal(mx.get(), base + world - 1)
          and np.array_equal(mn.get(), base) and np.all(host(b) == world * (world + 1) / 2)
          and np.array_equal(g.get(), np.repeat(np.arange(world)[:, None], 3, 1))
          and np.array_equal(recv_a.get()[:, 0], 100 * np.arange(world) + rank)
          and np.array_equal(recv_b.get(), (np.arange(world * 16).reshape(world, 16)[rank][None] + np.arange(world)[:, None])
                             .astype(np.uint8)))
    return ok, f"world {world}"


def _linear_weights(seed, n, k):
    r = np.random.default_rng(seed)
    return (dev((r.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)),
            dev(r.standard_normal(n).astype(np.float32)))


@check("ColumnParallelLinear.shard == Linear (bit-exact), gathered and sharded, T in {1, 5, 64}")
def _column():
    details, ok = [], True
    for n, k in ((4096, 2048), (2056, 1024)):
        w, b = _linear_weights(1, n, k)
        full = Linear.from_float(w, bias=b)
        col = dist.ColumnParallelLinear.shard(full, comm)
        part = dist.ColumnParallelLinear.shard(full, comm, gather_output=False)
        for t in (1, 5, 64):
            x = dev(np.random.default_rng(t).standard_normal((t, k)).astype(BF16))
            ref = full(x).copy()
            got, mine = col(x), part(x)
            sl = slice(rank * n // world, (rank + 1) * n // world)
            for name, d in (("gathered", describe_diff(got, ref)),
                            ("sharded", describe_diff(mine, cp.asnumpy(ref)[:, sl]))):
                if d:
                    ok = False
                    details.append(f"{n}x{k} T={t} rank {rank} output {name}: {d}")
            if ok:
                details.append(f"{n}x{k} T={t}")
    return ok, ", ".join(details)


@check(f"RowParallelLinear.shard == Linear (calc_diff <= {TOLERANCE}), group activation scale, T in {{1, 5, 64}}")
def _row():
    worst, ok, bad = 0.0, True, []
    for n, k in ((4096, 2048), (2048, 7168)):
        w, b = _linear_weights(2, n, k)
        full = Linear.from_float(w, bias=b)
        row = dist.RowParallelLinear.shard(full, comm)
        row_full_input = dist.RowParallelLinear.shard(full, comm, input_is_sharded=False)
        kk = k // world
        for t in (1, 5, 64):
            xh = np.random.default_rng(10 + t).standard_normal((t, k)).astype(BF16)
            xh[0, 3] = 50.0  # the largest amax lives on rank 0's slice only
            x = dev(xh)
            ref = host(full(x))
            got = host(row(dev(xh[:, rank * kk:(rank + 1) * kk])))
            d = calc_diff(got, ref)
            worst = max(worst, d)
            full_input = host(row_full_input(x))
            if d > TOLERANCE:
                ok = False
                bad.append(f"{n}x{k} T={t} rank {rank} output vs Linear: {describe_diff(got, ref)}")
            if not np.array_equal(got, full_input):
                ok = False
                bad.append(f"{n}x{k} T={t} rank {rank} output sharded vs full input: {describe_diff(got, full_input)}")
    return ok, f"worst calc_diff {worst:.2e}" + "".join(f"; {b}" for b in bad)


def _moe(seed, e, h, i, routing, **kwargs):
    r = np.random.default_rng(seed)
    gate = dev((r.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32))
    w1, w3 = (dev((r.standard_normal((e, i, h)) / np.sqrt(h)).astype(np.float32)) for _ in range(2))
    w2 = dev((r.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32))
    shared = SharedExpert.from_float(*(dev((r.standard_normal(s) / np.sqrt(s[1])).astype(np.float32))
                                       for s in ((i, h), (i, h), (h, i))), limit=10.0,
                                     mode=kwargs.get("mode", "w4a4"))
    # the decode GEMM at every row count: the single-GPU layer runs world x T rows, each rank T, and
    # the shared expert must take the same kernel for both (the prefill path sums in another order)
    shared.gate_up.decode_max_m = shared.down.decode_max_m = 1 << 30
    return MoE.from_float(gate, w1, w3, w2, routing, limit=10.0, shared=shared, **kwargs)


def _ep_against_single(moe, ts, **ep_kwargs):
    ep = dist.ExpertParallelMoE.shard(moe, comm, **ep_kwargs)
    worst, exact, ok, bad = 0.0, True, True, []
    for t in ts:
        r = np.random.default_rng(100 + t)
        xs = [r.standard_normal((t, moe.hidden)).astype(BF16) for _ in range(world)]
        xs[-1][0] *= 30  # the largest input amax on the last rank
        ref = cp.asnumpy(moe(dev(np.concatenate(xs))))[rank * t:(rank + 1) * t]
        got = ep(dev(xs[rank]))
        d = calc_diff(host(got), host(ref))
        worst, exact = max(worst, d), exact and same_bits(got, ref)
        if d > TOLERANCE:
            ok = False
            bad.append(f"T={t} rank {rank} output (this rank's rows of MoE): {describe_diff(got, ref)}")
    return ok, f"worst calc_diff {worst:.2e}, bit-exact: {exact}" + "".join(f"; {b}" for b in bad)


@check("ExpertParallelMoE == MoE on all ranks' tokens: V4 routing, 256 experts, shared expert, T in {1, 7, 64}")
def _ep_v4():
    return _ep_against_single(_moe(3, 256, 1024, 256, V4), (1, 7, 64))


@check("ExpertParallelMoE == MoE: V3 grouped routing, weight after down, unfused W1/W3, T in {1, 33}")
def _ep_v3():
    return _ep_against_single(_moe(4, 64, 1024, 512, V3, weight_before_down=False, fused=False), (1, 33))


@check("ExpertParallelMoE == MoE: W4A16, T in {1, 16}")
def _ep_w4a16():
    return _ep_against_single(_moe(5, 64, 512, 256, V4, mode="w4a16"), (1, 16))


@check("ExpertParallelMoE(tokens='replicated') == MoE on the same tokens on every rank (bit-exact), T in {1, 5, 64}")
def _ep_replicated():
    moe = _moe(10, 256, 1024, 256, V4)
    ep = dist.ExpertParallelMoE.shard(moe, comm, tokens="replicated")
    ok, bad = True, []
    for t in (1, 5, 64):
        x = dev(np.random.default_rng(200 + t).standard_normal((t, 1024)).astype(BF16))
        ref = moe(x).copy()
        got = ep(x).copy()
        again = ep(x).copy()  # the tickets (atomics) may come in another order: the result must not change
        for name, d in (("vs MoE", describe_diff(got, ref)), ("second call vs first", describe_diff(again, got)),
                         ("across ranks", ranks_agree(got))):
            if d:
                ok = False
                bad.append(f"T={t} rank {rank} output {name}: {d}")
    return ok, "all-gather of the result rows, no dispatch all-to-all" + "".join(f"; {b}" for b in bad)


@check("ExpertParallelMoE capacity overflow recorded in the status word (and none at the default capacity)")
def _overflow():
    bias = np.zeros(64, np.float32)
    bias[:6] = 100.0  # every token to experts 0..5 (rank 0's)
    moe = _moe(6, 64, 512, 256, V4, bias=dev(bias))
    x = dev(np.random.default_rng(rank).standard_normal((32, 512)).astype(BF16))
    status.clear()
    dist.ExpertParallelMoE.shard(moe, comm)(x)
    clean = not status.read() & dist.EP_CAPACITY_OVERFLOW
    y = dist.ExpertParallelMoE.shard(moe, comm, capacity_factor=0.5)(x)
    flagged = bool(status.read() & dist.EP_CAPACITY_OVERFLOW)
    finite = bool(np.isfinite(host(y)).all())
    status.clear()
    return clean and flagged and finite, f"default clean: {clean}, factor 0.5 flagged: {flagged}"


def _replay_equals_eager(step, x, make_input, names, calls=3):
    """Failure descriptions (empty when every replay equals the eager step on the same input)."""
    outs = step()
    o_ref = dict(zip(names, outs))
    # the eager step ran on the current stream, which a non-blocking stream does not wait for: let
    # it finish before the replays write the same buffers
    cp.cuda.get_current_stream().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    bad = []
    for j in range(calls):
        x.set(make_input(j), stream=stream)
        graph.launch(stream)
        stream.synchronize()
        replayed = [cp.asnumpy(o).copy() for o in outs]
        with cp.cuda.Stream(non_blocking=True) as s:
            eager_outs = step()
            eager = [cp.asnumpy(o.copy()) for o in eager_outs]
            s.synchronize()
        for name, a, b, e in zip(names, replayed, eager, eager_outs):
            if e.data.ptr != o_ref[name].data.ptr:
                bad.append(f"replay {j} output {name}: eager returned another buffer than the captured one")
            d = describe_diff(a, b)
            if d:
                bad.append(f"replay {j} output {name} (replayed vs eager): {d}")
    return bad


@check("CUDA graph: a sharded step (column -> row parallel Linear, EP MoE sharded and replicated) captured "
       "with NCCL inside, "
       "replayed with new inputs == eager")
def _graph():
    h = 1024
    up = dist.ColumnParallelLinear.from_float(_linear_weights(7, 2048, h)[0], comm, gather_output=False)
    down = dist.RowParallelLinear.from_float(_linear_weights(8, h, 2048)[0], comm)
    moe = _moe(9, 64, h, 512, V4)
    ep = dist.ExpertParallelMoE.shard(moe, comm)
    ep_replicated = dist.ExpertParallelMoE.shard(moe, comm, tokens="replicated")
    ok, bad = True, []
    for t in (1, 16):
        x = cp.zeros((t, h), BF16)

        def step():
            y = down(up(x))
            return y, ep(y), ep_replicated(y)

        # the same input on every rank (tensor parallelism); the EP layer then routes the same tokens
        fails = _replay_equals_eager(step, x, lambda j: np.random.default_rng(j).standard_normal((t, h)).astype(BF16),
                                     ("row-parallel y", "EP sharded", "EP replicated"))
        ok &= not fails
        bad += [f"T={t} rank {rank} {f}" for f in fails]
    return ok, "T in {1, 16}" + "".join(f"; {b}" for b in bad)


comm.barrier()
if rank == 0:
    print(f"{'ALL PASS' if not failures else f'{len(failures)} FAILED'} (world size {world})", flush=True)
sys.exit(1 if failures else 0)
