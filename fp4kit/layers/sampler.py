"""`Generator` and `Sampler`: token sampling with its random state kept in device memory.

`Generator` owns the Philox key (``seed``) and counter (``offset``) as uint64 ``[1]`` arrays, on
a CUDA device (``device=True``, the default) or the host (``device=False``). Each
`fp4kit.ops.sampling.sample` call reads them where they live and advances ``offset`` by one there,
so a CUDA graph holding a sample call draws new tokens on every replay, and ``offset`` counts the
calls. The same ``(seed, offset)`` gives the same
tokens. Use one generator per stream.

`Sampler` fixes the sampling parameters (scalars, or per-row arrays given per call) and owns its
output buffer, one per batch size, so that after one eager call the same call can be captured.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..ops import sampling as sampling_ops
from ..runtime import arrays, workspace
from ..runtime import device as runtime_device


def _seed_value(seed) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed: expected an integer, got {type(seed).__name__}")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed: expected 0 <= seed < 2**64, got {int(seed)}")
    return int(seed)


class Generator:
    """Philox4x32-10 state: ``seed`` (the key) and ``offset`` (the per-call counter), uint64 ``[1]``.

    Parameters
    ----------
    seed : int in [0, 2**64)
    device : where the state lives (see `fp4kit.runtime.device`)
        True (default) / ``"cuda"``: CuPy's current CUDA device (for device logits); ``"cuda:N"`` / ``N``:
        device N; False / ``"cpu"``: the host (numpy logits). Without a usable CUDA device a CUDA
        choice raises RuntimeError saying to pass ``device=False``. The attribute ``device`` is
        True for a generator on a CUDA device.
    offset : int, the starting counter (default 0)

    ``arrivals`` (uint32 ``[1]``, zero between calls) is the kernel's scratch for advancing the
    offset once per launch; `scratch` holds its per-row counters and histograms.
    """

    def __init__(self, seed: int, *, device=True, offset: int = 0):
        seed, offset = _seed_value(seed), _seed_value(offset)
        ordinal = runtime_device.resolve(device)
        self.device = ordinal is not None
        xp = runtime_device.array_module(ordinal)
        with runtime_device.using(ordinal):
            self.seed = xp.asarray(np.array([seed], np.uint64))
            self.offset = xp.asarray(np.array([offset], np.uint64))
            self.arrivals = xp.zeros(1, np.uint32)
        self._scratch = None
        self._retired: list = []

    def scratch(self, words: int):
        """A uint32 device buffer of at least ``words`` words, zero between calls (the sampling kernel
        leaves it zero). Made on first use and grown when a call needs more; a replaced buffer is
        kept alive, since a captured CUDA graph may still point at it."""
        if not self.device:
            raise TypeError("Generator.scratch: a host generator has no device scratch")
        if self._scratch is None or self._scratch.size < words:
            if self._scratch is not None:
                self._retired.append(self._scratch)
            self._scratch = workspace.zeros_outside_capture(max(int(words), 1), np.uint32)
        return self._scratch

    def set_state(self, seed: int | None = None, offset: int = 0) -> None:
        """Write a new seed (when given) and offset into the existing buffers (stream-ordered on the
        device; a captured graph keeps pointing at them)."""
        if seed is not None:
            self.seed[...] = np.uint64(_seed_value(seed))
        self.offset[...] = np.uint64(_seed_value(offset))

    def get_state(self) -> tuple[int, int]:
        """``(seed, offset)`` as Python ints (synchronises the host with the device)."""
        seed = self.seed.get() if self.device else self.seed
        offset = self.offset.get() if self.device else self.offset
        return int(seed[0]), int(offset[0])


class Sampler:
    """Draws one token per row of ``[B, V]`` logits (see `fp4kit.ops.sampling.sample`).

    Parameters
    ----------
    generator : Generator
    temperature, top_k, top_p, min_p
        Defaults for every call (scalars); a call may override any of them with a scalar or a
        per-row array in the logits' memory.
    """

    def __init__(self, generator: Generator, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0):
        if not isinstance(generator, Generator):
            raise TypeError(f"generator: expected a fp4kit.layers.sampler.Generator, got {type(generator).__name__}")
        self.generator = generator
        self.defaults = {name: sampling_ops._check_scalar(name, value) for name, value in
                         (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p))}
        self._buffers = workspace.BufferCache()

    def buffers(self, batch: int, *, device=True):
        """The int32 ``[batch]`` output buffer where ``device`` says (`fp4kit.runtime.device`: True
        the current CUDA device, False / ``"cpu"`` the host), made on first use."""
        return self._buffer(int(batch), runtime_device.resolve(device))

    def _buffer(self, batch: int, ordinal: int | None):
        def make():
            with runtime_device.using(ordinal):
                return runtime_device.array_module(ordinal).empty(batch, np.int32)

        return self._buffers.get((ordinal, batch), make)

    def __call__(self, logits, *, out=None, **overrides):
        """Token ids int32 ``[B]`` in this sampler's buffer for B (overwritten by the next call), or
        in ``out`` (int32 ``[B]`` in the logits' memory) when given: a caller that keeps the tokens
        in a buffer of its own needs no copy after the call."""
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            raise TypeError(f"Sampler: unknown parameter(s) {sorted(unknown)}; have {sorted(self.defaults)}")
        params = {**self.defaults, **overrides}
        logits = arrays.as_array(logits, "logits")
        if logits.ndim != 2:
            raise ValueError(f"logits: expected a 2-D array [batch, vocab], got {arrays.describe(logits)}")
        if out is None:
            out = self._buffer(int(logits.shape[0]), arrays.device_id(logits))  # in the logits' memory
        return sampling_ops.sample(logits, generator=self.generator, out=out, **params)
