"""Official DeepSeek checkpoints to NVFP4 (the ModelOpt layout): the tensor conversions behind
``fp4kit convert``.

Formats read, by the tensors beside a ``P.weight``:

* **DeepSeek-V4** (the official ``inference/`` layout): linear weights FP8 E4M3 ``P.weight [N, K]``
  with UE8M0 block scales ``P.scale [ceil(N/128), ceil(K/128)]`` (``F8_E8M0``: ``2^(byte - 127)``,
  one per 128 x 128 block); routed experts FP4 E2M1 ``P.weight [N, K/2]`` (``I8`` or ``U8``, two
  codes a byte along K, the lower nibble first, as in NVFP4) with one UE8M0 scale per 32 along K,
  ``P.scale [N, K/32]``.
* **DeepSeek-V3 / R1** (the Hugging Face layout): FP8 E4M3 ``P.weight [N, K]`` with fp32
  ``P.weight_scale_inv [ceil(N/128), ceil(K/128)]`` (the value is ``weight * weight_scale_inv``).

Every other tensor (embeddings, norms, router weights and biases, hash tables, attention sinks,
compressor and hyper-connection parameters) is copied as it is.

Conversions (`convert_weight`):

* **MXFP4 -> NVFP4, exact where it can be.** A block of 32 codes with scale ``2^e`` becomes two
  NVFP4 blocks of 16 with the same codes. With the tensor's largest exponent ``e_max`` (over blocks
  holding a non-zero code), the encode scale ``S = 2^(8 - e_max)`` makes each block scale
  ``2^(e - e_max + 8)``, an exact E4M3 value while ``e_max - e <= 17`` (E4M3 holds every power of two
  from ``2^-9``, a subnormal, to ``2^8``). Such a tensor keeps every value bit for bit; one with a
  larger exponent spread is re-quantized from its exact values with `fp4kit.quantize` (the TE
  recipe), and the report says so.
* **FP8 -> NVFP4.** Dequantized block by block in fp32 (``E4M3 * 2^e`` is exact; V3's fp32 scale
  multiplies in fp32 as its own loaders do), then `fp4kit.quantize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..formats import E2M1_VALUES, E4M3_VALUES, Nvfp4Tensor, array_module, unpack_nibbles

FP8_BLOCK = 128  # the FP8 weights' block scales cover 128 x 128
MX_BLOCK = 32  # one MXFP4 scale per 32 codes along K
_E4M3_MIN_EXP, _E4M3_MAX_EXP = -9, 8  # the powers of two E4M3 holds exactly (2^-9 is a subnormal)

FORMATS = ("fp8-ue8m0", "mxfp4", "fp8-scale-inv")


@dataclass(frozen=True)
class Source:
    """One quantized weight of an official checkpoint: ``P.weight`` and its scale tensor."""

    prefix: str
    format: str  # one of FORMATS
    scale_name: str


def find_sources(names: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Source]:
    """The quantized weights among ``names`` (``{name: (dtype, shape)}`` of the whole checkpoint),
    by weight name. A ``P.weight`` with a ``P.scale`` is V4 (FP8 with an F8_E8M0 128 x 128 scale,
    or MXFP4 codes with an F8_E8M0 per-32 scale); with a ``P.weight_scale_inv`` it is V3. A scale
    of the wrong dtype or shape for its weight is refused, naming both."""
    sources = {}
    for name, (dtype, shape) in names.items():
        if not name.endswith(".weight"):
            continue
        prefix = name.removesuffix(".weight")
        for suffix in ("scale", "weight_scale_inv"):
            scale_name = f"{prefix}.{suffix}"
            if scale_name not in names:
                continue
            s_dtype, s_shape = names[scale_name]
            fmt = _format_of(name, dtype, shape, scale_name, s_dtype, s_shape)
            sources[name] = Source(prefix, fmt, scale_name)
    return sources


def _format_of(name, dtype, shape, scale_name, s_dtype, s_shape) -> str:
    def refuse(expected: str):
        raise ValueError(f"{name} ({dtype} {list(shape)}) with {scale_name} ({s_dtype} {list(s_shape)}): expected "
                         f"{expected}")

    if len(shape) != 2:
        refuse("a 2-D weight")
    n, k = shape
    blocks = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if scale_name.endswith(".weight_scale_inv"):
        if dtype != "F8_E4M3" or s_dtype != "F32" or tuple(s_shape) != blocks:
            refuse(f"an F8_E4M3 weight and an F32 scale {list(blocks)}")
        return "fp8-scale-inv"
    if s_dtype != "F8_E8M0":
        refuse("an F8_E8M0 (UE8M0) scale")
    if dtype == "F8_E4M3":
        if tuple(s_shape) != blocks:
            refuse(f"one scale per 128 x 128 block: {list(blocks)}")
        return "fp8-ue8m0"
    if dtype in ("I8", "U8"):
        if tuple(s_shape) != (n, 2 * k // MX_BLOCK) or (2 * k) % MX_BLOCK:
            refuse(f"FP4 codes [N, K/2] with one scale per {MX_BLOCK} along K: [{n}, {2 * k // MX_BLOCK}]")
        return "mxfp4"
    refuse("an F8_E4M3 weight (FP8) or I8/U8 codes (FP4)")


def _ue8m0_bytes(scale: np.ndarray, where: str) -> np.ndarray:
    """The bytes of an F8_E8M0 scale tensor, refusing its NaN byte 0xFF."""
    raw = scale.view(np.uint8)
    if (raw == 0xFF).any():
        raise ValueError(f"{where}: holds the UE8M0 NaN byte 0xFF")
    return raw


def _scale_values(scale: np.ndarray, where: str) -> np.ndarray:
    """fp32 values of an F8_E8M0 (``2^(byte - 127)``) or F32 scale tensor."""
    if scale.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        return np.ldexp(np.float32(1.0), _ue8m0_bytes(scale, where).astype(np.int32) - 127).astype(np.float32)
    s = scale.astype(np.float32)
    if not np.isfinite(s).all():
        raise ValueError(f"{where}: holds non-finite scales")
    return s


def fp8_dequantize(weight, scale: np.ndarray, where: str):
    """fp32 ``[N, K]`` of an FP8 E4M3 weight with one scale per 128 x 128 block, in the weight's
    memory: host (``float8_e4m3fn`` or its bytes) or device (its bytes, as ``fp4kit convert
    --device cuda`` uploads them); the scale is read on the host. A table lookup per byte (exact,
    and cheaper than a dtype conversion)."""
    xp = array_module(weight)
    codes = weight.view(xp.uint8)
    n, k = codes.shape
    s = _scale_values(scale, where)
    if bool(((codes & 0x7F) == 0x7F).any()):
        raise ValueError(f"{where}: the FP8 weight holds NaN")
    w = xp.take(xp.asarray(E4M3_VALUES), codes)
    s = xp.asarray(s)
    bn, bk = s.shape
    if n == bn * FP8_BLOCK and k == bk * FP8_BLOCK:  # whole blocks: scale a blocked view in place
        w.reshape(bn, FP8_BLOCK, bk, FP8_BLOCK)[...] *= s[:, None, :, None]
        return w
    return w * xp.repeat(xp.repeat(s, FP8_BLOCK, axis=0)[:n], FP8_BLOCK, axis=1)[:, :k]


def mxfp4_dequantize(codes, scale: np.ndarray, where: str):
    """fp32 ``[N, K]`` of MXFP4 codes ``[N, K/2]`` with UE8M0 scales ``[N, K/32]`` (exact), in the
    codes' memory (host or device); the scale is read on the host."""
    xp = array_module(codes)
    s = xp.asarray(_scale_values(scale, where))
    return xp.take(xp.asarray(E2M1_VALUES), unpack_nibbles(codes.view(xp.uint8))) * xp.repeat(s, MX_BLOCK, axis=1)


def _e4m3_power_of_two(p: np.ndarray) -> np.ndarray:
    """E4M3 bytes of ``2^p`` for integer ``p`` in ``[-9, 8]`` (subnormal below ``2^-6``)."""
    p = p.astype(np.int32)
    return np.where(p >= -6, (p + 7) << 3, 1 << np.clip(p + 9, 0, 2)).astype(np.uint8)


def mxfp4_to_nvfp4(codes: np.ndarray, scale: np.ndarray, where: str) -> tuple[Nvfp4Tensor | None, int]:
    """The exact NVFP4 form of MXFP4 codes ``[N, K/2]`` with UE8M0 scales ``[N, K/32]``, and the
    tensor's exponent spread (``e_max - e_min`` over blocks holding a non-zero code; 0 when none
    does). ``None`` when no exact form exists (spread above 17, or an encode scale out of fp32's
    normal range): the caller re-quantizes. The codes are kept, not copied (a contiguous input is
    the result's ``packed``)."""
    codes = np.ascontiguousarray(codes.view(np.uint8))
    raw = scale.view(np.uint8)
    raw_max = int(raw.max(initial=0))
    if raw_max == 0xFF:
        raise ValueError(f"{where}: holds the UE8M0 NaN byte 0xFF")
    n, half = codes.shape
    # a block holds a non-zero code when either of its two 8-byte words is non-zero
    words = codes.view(np.uint64).reshape(n, half * 2 // MX_BLOCK, 2)
    live = np.bitwise_or(words[..., 0], words[..., 1]) != 0
    all_live = bool(live.all())
    if all_live:  # the usual case: no masking, the extremes straight from the bytes
        e_max, e_min = raw_max - 127, int(raw.min()) - 127
    elif not live.any():
        zero = np.zeros((n, half * 2 // 16), np.uint8)
        return Nvfp4Tensor(codes, zero, np.array(np.finfo(np.float32).max, np.float32), "linear", (n, half * 2)), 0
    else:  # (uint8 passes: a third of the int32 ones' time)
        e_max, e_min = int(np.where(live, raw, 0).max()) - 127, int(np.where(live, raw, 255).min()) - 127
    spread = e_max - e_min
    encode_exp = _E4M3_MAX_EXP - e_max
    if spread > _E4M3_MAX_EXP - _E4M3_MIN_EXP or not -126 <= encode_exp <= 127:
        return None, spread
    # each block's E4M3 scale 2^(e - e_max + 8) looked up by its UE8M0 byte (256 entries, not an
    # array of shifts), twice over in a uint16 entry: one lookup writes both 16-element halves of
    # the 32-element block (2048 x 4096 codes: 5.0 -> 1.4 ms with the byte table, 0.5 ms so)
    by_byte = _e4m3_power_of_two(np.clip(np.arange(256) - 127 - e_max + _E4M3_MAX_EXP, _E4M3_MIN_EXP, _E4M3_MAX_EXP))
    twice = by_byte.astype(np.uint16) * np.uint16(0x0101)
    block_scales = np.take(twice, raw).view(np.uint8)  # [N, K/32] uint16 -> [N, K/16] bytes
    if not all_live:
        block_scales.reshape(n, -1, 2)[~live] = 0
    s = np.array(np.ldexp(np.float32(1.0), encode_exp), np.float32)
    return Nvfp4Tensor(codes, block_scales, s, "linear", (n, half * 2)), spread


@dataclass
class Converted:
    """One converted weight: its NVFP4 form and how it was made."""

    prefix: str
    weight: Nvfp4Tensor
    source: str  # the Source format
    method: str  # "exact", "re-quantized" or "quantized"
    spread: int | None  # MXFP4 exponent spread
    rel_error: float  # relative L2 error of the NVFP4 values against the source values


def convert_weight(src: Source, weight: np.ndarray, scale: np.ndarray, quantize, upload=None) -> Converted:
    """``src``'s weight (host arrays) as NVFP4; ``quantize(name, fp32 [N, K])`` gives ``(Nvfp4Tensor
    on the host, its relative L2 error against the values)`` with the TE recipe (the CLI passes the
    CPU or CUDA quantizer). ``upload`` (``cupy.asarray`` for the CUDA quantizer) moves the weight's
    bytes to where the dequantization, quantization and error run, so only FP8 or FP4 bytes cross
    to the device and only the NVFP4 result and one number come back; the exact MXFP4 form is
    found on the host."""
    where = f"{src.prefix}.weight"
    upload = upload or (lambda a: a)
    if src.format == "mxfp4":
        exact, spread = mxfp4_to_nvfp4(weight, scale, f"{src.prefix} ({src.scale_name})")
        if exact is not None:
            return Converted(src.prefix, exact, src.format, "exact", spread, 0.0)
        q, rel = quantize(where, mxfp4_dequantize(upload(weight.view(np.uint8)), scale, src.scale_name))
        return Converted(src.prefix, q, src.format, "re-quantized", spread, rel)
    q, rel = quantize(where, fp8_dequantize(upload(weight.view(np.uint8)), scale, src.scale_name))
    return Converted(src.prefix, q, src.format, "quantized", None, rel)
