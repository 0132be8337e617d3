import os
import zlib

import numpy as np
import pytest


from fp4kit.runtime.device import cuda_available

HAVE_GPU = cuda_available()

if HAVE_GPU and os.environ.get("FP4KIT_NO_POOL") == "1":
    # compute-sanitizer cannot see an out-of-bounds write that lands inside CuPy's pool:
    # give every array its own cudaMalloc so memcheck reports it
    import cupy

    cupy.cuda.set_allocator(None)


# FP4KIT_REQUIRE_GPU=1 (the GPU suite sets it): a GPU test that does not run is a failure, so a
# machine whose CuPy or driver is broken cannot pass by skipping everything
REQUIRE_GPU = os.environ.get("FP4KIT_REQUIRE_GPU") == "1"


def _run_seed() -> int:
    """One seed per run: FP4KIT_SEED replays a run, otherwise fresh entropy."""
    text = os.environ.get("FP4KIT_SEED")
    if text is None:
        return int(np.random.SeedSequence().entropy % (2**63))
    try:
        return int(text)
    except ValueError:
        raise pytest.UsageError(f"FP4KIT_SEED: expected an integer, got {text!r}") from None


RUN_SEED = _run_seed()


def pytest_report_header(config):
    return f"fp4kit: FP4KIT_SEED={RUN_SEED} (set it to replay this run's random data)"


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    # a GPU module skipped at import (pytest.importorskip("cupy")) counts as failed GPU tests
    if REQUIRE_GPU and report.skipped and collector.nodeid.endswith("_gpu.py"):
        report.outcome = "failed"
        report.longrepr = f"FP4KIT_REQUIRE_GPU=1, but this GPU module was skipped: {_skip_reason(report)}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if REQUIRE_GPU and report.skipped and "gpu" in item.keywords and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"FP4KIT_REQUIRE_GPU=1, but this GPU test was skipped: {_skip_reason(report)}"
    if report.failed and "rng" in getattr(item, "fixturenames", ()):
        report.sections.append(("fp4kit seed", f"replay with FP4KIT_SEED={RUN_SEED} (test seed {_test_seed(item.nodeid)})"))
    return report


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _test_seed(nodeid: str) -> int:
    # crc32, not hash(): the same test id gives the same seed in every process
    return int(np.random.SeedSequence([RUN_SEED, zlib.crc32(nodeid.encode())]).generate_state(1)[0])


@pytest.fixture
def rng(request):
    """A generator per test seeded from the run seed (fresh entropy each run, or ``FP4KIT_SEED``)
    and the test id: every run draws new data, and a failing test reports the ``FP4KIT_SEED`` that
    replays it (alone or in the whole run)."""
    seed = _test_seed(request.node.nodeid)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def run_seed() -> int:
    """The run seed (`FP4KIT_SEED`), for data drawn once per run and shared by several tests."""
    return RUN_SEED


@pytest.fixture
def capture_stream():
    """A function giving a non-blocking stream to capture a CUDA graph on, once the device is idle: a
    non-blocking stream does not wait for the default stream, so a test's setup there (first calls,
    state resets, uploads) would otherwise race the graph's replays."""
    import cupy

    def make():
        cupy.cuda.Device().synchronize()
        return cupy.cuda.Stream(non_blocking=True)

    return make


@pytest.fixture
def swiglu_epilogue_launches(monkeypatch):
    """``record(module)`` wraps ``module.grouped_gemm`` and returns the list that gets, for each
    grouped GEMM launched from then on, whether it computed SwiGLU in its epilogue."""

    def record(module):
        launches, launch = [], module.grouped_gemm

        def spy(*args, **kwargs):
            launches.append(kwargs.get("swiglu") is not None)
            return launch(*args, **kwargs)

        monkeypatch.setattr(module, "grouped_gemm", spy)
        return launches

    return record


@pytest.fixture(autouse=True)
def _clean_status():
    from fp4kit.runtime import status

    status.clear(device=-1)  # host word only; device words are cleared by the tests that read them
    yield


@pytest.fixture(autouse=True)
def _return_cached_device_memory(request):
    """After each GPU test, CuPy's pool gives its cached free blocks back to the device. Several test
    processes share one GPU (scripts/parallel_pytest.py), and a pool keeps every block it ever
    freed: on an 80 GB H100 the decode tests' process held 41.7 GB while its neighbours ran out."""
    yield
    if HAVE_GPU and "gpu" in request.keywords:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
