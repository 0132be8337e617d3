"""Start one process per GPU: ``python -m fp4kit.distributed.launch --nproc N script.py args...``.

Each child runs ``python script.py args...`` (or ``python -m module args...``) with the
environment of `fp4kit.distributed.env` (rank, world size, device, rendezvous directory, NVLink
multicast off); ``fp4kit.distributed.init()`` in the script turns it into a communicator. Rank ``r``
uses device ``r`` (or the ``r``-th of ``--devices``); ``--isolate`` instead shows each child only
its GPU through ``CUDA_VISIBLE_DEVICES``.

Failures propagate: when a child exits non-zero, the others are terminated (SIGTERM, then SIGKILL
after ``--grace`` seconds) and the launcher exits with that child's code (128 + signal number for
a child killed by a signal). A run also ends when one child has exited cleanly and another is
still running ``--exit-timeout`` seconds later (e.g. hung in its communicator's teardown): that one
is reported and stopped, and the launcher exits with 124. Ctrl-C is forwarded to every child. The
parent never touches the GPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

from . import env as dist_env


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fp4kit.distributed.launch",
        description="Start one process per GPU with the environment fp4kit.distributed.init() reads.")
    parser.add_argument("--nproc", type=int, required=True, help="number of processes (one per GPU)")
    parser.add_argument("--devices", default=None,
                        help="comma-separated CUDA device indices, one per rank (default: 0..nproc-1)")
    parser.add_argument("--isolate", action="store_true",
                        help="set CUDA_VISIBLE_DEVICES to the rank's GPU only (the child then uses device 0)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping the other ranks")
    parser.add_argument("--exit-timeout", type=float, default=60.0,
                        help="seconds the other ranks get to exit once one rank has exited cleanly; a rank still "
                             "running then is reported as hung and stopped (exit code 124)")
    parser.add_argument("-m", dest="module", default=None, help="run a module (like python -m) instead of a script")
    parser.add_argument("script_and_args", nargs=argparse.REMAINDER, help="script.py and its arguments")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc: expected a positive integer, got {args.nproc}")
    if not args.exit_timeout > 0:
        parser.error(f"--exit-timeout: expected a positive number of seconds, got {args.exit_timeout}")
    if args.module is None and not args.script_and_args:
        parser.error("expected a script to run (or -m module)")
    if args.devices is not None:
        try:
            args.devices = [int(d) for d in args.devices.split(",") if d.strip()]
        except ValueError:
            parser.error(f"--devices: expected comma-separated integers, got {args.devices!r}")
        if len(args.devices) != args.nproc:
            parser.error(f"--devices: expected {args.nproc} indices (one per rank), got {len(args.devices)}")
    else:
        args.devices = list(range(args.nproc))
    return args


def child_env(base: dict, rank: int, world: int, device: int, rendezvous: str, isolate: bool) -> dict:
    """The environment of rank ``rank``."""
    from . import nccl_lib

    e = dict(base)
    e.update(dist_env.NO_MULTICAST)
    e.update({dist_env.RANK: str(rank), dist_env.WORLD_SIZE: str(world), dist_env.LOCAL_RANK: str(rank),
              dist_env.RENDEZVOUS: rendezvous, "PYTHONUNBUFFERED": "1"})
    if isolate:
        e["CUDA_VISIBLE_DEVICES"] = str(device)
        e[dist_env.DEVICE] = "0"
    else:
        e[dist_env.DEVICE] = str(device)
    lib_dirs = nccl_lib.library_dirs()  # a wheel's libnccl (e.g. PyTorch's) for CuPy's binding
    if lib_dirs:
        e["LD_LIBRARY_PATH"] = os.pathsep.join([*lib_dirs, *filter(None, [base.get("LD_LIBRARY_PATH")])])
    return e


def _stop(procs: list, grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    command = [sys.executable, *(["-m", args.module] if args.module else []), *args.script_and_args]
    with tempfile.TemporaryDirectory(prefix="fp4kit-rendezvous-") as rendezvous:
        procs = [subprocess.Popen(command, env=child_env(os.environ, r, args.nproc, args.devices[r], rendezvous,
                                                         args.isolate))
                 for r in range(args.nproc)]
        previous = signal.signal(signal.SIGTERM, _interrupt)  # a terminated launcher stops its children
        first_done = None  # (rank, time) of the first clean exit
        try:
            while True:
                codes = [p.poll() for p in procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    rank, code = failed[0]
                    print(f"fp4kit.distributed.launch: rank {rank} exited with code {_exit_code(code)}; stopping the "
                          "other ranks", file=sys.stderr, flush=True)
                    _stop(procs, args.grace)
                    return _exit_code(code)
                if all(c == 0 for c in codes):
                    return 0
                if first_done is None and 0 in codes:
                    first_done = (codes.index(0), time.monotonic())
                if first_done is not None and time.monotonic() - first_done[1] > args.exit_timeout:
                    hung = [r for r, c in enumerate(codes) if c is None]
                    print(f"fp4kit.distributed.launch: rank(s) {hung} still running {args.exit_timeout:g} s after rank "
                          f"{first_done[0]} exited cleanly; stopping them", file=sys.stderr, flush=True)
                    _stop(procs, args.grace)
                    return 124
                time.sleep(0.05)
        except KeyboardInterrupt:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            _stop(procs, args.grace)
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
