"""`KVCache`: one attention layer's cache for a batch of sequences, driven by device positions.

Buffers (all preallocated at construction, never grown):

* ``swa`` bf16 ``[B, W, D]``: the sliding-window ring buffer (token ``p`` at slot ``p % W``);
* ``pos`` int32 ``[B]``: tokens appended per sequence, **in device memory**;
* ``comp`` bf16 ``[B, max_comp, D]`` and ``comp_len`` int32 ``[B]``: the compressed entries, appended
  in O(1) (one row write per emitted entry; no concatenation, no growth);
* the compressor's fp32 state rings ``kv_state`` / ``score_state`` ``[B, coff*R, coff*D]``.

`append` writes T new tokens of every sequence in fixed launches (the ring write, the compressor,
the position advance; no ring write for a cache whose window is never read: ``append(None, ...)``) whose kernels read the positions on the device, so a decode step can be
captured in a CUDA graph and replayed while the positions advance. An entry that does not fit is
dropped and recorded in the device status word (``KV_COMP_OVERFLOW``), never written over another.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..ops import elementwise as ew_ops
from ..ops import kv_cache as kv_ops
from ..reference import elementwise as ref_ew
from ..reference import kv_cache as ref
from ..runtime import arrays, status
from ..runtime import device as runtime_device

RATIOS = (0, 4, 128)


class KVCache:
    """The cache of one layer (see the module docstring).

    Parameters
    ----------
    batch : int
    window : int — sliding window W (default 128)
    head_dim : int — latent width D (default 512, a multiple of 16)
    ratio : 0, 4 or 128 — compression ratio (0: window only)
    max_comp : int — compressed-entry capacity per sequence (default 32768)
    ape : fp32 ``[ratio, coff*D]`` — the compressor's learned per-slot score bias (zeros if None)
    norm_weight : fp32 ``[D]`` — the compressed entry's RMSNorm weight (ones if None)
    rope_dim, rope_theta, eps : RoPE on the last ``rope_dim`` channels of an entry (``rope_theta`` its
        base, or the channel pairs' inverse frequencies, e.g. YaRN's), RMSNorm epsilon
    device : where the buffers live (see `fp4kit.runtime.device`): True (default) / ``"cuda"`` CuPy's
        current CUDA device, ``"cuda:N"`` / ``N`` device N, False / ``"cpu"`` numpy (the reference backend).
        Without a usable CUDA device a CUDA choice raises RuntimeError saying to pass ``device=False``.
    """

    def __init__(self, batch: int, *, window: int = 128, head_dim: int = 512, ratio: int = 0, max_comp: int = 32768,
                 ape=None, norm_weight=None, rope_dim: int = 64, rope_theta=10000.0, eps: float = 1e-6,
                 device=True):
        if ratio not in RATIOS:
            raise ValueError(f"ratio: expected one of {RATIOS}, got {ratio}")
        for name, value in (("batch", batch), ("window", window), ("head_dim", head_dim), ("ratio", ratio),
                            ("max_comp", max_comp), ("rope_dim", rope_dim)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
        if head_dim % 16 or head_dim <= 0:
            raise ValueError(f"head_dim: expected a positive multiple of 16, got {head_dim}")
        if window <= 0 or batch <= 0 or max_comp <= 0:
            raise ValueError(f"batch, window and max_comp must be positive, got {batch}, {window}, {max_comp}")
        if rope_dim % 2 or not 0 <= rope_dim <= head_dim:
            raise ValueError(f"rope_dim: expected an even number in [0, {head_dim}], got {rope_dim}")
        ref_ew.rope_inv_freq(rope_dim, rope_theta, "rope_theta")  # a base, or rope_dim / 2 inverse frequencies
        ordinal = runtime_device.resolve(device)
        with runtime_device.using(ordinal):
            self._allocate(runtime_device.array_module(ordinal), batch, window, head_dim, ratio, max_comp, ape,
                           norm_weight, rope_dim, rope_theta, eps)

    def _allocate(self, xp, batch, window, head_dim, ratio, max_comp, ape, norm_weight, rope_dim, rope_theta, eps):
        self.xp, self.batch, self.window, self.head_dim, self.ratio = xp, batch, window, head_dim, ratio
        self.max_comp, self.rope_dim, self.rope_theta, self.eps = max_comp, rope_dim, rope_theta, eps
        self.swa = xp.zeros((batch, window, head_dim), arrays.BF16)
        # the compressed entries' RoPE frequencies on the device (the kernels read a table)
        self.rope_table = None if xp is np else ew_ops.rope_table(rope_theta, rope_dim if ratio else 0, self.swa,
                                                                  "rope_theta")
        self.pos = xp.zeros(batch, np.int32)
        self.comp = self.comp_len = self.kv_state = self.score_state = self.ape = self.norm_weight = None
        if ratio:
            cf = ref.coff(ratio)
            width = cf * head_dim
            self.comp = xp.zeros((batch, max_comp, head_dim), arrays.BF16)
            self.comp_len = xp.zeros(batch, np.int32)
            self.kv_state = xp.zeros((batch, cf * ratio, width), np.float32)
            self.score_state = xp.zeros((batch, cf * ratio, width), np.float32)
            self.ape = self._param("ape", ape, (ratio, width), 0.0)
            self.norm_weight = self._param("norm_weight", norm_weight, (head_dim,), 1.0)

    def _param(self, name, value, shape, fill):
        if value is None:
            return self.xp.full(shape, fill, np.float32)
        value = arrays.as_array(value, name)
        if tuple(value.shape) != shape or value.dtype != np.float32:
            raise ValueError(f"{name}: expected float32 {shape}, got {arrays.describe(value)}")
        return self.xp.asarray(value)

    @property
    def compress_width(self) -> int:
        """Channels of the compressor inputs per token: ``coff * D``."""
        return ref.coff(self.ratio) * self.head_dim if self.ratio else 0

    def append(self, kv, comp_kv=None, comp_score=None, *, counts=None) -> None:
        """Append ``T`` tokens per sequence.

        Parameters
        ----------
        kv : bf16 ``[B, T, D]`` — the layer's latent KV of the new tokens (the ring buffer's rows), or
            None for a compressing cache whose window is never read: the ring is left as it is (no
            launch for it), the compressor and the positions move on as usual
        comp_kv, comp_score : bf16 or fp32 ``[B, T, coff*D]`` — the compressor's inputs (ratio > 0)
        counts : int32 ``[B]``, optional — valid new tokens per sequence (<= T; prefill of prompts of
            different lengths); in the cache's memory, read on the device. A count outside ``[0, T]``
            is data, not an error: it is clamped to that range and recorded in the status word
            (`fp4kit.runtime.status.KV_INPUT`)
        """
        kv, comp_kv, comp_score, counts, t = self._validate(kv, comp_kv, comp_score, counts)
        if self.xp is np:
            n = None if counts is None else np.clip(counts, 0, t).astype(np.int32)
            if n is not None and not np.array_equal(n, counts):
                status.record_host(status.KV_INPUT)
            if kv is not None:
                ref.append_swa(self.swa, self.pos, kv, n)
            if self.ratio:
                dropped = ref.append_compressed(self.comp, self.comp_len, self.kv_state, self.score_state, self.pos,
                                                comp_kv.astype(np.float32), comp_score.astype(np.float32), self.ape,
                                                self.ratio, self.norm_weight, eps=self.eps, rope_dim=self.rope_dim,
                                                theta=self.rope_theta, counts=n)
                if dropped:
                    status.record_host(status.KV_COMP_OVERFLOW)
            ref.advance(self.pos, t, n)
            return
        if kv is not None:
            kv_ops.append_swa(self.swa, self.pos, kv, counts)
        if self.ratio:  # the compressor moves the positions on at its end
            kv_ops.compress(comp_kv, comp_score, counts, **self._compressor_args(report_counts=kv is None))
        else:
            kv_ops.advance(self.pos, counts, t)

    def _compressor_args(self, report_counts: bool) -> dict:
        """The cache's arguments of `fp4kit.ops.kv_cache.compress` (positions moved on at its end)."""
        return dict(ape=self.ape, norm_weight=self.norm_weight, kv_state=self.kv_state, score_state=self.score_state,
                    comp=self.comp, comp_len=self.comp_len, pos=self.pos, ratio=self.ratio, eps=self.eps,
                    rope_dim=self.rope_dim, rope_table=self.rope_table, advance=True, report_counts=report_counts)

    def _validate(self, kv, comp_kv, comp_score, counts):
        """`append`'s arguments checked against this cache: (kv, comp_kv, comp_score, counts, T)."""
        if kv is None:
            if not self.ratio:
                raise ValueError("kv: None (no window rows) is for a compressing cache (ratio > 0); this one has "
                                 "ratio 0 and appends only its window")
            if comp_kv is None:
                raise ValueError("comp_kv, comp_score: a compressing cache (ratio > 0) needs the compressor inputs")
            t = self._check("comp_kv", comp_kv, (self.batch, None, self.compress_width),
                            (arrays.BF16, np.dtype(np.float32))).shape[1]
        else:
            kv = self._check("kv", kv, (self.batch, None, self.head_dim), (arrays.BF16,))
            t = kv.shape[1]
        if self.ratio:
            if comp_kv is None or comp_score is None:
                raise ValueError("comp_kv, comp_score: a compressing cache (ratio > 0) needs the compressor inputs")
            shape = (self.batch, t, self.compress_width)
            comp_kv = self._check("comp_kv", comp_kv, shape, (arrays.BF16, np.dtype(np.float32)))
            comp_score = self._check("comp_score", comp_score, shape, (comp_kv.dtype,))
        elif comp_kv is not None or comp_score is not None:
            raise ValueError("comp_kv, comp_score: this cache does not compress (ratio 0)")
        if counts is not None:
            counts = self._check("counts", counts, (self.batch,), (np.dtype(np.int32),))
        return kv, comp_kv, comp_score, counts, t

    def advance(self, tokens: int = 1) -> None:
        """Move every sequence's position on by ``tokens`` after their window rows were written by
        the kernel that produced them (`fp4kit.ops.elementwise.rmsnorm_rope_pair` with
        ``window=cache.swa``): what `append` does after its ring write, for a cache that does not
        compress (a compressing one appends with ``kv=None``, its compressor moving the positions)."""
        if self.ratio:
            raise ValueError("advance: a compressing cache (ratio > 0) moves its positions in append(None, comp_kv, "
                             "comp_score), which also runs its compressor")
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
            raise ValueError(f"tokens: expected a non-negative int, got {tokens!r}")
        if self.xp is np:
            ref.advance(self.pos, int(tokens))
        else:
            kv_ops.advance(self.pos, None, int(tokens))

    def _check(self, name, a, shape, dtypes):
        a = arrays.as_array(a, name)
        if a.ndim != len(shape) or any(s is not None and a.shape[i] != s for i, s in enumerate(shape)):
            expected = ", ".join("T" if s is None else str(s) for s in shape)
            raise ValueError(f"{name}: expected shape ({expected}), got {tuple(a.shape)}")
        if a.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {' or '.join(np.dtype(d).name for d in dtypes)}, got {a.dtype}")
        arrays.check_contiguous(name, a)
        if arrays.is_device_array(a) != (self.xp is not np) or (arrays.is_device_array(a) and a.device.id != self.swa.device.id):
            raise ValueError(f"{name}: expected an array in the cache's memory, got one {arrays.describe(a)}")
        return a

    def rewind(self, tokens) -> None:
        """Take back the last token of the sequences where ``tokens[b]`` is 1 (int32 ``[B]`` of 0 / 1
        in the cache's memory, read on the device: e.g. a speculative step's rejected draft): their
        position moves back by one and their compressed length to the entries complete there.
        Nothing else needs undoing: the window ring, the compressor's running state and the entries
        are indexed by position, and the next append overwrites what that token left before any
        query can read it (its window slot held a position one window back, its compressor slot a
        group no later entry reads). Exact for one token; a count outside ``[0, 1]`` is clamped and
        recorded in the status word (`fp4kit.runtime.status.KV_INPUT`), as `append`'s counts are."""
        tokens = self._check("tokens", tokens, (self.batch,), (np.dtype(np.int32),))
        if self.xp is np:
            if ref.rewind(self.pos, self.comp_len, tokens, self.ratio, self.max_comp):
                status.record_host(status.KV_INPUT)
            return
        kv_ops.rewind(self.pos, self.comp_len, tokens, self.ratio, self.max_comp)

    def reset(self, seq: int) -> None:
        """Forget sequence ``seq`` (its position and compressed length go to 0; no host sync)."""
        if not 0 <= seq < self.batch:
            raise IndexError(f"seq: expected 0..{self.batch - 1}, got {seq}")
        self.pos[seq] = 0
        if self.ratio:
            self.comp_len[seq] = 0

    def overflowed(self) -> bool:
        """Whether any compressed entry was dropped for lack of room (reads the status word: a sync)."""
        device = None if self.xp is np else self.swa.device.id
        return bool(status.read(device) & status.KV_COMP_OVERFLOW)

    def window_slots(self):
        """For every sequence the ring slots holding tokens, oldest first, -1 for empty: ``[B, W]``
        (numpy backend; a convenience for tests and the reference attention)."""
        pos = np.asarray(self.pos if self.xp is np else self.pos.get())
        w = self.window
        out = np.full((self.batch, w), -1, np.int32)
        for b, p in enumerate(pos):
            first = max(0, int(p) - w)
            out[b, : int(p) - first] = np.arange(first, int(p)) % w
        return out


def append_compressed(first, second, *, counts=None) -> None:
    """``cache.append(None, comp_kv, comp_score, counts=counts)`` for both ``(cache, comp_kv,
    comp_score)`` of ``first`` and ``second``: two compressing caches whose windows are never
    read (a ratio-4 layer's KV cache at decode, whose window rows its norm kernel wrote, and its
    indexer's key cache). On the GPU, with bf16 inputs and the same batch, T and ``counts``, the two
    compressors run in one launch (`fp4kit.ops.kv_cache.compress_pair`); otherwise one after the other."""
    (a, *a_in), (b, *b_in) = first, second
    a_kv, a_score = a._validate(None, *a_in, counts)[1:3]
    b_kv, b_score, counts_b, t = b._validate(None, *b_in, counts)[1:]
    arrays.check_same_device(first=a.comp, second=b.comp, counts=counts)
    together = (a.xp is not np and a_kv.dtype == arrays.BF16 and b_kv.dtype == arrays.BF16 and a.batch == b.batch
                and a_kv.shape[1] == t and a.eps == b.eps)
    if not together:
        a.append(None, a_kv, a_score, counts=counts)
        b.append(None, b_kv, b_score, counts=counts)
        return
    kv_ops.compress_pair((a_kv, a_score, a._compressor_args(report_counts=True)),
                         (b_kv, b_score, b._compressor_args(report_counts=False)), counts_b)
