"""Token sampling: validate inputs, pick the backend, launch ``raw_kernels/sampling.cu``.

`sample` draws one token per row of ``[B, V]`` logits from ``softmax(logits / temperature)``
truncated by top-k, then top-p (over the renormalised top-k survivors), then min-p, with an
exponential race (Gumbel-max) on Philox4x32-10 numbers; ``temperature == 0`` is greedy (argmax,
ties to the lower id). `fp4kit.reference.sampling` is the specification: filter order, tie rules,
NaN / Inf rules, the Philox counter layout.

numpy logits run the reference; CuPy (or CUDA DLPack) logits run one cooperative kernel launch on
CuPy's current stream: each row is split over several blocks of 256 threads (more at small batch,
so the GPU is busy) that hold their tokens in registers and meet at row barriers; see
``raw_kernels/sampling.cu``. The generator's ``seed`` and ``offset`` live in device memory: the
kernel reads them and advances ``offset`` by one on the device, so the call can be captured in a
CUDA graph and every replay draws fresh numbers. The kernel's per-row scratch belongs to the
generator (zero between calls; the kernel leaves it zero).

Status word: a NaN or ``+inf`` logit, a row with no finite logit, or an invalid value in a
per-row device array (replaced as the reference says) or-s `fp4kit.runtime.status.SAMPLER_INPUT`
into the device status word; the numpy backend records the same value in the host word.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..reference import sampling as ref
from ..runtime import arrays, loader, status

_MODULE = "sampling"
_THREADS = 256
_MAX_PER = 16  # tokens per thread (registers): a block holds up to 4096 tokens of a row
_MIN_PER = 4
#: the kernel builds by register tile (tokens per thread, `Tile<P>` in raw_kernels/sampling.cu): a
#: launch runs the smallest build holding its ``per``. The token loops are unrolled to P, so the
#: P = 4 build that batch 1 runs over a 129280-token vocabulary is half the code of the P = 16 one,
#: which a cold SM fetches at every launch. ``(16,)``: every launch on the P = 16 build (the same
#: tokens bit for bit: the builds differ only in unrolling).
PER_BUILDS = (4, 8, 16)
#: the keys of the blocks' largest thread maxima a row posts for the gathered cut's bound
#: (kPostSlots in raw_kernels/sampling.cu)
POST_SLOTS = 256
#: uint32 words of scratch per row in flight before its gather slots (header, histograms,
#: candidates, posted maxima); equals kRowWords in raw_kernels/sampling.cu
ROW_WORDS = 16 + 3 * 1024 + 6 * 1024 + 4 * 512 + POST_SLOTS
#: a row's gather slots (kGatherSlots, kGatherMaxK in raw_kernels/sampling.cu): a top-k row with
#: ``top_k * blocks_per_row`` up to `gather_slots` takes the gathered cut (each block sends its tokens
#: that can be among the row's k best, the row's last block cuts them), with one row barrier instead
#: of three: with top-p after the top-k always, a top-k alone when the posted bound holds
GATHER_SLOTS = 8192
GATHER_MAX_K = 256


def gather_slots(blocks_per_row: int) -> int:
    """The gather slots (2 words each) of a row split over ``blocks_per_row`` blocks."""
    return min(GATHER_SLOTS, blocks_per_row * GATHER_MAX_K)


def row_words(blocks_per_row: int) -> int:
    """uint32 words of scratch per row in flight."""
    return ROW_WORDS + 2 * gather_slots(blocks_per_row)
_U32 = np.uint32
_I32 = np.int32
_F32 = np.float32
_NULL = np.uint64(0)

MAX_VOCAB = 1 << 20  # 256 blocks of 4096 tokens, all resident at once
MAX_BATCH = 2**31 - 1
_DTYPES = (arrays.BF16, np.dtype(np.float32))


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _check_scalar(name: str, value) -> float | int:
    if name == "top_k":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"top_k: expected an integer or an int32 array, got {type(value).__name__}")
        if int(value) < 0:
            raise ValueError(f"top_k: expected top_k >= 0 (0: off), got {int(value)}")
        return min(int(value), 2**31 - 1)
    if not _is_number(value):
        raise TypeError(f"{name}: expected a number or a float32 array, got {type(value).__name__}")
    v = float(value)
    if name == "temperature" and not (math.isfinite(v) and v >= 0):
        raise ValueError(f"temperature: expected a finite number >= 0 (0: greedy), got {v}")
    if name == "top_p" and not 0 < v <= 1:
        raise ValueError(f"top_p: expected 0 < top_p <= 1 (1: off), got {v}")
    if name == "min_p" and not 0 <= v < 1:
        raise ValueError(f"min_p: expected 0 <= min_p < 1 (0: off), got {v}")
    return v


def _check_rows(name: str, value, bsz: int, like):
    """A per-row array: shape ``[B]``, fp32 (int32 for top_k), contiguous, in the logits' memory.

    Host arrays are also checked value by value; device arrays are not read on the host (the
    kernel replaces invalid values and records a status event).
    """
    a = arrays.as_array(value, name)
    dtype = np.dtype(np.int32 if name == "top_k" else np.float32)
    if a.dtype != dtype:
        raise TypeError(f"{name}: expected a per-row array of dtype {dtype.name}, got {arrays.describe(a)}")
    if tuple(a.shape) != (bsz,):
        raise ValueError(f"{name}: expected a scalar or a per-row array of shape ({bsz},), got {arrays.describe(a)}")
    arrays.check_contiguous(name, a)
    if arrays.device_id(a) != arrays.device_id(like):
        raise ValueError(f"{name}: expected a per-row array in the same memory as logits "
                         f"({arrays.describe(like)}), got {arrays.describe(a)}")
    if not arrays.is_device_array(a):
        bad = {
            "temperature": lambda x: ~np.isfinite(x) | (x < 0),
            "top_k": lambda x: x < 0,
            "top_p": lambda x: np.isnan(x) | (x <= 0) | (x > 1),
            "min_p": lambda x: np.isnan(x) | (x < 0) | (x >= 1),
        }[name](a)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}: row {i} holds an invalid value {a[i]!r} (temperature finite >= 0, "
                             f"top_k >= 0, 0 < top_p <= 1, 0 <= min_p < 1)")
    return a


def check_generator(generator, like):
    """``(seed, offset, arrivals)`` of ``generator``: uint64 ``[1]``, uint64 ``[1]``, uint32 ``[1]`` in
    the memory of ``like`` (e.g. `fp4kit.layers.sampler.Generator`). Device generators also need a
    ``scratch(words)`` method (the kernel's per-row scratch)."""
    if generator is None:
        raise TypeError("generator: required (e.g. fp4kit.layers.sampler.Generator(seed))")
    try:
        parts = (generator.seed, generator.offset, generator.arrivals)
        if arrays.is_device_array(like) and not callable(generator.scratch):
            raise AttributeError
    except AttributeError:
        raise TypeError(f"generator: expected an object with seed, offset and arrivals arrays and a "
                        f"scratch(words) method (fp4kit.layers.sampler.Generator), got {type(generator).__name__}") from None
    for part, name, dtype in zip(parts, ("seed", "offset", "arrivals"), (np.uint64, np.uint64, np.uint32)):
        if not (isinstance(part, np.ndarray) or arrays.is_device_array(part)):
            raise TypeError(f"generator.{name}: expected a numpy or CuPy array, got {type(part).__name__}")
        if part.shape != (1,) or part.dtype != np.dtype(dtype):
            raise ValueError(f"generator.{name}: expected shape (1,) and dtype {np.dtype(dtype).name}, "
                             f"got {arrays.describe(part)}")
        if arrays.device_id(part) != arrays.device_id(like):
            where = "the host" if arrays.device_id(like) is None else f"cuda:{arrays.device_id(like)}"
            raise ValueError(f"generator.{name}: expected a generator on {where} like logits, got {arrays.describe(part)}")
    return parts


def check_inputs(logits, temperature, top_k, top_p, min_p):
    """Validated ``(logits, params)``; ``params`` maps each name to a Python scalar or a per-row array."""
    logits = arrays.as_array(logits, "logits")
    if logits.ndim != 2:
        raise ValueError(f"logits: expected a 2-D array [batch, vocab], got {arrays.describe(logits)}")
    if logits.dtype not in _DTYPES:
        raise TypeError(f"logits: expected dtype bfloat16 or float32, got {logits.dtype}")
    bsz, vocab = logits.shape
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"logits: expected a vocabulary of 1 to {MAX_VOCAB} tokens, got shape {tuple(logits.shape)}")
    if bsz > MAX_BATCH:
        raise ValueError(f"logits: at most {MAX_BATCH} rows, got shape {tuple(logits.shape)}")
    arrays.check_contiguous("logits", logits)
    params = {}
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        if _is_number(value) or isinstance(value, (bool, np.bool_)) or not hasattr(value, "__dlpack__"):
            params[name] = _check_scalar(name, value)
        else:
            params[name] = _check_rows(name, value, bsz, logits)
    return logits, params


def sample(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generator, out=None):
    """One token per row, drawn from the truncated, renormalised softmax of ``logits / temperature``.

    Parameters
    ----------
    logits : bf16 or fp32 ``[B, V]``, C-contiguous
        V up to 2**20. NaN is read as ``-inf``; a ``+inf`` makes the lowest-id ``+inf`` token
        certain; a row with no finite logit returns its greedy token (token 0 when all are
        ``-inf`` / NaN). NaN, ``+inf`` and empty rows are recorded in the status word (bit 8).
    temperature : float >= 0, or fp32 ``[B]``
        0 is greedy (argmax, ties to the lower id); any value below 1.18e-38 counts as 0.
    top_k : int >= 0, or int32 ``[B]``
        Keep the k most probable tokens (ties: lower id first); 0 is off.
    top_p : float in (0, 1], or fp32 ``[B]``
        Then keep the shortest most-probable prefix of the top-k survivors holding at least
        ``top_p`` of their mass (ties: lower id first); 1 is off.
    min_p : float in [0, 1), or fp32 ``[B]``
        Then keep the tokens with ``p >= min_p * p_max``; 0 is off.
    generator : `fp4kit.layers.sampler.Generator` (or anything with ``seed`` uint64 ``[1]``,
        ``offset`` uint64 ``[1]`` and ``arrivals`` uint32 ``[1]`` arrays, and for device logits a
        ``scratch(words)`` method returning a zeroed uint32 device buffer) in the logits' memory.
        Every call reads ``(seed, offset)`` and advances ``offset`` by one (on the device for device
        logits); row ``b``, token ``i`` of a call use Philox counter ``(i // 4, b, offset)``.
    out : int32 ``[B]``, optional
        Receives the token ids (always in ``[0, V)``); allocated when not given.

    Per-row arrays live in the logits' memory (device arrays are never read on the host: invalid
    values found there are replaced as the reference says and recorded in the status word).
    Everything is validated before launch. On the device the call is one launch on CuPy's current
    stream; with ``out`` given it allocates nothing and can be captured in a CUDA graph (call it
    once eagerly first, with the largest batch: the first call compiles the kernel and sizes the
    generator's scratch). One generator must not be used by
    two streams at once. A call with B == 0 does nothing (the offset is not advanced).
    """
    logits, params = check_inputs(logits, temperature, top_k, top_p, min_p)
    seed, offset, arrivals = check_generator(generator, logits)
    bsz, vocab = logits.shape
    if out is None:
        out = arrays.array_module(logits).empty(bsz, np.int32)
    else:
        arrays.check_out("out", out, (bsz,), np.int32, logits)
    if bsz == 0:
        return out
    if not arrays.is_device_array(logits):
        p = {k: (np.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in params.items()}
        if ref.row_events(logits, **p).any():
            status.record_host(status.SAMPLER_INPUT)
        out[...] = ref.sample(logits, int(seed[0]), int(offset[0]), **p)
        offset[0] = np.uint64((int(offset[0]) + 1) % 2**64)
        return out

    pairs = []
    for name, scalar_type in (("temperature", _F32), ("top_k", _I32), ("top_p", _F32), ("min_p", _F32)):
        v = params[name]
        if arrays.is_device_array(v):
            pairs += [v, scalar_type(0)]
        else:
            pairs += [_NULL, scalar_type(v)]
    vec = int(vocab % 4 == 0 and logits.data.ptr % 16 == 0)
    name = "sample_bf16" if logits.dtype == arrays.BF16 else "sample_f32"
    kernel = loader.get_kernel(_MODULE, name, cooperative=True, block=_THREADS)
    per, blocks_per_row, grid = geometry(bsz, vocab, kernel.max_blocks)
    build = register_build(per)
    if build != _MAX_PER:
        small = loader.get_kernel(_MODULE, f"{name}_p{build}", cooperative=True, block=_THREADS)
        if grid <= small.max_blocks:  # all blocks co-resident (the builds' register limits are equal)
            kernel = small
    scratch = generator.scratch(grid // blocks_per_row * row_words(blocks_per_row))  # one row per group of blocks
    kernel(grid, _THREADS, (logits, _U32(bsz), _U32(vocab), _I32(per), _I32(blocks_per_row), _I32(vec), *pairs,
                            seed, offset, arrivals, scratch, out, status.device_word()))
    return out


def register_build(per: int) -> int:
    """The P of the smallest kernel build in `PER_BUILDS` holding ``per`` tokens per thread."""
    return min((p for p in PER_BUILDS if p >= per), default=_MAX_PER)


def geometry(batch: int, vocab: int, max_blocks: int) -> tuple[int, int, int]:
    """``(per, blocks_per_row, grid)`` of the kernel for ``[batch, vocab]`` logits.

    A row is split over ``blocks_per_row`` blocks of ``256 * per`` tokens (``per`` a multiple of 4
    in [4, 16]): about ``max_blocks / 2`` blocks in all when the batch is small, so the GPU is
    busy (more blocks per row measured slower on the H200: every block adds histogram atomics, a
    histogram read and a barrier arrival). The cooperative grid holds whole rows and at most
    ``max_blocks`` (co-resident) blocks; its blocks loop over the rows.
    """
    fill = max(1, max_blocks // 2)
    g = max(-(-vocab // (_THREADS * _MAX_PER)), min(-(-vocab // (_THREADS * _MIN_PER)), -(-fill // batch)))
    quantum = _THREADS * _MIN_PER
    chunk = -(-(-(-vocab // g)) // quantum) * quantum
    per = chunk // _THREADS
    g = -(-vocab // chunk)
    if g > max_blocks:
        raise ValueError(f"logits: a vocabulary of {vocab} needs {g} resident blocks per row, this GPU holds "
                         f"{max_blocks}; at most {max_blocks * _THREADS * _MAX_PER} tokens")
    rows = min(batch, max_blocks // g)
    return per, g, rows * g
