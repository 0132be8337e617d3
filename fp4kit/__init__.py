"""fp4kit: NVFP4 kernels for decoding Mixture-of-Experts models, loaded through CuPy.

Every op takes numpy arrays (runs the numpy reference, the specification) or device arrays
(CuPy, or any CUDA DLPack producer such as PyTorch or JAX: runs the CUDA kernels, zero-copy,
on CuPy's current stream) and returns arrays of the same kind.

What ``import fp4kit`` gives:

* the ops and formats: `quantize`, `dequantize`, `amax`, `global_scale_from_amax`,
  `swiglu_quantize`, `Nvfp4Tensor`, the status word (`check_finite`, `read_status`, `clear_status`);
* the layers: `Linear`, `SharedExpert`, `MoE`, `RoutingConfig`, `KVCache`, `Indexer`,
  `SparseAttention`, `Sampler`, `Generator` (also as `fp4kit.layers`);
* checkpoints: `load_nvfp4`, `save_nvfp4` (and the rest in `fp4kit.checkpoint`);
* the subpackages `fp4kit.layers`, `fp4kit.ops`, `fp4kit.checkpoint`, `fp4kit.distributed`.

The layers, checkpoints and subpackages are imported on first use (a module ``__getattr__``),
so ``import fp4kit`` stays as cheap as the ops it always needs.

``device=`` means one thing wherever it appears (layers, `load_nvfp4`): ``None`` / ``False`` /
``"cpu"`` host memory and the numpy reference; ``True`` / ``"cuda"`` CuPy's current device;
``"cuda:N"`` / ``N`` device N. A CUDA choice without a usable CUDA device raises one
``RuntimeError`` that says why and to pass ``device=False`` (see `fp4kit.runtime.device`).
"""

from __future__ import annotations

import importlib

from .formats import BLOCK_SIZE, E2M1_VALUES, E4M3_VALUES, Nvfp4Tensor, swizzle_scales, unswizzle_scales
from .ops.quant import amax, dequantize, global_scale_from_amax, quantize, swiglu_quantize
from .runtime.status import check_finite
from .runtime.status import clear as clear_status
from .runtime.status import read as read_status

__version__ = "0.1.0"

#: subpackages imported on first attribute access
_SUBMODULES = ("checkpoint", "distributed", "layers", "ops", "runtime")
#: public names imported on first access, and the module that defines each
_LAZY = {
    "Generator": "layers",
    "Indexer": "layers",
    "KVCache": "layers",
    "Linear": "layers",
    "MoE": "layers",
    "RoutingConfig": "layers",
    "Sampler": "layers",
    "SharedExpert": "layers",
    "SparseAttention": "layers",
    "load_nvfp4": "checkpoint",
    "save_nvfp4": "checkpoint",
}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fp4kit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "E4M3_VALUES",
    "Generator",
    "Indexer",
    "KVCache",
    "Linear",
    "MoE",
    "Nvfp4Tensor",
    "RoutingConfig",
    "Sampler",
    "SharedExpert",
    "SparseAttention",
    "amax",
    "check_finite",
    "checkpoint",
    "clear_status",
    "dequantize",
    "distributed",
    "global_scale_from_amax",
    "layers",
    "load_nvfp4",
    "ops",
    "quantize",
    "read_status",
    "save_nvfp4",
    "swiglu_quantize",
    "swizzle_scales",
    "unswizzle_scales",
]
