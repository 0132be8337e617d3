"""NVFP4 storage formats: the E2M1 and E4M3 code tables, `Nvfp4Tensor`, nibble packing
and the 128x4 swizzled block-scale layout.

Everything here is array-module agnostic: the functions take numpy or CuPy arrays and use
the module the array belongs to, so the same code describes host and device buffers.

Conventions (see DESIGN.md §1):

* element: E2M1, codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign;
* packing: two codes per byte along the last axis, element ``2i`` in the low nibble;
* block: 16 consecutive elements along the last axis share one FP8 E4M3 block scale,
  stored as ``uint8``;
* global scale: the fp32 *encode* scale ``S = 448 * 6 / amax``; a value dequantizes as
  ``e2m1 * fp32(block_scale) / S``. ModelOpt's ``weight_scale_2`` / ``input_scale`` is the
  *decode* scale ``1 / S``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_SCALE_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688: S = 2688 / amax

SCALE_LAYOUTS = ("linear", "swizzled")
SWIZZLE_ROWS = 128  # rows of one swizzled tile
SWIZZLE_COLS = 4  # block-scale columns of one swizzled tile

#: value of every E2M1 code, index = 4-bit code (bit 3 = sign).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

#: value of every E4M3 byte (``float8_e4m3fn``: bias 7, max 448, 0x7F/0xFF are NaN).
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)

#: the E4M3 bytes that are not numbers.
E4M3_NAN_BYTES = (0x7F, 0xFF)


def array_module(x: Any):
    """numpy for host arrays, cupy for device arrays (imported only when one is seen)."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np
    import cupy

    return cupy.get_array_module(x)


def pack_nibbles(codes):
    """Pack 4-bit codes ``[..., 2n]`` (uint8, values 0..15) into bytes ``[..., n]``.

    Element ``2i`` goes to the low nibble, ``2i + 1`` to the high nibble.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dimension must be even, got shape {codes.shape}")
    codes = codes.astype(np.uint8, copy=False)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed):
    """Inverse of `pack_nibbles`: bytes ``[..., n]`` to codes ``[..., 2n]`` (uint8)."""
    xp = array_module(packed)
    low = packed & 0xF
    high = packed >> 4
    return xp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def swizzled_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """Padded ``(rows, scale_cols)`` of the 128x4 swizzled layout: multiples of 128 and 4."""
    return (
        -(-rows // SWIZZLE_ROWS) * SWIZZLE_ROWS,
        -(-scale_cols // SWIZZLE_COLS) * SWIZZLE_COLS,
    )


def swizzle_offsets(rows: int, scale_cols: int, xp=np):
    """Byte offset of every block scale ``[rows, scale_cols]`` in the swizzled buffer.

    The layout read by cuBLASLt / CUTLASS block-scaled GEMMs: 128x4 tiles of 512 bytes,
    tiles ordered row-tile major; inside a tile row ``m`` and column ``k`` sit at
    ``(m % 32) * 16 + (m % 128 // 32) * 4 + k % 4``.
    """
    _, padded_cols = swizzled_shape(rows, scale_cols)
    m = xp.arange(rows, dtype=np.int64)[:, None]
    k = xp.arange(scale_cols, dtype=np.int64)[None, :]
    tile = (m // SWIZZLE_ROWS) * (padded_cols // SWIZZLE_COLS) + k // SWIZZLE_COLS
    return tile * 512 + (m % 32) * 16 + (m % SWIZZLE_ROWS // 32) * 4 + k % SWIZZLE_COLS


def swizzle_scales(linear):
    """Linear block scales ``[rows, scale_cols]`` (uint8) to the flat swizzled buffer.

    Returns a 1-D uint8 array of ``padded_rows * padded_cols`` bytes whose padding is zero.
    """
    xp = array_module(linear)
    if linear.ndim != 2:
        raise ValueError(f"linear: expected a 2-D [rows, scale_cols] array, got shape {linear.shape}")
    rows, cols = linear.shape
    pr, pc = swizzled_shape(rows, cols)
    out = xp.zeros(pr * pc, dtype=np.uint8)
    out[swizzle_offsets(rows, cols, xp).ravel()] = linear.ravel()
    return out


def unswizzle_scales(swizzled, rows: int, scale_cols: int):
    """Inverse of `swizzle_scales`: the flat swizzled buffer to ``[rows, scale_cols]``."""
    pr, pc = swizzled_shape(rows, scale_cols)
    if swizzled.ndim != 1 or swizzled.shape[0] != pr * pc:
        raise ValueError(
            f"swizzled: expected a 1-D buffer of {pr * pc} bytes for {rows}x{scale_cols} scales, "
            f"got shape {swizzled.shape}"
        )
    xp = array_module(swizzled)
    return swizzled[swizzle_offsets(rows, scale_cols, xp)]


def block_scale_shape(shape: tuple[int, ...], scale_layout: str) -> tuple[int, ...]:
    """Shape of the block-scale buffer of a tensor of logical ``shape`` in ``scale_layout``."""
    k = shape[-1]
    if scale_layout == "linear":
        return (*shape[:-1], k // BLOCK_SIZE)
    if scale_layout == "swizzled":
        if len(shape) != 2:
            raise ValueError(
                f"scale_layout='swizzled' describes 2-D [rows, K] tensors only, got shape {tuple(shape)}"
            )
        pr, pc = swizzled_shape(shape[0], k // BLOCK_SIZE)
        return (pr * pc,)
    raise ValueError(f"scale_layout: expected one of {SCALE_LAYOUTS}, got {scale_layout!r}")


@dataclass
class Nvfp4Tensor:
    """An NVFP4 tensor of logical shape ``[..., K]``.

    Attributes
    ----------
    packed : uint8 ``[..., K/2]``
        E2M1 codes, two per byte, element ``2i`` in the low nibble.
    block_scales : uint8
        One FP8 E4M3 byte per 16-element block: ``[..., K/16]`` for ``scale_layout="linear"``;
        a flat zero-padded ``[round_up(rows,128) * round_up(K/16,4)]`` buffer for
        ``"swizzled"``.
    global_scale : fp32 0-d array
        The encode scale ``S = 2688 / amax``, in the same memory (host or device) as ``packed``.
    scale_layout : str
        ``"linear"`` or ``"swizzled"``.
    shape : tuple of int
        The logical (unpacked) shape.
    """

    packed: Any
    block_scales: Any
    global_scale: Any
    scale_layout: str
    shape: tuple[int, ...]

    def __post_init__(self):
        self.shape = tuple(int(s) for s in self.shape)
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"scale_layout: expected one of {SCALE_LAYOUTS}, got {self.scale_layout!r}")
        if not self.shape or self.shape[-1] % BLOCK_SIZE:
            raise ValueError(f"shape: last dimension must be a multiple of {BLOCK_SIZE}, got {self.shape}")
        expected = (*self.shape[:-1], self.shape[-1] // 2)
        _check_buffer("packed", self.packed, expected, np.uint8)
        _check_buffer("block_scales", self.block_scales, block_scale_shape(self.shape, self.scale_layout), np.uint8)
        _check_buffer("global_scale", self.global_scale, (), np.float32)
        kinds = {array_module(a).__name__ for a in (self.packed, self.block_scales, self.global_scale)}
        if len(kinds) != 1:
            raise ValueError(
                "Nvfp4Tensor: packed, block_scales and global_scale must live in the same memory, "
                f"got arrays from {sorted(kinds)}"
            )

    @property
    def rows(self) -> int:
        """Number of rows: the product of the leading dimensions."""
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    @property
    def linear_block_scales(self):
        """The block scales as ``[..., K/16]``, unswizzling if needed."""
        if self.scale_layout == "linear":
            return self.block_scales
        lin = unswizzle_scales(self.block_scales, self.rows, self.shape[-1] // BLOCK_SIZE)
        return lin.reshape(*self.shape[:-1], self.shape[-1] // BLOCK_SIZE)


def _check_buffer(name: str, arr, shape: tuple[int, ...], dtype) -> None:
    if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(arr).__name__}")
    if tuple(arr.shape) != tuple(shape) or arr.dtype != dtype:
        raise ValueError(
            f"{name}: expected shape {tuple(shape)} and dtype {np.dtype(dtype).name}, "
            f"got shape {tuple(arr.shape)} and dtype {arr.dtype}"
        )
