"""Every kernel compiles for sm_90a and sm_100a through the loader's own path, with no GPU;
the cache key covers every header; first use from many threads builds once."""

import threading

import pytest

from fp4kit.runtime import loader


@pytest.mark.parametrize("arch", loader.OFFLINE_TARGETS)
@pytest.mark.parametrize("name", loader.kernel_names())
def test_kernel_compiles_without_gpu(name, arch):
    cubin = loader.compile_offline(name, arch)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


def test_every_kernel_file_is_covered():
    assert "quant" in loader.kernel_names()


def test_source_inlines_local_headers():
    src = loader.kernel_source("quant")
    assert '#include "' not in src
    assert "// ---- begin common/nvfp4.cuh" in src and "// ---- begin common/fp32.cuh" in src
    assert src.count("// ---- begin common/fp32.cuh") == 1  # each header once


def test_cache_key_covers_headers_options_and_target(tmp_path, monkeypatch):
    import shutil

    shutil.copytree(loader.KERNEL_DIR, tmp_path / "raw_kernels")
    monkeypatch.setattr(loader, "KERNEL_DIR", tmp_path / "raw_kernels")
    opts = loader.compile_options("sm_90a")
    key = loader.module_key(loader.kernel_source("quant"), opts, "sm_90a", True)
    header = tmp_path / "raw_kernels" / "common" / "fp32.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    edited = loader.module_key(loader.kernel_source("quant"), opts, "sm_90a", True)
    assert edited != key
    src = loader.kernel_source("quant")
    assert loader.module_key(src, opts, "sm_100a", True) != edited
    assert loader.module_key(src, loader.compile_options("sm_100a"), "sm_90a", True) != edited
    assert loader.module_key(src, opts, "sm_90a", False) != edited


def test_target_arch():
    assert loader.target_arch("90") == "sm_90a"
    assert loader.target_arch("100") == "sm_100a"
    assert loader.target_arch("120") == "sm_120a"
    assert loader.target_arch("89") == "sm_89"


def test_missing_kernel_file_is_a_clear_error():
    with pytest.raises(ValueError, match="kernel: no such kernel file 'nope.cu'"):
        loader.kernel_source("nope")


def test_once_cache_builds_once_under_concurrent_first_use():
    cache = loader.OnceCache()
    calls = []
    barrier = threading.Barrier(16)

    def build():
        calls.append(1)
        return object()

    results = []

    def worker():
        barrier.wait()
        results.append(cache.get("k", build))

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(r) for r in results}) == 1
