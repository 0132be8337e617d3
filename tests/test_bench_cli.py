"""The benchmarks' command lines, checked on the CPU: ``--help`` prints the benchmark's docstring and
a flag a benchmark does not know (a typo, a value of the wrong form) stops it with the flag's name,
both before it touches the GPU. Before, a misspelt flag (``--batch=1`` for ``--batches=1``) was
ignored and the benchmark ran its full default for minutes."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402

# a benchmark, one of its flags for --help to list, and a bad command line with what its error names
CASES = [
    ("bench_decode", "--batches", ["--batch=1"], "unrecognized arguments: --batch=1"),
    ("bench_decode", "--mode", ["--mode=w8a8"], "argument --mode: invalid choice: 'w8a8'"),
    ("bench_moe", "--tokens", ["--tokens=1,x"], "argument --tokens: expected comma-separated integers"),
    ("bench_moe", "--configs", ["--configs=V5"], "argument --configs: unknown ['V5']"),
    ("bench_linear", "--shapes", ["--shapes=2048x"], "argument --shapes: expected comma-separated NxK shapes"),
    ("bench_linear", "--ms", ["--ms=0"], "argument --ms: expected positive integers"),
    ("bench_quant", None, ["--quick"], "unrecognized arguments: --quick"),
    ("bench_attention", None, ["--batches=1"], "unrecognized arguments: --batches=1"),
    ("bench_sampling", None, ["--mode=top-p"], "unrecognized arguments: --mode=top-p"),
    ("bench_dist", None, ["--world=2"], "unrecognized arguments: --world=2"),
]


def _run(name: str, args: list[str]) -> subprocess.CompletedProcess:
    # CUDA_VISIBLE_DEVICES empty: were the benchmark to reach the GPU, it would fail differently
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


@pytest.mark.parametrize("name", sorted({c[0] for c in CASES}))
def test_help_prints_the_docstring_without_a_gpu(name):
    done = _run(name, ["--help"])
    assert done.returncode == 0, done.stderr
    first_line = next(line for line in (BENCH / f"{name}.py").read_text().split('"""')[1].splitlines() if line)
    assert first_line.strip() in done.stdout
    for flag in {c[1] for c in CASES if c[0] == name and c[1]}:
        assert flag in done.stdout


@pytest.mark.parametrize("name, flag, args, message", CASES, ids=[f"{c[0]}-{c[2][0]}" for c in CASES])
def test_a_bad_flag_stops_the_benchmark_with_its_name(name, flag, args, message):
    done = _run(name, args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_flag_values_parse_to_what_the_benchmarks_use():
    assert common.int_list("1,8,32") == (1, 8, 32)
    for bad in ("", "1,,2", "0", "-1", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.int_list(bad)
    args = common.command_line("doc", lambda p: p.add_argument("--batches", type=common.int_list, default=(1,)),
                               ["--batches=4,2"])
    assert args.batches == (4, 2)
    assert common.command_line("doc", lambda p: p.add_argument("--batches", type=common.int_list, default=(1,)),
                               []).batches == (1,)
    with pytest.raises(SystemExit):  # no abbreviations: --batch is not --batches
        common.command_line("doc", lambda p: p.add_argument("--batches", type=common.int_list), ["--batch=1"])
