"""Mixture-of-Experts launchers for ``raw_kernels/moe.cu``: router, dispatch, grouped expert GEMM
and combine. `fp4kit.layers.MoE` validates its configuration once and calls these with its own
preallocated buffers; each launcher only checks what can change per call.
"""

from __future__ import annotations

import math

import numpy as np

from ..formats import GROUP_CHUNKS, TILE_K, Nvfp4Tensor
from ..runtime import arrays, loader, status
from . import elementwise as ew_ops
from . import gemm as gemm_ops

_MODULE = "moe"
_U32 = np.uint32
_I32 = np.int32
SCORE_FUNC_CODES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
MAX_EXPERTS = 1024
MAX_TOP_K = 16


def _suffix(dtype) -> str:
    return "bf16" if np.dtype(dtype) == arrays.BF16 else "f32"


#: warps per (token, expert) of the router's logits (1, 2, 4 or 8); None: `router_warps_per_expert`'s rule
ROUTER_WARPS_PER_EXPERT = None
#: the router's logits take the most warps per expert that keep the grid within this many blocks per SM
ROUTER_MAX_BLOCKS_PER_SM = 2


def router_warps_per_expert(h: int, e: int, t: int, sms: int) -> int:
    """Warps per (token, expert) of the router's logits (1, 2, 4 or 8): the most that leave each
    warp a slice of at least 512 of the H inputs in whole runs of 8 and keep the grid of
    ``ceil(e * wpe / 8) * t`` blocks within `ROUTER_MAX_BLOCKS_PER_SM` per SM. With one warp per
    expert, one token's logits ran on E / 8 blocks (V4-Flash: 32, 512 KB in flight). H200,
    V4-Flash, same run, rule against one warp per expert: T = 1 50.4 vs 51.4 us (W4A16), 64.3 vs
    65.1 (W4A4); at T = 8 eight warps per expert (2048 blocks) measured 241 vs 238 and 274 vs 269,
    so the grid bound keeps one warp there."""
    if ROUTER_WARPS_PER_EXPERT is not None:
        return ROUTER_WARPS_PER_EXPERT
    for wpe in (8, 4, 2):
        if h % (8 * wpe) == 0 and h // wpe >= 512 and -(-e * wpe // 8) * t <= ROUTER_MAX_BLOCKS_PER_SM * sms:
            return wpe
    return 1


def route(x, gate_weight, bias, token_ids, tid2eid, cfg, ids, weights, counts, tickets, logits, *,
          dispatch_into=None) -> None:
    """Logits (`router_warps_per_expert` warps per token and expert), then one block per token: scores, (grouped) top-k or
    hash ids, weights; dispatch tickets. ``counts`` must be zero on entry (`dispatch` leaves it
    zero); ``counts`` and ``tickets`` None: no tickets (the small-T path needs none); ``logits``
    is fp32 ``[T, E]`` scratch. A hash-routing token id outside
    ``[0, vocab)`` reads ``tid2eid`` row 0 and records `fp4kit.runtime.status.TOKEN_RANGE`.
    ``dispatch_into=(plan, done)``: the router's last block also runs `dispatch` into ``plan``
    (``done``: uint32 ``[1]``, zero on entry and left zero), one launch fewer."""
    t, h = x.shape
    e = gate_weight.shape[0]
    for name, a in (("x", x), ("gate_weight", gate_weight)):
        if a.dtype not in (arrays.BF16, np.dtype(np.float32)):
            raise TypeError(f"{name}: expected bfloat16 or float32, got {a.dtype}")
    name = f"moe_router_logits_{_suffix(x.dtype)}_{_suffix(gate_weight.dtype)}"
    wpe = router_warps_per_expert(h, e, t, loader.current_sm_count())
    loader.get_kernel(_MODULE, name).launch((-(-e // (8 // wpe)), t), 256, (x, gate_weight, _U32(e), _U32(h), _U32(wpe), logits))
    loader.get_kernel(_MODULE, "moe_router")(
        t, 256, (logits, _opt(bias), _opt(token_ids), _opt(tid2eid), _U32(0 if tid2eid is None else tid2eid.shape[0]),
                 status.device_word(), _U32(e), _U32(cfg.top_k),
                 _I32(SCORE_FUNC_CODES[cfg.score_func]), _U32(cfg.n_group), _U32(cfg.topk_group),
                 _I32(cfg.renormalize), np.float32(cfg.routed_scale), ids, weights, _opt(counts), _opt(tickets),
                 *_dispatch_args(dispatch_into, ids.size)))


def _dispatch_args(dispatch_into, pairs: int) -> tuple:
    """The router's dispatch arguments (done, pairs, the plan's outputs), or nulls."""
    if dispatch_into is None:
        return 0, _U32(0), 0, 0, 0, 0, 0, 0
    plan, done = dispatch_into
    return (done, _U32(pairs), plan.offsets, plan.active, plan.num_active, plan.slot_row, plan.row_token,
            plan.row_weight)


def route_small(x, gate_weight, bias, token_ids, tid2eid, cfg, ids, weights, logits, done, x_amax, x_act=None, *,
                release_next: bool = False) -> bool:
    """The small-T path's router in one launch (`moe_route_*`): the logits, then the last block of
    each token runs the router for it (``done [T]`` uint32, zero on entry and left zero) and, with
    ``x_amax [T]`` (uint32, W4A4), writes the token's max |x| for the next launch's in-block
    quantization, or with ``x_act`` (an `Nvfp4Tensor` [1, H], W4A4 at T = 1, H <= 8192) writes x
    quantized to NVFP4 as `fp4kit.ops.quant.quantize` would. No tickets: the small-T path reads the
    ids directly.

    ``release_next``: the launch releases the next one on the stream right after its own wait for
    the one before (common/pdl.cuh), where its grid is a single wave; for a `small_gate_up` with
    ``shared_first`` to run its shared expert beside the router. Returns whether it does."""
    t, h = x.shape
    if x_act is not None and (t != 1 or h > ROUTER_QUANTIZE_MAX_HIDDEN or h % 16):
        raise ValueError(f"x_act: the router quantizes one token of at most {ROUTER_QUANTIZE_MAX_HIDDEN} values "
                         f"(a multiple of 16), got x of shape {tuple(x.shape)}")
    e = gate_weight.shape[0]
    for name, a in (("x", x), ("gate_weight", gate_weight)):
        if a.dtype not in (arrays.BF16, np.dtype(np.float32)):
            raise TypeError(f"{name}: expected bfloat16 or float32, got {a.dtype}")
    kernel = loader.get_kernel(_MODULE, f"moe_route_{_suffix(x.dtype)}_{_suffix(gate_weight.dtype)}")
    wpe = router_warps_per_expert(h, e, t, loader.current_sm_count())
    grid = (-(-e // (8 // wpe)), t)
    # a waiting block of the next launch must never hold a slot one of this launch's blocks needs
    release_next = bool(release_next) and grid[0] * grid[1] <= kernel.resident_blocks(256)
    kernel.launch(grid, 256, (
        x, gate_weight, _U32(e), _U32(h), _U32(wpe), logits, done, _opt(x_amax), *_nvfp4_out(x_act), _opt(bias),
        _opt(token_ids), _opt(tid2eid),
        _U32(0 if tid2eid is None else tid2eid.shape[0]), status.device_word(), _U32(cfg.top_k),
        _I32(SCORE_FUNC_CODES[cfg.score_func]), _U32(cfg.n_group), _U32(cfg.topk_group), _I32(cfg.renormalize),
        np.float32(cfg.routed_scale), ids, weights, _I32(release_next)))
    return release_next


#: the widest row the router's last block quantizes (moe.cu block_quantize_row: two 16-value blocks
#: a thread, 256 threads)
ROUTER_QUANTIZE_MAX_HIDDEN = 8192


def _nvfp4_out(t) -> tuple:
    """Kernel arguments of an NVFP4 tensor a launch writes (moe.cu ``Nvfp4Out``), or nulls."""
    return (0, 0, 0) if t is None else (t.packed, t.block_scales, t.global_scale)


def dispatch(counts, tickets, ids, weights, top_k: int, plan) -> None:
    """Offsets, active experts, the sorted row of every (token, slot) and the token and weight of
    every sorted row; zeroes ``counts``. One block. Counts or tickets of another call (overlapping
    calls of one layer) record `fp4kit.runtime.status.MOE_DISPATCH` and route nothing
    (`fp4kit.reference.moe.dispatch`)."""
    e = counts.shape[0]
    loader.get_kernel(_MODULE, "moe_dispatch", block=1024)(
        1, 1024, (counts, tickets, ids, weights, _U32(e), _U32(ids.size), _U32(top_k), plan.offsets, plan.active,
                  plan.num_active, plan.slot_row, plan.row_token, plan.row_weight, status.device_word()))


#: rows of one expert that one pass of its weights serves in the grouped GEMM (8 per token tile, up
#: to 64); None: by the rows an expert is expected to get (`grouped_pass_rows`)
GROUPED_PASS_ROWS = None


#: the widest pass for NVFP4 activations (W4A4): their 64-row build spills registers (moe.cu
#: moe_gemm_nvfp4_8, 88 bytes of stack); H200, V4-Flash W4A4 T = 4096: 9856 us at 32 rows, 10815 at 64
GROUPED_PASS_ROWS_NVFP4_MAX = 32


def grouped_pass_rows(tokens: int, top_k: int, experts: int, nvfp4_act: bool = False) -> int:
    """Rows per pass of the grouped GEMM for ``tokens`` tokens routed top-``top_k`` over ``experts``
    experts (``nvfp4_act``: W4A4, at most `GROUPED_PASS_ROWS_NVFP4_MAX`). An expert gets at most
    one row per token, but rows beyond a pass are only served by another pass over the same weight
    tile (from L2), so the pass is sized to the rows an expert is expected to get rather than the
    worst case: wider passes stage empty token tiles and take more registers per thread (fewer
    resident blocks). The pass is the narrowest that holds a
    third more than the mean rows of an expert, ``tokens * top_k / experts``. H200, the MoE layer
    on the sorted path, µs at 8 / 16 / 32 / 64 rows per pass (mean rows): V4-Flash W4A16 T = 16
    (0.4) 377 / 444 / 516 / 822, T = 64 (1.5) 849 / 994 / 1155 / 1871, T = 128 (3) 1100 / 1255 /
    1453 / 2336, T = 512 (12) 2561 / 1877 / 1907 / 2814, T = 4096 (96) 16900 / 11756 / 9469 / 8776;
    W4A4 T = 64 974 / 1032 / 1212 / 2241, T = 4096 17182 / 12550 / 9856 / 10815; V3 W4A16 T = 512
    (16) 5406 / 4052 / 3440 / 4863; all tokens on the same 6 experts at T = 512 (512 rows each)
    3219 / 1699 / 1306 / 1211 (the worst case of a narrow pass: 2.7x at 8 rows)."""
    if GROUPED_PASS_ROWS is not None:
        return GROUPED_PASS_ROWS
    mean = tokens * top_k / experts
    rows = min(tokens, 8 * gemm_ops.token_tiles(math.ceil(mean * 4 / 3)))
    return min(rows, GROUPED_PASS_ROWS_NVFP4_MAX) if nvfp4_act else rows


#: resident blocks per SM the grouped GEMM's 8- and 16-row passes are built for: 3 (moe.cu
#: ``moe_gemm_*_occ3``: 77-80 registers, no spill in the mainloop, the mainloop up to 10.5 % longer)
#: or 2 (the GEMM engine's bound of 128 registers, where they take 78-124). Half again the warps
#: per scheduler for a loop that is issue- and latency-bound. H200, the MoE layer on the sorted
#: path, V4-Flash, 2 -> 3 per SM (three interleaved rounds, bit-identical): W4A4 T = 64 (8-row
#: passes, 121 registers at 2) 966 -> 886 us, T = 512 (16-row) 1946 -> 1892; W4A16 T = 512 1849
#: -> 1782; W4A16 T = 32 and 64 (8-row passes, 78 registers: three per SM either way) equal
GROUPED_BLOCKS_PER_SM = 3


def grouped_kernel_name(tiles: int, swiglu: bool = False, dense: bool = False, combine: bool = False) -> str:
    """The grouped GEMM build (``{}``: the activation kind) for ``tiles`` token tiles of 8 rows;
    ``swiglu``: the one with SwiGLU in its epilogue (and a dense expert); ``combine``: the one with
    the combine in its epilogue (and a dense expert); ``dense``: a plain one with a dense expert
    (the SwiGLU and dense builds take bf16 activations only)."""
    occ3 = GROUPED_BLOCKS_PER_SM == 3 and tiles <= 2
    kind = "swiglu_" if swiglu else "combine_" if combine else "dense_" if dense else ""
    return f"moe_gemm_{kind}{{}}_{tiles}" + ("_occ3" if occ3 else "")


def combine_column_groups(hidden: int) -> int:
    """Column groups of the grouped GEMM's blocks over an output of ``hidden`` columns: the arrival
    counts of the combine in the down GEMM are per (token, column group)."""
    return gemm_ops.row_groups(hidden, 1)


def grouped_gemm(act, stack, out, *, plan, gather: bool, out_col: int = 0, max_rows: int | None = None,
                 side_by_side: bool = False, swiglu: tuple | None = None, dense: tuple | None = None,
                 combine: tuple | None = None) -> None:
    """``out[r, out_col : out_col + N] = alpha_e * A[row r] @ W[e]^T`` for every sorted row ``r`` of
    every active expert ``e``; ``act`` an `Nvfp4Tensor` or bf16, gathered through the sorted rows'
    tokens when ``gather`` (the layer input) or read in sorted order (the down-projection input).
    ``stack`` is tiled (`ExpertStack.to_tiled`). ``max_rows``: the rows one pass of an expert's
    weights serves (default: every row; an expert with more takes more passes, `grouped_pass_rows`).
    ``side_by_side``: expert ``e``'s i-th row lands in row ``i`` of ``out`` at columns ``out_col + e *
    N ..`` instead (a grouped projection whose groups' outputs sit side by side in each row).
    ``swiglu=(row_scale, limit)``: ``stack`` is W13 (gate and up interleaved in chunks of 16 rows)
    and ``out`` bf16 ``[rows, N / 2]`` gets their SwiGLU, computed in the GEMM's epilogue: bit for bit
    ``quant.swiglu`` of the GEMM's bf16 output (the optional clamp ``limit``, times ``row_scale`` per
    sorted row unless None). bf16 activations only (W4A16).
    ``dense=(weight, row_decode, first, rows, limit)``: one more expert with its own weight (a tiled
    `Nvfp4Tensor` of ``stack``'s ``[N, K]``, e.g. the shared expert's) on sorted rows ``first ..
    first + rows - 1``, whose ``plan.row_token`` the caller has filled with their tokens; its own
    SwiGLU ``limit`` and no ``row_scale``. Its rows take ``ceil(rows / pass)`` more block rows.
    ``combine=(arrivals, weighted, shared, shared_rows, combined)`` (the down projection, fp32
    ``out``): the blocks also combine into bf16 ``combined [T, N]`` as `combine` does, each token's
    column group by the block whose rows complete it; ``arrivals`` uint32 ``[T *
    combine_column_groups(N)]``, zero on entry and left zero; ``shared``: a shared expert's bf16
    output or None; ``shared_rows``: the dense expert's rows are a folded shared expert's."""
    if stack.layout != "tiled":
        raise ValueError("stack: the grouped GEMM reads tiled expert stacks; convert with stack.to_tiled()")
    n, k = stack.shape[1:]
    slots = min(stack.shape[0], plan.slot_row.size)
    tiles = gemm_ops.token_tiles(plan.slot_row.size if max_rows is None else max_rows)
    common = (stack.packed, stack.block_scales, stack.decode, _opt(stack.row_decode),
              plan.row_token if gather else 0, out, _I32(out.dtype == np.float32), _U32(out.shape[-1]), _U32(out_col),
              _I32(side_by_side), plan.offsets, plan.active, plan.num_active, _U32(n), _U32(k), _U32(slots))
    dense_blocks = 0
    if dense is None:
        common += (0, 0, 0, 0, _U32(0), _U32(0), np.float32(0.0), _I32(0))
    else:
        weight, row_decode, first, rows, limit = dense
        if weight.scale_layout != "tiled" or tuple(weight.shape) != (n, k):
            raise ValueError(f"dense: expected a tiled NVFP4 weight [{n}, {k}], got {weight.scale_layout} "
                             f"{list(weight.shape)}")
        if side_by_side or first + rows > out.shape[0]:
            raise ValueError(f"dense: rows {first} .. {first + rows - 1} must lie in the output's {out.shape[0]} rows")
        if isinstance(act, Nvfp4Tensor):
            raise ValueError("dense: a dense expert rides in the bf16-activation (W4A16) builds only")
        common += (weight.packed, weight.block_scales, weight.global_scale, _opt(row_decode), _U32(first),
                   _U32(rows), np.float32(limit or 0.0), _I32(limit is not None))
        dense_blocks = -(-rows // (8 * tiles))
    if swiglu is not None:
        if isinstance(act, Nvfp4Tensor) or out.dtype != arrays.BF16 or out.shape[-1] * 2 != n or n % 32:
            raise ValueError(f"swiglu: the SwiGLU epilogue takes a bf16 activation, a W13 stack (rows a multiple of "
                             f"32, here {n}) and a bf16 output of {n // 2} columns, got {arrays.describe(out)}")
        if out_col or side_by_side:
            raise ValueError("swiglu: the SwiGLU epilogue writes whole rows (no out_col, no side_by_side)")
        row_scale, limit = swiglu
        common += (_opt(row_scale), np.float32(limit or 0.0), _I32(limit is not None))
    if combine is not None:
        arrivals, weighted, shared, shared_rows, combined = combine
        t = combined.shape[0]
        if (out.dtype != np.float32 or out_col or side_by_side or combined.shape != (t, n)
                or arrivals.size != t * combine_column_groups(n) or plan.slot_row.size % t):
            raise ValueError(f"combine: the down projection's fp32 rows into bf16 [T, {n}] with {t} * "
                             f"{combine_column_groups(n)} arrival counts, got {arrays.describe(combined)} and "
                             f"{arrivals.size} counts")
        common += (arrivals, plan.row_token, plan.slot_row, plan.weights, _I32(weighted), _opt(shared),
                   _I32(bool(shared_rows)), combined, _U32(plan.slot_row.size // t))
    name = grouped_kernel_name(tiles, swiglu is not None, dense is not None, combine is not None)
    kernel, args = _kernel_and_args(act, name, common)
    kernel.launch((gemm_ops.row_groups(n, 1), slots + dense_blocks), 256, args, shared_mem=gemm_ops.shared_bytes(tiles))


def _tile_chunks(k: int) -> int:
    return -(-k // TILE_K)


#: gate|up pairs (16 inner rows each) per block of the small-T first launch: its 8 warps split K
#: 8 / pairs ways; None picks by size (`small_pairs_per_block`)
SMALL_PAIRS_PER_BLOCK = None
#: tokens per block of a folded shared expert in the small-T first launch: the 8 columns of the
#: m16n8k16 MMA (moe.cu kSharedTokens)
SHARED_TOKENS_PER_BLOCK = 8
#: the kernel variants of the two small-T launches (the ones moe.cu instantiates, measured there);
#: None for the first launch: by token and block count (`small_gate_up_variant`)
SMALL_GATE_UP_VARIANT = None
#: up to this many tokens the first launch runs in 4-warp blocks (`small_gate_up_variant`), above it
#: in 8-warp ones (``d2c1``)
SMALL_NARROW_MAX_TOKENS = 4
SMALL_DOWN_VARIANT = "d1c2b4"
#: weight groups (4 tiles of 64 K each) a warp of the small-T launches requests into L2 ahead of
#: loading them into registers (moe.cu `WarpGemv::l2_ahead`), for (gate|up, down), up to
#: `SMALL_L2_AHEAD_MAX_TOKENS` tokens; 0: none. Read at each launch; the same bits at any value.
#: H100, V4-Flash at T = 1, one process, two runs of two interleaved rounds, (gate|up, down) = (0, 0)
#: / (0, 1) / (0, 2) / (0, 3) / (0, 4): W4A16 48.2 / 46.6 / 47.6 / 48.8 / 49.3 us, W4A4 59.7 / 58.6 /
#: 59.7 / 60.8 / 61.3; ahead in gate|up slower ((1, 0) 49.4, (1, 2) 50.3, (3, 7) 55.2): a wave of
#: either launch touches more weight than L2 holds, so requests far ahead evict what is needed now.
#: In the decode step the request costs more than it saves: H100, v4-flash-slice, 4 layers, W4A16,
#: five interleaved rounds, batch 1 578.4-585.6 us with (0, 1) against 568.5-576.2 with (0, 0)
#: (every round 6-13 us faster without; batch 2, where neither requests, equal). So none by default;
#: a caller that runs the layer alone may set (0, 1)
SMALL_L2_AHEAD = (0, 0)
#: T = 2 and 8 measured slower with any request (H100, V4-Flash: W4A16 T = 2 77.0 us at (0, 0),
#: 77.3 at (0, 1); T = 8 251.4, 254.2; W4A4 likewise)
SMALL_L2_AHEAD_MAX_TOKENS = 1
#: W4A4 at T = 1 (the layer's ``quantize_out``): the last this-many blocks of the gate|up launch to
#: finish share the quantization of its SwiGLU output for the down launch, each 1/N of the 16-value
#: blocks (moe.cu ``LastQuantize``); 1: the last block alone (at V4-Flash widths 896 blocks of 16 in
#: 128 threads, ~7 dependent L2 round trips each). Read at each launch; held to half the blocks the
#: GPU holds at once (`last_quantize_spread`). The same bits whatever the count. H100, the layer at
#: T = 1, three interleaved rounds, N = 1 / 4 / 8 / 16 / 32: V4-Flash 62.4 / 60.2 / 60.3 / 60.3 /
#: 60.5 us, V3 124.4 / 123.7 / 123.6 / 123.7 / 123.6
LAST_QUANTIZE_SPREAD = 8
#: the default variants' builds without per-tile bounds tests (``<variant>w``) where K is whole scale
#: groups (DeepSeek's H and I): 2.81 -> 2.57 SASS instructions per weight in the gate|up loop, 2.79
#: -> 2.64 in the down loop. H200, back-to-back runs, V4-Flash: T = 1 50.8 -> 50.0 us (W4A16), 64.4 -> 63.3
#: (W4A4); T = 8 240 -> 236, 272 -> 266; bit-identical (tests/test_moe_small_variants_gpu.py)
SMALL_WHOLE_FETCHES = True
#: the down-projection variants moe.cu instantiates (for scripts/sweep_moe_small.py)
SMALL_DOWN_VARIANTS = ("d1c2b4", "d2c1b2", "d2c2b2", "d4c1b2")
#: the variants with a whole-fetch build (moe.cu)
SMALL_WHOLE_VARIANTS = ("d2c1", "d1c2b4", "d2c1n4", "d1c1n4b7")
#: the first launch's variants: (warps per block, blocks per multiprocessor its registers allow,
#: pairs per block or None for the rule of `small_pairs_per_block`). ``d2c1n4`` keeps two weight
#: groups in flight per warp, ``d1c1n4b7`` one (72 registers, so 7 blocks per SM instead of 4), at
#: one pair per block: more, shorter blocks (its pair rule, one wave of longer ones, measured slower)
SMALL_GATE_UP_GEOMETRY = {"d2c1": (8, 2, None), "d2c1n4": (4, 4, None), "d1c1n4b7": (4, 7, 1)}
#: the 4-warp geometries: ``d1c1n4b7`` where its blocks fill one wave or their last wave at least
#: half, else ``d2c1n4``. H200, the MoE layer, two interleaved rounds, W4A16 / W4A4, d2c1n4 -> d1c1n4b7
#: (fraction of the last wave): V4-Flash T = 1 (0.97) 47.9 -> 46.0 / 59.5 -> 60.4 us, T = 2 (0.94)
#: 76.7 -> 71.2 / 88.8 -> 85.5, T = 3 (0.91) 106.7 -> 100.5 / 123.0 -> 116.4, T = 4 (0.88) 127.3 ->
#: 126.3 / 143.0 -> 143.9; V3 T = 1 (0.11) 97.6 -> 99.7 / 112.3 -> 118.6, T = 2 (0.22) 152.5 ->
#: 153.3 / 169.9 -> 174.1, T = 3 (0.32) 219.2 -> 210.3 / 236.6 -> 234.3, T = 4 (0.43) 263.7 -> 261.6
#: / 282.5 -> 285.8. The decode step (V4-Flash slice) at batch 1: 535.4 -> 528.3 us
SMALL_MANY_BLOCKS, SMALL_FEW_BLOCKS = "d1c1n4b7", "d2c1n4"


def small_l2_ahead(tokens: int) -> tuple[int, int]:
    """`SMALL_L2_AHEAD` for a call of ``tokens`` tokens: (0, 0) above `SMALL_L2_AHEAD_MAX_TOKENS`."""
    return SMALL_L2_AHEAD if tokens <= SMALL_L2_AHEAD_MAX_TOKENS else (0, 0)


def _pair_blocks(inner: int, pairs: int) -> int:
    """Blocks of the first launch along ``inner`` gate|up rows at ``pairs`` pairs (16 rows each) per block."""
    return -(-inner // (16 * pairs))


def small_gate_up_variant(tokens: int, inner: int, assignments: int, sms: int) -> str:
    """The first launch's kernel variant for ``tokens`` tokens, ``assignments`` rows of blocks (one
    per (token, expert) and per shared-expert block) over ``inner`` rows, on ``sms`` multiprocessors:
    `SMALL_GATE_UP_VARIANT` if set; above `SMALL_NARROW_MAX_TOKENS` tokens 8-warp blocks; else
    `SMALL_MANY_BLOCKS` where its blocks fill one wave or leave their last wave at least half full,
    `SMALL_FEW_BLOCKS` where that wave would be mostly idle (a tail of a few blocks costs a whole
    block's time)."""
    if SMALL_GATE_UP_VARIANT is not None:
        return SMALL_GATE_UP_VARIANT
    if tokens > SMALL_NARROW_MAX_TOKENS:
        return "d2c1"
    _, per_sm, pairs = SMALL_GATE_UP_GEOMETRY[SMALL_MANY_BLOCKS]
    blocks, slots = _pair_blocks(inner, pairs) * assignments, per_sm * sms
    tail = blocks % slots
    return SMALL_MANY_BLOCKS if blocks <= slots or tail == 0 or 2 * tail >= slots else SMALL_FEW_BLOCKS


def _whole_variant(variant: str, k: int) -> str:
    """The small-T kernel variant to launch over a K of ``k``: its build without per-tile bounds
    tests (``<variant>w``) where `SMALL_WHOLE_FETCHES` is on, the variant has one and K is whole scale
    groups (256), else the variant itself."""
    whole = SMALL_WHOLE_FETCHES and variant in SMALL_WHOLE_VARIANTS and _tile_chunks(k) % GROUP_CHUNKS == 0
    return variant + "w" if whole else variant


def small_pairs_per_block(inner: int, assignments: int, sms: int, warps: int = 8, blocks_per_sm: int = 2) -> int:
    """Pairs per block (1, 2, 4 or 8, at most ``warps``): the fewest that fit the launch in one wave
    of ``blocks_per_sm`` blocks per multiprocessor (V4-Flash at T = 1 on 8-warp blocks: 4 pairs,
    224 blocks, measured 3-6 % faster than 448 blocks in 1.7 waves), else the most that still leave
    ``blocks_per_sm`` blocks per multiprocessor (longer weight streams per warp)."""
    if SMALL_PAIRS_PER_BLOCK is not None:
        return min(SMALL_PAIRS_PER_BLOCK, warps)
    choices = [pp for pp in (1, 2, 4, 8) if pp <= warps]
    for pp in choices:
        if _pair_blocks(inner, pp) * assignments <= blocks_per_sm * sms:
            return pp
    pp = 1
    while pp < warps and _pair_blocks(inner, 2 * pp) * assignments >= blocks_per_sm * sms:
        pp *= 2
    return pp


def _weight_rows(w, step: int = 1, first: int = 0) -> tuple:
    """Kernel arguments of one weight of the small-T launches (moe.cu ``StackRows``): a tiled
    `ExpertStack`, a ``(tiled Nvfp4Tensor, row_decode or None)`` pair (the shared expert's dense
    weight), or None (absent)."""
    if w is None:
        return (0, 0, 0, 0, 0, _U32(0), _U32(0), _U32(0))
    if isinstance(w, tuple):
        tensor, row_decode = w
        if tensor.scale_layout != "tiled":
            raise ValueError("shared: the small-T MoE path reads tiled weights (a device Linear keeps its weight tiled)")
        return (tensor.packed, tensor.block_scales, 0, tensor.global_scale, _opt(row_decode), _U32(tensor.shape[0]),
                _U32(step), _U32(first))
    if w.layout != "tiled":
        raise ValueError("stack: the small-T MoE path reads tiled expert stacks; convert with stack.to_tiled()")
    return (w.packed, w.block_scales, w.decode, 0, _opt(w.row_decode), _U32(w.shape[1]), _U32(step), _U32(first))


def small_gate_up(act, gate, up, ids, row_scale, limit, out, *, shared=None, x_amax=None, h_amax=None,
                  quantize_out=None, shared_first: bool = False) -> tuple:
    """The small-T path's first launch: for every (token, slot) assignment ``a`` of ``ids [T, top_k]``,
    ``out[a] = swiglu(gate_e(x_t), up_e(x_t))`` (bf16-rounded GEMM outputs, optional clamp ``limit``
    and row factor ``row_scale [T * top_k]``) with ``e = ids[a]``; fp32 ``out`` for the W4A4 quantize
    that follows, bf16 for W4A16. ``gate`` and ``up`` are ``(stack, tile step, first tile)``: the
    interleaved fused stack twice with step 2 (first 0 and 1), or the two unfused stacks with step 1.

    ``shared``: ``(gate_up weight [2I, H] interleaved, its row_decode or None, its limit)`` of a
    shared expert folded in as one more expert that every token selects: rows ``T * top_k + t`` of
    ``out`` are its SwiGLU output for token ``t`` (no routing weight). Its blocks take up to
    `SHARED_TOKENS_PER_BLOCK` tokens each (one per MMA column), so its weights are streamed once
    per 8 tokens.

    ``x_amax`` (W4A4 in three launches): ``act`` is the raw layer input (bf16 or fp32), quantized
    in the blocks with the global amax of `route_small`'s per-token maxima; each block writes the
    max |SwiGLU output| it produced to ``h_amax`` (uint32, one per block: grid x * y words) for
    `small_down`. ``quantize_out = (h_amax, done, h_act, s_act)`` (W4A4 at T = 1, ``act`` NVFP4):
    the launch's last blocks to finish (`LAST_QUANTIZE_SPREAD` of them; ``done``: uint32 [1], zero
    on entry and left zero) quantize the fp32 ``out`` into ``h_act`` (the routed rows) and ``s_act``
    (a folded shared expert's rows, or None), as two `fp4kit.ops.quant.quantize` launches would;
    ``h_amax`` holds a word per block.

    ``shared_first`` (W4A16 with a shared expert): its blocks come first in launch order and do not
    wait for the launch before; only right after a `route_small` over the same ``act`` that
    released this launch (``release_next``), on the same stream: the router's wait has made ``act``
    final, and the shared expert's weights stream while the router works.
    Returns the grid ``(x, y)``."""
    (gs, g_step, g_first), (us, u_step, u_first) = gate, up
    if shared_first and (shared is None or isinstance(act, Nvfp4Tensor) or x_amax is not None):
        raise ValueError("shared_first: needs a shared expert and a bf16 activation staged as it is "
                         "(W4A16: no NVFP4 act, no x_amax)")
    h = gs.shape[2]
    inner = out.shape[1]
    routed = ids.size
    tokens = ids.shape[0]
    # a shared expert's blocks take up to SHARED_TOKENS_PER_BLOCK tokens each (moe.cu gate_up)
    shared_rows = 1 if shared is None else min(tokens, SHARED_TOKENS_PER_BLOCK)
    blocks_y = routed + (0 if shared is None else -(-tokens // SHARED_TOKENS_PER_BLOCK))
    s_gate = s_up = None
    s_limit = None
    if shared is not None:
        s_weight, s_row_decode, s_limit = shared
        s_gate, s_up = (s_weight, s_row_decode), (s_weight, s_row_decode)
    sms = loader.current_sm_count()
    geometry = small_gate_up_variant(tokens, inner, blocks_y, sms)
    warps, per_sm, pp = SMALL_GATE_UP_GEOMETRY[geometry]
    if pp is None or SMALL_PAIRS_PER_BLOCK is not None:  # the knob overrides a geometry's fixed pairs
        pp = small_pairs_per_block(inner, blocks_y, sms, warps, per_sm)
    variant = _whole_variant(geometry, h)
    common = (*_weight_rows(gs, g_step, g_first), *_weight_rows(us, u_step, u_first), *_weight_rows(s_gate, 2, 0),
              *_weight_rows(s_up, 2, 1), ids, _opt(row_scale), _U32(ids.shape[1]), _U32(routed),
              np.float32(0.0 if limit is None else limit), _I32(limit is not None),
              np.float32(0.0 if s_limit is None else s_limit), _I32(s_limit is not None), _U32(h), _U32(inner),
              _U32(pp), out, _I32(out.dtype == np.float32), _I32(shared_first), _U32(small_l2_ahead(tokens)[0]))
    grid = (_pair_blocks(inner, pp), blocks_y)
    smem = shared_rows * (_tile_chunks(h) * TILE_K + 8) * 2  # the staged rows, Kp + 8 bf16 apart (moe.cu staged_ld)
    if x_amax is not None:
        kernel = loader.get_kernel(_MODULE, f"moe_small_gate_up_quant_{_suffix(act.dtype)}_{variant}")
        args = (act, x_amax, _U32(ids.shape[0]), status.device_word(), h_amax, *common)
    else:
        if quantize_out is not None and not isinstance(act, Nvfp4Tensor):
            raise ValueError("quantize_out: the last block's quantization runs in the NVFP4-activation launch")
        q_amax, q_done, h_act, s_act = (None,) * 4 if quantize_out is None else quantize_out
        if quantize_out is not None and out.dtype != np.float32:
            raise TypeError(f"out: the last block quantizes fp32 SwiGLU outputs, got {out.dtype}")
        spread = 0
        if quantize_out is not None:
            launched = loader.get_kernel(_MODULE, f"moe_small_gate_up_nvfp4_{variant}")
            spread = last_quantize_spread(grid[0] * grid[1], launched.resident_blocks(32 * warps, smem))
        extra = (_opt(q_amax), _opt(q_done), _U32(spread), *_nvfp4_out(h_act), *_nvfp4_out(s_act), status.device_word())
        kernel, args = _kernel_and_args(act, f"moe_small_gate_up_{{}}_{variant}", common, nvfp4_extra=extra)
    kernel.launch(grid, 32 * warps, args, shared_mem=smem)
    return grid


def last_quantize_spread(blocks: int, resident: int) -> int:
    """How many of the last blocks of a W4A4 gate|up launch of ``blocks`` blocks share the
    quantization of its output (`LAST_QUANTIZE_SPREAD`), at most half the ``resident`` blocks the
    GPU holds at once: those blocks wait for the rest, which must find room to run."""
    return max(1, min(LAST_QUANTIZE_SPREAD, blocks, resident // 2))


def residual_norm_args(then_norm, out) -> tuple:
    """The kernel arguments of the residual step a launch that writes ``out`` (bf16 ``[T, H]``, the
    sublayer's output) ends with: ``then_norm = (ResidualNorm, y)`` (validated by the layer: ``resid``
    fp32 ``[T, H]`` updated in place, ``y`` the bf16 ``[T, H]`` RMSNorm written) or None (no step).
    The quad or channel layout is chosen as `add_rmsnorm` chooses it (the same bits)."""
    if then_norm is None:
        return (0, 0, 0, np.float32(0.0), _I32(0))
    norm, y = then_norm
    quads = ew_ops.quad_rows(out.shape[1], norm.resid, norm.weight, y, out)
    return (norm.resid, norm.weight, y, np.float32(norm.eps), _I32(quads))


def small_down(act, stack, ids, weights, weighted: bool, shared_out, out, *, shared=None, h_amax=None,
               amax_blocks: tuple | None = None) -> None:
    """The small-T path's second launch: ``out[t] = sum over slots j (in order) of alpha * act[t, j] @
    W2[ids[t, j]]^T (times ``weights[t, j]`` when ``weighted``) + shared_out[t]``, bf16 ``[T, H]``.

    ``shared``: ``(down weight [H, I], its row_decode or None, its activation)`` of a shared expert
    folded in (see `small_gate_up`): its down projection of activation row ``T * top_k + t``
    (bf16: rows of ``act``; NVFP4: its own tensor ``[T, I]``, passed here) is rounded to bf16 and
    added after the routed slots.

    ``h_amax`` (W4A4 in three launches): ``act`` is `small_gate_up`'s fp32 output, quantized in the
    blocks with the global amax of that launch's per-block maxima, ``amax_blocks = (routed blocks,
    all blocks)`` of its grid (the shared expert's rows keep the amax of its own blocks)."""
    t, h = out.shape
    top_k, inner = ids.shape[1], stack.shape[2]
    routed = ids.size
    s_weight, s_act = (None, None) if shared is None else ((shared[0], shared[1]), shared[2])
    common = (*_weight_rows(stack), *_weight_rows(s_weight), _I32(shared is not None), ids, weights, _I32(weighted),
              _U32(top_k), _U32(routed), _opt(shared_out), out, _U32(h), _U32(inner),
              _U32(small_l2_ahead(ids.shape[0])[1]))
    variant = _whole_variant(SMALL_DOWN_VARIANT, inner)
    if h_amax is not None:
        kernel = loader.get_kernel(_MODULE, f"moe_small_down_quant_{variant}")
        args = (act, h_amax, _U32(amax_blocks[0]), _U32(amax_blocks[1]), status.device_word(), *common)
    else:
        second = (0, 0, 0) if s_act is None else (s_act.packed, s_act.block_scales, s_act.global_scale)
        kernel, args = _kernel_and_args(act, f"moe_small_down_{{}}_{variant}", common, nvfp4_extra=second)
    slots = top_k + (shared is not None)
    kernel.launch((h // 16, t), 256, args, shared_mem=slots * _tile_chunks(inner) * TILE_K * 2)


def combine(y, slot_row, weights, weighted: bool, shared, out, shared_rows=None, then_norm=None) -> None:
    """``out[t] = sum_j y[slot_row[t, j]] (* weight) + shared[t]``; ``shared_rows`` (fp32 ``[T, H]``,
    instead of the bf16 ``shared``): a folded shared expert's rows of ``y``, rounded to bf16 first.
    ``then_norm = (ResidualNorm, y)``: each token's block then runs the residual step on its row of
    ``out`` (`residual_norm_args`)."""
    t, h = out.shape
    top_k = slot_row.size // t
    loader.get_kernel(_MODULE, "moe_combine")(
        t, 256, (y, slot_row, weights, _I32(weighted), _opt(shared), _opt(shared_rows), out, _U32(h), _U32(top_k),
                 *residual_norm_args(then_norm, out)))


def _kernel_and_args(act, name: str, common: tuple, nvfp4_extra: tuple = ()):
    """Kernel ``name`` for the activation's kind (``{}`` becomes ``nvfp4`` or ``bf16``) and its
    arguments: the activation (NVFP4: codes, scales, global scale, then ``nvfp4_extra``), then
    ``common``."""
    if isinstance(act, Nvfp4Tensor):
        return (loader.get_kernel(_MODULE, name.format("nvfp4")),
                (act.packed, act.block_scales, act.global_scale, *nvfp4_extra, *common))
    return loader.get_kernel(_MODULE, name.format("bf16")), (act, *common)


def _opt(a):
    return 0 if a is None else a
