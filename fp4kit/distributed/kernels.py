"""Launchers for ``raw_kernels/dist.cu``, each with its numpy twin (``reference/dist.py``): device
arrays launch the kernel, numpy arrays run the reference, so the sharded layers are written once.

The layers validate their configuration once and own every buffer; these check only what the
kernels rely on (dtypes, row sizes), before launching.
"""

from __future__ import annotations

import numpy as np

from ..ops import moe as moe_ops
from ..reference import dist as ref
from ..reference import moe as moe_ref
from ..reference import quant as quant_ref
from ..runtime import arrays, loader, status

_MODULE = "dist"
_U32 = np.uint32
_I32 = np.int32

MAX_WORLD = 1024  # one plan thread per (rank, expert) pair


def _device(a) -> bool:
    return arrays.is_device_array(a)


def route(x, layer, token_ids, ids, weights, counts, tickets, logits) -> None:
    """The MoE router of the full expert set (every rank routes its own tokens)."""
    if _device(x):
        moe_ops.route(x, layer.gate_weight, layer.bias, token_ids, layer.tid2eid, layer.routing, ids, weights, counts,
                      tickets, logits)
        return
    i, w = moe_ref.route(x, layer.gate_weight, bias=layer.bias, tid2eid=layer.tid2eid, token_ids=token_ids,
                         **vars(layer.routing))
    ids[...], weights[...] = i, w
    c, t = ref.tickets(i, layer.num_experts)
    counts[...] += c  # the kernel's atomics add to counts, which plan_send zeroes
    tickets[...] = t


def plan_send(counts, tickets, ids, weights, per_rank: int, world: int, capacity: int, pair_slot, send_counts,
              send_weight) -> None:
    """Each pair's slot in the per-destination send chunks; the counts and weights to send;
    ``counts`` zeroed; an overflow recorded in the status word."""
    e = counts.shape[0]
    if _device(counts):
        loader.get_kernel(_MODULE, "dist_plan_send", block=1024)(
            1, 1024, (counts, tickets, ids, weights, _U32(e), _U32(per_rank), _U32(world), _U32(capacity),
                      _U32(ids.size), pair_slot, send_counts, send_weight, status.device_word()))
        return
    slot, sent, w, overflow = ref.plan_send(counts, tickets, ids, weights, per_rank, world, capacity)
    kept = slot < world * capacity
    pair_slot[...] = slot
    send_counts[...] = sent
    send_weight.reshape(-1)[slot[kept]] = w[slot[kept]]
    counts[...] = 0
    if overflow:
        status.record_host(status.EP_CAPACITY_OVERFLOW)


def plan_recv(recv_counts, recv_weight, capacity: int, use_weight: bool, plan) -> None:
    """The grouped GEMM's plan over the received rows (``plan.offsets``, ``active``,
    ``num_active``, ``row_token``, ``row_weight``)."""
    world, per_rank = recv_counts.shape
    if _device(recv_counts):
        loader.get_kernel(_MODULE, "dist_plan_recv", block=1024)(
            1, 1024, (recv_counts, recv_weight, _U32(per_rank), _U32(world), _U32(capacity), _I32(use_weight),
                      plan.offsets, plan.active, plan.num_active, plan.row_token, plan.row_weight))
        return
    offsets, active, num_active, row_token, row_weight = ref.plan_recv(recv_counts, recv_weight, capacity, use_weight)
    plan.offsets[...], plan.active[...], plan.num_active[...] = offsets, active, num_active
    plan.row_token[...], plan.row_weight[...] = row_token, row_weight


def copy_rows(src, dst, n: int, *, n_limit=None, src_rows=None, src_div: int = 1, dst_rows=None,
              dst_limit: int | None = None) -> None:
    """``dst[dst_row(i)] = src[src_row(i)]`` for ``i < n`` (and ``< n_limit[0]``, a device count),
    ``src_row(i) = src_rows[i]`` or ``i // src_div``, ``dst_row(i) = dst_rows[i]`` or ``i``, rows
    whose destination is ``>= dst_limit`` skipped. Axis 0 of ``src`` and ``dst`` is the row."""
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"dst: expected rows like src ({arrays.describe(src)}), got {arrays.describe(dst)}")
    limit = dst.shape[0] if dst_limit is None else dst_limit
    if not _device(src):
        ref.copy_rows(src, dst, n, n_limit=n_limit, src_rows=src_rows, src_div=src_div, dst_rows=dst_rows,
                      dst_limit=limit)
        return
    if n == 0:
        return
    row_bytes = src.nbytes // max(src.shape[0], 1)
    aligned = src.data.ptr % 16 == 0 and dst.data.ptr % 16 == 0
    word, suffix = ((16, "u128") if row_bytes % 16 == 0 and aligned else
                    (4, "u32") if row_bytes % 4 == 0 and src.data.ptr % 4 == 0 and dst.data.ptr % 4 == 0 else (1, "u8"))
    loader.get_kernel(_MODULE, f"dist_copy_rows_{suffix}", block=128).function(
        (max(1, min(n, 16384)),), (128,),
        (src, dst, _U32(row_bytes // word), _U32(n), _opt(n_limit), _opt(src_rows), _U32(src_div), _opt(dst_rows),
         _U32(limit)))


def owner_slots(slot_all, ids, per_rank: int, out) -> None:
    """``out[p] = slot_all[ids[p] // per_rank, p]``: each pair's slot as the owner of its expert
    chose it (``slot_all [world, P]``: every rank's ``pair_slot``; replicated tokens)."""
    pairs = ids.size
    if slot_all.shape != (slot_all.shape[0], pairs) or out.size != pairs:
        raise ValueError(f"slot_all: expected [world, {pairs}] and out [{pairs}], got {arrays.describe(slot_all)} "
                         f"and {arrays.describe(out)}")
    if not _device(out):
        out.reshape(-1)[...] = ref.owner_slots(slot_all, ids, per_rank)
        return
    if pairs == 0:
        return
    loader.get_kernel(_MODULE, "dist_owner_slots")(
        max(1, min(-(-pairs // 256), 1024)), 256, (slot_all, ids, _U32(per_rank), _U32(pairs), out))


def bias_to_bf16(acc, bias, out) -> None:
    """``out = bf16(acc + bias)`` (fp32 add; ``bias`` fp32, bf16 or None)."""
    if not _device(acc):
        out[...] = ref.bias_to_bf16(acc, bias)
        return
    n = acc.shape[-1]
    rows = acc.size // max(n, 1)
    f32 = bias if bias is not None and bias.dtype == np.float32 else None
    bf16 = bias if bias is not None and bias.dtype == arrays.BF16 else None
    kernel = loader.get_kernel(_MODULE, "dist_bias_to_bf16")
    kernel(max(1, min(-(-acc.size // 256), kernel.max_blocks * 4)), 256,
           (acc, _opt(f32), _opt(bf16), out, _U32(rows), _U32(n)))


def grouped_gemm(act, stack, out, *, plan, gather: bool, out_col: int = 0, max_rows: int | None = None,
                 swiglu: tuple | None = None) -> None:
    """The MoE grouped expert GEMM (``moe.cu``) over the plan of the received rows; ``max_rows``: the
    rows one pass of an expert's weights serves on the device (`moe_ops.grouped_pass_rows`);
    ``swiglu=(row_scale, limit)``: ``out`` gets the SwiGLU of W13's output (`moe_ops.grouped_gemm`)."""
    if _device(out):
        moe_ops.grouped_gemm(act, stack, out, plan=plan, gather=gather, out_col=out_col, max_rows=max_rows,
                             swiglu=swiglu)
        return
    experts = [stack.expert(e) for e in range(stack.shape[0])]
    h = out if swiglu is None else np.zeros((out.shape[0], 2 * out.shape[1]), arrays.BF16)
    ref.grouped_gemm(act, experts, h, offsets=plan.offsets, active=plan.active, num_active=plan.num_active,
                     row_token=plan.row_token, gather=gather, row_decode=stack.row_decode, out_col=out_col)
    if swiglu is not None:
        out[...] = quant_ref.swiglu(h, "interleaved", swiglu[1], swiglu[0]).astype(arrays.BF16)


def combine(y, pair_slot, weights, weighted: bool, shared, out) -> None:
    """``out[t] = sum_j y[pair_slot[t, j]] (* weight) + shared[t]`` (the MoE combine)."""
    if _device(out):
        moe_ops.combine(y, pair_slot, weights, weighted, shared, out)
        return
    out[...] = ref.combine(y, pair_slot, weights, weighted, shared)


def _opt(a):
    return 0 if a is None else a
