"""Every kernel compiles for sm_90a and sm_100a through the loader's own path, with no GPU;
the cache key covers every header; first use from many threads builds once."""

import functools
import importlib.util
import itertools
import re
import threading
from pathlib import Path

import pytest

from fp4kit.runtime import launch as launch_module
from fp4kit.runtime import loader

# CuPy stays an optional dependency (the numpy backend, the checkpoint tools and the CPU half of
# this suite run without it); compiling needs its NVRTC binding, so without CuPy these tests skip
needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                reason="compiling the kernels needs CuPy's NVRTC binding (pip install -e '.[cuda13]')")
PACKAGE = Path(loader.__file__).resolve().parent.parent


@functools.cache
def _cubin(name: str, arch: str) -> bytes:
    return loader.compile_offline(name, arch)


@needs_cupy
@pytest.mark.parametrize("arch", loader.OFFLINE_TARGETS)
@pytest.mark.parametrize("name", loader.kernel_names())
def test_kernel_compiles_without_gpu(name, arch):
    cubin = _cubin(name, arch)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@needs_cupy
def test_every_gemm_kernel_the_launch_rule_picks_exists():
    """The GEMM launcher builds its kernel names from the launch shape: every shape it can pick
    (both engines, with and without clusters, every token-tile count) names a compiled kernel."""
    from fp4kit.ops import gemm as gemm_ops

    cubin = _cubin("gemm", "sm_90a")
    names = set()
    saved = (gemm_ops.USE_CLUSTERS, gemm_ops.GEMV_FETCH_TILES, gemm_ops.GEMV_WHOLE_FETCHES,
             gemm_ops.GEMV_RESIDENT_ACTIVATION, gemm_ops.GEMV_RESIDENT_PIPELINED, gemm_ops.GEMV_RESIDENT_PIPELINED_WARPS)
    try:
        for clusters in (True, False):
            gemm_ops.USE_CLUSTERS = clusters
            for m in (1, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 1024):
                for n, k in [(16, 64), (2048, 7168), (7168, 2048), (18432, 7168), (129280, 4096), (4096, 4096)]:
                    for wgmma in (False, True) if m <= 64 else (True,):
                        shape = gemm_ops.launch_config(m, n, k, sms=132, wgmma=wgmma)
                        if wgmma:  # window images, or bf16 staged in the blocks
                            names |= {f"gemm_{shape.kernel}", f"gemm_stage_{shape.token_tiles}_bf16",
                                      f"gemm_stage_{shape.token_tiles}_nvfp4", f"gemm_{shape.kernel}_bf16"}
                        else:
                            names |= {f"gemm_{shape.kernel}_bf16", f"gemm_{shape.kernel}_nvfp4"}
        gemm_ops.GEMV_RESIDENT_PIPELINED_WARPS = (8, 16)  # every block width the knob can name
        for m, f, whole, resident, pipelined in itertools.product((1, 8), (4, 8), (False, True), (False, True),
                                                                  (False, True)):  # the GEMV kernels
            gemm_ops.GEMV_FETCH_TILES, gemm_ops.GEMV_WHOLE_FETCHES = f, whole
            gemm_ops.GEMV_RESIDENT_ACTIVATION, gemm_ops.GEMV_RESIDENT_PIPELINED = resident, pipelined
            for n, k in [(16, 16), (16, 512), (2048, 1024), (2048, 2048), (1024, 4096), (2048, 7168), (129280, 4096),
                         (8192, 4096), (16, 256)]:
                shape = gemm_ops.gemv_config(m, n, k, sms=132)
                names |= {f"gemm_{shape.kernel}_bf16", f"gemm_{shape.kernel}_nvfp4"}
    finally:
        (gemm_ops.USE_CLUSTERS, gemm_ops.GEMV_FETCH_TILES, gemm_ops.GEMV_WHOLE_FETCHES,
         gemm_ops.GEMV_RESIDENT_ACTIVATION, gemm_ops.GEMV_RESIDENT_PIPELINED, gemm_ops.GEMV_RESIDENT_PIPELINED_WARPS) = saved
    # 1, 2, 4, 8 row tiles per 8-warp block and the 16-warp blocks of one row tile, at both fetch
    # sizes (20), the whole-fetch and resident-activation builds of the 4-tile ones (10 each), and
    # the pipelined resident builds of one row tile (4)
    assert len({name for name in names if "_gemv_" in name}) == 44
    missing = sorted(name for name in names if name.encode() + b"\0" not in cubin)
    assert not missing, f"gemm.cu does not define {missing}"
    assert any(name.startswith("gemm_wgmma_") and "_c" in name for name in names)


@needs_cupy
def test_every_small_moe_variant_exists():
    """The small-T MoE launchers build kernel names from their variant knobs: the first launch's
    variant and every down variant they list name a compiled kernel for every activation kind."""
    from fp4kit.ops import moe as moe_ops

    cubin = _cubin("moe", "sm_90a")
    names = [f"moe_small_gate_up_{kind}_{v}" for v in moe_ops.SMALL_GATE_UP_GEOMETRY
             for kind in ("bf16", "nvfp4", "quant_bf16", "quant_f32")]
    names += [f"moe_small_down_{kind}_{v}" for v in moe_ops.SMALL_DOWN_VARIANTS for kind in ("bf16", "nvfp4", "quant")]
    # the whole-fetch builds the launchers name with SMALL_WHOLE_FETCHES (a "w" appended)
    assert all(v in moe_ops.SMALL_WHOLE_VARIANTS for v in moe_ops.SMALL_GATE_UP_GEOMETRY)
    picked = {moe_ops.small_gate_up_variant(t, 2048, a, 132) for t, a in ((1, 7), (1, 8), (64, 400))}
    assert picked <= set(moe_ops.SMALL_GATE_UP_GEOMETRY)
    assert moe_ops.SMALL_DOWN_VARIANT in moe_ops.SMALL_WHOLE_VARIANTS
    names += [name + "w" for name in names if name.rsplit("_", 1)[1] in moe_ops.SMALL_WHOLE_VARIANTS]
    missing = [name for name in names if name.encode() + b"\0" not in cubin]
    assert not missing, f"moe.cu does not define {missing}"
    assert moe_ops.SMALL_DOWN_VARIANT in moe_ops.SMALL_DOWN_VARIANTS


@needs_cupy
def test_every_grouped_moe_gemm_build_exists(monkeypatch):
    """The grouped expert GEMM's launcher names its build from the pass's token tiles, the blocks
    per SM it is built for, the SwiGLU or combine epilogue and a dense expert: every name it can
    form is a compiled kernel."""
    from fp4kit.ops import moe as moe_ops

    cubin = _cubin("moe", "sm_90a")
    names = []
    for blocks in (2, 3):
        monkeypatch.setattr(moe_ops, "GROUPED_BLOCKS_PER_SM", blocks)
        for tiles in (1, 2, 4, 8):
            names += [moe_ops.grouped_kernel_name(tiles).format(kind) for kind in ("bf16", "nvfp4")]
            names.append(moe_ops.grouped_kernel_name(tiles, swiglu=True).format("bf16"))
            names.append(moe_ops.grouped_kernel_name(tiles, dense=True).format("bf16"))
            names += [moe_ops.grouped_kernel_name(tiles, dense=True, combine=True).format(kind)
                      for kind in ("bf16", "nvfp4")]
    assert {"moe_gemm_swiglu_bf16_1_occ3", "moe_gemm_dense_bf16_8", "moe_gemm_combine_nvfp4_2_occ3",
            "moe_gemm_nvfp4_8"} <= set(names)
    missing = [name for name in names if name.encode() + b"\0" not in cubin]
    assert not missing, f"moe.cu does not define {missing}"


def _launchers() -> dict[str, list[str]]:
    """For each Python module that launches kernels: the kernel file it names (``_MODULE``) and
    the kernels it launches by a literal name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        module = re.search(r'^_MODULE = "(\w+)"', text, re.MULTILINE)
        if module:
            found[str(path.relative_to(PACKAGE))] = (module.group(1),
                                                     re.findall(r'get_kernel\(_MODULE, "(\w+)"', text))
    return found


def test_every_kernel_file_is_loaded_and_every_launched_kernel_exists():
    """The compile test above covers the files that exist; this one ties them to the launchers: a
    launcher naming a missing file or kernel, or a kernel file no launcher loads, fails here."""
    launchers = _launchers()
    files = set(loader.kernel_names())
    named = {module for module, _ in launchers.values()}
    assert named - files == set(), f"launchers name kernel files that do not exist: {sorted(named - files)}"
    assert files - named == set(), f"kernel files that no launcher loads: {sorted(files - named)}"
    for where, (module, kernels) in launchers.items():
        source = loader.kernel_source(module)
        missing = [k for k in kernels if not re.search(rf"\b{k}\s*\(", source)]
        assert not missing, f"{where} launches {missing}, which {module}.cu does not define"


def test_source_inlines_local_headers():
    src = loader.kernel_source("quant")
    assert '#include "' not in src
    assert "// ---- begin common/nvfp4.cuh" in src and "// ---- begin common/fp32.cuh" in src
    assert src.count("// ---- begin common/fp32.cuh") == 1  # each header once


@needs_cupy  # the key includes the CuPy and NVRTC versions
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


def _gemm_sass():
    import sys

    sys.path.insert(0, str(PACKAGE.parent / "scripts"))
    import gemm_sass

    return gemm_sass


def _sass_by_kernel(cubin: bytes) -> dict[str, list[tuple[int, str, str]]]:
    """{kernel: [(address, opcode, modifiers and operands)]} in address order (scripts/gemm_sass.py)."""
    result = _gemm_sass().sass_of(cubin)
    assert result.returncode == 0, result.stderr
    return _gemm_sass().parse(result.stdout)


# global memory instructions (loads, stores, atomics, reductions, async and bulk copies)
_GLOBAL_OPS = {"LDG", "STG", "ATOMG", "ATOM", "RED", "REDG", "LDGSTS", "UBLKCP", "UTMALDG", "UTMASTG", "UBLKRED", "LD",
               "ST"}
# the kernels that may release the next kernel before they exit, when their launch asks for it and
# their grid is a single wave (common/pdl.cuh): the row kernels at their start, the GEMVs once their
# first weights are in flight, the wgmma GEMMs' staging launches and the small-T MoE router right
# after their wait
_RELEASING = re.compile(r"^(rmsnorm_rope_bf16|rmsnorm_rope2_bf16|add_rmsnorm_bf16|embed_rmsnorm_bf16|hc_pre_norm|"
                        r"gemm_gemv_\w+|gemm_stage_\w+|moe_route_\w+)$")
# kernels that issue their first weight loads (non-coherent, read-only) before they wait (the
# routers: their gate weight; the residual norms: their norm weight)
_PREFETCHING = re.compile(r"^(gemm_(tiled|gemv|wgmma)_|moe_small_|moe_route_|moe_router_logits_|add_rmsnorm_bf16$|"
                          r"embed_rmsnorm_bf16$|hc_)")


@needs_cupy
@pytest.mark.parametrize("name", sorted(launch_module.PDL_MODULES))
def test_pdl_kernels_wait_before_touching_memory(name):
    """Every kernel of a module launched with programmatic dependent launch keeps the contract of
    common/pdl.cuh, read off its SASS: it waits (ACQBULK, griddepcontrol.wait), releases the next
    kernel only by exiting (no PREEXIT) unless it is one of the kernels whose single-wave launches
    may release it once (the row kernels, the GEMVs before their wait, the wgmma staging launches
    and the small-T MoE router after theirs); before the first wait (in address order: the W4A16
    gate|up's shared-expert blocks that run beside the router branch past it) it neither writes
    global memory nor
    reads it, except the weight-streaming kernels' read-only (.CONSTANT) loads."""
    if not all(_gemm_sass().find_tool(tool) for tool in ("cuobjdump", "nvdisasm")):
        pytest.skip("cuobjdump / nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    kernels = _sass_by_kernel(_cubin(name, "sm_90a"))
    assert kernels, f"{name}.cu: no kernels in the SASS"
    for kernel, code in kernels.items():
        ops = [op for _, op, _ in code]
        assert "ACQBULK" in ops, f"{name}.cu {kernel}: never waits for the kernel before it (pdl::wait_prior)"
        first_wait = ops.index("ACQBULK")
        if _RELEASING.match(kernel):  # where their launch asks for it (ops/elementwise.py, ops/gemm.py)
            assert ops.count("PREEXIT") == 1, f"{kernel}: expected one conditional release of the next kernel"
            if kernel.startswith("gemm_gemv_"):  # with its first weights in flight, before its wait
                assert ops.index("PREEXIT") < first_wait, f"{kernel}: releases the next kernel after its wait"
            if kernel.startswith(("gemm_stage_", "moe_route_")):  # once its input is final
                assert ops.index("PREEXIT") > first_wait, f"{kernel}: releases the next kernel before its wait"
        else:
            assert "PREEXIT" not in ops, f"{kernel}: releases the next kernel before its blocks exit"
        early = [(op, rest) for _, op, rest in code[:first_wait] if op in _GLOBAL_OPS]
        if _PREFETCHING.match(kernel):
            early = [(op, rest) for op, rest in early if not (op == "LDG" and ".CONSTANT" in rest)]
        assert not early, f"{name}.cu {kernel}: global memory touched before the wait: {early[:4]}"


@needs_cupy
@pytest.mark.parametrize("kernel", ["add_rmsnorm_bf16", "embed_rmsnorm_bf16"])
def test_row_norms_load_their_weight_before_the_wait(kernel):
    """The residual norms' weight loads (16-byte, read-only) are issued ahead of the wait for the
    kernel before, where the compiler is free to move them below it: the point of their layout."""
    if not all(_gemm_sass().find_tool(tool) for tool in ("cuobjdump", "nvdisasm")):
        pytest.skip("cuobjdump / nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    code = _sass_by_kernel(_cubin("elementwise", "sm_90a"))[kernel]
    ops = [op for _, op, _ in code]
    early = [rest for _, op, rest in code[:ops.index("ACQBULK")] if op == "LDG"]
    assert len(early) == 8 and all(".128.CONSTANT" in rest for rest in early), early


# a spin on an acquiring load, then a fence: the load already orders what follows it
_SPIN_THEN_FENCE = re.compile(r"while \([^{;]*gpu_sync::ld_acquire[^{;]*\{(?:\s|//[^\n]*)*\}\s*gpu_sync::fence_acq_rel\(\)")


def test_blocks_meet_through_gpu_sync_without_a_second_fence():
    """Blocks of a launch meet through common/gpu_sync.cuh: no kernel fences with every thread
    (`__threadfence()`, a sequentially consistent MEMBAR each; one thread's release behind a block
    barrier does), and no spin on an acquiring load is followed by a fence (on sm_90 a fence is a
    round trip through the memory system, the acquire only an L1 invalidation)."""
    sources = sorted(loader.KERNEL_DIR.rglob("*.cu")) + sorted(loader.KERNEL_DIR.rglob("*.cuh"))
    assert sources
    for path in sources:
        text = path.read_text()
        assert "__threadfence()" not in text, f"{path.name}: use gpu_sync::last_to_arrive / arrive_acq_rel"
        assert not _SPIN_THEN_FENCE.search(text), f"{path.name}: a fence after a spin on gpu_sync::ld_acquire"
    assert "atom.add.acq_rel.gpu" in (loader.KERNEL_DIR / "common" / "gpu_sync.cuh").read_text()


@needs_cupy
def test_small_moe_gemv_builds_keep_no_stack_frame():
    """The small-T MoE GEMV builds the layer launches at DeepSeek widths (whole-group K, bf16 or
    NVFP4 activations) keep their weight pointers and buffers in registers: a stack frame (local
    memory) in these loops made the layer ≈ 40 % slower at T = 1 (an L2-request helper that indexed
    the row pointers by lane: `cuobjdump -res-usage` STACK:208). The in-block quantization builds
    spill a few words at their register cap; they are not checked here."""
    from fp4kit.ops import moe as moe_ops

    if not all(_gemm_sass().find_tool(tool) for tool in ("cuobjdump", "nvdisasm")):
        pytest.skip("cuobjdump / nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    result = _gemm_sass().resource_usage_of(_cubin("moe", "sm_90a"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    usage = dict(re.findall(r"Function (moe_small_(?:gate_up|down)_(?:bf16|nvfp4)_\w+w):\s*\n\s*(REG:\d+ STACK:\d+ [^\n]*)", out))
    launched = {f"moe_small_{launch}_{kind}_{variant}w" for kind in ("bf16", "nvfp4")
                for launch, variant in [("down", moe_ops.SMALL_DOWN_VARIANT)] + [("gate_up", v) for v in moe_ops.SMALL_GATE_UP_GEOMETRY]}
    assert launched <= set(usage), sorted(launched - set(usage))
    framed = {k: v for k, v in usage.items() if k in launched and ("STACK:0 " not in v or "LOCAL:0 " not in v)}
    assert not framed, framed
