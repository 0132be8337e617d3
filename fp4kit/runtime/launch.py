"""Kernel launches with programmatic dependent launch (PDL), through the driver's ``cuLaunchKernelEx``.

A kernel launched with the programmatic-serialization attribute may be scheduled while the kernel
before it in the stream is still running; it waits for that kernel's results inside
(``griddepcontrol.wait``, ``raw_kernels/common/pdl.cuh``). At decode sizes a step is a chain of
short kernels, so each one's launch latency, and the first weight loads of the GEMMs, overlap the
kernel before instead of following it. fp4kit uses it while a stream is being captured (the
dependency becomes a programmatic edge of the CUDA graph); eager launches go through CuPy, whose
launcher costs the host less than the packing here.

Only kernels that keep the contract of ``pdl.cuh`` may be launched this way: those of the modules
in `PDL_MODULES` (tests/test_compile.py checks every one of their kernels in the SASS). ``FP4KIT_PDL=0``
launches everything through CuPy as before.

CuPy has no ``cuLaunchKernelEx``, so the arguments are packed here as CuPy packs them: a
`cupy.ndarray` is its device pointer, a numpy scalar its own bytes, a Python int an int64, a
float a double, a bool one byte.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

PDL_MODULES = frozenset({"attention", "elementwise", "gemm", "hyper", "indexer", "kv_cache", "moe"})
_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: the id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_int), ("value", ctypes.c_int), ("_rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)),
                ("num_attrs", ctypes.c_uint)]


def enabled() -> bool:
    """Whether PDL-ready kernels are launched with PDL in captured graphs (``FP4KIT_PDL``: 1, the
    default, or 0)."""
    value = os.environ.get("FP4KIT_PDL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"FP4KIT_PDL: expected 0 or 1, got {value!r}")
    return value == "1"


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_Config)]
    lib.cuOccupancyMaxActiveClusters.restype = ctypes.c_int
    return lib


def pack(args: tuple) -> list:
    """The kernel arguments as ctypes objects, in the encoding CuPy's launcher uses."""
    import cupy

    packed = []
    for i, a in enumerate(args):
        if isinstance(a, cupy.ndarray):
            packed.append(ctypes.c_uint64(a.data.ptr))
        elif isinstance(a, np.generic):
            packed.append((ctypes.c_char * a.itemsize).from_buffer_copy(a.tobytes()))
        elif isinstance(a, bool):
            packed.append(ctypes.c_bool(a))
        elif isinstance(a, int):
            packed.append(ctypes.c_int64(a))
        elif isinstance(a, float):
            packed.append(ctypes.c_double(a))
        else:
            raise TypeError(f"kernel argument {i}: expected a cupy.ndarray, a numpy scalar, an int, a float or a "
                            f"bool, got {type(a).__name__}")
    return packed


def _check(status: int, what: str) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({status})")


def max_active_clusters(function_ptr: int, cluster: int, block: int, shared_mem: int) -> int:
    """Clusters of ``cluster`` blocks of ``function_ptr`` (a CUfunction compiled with
    ``__cluster_dims__(1, cluster, 1)``) that the current device holds at once: a cluster's blocks
    share one GPC, so this can be fewer than the resident blocks over ``cluster``."""
    config = _Config(1, int(cluster), 1, int(block), 1, 1, int(shared_mem), None, None, 0)
    count = ctypes.c_int(0)
    _check(_driver().cuOccupancyMaxActiveClusters(ctypes.byref(count), function_ptr, ctypes.byref(config)),
           "cuOccupancyMaxActiveClusters")
    return count.value


def launch(function_ptr: int, grid: tuple, block: tuple, args: tuple, shared_mem: int, stream_ptr: int) -> None:
    """Launch ``function_ptr`` (a CUfunction) on ``stream_ptr`` with the PDL attribute."""
    packed = pack(args)
    params = (ctypes.c_void_p * max(1, len(packed)))(*[ctypes.addressof(p) for p in packed])
    attr = _Attribute(id=_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    config = _Config(*grid, *block, shared_mem, stream_ptr, ctypes.pointer(attr), 1)
    _check(_driver().cuLaunchKernelEx(ctypes.byref(config), function_ptr, params, None), "cuLaunchKernelEx")
