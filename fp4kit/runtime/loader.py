"""The kernel loader: compiles ``fp4kit/raw_kernels/<name>.cu`` once per process and device.

* Local headers (``#include "common/x.cuh"``) are inlined into the source string, so the code
  that is compiled, CuPy's on-disk cache key and our in-process key all cover every header:
  editing a header can never run a stale binary.
* The target is explicit: ``sm_90a`` on Hopper, ``sm_100a`` / ``sm_103a`` / ``sm_120a`` /
  ``sm_121a`` on Blackwell (the ``a`` variants enable architecture-specific instructions).
* The in-process key is (source, options, target, CuPy version, NVRTC version, cooperative);
  concurrent first use from many threads compiles once (a lock per key).
* `compile_offline` runs the same source and options through NVRTC with no GPU and no driver,
  which is how CI checks that every kernel compiles for sm_90a and sm_100a.
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import launch

KERNEL_DIR = Path(__file__).resolve().parent.parent / "raw_kernels"
BASE_OPTIONS = ("-std=c++17",)
OFFLINE_TARGETS = ("sm_90a", "sm_100a")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_ARCH_BY_CC = {"90": "sm_90a", "100": "sm_100a", "103": "sm_103a", "120": "sm_120a", "121": "sm_121a"}


def kernel_names() -> list[str]:
    """Every compilable kernel file (``raw_kernels/*.cu``), by stem."""
    return sorted(p.stem for p in KERNEL_DIR.glob("*.cu"))


def kernel_source(name: str) -> str:
    """The source of ``raw_kernels/<name>.cu`` with its local headers inlined (each once)."""
    path = KERNEL_DIR / f"{name}.cu"
    if not path.is_file():
        raise ValueError(f"kernel: no such kernel file {path.name!r}; have {kernel_names()}")
    seen: set[Path] = set()
    root = KERNEL_DIR.resolve()

    def expand(file: Path) -> str:
        text = file.read_text()

        def include(match: re.Match) -> str:
            header = (file.parent / match.group(1)).resolve()
            if not header.is_file():
                raise FileNotFoundError(f"{file.name}: included header {match.group(1)!r} not found")
            label = header.relative_to(root).as_posix()
            if header in seen:
                return f"// (already included: {label})"
            seen.add(header)
            return f"// ---- begin {label}\n{expand(header)}\n// ---- end {label}"

        return _INCLUDE.sub(include, text)

    return expand(path)


def target_arch(compute_capability: str) -> str:
    """The compile target for a device of ``compute_capability`` (e.g. ``"90"`` -> ``"sm_90a"``)."""
    return _ARCH_BY_CC.get(str(compute_capability), f"sm_{compute_capability}")


def compile_options(arch: str) -> tuple[str, ...]:
    """The options fp4kit passes to NVRTC (CuPy adds ``-ftz=true`` and its include paths)."""
    return (*BASE_OPTIONS, f"-arch={arch}")


@functools.cache
def _toolchain_versions() -> tuple[str, str]:
    import cupy
    from cupy.cuda import nvrtc

    return cupy.__version__, ".".join(map(str, nvrtc.getVersion()))


def module_key(source: str, options: tuple[str, ...], arch: str, cooperative: bool) -> str:
    """In-process cache key: the source with its headers, options, target and toolchain versions."""
    cupy_version, nvrtc_version = _toolchain_versions()
    h = hashlib.sha256()
    for part in (source, "\0".join(options), arch, cupy_version, nvrtc_version, str(cooperative)):
        h.update(part.encode())
        h.update(b"\x1f")
    return h.hexdigest()


class OnceCache:
    """A dict whose values are built once per key even under concurrent first use."""

    def __init__(self) -> None:
        self._values: dict = {}
        self._locks: dict = {}
        self._guard = threading.Lock()

    def get(self, key, build: Callable[[], object]):
        value = self._values.get(key)
        if value is not None:
            return value
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            value = self._values.get(key)
            if value is None:
                value = build()
                self._values[key] = value
            return value

    def __len__(self) -> int:
        return len(self._values)


_modules = OnceCache()
_kernels = OnceCache()


@dataclass(frozen=True)
class Kernel:
    """A compiled kernel and the facts a launcher needs."""

    function: object  # cupy.RawKernel
    cooperative: bool
    max_blocks: int  # co-resident blocks for the default block size (cooperative grids)
    pdl: bool = False  # keeps the contract of common/pdl.cuh: launched with PDL (runtime/launch.py)

    def __call__(self, grid: int, block: int, args: tuple) -> None:
        self.launch((grid,), block, args)

    def resident_blocks(self, block: int, shared_mem: int = 0) -> int:
        """Blocks of ``block`` threads with ``shared_mem`` bytes of dynamic shared memory that the
        current device holds at once (a grid of at most this many is a single wave)."""
        self._allow_shared(shared_mem)
        return _resident_blocks(self.function.kernel.ptr, int(block), int(shared_mem), current_sm_count())

    def resident_clusters(self, cluster: int, block: int, shared_mem: int = 0) -> int:
        """Clusters of ``cluster`` blocks (the kernel's compiled cluster size) of ``block`` threads
        with ``shared_mem`` bytes of dynamic shared memory that the current device holds at once."""
        self._allow_shared(shared_mem)
        return _resident_clusters(self.function.kernel.ptr, int(cluster), int(block), int(shared_mem))

    def _allow_shared(self, shared_mem: int) -> None:
        # a function attribute, not a stream operation: fine under graph capture
        if shared_mem and self.function.max_dynamic_shared_size_bytes < shared_mem:
            self.function.max_dynamic_shared_size_bytes = shared_mem

    def launch(self, grid: tuple, block: int, args: tuple, shared_mem: int = 0) -> None:
        """Launch on a 1- to 3-D grid with ``shared_mem`` bytes of dynamic shared memory, raising the
        kernel's limit first when it is above 48 KB."""
        self._allow_shared(shared_mem)
        grid = tuple(int(g) for g in grid)
        if self.pdl and launch.enabled():
            import cupy

            stream = cupy.cuda.get_current_stream()
            # PDL in captured graphs only: eager launches stay on CuPy's launcher, which costs the
            # host less per launch (eager dequantize + cuBLAS calls were host-bound: 76 -> 94 µs)
            if stream.is_capturing():
                launch.launch(self.function.kernel.ptr, grid, (int(block),), args, shared_mem, stream.ptr)
                return
        self.function(grid, (int(block),), args, shared_mem=shared_mem)


@functools.cache
def _resident_blocks(function_ptr: int, block: int, shared_mem: int, sms: int) -> int:
    from cupy.cuda import driver

    return driver.occupancyMaxActiveBlocksPerMultiprocessor(function_ptr, block, shared_mem) * sms


@functools.cache
def _resident_clusters(function_ptr: int, cluster: int, block: int, shared_mem: int) -> int:
    return launch.max_active_clusters(function_ptr, cluster, block, shared_mem)


@functools.cache
def sm_count(device_id: int) -> int:
    """Multiprocessors of CUDA device ``device_id`` (read once: CuPy's ``attributes`` queries them all)."""
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def current_sm_count() -> int:
    """Multiprocessors of the current CUDA device (`sm_count`)."""
    import cupy

    return sm_count(cupy.cuda.Device().id)


@functools.cache
def compute_capability(device_id: int) -> str:
    """Compute capability of CUDA device ``device_id`` as CuPy spells it (``"90"`` on Hopper)."""
    import cupy

    return str(cupy.cuda.Device(device_id).compute_capability)


def get_module(name: str, *, cooperative: bool = False):
    """The compiled `cupy.RawModule` of ``raw_kernels/<name>.cu`` for the current device."""
    import cupy

    device = cupy.cuda.Device()
    arch = target_arch(device.compute_capability)
    source = kernel_source(name)
    options = compile_options(arch)
    key = (device.id, module_key(source, options, arch, cooperative))

    def build():
        module = cupy.RawModule(code=source, options=options, enable_cooperative_groups=cooperative)
        module.compile()  # compile now, under the lock, not lazily at the first launch
        return module

    return _modules.get(key, build)


def get_kernel(module: str, function: str, *, cooperative: bool = False, block: int = 256) -> Kernel:
    """A kernel of ``raw_kernels/<module>.cu`` by its ``extern "C"`` name, cached per device."""
    import cupy
    from cupy.cuda import driver

    device = cupy.cuda.Device()

    def build():
        raw = get_module(module, cooperative=cooperative).get_function(function)
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(raw.kernel.ptr, block, 0)
        return Kernel(raw, cooperative, max(1, per_sm) * sm_count(device.id),
                      pdl=module in launch.PDL_MODULES and not cooperative)

    return _kernels.get((device.id, module, function, cooperative, block), build)


def compile_offline(name: str, arch: str) -> bytes:
    """Compile ``raw_kernels/<name>.cu`` for ``arch`` to a cubin without a GPU or driver.

    Uses the option list CuPy's RawModule builds (its include paths, ``-ftz=true``,
    ``--device-as-default-execution-space``) with the same source and fp4kit options.
    Raises ``cupy.cuda.compiler.CompileException`` with the NVRTC log on error.
    """
    from cupy._core import core
    from cupy.cuda import compiler

    options = core.assemble_cupy_compiler_options(compile_options(arch))
    options += ("-ftz=true", f"-arch={arch}", "--device-as-default-execution-space")
    program = compiler._NVRTCProgram(kernel_source(name), f"{name}.cu", method="cubin")
    cubin, _ = program.compile(options)
    return cubin
