"""NVFP4 storage formats: the E2M1 and E4M3 code tables, `Nvfp4Tensor`, nibble packing
and the 128x4 swizzled block-scale layout.

Everything here is array-module agnostic: the functions take numpy or CuPy arrays and use
the module the array belongs to, so the same code describes host and device buffers.

Conventions (see docs/design.md §1):

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

SCALE_LAYOUTS = ("linear", "swizzled", "tiled")
SWIZZLE_ROWS = 128  # rows of one swizzled tile
SWIZZLE_COLS = 4  # block-scale columns of one swizzled tile

ROW_INTERLEAVE = 16  # rows per chunk where gate and up rows alternate (SwiGLU's "interleaved" layout)
_FLT_MIN = np.float32(1.17549435e-38)

# The tiled GEMM weight layout (``scale_layout="tiled"``, see `to_tiled`).
TILE_ROWS = 16  # weight rows of one tile: the MMA's M dimension
TILE_K = 64  # k of one tile ("chunk"): 4 MMA k16 steps, one 16-byte load per lane
GROUP_CHUNKS = 4  # chunks whose block scales one lane reads with one 8-byte load
TILE_BYTES = TILE_ROWS * TILE_K // 2  # 512: codes of one tile, 16 bytes for each of 32 lanes
GROUP_SCALE_BYTES = TILE_ROWS * TILE_K * GROUP_CHUNKS // BLOCK_SIZE  # 256: 8 bytes per lane

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
    if scale_layout == "tiled":
        _check_tiled_shape(shape)
        row_tiles, _, groups = tiled_dims(shape[-2], k)
        return (*shape[:-2], row_tiles * groups * GROUP_SCALE_BYTES)
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
        E2M1 codes, two per byte, element ``2i`` in the low nibble; for ``scale_layout="tiled"``
        the tiled GEMM weight layout ``[..., N/16 * K/64 * 512]`` (see `to_tiled`).
    block_scales : uint8
        One FP8 E4M3 byte per 16-element block: ``[..., K/16]`` for ``scale_layout="linear"``;
        a flat zero-padded ``[round_up(rows,128) * round_up(K/16,4)]`` buffer for
        ``"swizzled"``; ``[..., N/16 * K/256 * 256]`` for ``"tiled"`` (dimensions rounded up).
    global_scale : fp32 0-d array
        The encode scale ``S = 2688 / amax``, in the same memory (host or device) as ``packed``.
    scale_layout : str
        ``"linear"``, ``"swizzled"`` or ``"tiled"`` (codes and scales both in the order the
        GEMM reads them; produced by `to_tiled` when a layer is built, undone by `to_linear`).
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
        _check_buffer("packed", self.packed, packed_shape(self.shape, self.scale_layout), np.uint8)
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
        """The block scales as ``[..., K/16]``, unswizzling or untiling if needed."""
        if self.scale_layout == "linear":
            return self.block_scales
        if self.scale_layout == "tiled":
            return untile_scales(self.block_scales, self.shape)
        lin = unswizzle_scales(self.block_scales, self.rows, self.shape[-1] // BLOCK_SIZE)
        return lin.reshape(*self.shape[:-1], self.shape[-1] // BLOCK_SIZE)

    @property
    def linear_packed(self):
        """The codes as ``[..., K/2]`` (element ``2i`` in the low nibble), untiling if needed."""
        if self.scale_layout == "tiled":
            return untile_codes(self.packed, self.shape)
        return self.packed


def _check_buffer(name: str, arr, shape: tuple[int, ...], dtype) -> None:
    if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(arr).__name__}")
    if tuple(arr.shape) != tuple(shape) or arr.dtype != dtype:
        raise ValueError(
            f"{name}: expected shape {tuple(shape)} and dtype {np.dtype(dtype).name}, "
            f"got shape {tuple(arr.shape)} and dtype {arr.dtype}"
        )


# ---------------------------------------------------------------------------------------------
# The tiled GEMM weight layout.
#
# A weight [..., N, K] is cut into tiles of 16 rows x 64 k. Inside a tile, lane l = 4g + t of a
# warp owns rows g and g + 8 and the 16 k of block t; its 16 bytes are four 32-bit words, word s
# holding the 8 codes of MMA step s (an m16n8k16 bf16 A fragment: pairs a0 = row g, a1 = row g+8,
# both at k = 16t + 4s + {0, 1}; a2 = row g, a3 = row g+8, both at 16t + 4s + {2, 3}). The GEMM
# multiplies activations read in the same k order, so the permutation of k costs nothing.
#
# Inside a word the bits are placed so that each pair becomes two bf16 values (e2m1 * 2^-126:
# sign at bit 15, exponent/mantissa bits e1 e0 m at bits 8..6 of each half) with few integer
# operations: a0 = q & M, a1 = (q << 6) & M, a2 = (q << 3) & M with M = 0x81C081C0, and a3 from the
# eight bits left over (bits 10, 11, 13, 14 of each half) with three shifts.
#
# Block scales: lane l of tile row r reads, for each group of 4 chunks, 8 bytes: for chunk j the
# scale of (row g, block t) then (row g + 8, block t). Padding rows, k and chunks are zero.
# Tiles are stored row-tile major: [row tile][chunk][lane][16 bytes]; scales
# [row tile][group][lane][8 bytes].

# _CODE_BIT_POS[a][half][bit]: where bit (0 m, 1 e0, 2 e1, 3 sign) of the code of pair a
# (a0..a3) in lane half 0 (lower k) or 1 lands in the 32-bit word.
_CODE_BIT_POS = np.array([
    [[6, 7, 8, 15], [22, 23, 24, 31]],  # a0: the word itself
    [[0, 1, 2, 9], [16, 17, 18, 25]],  # a1: shifted left by 6
    [[3, 4, 5, 12], [19, 20, 21, 28]],  # a2: shifted left by 3
    [[10, 11, 13, 14], [26, 27, 29, 30]],  # a3: the bits left over
], dtype=np.uint32)


def tiled_dims(n: int, k: int) -> tuple[int, int, int]:
    """``(row_tiles, chunks, groups)`` of an ``[N, K]`` weight in the tiled layout."""
    row_tiles = -(-n // TILE_ROWS)
    chunks = -(-k // TILE_K)
    return row_tiles, chunks, -(-chunks // GROUP_CHUNKS)


def _check_tiled_shape(shape) -> None:
    if len(shape) < 2:
        raise ValueError(f"scale_layout='tiled' describes [..., N, K] weights, got shape {tuple(shape)}")


def packed_shape(shape: tuple[int, ...], scale_layout: str) -> tuple[int, ...]:
    """Shape of the code buffer of a tensor of logical ``shape`` in ``scale_layout``."""
    if scale_layout == "tiled":
        _check_tiled_shape(shape)
        row_tiles, chunks, _ = tiled_dims(shape[-2], shape[-1])
        return (*shape[:-2], row_tiles * chunks * TILE_BYTES)
    return (*shape[:-1], shape[-1] // 2)


def _pad_last2(x, rows: int, cols: int):
    xp = array_module(x)
    if x.shape[-2:] == (rows, cols):
        return x
    out = xp.zeros((*x.shape[:-2], rows, cols), dtype=x.dtype)
    out[..., : x.shape[-2], : x.shape[-1]] = x
    return out


def tile_codes(packed, shape):
    """Codes ``[..., N, K/2]`` (linear) to the tiled code buffer ``[..., tiles * 512]``."""
    xp = array_module(packed)
    *lead, n, k = shape
    row_tiles, chunks, _ = tiled_dims(n, k)
    codes = _pad_last2(unpack_nibbles(packed), row_tiles * TILE_ROWS, chunks * TILE_K)
    # axes: lead, row tile, row half h, g, chunk, t, step s, pair p (k + 0/1 or + 2/3), half e
    codes = codes.reshape(*lead, row_tiles, 2, 8, chunks, 4, 4, 2, 2)
    nl = len(lead)
    codes = codes.transpose(*range(nl), nl, nl + 3, nl + 2, nl + 4, nl + 5, nl + 1, nl + 6, nl + 7)
    words = xp.zeros(codes.shape[:-3], dtype=np.uint32)  # lead, tile, chunk, g, t, s
    for h in range(2):
        for p in range(2):
            pair = 2 * p + h  # a0 = (h0, p0), a1 = (h1, p0), a2 = (h0, p1), a3 = (h1, p1)
            for e in range(2):
                c = codes[..., h, p, e].astype(np.uint32)
                for bit in range(4):
                    words |= ((c >> bit) & 1) << _CODE_BIT_POS[pair, e, bit]
    return words.reshape(*lead, -1).view(np.uint8)


def untile_codes(tiled, shape):
    """Inverse of `tile_codes`: the tiled code buffer back to linear codes ``[..., N, K/2]``."""
    xp = array_module(tiled)
    *lead, n, k = shape
    row_tiles, chunks, _ = tiled_dims(n, k)
    words = xp.ascontiguousarray(tiled).view(np.uint32).reshape(*lead, row_tiles, chunks, 8, 4, 4)
    codes = xp.zeros((*words.shape, 2, 2, 2), dtype=np.uint8)  # ..., h, p, e
    for h in range(2):
        for p in range(2):
            pair = 2 * p + h
            for e in range(2):
                c = xp.zeros(words.shape, dtype=np.uint32)
                for bit in range(4):
                    c |= ((words >> _CODE_BIT_POS[pair, e, bit]) & 1) << bit
                codes[..., h, p, e] = c.astype(np.uint8)
    nl = len(lead)
    # back to: lead, tile, h, g, chunk, t, s, p, e
    codes = codes.transpose(*range(nl), nl, nl + 5, nl + 2, nl + 1, nl + 3, nl + 4, nl + 6, nl + 7)
    codes = codes.reshape(*lead, row_tiles * TILE_ROWS, chunks * TILE_K)[..., :n, :k]
    return pack_nibbles(codes)


def tile_scales(linear, shape):
    """Linear block scales ``[..., N, K/16]`` to the tiled scale buffer."""
    *lead, n, k = shape
    row_tiles, _, groups = tiled_dims(n, k)
    sf = _pad_last2(linear, row_tiles * TILE_ROWS, groups * GROUP_CHUNKS * 4)
    sf = sf.reshape(*lead, row_tiles, 2, 8, groups, GROUP_CHUNKS, 4)  # tile, h, g, group, j, t
    nl = len(lead)
    sf = sf.transpose(*range(nl), nl, nl + 3, nl + 2, nl + 5, nl + 4, nl + 1)  # tile, group, g, t, j, h
    return array_module(linear).ascontiguousarray(sf).reshape(*lead, -1)


def untile_scales(tiled, shape):
    """Inverse of `tile_scales`: the tiled scale buffer back to ``[..., N, K/16]``."""
    *lead, n, k = shape
    row_tiles, _, groups = tiled_dims(n, k)
    sf = tiled.reshape(*lead, row_tiles, groups, 8, 4, GROUP_CHUNKS, 2)
    nl = len(lead)
    sf = sf.transpose(*range(nl), nl, nl + 5, nl + 2, nl + 1, nl + 4, nl + 3)  # tile, h, g, group, j, t
    sf = sf.reshape(*lead, row_tiles * TILE_ROWS, groups * GROUP_CHUNKS * 4)
    return array_module(tiled).ascontiguousarray(sf[..., :n, : k // BLOCK_SIZE])


def to_tiled(q: "Nvfp4Tensor") -> "Nvfp4Tensor":
    """The GEMM weight layout of ``q`` (``[..., N, K]``), exactly and invertibly (`to_linear`).

    Done once when a layer is built: the tiled tensor replaces the linear one. Returns ``q``
    itself if it is already tiled.
    """
    if q.scale_layout == "tiled":
        return q
    _check_tiled_shape(q.shape)
    return Nvfp4Tensor(tile_codes(q.packed, q.shape), tile_scales(q.linear_block_scales, q.shape),
                       q.global_scale, "tiled", q.shape)


def to_linear(q: "Nvfp4Tensor") -> "Nvfp4Tensor":
    """The checkpoint layout (codes ``[..., K/2]``, linear scales) of any `Nvfp4Tensor`."""
    if q.scale_layout == "linear":
        return q
    return Nvfp4Tensor(q.linear_packed, q.linear_block_scales, q.global_scale, "linear", q.shape)


# ---------------------------------------------------------------------------------------------
# Row fusion: one weight from several, without re-quantizing.


def interleave_rows(gate, up):
    """Rows of ``gate`` and ``up`` (``[I, ...]`` each) alternating in chunks of 16: ``[2I, ...]``."""
    xp = array_module(gate)
    i = gate.shape[0]
    if i % ROW_INTERLEAVE or up.shape != gate.shape:
        raise ValueError(f"gate/up: expected equal shapes with rows a multiple of 16, got {gate.shape} and {up.shape}")
    c = i // ROW_INTERLEAVE
    g = gate.reshape(c, 1, ROW_INTERLEAVE, *gate.shape[1:])
    u = up.reshape(c, 1, ROW_INTERLEAVE, *up.shape[1:])
    return xp.concatenate([g, u], axis=1).reshape(2 * i, *gate.shape[1:])


FUSE_ARRANGEMENTS = ("concatenated", "interleaved")


def fuse_rows(parts, arrangement: str = "concatenated", row_decodes=None):
    """Join the rows of NVFP4 weights ``[N_i, K]`` into one ``[sum N_i, K]`` weight, every byte kept.

    ``arrangement``: ``"concatenated"`` (part after part, e.g. q|k|v shards) or ``"interleaved"``
    (exactly two equal parts, gate and up, alternating in chunks of 16 rows: the layout the fused
    SwiGLU reads). Returns ``(fused, row_decode)``: the fused tensor (linear layout, global scale 1)
    and the fp32 per-row decode factor ``row_decode [sum N_i]``: ``fp32(1 / S_i)`` of the part each
    row came from (``__fdiv_rn`` under ftz, as the kernels compute it), or that part's own
    ``row_decodes[i]`` when given. Row ``n`` then dequantizes as ``e2m1 * fp32(block_scale) *
    row_decode[n]``: parts with different global scales stay exact, and a GEMM applies the factor in
    its epilogue (``row_decode=`` of `fp4kit.ops.gemm.gemm`). The global scale is 1 so that
    ``alpha = 1 / (S_a * S_w)`` stays right where a GEMM applies both.
    """
    if arrangement not in FUSE_ARRANGEMENTS:
        raise ValueError(f"arrangement: expected one of {FUSE_ARRANGEMENTS}, got {arrangement!r}")
    if not parts:
        raise ValueError("parts: expected at least one Nvfp4Tensor, got none")
    for i, p in enumerate(parts):
        if not isinstance(p, Nvfp4Tensor):
            raise TypeError(f"parts[{i}]: expected an Nvfp4Tensor, got {type(p).__name__}")
        if len(p.shape) != 2 or p.shape[1] != parts[0].shape[1]:
            raise ValueError(
                f"parts[{i}]: expected a 2-D [N, {parts[0].shape[-1]}] tensor like parts[0], got shape {list(p.shape)}"
            )
    if arrangement == "interleaved" and (len(parts) != 2 or parts[0].shape != parts[1].shape):
        raise ValueError(f"parts: 'interleaved' takes two equal weights (gate, up), got shapes {[p.shape for p in parts]}")
    xp = array_module(parts[0].packed)
    if any(array_module(p.packed) is not xp for p in parts):
        raise ValueError("parts: expected all parts in the same memory (all numpy or all CuPy)")
    if row_decodes is None:
        row_decodes = [None] * len(parts)
    decode = []
    for p, given in zip(parts, row_decodes):
        if given is None:
            with np.errstate(divide="ignore", over="ignore"):
                d = xp.float32(1) / p.global_scale.reshape(()).astype(np.float32)
            d = xp.where(xp.abs(d) < _FLT_MIN, xp.float32(0), d)  # ftz, as the kernels' division
            given = xp.broadcast_to(d, (p.shape[0],))
        decode.append(xp.asarray(given, dtype=np.float32).reshape(p.shape[0]))
    if arrangement == "interleaved":
        join = lambda a, b: interleave_rows(a, b)  # noqa: E731
    else:
        join = lambda *a: xp.concatenate(a, axis=0)  # noqa: E731
    packed = join(*[p.linear_packed for p in parts])
    scales = join(*[p.linear_block_scales for p in parts])
    row_decode = xp.ascontiguousarray(join(*decode).astype(np.float32, copy=False))
    n = sum(p.shape[0] for p in parts)
    return Nvfp4Tensor(packed, scales, xp.ones((), dtype=np.float32), "linear", (n, parts[0].shape[1])), row_decode
