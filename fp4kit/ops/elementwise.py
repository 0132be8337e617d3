"""Row-wise ops between the GEMMs of a decode step: RMSNorm (+ RoPE), residual add + RMSNorm, the
embedding gather (alone, or with the first RMSNorm), the ratio-128 "all entries" selection and the token log.

numpy arrays run `fp4kit.reference.elementwise`; device arrays launch ``raw_kernels/elementwise.cu``
on CuPy's current stream. Inputs are validated before any launch; device calls read positions,
lengths and tokens on the device and write into ``out`` when given (what a captured step needs).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from ..reference import elementwise as ref
from ..reference import kv_cache as kv_ref
from ..runtime import arrays, loader, status

_MODULE = "elementwise"
_THREADS = 256
_U32 = np.uint32
#: the row kernels (RMSNorm (+ RoPE), residual add + RMSNorm, embedding + RMSNorm) release the next
#: kernel at their start in a captured graph (common/pdl.cuh): its blocks issue their weight loads
#: while the row kernel runs (the next kernel still waits for the row kernel's completion before it
#: reads the rows). Measured on the H200: the replayed v4-flash-slice step 0.608 -> 0.591 ms at
#: batch 1, 1.461 -> 1.443 ms at batch 8; False launches them without it
EARLY_RELEASE = True


def _release() -> np.int32:
    return np.int32(EARLY_RELEASE)


def _check(name: str, x, dtype, ndim: tuple[int, ...]):
    x = arrays.as_array(x, name)
    if x.ndim not in ndim:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ndim))} dimensions, got {arrays.describe(x)}")
    if x.dtype != np.dtype(dtype):
        raise TypeError(f"{name}: expected {np.dtype(dtype).name}, got {x.dtype}")
    arrays.check_contiguous(name, x)
    return x


def _norm_rope_args(x, weight, positions, rope_dim: int, part: str = ""):
    """The validated ``x``, ``weight`` and ``positions`` of one RMSNorm + RoPE (``part``: the
    argument's name prefix in messages, e.g. ``"second."``)."""
    x = _check(f"{part}x", x, arrays.BF16, (2, 3))
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"{part}x: expected an even last dimension, got {arrays.describe(x)}")
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, (int, np.integer)) or rope_dim < 0 or rope_dim % 2 \
            or rope_dim > d:
        raise ValueError(f"{part}rope_dim: expected an even number in [0, {d}], got {rope_dim}")
    if weight is not None:
        weight = _check(f"{part}weight", weight, np.float32, (1,))
        if weight.shape[0] != d:
            raise ValueError(f"{part}weight: expected float32 [{d}], got {arrays.describe(weight)}")
    if rope_dim:
        if positions is None:
            raise ValueError(f"positions: RoPE ({part}rope_dim > 0) needs the token positions")
        positions = _check("positions", positions, np.int32, (1,))
        if positions.shape[0] != x.shape[0]:
            raise ValueError(f"positions: expected int32 [{x.shape[0]}] (the tokens of {part}x), "
                             f"got {arrays.describe(positions)}")
    return x, weight, positions


# RoPE frequency tables on the device: (device, rope_dim, the float64 frequencies' bytes) -> array
_ROPE_TABLES: dict = {}


def check_rope_positions(prefix: str, positions, offset, batch: int, like):
    """``(positions, offset)`` of a RoPE that another launch applies to its input ``like`` (a query
    handed over raw: `fp4kit.ops.attention.QueryNorm`, `fp4kit.ops.indexer.QueryRope`): int32
    positions ``[batch]`` on ``like``'s device (read there) and a small integer ``offset``, each
    refused by its name under ``prefix``."""
    name = f"{prefix}.positions"
    positions = arrays.as_array(positions, name)
    if positions.dtype != np.int32:
        raise TypeError(f"{name}: expected int32 [{batch}], got {arrays.describe(positions)}")
    if positions.shape != (batch,):
        raise ValueError(f"{name}: expected int32 [{batch}], got {arrays.describe(positions)}")
    arrays.check_contiguous(name, positions)
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or abs(int(offset)) > 2**30:
        raise ValueError(f"{prefix}.offset: expected a small integer, got {offset!r}")
    arrays.check_same_device(**{"q": like, name: positions})
    arrays.check_aligned(name, positions, 4)
    return positions, int(offset)


def rope_table(theta, rope_dim: int, like, name: str = "theta"):
    """The RoPE frequencies the kernels read: float64 ``[rope_dim / 2]`` on ``like``'s device, the
    inverse frequency of each channel pair (`fp4kit.reference.elementwise.rope_inv_freq` of
    ``theta``: a base, or the frequencies themselves, e.g. YaRN's), or 0 (a null pointer) where
    ``rope_dim`` is 0. A device float64 array of that shape is taken as is. Tables of a base or
    host array are made once per device and kept, so the first call with new frequencies copies
    them to the device: it must not be inside a graph capture (RuntimeError, naming ``name``)."""
    if not rope_dim:
        return 0
    if arrays.is_device_array(theta):
        if theta.dtype != np.float64 or theta.shape != (rope_dim // 2,) or not theta.flags.c_contiguous:
            raise ValueError(f"{name}: expected a float64 [{rope_dim // 2}] array of inverse frequencies, got "
                             f"{arrays.describe(theta)}")
        arrays.check_same_device(**{name: theta, "input": like})
        return theta
    # a base is its own key; frequencies are checked (and keyed) by their bytes
    key = (like.device.id, rope_dim,
           float(theta) if not np.ndim(theta) else ref.rope_inv_freq(rope_dim, theta, name).tobytes())
    table = _ROPE_TABLES.get(key)
    if table is None:
        freqs = ref.rope_inv_freq(rope_dim, theta, name)
        import cupy

        if cupy.cuda.get_current_stream().is_capturing():
            raise RuntimeError(f"{name}: the first call with these RoPE frequencies copies them to the device, which a "
                               f"graph capture cannot hold; make one call (or build the layer) before capturing")
        with like.device:
            table = _ROPE_TABLES[key] = cupy.asarray(freqs)
    return table


def rmsnorm_rope(x, weight=None, positions=None, *, eps: float = 1e-6, normalize: bool = True, rope_dim: int = 0,
                 theta=10000.0, out=None):
    """bf16 ``[B, D]`` or ``[B, H, D]`` -> bf16, see `fp4kit.reference.elementwise.rmsnorm_rope`.

    ``weight`` fp32 ``[D]`` or None; ``positions`` int32 ``[B]`` (the token's index in its
    sequence; read on the device), required when ``rope_dim > 0``; ``theta`` the RoPE base, or the
    channel pairs' inverse frequencies (host array, or on the device as `rope_table` takes them).
    """
    x, weight, positions = _norm_rope_args(x, weight, positions, rope_dim)
    d = x.shape[-1]
    arrays.check_same_device(x=x, weight=weight, positions=positions, out=out)
    if not arrays.is_device_array(x):
        y = ref.rmsnorm_rope(x, weight, positions, eps=eps, normalize=normalize, rope_dim=rope_dim, theta=theta)
        return arrays.host_result(y, out)
    table = rope_table(theta, rope_dim, x)
    out = arrays.device_out("out", out, x.shape, arrays.BF16, x)
    heads = x.shape[1] if x.ndim == 3 else 1
    rows = x.size // d
    if rows:
        loader.get_kernel(_MODULE, "rmsnorm_rope_bf16")(
            rows, _THREADS, (x, 0 if weight is None else weight, 0 if positions is None else positions, out,
                             _U32(heads), _U32(d), np.float32(eps), np.int32(bool(normalize)), _U32(rope_dim),
                             table, _release()))
    return out


class NormRope(NamedTuple):
    """One part of `rmsnorm_rope_pair`: the arguments of `rmsnorm_rope` that may differ by part."""

    x: object
    weight: object = None
    normalize: bool = True
    rope_dim: int = 0


def rmsnorm_rope_pair(first: NormRope, second: NormRope, positions=None, *, eps: float = 1e-6,
                      theta=10000.0, outs=None, window=None, advance: bool = False) -> tuple:
    """`rmsnorm_rope` of two arrays in one launch (e.g. two parts of one concatenated projection's
    output), each exactly as `rmsnorm_rope` computes it, with the same ``positions``, ``eps`` and
    ``theta``. Returns ``(y0, y1)``; ``outs``: their buffers (bf16, the shapes of the inputs).

    ``window``: a sliding-window ring bf16 ``[B, W, D]`` (`KVCache.swa`) that takes the second
    part's rows instead of a new array: ``second.x`` is one row per sequence ``[B, D]``, and row b
    goes to slot ``positions[b] % W`` of sequence b, where `KVCache.append` puts a decode token's
    row (the cache is then appended with ``kv=None``). ``y1`` is then ``window``. ``advance`` (with
    ``window``, and ``first`` without RoPE): ``positions`` then move on by one, as
    `KVCache.advance(1)` would after the write (one launch less; nothing launched after may expect
    the old positions)."""
    parts = []
    for name, part in (("first", first), ("second", second)):
        if not isinstance(part, NormRope):
            raise TypeError(f"{name}: expected an elementwise.NormRope(x, weight, normalize, rope_dim), "
                            f"got {type(part).__name__}")
        x, weight, pos = _norm_rope_args(part.x, part.weight, positions, part.rope_dim, f"{name}.")
        parts.append((x, weight, bool(part.normalize), int(part.rope_dim)))
        positions = pos if pos is not None else positions
    if outs is not None and (not isinstance(outs, (tuple, list)) or len(outs) != 2):
        raise TypeError(f"outs: expected two arrays (y0, y1) or None, got {type(outs).__name__}")
    outs = (None, None) if outs is None else tuple(outs)
    (x0, w0, n0, r0), (x1, w1, n1, r1) = parts
    if window is not None:
        window, positions = _window_ring(window, x1, positions, outs[1])
    if advance and (window is None or r0):
        raise ValueError("advance: moves the positions of a window ring (window=...) on, and the first part must not "
                         f"read them (rope_dim 0), got window={'None' if window is None else 'a ring'}, first.rope_dim={r0}")
    arrays.check_same_device(**{"first.x": x0, "first.weight": w0, "second.x": x1, "second.weight": w1,
                                "positions": positions, "outs[0]": outs[0], "outs[1]": outs[1], "window": window})
    if not arrays.is_device_array(x0):
        ys = tuple(arrays.host_result(ref.rmsnorm_rope(x, w, positions if r else None, eps=eps, normalize=n,
                                                       rope_dim=r, theta=theta), out)
                   for (x, w, n, r), out in zip(parts, outs))
        if window is None:
            return ys
        kv_ref.append_swa(window, positions, ys[1][:, None, :])
        if advance:
            kv_ref.advance(positions, 1)
        return ys[0], window
    tables = (rope_table(theta, r0, x0), rope_table(theta, r1, x1))
    ys = (arrays.device_out("outs[0]", outs[0], x0.shape, arrays.BF16, x0),
          window if window is not None else arrays.device_out("outs[1]", outs[1], x1.shape, arrays.BF16, x1))
    rows0, rows1 = x0.size // x0.shape[-1], x1.size // x1.shape[-1]
    if rows0 + rows1:
        heads = [x.shape[1] if x.ndim == 3 else 1 for x in (x0, x1)]
        loader.get_kernel(_MODULE, "rmsnorm_rope2_bf16")(
            rows0 + rows1, _THREADS,
            (x0, 0 if w0 is None else w0, ys[0], _U32(rows0), _U32(heads[0]), _U32(x0.shape[-1]), np.int32(n0),
             _U32(r0), x1, 0 if w1 is None else w1, ys[1], _U32(heads[1]), _U32(x1.shape[-1]), np.int32(n1), _U32(r1),
             0 if positions is None else positions, np.float32(eps), *tables,
             _U32(0 if window is None else window.shape[1]), np.int32(bool(advance)), _release()))
    return ys


def _window_ring(window, x1, positions, out1):
    """The validated ring of `rmsnorm_rope_pair`'s ``window``: bf16 ``[B, W, D]`` for ``x1 [B, D]``,
    with the positions that pick the slots."""
    window = _check("window", window, arrays.BF16, (3,))
    if x1.ndim != 2:
        raise ValueError(f"second.x: a window takes one row per sequence [B, D], got {arrays.describe(x1)}")
    b, d = x1.shape
    if window.shape[0] != b or window.shape[2] != d or window.shape[1] < 1:
        raise ValueError(f"window: expected bfloat16 [{b}, W, {d}] (a ring for the rows of second.x), "
                         f"got {arrays.describe(window)}")
    if positions is None:
        raise ValueError("positions: a window ring needs the token positions (they pick the slots)")
    positions = _check("positions", positions, np.int32, (1,))
    if positions.shape[0] != b:
        raise ValueError(f"positions: expected int32 [{b}] (the sequences of the window), got {arrays.describe(positions)}")
    if out1 is not None:
        raise ValueError("outs[1]: the second part goes into the window; pass None there")
    return window, positions


class ResidualNorm(NamedTuple):
    """The residual stream step after a sublayer, `add_rmsnorm` of its output: ``resid`` (fp32
    ``[B, D]``) += the output, in place, then the bf16 RMSNorm of ``resid`` with fp32 ``weight [D]``.
    A layer that takes one (`fp4kit.layers.MoE`'s ``then_norm``) returns that RMSNorm, and may run
    the step inside its own last launch."""
    resid: object
    weight: object
    eps: float = 1e-6


def check_residual_norm(norm: ResidualNorm, rows: int, width: int) -> ResidualNorm:
    """``norm`` validated for a sublayer output of bf16 ``[rows, width]``: `add_rmsnorm`'s checks,
    before any launch."""
    if not isinstance(norm, ResidualNorm):
        raise TypeError(f"then_norm: expected a fp4kit.ops.elementwise.ResidualNorm, got {type(norm).__name__}")
    resid = _check("then_norm.resid", norm.resid, np.float32, (2,))
    if resid.shape != (rows, width):
        raise ValueError(f"then_norm.resid: expected float32 [{rows}, {width}], got {arrays.describe(resid)}")
    weight = _check("then_norm.weight", norm.weight, np.float32, (1,))
    if weight.shape[0] != width:
        raise ValueError(f"then_norm.weight: expected float32 [{width}], got {arrays.describe(weight)}")
    arrays.check_same_device(resid=resid, weight=weight)
    return ResidualNorm(resid, weight, float(norm.eps))


def add_rmsnorm(resid, delta, weight, *, eps: float = 1e-6, out=None):
    """``resid += delta`` (fp32 ``[B, D]`` in place; ``delta`` bf16 ``[B, D]`` or None), then the
    bf16 RMSNorm of ``resid`` with fp32 ``weight [D]``."""
    resid = _check("resid", resid, np.float32, (2,))
    if delta is not None:
        delta = _check("delta", delta, arrays.BF16, (2,))
        if delta.shape != resid.shape:
            raise ValueError(f"delta: expected bfloat16 {tuple(resid.shape)}, got {arrays.describe(delta)}")
    weight = _check("weight", weight, np.float32, (1,))
    if weight.shape[0] != resid.shape[1]:
        raise ValueError(f"weight: expected float32 [{resid.shape[1]}], got {arrays.describe(weight)}")
    arrays.check_same_device(resid=resid, delta=delta, weight=weight, out=out)
    if not arrays.is_device_array(resid):
        return arrays.host_result(ref.add_rmsnorm(resid, delta, weight, eps=eps), out)
    out = arrays.device_out("out", out, resid.shape, arrays.BF16, resid)
    if resid.size:
        vec = quad_rows(resid.shape[1], resid, weight, out, delta)
        loader.get_kernel(_MODULE, "add_rmsnorm_bf16")(
            resid.shape[0], _THREADS, (resid, 0 if delta is None else delta, weight, out, _U32(resid.shape[1]),
                                       np.float32(eps), np.int32(vec), _release()))
    return out


#: the row kernels' quad path (raw_kernels/common/residual_norm.cuh ``kRowQuads``): rows of up to
#: this many channels, a multiple of 4, held in registers, the weight loaded before the wait
QUAD_ROW_MAX = 4 * _THREADS * 8


def _aligned16(*arrays_) -> bool:
    """Whether every device array given (None: skipped) starts on a 16-byte boundary."""
    return all(a is None or a.data.ptr % 16 == 0 for a in arrays_)


def quad_rows(d: int, *arrays_) -> bool:
    """Whether rows of ``d`` channels of these device arrays (fp32 rows 16-byte, bf16 rows 8-byte
    aligned when their start is) take the kernels' quad path (the residual step's layout: a launch
    that ends with it must choose as `add_rmsnorm` does, for the same bits)."""
    return d % 4 == 0 and d <= QUAD_ROW_MAX and _aligned16(*arrays_)


def embed_rmsnorm(table, tokens, weight, *, eps: float = 1e-6, resid=None, out=None):
    """The first layer's input in one launch: ``resid [B, H]`` (fp32) = the rows of ``table`` at
    ``tokens`` (what `embed` writes), and their bf16 RMSNorm with fp32 ``weight [H]`` (what
    `add_rmsnorm` without a delta returns), which is returned. ``resid``: the residual stream to
    write (allocated when None)."""
    table = _check("table", table, arrays.BF16, (2,))
    tokens = _check("tokens", tokens, np.int32, (1,))
    weight = _check("weight", weight, np.float32, (1,))
    h = table.shape[1]
    if weight.shape[0] != h:
        raise ValueError(f"weight: expected float32 [{h}] (the table's width), got {arrays.describe(weight)}")
    arrays.check_same_device(table=table, tokens=tokens, weight=weight, resid=resid, out=out)
    device = arrays.is_device_array(table)
    if device:
        resid = arrays.device_out("resid", resid, (tokens.shape[0], h), np.float32, table)
        out = arrays.device_out("out", out, (tokens.shape[0], h), arrays.BF16, table)
    if not device or not quad_rows(h, table, weight, resid, out):  # numpy, or rows off the quad path
        return add_rmsnorm(embed(table, tokens, out=resid), None, weight, eps=eps, out=out)
    if tokens.shape[0]:
        loader.get_kernel(_MODULE, "embed_rmsnorm_bf16")(
            tokens.shape[0], _THREADS, (table, tokens, resid, weight, out, _U32(h), _U32(table.shape[0]),
                                        np.float32(eps), status.device_word(), _release()))
    return out


def embed(table, tokens, *, out=None):
    """fp32 ``[B, H]`` rows of the bf16 ``table [V, H]`` for int32 ``tokens [B]``; an id outside
    ``[0, V)`` reads row 0 and records `fp4kit.runtime.status.TOKEN_RANGE`."""
    table = _check("table", table, arrays.BF16, (2,))
    tokens = _check("tokens", tokens, np.int32, (1,))
    arrays.check_same_device(table=table, tokens=tokens, out=out)
    shape = (tokens.shape[0], table.shape[1])
    if not arrays.is_device_array(table):
        rows, bad = ref.embed(table, tokens)
        if bad:
            status.record_host(status.TOKEN_RANGE)
        return arrays.host_result(rows, out)
    out = arrays.device_out("out", out, shape, np.float32, table)
    if tokens.shape[0]:
        vec = table.shape[1] % 8 == 0 and _aligned16(table, out)
        loader.get_kernel(_MODULE, "embed_bf16")(
            tokens.shape[0], _THREADS, (table, tokens, out, _U32(table.shape[1]), _U32(table.shape[0]),
                                        status.device_word(), np.int32(vec)))
    return out


def all_entries(comp_len, n: int, *, out=None):
    """int32 ``[B, n]``: every live compressed entry ``i < comp_len[b]``, -1 padded (ratio-128
    layers attend to all of them)."""
    comp_len = _check("comp_len", comp_len, np.int32, (1,))
    if n < 1:
        raise ValueError(f"n: expected a positive entry count, got {n}")
    arrays.check_same_device(comp_len=comp_len, out=out)
    if not arrays.is_device_array(comp_len):
        return arrays.host_result(ref.all_entries(comp_len, n), out)
    out = arrays.device_out("out", out, (comp_len.shape[0], n), np.int32, comp_len)
    if comp_len.shape[0]:
        loader.get_kernel(_MODULE, "all_entries").launch(
            ((n + _THREADS - 1) // _THREADS, comp_len.shape[0]), _THREADS, (comp_len, out, _U32(n)))
    return out


MAX_SPLIT_PARTS = 16
_bounds: dict = {}  # (device, bounds) -> the bounds on the device, made once (a graph keeps pointing at them)


def device_bounds(bounds, device: int | None = None):
    """Column boundaries ``0 = b_0 < ... < b_P`` as a uint32 array on ``device`` (default: the
    current one), made once per device and boundaries and kept (a captured graph keeps reading
    them): `split_columns` and the GEMM's column blocks (`fp4kit.ops.gemm.gemm`) take them."""
    import cupy

    device = cupy.cuda.Device().id if device is None else int(device)
    key = (device, tuple(int(b) for b in bounds))
    if key not in _bounds:
        with cupy.cuda.Device(device):
            _bounds[key] = cupy.asarray(np.asarray(key[1], np.uint32))
    return _bounds[key]


def split_columns(y, sizes, *, out=None) -> list:
    """The consecutive column blocks of ``y [rows, sum(sizes)]`` (bf16, C-contiguous) as
    C-contiguous ``[rows, sizes[p]]`` arrays: views of ``y`` for one row, else views of one buffer
    (``out``, bf16 of ``y.size`` elements, or allocated) that a single launch fills, part after part.
    numpy returns copies."""
    y = arrays.as_array(y, "y")
    if y.dtype != arrays.BF16 or y.ndim != 2:
        raise ValueError(f"y: expected a bfloat16 [rows, cols] array, got {arrays.describe(y)}")
    arrays.check_contiguous("y", y)
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 1 or sum(sizes) != y.shape[1] or len(sizes) > MAX_SPLIT_PARTS:
        raise ValueError(f"sizes: expected 1 to {MAX_SPLIT_PARTS} positive widths adding up to y's {y.shape[1]} "
                         f"columns, got {sizes}")
    rows, bounds = y.shape[0], np.cumsum([0, *sizes])
    if rows <= 1 or len(sizes) == 1 or not arrays.is_device_array(y):
        xp = arrays.array_module(y)
        return [xp.ascontiguousarray(y[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    if out is None:
        import cupy

        out = cupy.empty(y.size, arrays.BF16)
    elif out.dtype != arrays.BF16 or out.ndim != 1 or out.size != y.size:
        raise ValueError(f"out: expected a 1-D bfloat16 array of {y.size} elements, got {arrays.describe(out)}")
    arrays.check_same_device(y=y, out=out)
    vec8 = all(int(b) % 8 == 0 for b in bounds) and _aligned16(y, out)
    items = rows * y.shape[1] // (8 if vec8 else 1)
    loader.get_kernel(_MODULE, "split_columns_bf16")(
        (items + _THREADS - 1) // _THREADS, _THREADS,
        (y, out, _U32(rows), _U32(y.shape[1]), _U32(len(sizes)), device_bounds(bounds), np.int32(vec8)))
    return [out[rows * a: rows * b].reshape(rows, b - a) for a, b in zip(bounds[:-1], bounds[1:])]


def log_tokens(tokens, history, step) -> None:
    """``history[step % rows] = tokens``, then ``step += 1``: int32 ``tokens [B]``,
    ``history [rows, B]``, ``step [1]`` (all read and written on the device, or in numpy)."""
    tokens = _check("tokens", tokens, np.int32, (1,))
    history = _check("history", history, np.int32, (2,))
    step = _check("step", step, np.int32, (1,))
    if history.shape[1] != tokens.shape[0] or history.shape[0] < 1:
        raise ValueError(f"history: expected int32 [rows >= 1, {tokens.shape[0]}], got {arrays.describe(history)}")
    arrays.check_same_device(tokens=tokens, history=history, step=step)
    if not arrays.is_device_array(tokens):
        history[int(step[0]) % history.shape[0]] = tokens
        step[0] += 1
        return
    loader.get_kernel(_MODULE, "log_tokens")(1, _THREADS, (tokens, history, step, _U32(tokens.shape[0]),
                                                           _U32(history.shape[0])))


def prompt_tokens(prompt, positions, out) -> None:
    """``out[b] = prompt[b, min(positions[b], P - 1)]`` for int32 ``prompt [B, P]``, ``positions [B]``
    and ``out [B]``: the next prompt token per sequence, picked on the device."""
    prompt = _check("prompt", prompt, np.int32, (2,))
    positions = _check("positions", positions, np.int32, (1,))
    out = _check("out", out, np.int32, (1,))
    b, p = prompt.shape
    if p < 1 or positions.shape[0] != b or out.shape[0] != b:
        raise ValueError(f"prompt, positions, out: expected [B, P >= 1], [B], [B], got {arrays.describe(prompt)}, "
                         f"{arrays.describe(positions)}, {arrays.describe(out)}")
    arrays.check_same_device(prompt=prompt, positions=positions, out=out)
    if not arrays.is_device_array(prompt):
        out[...] = prompt[np.arange(b), np.clip(positions, 0, p - 1)]
        return
    if b:
        loader.get_kernel(_MODULE, "prompt_tokens")((b + _THREADS - 1) // _THREADS, _THREADS,
                                                    (prompt, positions, out, _U32(b), _U32(p)))
