"""Benchmark: the expert-parallel MoE layer over NCCL at DeepSeek-V4-Flash shape (hidden 4096, 256
experts, top-6, inner 2048, one shared expert, W4A4), EP = world size, against the single-GPU layer
measured in the same run. Run by the launcher, one process per GPU:

    .venv/bin/python -m fp4kit.distributed.launch --nproc 2 benchmarks/bench_dist.py

Every rank builds the same full layer (benchmarks/bench_moe.py's `build`, same seed), keeps it for
the single-GPU baseline, and shards it. Each rank brings T tokens of its own; a call is
graph-replayed (all collectives inside the graph), four different inputs per graph. Columns:

* ``EP µs``: one EP layer call (router, input quantization, plans, the dispatch all-to-all, the
  group-scale all-reduces, the local experts, the return all-to-all, combine, shared expert), the
  slowest rank;
* ``EP replicated µs``: the same layer with ``tokens="replicated"`` (every rank passes the same T
  tokens, as after tensor-parallel attention: no dispatch all-to-all, one all-gather of the
  results), the slowest rank; compare with ``1-GPU µs (T)``;
* ``1-GPU µs (T)``: the single-GPU layer on the same T tokens (what one rank would take alone);
* ``1-GPU µs (world x T)``: the single-GPU layer on all ranks' tokens at once (the same work the
  EP group does in one call); ``speedup`` = that / EP µs;
* ``a2a MB``: bytes one rank sends per call in both all-to-alls (fixed-capacity buffers, default
  capacity: no overflow possible).

Not measured here: the decode step with TP/EP (examples/decode.py), the tensor-parallel Linear.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from fp4kit import distributed as dist  # noqa: E402

try:
    from benchmarks.bench_moe import CONFIGS, build
    from benchmarks.common import Table, command_line, device_name, graph_us
except ImportError:
    from bench_moe import CONFIGS, build
    from common import Table, command_line, device_name, graph_us

BF16 = ml_dtypes.bfloat16
TOKENS = (1, 64, 512)
ROTATE = 4  # inputs per graph


def a2a_bytes(ep: dist.ExpertParallelMoE, t: int) -> int:
    """Bytes one rank sends per call: dispatch (counts, weights, NVFP4 rows) + return (fp32 rows)."""
    world, cap, h = ep.comm.world_size, ep.capacity(t), ep.hidden
    dispatch = world * (ep.experts_per_rank * 4 + cap * (4 + h // 2 + h // 16))
    return dispatch + world * cap * h * 4


def main() -> None:
    comm = dist.init()
    rank, world = comm.rank, comm.world_size
    cfg = CONFIGS["V4-Flash"]
    layer, _ = build(cfg)  # the same seed on every rank: identical full layers
    ep = dist.ExpertParallelMoE.shard(layer, comm)
    ep_replicated = dist.ExpertParallelMoE.shard(layer, comm, tokens="replicated")
    rng = np.random.default_rng(1234 + rank)
    table = Table(f"Expert-parallel MoE layer, V4-Flash, W4A4, EP={world} over NCCL, graph-replayed ({device_name()})",
                  ["T per rank", "EP µs", "1-GPU µs (T)", f"1-GPU µs ({world} x T)", "speedup", "capacity rows",
                   "a2a MB", "EP replicated µs", "replicated speedup"])
    for t in TOKENS:
        hosts = [rng.standard_normal((t, cfg["hidden"])).astype(BF16) for _ in range(ROTATE)]
        xs = [cp.asarray(a) for a in hosts]
        same = [cp.asarray(np.random.default_rng(j).standard_normal((t, cfg["hidden"])).astype(BF16))
                for j in range(ROTATE)]  # the same tokens on every rank
        ep_us = graph_us(lambda j: ep(xs[j % ROTATE]), calls=ROTATE, replays=20)
        rep_us = graph_us(lambda j: ep_replicated(same[j % ROTATE]), calls=ROTATE, replays=20)
        slowest = cp.array([ep_us, rep_us], cp.float32)
        comm.all_reduce(slowest, "max")
        single_us = graph_us(lambda j: layer(xs[j % ROTATE]), calls=ROTATE, replays=20)
        alls = [cp.asarray(np.concatenate([hosts[(j + r) % ROTATE] for r in range(world)])) for j in range(ROTATE)]
        single_all_us = graph_us(lambda j: layer(alls[j % ROTATE]), calls=ROTATE, replays=20)
        del alls
        ep_max, rep_max = (float(v) for v in slowest.get())
        if rank == 0:
            table.add(**{"T per rank": t, "EP µs": ep_max, "1-GPU µs (T)": single_us,
                         f"1-GPU µs ({world} x T)": single_all_us, "speedup": single_all_us / ep_max,
                         "capacity rows": ep.capacity(t), "a2a MB": a2a_bytes(ep, t) / 1e6,
                         "EP replicated µs": rep_max, "replicated speedup": single_us / rep_max})
        comm.barrier()
    if rank == 0:
        print()
        print(table.markdown())
        meta = {"device": device_name(), "world_size": world, "cupy": cp.__version__,
                "nccl": _nccl_version(), "capacity": "default (no overflow possible)"}
        print("saved", table.save("bench_dist", meta))


def _nccl_version():
    from fp4kit.distributed import nccl_lib

    try:
        return nccl_lib.load().get_version()
    except RuntimeError:
        return None


#: GPUs this benchmark runs on (benchmarks/run_all.py skips it on a machine with fewer)
GPUS = 2

if __name__ == "__main__":
    command_line(__doc__)  # no flags: --help, or a stray flag stops here, before any process starts
    if "FP4KIT_RANK" not in os.environ:  # started plainly (e.g. by run_all.py): one process per GPU
        import subprocess

        sys.exit(subprocess.call([sys.executable, "-m", "fp4kit.distributed.launch", "--nproc", str(GPUS), __file__]))
    main()
