"""`ExpertParallelMoE`: the DeepSeek MoE layer with its routed experts spread over ranks.

Rank ``r`` of ``world`` owns the ``per_rank = E / world`` consecutive experts ``[r * per_rank,
(r + 1) * per_rank)`` and the full router and shared expert (replicated). Every rank brings its
own ``T`` tokens (the same ``T`` on every rank: the all-to-all sizes are fixed) and a call is a
fixed sequence of launches and collectives, capturable in one CUDA graph:

1. route this rank's tokens over all E experts (the single-device router);
2. quantize the input (W4A4) with the group's encode scale: each rank's ``S``, then an all-reduce
   ``min`` (``S = 2688 / amax`` falls as amax grows, so the minimum is the ``S`` of the largest
   amax), then the quantization with it;
3. `plan_send` places each (token, slot) pair in its expert owner's chunk of ``capacity`` rows
   (sorted by expert; pairs beyond the capacity are dropped and recorded in the status word);
   the activation rows are copied there; one all-to-all carries the per-expert counts, the
   routing weights and the rows;
4. `plan_recv` makes each local expert's received rows contiguous: the grouped L1 GEMM of the
   single-device layer gathers them from the receive buffer; the fused SwiGLU + quantize runs with
   the group's scale (an all-reduce ``min`` again, shared with the shared expert's); the grouped
   L2 GEMM;
5. the result rows go back to their slots, a second all-to-all returns them to their sources, and
   each rank combines its pairs (the single-device combine) and adds the shared expert.

With the group's activation scales the result on every rank equals the single-device `MoE` run
on all ranks' tokens at once (tested on the numpy backend at world sizes 1, 2 and 4). Only the
counts and sizes fixed at construction are used on the host: nothing is read back.

Replicated tokens (``tokens="replicated"``, e.g. after tensor-parallel attention, where every rank
holds the same hidden states): no dispatch all-to-all and no input all-reduce. Every rank routes the
same tokens, runs its local experts on the pairs routed to them (taken from its own chunk of the
send buffer), and one all-gather of the result chunks gives every rank all result rows (the other
ranks' chunks: exact copies), which it combines: the result equals the single-device `MoE` on those
tokens, bit for bit, on every rank. The ranks agree on the experts of every pair but not on its row
within an expert's group: the router's tickets come from atomics, in an order that differs between
ranks (and calls). So a pair's result is read where its expert's owner put it: every rank's
``pair_slot`` travels in a small all-gather, and the combine reads, for each pair, the slot chosen by
the owner of its expert (`kernels.owner_slots`).

Capacity: ``capacity_factor=None`` (default) gives every destination room for all of a rank's
pairs that could reach it, ``T * min(top_k, per_rank)`` rows: no overflow is possible. A factor
``f`` gives ``ceil(f * T * top_k / world)`` rows (1.0 = the average load), smaller buffers and
all-to-alls, and drops what does not fit (`fp4kit.distributed.EP_CAPACITY_OVERFLOW`).
"""

from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass

import numpy as np

from ..formats import Nvfp4Tensor
from ..layers import moe as moe_layer
from ..layers.moe import ExpertStack, MoE, RoutingConfig, _check_routing, check_token_ids, checkpoint_parts
from ..layers.shared_expert import SharedExpert, interleave_rows
from ..ops import moe as moe_ops, quant as quant_ops
from ..runtime import arrays, workspace
from ..runtime.workspace import zeros_outside_capture
from . import kernels
from .comm import Communicator

TOKEN_MODES = ("sharded", "replicated")


def expert_range(num_experts: int, comm: Communicator) -> range:
    """The experts rank ``comm.rank`` owns (ValueError when the world size does not divide them)."""
    world = comm.world_size
    if num_experts % world:
        raise ValueError(f"comm: world_size {world} must divide the number of experts {num_experts} "
                         f"(expert parallelism gives every rank the same number of experts)")
    per = num_experts // world
    return range(comm.rank * per, (comm.rank + 1) * per)


def slice_stack(stack: ExpertStack | None, experts: range) -> ExpertStack | None:
    """Experts ``experts`` of a stack (copies, so the full stack can be freed)."""
    if stack is None:
        return None
    sl = slice(experts.start, experts.stop)

    def take(a):
        return None if a is None else a[sl].copy()

    return dataclasses.replace(stack, packed=take(stack.packed), block_scales=take(stack.block_scales),
                               global_scale=take(stack.global_scale), decode=take(stack.decode),
                               row_decode=take(stack.row_decode))


@dataclass
class _LocalPlan:
    """The grouped GEMM's plan over the received rows (the fields `fp4kit.ops.moe.grouped_gemm`
    reads; ``slot_row`` only sizes its grid: at most ``world * capacity`` rows)."""

    offsets: object
    active: object
    num_active: object
    row_token: object
    row_weight: object

    @property
    def slot_row(self):
        return self.row_token


@dataclass
class _Buffers:
    """Everything one call with T tokens writes (owned by the layer, reused across calls)."""

    capacity: int
    logits: object
    ids: object
    weights: object
    tickets: object
    counts: object
    scales: object  # fp32 [3, 4]: encode scales of the input, the routed and the shared SwiGLU output in
    # column 0 (rows of 16 bytes: each is an aligned 0-d array for the quantizers)
    x_act: object
    pair_slot: object
    slot_all: object  # replicated tokens, world > 1: [world, T * top_k] every rank's pair_slot, else None
    owner_slot: object  # ... and [T * top_k] each pair's slot as its expert's owner chose it, else None
    sends: list
    recvs: list
    send_rows: list  # views [world * capacity, ...] of the row payloads in sends
    local: _LocalPlan
    h: object
    h_act: object
    hs_act: object
    y: object
    back_send: object
    back_recv: object  # [world * capacity + 1, H]: the last row stays zero (dropped pairs read it)
    out: object

    def scale(self, i: int):
        return self.scales[i, 0:1].reshape(())


class ExpertParallelMoE:
    """The MoE layer with experts partitioned over ``comm`` (see the module docstring).

    Parameters
    ----------
    gate_weight : bf16 or fp32 ``[E, H]`` — the full router (replicated)
    w2 : ExpertStack ``[E / world, H, I]`` — this rank's experts
    routing : RoutingConfig
    comm : Communicator
    w13 : ExpertStack ``[E / world, 2I, H]`` (fused gate|up), or ``w1`` and ``w3`` ``[E / world, I, H]``
    bias, tid2eid, limit, weight_before_down, mode, shared : as in `fp4kit.layers.MoE`
        ``shared`` is replicated; a `SharedExpert` (W4A4) shares the group's activation scales.
    capacity_factor : float, optional — see the module docstring (None: no overflow possible)
    tokens : "sharded" (default: every rank brings its own tokens) or "replicated" (every rank
        passes the same tokens; see the module docstring)
    """

    def __init__(self, gate_weight, w2: ExpertStack, routing: RoutingConfig, comm: Communicator, *,
                 w13: ExpertStack | None = None, w1: ExpertStack | None = None, w3: ExpertStack | None = None,
                 bias=None, tid2eid=None, limit: float | None = None, weight_before_down: bool = True,
                 mode: str = "w4a4", shared=None, capacity_factor: float | None = None, tokens: str = "sharded"):
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm: expected an fp4kit.distributed Communicator, got {type(comm).__name__}")
        gate_weight = arrays.as_array(gate_weight, "gate_weight")
        if gate_weight.ndim != 2:
            raise ValueError(f"gate_weight: expected [experts, hidden], got {arrays.describe(gate_weight)}")
        e, h = gate_weight.shape
        experts = expert_range(e, comm)
        per = len(experts)
        if (w13 is None) == (w1 is None or w3 is None):
            raise ValueError("w13: pass either the fused w13 or both w1 and w3")
        for name, st in (("w2", w2), ("w13", w13), ("w1", w1), ("w3", w3)):
            if st is not None and st.shape[0] != per:
                raise ValueError(f"{name}: expected this rank's {per} experts ({e} experts over world_size "
                                 f"{comm.world_size}), got a stack of {st.shape[0]}")
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            raise ValueError(f"capacity_factor: expected a positive number or None, got {capacity_factor!r}")
        if tokens not in TOKEN_MODES:
            raise ValueError(f"tokens: expected one of {TOKEN_MODES}, got {tokens!r}")
        # the single-device layer validates everything else, given stacks of the full expert count
        _check_routing(routing, e)
        full = {name: _FullShape.of(st, comm.world_size) for name, st in (("w13", w13), ("w1", w1), ("w3", w3))}
        check = MoE(gate_weight, _FullShape.of(w2, comm.world_size), routing, **full, bias=bias, tid2eid=tid2eid,
                    limit=limit, weight_before_down=weight_before_down, mode=mode, shared=shared)
        self.gate_weight, self.bias, self.tid2eid = check.gate_weight, check.bias, check.tid2eid
        if arrays.is_device_array(w2.packed):  # the grouped GEMM reads the tiled layout
            w13, w1, w3, w2 = (None if st is None else st.to_tiled() for st in (w13, w1, w3, w2))
        self.w13, self.w1, self.w3, self.w2 = w13, w1, w3, w2
        self.routing, self.limit, self.weight_before_down, self.mode, self.shared = (
            routing, limit, weight_before_down, mode, shared)
        self.num_experts, self.hidden, self.inner = e, h, w2.shape[2]
        self.comm, self.experts, self.capacity_factor, self.tokens = comm, experts, capacity_factor, tokens
        self._buffers = workspace.BufferCache()

    @property
    def fused(self) -> bool:
        return self.w13 is not None

    @property
    def experts_per_rank(self) -> int:
        return len(self.experts)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def shard(cls, moe: MoE, comm: Communicator, *, capacity_factor: float | None = None,
              tokens: str = "sharded") -> "ExpertParallelMoE":
        """This rank's share of a full single-device `MoE` (expert weights sliced, every byte and
        scale kept; router and shared expert shared with ``moe``)."""
        if not isinstance(moe, MoE):
            raise TypeError(f"moe: expected an fp4kit.layers.MoE, got {type(moe).__name__}")
        experts = expert_range(moe.num_experts, comm)
        return cls(moe.gate_weight, slice_stack(moe.w2, experts), moe.routing, comm,
                   w13=slice_stack(moe.w13, experts), w1=slice_stack(moe.w1, experts),
                   w3=slice_stack(moe.w3, experts), bias=moe.bias, tid2eid=moe.tid2eid, limit=moe.limit,
                   weight_before_down=moe.weight_before_down, mode=moe.mode, shared=moe.shared,
                   capacity_factor=capacity_factor, tokens=tokens)

    @classmethod
    def from_checkpoint(cls, checkpoint, prefix: str, routing: RoutingConfig, comm: Communicator, *,
                        num_experts: int, gate: str = "gate.weight", bias: str | None = None,
                        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), fused: bool = True,
                        **kwargs) -> "ExpertParallelMoE":
        """This rank's share of the MoE ``prefix`` of a checkpoint, as `fp4kit.layers.MoE.from_checkpoint`
        reads it, stacking only the experts this rank owns: the checkpoint needs to hold no others
        (load it with a ``keep`` that skips them, and no rank ever holds the whole layer)."""
        experts = expert_range(num_experts, comm)
        gate_weight, w2, parts, sel_bias = checkpoint_parts(checkpoint, prefix, experts, gate=gate, bias=bias,
                                                            names=names, fused=fused)
        return cls(gate_weight, w2, routing, comm, bias=sel_bias, **parts, **kwargs)

    @classmethod
    def from_float(cls, gate_weight, w1, w3, w2, routing: RoutingConfig, comm: Communicator, *, fused: bool = True,
                   capacity_factor: float | None = None, **kwargs) -> "ExpertParallelMoE":
        """Quantize only this rank's experts of the float weights ``w1, w3 [E, I, H]``, ``w2 [E, H, I]``
        (anything indexable by expert with a ``shape``), one global scale per expert and matrix,
        exactly as `MoE.from_float` quantizes them."""
        e = gate_weight.shape[0]
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            if len(w.shape) != 3 or w.shape[0] != e:
                raise ValueError(f"{name}: expected [{e} experts, rows, cols] like gate_weight, got shape {tuple(w.shape)}")
        experts = expert_range(e, comm)
        if fused:
            parts = {"w13": ExpertStack.from_tensors([quant_ops.quantize(interleave_rows(w1[i], w3[i]))
                                                      for i in experts])}
        else:
            parts = {"w1": ExpertStack.from_tensors([quant_ops.quantize(w1[i]) for i in experts]),
                     "w3": ExpertStack.from_tensors([quant_ops.quantize(w3[i]) for i in experts])}
        w2s = ExpertStack.from_tensors([quant_ops.quantize(w2[i]) for i in experts])
        return cls(gate_weight, w2s, routing, comm, **parts, capacity_factor=capacity_factor, **kwargs)

    # -- buffers --------------------------------------------------------------------------------
    def capacity(self, t: int) -> int:
        """Rows per (source, destination) chunk for calls with ``t`` tokens."""
        k = self.routing.top_k
        most = t * min(k, self.experts_per_rank)  # a token's experts are distinct
        if self.capacity_factor is None:
            return max(1, most)
        return max(1, min(most, math.ceil(self.capacity_factor * t * k / self.comm.world_size)))

    def _buffers_for(self, x) -> _Buffers:
        return self._buffers.get(x.shape[0], lambda: self._make_buffers(x))

    def _make_buffers(self, x) -> _Buffers:
        t = x.shape[0]
        xp = arrays.array_module(x)
        device = xp is not np

        def zeros(shape, dtype):
            if not device:
                return np.zeros(shape, dtype)
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            return zeros_outside_capture(nbytes, np.uint8).view(dtype).reshape(shape)

        world, per, k = self.comm.world_size, self.experts_per_rank, self.routing.top_k
        e, h, i, cap = self.num_experts, self.hidden, self.inner, self.capacity(t)
        slots, pairs = world * cap, t * k
        replicated = self.tokens == "replicated"
        rows = cap if replicated else slots  # rows the local experts may get: own chunk, or every source's
        w4a4 = self.mode == "w4a4"
        scales = zeros((3, 4), np.float32)

        def nvfp4(rows, cols, scale):
            return Nvfp4Tensor(xp.empty((rows, cols // 2), np.uint8), xp.empty((rows, cols // 16), np.uint8), scale,
                               "linear", (rows, cols))

        def exchanged(shape, dtype):  # (send, recv); one array when nothing moves
            send = zeros(shape, dtype)
            return send, (send if world == 1 or replicated else zeros(shape, dtype))

        counts_s, counts_r = exchanged((world, per), np.uint32)
        weight_s, weight_r = exchanged((world, cap), np.float32)
        row_shapes = [((world, cap, h // 2), np.uint8), ((world, cap, h // 16), np.uint8)] if w4a4 else [
            ((world, cap, h), arrays.BF16)]
        rows_s, rows_r = zip(*(exchanged(s, d) for s, d in row_shapes))
        back_recv = zeros((slots + 1, h), np.float32)
        shared_inner = self.shared.down.in_features if isinstance(self.shared, SharedExpert) else 0
        buf = _Buffers(
            capacity=cap, logits=xp.empty((t, e), np.float32), ids=xp.empty((t, k), np.int32),
            weights=xp.empty((t, k), np.float32), tickets=xp.empty((t, k), np.uint32), counts=zeros(e, np.uint32),
            scales=scales, x_act=None, pair_slot=xp.empty(pairs, np.uint32),
            slot_all=zeros((world, pairs), np.uint32) if replicated and world > 1 else None,
            owner_slot=zeros(pairs, np.uint32) if replicated and world > 1 else None,
            sends=[counts_s, weight_s, *rows_s], recvs=[counts_r, weight_r, *rows_r],
            send_rows=[r.reshape(slots, -1) for r in rows_s],
            local=_LocalPlan(xp.empty(per + 1, np.uint32), xp.empty(per, np.uint32), xp.empty(1, np.uint32),
                             xp.empty(rows, np.uint32), xp.empty(rows, np.float32)),
            h=zeros((rows, 2 * i), arrays.BF16), h_act=None, hs_act=None, y=xp.empty((rows, h), np.float32),
            back_send=back_recv[:slots].reshape(world, cap, h) if world == 1 or replicated else zeros(
                (world, cap, h), np.float32),
            back_recv=back_recv,
            out=xp.empty((t, h), arrays.BF16))
        if w4a4:
            buf.x_act = nvfp4(t, h, buf.scale(0))
            buf.h_act = nvfp4(rows, i, buf.scale(1))
            if shared_inner:
                buf.hs_act = nvfp4(t, shared_inner, buf.scale(2))
        else:
            buf.h_act = xp.empty((rows, i), arrays.BF16)
        return buf

    # -- forward --------------------------------------------------------------------------------
    def __call__(self, x, token_ids=None):
        """``[T, H]`` bf16 (this rank's tokens; the same T on every rank) to ``[T, H]`` bf16. On the
        device the result is a buffer owned by the layer (one per T), overwritten by the next call
        with the same T; every rank must make the call (it holds collectives)."""
        x = arrays.as_array(x, "x")
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x: expected [tokens, {self.hidden}], got shape {tuple(x.shape)}")
        if x.dtype != arrays.BF16:
            raise TypeError(f"x: expected bfloat16, got {x.dtype}")
        arrays.check_contiguous("x", x)
        arrays.check_same_device(x=x, gate_weight=self.gate_weight)
        token_ids = check_token_ids(token_ids, x, self.tid2eid)
        b = self._buffers_for(x)
        out = self._forward(x, token_ids, b)
        return out if arrays.is_device_array(out) else out.copy()

    def _group_scale(self, b: _Buffers, first: int, last: int) -> None:
        """Replace this rank's encode scales ``first .. last - 1`` by the group's (the smallest)."""
        if self.comm.world_size > 1:
            self.comm.all_reduce(b.scales[first:last], "min")

    def _forward(self, x, token_ids, b: _Buffers):
        comm, world, rank, per, cap = self.comm, self.comm.world_size, self.comm.rank, self.experts_per_rank, b.capacity
        k, slots, w4a4 = self.routing.top_k, world * b.capacity, self.mode == "w4a4"
        replicated = self.tokens == "replicated"
        rows = cap if replicated else slots
        # every rank's tokens reach the experts (replicated: the same tokens on every rank)
        pass_rows = moe_ops.grouped_pass_rows(x.shape[0] * (1 if replicated else world), k, self.num_experts, w4a4)
        kernels.route(x, self, token_ids, b.ids, b.weights, b.counts, b.tickets, b.logits)

        # the input, quantized with the group's scale (rows identical to the single-device layer's)
        if w4a4:
            quant_ops.quantize(x, out=b.x_act)
            if world > 1 and not replicated:
                self._group_scale(b, 0, 1)
                quant_ops.quantize(x, global_scale=b.scale(0), out=b.x_act)
            row_sources = [b.x_act.packed, b.x_act.block_scales]
        else:
            row_sources = [x]

        # dispatch: pack by destination, one all-to-all (counts, weights, rows); replicated tokens
        # need none: this rank's own chunk holds the pairs of its experts
        kernels.plan_send(b.counts, b.tickets, b.ids, b.weights, per, world, cap, b.pair_slot, b.sends[0], b.sends[1])
        for src, dst in zip(row_sources, b.send_rows):
            kernels.copy_rows(src, dst, b.pair_slot.size, src_div=k, dst_rows=b.pair_slot, dst_limit=slots)
        if replicated:
            incoming = [a[rank:rank + 1] for a in b.sends]
            if world > 1:  # the ranks' tickets (atomics) differ: every rank's slots, for the combine
                comm.all_gather(b.pair_slot, b.slot_all)
        else:
            comm.all_to_all(b.sends, b.recvs)
            incoming = b.recvs
        kernels.plan_recv(incoming[0], incoming[1], cap, self.weight_before_down, b.local)

        # the local experts on the received rows
        if w4a4:
            packed, scales = (r.reshape(rows, -1) for r in incoming[2:4])
            act = Nvfp4Tensor(packed, scales, b.scale(0), "linear", (rows, self.hidden))
        else:
            act = incoming[2].reshape(rows, self.hidden)
        # W4A16 with a fused W13: SwiGLU in the gate|up GEMM's epilogue, as `MoE` (GROUPED_SWIGLU_EPILOGUE)
        swiglu_in_gemm = moe_layer.GROUPED_SWIGLU_EPILOGUE and self.fused and not w4a4
        if swiglu_in_gemm:
            kernels.grouped_gemm(act, self.w13, b.h_act, plan=b.local, gather=True, max_rows=pass_rows,
                                 swiglu=(b.local.row_weight, self.limit))
        elif self.fused:
            kernels.grouped_gemm(act, self.w13, b.h, plan=b.local, gather=True, max_rows=pass_rows)
            layout = "interleaved"
        else:
            kernels.grouped_gemm(act, self.w1, b.h, plan=b.local, gather=True, max_rows=pass_rows)
            kernels.grouped_gemm(act, self.w3, b.h, plan=b.local, gather=True, out_col=self.inner,
                                 max_rows=pass_rows)
            layout = "concatenated"
        shared_h = self._shared_gate_up(x, b)
        if w4a4:
            # unused rows have row factor 0: their stale values stay out of the amax
            quant_ops.swiglu_quantize(b.h, layout=layout, limit=self.limit, row_scale=b.local.row_weight, out=b.h_act)
            shared_act = self._shared_swiglu(shared_h, b, None)
            if world > 1:
                self._group_scale(b, 1, 3)
                quant_ops.swiglu_quantize(b.h, layout=layout, limit=self.limit, row_scale=b.local.row_weight,
                                          global_scale=b.scale(1), out=b.h_act)
                shared_act = self._shared_swiglu(shared_h, b, b.scale(2))
        else:
            if not swiglu_in_gemm:
                quant_ops.swiglu(b.h, layout=layout, limit=self.limit, row_scale=b.local.row_weight, out=b.h_act)
            shared_act = None
        kernels.grouped_gemm(b.h_act, self.w2, b.y, plan=b.local, gather=False, max_rows=pass_rows)

        # results back to their slots (and sources), then the single-device combine
        everything = b.back_recv[:slots].reshape(world, cap, -1)
        if replicated:
            mine = everything[rank]
            kernels.copy_rows(b.y, mine, rows, n_limit=b.local.offsets[per:], dst_rows=b.local.row_token,
                              dst_limit=rows)
            comm.all_gather(mine, everything)
        else:
            kernels.copy_rows(b.y, b.back_send.reshape(slots, -1), slots, n_limit=b.local.offsets[per:],
                              dst_rows=b.local.row_token, dst_limit=slots)
            comm.all_to_all(b.back_send, everything)
        pair_slot = b.pair_slot
        if b.owner_slot is not None:
            kernels.owner_slots(b.slot_all, b.ids, per, b.owner_slot)
            pair_slot = b.owner_slot
        shared_out = self._shared_out(x, shared_act)
        kernels.combine(b.back_recv, pair_slot, b.weights, not self.weight_before_down, shared_out, b.out)
        return b.out

    # -- the shared expert, with the group's activation scales where it has dynamic ones ----------
    def _group_scaled_shared(self) -> bool:
        s = self.shared
        return isinstance(s, SharedExpert) and s.mode == "w4a4" and self.mode == "w4a4"

    def _shared_gate_up(self, x, b: _Buffers):
        if not self._group_scaled_shared():
            return None
        gate_up = self.shared.gate_up
        # dynamic: the input quantized with the group's scale is the routed experts' input
        return gate_up(x) if gate_up.input_scale is not None else gate_up.gemm(b.x_act)

    def _shared_swiglu(self, h, b: _Buffers, scale):
        """The shared expert's SwiGLU + quantize: its static scale if it has one, else ``scale``
        (None: this rank's, written into ``scales[2]`` for the group's all-reduce)."""
        if h is None:
            return None
        static = self.shared.down.input_scale
        return quant_ops.swiglu_quantize(h, layout="interleaved", limit=self.shared.limit,
                                         global_scale=static if static is not None else scale, out=b.hs_act)

    def _shared_out(self, x, shared_act):
        if self.shared is None:
            return None
        if shared_act is not None:
            return self.shared.down.gemm(shared_act)
        return self.shared(x)  # W4A16, or any callable: its own scales on this rank's tokens


@dataclass
class _FullShape:
    """What `MoE`'s checks read of a stack (``shape``, ``packed``), at the full expert count."""

    shape: tuple
    packed: object

    @classmethod
    def of(cls, stack: ExpertStack | None, world: int):
        return None if stack is None else cls((stack.shape[0] * world, *stack.shape[1:]), stack.packed)
