"""Where work runs: the one probe for a usable CUDA device and the one meaning of ``device=``.

Every ``device=`` argument of fp4kit (`fp4kit.layers.KVCache`, `fp4kit.layers.Generator`,
`fp4kit.checkpoint.load_nvfp4`, ...) is read by `resolve` and means the same thing:

=======================================  ===================================================
``None``, ``False``, ``"cpu"``           host memory: numpy arrays, the numpy reference
``True``, ``"cuda"``                     CuPy's current CUDA device (at the time of the call)
``"cuda:N"``, ``N`` (an int >= 0)        CUDA device ``N``
=======================================  ===================================================

Asking for a CUDA device where none is usable (CuPy missing, no driver, a driver too old for
the CUDA runtime, no visible device) raises one `RuntimeError` that says why and that
``device=False`` (or ``"cpu"``) runs the numpy backend; nothing falls back silently.

The probe runs once per process (a process does not gain or lose GPUs) and never raises.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

#: what ``device=`` accepts, for messages
ACCEPTED = "None/False/'cpu' (host, numpy), True/'cuda' (the current CUDA device), 'cuda:N' or an int N"


@functools.cache
def _probe() -> tuple[int, str | None]:
    """(number of usable CUDA devices, why there is none or None)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CuPy whose CUDA libraries fail to load
        return 0, f"CuPy cannot be imported ({type(e).__name__}: {e}; pip install 'fp4kit[cuda13]' or '[cuda12]')"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # no driver, or one older than the CUDA runtime (cudaErrorInsufficientDriver)
        return 0, f"CuPy finds no usable CUDA driver ({type(e).__name__}: {e})"
    if count == 0:
        return 0, "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)"
    return count, None


def device_count() -> int:
    """Usable CUDA devices (0 without CuPy or a driver); never raises."""
    return _probe()[0]


def cuda_available() -> bool:
    """Whether at least one CUDA device is usable through CuPy; never raises."""
    return device_count() > 0


def unavailable_reason() -> str | None:
    """Why no CUDA device is usable, or None when one is."""
    return _probe()[1]


def resolve(device, name: str = "device") -> int | None:
    """``device`` (see the module docstring) as None (host) or a CUDA device ordinal.

    Raises TypeError / ValueError for a value outside the accepted ones, and RuntimeError when
    a CUDA device is asked for and none is usable (the message says to pass ``device=False``).
    """
    if isinstance(device, (bool, np.bool_)):
        if not device:
            return None
        ordinal = None
    elif device is None or (isinstance(device, str) and device == "cpu"):
        return None
    elif isinstance(device, str) and device == "cuda":
        ordinal = None
    elif isinstance(device, (int, np.integer)):
        if device < 0:
            raise ValueError(f"{name}: expected a non-negative CUDA device ordinal, got {int(device)}")
        ordinal = int(device)
    elif isinstance(device, str):
        head, _, tail = device.partition(":")
        if head != "cuda" or not tail.isdigit():
            raise ValueError(f"{name}: expected {ACCEPTED}; got {device!r}")
        ordinal = int(tail)
    else:
        raise TypeError(f"{name}: expected {ACCEPTED}; got {type(device).__name__}")
    count, reason = _probe()
    if reason is not None:
        raise RuntimeError(
            f"{name}={device!r} asks for a CUDA device, but none is usable: {reason}. "
            f"Pass {name}=False (or 'cpu') to run on the numpy backend."
        )
    if ordinal is None:
        import cupy

        return cupy.cuda.Device().id
    if ordinal >= count:
        raise ValueError(f"{name}: CUDA device {ordinal} does not exist ({count} visible: 0..{count - 1})")
    return ordinal


def array_module(ordinal: int | None):
    """numpy for the host (None), CuPy for a CUDA device ordinal."""
    if ordinal is None:
        return np
    import cupy

    return cupy


def using(ordinal: int | None):
    """A context manager that makes CUDA device ``ordinal`` current while buffers are allocated
    on it (does nothing for the host)."""
    if ordinal is None:
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(ordinal)
