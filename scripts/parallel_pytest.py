#!/usr/bin/env python3
"""Run a pytest selection as several pytest processes at once, and add up their results.

The GPU tests are mostly host work (the numpy references, data generation, launches of small
kernels), so one process leaves the GPU and most CPU cores idle: on an H200 with 16 cores the
GPU test files (1,467 tests) ran in ≈ 4 minutes as 10-12 processes. The selected tests are
collected once and dealt out in turn, so each process gets a share of every file. Each process
writes its own log; the script prints every process's summary line, the failed tests with their
messages, the first exception lines of each failing process, and the totals, and exits non-zero when any process failed (a process that collected nothing, pytest's
exit 5, counts as passed). By default it starts half as many processes as there are cores, at most
8, and at most one per 12 GiB of the GPU's memory (`GIB_PER_PROCESS`: each holds its own memory
pool; eight on an 80 GB card ran out of memory). Tests marked ``alone`` (they read device-wide state, such as the free
memory that the other processes change) run after the others, in one process of their own.

    .venv/bin/python scripts/parallel_pytest.py [--jobs N] [--logs DIR] [-m EXPR] [-k EXPR] [PATH ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

OUTCOMES = ("passed", "failed", "errors", "error", "skipped", "xfailed", "xpassed", "deselected")


#: device memory one GPU test process may hold at its peak (its CuPy pool and fp4kit's workspaces):
#: on an 80 GB H100, 8 processes over the whole suite ran out of memory and 6 did not
GIB_PER_PROCESS = 12


def gpu_memory_gib() -> float | None:
    """The smallest total memory of the visible GPUs in GiB, from ``nvidia-smi`` (no CUDA context is
    created here, as the processes need the memory); None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = [float(v) for v in out.stdout.split() if v.replace(".", "", 1).isdigit()] if out.returncode == 0 else []
    return min(sizes) / 1024 if sizes else None  # MiB -> GiB


def default_jobs(memory_gib: float | None = None) -> int:
    """Half the cores, at most 8, and at most one process per `GIB_PER_PROCESS` of the GPU's memory
    (``memory_gib``, default `gpu_memory_gib`; no bound without a GPU)."""
    jobs = max(1, min(8, (os.cpu_count() or 2) // 2))
    memory_gib = gpu_memory_gib() if memory_gib is None else memory_gib
    if memory_gib:
        jobs = max(1, min(jobs, int(memory_gib // GIB_PER_PROCESS)))
    return jobs


def collect(python: str, marker: str | None, paths: list[str], keyword: str | None = None) -> list[str]:
    """The node ids pytest selects for ``paths`` (and ``-m marker``, ``-k keyword``); raises on a
    collection error."""
    cmd = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths]
    if marker:
        cmd += ["-m", marker]
    if keyword:
        cmd += ["-k", keyword]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 5):  # 5: nothing selected
        raise RuntimeError(f"pytest collection failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    return [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def split_alone(python: str, marker: str | None, paths: list[str], ids: list[str]) -> tuple[list[str], list[str]]:
    """``ids`` as (the tests to deal out, the tests marked ``alone``, in collection order)."""
    alone = set(collect(python, f"({marker}) and alone" if marker else "alone", paths))
    return [i for i in ids if i not in alone], [i for i in ids if i in alone]


def first_errors(lines: list[str], limit: int = 4) -> list[str]:
    """The first ``limit`` exception lines ("E   ...") of a pytest log: what the first failure raised,
    which tells one bug from a process that lost its GPU context or memory."""
    return [line for line in lines if line.startswith("E ")][:limit]


def deal(ids: list[str], jobs: int) -> list[list[str]]:
    """``ids`` dealt out in turn to at most ``jobs`` non-empty shares."""
    shares = [ids[i::jobs] for i in range(jobs)]
    return [s for s in shares if s]


_SUMMARY = re.compile(r"\d+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b.* in [\d.]+s")


def summary_line(lines: list[str]) -> str | None:
    """The last pytest summary line of a log ("3 passed, 1 failed in 2.0s"), or None: a process that
    crashed after its tests (an interpreter error at exit) can end on other lines."""
    return next((line for line in reversed(lines) if _SUMMARY.search(line)), None)


def counts(summary: str) -> dict[str, int]:
    """The outcome counts of a pytest summary line ("3 passed, 1 failed in 2.0s")."""
    found = {}
    for number, word in re.findall(r"(\d+) (\w+)", summary):
        if word in OUTCOMES:
            word = "errors" if word == "error" else word
            found[word] = found.get(word, 0) + int(number)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=0,
                        help="pytest processes (0, the default: half the cores, at most 8, and one per "
                             f"{GIB_PER_PROCESS} GiB of GPU memory)")
    parser.add_argument("--logs", default=None, help="folder for the processes' logs (default: a temporary one)")
    parser.add_argument("-m", dest="marker", default=None, help="pytest marker expression, as pytest -m")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest keyword expression, as pytest -k")
    parser.add_argument("paths", nargs="*", default=["tests"], help="test files or folders (default: tests)")
    args = parser.parse_args(argv)
    if args.jobs < 0:
        parser.error(f"--jobs: expected a positive number (0: the default), got {args.jobs}")
    jobs = args.jobs or default_jobs()
    python = sys.executable
    ids = collect(python, args.marker, args.paths, args.keyword)
    if not ids:
        print("no tests selected")
        return 0
    together, alone = split_alone(python, args.marker, args.paths, ids)
    shares = deal(together, jobs)
    logs = Path(args.logs) if args.logs else Path(os.environ.get("TMPDIR", "/tmp")) / f"parallel-pytest-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"{len(ids)} tests in {len(shares)} processes{f', then {len(alone)} alone' if alone else ''}; logs in {logs}",
          flush=True)
    start = time.perf_counter()
    # a wide terminal for the children: pytest cuts its "FAILED id - message" lines to the width
    env = {**os.environ, "COLUMNS": "400"}

    def launch(name: str, share: list[str]):
        log = (logs / f"{name}.log").open("w")
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *share]
        if args.marker:
            cmd += ["-m", args.marker]
        return name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log

    total: dict[str, int] = {}
    failed_parts = 0

    def report(name: str, proc, log) -> None:
        nonlocal failed_parts
        rc = proc.wait()
        log.close()
        lines = (logs / f"{name}.log").read_text(errors="replace").splitlines()
        summary = summary_line(lines)
        failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
        shown = summary if summary is not None else f"no summary line ({len(failures)} FAILED / ERROR lines)"
        print(f"{name.replace('part', 'part ')}: exit {rc}: {shown}")
        for line in failures:
            print(f"    {line}")
        if rc not in (0, 5) or summary is None:
            for line in first_errors(lines):
                print(f"    first error: {line}")
        found = counts(summary) if summary is not None else {"failed": len(failures)}
        for word, n in found.items():
            total[word] = total.get(word, 0) + n
        failed_parts += rc not in (0, 5) or summary is None

    for running in [launch(f"part{i}", share) for i, share in enumerate(shares)]:
        report(*running)
    if alone:  # once every other process has finished
        report(*launch("alone", alone))
    words = ", ".join(f"{total[w]} {w}" for w in OUTCOMES if total.get(w))
    print(f"{words or 'no outcome'} in {time.perf_counter() - start:.1f}s ({len(shares)} processes"
          f"{', then one alone' if alone else ''}{f'; {failed_parts} failed' if failed_parts else ''})")
    return 1 if failed_parts else 0


if __name__ == "__main__":
    sys.exit(main())
