"""Finding NCCL for ``cupy.cuda.nccl``, lazily: the CPU suite and world size 1 never need it.

CuPy's binding links ``libnccl.so.2``. When the dynamic loader cannot find it, `load` first
loads it by path (global symbols, so the binding's dependency is satisfied by its soname) from:

1. ``$FP4KIT_NCCL_LIBRARY`` (a path to ``libnccl.so.2``);
2. the ``nvidia-nccl-cu13`` / ``nvidia-nccl-cu12`` wheel (``site-packages/nvidia/nccl/lib``),
   which is also where PyTorch's NCCL lives.

This only works before ``cupy.cuda.nccl`` is imported for the first time in the process.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import sys

_HOW_TO_FIX = (
    "install NCCL for CuPy (pip install 'nvidia-nccl-cu13>=2.27.7,<3' for CUDA 13), or point "
    "FP4KIT_NCCL_LIBRARY at a libnccl.so.2 (PyTorch ships one: "
    "python -c \"import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], 'lib'))\"), "
    "or set LD_LIBRARY_PATH / LD_PRELOAD to it before starting Python. "
    "Check with: python -c \"from cupy.cuda import nccl; print(nccl.available, nccl.get_version())\""
)


def candidate_paths() -> list[str]:
    """Where a ``libnccl.so.2`` may be, in the order `load` tries them."""
    paths = []
    if os.environ.get("FP4KIT_NCCL_LIBRARY"):
        paths.append(os.environ["FP4KIT_NCCL_LIBRARY"])
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        paths.extend(sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*"))))
    return paths


def library_dirs() -> list[str]:
    """Directories of `candidate_paths` (the launcher adds them to ``LD_LIBRARY_PATH``)."""
    return sorted({os.path.dirname(p) for p in candidate_paths()})


def load():
    """The ``cupy.cuda.nccl`` module, with NCCL loaded; RuntimeError saying how to fix it if not."""
    if "cupy.cuda.nccl" not in sys.modules:
        for path in candidate_paths():
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CuPy warns on a missing library; the error below says more
        try:
            from cupy.cuda import nccl
        except ImportError as e:
            raise RuntimeError("NCCL: CuPy cannot be imported (" + str(e) + "); pip install 'fp4kit[cuda13]' "
                               "(or '[cuda12]') first. " + _HOW_TO_FIX) from e
    if not getattr(nccl, "available", False):
        tried = candidate_paths() or ["(no candidate found)"]
        raise RuntimeError(f"NCCL: CuPy could not load libnccl.so.2 (tried the loader path and {tried}); " + _HOW_TO_FIX)
    return nccl
