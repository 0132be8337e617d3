"""Array intake: backend detection, zero-copy DLPack import, and input validation.

Every op calls these before it launches anything, so bad input is reported with the argument's
name and the expected and actual value, and never reaches a kernel.

* numpy arrays (and CPU DLPack producers) run the numpy reference;
* CuPy arrays run the kernels; any other CUDA DLPack producer (PyTorch, JAX, ...) is imported
  with `cupy.from_dlpack`: zero-copy, ordered after the producer's stream by an event (no host
  synchronisation).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (BF16, np.dtype(np.float16), np.dtype(np.float32))
DTYPE_SUFFIX = {BF16: "bf16", np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}

_DLPACK_CPU = 1
_DLPACK_CUDA_DEVICES = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def _cupy():
    try:
        import cupy
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return cupy


def is_device_array(x: Any) -> bool:
    cupy = _cupy()
    return cupy is not None and isinstance(x, cupy.ndarray)


def as_array(x: Any, name: str):
    """``x`` as a numpy or CuPy array without copying; raises TypeError for anything else."""
    if isinstance(x, np.ndarray) or is_device_array(x):
        return x
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = int(x.__dlpack_device__()[0])
        if device_type == _DLPACK_CPU:
            return np.from_dlpack(x)
        if device_type in _DLPACK_CUDA_DEVICES:
            cupy = _cupy()
            if cupy is None:
                raise TypeError(f"{name}: a CUDA array needs CuPy (pip install 'fp4kit[cuda13]')")
            return cupy.from_dlpack(x)
        raise TypeError(f"{name}: DLPack device type {device_type} is not supported (CPU or CUDA expected)")
    raise TypeError(f"{name}: expected a numpy, CuPy or DLPack array, got {type(x).__name__}")


def array_module(x):
    if is_device_array(x):
        return _cupy()
    return np


def device_id(x):
    """None for host arrays, the CUDA device ordinal for CuPy arrays."""
    return x.device.id if is_device_array(x) else None


def describe(x) -> str:
    where = "host" if device_id(x) is None else f"cuda:{device_id(x)}"
    return f"shape {tuple(x.shape)}, dtype {x.dtype}, on {where}"


def check_float_input(name: str, x) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype bfloat16, float16 or float32, got {x.dtype}")


def check_contiguous(name: str, x) -> None:
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{name}: expected a C-contiguous array, got strides {x.strides} for shape {tuple(x.shape)} "
            "(make a contiguous copy first, e.g. x.copy())"
        )


def check_aligned(name: str, x, alignment: int = 16) -> None:
    if is_device_array(x) and x.size and x.data.ptr % alignment:
        raise ValueError(f"{name}: expected a {alignment}-byte aligned device pointer, got {x.data.ptr:#x}")


def check_last_dim(name: str, x, multiple: int) -> None:
    if x.ndim == 0 or x.shape[-1] % multiple:
        raise ValueError(f"{name}: last dimension must be a multiple of {multiple}, got shape {tuple(x.shape)}")


def check_same_device(**arrays) -> None:
    """All arrays on the host, or all on one CUDA device."""
    places = {name: device_id(a) for name, a in arrays.items() if a is not None}
    if len(set(places.values())) > 1:
        listing = ", ".join(f"{n} on {'host' if d is None else f'cuda:{d}'}" for n, d in places.items())
        raise ValueError(f"arrays must live on one device (or all on the host), got {listing}")


def check_out(name: str, out, shape: tuple[int, ...], dtype, like) -> None:
    """``out`` must match ``shape`` and ``dtype``, be contiguous, and live where ``like`` lives."""
    if not (isinstance(out, np.ndarray) or is_device_array(out)):
        raise TypeError(f"{name}: expected a numpy or CuPy array, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != np.dtype(dtype):
        raise ValueError(
            f"{name}: expected shape {tuple(shape)} and dtype {np.dtype(dtype).name}, "
            f"got shape {tuple(out.shape)} and dtype {out.dtype}"
        )
    check_contiguous(name, out)
    check_aligned(name, out)
    if device_id(out) != device_id(like):
        raise ValueError(f"{name}: expected an array on the same device as the input, got one {describe(out)}")


def device_out(name: str, out, shape: tuple[int, ...], dtype, like):
    """A device op's output: ``out`` checked as `check_out` does, or a new CuPy array of ``shape``
    and ``dtype`` on the current device when it is None."""
    if out is None:
        return _cupy().empty(shape, dtype)
    check_out(name, out, shape, dtype, like)
    return out


def host_result(result, out=None):
    """The numpy backend's ``result``, written into ``out`` when one was given (and returned)."""
    if out is None:
        return result
    out[...] = result
    return out


def as_scalar_fp32(name: str, s, like=None):
    """``s`` as a 0-d fp32 array in the same memory as ``like`` (default: wherever ``s`` is).

    Scales are never Python floats: a device op must not depend on a host value.
    """
    if isinstance(s, (np.generic, float, int)):
        raise TypeError(
            f"{name}: expected a 0-d float32 array in the same memory as the input, got the "
            f"{type(s).__name__} scalar {s!r}; wrap it, e.g. np.asarray(np.float32(v)) for a numpy input "
            "or cupy.asarray(np.float32(v)) for a device input (scales stay in device memory)"
        )
    if not (isinstance(s, np.ndarray) or hasattr(s, "__dlpack__")):
        raise TypeError(
            f"{name}: expected a 0-d float32 array in the same memory as the input, got {type(s).__name__}"
        )
    s = as_array(s, name)
    check_scalar_fp32(name, s, s if like is None else like)
    return s


def check_scalar_fp32(name: str, s, like) -> None:
    """A 0-d (or 1-element 1-d) fp32 array in the same memory as ``like``."""
    if s.dtype != np.float32 or s.size != 1 or s.ndim > 1:
        raise ValueError(f"{name}: expected a 0-d (or 1-element) float32 array, got {describe(s)}")
    if device_id(s) != device_id(like):
        where = "host" if device_id(like) is None else f"cuda:{device_id(like)}"
        raise ValueError(f"{name}: expected an array on {where} like the input, got one {describe(s)}")
