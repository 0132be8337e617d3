"""Specification of the sharded layers' kernels (``raw_kernels/dist.cu``) and the numpy backend of
the expert-parallel MoE.

Expert parallelism with fixed-capacity all-to-all buffers. ``world`` ranks each own
``per_rank = E / world`` consecutive experts (rank ``d`` owns ``[d * per_rank, (d + 1) * per_rank)``).
Every rank routes its own ``T`` tokens (``P = T * top_k`` pairs) and sends each pair's activation
row to the expert's owner, into a chunk of ``capacity`` rows per destination:

* `plan_send`: a pair's position in its destination's chunk is the number of this rank's pairs
  routed to the destination's lower experts plus its ticket (its rank among the pairs of the same
  expert), so each chunk is sorted by expert; positions ``>= capacity`` are dropped (the pair
  contributes nothing; the overflow is recorded);
* `plan_recv`: the receiver makes the rows of each local expert contiguous in (expert, source,
  position) order — the grouped GEMM's plan — with each sorted row's slot in the receive buffer;
* after the experts ran, each result row goes back to its slot (`copy_rows`), a second
  all-to-all returns it to its source, and the source combines its pairs' rows in slot order.

Rows are independent through the GEMMs, so the order changes no value: with activation scales
shared by all ranks the sharded layer equals the single-device layer on all ranks' tokens at once.
"""

from __future__ import annotations

import numpy as np

from . import gemm as gemm_ref
from .moe import take_rows


def tickets(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert counts ``[E]`` and each pair's ticket ``[T, top_k]`` (its rank among the pairs of
    its expert, in pair order; the kernels draw tickets from atomics, in any order)."""
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    counts = np.bincount(flat, minlength=num_experts).astype(np.uint32)
    order = np.argsort(flat, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    t = np.empty(flat.size, np.uint32)
    t[order] = np.arange(flat.size) - starts[flat[order]]
    return counts, t.reshape(np.shape(ids))


def plan_send(counts, tickets_, ids, weights, per_rank: int, world: int, capacity: int):
    """``(pair_slot [P], send_counts [world, per_rank], send_weight [world * capacity], overflow)``.

    ``pair_slot[p] = d * capacity + position`` (``world * capacity`` for a dropped pair);
    ``send_counts`` the rows sent per destination and local expert; ``send_weight`` the routing
    weight of each sent slot (unsent slots keep 0 here; the kernel leaves them untouched)."""
    counts = np.asarray(counts, np.int64)
    start = np.concatenate([[0], np.cumsum(counts)])
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    dest = ids // per_rank
    pos = start[ids] - start[dest * per_rank] + np.asarray(tickets_).reshape(-1).astype(np.int64)
    kept = pos < capacity
    pair_slot = np.where(kept, dest * capacity + pos, world * capacity).astype(np.uint32)
    send_weight = np.zeros(world * capacity, np.float32)
    send_weight[pair_slot[kept]] = np.asarray(weights, np.float32).reshape(-1)[kept]
    e = np.arange(counts.size)
    base = start[(e // per_rank) * per_rank]
    sent = np.minimum(start[1:] - base, capacity) - np.minimum(start[:-1] - base, capacity)
    return pair_slot, sent.astype(np.uint32).reshape(world, per_rank), send_weight, bool((~kept).any())


def plan_recv(recv_counts, recv_weight, capacity: int, use_weight: bool):
    """``(offsets [per_rank + 1], active [per_rank], num_active [1], row_token [world * capacity],
    row_weight [world * capacity])`` from the received counts ``[world, per_rank]``.

    Sorted rows run over experts, then sources, then positions; ``row_token[row]`` is the row's
    slot ``s * capacity + position`` in the receive buffer; ``row_weight`` the received weight (or 1
    when ``use_weight`` is False), 0 past the last row. Entries of ``active`` past ``num_active``
    are unspecified (0 here)."""
    recv_counts = np.asarray(recv_counts, np.int64)
    world, per_rank = recv_counts.shape
    per_expert = recv_counts.sum(0)
    offsets = np.concatenate([[0], np.cumsum(per_expert)]).astype(np.uint32)
    active_ids = np.nonzero(per_expert)[0]
    active = np.zeros(per_rank, np.uint32)
    active[: active_ids.size] = active_ids
    slots = world * capacity
    row_token = np.zeros(slots, np.uint32)
    row_weight = np.zeros(slots, np.float32)
    recv_weight = np.asarray(recv_weight, np.float32).reshape(-1)
    row = 0
    for e in range(per_rank):
        for s in range(world):
            first = int(recv_counts[s, :e].sum())
            for i in range(int(recv_counts[s, e])):
                q = s * capacity + first + i
                row_token[row] = q
                row_weight[row] = recv_weight[q] if use_weight else 1.0
                row += 1
    return offsets, active, np.array([active_ids.size], np.uint32), row_token, row_weight


def copy_rows(src, dst, n: int, *, n_limit=None, src_rows=None, src_div: int = 1, dst_rows=None,
              dst_limit: int | None = None) -> None:
    """``dst[dst_row(i)] = src[src_row(i)]`` for ``i < min(n, n_limit)``; ``src_row(i) = src_rows[i]``
    or ``i // src_div``; ``dst_row(i) = dst_rows[i]`` or ``i``; rows with ``dst_row >= dst_limit``
    are skipped. ``src`` and ``dst`` are viewed as ``[rows, ...]`` (axis 0 the row)."""
    rows = n if n_limit is None else min(n, int(np.asarray(n_limit).reshape(-1)[0]))
    limit = dst.shape[0] if dst_limit is None else dst_limit
    i = np.arange(rows)
    s = np.asarray(src_rows)[:rows].astype(np.int64) if src_rows is not None else i // src_div
    d = np.asarray(dst_rows)[:rows].astype(np.int64) if dst_rows is not None else i
    keep = d < limit
    dst[d[keep]] = src[s[keep]]


def owner_slots(slot_all, ids, per_rank: int):
    """``[P]``: ``slot_all[ids[p] // per_rank, p]``, each pair's slot as its expert's owner chose it."""
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    return np.asarray(slot_all)[ids // per_rank, np.arange(ids.size)].astype(np.uint32)


def bias_to_bf16(acc, bias=None):
    """``bf16(acc + bias)`` in fp32 (the row-parallel Linear's last step)."""
    from .moe import BF16

    y = np.asarray(acc, np.float32)
    if bias is not None:
        y = (y + np.asarray(bias).astype(np.float32)).astype(np.float32)
    return y.astype(BF16)


def grouped_gemm(act, experts, out, *, offsets, active, num_active, row_token, gather: bool,
                 row_decode=None, out_col: int = 0) -> None:
    """The grouped expert GEMM of ``moe.cu`` over an explicit plan: for every active expert ``e``
    and sorted row ``r`` in ``[offsets[e], offsets[e + 1])``, ``out[r, out_col : out_col + N] =
    gemm(A[row_token[r] if gather else r], W[e])``, rounded once to ``out``'s dtype.

    ``experts`` is a sequence of `Nvfp4Tensor` ``[N, K]``; ``row_decode`` an optional sequence of
    per-row decode vectors; ``act`` an `Nvfp4Tensor` or a bf16 array."""
    offsets = np.asarray(offsets).astype(np.int64)
    for e in np.asarray(active)[: int(np.asarray(num_active).reshape(-1)[0])]:
        rows = np.arange(offsets[e], offsets[e + 1])
        src = np.asarray(row_token)[rows].astype(np.int64) if gather else rows
        a = take_rows(act, src)
        n = experts[e].shape[0]
        rd = None if row_decode is None else row_decode[e]
        out[rows, out_col: out_col + n] = gemm_ref.gemm(a, experts[e], None, rd, out.dtype)


def combine(y, pair_slot, weights, weighted: bool, shared=None):
    """``out[t] = sum over slots j of y[pair_slot[t, j]]`` (times the routing weight when
    ``weighted``) in float64, rounded to fp32, plus the shared expert's output in fp32, as bf16 —
    the single-device MoE reference's combine, reading the rows returned by the all-to-all."""
    from .moe import BF16

    t, k = np.shape(weights)
    rows = np.asarray(y)[np.asarray(pair_slot).reshape(-1).astype(np.int64)].reshape(t, k, -1)
    if weighted:
        rows = rows * np.asarray(weights, np.float32)[..., None]
    out = rows.sum(1, dtype=np.float64).astype(np.float32)
    if shared is not None:
        out = out + np.asarray(shared).astype(np.float32)
    return out.astype(BF16)
