"""The benchmark runner on the CPU: report assembly, markdown, the fraction-of-floor mapping,
failure handling, and (with matplotlib) the plot."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import run_all  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
EXISTING = sorted(p.stem for p in RESULTS.glob("bench_*.json"))


def fixture_tables():
    quant = {"title": "NVFP4 quantization (Test GPU)", "meta": {"device": "Test GPU", "copy_bandwidth_Bps": 4e12,
                                                                "cupy": "14.2.0", "cuda_runtime": 13020,
                                                                "torch": "2.11.0"},
             "columns": ["op", "shape", "µs", "% of copy BW", "target"],
             "rows": [{"op": "fused amax+quantize", "shape": "1x7168", "µs": 3.2, "% of copy BW": 40.0,
                       "target": "<= 5 µs met"},
                      {"op": "a|b", "shape": "8x7168", "µs": 3.5, "% of copy BW": None}]}
    moe = {"title": "MoE layer", "meta": {"device": "Test GPU", "copy_bandwidth_Bps": 4.2e12},
           "columns": ["shape", "T", "µs", "x floor"],
           "rows": [{"shape": "V4-Flash", "T": 1, "µs": 186.0, "x floor": 4.0}]}
    return {"bench_quant": quant, "bench_moe": moe}


def write_tables(directory: Path, tables: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        (directory / f"{name}.json").write_text(json.dumps(table))


def write_bench(bench_dir: Path, name: str, body: str) -> None:
    bench_dir.mkdir(parents=True, exist_ok=True)
    (bench_dir / f"{name}.py").write_text(body)


GOOD_BENCH = """
import json, os, pathlib
out = pathlib.Path(os.environ["FP4KIT_BENCH_OUT"])
table = {"title": "ok", "meta": {"device": "Fake GPU"}, "columns": ["op", "µs", "% of copy BW"],
         "rows": [{"op": "copy", "µs": 1.0, "% of copy BW": 50.0}]}
(out / "bench_ok.json").write_text(json.dumps(table))
print("fake benchmark done")
"""


def test_report_assembles_metadata_and_tables(tmp_path):
    write_tables(tmp_path, fixture_tables())
    scripts = [tmp_path / "bench_quant.py", tmp_path / "bench_moe.py", tmp_path / "bench_new.py"]
    tables, missing = run_all.load_existing(scripts, tmp_path)
    assert set(tables) == {"bench_quant", "bench_moe"} and set(missing) == {"bench_new"}

    meta = {**run_all.meta_from_tables(tables), "date": "2026-01-02", "git_commit": "abc123"}
    assert meta["gpu"] == "Test GPU" and meta["cuda_runtime"] == "13.2" and meta["torch"] == "2.11.0"
    assert meta["copy_bandwidth_Bps"] == pytest.approx(4.1e12)  # median over the benchmarks

    report = run_all.build_report(meta, tables, {}, missing)
    path = run_all.write_report(report, tmp_path / "out")
    assert path.name == "2026-01-02-test-gpu.json"
    saved = json.loads(path.read_text())
    assert saved["meta"]["git_commit"] == "abc123" and saved["skipped"] == missing
    assert saved["benchmarks"]["bench_quant"]["rows"] == fixture_tables()["bench_quant"]["rows"]
    assert saved["benchmarks"]["bench_quant"]["fraction_of_floor"] == [pytest.approx(0.4), None]
    assert saved["benchmarks"]["bench_moe"]["fraction_of_floor"] == [pytest.approx(0.25)]

    md = path.with_suffix(".md").read_text()
    assert md.startswith("## Benchmarks: Test GPU, CUDA 13.2, CuPy 14.2.0, PyTorch 2.11.0")
    assert "### NVFP4 quantization (Test GPU)" in md and "### MoE layer" in md
    assert "copy bandwidth 4.10 TB/s" in md and "`bench_new`" in md


def test_markdown_table_is_well_formed():
    columns = ["op", "µs", "note"]
    rows = [{"op": "a|b", "µs": 3.14159, "note": "two\nlines"}, {"op": "c", "µs": 1234.5}]
    lines = run_all.markdown_table(columns, rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0] == "| op | µs | note |" and lines[1] == "| --- | --- | --- |"
    for line in lines:
        assert line.startswith("| ") and line.endswith(" |")
        cells = line.replace("\\|", "")  # an escaped pipe is inside a cell
        assert cells.count("|") == len(columns) + 1
    assert lines[2] == "| a\\|b | 3.14 | two lines |"
    assert lines[3] == "| c | 1234 |  |"  # missing cells stay empty, large numbers lose decimals


@pytest.mark.parametrize("name", EXISTING)
def test_fraction_mapping_handles_each_existing_benchmark(name):
    table = json.loads((RESULTS / f"{name}.json").read_text())
    assert name in run_all.FRACTION_OF_FLOOR, f"add {name} to FRACTION_OF_FLOOR"
    meta = {"copy_bandwidth_Bps": 4e12, **table["meta"]}
    fractions = [run_all.fraction_of_floor(name, row, meta) for row in table["rows"]]
    timed = [f for f, row in zip(fractions, table["rows"]) if row.get("GB/s") or row.get("x floor")
             or row.get("TB/s (weight)") or row.get("speedup") or row.get("% of copy BW")
             or name == "bench_sampling"]
    assert timed and all(f is not None and 0 < f < 1.5 for f in timed)  # a floor cannot be beaten by much
    assert sum(f is not None for f in fractions) >= len(table["rows"]) - 1


def test_fraction_definitions():
    row = {"% of copy BW": 45.0, "TFLOP/s": 700.0}
    assert run_all.fraction_of_floor("bench_linear", row, {"device": "NVIDIA H200"}) == pytest.approx(700 / 989)
    assert run_all.fraction_of_floor("bench_linear", row, {"device": "Unknown"}) == pytest.approx(0.45)
    assert run_all.fraction_of_floor("bench_moe", {"x floor": 5.0}, {}) == pytest.approx(0.2)
    sampled = run_all.fraction_of_floor("bench_sampling", {"batch": 2, "µs": 10.0},
                                        {"vocab": 1000, "copy_bandwidth_Bps": 1e9})
    assert sampled == pytest.approx(2 * 1000 * 2 / 1e9 * 1e6 / 10.0)
    # unknown benchmarks fall back to the common columns; nothing usable gives None
    assert run_all.fraction_of_floor("bench_new", {"x floor": 2.0}, {}) == pytest.approx(0.5)
    assert run_all.fraction_of_floor("bench_new", {"µs": 1.0}, {}) is None
    assert run_all.fraction_of_floor("bench_moe", {"x floor": math.inf}, {}) is None


def test_failing_benchmark_is_reported_and_the_others_still_run(tmp_path):
    bench_dir, results = tmp_path / "benches", tmp_path / "results"
    write_bench(bench_dir, "bench_bad", "import sys\nprint('about to fail')\nsys.exit('kernel exploded')\n")
    write_bench(bench_dir, "bench_ok", GOOD_BENCH)
    write_bench(bench_dir, "bench_silent", "print('forgot to save')\n")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--bench-dir", str(bench_dir),
                           "--results", str(results), "--no-plot"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "FAILED bench_bad" in proc.stderr and "kernel exploded" in proc.stderr
    assert "FAILED bench_silent" in proc.stderr and "no bench_silent.json" in proc.stderr
    assert "fake benchmark done" in proc.stdout

    (report_path,) = [p for p in results.glob("*.json") if not p.name.startswith("bench_")]
    report = json.loads(report_path.read_text())
    assert list(report["benchmarks"]) == ["bench_ok"]
    assert set(report["failed"]) == {"bench_bad", "bench_silent"}
    assert report["benchmarks"]["bench_ok"]["fraction_of_floor"] == [pytest.approx(0.5)]
    assert (results / "bench_ok.json").exists()  # the per-benchmark file is kept current
    assert "* `bench_bad`: exit code 1: kernel exploded" in report_path.with_suffix(".md").read_text()


def test_only_skip_and_gpu_declaration(tmp_path):
    write_bench(tmp_path, "bench_quant", "")
    write_bench(tmp_path, "bench_moe", "")
    write_bench(tmp_path, "bench_dist", "GPUS = 4  # ranks are spawned by the script itself\n")
    assert [s.stem for s in run_all.discover(["quant", "bench_dist"], bench_dir=tmp_path)] == ["bench_dist",
                                                                                             "bench_quant"]
    assert [s.stem for s in run_all.discover(None, ["dist"], bench_dir=tmp_path)] == ["bench_moe", "bench_quant"]
    with pytest.raises(SystemExit, match="unknown benchmark"):
        run_all.discover(["nope"], bench_dir=tmp_path)
    assert run_all.gpus_needed(tmp_path / "bench_dist.py") == 4
    assert run_all.gpus_needed(tmp_path / "bench_quant.py") == 1

    tables, failed, skipped = run_all.run_benchmarks([tmp_path / "bench_dist.py"], gpu_count=1)
    assert tables == {} and failed == {} and skipped == {"bench_dist": "needs 4 GPUs, 1 visible"}


def test_plot_from_report(tmp_path):
    pytest.importorskip("matplotlib")
    tables = fixture_tables()
    meta = {**run_all.meta_from_tables(tables), "date": "2026-01-02", "git_commit": "abc123"}
    path = run_all.write_report(run_all.build_report(meta, tables, {}, {}), tmp_path)
    assert run_all.main(["--plot-only", str(path)]) == 0
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    bars = run_all.plot_bars(json.loads(path.read_text()))
    assert [(b, label) for b, label, _ in bars] == [("bench_quant", "fused amax+quantize 1x7168"),
                                                     ("bench_moe", "V4-Flash T=1")]


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(SystemExit, match=r"needs matplotlib: pip install 'fp4kit\[plot\]'"):
        run_all.plot(tmp_path / "report.json")


def test_a_hanging_benchmark_times_out(tmp_path):
    write_bench(tmp_path, "bench_hang", "import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    tables, failed, _ = run_all.run_benchmarks([tmp_path / "bench_hang.py"], gpu_count=0, timeout=1)
    assert tables == {} and failed == {"bench_hang": "timed out after 1 s"}
