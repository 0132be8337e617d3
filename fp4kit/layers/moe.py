"""`MoE`: a DeepSeek Mixture-of-Experts layer with NVFP4 experts and no host synchronisation.

A forward pass on the device is a fixed sequence of launches whose grids are sized for the worst
case (every token to distinct experts) and exit early, so it can be captured in a CUDA graph. The
path is chosen from the token count alone (`SMALL_MAX_ASSIGNMENTS`). Both start with

1. router (one block per token): logits from the high-precision gate weight, scores
   (``sqrtsoftplus`` V4 / ``sigmoid`` V3 / ``softmax``), selection-only bias, optional grouped top-k,
   top-k (ties to the lower expert id) or hash routing, renormalisation, routed scaling (the
   sorted path also counts the pairs per expert by atomics);
2. the layer input quantized once (W4A4; W4A16 feeds bf16).

The small-T path (decode) then runs two GEMV launches over the (token, slot) assignments, read
straight from the router's ids: gate|up + SwiGLU (+ clamp, + routing weight) per assignment, the
W4A4 quantize of that output, and down + the weighted combine in slot order; a `SharedExpert`
rides along as one more expert (`FOLD_SHARED`) or runs apart. The expert-sorted path (larger T):

3. dispatch (one block): offsets by a prefix sum, the active experts, each (token, slot)'s row in
   expert-sorted order;
4. L1: one grouped GEMM over W13 (gate and up interleaved in chunks of 16 rows, so the fused SwiGLU
   reads its output directly) — or, unfused, two grouped GEMMs over W1 and W3 writing the two
   halves of a ``[gate | up]`` buffer;
5. the fused SwiGLU (+ V4 clamp, + routing weight as row factor when it is applied before the down
   projection) + amax + quantize (W4A4), or SwiGLU to bf16 (W4A16; with `GROUPED_SWIGLU_EPILOGUE`
   in L1's epilogue instead of a launch of its own);
6. L2: one grouped GEMM over W2;
7. combine back to token order in slot order (times the routing weight for V3), plus the shared
   expert (with `GROUPED_FOLD_SHARED` one more expert of L1 and L2 instead of its own launches; with
   `GROUPED_COMBINE_IN_GEMM` in L2, by the block that completes a token's slots).

Expert weights are stacked: `ExpertStack` holds ``[E, N, K/2]`` codes, ``[E, N, K/16]`` scales, the
per-expert encode scales ``[E]`` and their decode factors on the device (and optional per-row
decode factors for experts fused from shards with different global scales).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import numpy as np

from .. import formats
from ..formats import Nvfp4Tensor, interleave_rows
from ..ops import elementwise as ew_ops
from ..ops import moe as moe_ops
from ..ops import quant as quant_ops
from ..reference import fp32
from ..reference import moe as moe_ref
from ..reference.elementwise import token_rows
from ..reference.quant import has_nonfinite
from ..runtime import arrays, status, workspace
from ..runtime.workspace import zeros_outside_capture
from .shared_expert import SharedExpert

SCORE_FUNCS = moe_ref.SCORE_FUNCS
#: T * top_k up to which a call takes the small-T path (two GEMV launches over the (token, slot)
#: assignments, no dispatch) instead of the expert-sorted grouped GEMMs. H200, W4A4, graph-replayed:
#: V4-Flash 86 vs 101 us at T = 1, 266 vs 275 at T = 8; V3 131 vs 160 at T = 1, 512 vs 530 at T = 8
#: (top-8: 64 assignments); at T = 16 about equal (an expert picked twice is streamed twice)
SMALL_MAX_ASSIGNMENTS = 64
#: on the small-T path, a `SharedExpert` rides in the two launches as one more expert that every
#: token selects, instead of its own launches (gate_up, SwiGLU + quantize, down) -- up to
#: `FOLD_SHARED_MAX_TOKENS` tokens and while the routed slots and the shared one fit the 8 warps of
#: a down-projection block. Its gate|up blocks take 8 tokens each (one per MMA column), so its
#: gate|up weights are streamed once per 8 tokens; its down weights once per token (from L2 after
#: the first). H200, V4-Flash, graph-replayed (scripts/fold_probe.py), apart -> folded: W4A16
#: 64.8 -> 50.4 us at T = 1, 94.4 -> 78.8 at T = 2, 142.6 -> 140.5 at T = 4, 199.8 -> 186.9 at
#: T = 6, 238.1 -> 227.4 at T = 8; W4A4 78.3 -> 61.5, 110.5 -> 93.0, 163.1 -> 157.3, 223.1 ->
#: 207.9, 263.5 -> 251.3.
#: (With one block per token it lost at T = 8: W4A4 266 -> 281.) V3 (top-8: 9 slots) never folds.
FOLD_SHARED = True
FOLD_SHARED_MAX_TOKENS = 8
#: W4A4 on the small-T path in three launches: the router launch writes each token's max |x|, the
#: gate|up launch quantizes the input in its blocks (the global amax from those maxima, the
#: quantize kernels' recipe bit for bit) and writes each block's max |SwiGLU output|, the down
#: launch quantizes its rows likewise; instead of a quantize launch before each GEMV launch. Up to
#: this many tokens: H200, W4A4, V4-Flash, T = 1 74.1 -> 74.9 us (7 -> 3 launches); T = 2 103 -> 107,
#: T = 4 166 -> 175 (the blocks repeat the quantization of the input rows they read). Not with a
#: shared expert run apart (V3, top-8: 147 us in-block, 131-138 with the launches in the run before)
QUANTIZE_IN_BLOCKS_MAX_TOKENS = 1
#: where those three launches quantize at T = 1: True, once each in the last block to finish of
#: the launch before (the router's quantizes x, the gate|up launch's its SwiGLU output: the
#: quantize launches' output bit for bit), read by NVFP4-activation GEMV launches; False, in every
#: block of the launch that reads them. H100, V4-Flash W4A4 T = 1, same run, bit-identical: the
#: layer 64.58 -> 63.68 us (three interleaved rounds; quantize launches apart 65.88); by kernel
#: (traced) router 10.6 -> 8.6, down 23.7 -> 18.6, but gate|up 30.7 -> 36.2: its last block
#: encoded the 7 rows (896 blocks of 16) with 128 threads, one L2 round trip per block of 16 each.
#: Since then the gate|up launch's last 8 blocks share that encoding (`fp4kit.ops.moe.LAST_QUANTIZE_SPREAD`:
#: the layer 62.4 -> 60.3 us, H100)
QUANTIZE_IN_LAST_BLOCK = True
#: W4A16 on the small-T path with the shared expert folded in: the router launch releases the
#: gate|up launch right after its own wait (its grid a single wave), and the shared expert's gate|up
#: blocks, first in launch order, run whole while the router works (`fp4kit.ops.moe.small_gate_up`
#: ``shared_first``): the router's serial tail (the last block's scores and top-k) leaves the memory
#: system idle, and the routed blocks then stream one expert's weights fewer. Same bits either way.
SHARED_EXPERT_BESIDE_ROUTER = True
#: W4A16 on the expert-sorted path with a fused W13: SwiGLU (+ clamp, + routing weight) computed in
#: the gate|up grouped GEMM's epilogue (moe.cu ``moe_gemm_swiglu_bf16_*``, bit for bit the GEMM's
#: bf16 output through the SwiGLU kernel) instead of writing ``h [pairs, 2I]`` and a SwiGLU launch:
#: one launch per layer fewer, and h's write and read gone (V4-Flash at T = 4096: 2 x 200 MB).
#: H100, same run: the V4-Flash layer at T = 64 1036 -> 1025 us, T = 512 1979 -> 1979; the decode step
#: at batch 32 3.625 -> 3.61 ms (two rounds)
GROUPED_SWIGLU_EPILOGUE = True
#: on the expert-sorted path with the SwiGLU epilogue, a `SharedExpert` (W4A16, this layer's widths,
#: no biases) rides in the two grouped GEMMs as one more expert on sorted rows T * top_k .. + T - 1
#: (its own weights, clamp and no routing weight; 8T-row passes of its rows on block rows of their
#: own) and in the combine, instead of its own three launches (gate|up, SwiGLU, down). Changes
#: nothing but its GEMMs' summation order. Its weights are streamed once per pass, so only up to
#: `GROUPED_FOLD_SHARED_MAX_TOKENS` tokens. H100, the decode step at batch 32 (T = 32 per layer)
#: 3.61 -> 3.565 ms (two rounds); with the dispatch and the combine fused too, the V4-Flash layer
#: at T = 64 1025 -> 1034 us and at T = 512 1979 -> 2106
GROUPED_FOLD_SHARED = True
GROUPED_FOLD_SHARED_MAX_TOKENS = 32
#: the expert-sorted path's dispatch run by the router's last block instead of a launch of its own,
#: up to this many (token, slot) pairs (0: never). The dispatch is one block either way; the
#: router's blocks are 256 threads against the dispatch's 1024, so its loop over the pairs takes
#: four times the turns above 256 pairs, so up to 256. H100, the decode step at batch 32 (192 pairs
#: per layer): 3.565 -> 3.56 ms (two rounds), one launch per layer fewer
ROUTER_DISPATCH_MAX_PAIRS = 256
#: the expert-sorted path's combine in the down projection's grouped GEMM (moe.cu
#: ``moe_gemm_combine_*``): the block whose rows complete a token's slots (per column group of 128)
#: adds them in slot order, bit for bit `moe_combine`, instead of a launch of its own. Off: H100,
#: the decode step at batch 32 3.56 -> 3.585 ms (two rounds, both slower), one launch per layer fewer
GROUPED_COMBINE_IN_GEMM = False
#: a call with ``then_norm`` on the expert-sorted path runs the residual step
#: (`fp4kit.ops.elementwise.add_rmsnorm`) in each token's block of the combine instead of a launch of
#: its own (the same bits): one launch per layer fewer. H100, the decode step at batch 32 (every layer
#: on the sorted path): 69 -> 65 kernels, 3567 -> 3550 / 3565 us (two runs; within the noise). Not on
#: the small-T path: run by the down launch's last block of each token (a per-token arrival counter,
#: the next kernel released first) the step was slower than its own launch, +4 us a step at batch 1
#: on the H100 and +8 on the H200, equal at batch 8 (the arrival's round trip and the tail it adds
#: to the launch outweigh the launch it saves). False: the step's own launch on every path
FUSE_RESIDUAL_NORM = True


def check_token_ids(token_ids, x, tid2eid):
    """The token ids hash routing needs: int32 ``[T]`` beside ``x [T, H]`` (None without hashing).

    An id outside ``[0, vocab)`` is not an error here (device ids are never read on the host): it
    routes like token 0 and records `fp4kit.runtime.status.TOKEN_RANGE` (on the host for numpy ids).
    """
    if tid2eid is None:
        return token_ids
    if token_ids is None:
        raise ValueError("token_ids: hash routing needs the token ids of x")
    token_ids = arrays.as_array(token_ids, "token_ids")
    if tuple(token_ids.shape) != (x.shape[0],) or token_ids.dtype != np.int32:
        raise ValueError(f"token_ids: expected int32 [{x.shape[0]}], got {arrays.describe(token_ids)}")
    arrays.check_same_device(x=x, token_ids=token_ids)
    if not arrays.is_device_array(token_ids) and token_rows(token_ids, len(tid2eid))[1]:
        status.record_host(status.TOKEN_RANGE)
    return token_ids


@dataclass
class ExpertStack:
    """NVFP4 weights of E experts, ``[E, N, K]`` logically.

    ``packed`` uint8 ``[E, N, K/2]``; ``block_scales`` uint8 ``[E, N, K/16]`` (``layout="linear"``),
    or each expert in the tiled GEMM layout, ``[E, tiled bytes]`` (``layout="tiled"``, see
    `to_tiled`; ``nk`` then holds ``(N, K)``); ``global_scale`` fp32 ``[E]`` (encode scales);
    ``decode`` fp32 ``[E]`` = ``fp32(1 / S_e)``; ``row_decode`` fp32 ``[E, N]`` or None (overrides
    ``decode`` row by row).
    """

    packed: object
    block_scales: object
    global_scale: object
    decode: object
    row_decode: object = None
    layout: str = "linear"
    nk: tuple | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        if self.layout == "tiled":
            return (self.packed.shape[0], *self.nk)
        e, n, half_k = self.packed.shape
        return e, n, 2 * half_k

    def to_tiled(self) -> "ExpertStack":
        """The stack in the tiled GEMM layout the grouped expert GEMM reads (exact; `to_linear`
        undoes it). Done once when a device layer is built; the tiled stack replaces this one."""
        if self.layout == "tiled":
            return self
        shape = self.shape
        return dataclasses.replace(self, packed=formats.tile_codes(self.packed, shape),
                                   block_scales=formats.tile_scales(self.block_scales, shape), layout="tiled",
                                   nk=shape[1:])

    def to_linear(self) -> "ExpertStack":
        """The checkpoint layout: codes ``[E, N, K/2]``, linear scales ``[E, N, K/16]``."""
        if self.layout == "linear":
            return self
        shape = self.shape
        return dataclasses.replace(self, packed=formats.untile_codes(self.packed, shape),
                                   block_scales=formats.untile_scales(self.block_scales, shape), layout="linear",
                                   nk=None)

    @classmethod
    def from_tensors(cls, experts: list[Nvfp4Tensor], row_decode=None) -> "ExpertStack":
        """Stack per-expert `Nvfp4Tensor` ``[N, K]`` (host or device, linear scales)."""
        if not experts:
            raise ValueError("experts: expected at least one expert")
        shape = experts[0].shape
        for i, q in enumerate(experts):
            if not isinstance(q, Nvfp4Tensor) or q.shape != shape or q.scale_layout != "linear":
                raise ValueError(f"experts[{i}]: expected an Nvfp4Tensor of shape {shape} with linear scales")
        xp = arrays.array_module(experts[0].packed)
        s = xp.stack([q.global_scale.reshape(()) for q in experts]).astype(np.float32)
        decode = fp32.div(np.float32(1), s) if xp is np else (1 / s).astype(np.float32)
        return cls(xp.stack([q.packed for q in experts]), xp.stack([q.block_scales for q in experts]), s, decode,
                   row_decode)

    @classmethod
    def fuse_gate_up(cls, w1: "ExpertStack", w3: "ExpertStack") -> "ExpertStack":
        """W13 from separately quantized W1 (gate) and W3 (up) ``[E, I, H]``: rows interleaved in
        chunks of 16, every byte kept, a decode factor per row (exact with different scales)."""
        if w1.shape != w3.shape:
            raise ValueError(f"w1/w3: expected equal shapes, got {w1.shape} and {w3.shape}")
        if w1.layout != "linear" or w3.layout != "linear":
            raise ValueError("w1/w3: fuse linear stacks (to_linear()), then tile the fused one")
        xp = arrays.array_module(w1.packed)

        def row_decode(stack, e):
            return None if stack.row_decode is None else stack.row_decode[e]

        fused = [formats.fuse_rows([w1.expert(e), w3.expert(e)], "interleaved",
                                   row_decodes=[row_decode(w1, e), row_decode(w3, e)]) for e in range(w1.shape[0])]
        return cls(xp.stack([f.packed for f, _ in fused]), xp.stack([f.block_scales for f, _ in fused]),
                   w1.global_scale.copy(), w1.decode.copy(), xp.stack([d for _, d in fused]))

    def expert(self, e: int) -> Nvfp4Tensor:
        """Expert ``e`` as an `Nvfp4Tensor` (views)."""
        _, n, k = self.shape
        return Nvfp4Tensor(self.packed[e], self.block_scales[e], self.global_scale[e].reshape(()), self.layout, (n, k))


@dataclass
class RoutingConfig:
    top_k: int
    score_func: str = "sqrtsoftplus"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scale: float = 1.0

    def __post_init__(self):
        # what can be checked without the expert count (`MoE` checks the rest)
        for name in ("top_k", "n_group", "topk_group"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise TypeError(f"{name}: expected a positive int, got {type(v).__name__} {v!r}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {self.score_func!r}")
        r = self.routed_scale
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not (np.isfinite(r) and r > 0):
            raise ValueError(f"routed_scale: expected a positive finite number, got {r!r}")


@dataclass
class _Plan:
    """Device buffers of one forward pass for T tokens (those of the path T takes; the others None)."""

    logits: object
    ids: object
    weights: object
    x_act: object
    out: object
    h_act: object
    tickets: object = None
    offsets: object = None
    active: object = None
    num_active: object = None
    slot_row: object = None
    row_token: object = None
    row_weight: object = None
    h: object = None
    y: object = None
    h_f32: object = None  # the small-T path's SwiGLU output before the W4A4 quantize
    hs_act: object = None  # the folded shared expert's down-projection input (W4A4)
    fold: bool = False  # the shared expert rides in the layer's launches (`MoE._folds_shared`)
    done: object = None  # the small-T router's per-token block counters (zero between calls)
    x_amax: object = None  # W4A4 quantized in the blocks: per-token max |x| (fp32 bits)
    h_amax: object = None  # ... and per first-launch block max |SwiGLU output|
    h_done: object = None  # W4A4 quantized by last blocks: the gate|up launch's arrival counter
    arrivals: object = None  # the sorted path's combine in the down GEMM: arrivals per (token, column group)


def _shared_intermediate(name: str, shape: tuple, dtype):
    """A view of ``shape`` into the expert-sorted path's intermediate ``name`` (gate|up output,
    SwiGLU output, expert outputs), one buffer for every MoE layer on this device and stream: each
    is written and read within one call, and at a 4096-token prefill of V4-Flash widths they hold
    ~0.7 GB, which one buffer per layer and token count would hold per layer. The buffer grows for
    a larger call and keeps the one it outgrew (`workspace.capturable_buffer`), so a captured
    graph still points at live memory."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return workspace.capturable_buffer("moe." + name, nbytes)[:nbytes].view(dtype).reshape(shape)


class MoE:
    """DeepSeek MoE layer with NVFP4 routed experts (see the module docstring).

    Parameters
    ----------
    gate_weight : bf16 or fp32 ``[E, H]``
        Router weight (kept in high precision).
    w13 : ExpertStack ``[E, 2I, H]``
        Gate and up, rows interleaved in chunks of 16 (fused SwiGLU). For the unfused path pass
        ``w1`` and ``w3`` (``[E, I, H]`` each) instead.
    w2 : ExpertStack ``[E, H, I]``
    routing : RoutingConfig
    bias : fp32 ``[E]``, optional — selection-only (noaux) bias
    tid2eid : int32 ``[vocab, top_k]``, optional — hash routing (``token_ids`` required per call)
    limit : float, optional — V4 ``swiglu_limit``
    weight_before_down : bool — V4 applies the routing weight before W2 (True); V3 after (False)
    mode : "w4a4" or "w4a16"
    shared : callable ``[T, H] -> [T, H]`` bf16, optional (e.g. a `SharedExpert`)
    """

    def __init__(self, gate_weight, w2: ExpertStack, routing: RoutingConfig, *, w13: ExpertStack | None = None,
                 w1: ExpertStack | None = None, w3: ExpertStack | None = None, bias=None, tid2eid=None,
                 limit: float | None = None, weight_before_down: bool = True, mode: str = "w4a4", shared=None):
        self.gate_weight = arrays.as_array(gate_weight, "gate_weight")
        if self.gate_weight.ndim != 2 or self.gate_weight.shape[0] != w2.shape[0]:
            raise ValueError(f"gate_weight: expected [experts, hidden] with {w2.shape[0]} experts (w2 is [E, H, I] = "
                             f"{w2.shape}), got shape {tuple(self.gate_weight.shape)}")
        e, h = self.gate_weight.shape
        if (w13 is None) == (w1 is None or w3 is None):
            raise ValueError("w13: pass either the fused w13 or both w1 and w3")
        inner = w2.shape[2]
        if w13 is not None and w13.shape != (e, 2 * inner, h):
            raise ValueError(f"w13: expected shape {(e, 2 * inner, h)}, got {w13.shape}")
        for name, st in (("w1", w1), ("w3", w3)):
            if st is not None and st.shape != (e, inner, h):
                raise ValueError(f"{name}: expected shape {(e, inner, h)}, got {st.shape}")
        if w2.shape != (e, h, inner):
            raise ValueError(f"w2: expected shape {(e, h, inner)} (experts, hidden, inner), got {w2.shape}")
        _check_routing(routing, e)
        if h % 16 or inner % 16:
            raise ValueError(f"hidden and inner sizes must be multiples of 16, got hidden={h}, inner={inner}")
        if mode not in ("w4a4", "w4a16"):
            raise ValueError(f"mode: expected 'w4a4' or 'w4a16', got {mode!r}")
        quant_ops.check_limit(limit)
        _check_shared(shared, h)
        if tid2eid is not None:
            tid2eid = arrays.as_array(tid2eid, "tid2eid")
            host = np.asarray(tid2eid.get() if arrays.is_device_array(tid2eid) else tid2eid)  # once, at construction
            if tid2eid.ndim != 2 or tid2eid.shape[1] != routing.top_k or tid2eid.dtype != np.int32:
                raise ValueError(f"tid2eid: expected int32 [vocab, {routing.top_k}], got {arrays.describe(tid2eid)}")
            if host.size and (host.min() < 0 or host.max() >= e):
                raise ValueError(f"tid2eid: expert ids must lie in [0, {e}), got [{host.min()}, {host.max()}]")
        if bias is not None:
            bias = arrays.as_array(bias, "bias")
            if tuple(bias.shape) != (e,) or bias.dtype != np.float32:
                raise ValueError(f"bias: expected float32 [{e}], got {arrays.describe(bias)}")
        arrays.check_same_device(gate_weight=self.gate_weight, w2=w2.packed, bias=bias, tid2eid=tid2eid)
        if self.gate_weight.dtype not in (arrays.BF16, np.dtype(np.float32)):
            raise TypeError(f"gate_weight: expected bfloat16 or float32, got {self.gate_weight.dtype}")
        if arrays.is_device_array(w2.packed):  # the grouped GEMM reads the tiled layout; it replaces the linear one
            w13, w1, w3, w2 = (st.to_tiled() if isinstance(st, ExpertStack) else st for st in (w13, w1, w3, w2))
        self.w13, self.w1, self.w3, self.w2 = w13, w1, w3, w2
        self.routing, self.bias, self.tid2eid = routing, bias, tid2eid
        self.limit, self.weight_before_down, self.mode, self.shared = limit, weight_before_down, mode, shared
        self.num_experts, self.hidden, self.inner = e, h, inner
        self._plans = workspace.BufferCache()  # one plan per token count and path
        self._counts = None
        self._dispatch_done = None  # the router's arrival counter when it runs the dispatch
        #: the small-T path (`SMALL_MAX_ASSIGNMENTS`) up to this many (token, slot) assignments
        self.small_max_assignments = SMALL_MAX_ASSIGNMENTS
        #: the small-T launches run a `SharedExpert` as one more expert (`_folds_shared`)
        self.fold_shared = FOLD_SHARED
        #: W4A4 on the small-T path quantizes inside the two GEMV launches up to this many tokens
        #: (`QUANTIZE_IN_BLOCKS_MAX_TOKENS`)
        self.quantize_in_blocks_max_tokens = QUANTIZE_IN_BLOCKS_MAX_TOKENS

    @property
    def fused(self) -> bool:
        return self.w13 is not None

    @classmethod
    def from_float(cls, gate_weight, w1, w3, w2, routing: RoutingConfig, *, fused: bool = True, **kwargs) -> "MoE":
        """Quantize per-expert float weights ``w1, w3 [E, I, H]``, ``w2 [E, H, I]`` (on the GPU for
        device arrays), one global scale per expert and matrix (W13 shares one per expert)."""
        w1, w3, w2 = (arrays.as_array(w, n) for w, n in ((w1, "w1"), (w3, "w3"), (w2, "w2")))
        if w1.ndim != 3 or w1.shape[1] % 16 or w1.shape[2] % 16:
            raise ValueError(f"w1: expected [experts, inner, hidden] with inner and hidden multiples of 16, "
                             f"got shape {tuple(w1.shape)}")
        if w3.shape != w1.shape:
            raise ValueError(f"w3: expected the shape of w1 {tuple(w1.shape)}, got {tuple(w3.shape)}")
        e, i, h = w1.shape
        if tuple(w2.shape) != (e, h, i):
            raise ValueError(f"w2: expected [experts, hidden, inner] = {(e, h, i)}, got {tuple(w2.shape)}")
        if fused:
            w13 = ExpertStack.from_tensors([quant_ops.quantize(interleave_rows(w1[i], w3[i])) for i in range(e)])
            parts = {"w13": w13}
        else:
            parts = {"w1": ExpertStack.from_tensors([quant_ops.quantize(w1[i]) for i in range(e)]),
                     "w3": ExpertStack.from_tensors([quant_ops.quantize(w3[i]) for i in range(e)])}
        w2s = ExpertStack.from_tensors([quant_ops.quantize(w2[i]) for i in range(e)])
        return cls(gate_weight, w2s, routing, **parts, **kwargs)

    @classmethod
    def from_checkpoint(cls, checkpoint, prefix: str, routing: RoutingConfig, *, num_experts: int,
                        gate: str = "gate.weight", bias: str | None = None,
                        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), fused: bool = True,
                        **kwargs) -> "MoE":
        """The MoE ``prefix`` of a loaded `fp4kit.checkpoint.Checkpoint` (host or device).

        Experts are ``{prefix}.experts.{i}.{gate|up|down}`` (``names``; the official DeepSeek
        names are ``("w1", "w3", "w2")``) in the ModelOpt NVFP4 layout, each with its own global
        scale; they are stacked into the layer's buffers, and gate and up are fused exactly (a
        decode factor per row, no re-quantization). The router weight ``{prefix}.{gate}`` and the
        optional selection bias ``{prefix}.{bias}`` are unquantized tensors of the checkpoint.
        """
        gate_weight, w2, parts, sel_bias = checkpoint_parts(checkpoint, prefix, range(num_experts), gate=gate, bias=bias,
                                                            names=names, fused=fused)
        return cls(gate_weight, w2, routing, bias=sel_bias, **parts, **kwargs)

    def route(self, x, token_ids=None):
        """Expert ids ``[T, top_k]`` and routing weights ``[T, top_k]`` (numpy inputs: the reference)."""
        x = arrays.as_array(x, "x")
        if not arrays.is_device_array(x):
            return moe_ref.route(x, self.gate_weight, bias=self.bias, tid2eid=self.tid2eid, token_ids=token_ids,
                                 **vars(self.routing))
        plan = self._plan(x)
        self._route_device(x, token_ids, plan)
        return plan.ids, plan.weights

    def __call__(self, x, token_ids=None, *, then_norm: ew_ops.ResidualNorm | None = None):
        """``[T, H]`` (bf16 or fp32) to ``[T, H]`` bf16. On the device the result is a buffer owned by
        the layer (one per T), overwritten by the next call with the same T.

        ``then_norm`` (`fp4kit.ops.elementwise.ResidualNorm`): the call returns
        ``add_rmsnorm(then_norm.resid, moe(x), then_norm.weight)`` instead (``resid`` updated in place,
        the result a new bf16 array); on the expert-sorted path in the layer's last launch
        (`FUSE_RESIDUAL_NORM`): the next layer's input without a launch of its own."""
        x = arrays.as_array(x, "x")
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x: expected [tokens, {self.hidden}], got shape {tuple(x.shape)}")
        if x.dtype not in (arrays.BF16, np.dtype(np.float32)):
            raise TypeError(f"x: expected bfloat16 or float32, got {x.dtype}")
        arrays.check_contiguous("x", x)
        token_ids = check_token_ids(token_ids, x, self.tid2eid)
        if then_norm is not None:
            then_norm = ew_ops.check_residual_norm(then_norm, x.shape[0], self.hidden)
            arrays.check_same_device(x=x, resid=then_norm.resid)
        if x.shape[0] == 0 or not arrays.is_device_array(x):
            if x.shape[0] == 0:  # no tokens: an empty result, as quantize gives for an empty tensor
                y = arrays.array_module(x).empty((0, self.hidden), arrays.BF16)
            else:
                y = self._forward_reference(x, token_ids)
            return y if then_norm is None else ew_ops.add_rmsnorm(then_norm.resid, y, then_norm.weight,
                                                                  eps=then_norm.eps)
        if then_norm is None:
            return self._forward_device(x, token_ids, None)
        out = self._forward_device(x, token_ids, then_norm if FUSE_RESIDUAL_NORM else None)
        if out is self._plan(x).out:  # the layer's own output: its last launch did not take the step
            out = ew_ops.add_rmsnorm(then_norm.resid, out, then_norm.weight, eps=then_norm.eps)
        return out

    # -- numpy reference --------------------------------------------------------------------------
    def _experts(self, stack: ExpertStack):
        return [stack.expert(i) for i in range(self.num_experts)]

    def _forward_reference(self, x, token_ids):
        if has_nonfinite(x):  # what Linear's quantizer records, in either mode
            status.record_host(status.NONFINITE_INPUT)
        ids, weights = moe_ref.route(x, self.gate_weight, bias=self.bias, tid2eid=self.tid2eid, token_ids=token_ids,
                                     **vars(self.routing))
        if self.fused:
            w13, layout, row_decode = self._experts(self.w13), "interleaved", self.w13.row_decode
        else:
            (w13, row_decode), layout = _concat_experts(self.w1, self.w3), "concatenated"
        y = moe_ref.moe(x, ids, weights, w13, self._experts(self.w2), limit=self.limit,
                        weight_before_down=self.weight_before_down, mode=self.mode, layout=layout,
                        w13_row_decode=row_decode)
        if self.shared is not None:
            y = y + np.asarray(self.shared(x.astype(moe_ref.BF16) if x.dtype != moe_ref.BF16 else x)).astype(np.float32)
        return y.astype(moe_ref.BF16)

    # -- device -------------------------------------------------------------------------------------
    def _plan(self, x) -> _Plan:
        t = x.shape[0]
        return self._plans.get(self._plan_key(t), lambda: self._make_plan(x))

    def _plan_key(self, t: int) -> tuple:
        small = self._small(t)
        return (t, small, self._folds_shared(t), self._quantizes_in_blocks(t), self._quantizes_in_last_block(t),
                self._swiglu_in_gemm(t), GROUPED_COMBINE_IN_GEMM and not small)

    def routed_ids(self, tokens: int):
        """The device expert ids ``[tokens, top_k]`` written by the last device call over ``tokens``
        tokens with the layer's current settings (None if there was none); reading them is the
        caller's host sync."""
        plan = self._plans.peek(self._plan_key(tokens))
        return None if plan is None else plan.ids

    def _small(self, t: int) -> bool:
        return t * self.routing.top_k <= self.small_max_assignments

    def _swiglu_in_gemm(self, t: int) -> bool:
        """Whether the sorted path computes SwiGLU in the gate|up GEMM's epilogue for ``t`` tokens
        (`GROUPED_SWIGLU_EPILOGUE`: W4A16 with a fused W13)."""
        return GROUPED_SWIGLU_EPILOGUE and self.mode == "w4a16" and self.fused and not self._small(t)

    def _make_plan(self, x) -> _Plan:
        t = x.shape[0]
        import cupy

        k, e, h, i = self.routing.top_k, self.num_experts, self.hidden, self.inner
        pairs = t * k
        w4a4 = self.mode == "w4a4"

        def nvfp4(rows, cols):
            return Nvfp4Tensor(cupy.empty((rows, cols // 2), np.uint8), cupy.empty((rows, cols // 16), np.uint8),
                               cupy.empty((), np.float32), "linear", (rows, cols))

        small = self._small(t)
        fold = self._folds_shared(t)
        rows = pairs + (t if fold else 0)  # the folded shared expert's rows follow the routed ones
        # the in-block quantization reads the raw rows; quantized by a last block, they are NVFP4 tensors
        last_block = self._quantizes_in_last_block(t)
        in_blocks = self._quantizes_in_blocks(t) and not last_block
        common = dict(logits=cupy.empty((t, e), np.float32), ids=cupy.empty((t, k), np.int32),
                      weights=cupy.empty((t, k), np.float32), x_act=nvfp4(t, h) if w4a4 and not in_blocks else None,
                      h_act=None if in_blocks else nvfp4(pairs, i) if w4a4 else
                      cupy.empty((rows if small else pairs, i), arrays.BF16),
                      out=cupy.empty((t, h), arrays.BF16))
        if small:
            return _Plan(**common, h_f32=cupy.empty((rows, i), np.float32) if w4a4 else None,
                         hs_act=nvfp4(t, i) if w4a4 and fold and not in_blocks else None, fold=fold,
                         done=zeros_outside_capture(t, np.uint32),
                         x_amax=cupy.empty(t, np.uint32) if in_blocks else None,
                         # a word per gate|up block: its max |SwiGLU output|, for either quantization
                         h_amax=cupy.empty(-(-i // 16) * rows, np.uint32) if in_blocks or last_block else None,
                         h_done=zeros_outside_capture(1, np.uint32) if last_block else None)
        if self._counts is None:
            self._counts = zeros_outside_capture(self.num_experts, np.uint32)
        if not w4a4:  # the bf16 SwiGLU output, written and read within the call: shared too
            common["h_act"] = _shared_intermediate("h_act", (rows, i), arrays.BF16)
        # a folded shared expert's sorted rows (after the routed ones) take their tokens in order;
        # the dispatch writes only the routed rows' tokens
        row_token = (workspace.made_outside_capture(lambda: cupy.concatenate(
            [cupy.zeros(pairs, np.uint32), cupy.arange(t, dtype=np.uint32)])) if fold else cupy.empty(pairs, np.uint32))
        return _Plan(
            **common, tickets=cupy.empty((t, k), np.uint32), offsets=cupy.empty(e + 1, np.uint32),
            active=cupy.empty(e, np.uint32), num_active=cupy.empty(1, np.uint32),
            slot_row=cupy.empty(pairs, np.uint32), row_token=row_token,
            row_weight=cupy.empty(pairs, np.float32), fold=fold,
            arrivals=zeros_outside_capture(t * moe_ops.combine_column_groups(h), np.uint32)
            if GROUPED_COMBINE_IN_GEMM else None,
            h=None if self._swiglu_in_gemm(t) else _shared_intermediate("h", (pairs, 2 * i), arrays.BF16),
            y=_shared_intermediate("y", (rows, h), np.float32))

    def _route_device(self, x, token_ids, plan: _Plan) -> None:
        if plan.tickets is None:  # the small-T path: ids and weights only, one launch
            moe_ops.route_small(x, self.gate_weight, self.bias, token_ids, self.tid2eid, self.routing, plan.ids,
                                plan.weights, plan.logits, plan.done, None)
            return
        in_router = plan.ids.size <= ROUTER_DISPATCH_MAX_PAIRS
        if in_router and self._dispatch_done is None:
            self._dispatch_done = zeros_outside_capture(1, np.uint32)
        moe_ops.route(x, self.gate_weight, self.bias, token_ids, self.tid2eid, self.routing, plan.ids, plan.weights,
                      self._counts, plan.tickets, plan.logits,
                      dispatch_into=(plan, self._dispatch_done) if in_router else None)
        if not in_router:
            moe_ops.dispatch(self._counts, plan.tickets, plan.ids, plan.weights, self.routing.top_k, plan)

    def _forward_device(self, x, token_ids, then_norm):
        """The layer's launches; ``then_norm`` (a `ResidualNorm`) or None: the residual step in the
        combine of the sorted path, which then returns the RMSNorm (else the layer's output)."""
        plan = self._plan(x)
        if self.mode == "w4a16" and x.dtype != arrays.BF16:
            raise TypeError("x: mode 'w4a16' takes bfloat16 input")
        if plan.tickets is None:
            return self._forward_small(x, token_ids, plan)
        self._route_device(x, token_ids, plan)
        act = quant_ops.quantize(x, out=plan.x_act) if self.mode == "w4a4" else x
        rows = moe_ops.grouped_pass_rows(x.shape[0], self.routing.top_k, self.num_experts, self.mode == "w4a4")
        row_scale = plan.row_weight if self.weight_before_down else None
        if plan.h is None:  # SwiGLU in the gate|up GEMM's epilogue (`_swiglu_in_gemm`)
            sh, pairs, t = self.shared, plan.slot_row.size, x.shape[0]
            dense = (sh.gate_up.weight, sh.gate_up.row_decode, pairs, t, sh.limit) if plan.fold else None
            moe_ops.grouped_gemm(act, self.w13, plan.h_act, plan=plan, gather=True, max_rows=rows,
                                 swiglu=(row_scale, self.limit), dense=dense)
            return self._down_and_combine(x, act, plan, plan.h_act, rows, then_norm)
        if self.fused:
            moe_ops.grouped_gemm(act, self.w13, plan.h, plan=plan, gather=True, max_rows=rows)
            layout = "interleaved"
        else:
            moe_ops.grouped_gemm(act, self.w1, plan.h, plan=plan, gather=True, max_rows=rows)
            moe_ops.grouped_gemm(act, self.w3, plan.h, plan=plan, gather=True, out_col=self.inner, max_rows=rows)
            layout = "concatenated"
        if self.mode == "w4a4":
            h_act = quant_ops.swiglu_quantize(plan.h, layout=layout, limit=self.limit, row_scale=row_scale,
                                              out=plan.h_act)
        else:
            h_act = quant_ops.swiglu(plan.h, layout=layout, limit=self.limit, row_scale=row_scale, out=plan.h_act)
        return self._down_and_combine(x, act, plan, h_act, rows, then_norm)

    def _down_and_combine(self, x, act, plan: _Plan, h_act, rows: int, then_norm):
        """The sorted path after SwiGLU: the shared expert (run apart, or as one more expert of the
        down GEMM whose rows the combine adds last), the down projection's grouped GEMM and the
        combine back to token order (in the down GEMM with `GROUPED_COMBINE_IN_GEMM`, which takes no
        residual step), then the residual step (``then_norm``) in the combine."""
        pairs, t, sh = plan.slot_row.size, x.shape[0], self.shared
        dense = (sh.down.weight, sh.down.row_decode, pairs, t, None) if plan.fold else None
        shared = None if plan.fold else self._shared(x, act)  # before the down GEMM, whose blocks may combine
        weighted = not self.weight_before_down
        if plan.arrivals is not None:
            moe_ops.grouped_gemm(h_act, self.w2, plan.y, plan=plan, gather=False, max_rows=rows, dense=dense,
                                 combine=(plan.arrivals, weighted, shared, plan.fold, plan.out))
            return plan.out
        moe_ops.grouped_gemm(h_act, self.w2, plan.y, plan=plan, gather=False, max_rows=rows, dense=dense)
        # the RMSNorm's output made just before the combine that writes it, as its own launch would
        normed = None if then_norm is None else arrays.array_module(plan.out).empty_like(plan.out)
        moe_ops.combine(plan.y, plan.slot_row, plan.weights, weighted, shared, plan.out,
                        shared_rows=plan.y[pairs:] if plan.fold else None,
                        then_norm=None if then_norm is None else (then_norm, normed))
        return plan.out if normed is None else normed

    def _shared(self, x, act):
        """The shared expert's output; a W4A4 `SharedExpert` with a dynamic input scale reuses the
        layer's quantized input (the same bits its own quantize would give)."""
        if self.shared is None:
            return None
        if (isinstance(self.shared, SharedExpert) and self.mode == "w4a4" and self.shared.mode == "w4a4"
                and self.shared.gate_up.input_scale is None):
            return self.shared(x, x_act=act)
        return self.shared(x)

    def _quantizes_in_blocks(self, t: int) -> bool:
        """Whether W4A4 on the small-T path quantizes inside the GEMV launches for ``t`` tokens: up to
        `quantize_in_blocks_max_tokens`, and only with no shared expert or a folded one (one run
        apart needs the quantized input anyway, so the in-block quantization would save no launch)."""
        return (self.mode == "w4a4" and self._small(t) and t <= self.quantize_in_blocks_max_tokens
                and (self.shared is None or self._folds_shared(t)))

    def _quantizes_in_last_block(self, t: int) -> bool:
        """Whether the in-block quantization for ``t`` tokens (`_quantizes_in_blocks`) runs once in
        the last block of the launch before instead (`QUANTIZE_IN_LAST_BLOCK`: one token, a hidden
        width the router's block quantizes)."""
        return (QUANTIZE_IN_LAST_BLOCK and t == 1 and self._quantizes_in_blocks(t)
                and self.hidden <= moe_ops.ROUTER_QUANTIZE_MAX_HIDDEN and self.hidden % 16 == 0)

    def _folds_shared(self, t: int) -> bool:
        """Whether the launches for ``t`` tokens run the shared expert as one more expert: on the
        small-T path where `fold_shared_pays` for ``t`` and top-k (`FOLD_SHARED`), on the sorted
        path with `GROUPED_FOLD_SHARED`, up to `GROUPED_FOLD_SHARED_MAX_TOKENS` tokens and with the
        SwiGLU epilogue (W4A16); and the shared expert is a
        `SharedExpert` in the layer's mode with this layer's widths, no biases and (W4A4) dynamic
        input scales, so that folding it in changes nothing but the summation order of its GEMMs."""
        if self._small(t):
            pays = self.fold_shared and fold_shared_pays(t, self.routing.top_k)
        else:
            pays = GROUPED_FOLD_SHARED and t <= GROUPED_FOLD_SHARED_MAX_TOKENS and self._swiglu_in_gemm(t)
        sh = self.shared
        if not (pays and isinstance(sh, SharedExpert) and sh.mode == self.mode):
            return False
        gate_up, down = sh.gate_up, sh.down
        return (gate_up.bias is None and down.bias is None and gate_up.in_features == self.hidden
                and down.in_features == self.inner and arrays.is_device_array(gate_up.weight.packed)
                and (self.mode == "w4a16" or (gate_up.input_scale is None and down.input_scale is None)))

    def _forward_small(self, x, token_ids, plan: _Plan):
        """The router in one launch, then two GEMV launches over the (token, slot) assignments:
        gate|up + SwiGLU, then down + weighted combine + the shared expert, which rides along as
        one more expert (`_folds_shared`) or runs on its own. W4A4 quantizes the input and the
        SwiGLU output in the last block to finish of the launch before the one that reads them
        (`_quantizes_in_last_block`), inside the GEMV launches (`_quantizes_in_blocks`, from the
        previous launch's maxima) or with launches of their own. W4A16 runs a folded shared
        expert's gate|up beside the router (`SHARED_EXPERT_BESIDE_ROUTER`)."""
        last_block = plan.h_done is not None
        # W4A16 (so no in-block or last-block quantization of the input) with the shared expert folded
        beside = SHARED_EXPERT_BESIDE_ROUTER and plan.fold and self.mode == "w4a16"
        released = moe_ops.route_small(x, self.gate_weight, self.bias, token_ids, self.tid2eid, self.routing,
                                       plan.ids, plan.weights, plan.logits, plan.done, plan.x_amax,
                                       plan.x_act if last_block else None, release_next=beside)
        if self.fused:
            gate, up = (self.w13, 2, 0), (self.w13, 2, 1)
        else:
            gate, up = (self.w1, 1, 0), (self.w3, 1, 0)
        row_scale = plan.weights if self.weight_before_down else None
        fold, sh, routed = plan.fold, self.shared, plan.ids.size
        first = (sh.gate_up.weight, sh.gate_up.row_decode, sh.limit) if fold else None
        weighted = not self.weight_before_down
        if last_block:  # W4A4 at T = 1: x and the SwiGLU output quantized by the launches' last blocks
            s_act = plan.hs_act if fold else None
            moe_ops.small_gate_up(plan.x_act, gate, up, plan.ids, row_scale, self.limit, plan.h_f32, shared=first,
                                  quantize_out=(plan.h_amax, plan.h_done, plan.h_act, s_act))
            second = (sh.down.weight, sh.down.row_decode, s_act) if fold else None
            moe_ops.small_down(plan.h_act, self.w2, plan.ids, plan.weights, weighted, None, plan.out, shared=second)
            return plan.out
        if plan.x_amax is not None:  # W4A4, quantized in the blocks
            gx, gy = moe_ops.small_gate_up(x, gate, up, plan.ids, row_scale, self.limit, plan.h_f32, shared=first,
                                           x_amax=plan.x_amax, h_amax=plan.h_amax)
            # in-block quantization implies no shared expert or a folded one (`_quantizes_in_blocks`)
            second = (sh.down.weight, sh.down.row_decode, None) if fold else None
            moe_ops.small_down(plan.h_f32, self.w2, plan.ids, plan.weights, weighted, None, plan.out,
                               shared=second, h_amax=plan.h_amax, amax_blocks=(gx * routed, gx * gy))
            return plan.out
        if self.mode == "w4a4":
            act = quant_ops.quantize(x, out=plan.x_act)
            moe_ops.small_gate_up(act, gate, up, plan.ids, row_scale, self.limit, plan.h_f32, shared=first)
            # the routed rows and the shared expert's rows, each with its own global scale
            h_act = quant_ops.quantize(plan.h_f32[:routed], out=plan.h_act)
            s_act = quant_ops.quantize(plan.h_f32[routed:], out=plan.hs_act) if fold else None
        else:
            act = x
            moe_ops.small_gate_up(act, gate, up, plan.ids, row_scale, self.limit, plan.h_act, shared=first,
                                  shared_first=released)
            h_act, s_act = plan.h_act, None
        second = (sh.down.weight, sh.down.row_decode, s_act) if fold else None
        shared_out = None if fold else self._shared(x, act)
        moe_ops.small_down(h_act, self.w2, plan.ids, plan.weights, weighted, shared_out, plan.out, shared=second)
        return plan.out


def fold_shared_pays(t: int, top_k: int) -> bool:
    """The measured rule of `FOLD_SHARED_MAX_TOKENS`: at most that many tokens, and the top-k
    routed slots plus the shared one within the 8 warps of a down-projection block."""
    return t <= FOLD_SHARED_MAX_TOKENS and top_k + 1 <= 8


def _check_shared(shared, hidden: int) -> None:
    """A shared expert must map ``[T, hidden]`` to ``[T, hidden]``; layers with weights are checked."""
    if shared is None:
        return
    if not callable(shared):
        raise TypeError(f"shared: expected a callable [T, H] -> [T, H] (e.g. a SharedExpert), got {type(shared).__name__}")
    gate_up, down = getattr(shared, "gate_up", None), getattr(shared, "down", None)
    sizes = (getattr(gate_up, "in_features", hidden), getattr(down, "out_features", hidden))
    if sizes != (hidden, hidden):
        raise ValueError(f"shared: expected a shared expert of hidden size {hidden} (in and out), got in_features "
                         f"{sizes[0]} and out_features {sizes[1]}")


def _check_routing(r: RoutingConfig, e: int) -> None:
    if r.score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {r.score_func!r}")
    if not 1 <= r.top_k <= min(e, moe_ops.MAX_TOP_K):
        raise ValueError(f"top_k: expected 1..{min(e, moe_ops.MAX_TOP_K)} for {e} experts, got {r.top_k}")
    if e > moe_ops.MAX_EXPERTS:
        raise ValueError(f"experts: at most {moe_ops.MAX_EXPERTS} supported, got {e}")
    if r.n_group > 1:
        if e % r.n_group or r.n_group > 32 or not 1 <= r.topk_group <= r.n_group:
            raise ValueError(f"n_group/topk_group: expected n_group dividing {e} (<= 32) and 1 <= topk_group <= n_group, "
                             f"got {r.n_group}/{r.topk_group}")
        if r.top_k > r.topk_group * (e // r.n_group):
            raise ValueError(f"top_k: {r.top_k} exceeds the experts of the {r.topk_group} kept groups")


def _concat_experts(w1: ExpertStack, w3: ExpertStack) -> tuple[list[Nvfp4Tensor], list]:
    """Per-expert ``[gate | up]`` weights ``[2I, H]`` for the reference of the unfused path, with one
    decode factor per row (gate and up keep their own global scales)."""
    fused = [formats.fuse_rows([w1.expert(i), w3.expert(i)], "concatenated",
                               row_decodes=[None if s.row_decode is None else s.row_decode[i] for s in (w1, w3)])
             for i in range(w1.shape[0])]
    return [f for f, _ in fused], [d for _, d in fused]


def checkpoint_parts(checkpoint, prefix: str, experts: range, *, gate: str = "gate.weight", bias: str | None = None,
                     names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), fused: bool = True):
    """``(gate_weight, w2, {"w13": ...} or {"w1": ..., "w3": ...}, selection bias or None)`` of the
    MoE ``prefix`` of a checkpoint, with the experts ``experts`` stacked (`MoE.from_checkpoint`: all
    of them; an expert-parallel rank: its own, so a checkpoint read for that rank may hold no others)."""
    def stack(which: str) -> ExpertStack:
        missing = [f"{prefix}.experts.{i}.{which}" for i in experts
                   if f"{prefix}.experts.{i}.{which}" not in checkpoint.weights]
        if missing:
            raise KeyError(f"checkpoint: no quantized weight {missing[0]!r} ({len(missing)} experts missing)")
        return ExpertStack.from_tensors([checkpoint.weights[f"{prefix}.experts.{i}.{which}"] for i in experts])

    for name in [gate] + ([bias] if bias else []):
        if f"{prefix}.{name}" not in checkpoint.extra:
            raise KeyError(f"checkpoint: no tensor {prefix}.{name!s}")
    w1, w3, w2 = (stack(n) for n in names)
    parts = {"w13": ExpertStack.fuse_gate_up(w1, w3)} if fused else {"w1": w1, "w3": w3}
    gate_weight = checkpoint.extra[f"{prefix}.{gate}"]
    if gate_weight.dtype not in (arrays.BF16, np.dtype(np.float32)):
        gate_weight = gate_weight.astype(np.float32)
    sel_bias = None if bias is None else checkpoint.extra[f"{prefix}.{bias}"].astype(np.float32)
    return gate_weight, w2, parts, sel_bias
