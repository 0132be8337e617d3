"""Mixture-of-Experts launchers for ``raw_kernels/moe.cu``: router, dispatch, grouped expert GEMM
and combine. `fp4kit.layers.MoE` validates its configuration once and calls these with its own
preallocated buffers; each launcher only checks what can change per call.
"""

from __future__ import annotations

import numpy as np

from ..formats import Nvfp4Tensor
from ..runtime import arrays, loader, status
from . import gemm as gemm_ops

_MODULE = "moe"
_U32 = np.uint32
_I32 = np.int32
SCORE_FUNC_CODES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
MAX_EXPERTS = 1024
MAX_TOP_K = 16


def _suffix(dtype) -> str:
    return "bf16" if np.dtype(dtype) == arrays.BF16 else "f32"


def route(x, gate_weight, bias, token_ids, tid2eid, cfg, ids, weights, counts, tickets, logits) -> None:
    """Logits (one warp per token and expert), then one block per token: scores, (grouped) top-k or
    hash ids, weights; dispatch tickets. ``counts`` must be zero on entry (`dispatch` leaves it
    zero); ``logits`` is fp32 ``[T, E]`` scratch. A hash-routing token id outside
    ``[0, vocab)`` reads ``tid2eid`` row 0 and records `fp4kit.runtime.status.TOKEN_RANGE`."""
    t, h = x.shape
    e = gate_weight.shape[0]
    for name, a in (("x", x), ("gate_weight", gate_weight)):
        if a.dtype not in (arrays.BF16, np.dtype(np.float32)):
            raise TypeError(f"{name}: expected bfloat16 or float32, got {a.dtype}")
    name = f"moe_router_logits_{_suffix(x.dtype)}_{_suffix(gate_weight.dtype)}"
    loader.get_kernel(_MODULE, name).function((-(-e // 8), t), (256,), (x, gate_weight, _U32(e), _U32(h), logits))
    loader.get_kernel(_MODULE, "moe_router")(
        t, 256, (logits, _opt(bias), _opt(token_ids), _opt(tid2eid), _U32(0 if tid2eid is None else tid2eid.shape[0]),
                 status.device_word(), _U32(e), _U32(cfg.top_k),
                 _I32(SCORE_FUNC_CODES[cfg.score_func]), _U32(cfg.n_group), _U32(cfg.topk_group),
                 _I32(cfg.renormalize), np.float32(cfg.routed_scale), ids, weights, counts, tickets))


def dispatch(counts, tickets, ids, weights, top_k: int, plan) -> None:
    """Offsets, active experts, the sorted row of every (token, slot) and the token and weight of
    every sorted row; zeroes ``counts``. One block."""
    e = counts.shape[0]
    loader.get_kernel(_MODULE, "moe_dispatch", block=1024)(
        1, 1024, (counts, tickets, ids, weights, _U32(e), _U32(ids.size), _U32(top_k), plan.offsets, plan.active,
                  plan.num_active, plan.slot_row, plan.row_token, plan.row_weight))


def grouped_gemm(act, stack, out, *, plan, gather: bool, out_col: int = 0, max_rows: int | None = None) -> None:
    """``out[r, out_col : out_col + N] = alpha_e * A[row r] @ W[e]^T`` for every sorted row ``r`` of
    every active expert ``e``; ``act`` an `Nvfp4Tensor` or bf16, gathered through the sorted rows'
    tokens when ``gather`` (the layer input) or read in sorted order (the down-projection input).
    ``stack`` is tiled (`ExpertStack.to_tiled`). ``max_rows`` bounds the rows of one expert (the
    token count; default: every row): it picks how many rows one pass of the weights serves."""
    if stack.layout != "tiled":
        raise ValueError("stack: the grouped GEMM reads tiled expert stacks; convert with stack.to_tiled()")
    n, k = stack.shape[1:]
    slots = min(stack.shape[0], plan.slot_row.size)
    tiles = gemm_ops.token_tiles(plan.slot_row.size if max_rows is None else max_rows)
    common = (stack.packed, stack.block_scales, stack.decode, _opt(stack.row_decode),
              plan.row_token if gather else 0, out, _I32(out.dtype == np.float32), _U32(out.shape[-1]), _U32(out_col),
              plan.offsets, plan.active, plan.num_active, _U32(n), _U32(k))
    if isinstance(act, Nvfp4Tensor):
        kernel = loader.get_kernel(_MODULE, f"moe_gemm_nvfp4_{tiles}")
        args = (act.packed, act.block_scales, act.global_scale, *common)
    else:
        kernel = loader.get_kernel(_MODULE, f"moe_gemm_bf16_{tiles}")
        args = (act, *common)
    kernel.launch((gemm_ops.row_groups(n, 1), slots), 256, args, shared_mem=gemm_ops.shared_bytes(tiles))


def combine(y, slot_row, weights, weighted: bool, shared, out) -> None:
    t, h = out.shape
    top_k = slot_row.size // t
    loader.get_kernel(_MODULE, "moe_combine")(
        t, 256, (y, slot_row, weights, _I32(weighted), _opt(shared), out, _U32(h), _U32(top_k)))


def _opt(a):
    return 0 if a is None else a
