"""The GPU suite's scripts, checked on the CPU: scripts/gpu_suite.sh fails when a step fails (and
passes when none does), and scripts/sanitize_kernels.py runs every kernel family's workload on
the numpy backend (on a GPU the same calls run the kernels under compute-sanitizer)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def _suite(tmp_path, python_exit: int, steps: str):
    """gpu_suite.sh with stand-ins for nvidia-smi, cuobjdump, compute-sanitizer and its Python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("nvidia-smi", "cuobjdump", "compute-sanitizer"):
        (bin_dir / tool).write_text("#!/bin/sh\necho stand-in\n")
    fake_python = bin_dir / "fake-python"
    fake_python.write_text(f"#!/bin/sh\ncat >/dev/null 2>&1 </dev/null\necho \"fake python $*\"\nexit {python_exit}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(fake_python), OUT=str(tmp_path / "logs"))
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_suite.sh"), steps], env=env, capture_output=True,
                          text=True, timeout=60)


def test_gpu_suite_exits_non_zero_when_a_step_fails(tmp_path):
    done = _suite(tmp_path, python_exit=3, steps="tests")
    assert done.returncode != 0
    assert "=== gpu-tests exit 3" in done.stdout and "FAILED steps:" in done.stdout and "gpu-tests" in done.stdout


def test_gpu_suite_requires_every_gpu_test_to_run(tmp_path):
    done = _suite(tmp_path, python_exit=0, steps="tests")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "=== gpu-tests: env FP4KIT_REQUIRE_GPU=1" in done.stdout
    assert "every step passed" in done.stdout


def test_gpu_suite_sanitizes_every_family(tmp_path):
    done = _suite(tmp_path, python_exit=0, steps="sanitize")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "memcheck-families: timeout 900 compute-sanitizer --tool memcheck" in done.stdout
    assert "racecheck-families: timeout 900 compute-sanitizer --tool racecheck" in done.stdout
    assert done.stdout.count("scripts/sanitize_kernels.py\n") == 2


def test_sanitizer_workloads_run_on_numpy(capsys):
    import sanitize_kernels

    assert sanitize_kernels.main(["--numpy"]) == 0
    out = capsys.readouterr().out
    for family in sanitize_kernels.FAMILIES:
        assert f"ok   {family}" in out
    assert {"hyper", "qat"} <= set(sanitize_kernels.FAMILIES)
    assert f"{len(sanitize_kernels.FAMILIES)} of {len(sanitize_kernels.FAMILIES)} kernel families passed" in out


def test_sanitizer_workload_reports_a_failing_family(monkeypatch, capsys):
    import sanitize_kernels

    def broken(be, rng):
        raise AssertionError("quantize: device and numpy results differ")

    monkeypatch.setattr(sanitize_kernels, "run_quant", broken)
    assert sanitize_kernels.main(["--numpy", "--only", "quant,elementwise"]) == 1
    out = capsys.readouterr().out
    assert "FAIL quant" in out and "ok   elementwise" in out and "1 of 2 kernel families passed" in out
    with pytest.raises(SystemExit):
        sanitize_kernels.main(["--numpy", "--only", "nope"])


def test_precompile_builds_the_modules_the_launches_use():
    """scripts/precompile_kernels.py builds every module plainly and, cooperatively, exactly those
    whose kernels the ops launch with cooperative groups."""
    import re

    import precompile_kernels

    from fp4kit.runtime import loader

    launched = set()
    for path in (ROOT / "fp4kit" / "ops").glob("*.py"):
        text = path.read_text()
        if "cooperative=True" in text:
            launched.add(re.search(r'^_MODULE = "(\w+)"', text, re.M).group(1))
    assert launched == set(precompile_kernels.COOPERATIVE_MODULES)
    assert set(precompile_kernels.COOPERATIVE_MODULES) <= set(loader.kernel_names())


def test_trace_step_cuts_kernel_records_into_steps(tmp_path):
    """scripts/trace_step.py reads the kernel records of a Chrome trace (other records ignored) in
    start order and gives each position of a step its median start, duration and gap."""
    import json

    import trace_step

    events = [{"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5}]
    for step, t0 in enumerate((100.0, 200.0, 300.0)):
        # kernel a: 10 us; kernel b starts 2 us before a ends (overlapped), lasts 20 + step us
        events += [{"cat": "kernel", "name": "b", "ts": t0 + 8, "dur": 20 + step},
                   {"cat": "kernel", "name": "a", "ts": t0, "dur": 10}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    records = trace_step.kernel_records(str(path))
    assert [name for _, _, name in records] == ["a", "b"] * 3
    rows = trace_step.per_position([records[i:i + 2] for i in range(0, 6, 2)])
    assert rows[0] == {"kernel": "a", "start": 0.0, "us": 10.0, "gap": 0.0}
    assert rows[1] == {"kernel": "b", "start": 8.0, "us": 21.0, "gap": -2.0}


def test_attention_splits_builds_the_step_s_candidate_lists():
    """scripts/attention_splits.py's inputs (numpy standing in for CuPy): full windows, and the
    ratio-4 layer's selected entries sorted, distinct and live."""
    import attention_splits as script

    rng = np.random.default_rng(0)
    q, swa, pos, comp, comp_len, idx, sink = script.inputs(np, rng, 2, 2048, 1024, 512)
    assert q.shape == (2, script.HEADS, script.DIM) and swa.shape == (2, script.WINDOW, script.DIM)
    assert (pos >= script.WINDOW).all() and (comp_len == 1024).all() and sink.shape == (script.HEADS,)
    assert idx.shape == (2, 512) and (np.diff(idx, axis=1) > 0).all() and idx.min() >= 0 and idx.max() < 1024
    assert script.inputs(np, rng, 1, 1, 0, 1)[5].tolist() == [[-1]]  # ratio 0: no compressed entry
    assert script.inputs(np, rng, 1, 64, 32, None)[5] is None  # ratio 128: every live entry


def _compiles_for_sm90a(module: str, source: str) -> None:
    """``source`` built in place of raw_kernels/<module>.cu compiles offline for sm_90a."""
    pytest.importorskip("cupy")
    import cupy.cuda.compiler  # noqa: F401  (the offline compile needs CuPy's NVRTC)

    from fp4kit.runtime import loader

    original = loader.kernel_source
    try:
        loader.kernel_source = lambda name: source if name == module else original(name)
        assert len(loader.compile_offline(module, "sm_90a")) > 0
    finally:
        loader.kernel_source = original


def test_attention_phases_marks_every_phase_of_the_kernel():
    """scripts/attention_phases.py finds each of its marks once in attention.cu (a kernel change
    that moves one fails here, not on the GPU), the marked source compiles for sm_90a, and the
    summary reads cycle counts per phase and the blocks' finish times."""
    import attention_phases as script

    from fp4kit.runtime import loader

    source = script.instrumented_source(loader.kernel_source("attention"))
    marks = sum(marked.count("PHASE(") for _, marked in script.MARKS)
    assert source.count("PHASE(") == marks + 1  # every mark and the macro's definition
    assert all(f"PHASE({i});" in source for i in range(8))
    with pytest.raises(ValueError, match="expected the text"):
        script.instrumented_source(loader.kernel_source("attention").replace("    if (!last_block) return;", ""))
    clock = np.zeros((script.MAX_BLOCKS, 8), np.int64)
    time_ns = np.zeros_like(clock)
    clock[:2, :6] = np.cumsum([[100, 10, 20, 30, 40, 50]] * 2, axis=1)
    time_ns[:2, :6] = [[1000, 1100, 1200, 1300, 1400, 3000], [1000, 1100, 1200, 1300, 1400, 2000]]
    lines = script.summary(clock, time_ns, 2)
    assert lines[0] == "  entry -> wait: median 10 cycles, max 10 (2 blocks)"
    assert lines[-1] == "  blocks finished: first 1.00 us, median 2.00, last 2.00"
    _compiles_for_sm90a("attention", source)


def test_sampler_phases_marks_every_phase_of_the_kernel():
    """scripts/sampler_phases.py finds each of its marks once in sampling.cu, the recorder lands
    before the first function that stamps, and the marked (cooperative) source compiles for sm_90a."""
    import phase_probe
    import sampler_phases as script

    from fp4kit.runtime import loader

    source = script.instrumented_source(loader.kernel_source("sampling"))
    assert all(f"PHASE({i});" in source for i in range(len(script.PHASES)))
    assert source.index("#define PHASE(i)") < source.index("PHASE(3);") < source.index("PHASE(0);")
    with pytest.raises(ValueError, match="sampling.cu: expected the text"):
        script.instrumented_source(loader.kernel_source("sampling").replace("    smp_barrier(cx);\n    const unsigned nposts", ""))
    with pytest.raises(ValueError, match="expected the text"):
        phase_probe.instrument("no anchor here", (), "// One histogram pass", "x.cu")
    _compiles_for_sm90a("sampling", source)


def test_sm_read_rate_probe_defines_and_compiles_every_setting():
    """scripts/sm_read_rate.py: a kernel for every (width, loads in flight) it times, whose loads
    tile each block's region exactly at every setting, and the source compiles for sm_90a."""
    import sm_read_rate as script

    for name in script.kernel_names():
        w, n = (int(v[1:]) for v in name.split("_")[1:])
        assert f"PROBE({w}, {n})" in script.SOURCE
        for threads in script.THREADS:
            assert script.REGION % (threads * w * n) == 0  # whole steps: no load past the region
    _compiles_for_sm90a("sm_read_rate", script.SOURCE)


def test_bench_convert_measures_the_disk_and_reads_the_shard_lines(tmp_path):
    """benchmarks/bench_convert.py: the write-rate probe writes the bytes asked for with one writer
    per file and leaves nothing behind; the stage medians come from the converter's shard lines,
    past each job's first shard."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_convert

    assert bench_convert.disk_write_gbps(tmp_path, 3 << 20, 2) > 0
    assert list(tmp_path.iterdir()) == []
    line = "model-{0}-of-00003.safetensors: 1 tensors in {1} s (0.5 GB/s; read {2} s, convert 0.4 s of which quantize 0.1 s, write {3} s)"
    log = "\n".join(line.format(*v) for v in (("00001", 9.0, 5.0, 3.0), ("00002", 2.0, 0.5, 0.25), ("00003", 4.0, 1.5, 0.75)))
    medians = bench_convert.stage_medians(log, jobs=1)
    assert medians["shard"] == 3.0 and medians["read"] == 1.0 and medians["write"] == 0.5
    assert medians["CUDA start"] == 0.0 and medians["quantize"] == 0.1


def test_bench_convert_sizes_its_run_before_writing(tmp_path):
    """benchmarks/bench_convert.py: `layer_bytes` is the tensor data of the shard it writes, and a
    run the temporary folder's file system cannot hold is refused up front, naming the arguments."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_convert

    size = bench_convert.write_checkpoint(tmp_path, 1, 2)
    header = 8 + int.from_bytes(next(tmp_path.glob("*.safetensors")).read_bytes()[:8], "little")
    assert size - header == bench_convert.layer_bytes(2)
    bench_convert.check_disk_space(tmp_path, 1, 2)  # a few MB: fits
    with pytest.raises(ValueError, match=r"--layers 100000 --experts 256: the run needs about .* GB"):
        bench_convert.check_disk_space(tmp_path, 100_000, 256)


def test_memory_trace_counts_live_bytes_by_site():
    """scripts/memory_trace.py's bookkeeping: the peak of the live bytes, the sites live at that
    peak (a freed block no longer counts; a free of an untracked pointer is ignored), and the site of
    an allocation is its innermost frame in the library."""
    import traceback

    import memory_trace

    live = memory_trace.LiveBytes()
    live.malloc(1, 100, "a")
    live.malloc(2, 50, "b")
    live.free(1)
    live.free(99)
    live.malloc(3, 70, "b")
    assert live.total == 120 and live.peak == 150
    assert live.report(5) == [("a", 100), ("b", 50)]
    live.malloc(4, 200, "c")
    assert live.peak == 320 and live.report(1) == [("c", 200)]
    root = str(memory_trace.ROOT)
    stack = [traceback.FrameSummary(f"{root}/fp4kit/layers/moe.py", 10, "plan"),
             traceback.FrameSummary("/usr/lib/python3/cupy.py", 5, "empty")]
    assert memory_trace.allocation_site(stack) == "fp4kit/layers/moe.py:10 plan"
    assert memory_trace.allocation_site(stack[1:]) == "/usr/lib/python3/cupy.py:5 empty"
    # a workspace helper allocates for its caller, which names the buffer
    helper = [traceback.FrameSummary(f"{root}/fp4kit/ops/gemm.py", 20, "_stage_image"),
              traceback.FrameSummary(f"{root}/fp4kit/runtime/workspace.py", 125, "_growing"),
              traceback.FrameSummary("/usr/lib/python3/cupy.py", 5, "empty")]
    assert memory_trace.allocation_site(helper) == "fp4kit/ops/gemm.py:20 _stage_image"


def _parallel(tmp_path, body: str, *args):
    (tmp_path / "test_sample.py").write_text(body)
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "parallel_pytest.py"), "--logs", str(tmp_path / "logs"),
                           *args, str(tmp_path / "test_sample.py")], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


SAMPLE_TESTS = """
import pytest

@pytest.mark.parametrize("i", range(7))
def test_many(i):
    assert i != 5, "the message of a failure, kept whole however long its line grows" + "." * 60

@pytest.mark.slow
def test_marked():
    pass

def test_skipped():
    pytest.skip("not here")
"""


def test_parallel_pytest_adds_up_every_process_and_fails_with_any(tmp_path):
    done = _parallel(tmp_path, SAMPLE_TESTS, "--jobs", "3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "9 tests in 3 processes" in done.stdout
    assert "7 passed, 1 failed, 1 skipped" in done.stdout
    assert "FAILED " in done.stdout and "test_many[5]" in done.stdout
    assert len(list((tmp_path / "logs").glob("part*.log"))) == 3
    # the failure's message whole (pytest cuts summary lines to the terminal's width), and what it raised
    assert "the message of a failure, kept whole however long its line grows" in done.stdout
    assert "first error: E " in done.stdout


def test_parallel_pytest_passes_the_marker_and_exits_zero(tmp_path):
    done = _parallel(tmp_path, SAMPLE_TESTS.replace("i != 5", "i >= 0"), "--jobs", "4", "-m", "not slow")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "8 tests in 4 processes" in done.stdout
    assert "7 passed, 1 skipped" in done.stdout


ALONE_TESTS = """
import pathlib
import time

import pytest

@pytest.mark.parametrize("i", range(4))
def test_together(i):
    time.sleep(0.5)
    pathlib.Path(f"done{i}").write_text("")

@pytest.mark.alone
def test_alone():
    assert all(pathlib.Path(f"done{i}").exists() for i in range(4)), "ran beside the others"
"""


def test_parallel_pytest_runs_the_alone_tests_after_the_others(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: run after the others\n")
    done = _parallel(tmp_path, ALONE_TESTS, "--jobs", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 tests in 4 processes, then 1 alone" in done.stdout
    assert "alone: exit 0: 1 passed" in done.stdout and "5 passed" in done.stdout
    assert "(4 processes, then one alone)" in done.stdout
    done = _parallel(tmp_path, ALONE_TESTS, "--jobs", "2", "-m", "not alone")
    assert "4 tests in 2 processes;" in done.stdout and "alone:" not in done.stdout


def test_parallel_pytest_holds_its_processes_to_the_gpu_memory(monkeypatch):
    """The default process count: half the cores up to 8, and one per `GIB_PER_PROCESS` of GPU
    memory (an 80 GB card: 6; 141 GB: 8; no GPU: no bound)."""
    import parallel_pytest

    monkeypatch.setattr(parallel_pytest.os, "cpu_count", lambda: 16)
    assert parallel_pytest.default_jobs(memory_gib=79.6) == 6
    assert parallel_pytest.default_jobs(memory_gib=139.8) == 8
    assert parallel_pytest.default_jobs(memory_gib=8.0) == 1
    monkeypatch.setattr(parallel_pytest, "gpu_memory_gib", lambda: None)
    assert parallel_pytest.default_jobs() == 8
    monkeypatch.setattr(parallel_pytest.os, "cpu_count", lambda: 2)
    assert parallel_pytest.default_jobs(memory_gib=79.6) == 1


def test_parallel_pytest_reads_summary_lines():
    import parallel_pytest

    assert parallel_pytest.counts("== 3 passed, 1 failed, 2 error, 4 warnings in 1.2s ==") == \
        {"passed": 3, "failed": 1, "errors": 2}
    assert parallel_pytest.deal(list("abcde"), 3) == [["a", "d"], ["b", "e"], ["c"]]
    assert parallel_pytest.deal(list("ab"), 4) == [["a"], ["b"]]
    log = ["x", "E   cupy.cuda.memory.OutOfMemoryError: out of memory", "E   more", "FAILED t - E"]
    assert parallel_pytest.first_errors(log, 1) == ["E   cupy.cuda.memory.OutOfMemoryError: out of memory"]


def test_router_phases_marks_every_phase_of_the_kernel():
    """scripts/router_phases.py finds each of its marks once in moe.cu, the recorder lands before
    the first function that stamps, and the marked source compiles for sm_90a."""
    import router_phases as script

    from fp4kit.runtime import loader

    source = script.instrumented_source(loader.kernel_source("moe"))
    assert all(f"PHASE({i});" in source for i in range(len(script.PHASES)))
    assert source.index("#define PHASE(i)") < source.index("PHASE(0);") < source.index("PHASE(2);")
    with pytest.raises(ValueError, match="moe.cu: expected the text"):
        script.instrumented_source(loader.kernel_source("moe").replace(
            "    if (threadIdx.x < 32) {  // lane j writes pick j", "    {"))
    _compiles_for_sm90a("moe", source)


def test_topk_phases_marks_every_phase_of_the_cluster_select():
    """scripts/topk_phases.py finds each of its marks once in indexer.cu, the recorder lands before
    the cluster select's first stamp, each radix pass stamps its histogram and its decision into
    slots of its own, and the marked source compiles for sm_90a."""
    import topk_phases as script

    from fp4kit.runtime import loader

    source = script.instrumented_source(loader.kernel_source("indexer"))
    fixed = (0, 1, 2, 11, 12, 13, 14)
    assert all(f"PHASE({i});" in source for i in fixed)
    assert "PHASE(3 + 2 * pass);" in source and "PHASE(4 + 2 * pass);" in source
    assert len(script.PHASES) == 15 <= script.phase_probe.PHASE_SLOTS
    assert source.index("#define PHASE(i)") < source.index("PHASE(0);") < source.index("PHASE(3 + 2 * pass);")
    with pytest.raises(ValueError, match="indexer.cu: expected the text"):
        script.instrumented_source(loader.kernel_source("indexer").replace(
            "    cluster_arrive();  // no more reads of the peers' shared memory\n", "    cluster_arrive();\n"))
    _compiles_for_sm90a("indexer", source)


def test_moe_small_phases_marks_every_phase_of_both_launches():
    """scripts/moe_small_phases.py finds each of its marks once in moe.cu for either launch, the
    recorder lands before the first function that stamps, and the marked down launch compiles for
    sm_90a."""
    import moe_small_phases as script

    from fp4kit.runtime import loader

    library = loader.kernel_source("moe")
    for launch, phases in script.PHASES.items():
        source = script.instrumented_source(library, launch)
        assert all(f"PHASE({i});" in source for i in range(len(phases))), launch
        assert source.index("#define PHASE(i)") < source.index("PHASE(0);")
    with pytest.raises(ValueError, match="moe.cu: expected the text"):
        script.instrumented_source(library.replace("    if (threadIdx.x >= 16) return;\n", "    {}\n"), "down")
    _compiles_for_sm90a("moe", script.instrumented_source(library, "down"))


def test_phase_probe_groups_sms_by_their_block_count():
    """phase_probe.sm_summary: SMs grouped by how many stamped blocks they ran, with when their last
    block finished (from the blocks' latest stamps, after the first block's first one)."""
    import phase_probe

    time_ns = np.zeros((4, 8), np.int64)
    time_ns[:, 0] = [1000, 1000, 1500, 1200]
    time_ns[:, 3] = [3000, 6000, 5000, 2200]  # ends 2, 5, 4, 1.2 us after 1000 ns
    sm = np.array([0, 0, 1, 2], np.int32)
    assert phase_probe.sm_summary(time_ns, sm, 4) == [
        "  SMs with 1 blocks: 2, their last block done at median 2.60 us, latest 4.00",
        "  SMs with 2 blocks: 1, their last block done at median 5.00 us, latest 5.00",
    ]


def test_phase_probe_prebuilds_both_modules_once(monkeypatch):
    """phase_probe.prebuild compiles the library's module and the instrumented source side by side
    (two processes), once per process and source."""
    import concurrent.futures

    import phase_probe

    assert phase_probe.prebuild_jobs("gemm", "src", False) == [("gemm", None, False), ("gemm", "src", False)]
    maps = []

    class Pool:
        def __init__(self, workers, mp_context=None):
            assert workers == 2 and mp_context.get_start_method() == "spawn"  # no fork of a CUDA process

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, fn, jobs):
            maps.append((fn, list(jobs)))
            return []

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(phase_probe, "_prebuilt", set())
    for _ in range(2):
        phase_probe.prebuild("moe", "instrumented moe")
    phase_probe.prebuild("moe", "another source")
    assert maps == [(phase_probe._build, phase_probe.prebuild_jobs("moe", "instrumented moe")),
                    (phase_probe._build, phase_probe.prebuild_jobs("moe", "another source"))]


def test_gemm_phases_marks_every_phase_of_the_engine():
    """scripts/gemm_phases.py finds each of its marks once in gemm.cu's engine, the recorder lands at
    file scope before the engine's namespace, and the marked source compiles for sm_90a."""
    import gemm_phases as script

    from fp4kit.runtime import loader

    library = loader.kernel_source("gemm")
    source = script.instrumented_source(library)
    assert all(f"PHASE({i});" in source for i in range(len(script.PHASES)))
    assert source.index("#define PHASE(i)") < source.index("namespace gemm {") < source.index("PHASE(0);")
    with pytest.raises(ValueError, match="gemm.cu: expected the text"):
        script.instrumented_source(library.replace("    Ep ep = ep_in;\n", "    Ep ep(ep_in);\n"))
    _compiles_for_sm90a("gemm", source)


def test_ab_step_reads_settings_and_refuses_what_does_not_exist(tmp_path):
    import ab_step

    assert ab_step.parse_setting("base") == ("base", {}, None)
    assert ab_step.parse_setting("m:ops.gemm.GEMV_MAX_BLOCKS_PER_SM={1: 3.0, 8: 1.0},ops.gemm.USE_GEMV='a,b'")[1] == {
        ("ops.gemm", "GEMV_MAX_BLOCKS_PER_SM"): {1: 3.0, 8: 1.0}, ("ops.gemm", "USE_GEMV"): "a,b"}
    label, values, kernels = ab_step.parse_setting(
        f"off:ops.gemm.GEMV_EARLY_RELEASE=False, ops.gemm.GEMV_FETCH_TILES=8,kernels={tmp_path}")
    assert label == "off" and values == {("ops.gemm", "GEMV_EARLY_RELEASE"): False, ("ops.gemm", "GEMV_FETCH_TILES"): 8}
    assert kernels == tmp_path
    from fp4kit.ops import gemm as gemm_ops

    assert ab_step.resolve(values) == [(gemm_ops, "GEMV_EARLY_RELEASE", False), (gemm_ops, "GEMV_FETCH_TILES", 8)]
    for bad, message in [("x:GEMV=1", "expected module.ATTR=value"), (":ops.gemm.USE_GEMV=1", "expected LABEL"),
                         ("x:ops.gemm.USE_GEMV=yes please", "not a Python literal")]:
        with pytest.raises(ValueError, match=message):
            ab_step.parse_setting(bad)
    with pytest.raises(ValueError, match="has no attribute 'NOPE'"):
        ab_step.resolve(ab_step.parse_setting("x:ops.gemm.NOPE=1")[1])
    with pytest.raises(ValueError, match="no module fp4kit.nomodule"):
        ab_step.resolve(ab_step.parse_setting("x:nomodule.A=1")[1])
    resolved = ab_step.resolve(ab_step.parse_setting("q:dsv4.model.NORM_QUERY_IN_ATTENTION=True")[1])
    from dsv4 import model as model_module  # the example's modules by their own name

    assert resolved == [(model_module, "NORM_QUERY_IN_ATTENTION", True)]
    with pytest.raises(ValueError, match="dsv4.model has no attribute 'NOPE'"):
        ab_step.resolve(ab_step.parse_setting("x:dsv4.model.NOPE=1")[1])
    with pytest.raises(SystemExit, match="two or more settings"):
        ab_step.main(["base"])


def test_ab_step_kernel_overlays_build_only_the_modules_they_change(tmp_path):
    """A setting's kernels=DIR replaces library files in a copy of the kernel folder; the builds are
    every library module plus, per overlay, the modules whose expanded source changed (a header
    changes every module that includes it); an overlay file the library lacks is refused."""
    import ab_step
    from fp4kit.runtime import loader

    overlay = tmp_path / "late"
    (overlay / "common").mkdir(parents=True)
    (overlay / "attention.cu").write_text((loader.KERNEL_DIR / "attention.cu").read_text() + "\n// late\n")
    (overlay / "common" / "pdl.cuh").write_text((loader.KERNEL_DIR / "common" / "pdl.cuh").read_text() + "\n// x\n")
    trees = tmp_path / "trees"
    trees.mkdir()
    tree = ab_step.kernel_tree(overlay, trees)
    assert (tree / "attention.cu").read_text().endswith("// late\n")
    assert (tree / "moe.cu").read_text() == (loader.KERNEL_DIR / "moe.cu").read_text()
    jobs = ab_step.builds([None, tree])
    library = [j for j in jobs if j[1] is None]
    assert {n for n, _, _ in library} == set(loader.kernel_names()) and ("sampling", None, True) in library
    changed = {(n, c): src for n, src, c in jobs if src is not None}
    pdl_users = {n for n in loader.kernel_names() if "begin common/pdl.cuh" in loader.kernel_source(n)}
    assert set(changed) == {(n, c) for n, _, c in library if n in pdl_users | {"attention"}}
    assert "// late" in changed[("attention", False)] and "// x" in changed[("moe", False)]
    assert len(pdl_users) > 3 and "moe" in pdl_users  # the header reaches beyond the file edited
    assert loader.KERNEL_DIR == loader._library_kernel_dir  # restored after reading the overlay's sources
    (overlay / "nope.cu").write_text("")
    with pytest.raises(ValueError, match="nope.cu replaces no file"):
        ab_step.kernel_tree(overlay, trees)
    with pytest.raises(ValueError, match="not a folder"):
        ab_step.kernel_tree(tmp_path / "missing", trees)

def test_parallel_pytest_counts_a_process_that_crashed_after_its_tests():
    """A process whose log ends without a summary line (the interpreter failed at exit, as a lost GPU
    context can make it) fails the run and its FAILED lines count, instead of counting nothing."""
    import parallel_pytest

    crashed = ["..FF", "FAILED t.py::a - CUDARuntimeError", "FAILED t.py::b - CUDARuntimeError",
               "=== short test summary info ===", "Error in sys.excepthook:", "", "Original exception was:"]
    assert parallel_pytest.summary_line(crashed) is None
    finished = ["..", "=== 2 passed, 1 warning in 3.10s ===", ""]
    assert parallel_pytest.summary_line(finished) == "=== 2 passed, 1 warning in 3.10s ==="


def test_parallel_pytest_fails_a_process_that_ends_without_a_summary(tmp_path):
    """A process that stops before pytest's summary, with exit status 0 even, fails the run."""
    done = _parallel(tmp_path, "import os\n\ndef test_a():\n    pass\n\ndef test_b():\n    os._exit(0)\n",
                     "--jobs", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "part 0: exit 0: no summary line" in done.stdout
    assert "(1 processes; 1 failed)" in done.stdout
