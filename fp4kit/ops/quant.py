"""NVFP4 quantization ops: validate inputs, pick the backend, launch ``raw_kernels/quant.cu``.

Each op takes numpy arrays (runs `fp4kit.reference.quant`) or device arrays (CuPy, or any CUDA
DLPack producer such as a PyTorch tensor: runs the kernels on CuPy's current stream and returns
CuPy arrays). Inputs are validated before anything launches; outputs go into ``out=`` when given.
No op reads a device value on the host, so every device op can be captured in a CUDA graph
(run each op once eagerly first: the first call compiles and allocates scratch).
"""

from __future__ import annotations

import numbers

import numpy as np

from .. import formats
from ..formats import BLOCK_SIZE, Nvfp4Tensor
from ..reference import quant as ref
from ..runtime import arrays, loader, status, workspace

_MODULE = "quant"  # raw_kernels/quant.cu, loaded for cooperative launch (grid-wide amax)
_THREADS = 256
_I32 = np.int32
_U32 = np.uint32
_MAX_BLOCKS = 2**31  # the kernels index 16-element blocks with 32-bit integers


def _kernel(name: str) -> loader.Kernel:
    return loader.get_kernel(_MODULE, name, cooperative=True, block=_THREADS)


def _grid(kernel: loader.Kernel, work_items: int) -> int:
    return max(1, min(-(-work_items // _THREADS), kernel.max_blocks))


def _intake(x, name: str, last_dim_multiple: int):
    x = arrays.as_array(x, name)
    arrays.check_float_input(name, x)
    arrays.check_last_dim(name, x, last_dim_multiple)
    arrays.check_contiguous(name, x)
    arrays.check_aligned(name, x)
    if x.size // BLOCK_SIZE >= _MAX_BLOCKS:
        raise ValueError(f"{name}: {x.size} elements is too large; at most {_MAX_BLOCKS * BLOCK_SIZE - 1} per call")
    return x


def _scale_arg(global_scale, like, name: str = "global_scale"):
    if global_scale is None:
        return None
    return arrays.as_scalar_fp32(name, global_scale, like)


def _dtype(dtype) -> np.dtype:
    d = np.dtype(dtype)
    if d not in arrays.FLOAT_DTYPES:
        raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {d}")
    return d


def _prepare_out(out: Nvfp4Tensor | None, shape, scale_layout: str, like) -> Nvfp4Tensor:
    """Validate ``out`` for a result of ``shape`` or allocate one next to ``like``."""
    ref._check_quantize_layout(scale_layout)
    formats.block_scale_shape(shape, scale_layout)  # validates the layout for this shape
    if out is None:
        xp = arrays.array_module(like)
        return Nvfp4Tensor(
            xp.empty((*shape[:-1], shape[-1] // 2), dtype=np.uint8),
            xp.empty(formats.block_scale_shape(shape, scale_layout), dtype=np.uint8),
            xp.empty((), dtype=np.float32),
            scale_layout,
            shape,
        )
    if not isinstance(out, Nvfp4Tensor):
        raise TypeError(f"out: expected an Nvfp4Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.scale_layout != scale_layout:
        raise ValueError(
            f"out: expected an Nvfp4Tensor of shape {tuple(shape)} with scale_layout {scale_layout!r}, "
            f"got shape {out.shape} with scale_layout {out.scale_layout!r}"
        )
    arrays.check_out("out.packed", out.packed, (*shape[:-1], shape[-1] // 2), np.uint8, like)
    arrays.check_out("out.block_scales", out.block_scales, formats.block_scale_shape(shape, scale_layout), np.uint8, like)
    arrays.check_out("out.global_scale", out.global_scale, (), np.float32, like)
    return out


def _copy_into(out: Nvfp4Tensor, q: Nvfp4Tensor) -> Nvfp4Tensor:
    out.packed[...] = q.packed
    out.block_scales[...] = q.block_scales
    out.global_scale[...] = q.global_scale
    return out


def _layout_args(out: Nvfp4Tensor):
    rows, kblocks = out.rows, out.shape[-1] // BLOCK_SIZE
    padded_kblocks = formats.swizzled_shape(rows, kblocks)[1]
    swizzled = out.scale_layout == "swizzled"
    # blocks to quantize, and entries the swizzle padding loop visits
    work = max(rows * kblocks, formats.swizzled_shape(rows, kblocks)[0] * padded_kblocks if swizzled else 0)
    if work >= _MAX_BLOCKS:
        raise ValueError(f"out: {work} block scales is too large; the kernels index at most {_MAX_BLOCKS - 1}")
    args = (out.packed, out.block_scales, _U32(rows), _U32(kblocks), _I32(swizzled), _U32(padded_kblocks),
            status.device_word())
    return args, work


def _record_host_nonfinite(values) -> None:
    if ref.has_nonfinite(values):
        status.record_host(status.NONFINITE_INPUT)


def _record_host_bad_scale(s) -> None:
    """A host encode scale that is not a positive finite fp32 (0, negative, NaN, ±Inf) makes every
    code and decode factor meaningless: record it as the device records it (a scale is data, never
    read back on the device path, so this is a status event rather than an exception)."""
    v = np.asarray(s, np.float32).reshape(())
    if not (v > 0 and v <= np.finfo(np.float32).max):
        status.record_host(status.NONFINITE_INPUT)


def amax(x, *, out=None):
    """``max |x|`` over the whole tensor as a 0-d fp32 array (NaN if any element is NaN).

    Parameters
    ----------
    x : bf16 / fp16 / fp32 array ``[..., K]``, K a multiple of 16, contiguous
    out : 0-d fp32 array in the same memory, optional

    A single cooperative launch on the device: per-block maxima, a grid-wide barrier, then
    one reduction; correct for any grid size. A NaN or Inf input sets the status word.
    """
    x = _intake(x, "x", BLOCK_SIZE)
    if out is not None:
        arrays.check_out("out", out, (), np.float32, x)
    if not arrays.is_device_array(x):
        _record_host_nonfinite(x)
        return arrays.host_result(ref.amax(x), out)
    import cupy

    out = cupy.empty((), dtype=np.float32) if out is None else out
    kernel = _kernel(f"amax_{arrays.DTYPE_SUFFIX[x.dtype]}")
    nblocks = x.size // BLOCK_SIZE
    grid = _grid(kernel, nblocks)
    unused_scale = workspace.scalar()  # the kernel also derives S; amax() does not return it
    kernel(grid, _THREADS, (x, _U32(nblocks), out, unused_scale, workspace.partials(), status.device_word()))
    return out


def global_scale_from_amax(amax_value, *, out=None):
    """Encode scale ``S = min(2688 / amax, FLT_MAX)`` (1 if that is 0 or amax is not finite).

    ``amax_value`` is a 0-d fp32 array (host or device); the result lives in the same memory.
    """
    amax_value = arrays.as_scalar_fp32("amax", amax_value)
    if out is not None:
        arrays.check_out("out", out, (), np.float32, amax_value)
    if not arrays.is_device_array(amax_value) and np.signbit(np.asarray(amax_value, np.float32)).any():
        status.record_host(status.NONFINITE_INPUT)  # an amax is |x|: a negative one (even -0.0) is not one
    if not arrays.is_device_array(amax_value):
        result = ref.global_scale_from_amax(amax_value.reshape(()))
        _record_host_nonfinite(amax_value)
        return arrays.host_result(result, out)
    import cupy

    out = cupy.empty((), dtype=np.float32) if out is None else out
    _kernel("global_scale_from_amax")(1, 32, (amax_value, out, status.device_word()))
    return out


def quantize(x, *, global_scale=None, scale_layout: str = "linear", out: Nvfp4Tensor | None = None) -> Nvfp4Tensor:
    """Quantize ``x`` to NVFP4 (the recipe of docs/design.md §1, bit-exact with the reference).

    Parameters
    ----------
    x : bf16 / fp16 / fp32 array ``[..., K]``, K a multiple of 16, C-contiguous
        Any leading dimensions; an empty tensor is valid and gives an empty result.
    global_scale : 0-d fp32 array, optional
        A static encode scale ``S`` in the same memory as ``x`` (e.g. ``1 / input_scale`` of a
        ModelOpt checkpoint, kept on the device). ``None``: ``S`` is computed from ``amax(x)``
        in the same launch (a grid-wide barrier, one cooperative kernel).
    scale_layout : "linear" or "swizzled"
        ``"swizzled"`` (2-D inputs only) writes the zero-padded 128x4 tile layout of cuBLASLt.
    out : Nvfp4Tensor, optional
        Preallocated result of the same shape and layout, in the same memory as ``x``.

    Returns
    -------
    Nvfp4Tensor
        Its ``global_scale`` holds the ``S`` used: computed by the kernel, or a device-side
        copy of the static scale.

    A NaN or Inf input, and a static ``global_scale`` that is not a positive finite number, are
    recorded in the status word (`fp4kit.check_finite`).
    """
    x = _intake(x, "x", BLOCK_SIZE)
    global_scale = _scale_arg(global_scale, x)
    out = _prepare_out(out, tuple(x.shape), scale_layout, x)
    if not arrays.is_device_array(x):
        _record_host_nonfinite(x)
        if global_scale is not None:
            _record_host_bad_scale(global_scale)
        return _copy_into(out, ref.quantize(x, global_scale, scale_layout))
    suffix = arrays.DTYPE_SUFFIX[x.dtype]
    layout_args, work = _layout_args(out)
    if global_scale is None:
        kernel = _kernel(f"amax_quantize_{suffix}")
        args = (x, workspace.scalar(), out.global_scale, workspace.partials(), *layout_args)
    else:
        kernel = _kernel(f"quantize_{suffix}")
        args = (x, global_scale, *layout_args)
        out.global_scale[...] = global_scale.reshape(())
    kernel(_grid(kernel, work), _THREADS, args)
    return out


def check_limit(limit) -> None:
    """DeepSeek-V4's ``swiglu_limit``: None or a positive finite real number."""
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
        raise TypeError(f"limit: expected a positive finite float or None, got {type(limit).__name__} {limit!r}")
    if not (np.isfinite(limit) and limit > 0):
        raise ValueError(f"limit: expected a positive finite float or None, got {limit!r}")


def _swiglu_args(h, layout, limit, row_scale):
    """Validated (h, row_scale) and the source arguments shared by the SwiGLU kernels."""
    h = _intake(h, "h", 2 * BLOCK_SIZE)
    if layout not in ref.SWIGLU_LAYOUTS:
        raise ValueError(f"layout: expected one of {ref.SWIGLU_LAYOUTS}, got {layout!r}")
    check_limit(limit)
    if row_scale is not None:
        row_scale = arrays.as_array(row_scale, "row_scale")
        if row_scale.dtype != np.float32 or tuple(row_scale.shape) != tuple(h.shape[:-1]):
            raise ValueError(
                f"row_scale: expected float32 of shape {tuple(h.shape[:-1])}, got {arrays.describe(row_scale)}"
            )
        arrays.check_contiguous("row_scale", row_scale)
        arrays.check_same_device(h=h, row_scale=row_scale)
    source = (h, row_scale if row_scale is not None else 0, np.float32(limit or 0.0), _I32(limit is not None))
    return h, row_scale, source


def swiglu(h, *, layout: str = "interleaved", limit: float | None = None, row_scale=None, out=None):
    """``silu(gate) * up`` (with the optional clamp and row factor of `swiglu_quantize`), computed
    in fp32 and rounded to bf16: ``[..., 2I]`` to ``[..., I]``. The W4A16 down-projection input."""
    h, row_scale, source = _swiglu_args(h, layout, limit, row_scale)
    shape = (*h.shape[:-1], h.shape[-1] // 2)
    if out is not None:
        arrays.check_out("out", out, shape, arrays.BF16, h)
    if not arrays.is_device_array(h):
        return arrays.host_result(ref.swiglu(h, layout, limit, row_scale).astype(arrays.BF16), out)
    import cupy

    out = cupy.empty(shape, dtype=arrays.BF16) if out is None else out
    rows, kblocks = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1] // BLOCK_SIZE
    kernel = _kernel(f"swiglu_{arrays.DTYPE_SUFFIX[h.dtype]}_{layout}")
    kernel(_grid(kernel, rows * kblocks), _THREADS, (*source, out, _U32(rows), _U32(kblocks)))
    return out


def swiglu_quantize(
    h,
    *,
    layout: str = "interleaved",
    limit: float | None = None,
    row_scale=None,
    global_scale=None,
    scale_layout: str = "linear",
    out: Nvfp4Tensor | None = None,
) -> Nvfp4Tensor:
    """Deinterleave + SwiGLU (+ clamp) + amax + quantize, in one launch on the device.

    Parameters
    ----------
    h : bf16 / fp16 / fp32 array ``[..., 2I]``, I a multiple of 16, C-contiguous
        Fused gate|up projection output in ``layout``.
    layout : "interleaved" or "concatenated"
        ``"interleaved"``: 16-element chunks alternate gate, up, gate, up, ... (the layout a
        GEMM epilogue can apply SwiGLU to); ``"concatenated"``: ``[gate | up]``.
    limit : float, optional
        DeepSeek-V4 ``swiglu_limit``: gate clamped to ``<= limit``, up to ``[-limit, limit]``.
    row_scale : fp32 array ``[...]`` (one per row of ``h``), optional
        Multiplies each row of the activation before quantization (V4 applies the routing
        weight before the down projection).
    global_scale, scale_layout, out
        As in `quantize`; the result has shape ``[..., I]``.

    The activation ``silu(gate) * up`` is computed in fp32 and quantized without rounding in
    between. A NaN or Inf activation is recorded in the status word.
    """
    h, row_scale, source_args = _swiglu_args(h, layout, limit, row_scale)
    global_scale = _scale_arg(global_scale, h)
    shape = (*h.shape[:-1], h.shape[-1] // 2)
    out = _prepare_out(out, shape, scale_layout, h)
    if not arrays.is_device_array(h):
        act = ref.swiglu(h, layout, limit, row_scale)
        _record_host_nonfinite(act)
        if global_scale is not None:
            _record_host_bad_scale(global_scale)
        return _copy_into(out, ref.quantize(act, global_scale, scale_layout))
    suffix = f"{arrays.DTYPE_SUFFIX[h.dtype]}_{layout}"
    layout_args, work = _layout_args(out)
    if global_scale is None:
        kernel = _kernel(f"swiglu_amax_quantize_{suffix}")
        args = (*source_args, workspace.scalar(), out.global_scale, workspace.partials(), *layout_args)
    else:
        kernel = _kernel(f"swiglu_quantize_{suffix}")
        args = (*source_args, global_scale, *layout_args)
        out.global_scale[...] = global_scale.reshape(())
    kernel(_grid(kernel, work), _THREADS, args)
    return out


def dequantize(q: Nvfp4Tensor, dtype=np.float32, *, out=None):
    """``e2m1 * (fp32(block_scale) / S)`` rounded to ``dtype`` (bf16, fp16 or fp32).

    Works on either scale layout; the result has ``q.shape`` and lives where ``q`` lives. A
    ``q.global_scale`` that is not a positive finite number is recorded in the status word.
    """
    if not isinstance(q, Nvfp4Tensor):
        raise TypeError(f"q: expected an Nvfp4Tensor, got {type(q).__name__}")
    dtype = _dtype(dtype)
    if not arrays.is_device_array(q.packed):
        _record_host_bad_scale(q.global_scale)

    if out is not None:
        arrays.check_out("out", out, q.shape, dtype, q.packed)
    if not arrays.is_device_array(q.packed):
        return arrays.host_result(ref.dequantize(q, dtype), out)
    import cupy

    arrays.check_same_device(**{"q.packed": q.packed, "q.block_scales": q.block_scales, "q.global_scale": q.global_scale})
    q = formats.to_linear(q)  # a tiled GEMM weight: its checkpoint layout (a copy), which the kernel reads
    for name in ("packed", "block_scales"):
        arrays.check_contiguous(f"q.{name}", getattr(q, name))
    arrays.check_aligned("q.packed", q.packed, 8)
    rows, kblocks = q.rows, q.shape[-1] // BLOCK_SIZE
    if rows * kblocks >= _MAX_BLOCKS:
        raise ValueError(f"q: {rows * kblocks} blocks is too large; the kernels index at most {_MAX_BLOCKS - 1}")
    out = cupy.empty(q.shape, dtype=dtype) if out is None else out
    kernel = _kernel(f"dequantize_{arrays.DTYPE_SUFFIX[dtype]}")
    args = (q.packed, q.block_scales, q.global_scale, out, _U32(rows), _U32(kblocks),
            _I32(q.scale_layout == "swizzled"), _U32(formats.swizzled_shape(rows, kblocks)[1]), status.device_word())
    kernel(_grid(kernel, rows * kblocks), _THREADS, args)
    return out
