"""The status word: events that kernels record on the device instead of stopping the decode loop.

Each CUDA device has one ``uint32`` word in device memory; kernels ``atomicOr`` flags into it.
Nothing in fp4kit reads it back: the caller checks it when it chooses (one host sync), e.g.
once per N decode steps. The numpy backend keeps a host word with the same flags.

The flags below are named once for Python; ``raw_kernels/common/status.cuh`` holds the same
list for the kernels (``FP4_STATUS_<NAME>``), and a CPU test checks that the two agree.
"""

from __future__ import annotations

import threading

from .workspace import zeros_outside_capture

#: a NaN or ±Inf reached an NVFP4 encoder (quantize, amax, swiglu_quantize), or an encode scale
#: or amax that is not a positive finite number (resp. not a finite number >= 0) reached quantize,
#: dequantize or global_scale_from_amax: the result is not a faithful NVFP4 value
NONFINITE_INPUT = 1
#: the indexer met a NaN score (ranked as -inf) or a live length outside [0, capacity] (clamped)
INDEXER_INPUT = 2
#: a compressed-KV entry was dropped because its sequence's buffer was full (KVCache max_comp)
KV_COMP_OVERFLOW = 4
#: the sampler met a NaN or +Inf logit, a row without a finite logit, or an invalid per-row parameter
SAMPLER_INPUT = 8
#: a token id outside [0, vocab) reached the embedding gather or hash routing (row 0 was read instead)
TOKEN_RANGE = 16
#: KVCache.append met a count outside [0, T] (clamped), or sparse attention a negative position
#: (counted as 0) or a compressed length outside [0, capacity] (clamped)
KV_INPUT = 32
#: pairs of an expert-parallel MoE call did not fit the all-to-all capacity and were dropped
EP_CAPACITY_OVERFLOW = 1 << 8
#: a MoE dispatch met per-expert counts that do not sum to its call's pairs, or a ticket past them:
#: the layer's device state was shared by calls that overlapped (two streams); no expert ran, the
#: rows were clamped into the call's buffers
MOE_DISPATCH = 1 << 9

FLAG_NAMES = {
    NONFINITE_INPUT: "non-finite input to an NVFP4 encoder, or a global scale / amax out of range",
    INDEXER_INPUT: "indexer: a NaN score or a length outside [0, capacity]",
    KV_COMP_OVERFLOW: "a compressed-KV buffer overflowed (entries dropped, none overwritten)",
    SAMPLER_INPUT: "sampler: a NaN/+Inf logit, a row without a finite logit, or an invalid per-row parameter",
    TOKEN_RANGE: "embedding or hash routing: a token id outside [0, vocab) (row 0 read instead)",
    KV_INPUT: "KV cache or sparse attention: a count, position or compressed length out of range (clamped)",
    EP_CAPACITY_OVERFLOW: "expert-parallel MoE: pairs beyond the all-to-all capacity were dropped",
    MOE_DISPATCH: "MoE dispatch: counts or tickets of another call (overlapping calls of one layer); nothing routed",
}

_lock = threading.Lock()
_host_word = 0
_device_words: dict[int, object] = {}


def device_word():
    """The status word of the current CUDA device (a CuPy ``uint32[1]``), created zeroed once."""
    import cupy

    dev = cupy.cuda.Device().id
    word = _device_words.get(dev)
    if word is None:
        with _lock:
            word = _device_words.get(dev)
            if word is None:
                word = zeros_outside_capture(1, cupy.uint32)
                _device_words[dev] = word
    return word


def record_host(flags: int) -> None:
    """Or ``flags`` into the host word (numpy backend)."""
    global _host_word
    with _lock:
        _host_word |= int(flags)


def read(device: int | None = None) -> int:
    """The flags recorded so far: the host word, or-ed with the word of ``device`` (or of every
    device that has one when ``device`` is None). Reading a device word synchronises the host."""
    flags = _host_word
    for dev, word in list(_device_words.items()):
        if device is None or dev == device:
            flags |= int(word.get()[0])
    return flags


def clear(device: int | None = None) -> None:
    """Reset the host word and the device word(s)."""
    global _host_word
    with _lock:
        _host_word = 0
    for dev, word in list(_device_words.items()):
        if device is None or dev == device:
            word.fill(0)


def describe(flags: int) -> list[str]:
    return [text for bit, text in FLAG_NAMES.items() if flags & bit]


def check_finite(device: int | None = None, *, raise_error: bool = False) -> bool:
    """True if no non-finite value has reached an encoder since the last `clear`.

    With ``raise_error=True`` a recorded event raises `FloatingPointError` instead.
    Synchronises the host with the device(s) it reads.
    """
    ok = not (read(device) & NONFINITE_INPUT)
    if not ok and raise_error:
        raise FloatingPointError(FLAG_NAMES[NONFINITE_INPUT])
    return ok
