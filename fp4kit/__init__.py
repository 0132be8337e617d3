"""fp4kit: NVFP4 kernels for decoding Mixture-of-Experts models, loaded through CuPy.

Every op takes numpy arrays (runs the numpy reference, the specification) or device arrays
(CuPy, or any CUDA DLPack producer such as PyTorch or JAX: runs the CUDA kernels, zero-copy,
on CuPy's current stream) and returns arrays of the same kind.
"""

from .formats import BLOCK_SIZE, E2M1_VALUES, E4M3_VALUES, Nvfp4Tensor, swizzle_scales, unswizzle_scales
from .ops.quant import amax, dequantize, global_scale_from_amax, quantize, swiglu_quantize
from .runtime.status import check_finite
from .runtime.status import clear as clear_status
from .runtime.status import read as read_status

__version__ = "0.1.0"

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "E4M3_VALUES",
    "Nvfp4Tensor",
    "amax",
    "check_finite",
    "clear_status",
    "dequantize",
    "global_scale_from_amax",
    "quantize",
    "read_status",
    "swiglu_quantize",
    "swizzle_scales",
    "unswizzle_scales",
]
