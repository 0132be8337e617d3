"""NVFP4 GEMM ops: ``y = alpha * A @ W^T (+ bias)`` with W an NVFP4 weight, launching
``raw_kernels/gemm.cu``.

On the GPU the weight must be in the tiled layout (`fp4kit.formats.to_tiled`, done once when a
layer is built); numpy arrays run the reference with either layout. Two paths, picked by the number
of activation rows M (``decode_max_m``; by default `DECODE_MAX_M` on Hopper, 64 elsewhere):

* **engine** (M <= ``decode_max_m``): one launch that streams the weight, dequantizing it in
  registers and multiplying on the bf16 tensor cores: up to 8 rows on grids of about one wave the
  GEMV kernels (`gemv_launch`: K split over the warps of one block), ``mma.sync`` up to 16 rows
  otherwise, and on Hopper the warpgroup MMA (``wgmma``) from `WGMMA_MIN_M` rows, up to 128 rows
  per block and more rows as token chunks of the same launch (elsewhere ``mma.sync`` once per 64
  rows). The wgmma launch is preceded by a small staging launch that writes the activation (W4A4:
  decoded) as the byte images of the kernel's shared-memory windows, which its blocks then fetch
  with one bulk copy per window instead of scattering 4-byte pairs themselves. Small weights are
  split along K over more blocks with a deterministic reduction (in a thread-block cluster where a
  kernel for that split count exists). No library call, so it can be captured in a CUDA graph.
* **prefill** (M > ``decode_max_m``): the weight (and an NVFP4 activation) dequantized exactly into
  a reusable bf16 workspace, a cuBLAS bf16 GEMM with fp32 output, then one epilogue kernel for
  alpha, bias and the output cast. cuBLAS cannot be captured in a CuPy graph.

The threshold and the launch shapes were chosen from ``benchmarks/bench_linear.py`` on an H200
(README, docs/gemm-engine.md); override the threshold per call with ``decode_max_m``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from ..formats import BLOCK_SIZE, GROUP_CHUNKS, TILE_K, TILE_ROWS, Nvfp4Tensor, tiled_dims, to_linear
from ..reference import gemm as ref
from ..runtime import arrays, loader, workspace
from . import elementwise as ew_ops

#: the largest M on the engine by default, with the wgmma kernels (Hopper; H200, both paths timed in
#: one run: the engine is faster up to 512 rows on 8 of 9 shapes, the dequantize + cuBLAS path from
#: 1024 rows on all but the smallest weights, where an eager call is host-bound); elsewhere the
#: mma.sync kernels re-read the weight per 64 rows, and 64 rows is the default
DECODE_MAX_M = 512
DECODE_MAX_M_MMA_SYNC = 64
_TOKEN_TILES = (1, 2, 4, 8)  # mma.sync kernels: 8 tokens per tile
#: weight row tiles (16 rows) per warp, by token tiles: more rows share each staged activation
ROW_TILES_PER_WARP = {1: 1, 2: 1, 4: 1, 8: 1}  # 4x2 and 8x2 spill
#: weight tiles a warp fetches at once, by token tiles (4 or 8; 8 only for 1 and 2 token tiles).
#: H200, one token tile, same run: the lm_head at M = 1 91.1 -> 80.0 us, 32768x1024 9.5 -> 9.2
FETCH_TILES = {1: 8, 2: 8, 4: 4, 8: 4}
#: split K until the grid has this many 8-warp blocks per SM (when K allows), by token tiles:
#: more tokens make the split-K partials larger, and their kernels are less bound by latency.
#: 0: the fewest splits that spread the blocks evenly over the SMs (`balanced_splits`): H200, M = 1,
#: 32768x1024 (256 row groups) 13.4 us in 2 splits -> 9.2 in 1, 18432x7168 (144 row groups) 34.6
#: in 1 split -> 29.6 in 4; M = 16 (was 4 blocks per SM) 32768x1024 16.6 -> 11.0, 4096x4096
#: 11.6 -> 9.8, 2048x7168 12.3 -> 10.0, equal or better on the other six shapes
BLOCKS_PER_SM = {1: 0, 2: 0, 4: 2, 8: 1}
#: `balanced_splits`: the busiest SM's blocks over the mean
WAVE_IMBALANCE = 1.15
#: ... but a grid of at least this many row groups per SM is not split: every SM already holds
#: several blocks at once, so an uneven count costs less than the split-K reduction (H200, M = 1,
#: same run: 40960x1024, 320 row groups, 16.7 us in the 2 balanced splits -> 11.9 unsplit)
UNSPLIT_MIN_GROUPS_PER_SM = 2.0
#: the warpgroup-MMA (wgmma, sm_90a) kernels: token tiles per block (up to 128 tokens; more rows
#: run as token chunks of the same launch), blocks per SM to split K for, and the smallest M that
#: takes them on Hopper (below it the mma.sync kernels)
WGMMA_TOKEN_TILES = (2, 4, 8, 16)
#: token tiles of a token chunk: a wgmma launch of more rows than this many tiles hold runs them as
#: token chunks of this size (8: 64 tokens, two blocks per SM; 16: 128 tokens, one block per SM),
#: unless that would split K fewer ways than chunks of 128 tokens (`launch_config`). H100, same
#: run, 65-512 rows, 72 launches: 64-token chunks at two blocks per SM faster on 57, e.g. 4096x2048
#: at 128 rows 15.6 -> 10.9 us, 1024x4096 at 512 21.8 -> 16.4, 32768x1024 at 512 159 -> 114,
#: 18432x7168 at 512 361 -> 324; up to 12 % slower on 11 of them (2048x7168 at 512 rows 31.7 -> 35.7)
#: and 46-51 % slower on 18432x7168 at 96/128 rows, where the 64-token launch would not split K
#: (288 blocks beyond one wave) and 128-token chunks split it 4 ways (82 us vs 124): the exception
WGMMA_CHUNK_TILES = 8
#: blocks per SM in the one wave of a token-chunked launch (`WGMMA_CHUNKS_ONE_WAVE`), by token tiles
WGMMA_CHUNK_BLOCKS_PER_SM = {8: 2, 16: 1}
#: long-K prefill: at least this many rows, K and N run 128-token chunks of 256-row blocks
#: (``wgmma_16x2``: two row tiles per warp, one block per SM), which stage half the activation bytes
#: per FLOP of the 64-token, 128-row blocks; with one block per SM a block's prologue and epilogue
#: overlap nothing, so only a long K loop and enough row groups pay for them. H200, same run, W4A16,
#: graph replays, 64-token chunks -> 16x2 (µs): 4096 rows 18432x7168 2642 -> 2315, 4096x4096 350 ->
#: 336, 2048x7168 301 -> 291, 2048x4096 181 -> 186; 1024 rows 2048x7168 68.6 -> 57.7, 2048x4096
#: 41.3 -> 38.1, 4096x4096 78.4 -> 75.3, 18432x7168 583 -> 583; outside the rule slower: K <= 2048
#: (4096 rows 32768x1024 879 -> 1385, 4096x2048 182 -> 234), N = 1024 (1024x4096 98 -> 114), 512
#: rows (2048x7168 35.2 -> 52.7, 18432x7168 293 -> 334; 4096x4096 40.9 -> 36.6 the exception)
WGMMA_WIDE_BLOCK_MIN = {"m": 1024, "k": 4096, "n": 2048}
WGMMA_ROW_TILES_PER_WARP = {2: 1, 4: 1, 8: 1, 16: 1}  # 4x2 and 8x2 exist too
#: about one block per SM while the row groups are fewer than the SMs (more K splits cost more in
#: the reduction than they gain); a weight with a row group per SM or more splits K `WGMMA_WIDE_SPLITS`
#: ways, for more resident blocks (H200: 18432x7168 at 64 rows 75 -> 60 us), up to
#: `WGMMA_WIDE_MAX_GROUPS_PER_SM` row groups per SM (beyond, the row groups fill the SMs unsplit:
#: the lm_head at 64 rows 207 us in 4 splits, 162 in 1)
WGMMA_BLOCKS_PER_SM = {2: 1, 4: 1, 8: 1, 16: 1}
WGMMA_WIDE_SPLITS = 4
WGMMA_WIDE_MIN_WINDOWS = 4  # ... each keeping at least this many activation windows (32768x1024: none)
WGMMA_WIDE_MAX_GROUPS_PER_SM = 2
#: a kernel with cluster sizes (`CLUSTER_SIZES`) and fewer row groups than SMs splits K into the
#: smallest cluster size that makes this many blocks per SM, or the largest that divides K into whole
#: windows evenly: a reduction in distributed shared memory costs far less than one through the
#: global scratch (H200, same run, 64 rows: 7168x2048 17.3 us in 3 splits -> 11.5 in a cluster of
#: 2, 1024x4096 15.9 in 16 -> 7.6 in a cluster of 8, 2048x7168 18.2 in 7 -> 15.4 in a cluster of 4)
WGMMA_CLUSTER_MIN_BLOCKS_PER_SM = 0.5
WGMMA_MIN_M = 17
#: force the K splits of every wgmma launch (None: the rule below; the benchmark's sweep sets it)
WGMMA_SPLITS = None
#: W4A16 on the wgmma kernels up to 64 rows: weights with fewer elements stage the activation in
#: each block (4-byte copies) instead of reading window images, whose staging launch costs more
#: than it saves there (H200, 64 rows: 2048x7168 17.0 us in-block vs 19.1 with images; 18432x7168
#: 60.4 vs 49.4)
WGMMA_IMAGE_MIN_WEIGHT = 1 << 26
#: W4A4 on the mma.sync kernels: weights with at least this many elements take the activation
#: dequantized once by its own launch instead of by every block (H200, W4A4 / W4A16 with the
#: in-block decode -> with the launch: 16 rows 1.16 -> 1.05 on 18432x7168, 1.15 -> 1.02 on the
#: lm_head; 1 row 1.10 -> 1.05 and 1.11 -> 1.03; on smaller weights the launch costs more than it saves)
PREDEQUANTIZE_MIN_WEIGHT = 1 << 26
#: kernels whose K splits can meet in a thread-block cluster (sm_90+), and the cluster sizes built:
#: the splits of a row group reduce through distributed shared memory instead of a global scratch
#: (the mma.sync kernels at M <= 16 measured no faster with them)
CLUSTER_SIZES = {"wgmma_4x1": (2, 4, 8), "wgmma_8x1": (2, 4, 8), "wgmma_16x1": (2, 4, 8), "wgmma_16x2": (2, 4)}
USE_CLUSTERS = True
#: a wgmma launch of token chunks (`WGMMA_CHUNK_TILES`) splits K into the most splits that keep its
#: grid within one wave (`WGMMA_CHUNK_BLOCKS_PER_SM` blocks per SM); a second, partial wave costs more
#: than the splits save (H100, 256 rows, forced splits: 7168x2048 45.6 us in 2 splits -> 33.3 in 1,
#: 4096x4096 43.5 in 3 -> 36.3 in 2, 2048x7168 44.8 in 5 -> 35.0 in 4; 512 rows 4096x4096 66.1 in 2
#: -> 51.2 in 1). False: the rule below, as for one token chunk without clusters (the rule before)
WGMMA_CHUNKS_ONE_WAVE = True
#: a launch takes a cluster only where its clusters fit (the driver's cuOccupancyMaxActiveClusters
#: for the kernel and its shared memory): a cluster's blocks share one GPC, so fewer clusters fit
#: than the blocks over the cluster size (H100, one block per SM: 30 clusters of 4, 15 of 8). The
#: split rules choose among the cluster sizes whose clusters all fit at once, and any launch keeps
#: its cluster only where the clusters take no more waves than its blocks would without one (H100,
#: 4096x4096 at 128 rows: 4 splits in 32 clusters of 4 27.9 us, 2 in clusters of 2 22.3; at 256
#: rows 2048x4096 4 splits through the global scratch 28.2 -> 2 in clusters 22.5). The query needs
#: the device: `launch_config` checks it for the current device (``sms`` left out) or with
#: ``cluster_capacity``; else every cluster counts as fitting
CLUSTERS_MUST_FIT = True
_WARPS = 8
#: the decode-size kernels (``gemv_<RT>f<F>``, raw_kernels/common/gemv.cuh) up to this many rows:
#: the K split over the warps of one block, which add up in shared memory, instead of over blocks
#: that meet through a global scratch and a counter. They win while their grid is about one wave,
#: up to `GEMV_MAX_BLOCKS_PER_SM` blocks per SM (by M); larger weights stay on the tiled kernels.
#: H200, same run, W4A16: M = 1 1024x4096 5.46 -> 4.33 us, 2048x4096 6.07 -> 5.05, 4096x2048
#: 5.92 -> 5.25, 4096x4096 (256 blocks) 7.78 -> 7.41, 2048x7168 7.88 -> 7.56; 7168x2048 (448
#: blocks) 7.40 vs 7.44, 18432x7168 26.7 vs 30.4, the lm_head 81 vs 103, 32768x1024 9.3 vs 15.1;
#: M = 8 4096x4096 8.73 vs 9.70
GEMV_MAX_M = 8
USE_GEMV = True
GEMV_MAX_BLOCKS_PER_SM = {1: 2.0, 8: 1.0}  # by the largest M of each entry
#: a grid of more GEMV blocks than allowed may be held to the limit by giving each row tile fewer
#: K slices, i.e. more row tiles per block, up to this many (two row tiles of 4 K slices each in
#: place of one of 8). H200, M = 1, same run: 7168x2048 (448 -> 224 blocks) 7.41 us on the tiled
#: kernel -> 6.80, 8192x4096 (512 -> 256) 10.85 -> 10.57; four and eight row tiles per block were
#: slower than the tiled kernel (8192x4096 13.5 us, 32768x1024 17.3 against 9.0), and at M = 8
#: every held grid was (4160x4096 10.5 against 8.6)
GEMV_HELD_MAX_ROW_TILES = 2
#: dense calls of up to this many rows hold their GEMV grid (`GEMV_HELD_MAX_ROW_TILES`) before
#: falling back to the tiled kernels
GEMV_HELD_MAX_M = 1
#: a grouped GEMV (`gemm_grouped`, e.g. the attention's ``wo_a``: 8 groups, 512 row tiles at
#: V4-Flash widths) has no tiled kernel to go to: its grid is held to this many blocks per SM (by
#: M; 0 or absent: 8 slices per row tile at any grid). H200, 8 x 1024 x 4096: M = 1 11.54 us in 512
#: blocks -> 9.60 in 256, M = 8 15.39 -> 13.31; the replayed v4-flash-slice step 0.588 -> 0.578 ms
#: at batch 1, 1.437 -> 1.426 at batch 8
GROUPED_GEMV_MAX_BLOCKS_PER_SM = {1: 2.0, 8: 2.0}
#: weight tiles a GEMV warp fetches at once (4 or 8; 8 measured slower or equal but on two shapes)
GEMV_FETCH_TILES = 4
#: split K over blocks too while the grid has fewer blocks than this many per SM (0: never; the
#: split measured slower even at 64 blocks: 1024x4096, M = 1 4.47 us unsplit, 5.21 in two splits)
GEMV_SPLIT_BELOW_BLOCKS_PER_SM = 0.0
#: 16 warps per GEMV block instead of 8 while a grid of 8-warp blocks has at most this many blocks
#: per SM and K has 16 or more scale groups (4096+): each row tile's K then splits over 16 warps.
#: Below one block per SM an SM holds 8 warps, two per scheduler, and the dequantizing mainloop
#: (about 3.8 instructions per weight) is issue-bound on their dependent chains (0: never)
GEMV_WIDE_MAX_BLOCKS_PER_SM = 1.0
_WIDE_WARPS = 16
#: GEMV kernels without per-tile bounds tests (``gemv_<RT>f4[w16]whole``) where every K slice is
#: whole 4-tile fetches (K a multiple of 256): 3.41 SASS instructions per weight in the mainloop
#: instead of 3.80 (bf16; NVFP4 4.45 instead of 4.71), the same arithmetic in the same order.
#: H200, same run, M = 1: 4096x7168 9.98 -> 9.02 us, 2048x7168 6.63 -> 6.46, 4096x4096 6.92 ->
#: 6.77, 1-3 % on the other GEMV shapes; no GEMV shape slower, at M = 1 or 8, in two runs
GEMV_WHOLE_FETCHES = True
#: GEMV kernels that stage the activation once, before the mainloop (``gemv_<RT>f4[w16]res``; whole
#: fetches, K a multiple of 256, where the slots fit): 2.48 SASS instructions per weight in the
#: mainloop instead of 3.41 (whole fetches) or 3.80, NVFP4 activation included, since the mainloop
#: has no staging, slot hand-over or zeroing of absent tokens. Taken where every warp's K slice is
#: at most `GEMV_RESIDENT_MAX_SLICE_GROUPS` scale groups: with longer slices the double buffer
#: multiplies the first group while the next one's activation arrives, and measured faster.
#: H200, same run, M = 1 (whole fetches -> resident): 4096x1024 4.14 -> 3.58 us, 7168x1024 5.45 ->
#: 4.77, 2048x1024 3.22 -> 2.97, 4096x2048 4.83 -> 4.64, 2048x4096 4.65 -> 4.59 (M = 8 6.13 ->
#: 5.92); two groups or more per slice: 4096x4096 6.77 -> 7.10, 2048x7168 6.46 -> 6.75, 4096x7168
#: 9.02 -> 10.06
GEMV_RESIDENT_ACTIVATION = True
GEMV_RESIDENT_MAX_SLICE_GROUPS = 1
#: the resident build for an NVFP4 activation too (W4A4; its decode then runs before the mainloop):
#: H200, same run, M = 1 slower on every shape (1024x4096 4.18 -> 4.50 us, 2048x2048 3.62 -> 3.96,
#: 4096x2048 4.46 -> 4.74), M = 8 faster only at two row tiles per block (2048x1024 3.97 -> 3.77)
GEMV_RESIDENT_NVFP4_ACTIVATION = False
#: with one row tile per block of 16 warps, the resident build whose mainloop waits for each
#: group's activation just before multiplying it (``gemv_1f4w16resp``), at any slice length: a slice
#: of several groups then overlaps their arrival with the first groups' work, as the double buffer
#: does (2.95 SASS instructions per weight against 3.41 for whole fetches; the wait is a switch over
#: the pending count). H200, same run, M = 1 (default -> pipelined): 16-warp blocks 1024x7168 5.38
#: -> 5.21 us, 2048x7168 6.56 -> 6.36, 1024x4096 3.64 -> 3.58, 2048x4096 4.81 -> 4.81; 8-warp
#: blocks slower (4096x4096 6.96 -> 7.17, 4096x7168 9.00 -> 9.28) or equal (slices of one group),
#: so they keep the double buffer or the one-wait resident build
GEMV_RESIDENT_PIPELINED = True
#: the block widths (warps) that take the pipelined build; gemm.cu builds it for 8 and 16
GEMV_RESIDENT_PIPELINED_WARPS = (_WIDE_WARPS,)
#: a GEMV launch whose grid is a single wave releases the next kernel once its first weights are in
#: flight (common/pdl.cuh; in a captured graph): the next kernel's blocks take the SMs it leaves
#: free or frees first and issue their weights while it drains, instead of after its last block.
#: H100, the replayed v4-flash-slice step at batch 1, three rounds in one process: 573.0, 583.7,
#: 584.4 -> 564.8, 570.0, 572.7 µs; batch 8 within the noise (1543-1552 -> 1540-1549). The same
#: release from the attention kernel (into the output projection) and the MoE's router and down
#: launches measured 4-8 µs slower at batch 1; from the tiled kernels, within the noise
GEMV_EARLY_RELEASE = True
#: the staging launch of a wgmma GEMM (`_stage_image`) whose grid is a single wave releases the GEMM
#: right after its own wait (common/pdl.cuh): the GEMM's blocks are scheduled and issue their first
#: weight loads while the window images are written, instead of after the staging's last block
STAGE_EARLY_RELEASE = True
_GEMV_MAX_SHARED = 219 * 1024  # dynamic shared memory beside a GEMV block's static buffers (227 KB in all)


def _window_chunks(tiles: int, wgmma: bool = False) -> int:
    """Tiles of 64 k per staged activation window (gemm_engine.cuh ``Window<T, kWg>``)."""
    return 8 if tiles <= 2 and not wgmma else 4


_PARTIALS_BYTES = 16 << 20  # split-K scratch per stream
_MAX_ROW_GROUPS = 1 << 16  # split-K counters per stream
_MODULE = "gemm"
_U32 = np.uint32
_I32 = np.int32

# cuBLAS enums (cublas_api.h, library_types.h)
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUDA_R_32F, _CUDA_R_16BF = 0, 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_POINTER_MODE_HOST, _CUBLAS_POINTER_MODE_DEVICE = 0, 1


def _check_weight(w) -> None:
    if not isinstance(w, Nvfp4Tensor):
        raise TypeError(f"w: expected an Nvfp4Tensor [N, K], got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"w: expected a 2-D [N, K] weight, got shape {w.shape}")
    if w.scale_layout == "swizzled":
        raise ValueError("w: expected scale_layout 'tiled' (or 'linear' on numpy), got 'swizzled'; "
                         "convert with fp4kit.formats.to_tiled(w)")
    if w.scale_layout == "linear" and arrays.is_device_array(w.packed):
        raise ValueError("w: the GPU GEMM reads the tiled weight layout, got scale_layout 'linear'; convert it "
                         "once with fp4kit.formats.to_tiled(w) (Linear and the other layers do this when built)")
    for name in ("packed", "block_scales"):
        arrays.check_contiguous(f"w.{name}", getattr(w, name))
    arrays.check_aligned("w.packed", w.packed)
    arrays.check_same_device(**{"w.packed": w.packed, "w.block_scales": w.block_scales, "w.global_scale": w.global_scale})


def _check_activation(a, k: int):
    """``a`` as (kind, rows, leading shape): an Nvfp4Tensor (W4A4) or a bf16 array (W4A16)."""
    if isinstance(a, Nvfp4Tensor):
        if a.scale_layout != "linear":
            raise ValueError("a: expected an Nvfp4Tensor with scale_layout 'linear', got 'swizzled'")
        if a.shape[-1] != k:
            raise ValueError(f"a: expected last dimension K={k} to match w, got shape {a.shape}")
        for name in ("packed", "block_scales"):
            arrays.check_contiguous(f"a.{name}", getattr(a, name))
        return a, a.shape[:-1]
    a = arrays.as_array(a, "a")
    if a.dtype != arrays.BF16:
        raise TypeError(f"a: expected an Nvfp4Tensor or a bfloat16 array, got dtype {a.dtype}")
    if a.ndim == 0 or a.shape[-1] != k:
        raise ValueError(f"a: expected last dimension K={k} to match w, got shape {tuple(a.shape)}")
    arrays.check_contiguous("a", a)
    arrays.check_aligned("a", a)
    return a, tuple(a.shape[:-1])


def _vector(name: str, v, n: int, dtypes, like):
    if v is None:
        return None
    v = arrays.as_array(v, name)
    if tuple(v.shape) != (n,) or v.dtype not in [np.dtype(d) for d in dtypes]:
        names = " or ".join(np.dtype(d).name for d in dtypes)
        raise ValueError(f"{name}: expected shape ({n},) and dtype {names}, got {arrays.describe(v)}")
    arrays.check_contiguous(name, v)
    if arrays.device_id(v) != arrays.device_id(like):
        raise ValueError(f"{name}: expected an array on the same device as w, got one {arrays.describe(v)}")
    return v


def gemm(
    a,
    w: Nvfp4Tensor,
    *,
    bias=None,
    row_decode=None,
    out=None,
    out_dtype=arrays.BF16,
    decode_max_m: int | None = None,
    column_blocks=None,
):
    """``y[..., N] = alpha * A @ W^T (+ bias)``.

    Parameters
    ----------
    a : Nvfp4Tensor ``[..., K]`` (W4A4) or bf16 array ``[..., K]`` (W4A16), C-contiguous
        An NVFP4 activation comes from `fp4kit.quantize` (linear scale layout); its global scale
        stays on the device.
    w : Nvfp4Tensor ``[N, K]``, linear scale layout
    bias : fp32 or bf16 ``[N]``, optional
    row_decode : fp32 ``[N]``, optional
        A decode factor per output row replacing ``1 / S_w`` (fused weights whose shards had
        different global scales, see `fp4kit.checkpoint`).
    out : bf16 or fp32 array ``[..., N]``, optional
    out_dtype : bf16 (default) or fp32, when ``out`` is not given
    decode_max_m : int, optional
        Largest row count that takes the engine (capturable in a CUDA graph); above it the
        dequantize + cuBLAS path. Default: `DECODE_MAX_M` on Hopper, `DECODE_MAX_M_MMA_SYNC`
        elsewhere.
    column_blocks : sequence of positive ints adding up to N, optional
        Write the output column-blocked: block j (columns ``c_j .. c_j + N_j - 1``) as its own
        C-contiguous ``[M, N_j]`` matrix starting at element ``M * c_j``, the blocks one after
        another (e.g. the parts of a concatenated projection, `fp4kit.layers.Linear.call_split`).
        ``out`` is then a flat ``[M * N]`` array and the result is the list of the blocks'
        ``[..., N_j]`` views. The engine writes the blocks directly (no split launch) where their
        interior boundaries are multiples of `COLUMN_BLOCK_ALIGN` and it runs in one launch, the
        prefill epilogue always; otherwise (mma.sync above 64 rows) they are copied apart after it.

    ``alpha = (row_decode[n] or 1/S_w) * (1/S_a for W4A4)`` is computed on the device from the
    device global scales: nothing is read back. Runs on CuPy's current stream.
    """
    _check_weight(w)
    n, k = w.shape
    a, lead = _check_activation(a, k)
    a_data = a.packed if isinstance(a, Nvfp4Tensor) else a
    arrays.check_same_device(a=a_data, w=w.packed)
    bias = _vector("bias", bias, n, (np.float32, arrays.BF16), w.packed)
    row_decode = _vector("row_decode", row_decode, n, (np.float32,), w.packed)
    m = int(np.prod(lead, dtype=np.int64))
    out_dtype = np.dtype(out.dtype if out is not None else out_dtype)
    if out_dtype not in (arrays.BF16, np.dtype(np.float32)):
        raise TypeError(f"out_dtype: expected bfloat16 or float32, got {out_dtype}")
    if column_blocks is not None:
        column_blocks = _check_column_blocks(column_blocks, n)
        if out is not None:
            arrays.check_out("out", out, (m * n,), out_dtype, w.packed)
    elif out is not None:
        arrays.check_out("out", out, (*lead, n), out_dtype, w.packed)
    if decode_max_m is not None and (not isinstance(decode_max_m, (int, np.integer)) or decode_max_m < 0):
        raise ValueError(f"decode_max_m: expected a non-negative int, got {decode_max_m!r}")
    if n * k // 2 >= 2**31 or m * k >= 2**31 or m * n >= 2**31:
        raise ValueError(f"gemm: M={m}, N={n}, K={k} is too large for 32-bit indexing; split the call")

    if not arrays.is_device_array(w.packed):
        y = ref.gemm(a, w, bias, row_decode, out_dtype).reshape(m, n)
        if column_blocks is None:
            return arrays.host_result(y.reshape(*lead, n), out)
        flat = np.empty(m * n, out_dtype) if out is None else out
        return _copy_blocks(y, column_block_views(flat, lead, column_blocks), column_blocks)

    import cupy

    if out is None:
        out = cupy.empty(m * n if column_blocks else (*lead, n), dtype=out_dtype)
    result = out if column_blocks is None else column_block_views(out, lead, column_blocks)
    if m == 0:
        return result
    epilogue = (w.global_scale, _ptr(row_decode), _ptr(bias), _I32(_bias_kind(bias)), out,
                _I32(out_dtype == np.float32))
    capability = loader.compute_capability(out.device.id)
    if decode_max_m is None:
        decode_max_m = default_decode_max_m(capability)
    wgmma = uses_wgmma(m, capability)
    step = m if wgmma else 64  # mma.sync: 64 rows per launch, the weight streamed once per 64 rows
    if column_blocks is not None and m <= decode_max_m and (m > step or not _aligned_blocks(column_blocks)):
        # launches of 64 rows each, or blocks that a kernel's thread block may straddle: one [M, N]
        # result, then the blocks copied apart
        y = gemm(a, w, bias=bias, row_decode=row_decode, out_dtype=out_dtype, decode_max_m=decode_max_m)
        return _copy_blocks(y.reshape(m, n), result, column_blocks)
    parts = None if column_blocks is None else ew_ops.device_bounds(np.cumsum([0, *column_blocks]), out.device.id)
    if m > decode_max_m:
        plain = bias is None and row_decode is None and column_blocks is None
        _prefill(a, w, m, n, k, (*epilogue, _U32(m), _U32(n), _U32(k), _ptr(parts)), plain=plain)
        return result
    rows = out.reshape(m, n) if column_blocks is None else out
    predequantized = isinstance(a, Nvfp4Tensor) and predequantizes(m, n, k, wgmma)
    if predequantized:
        x16 = _dequantize_unscaled(a, m, k, "gemm.a16", capturable=True)
    for m0 in range(0, m, step):
        ms = min(step, m - m0)
        if predequantized:
            act = (x16[m0:], a.global_scale)
        elif isinstance(a, Nvfp4Tensor):
            act = (a.packed.reshape(m, k // 2)[m0:], a.block_scales.reshape(m, k // BLOCK_SIZE)[m0:], a.global_scale)
        else:
            act = (a.reshape(m, k)[m0:], 0)
        _launch(w, act, (*epilogue[:4], rows[m0:], *epilogue[5:]), ms, n, k, wgmma, parts=parts)
    return result


def _check_column_blocks(column_blocks, n: int) -> tuple:
    sizes = tuple(column_blocks)
    if not sizes or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1
                        for v in sizes) or sum(sizes) != n:
        raise ValueError(f"column_blocks: expected positive ints adding up to N = {n}, got {list(sizes)}")
    return tuple(int(v) for v in sizes)


def _column_starts(sizes: tuple) -> list:
    """``(first column, width)`` of each block."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    return list(zip(starts, sizes))


def column_block_views(flat, lead: tuple, sizes) -> list:
    """The ``[*lead, N_j]`` views of the column blocks in a flat ``[M * N]`` array (see `gemm`)."""
    m = int(np.prod(lead, dtype=np.int64))
    return [flat[m * c:m * (c + width)].reshape(*lead, width) for c, width in _column_starts(tuple(sizes))]


def _copy_blocks(y, views: list, sizes: tuple) -> list:
    for view, (c, width) in zip(views, _column_starts(sizes)):
        view[...] = y[:, c:c + width].reshape(view.shape)
    return views


#: column blocks are written apart by the engine's kernels themselves where their interior
#: boundaries are multiples of this: every thread block's output columns (16 per GEMV row tile, up to
#: 8; 128 per row tile per warp of the mma.sync / wgmma kernels, up to 2) then lie in one block
COLUMN_BLOCK_ALIGN = 256


def _aligned_blocks(sizes: tuple) -> bool:
    """Whether every interior boundary is a multiple of `COLUMN_BLOCK_ALIGN` (no thread block of
    the engine straddles two blocks)."""
    return all(int(c) % COLUMN_BLOCK_ALIGN == 0 for c in np.cumsum(sizes)[:-1])


def gemm_grouped(a, w: Nvfp4Tensor, groups: int, *, row_decode=None, out=None, out_dtype=arrays.BF16):
    """A grouped GEMM in one launch: ``y[:, g Ng:(g + 1) Ng] = a[:, g K:(g + 1) K] @ W_g^T`` for the
    ``groups`` equal row blocks ``W_g`` of ``w [groups * Ng, K]`` (e.g. a low-rank output
    projection whose head groups each have their own weight, held as one concatenated weight).

    a : bf16 ``[M, groups * K]``, C-contiguous (on the GPU: M <= `GEMV_MAX_M`, the GEMV kernels)
    w : Nvfp4Tensor ``[groups * Ng, K]`` with Ng a multiple of 128 (a block's row tiles in one group)
    row_decode : fp32 ``[groups * Ng]``, optional: a decode factor per row replacing ``1 / S_w``
    out : bf16 or fp32 ``[M, groups * Ng]``, optional

    The arithmetic of `gemm` on each group: numpy runs the reference per group.
    """
    _check_weight(w)
    n, k = w.shape
    if isinstance(groups, (bool, np.bool_)) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"groups: expected a positive int, got {groups!r}")
    if n % groups or (n // groups) % 128:
        raise ValueError(f"w: expected rows in {groups} groups of a multiple of 128 rows, got shape {tuple(w.shape)}")
    a = arrays.as_array(a, "a")
    if a.dtype != arrays.BF16:
        raise TypeError(f"a: expected dtype bfloat16 (a grouped GEMM reads bf16 activations), got {a.dtype}")
    if a.ndim != 2 or a.shape[1] != groups * k:
        raise ValueError(f"a: expected shape (M, {groups * k}) for {groups} groups of K = {k}, got {arrays.describe(a)}")
    arrays.check_contiguous("a", a)
    arrays.check_same_device(a=a, w=w.packed)
    row_decode = _vector("row_decode", row_decode, n, (np.float32,), w.packed)
    m = a.shape[0]
    out_dtype = np.dtype(out.dtype if out is not None else out_dtype)
    if out_dtype not in (arrays.BF16, np.dtype(np.float32)):
        raise TypeError(f"out_dtype: expected bfloat16 or float32, got {out_dtype}")
    if out is not None:
        arrays.check_out("out", out, (m, n), out_dtype, w.packed)
    if not arrays.is_device_array(w.packed):
        ng = n // groups
        parts = [ref.gemm(np.ascontiguousarray(a[:, g * k:(g + 1) * k]), _host_rows(w, g * ng, (g + 1) * ng), None,
                          None if row_decode is None else row_decode[g * ng:(g + 1) * ng], out_dtype)
                 for g in range(groups)]
        return arrays.host_result(np.concatenate(parts, axis=1), out)
    if m > GEMV_MAX_M:
        raise ValueError(f"a: the grouped GEMM runs on the GEMV kernels, at most {GEMV_MAX_M} rows; got {m}")
    arrays.check_aligned("a", a)
    import cupy

    out = cupy.empty((m, n), dtype=out_dtype) if out is None else out
    if m == 0:
        return out
    epilogue = (w.global_scale, _ptr(row_decode), 0, _I32(0), out, _I32(out_dtype == np.float32))
    _launch(w, (a, 0), epilogue, m, n, k, False, grouped=(groups * k, n // groups))
    return out


def _host_rows(w: Nvfp4Tensor, start: int, stop: int) -> Nvfp4Tensor:
    """Rows [start, stop) of a host NVFP4 weight in the linear layout (the reference's input)."""
    w = w if w.scale_layout == "linear" else to_linear(w)
    return Nvfp4Tensor(w.packed[start:stop], w.block_scales[start:stop], w.global_scale, "linear",
                       (stop - start, w.shape[1]))


def predequantizes(m: int, n: int, k: int, wgmma: bool) -> bool:
    """Whether an NVFP4 activation of ``m`` rows is dequantized exactly into bf16 by one launch before
    an ``mma.sync`` engine launch (on weights of `PREDEQUANTIZE_MIN_WEIGHT` elements or more), rather
    than by every block of the GEMM."""
    return not wgmma and n * k >= PREDEQUANTIZE_MIN_WEIGHT


def uses_image(m: int, n: int, k: int, nvfp4: bool) -> bool:
    """Whether a wgmma launch reads window images (`_stage_image`): always for an NVFP4 activation,
    and for bf16 above 64 rows or on weights of `WGMMA_IMAGE_MIN_WEIGHT` elements or more."""
    return nvfp4 or m > 64 or n * k >= WGMMA_IMAGE_MIN_WEIGHT


def default_decode_max_m(compute_capability: str) -> int:
    """The most activation rows the engine takes by default on a device of this compute capability."""
    return DECODE_MAX_M if compute_capability == "90" else DECODE_MAX_M_MMA_SYNC


def token_tiles(m: int) -> int:
    """Token tiles (8 rows each) of the mma.sync kernel that serves ``m`` rows in one pass."""
    return next(t for t in _TOKEN_TILES if 8 * t >= min(m, 64))


def shared_bytes(tiles: int, wgmma: bool = False) -> int:
    """Dynamic shared memory of an engine kernel with ``tiles`` token tiles: two activation windows
    (gemm_engine.cuh ``Window``: padded token rows for mma.sync, padded K-columns for wgmma)."""
    k = _window_chunks(tiles, wgmma) * TILE_K
    per_window = k // 8 * (64 * tiles + 8) if wgmma else 8 * tiles * (k + 8)  # bf16
    return 2 * per_window * 2


def row_groups(n: int, row_tiles_per_warp: int) -> int:
    """Blocks along N: 8 warps of ``row_tiles_per_warp`` tiles of 16 rows each."""
    return -(-tiled_dims(n, TILE_K)[0] // (_WARPS * row_tiles_per_warp))


@dataclass(frozen=True)
class LaunchShape:
    """One engine launch: kernel ``gemm_{kernel}_{bf16,nvfp4}``, grid ``(row_groups, splits,
    token_chunks)``; ``cluster`` > 1: the splits are one thread-block cluster and reduce in
    distributed shared memory."""

    wgmma: bool
    token_tiles: int
    row_tiles_per_warp: int  # GEMV: row tiles per block
    fetch8: bool  # 8 weight tiles per fetch (mma.sync and GEMV kernels)
    row_groups: int
    splits: int
    chunks_per_split: int
    token_chunks: int
    shared_bytes: int
    cluster: int = 0
    gemv: bool = False
    warps: int = _WARPS  # per block (GEMV: 8 or 16)
    whole: bool = False  # GEMV: the build without per-tile bounds tests (`GEMV_WHOLE_FETCHES`)
    resident: bool = False  # GEMV: the block's activation staged once (`GEMV_RESIDENT_ACTIVATION`)
    pipelined: bool = False  # GEMV, resident: a wait per group (`GEMV_RESIDENT_PIPELINED`)

    @property
    def family(self) -> str:
        """``tiled_<T>x<R>[f8]``, ``wgmma_<T>x<R>`` or ``gemv_<RT>f<4|8>``: the kernel without its
        cluster size."""
        if self.gemv:
            wide = f"w{self.warps}" if self.warps != _WARPS else ""
            build = "resp" if self.pipelined else "res" if self.resident else "whole" if self.whole else ""
            return f"gemv_{self.row_tiles_per_warp}f{8 if self.fetch8 else 4}{wide}{build}"
        return (f"{'wgmma' if self.wgmma else 'tiled'}_{self.token_tiles}x{self.row_tiles_per_warp}"
                + ("f8" if self.fetch8 else ""))

    @property
    def kernel(self) -> str:
        """The kernel name without ``gemm_`` and the activation kind: the family, ``_c<C>`` with a cluster."""
        return self.family + (f"_c{self.cluster}" if self.cluster else "")


def uses_wgmma(m: int, compute_capability: str) -> bool:
    """Whether ``m`` rows take the warpgroup-MMA kernels: on sm_90 from `WGMMA_MIN_M` rows."""
    return str(compute_capability) == "90" and m >= WGMMA_MIN_M


def balanced_splits(blocks: int, most: int, sms: int) -> int:
    """The fewest K splits (up to ``most``) that spread ``blocks`` times the splits over ``sms``
    SMs within `WAVE_IMBALANCE` of evenly (the busiest SM's share over the mean: a grid of 1.09
    blocks per SM takes as long as one of 2), or else the most even split count."""
    best = (float("inf"), 1)
    for splits in range(1, most + 1):
        per_sm = blocks * splits / sms
        imbalance = math.ceil(per_sm) / per_sm
        if imbalance <= WAVE_IMBALANCE:
            return splits
        best = min(best, (imbalance, splits))
    return best[1]


def cluster_splits(groups: int, windows: int, sizes: tuple, sms: int) -> int:
    """K splits for a cluster kernel of ``groups`` row groups over ``windows`` activation windows:
    the smallest of the cluster ``sizes`` giving `WGMMA_CLUSTER_MIN_BLOCKS_PER_SM` blocks per SM,
    among those that split the windows into exactly that many parts; else the largest such (1 if
    none)."""
    exact = [c for c in sizes if c <= windows and -(-windows // -(-windows // c)) == c]
    for c in exact:
        if groups * c >= WGMMA_CLUSTER_MIN_BLOCKS_PER_SM * sms:
            return c
    return exact[-1] if exact else 1


def device_cluster_capacity(kernel: str, cluster: int, shared: int) -> int:
    """Clusters of ``cluster`` blocks of the wgmma kernel ``gemm_<kernel>`` (e.g. ``wgmma_16x1_c4``;
    cluster 1: the blocks of a kernel without one) with ``shared`` bytes of dynamic shared memory
    that the current device holds at once (asked once per device: `launch_config` asks on every
    call)."""
    import cupy

    return _cluster_capacity(cupy.cuda.Device().id, kernel, cluster, shared)


@functools.cache
def _cluster_capacity(device: int, kernel: str, cluster: int, shared: int) -> int:
    kern = loader.get_kernel(_MODULE, f"gemm_{kernel}")  # the current device's, i.e. ``device``'s
    if cluster == 1:
        return kern.resident_blocks(_WARPS * 32, shared)
    return kern.resident_clusters(cluster, _WARPS * 32, shared)


def launch_config(m: int, n: int, k: int, sms: int | None = None, wgmma: bool = False,
                  cluster_capacity=None, chunk_tiles: int | None = None, row_tiles: int | None = None) -> LaunchShape:
    """The engine launch of ``m`` rows (``m <= 64`` for mma.sync: larger M runs once per 64 rows)
    on a GPU with ``sms`` multiprocessors (default: the current device's).

    ``cluster_capacity(kernel, cluster, shared)``: the clusters of a cluster kernel (cluster 1: the
    blocks of the kernel without) resident at once, for `CLUSTERS_MUST_FIT`. Default: the current
    device's (`device_cluster_capacity`) when ``sms`` is left out, else no check.

    Splits K over more blocks until the grid has `BLOCKS_PER_SM` (`WGMMA_BLOCKS_PER_SM`) blocks
    per SM (0: `balanced_splits`), in whole activation windows and within the split-K scratch
    (`_PARTIALS_BYTES`); every split gets at least one tile. A wgmma launch of more rows than
    `WGMMA_CHUNK_TILES` token tiles hold (64) runs them as token chunks of that size in one grid,
    each with its own split-K scratch, or as chunks of 128 rows where those split K more ways;
    ``chunk_tiles`` fixes the chunk's token tiles and ``row_tiles`` the row tiles per warp (default
    `WGMMA_ROW_TILES_PER_WARP`). Long-K prefill (`WGMMA_WIDE_BLOCK_MIN`) runs 128-token chunks of
    two row tiles per warp.
    """
    if sms is None:
        sms = loader.current_sm_count()
        cluster_capacity = cluster_capacity or device_cluster_capacity
    largest = WGMMA_TOKEN_TILES[-1]
    if wgmma and chunk_tiles is None and _wide_blocks(m, n, k):
        return launch_config(m, n, k, sms, True, cluster_capacity, chunk_tiles=largest, row_tiles=2)
    if wgmma and chunk_tiles is None and WGMMA_CHUNK_TILES < largest and m > 8 * WGMMA_CHUNK_TILES:
        # short token chunks, unless they split K fewer ways than chunks of the largest tile count
        short, full = (launch_config(m, n, k, sms, True, cluster_capacity, chunk_tiles=t)
                       for t in (WGMMA_CHUNK_TILES, largest))
        return short if short.splits >= full.splits else full
    if wgmma:
        tiles = min(next((t for t in WGMMA_TOKEN_TILES if 8 * t >= m), largest), chunk_tiles or WGMMA_CHUNK_TILES)
        r, per_sm, fetch8 = row_tiles or WGMMA_ROW_TILES_PER_WARP[tiles], WGMMA_BLOCKS_PER_SM[tiles], False
    else:
        tiles = token_tiles(m)
        r, per_sm, fetch8 = ROW_TILES_PER_WARP[tiles], BLOCKS_PER_SM[tiles], FETCH_TILES[tiles] == 8
    token_chunks = -(-m // (8 * tiles))
    row_tiles, chunks, _ = tiled_dims(n, k)
    groups = row_groups(n, r)
    window = _window_chunks(tiles, wgmma)
    windows = -(-chunks // window)
    # split-K scratch rows: each token chunk of a wgmma launch has 8T rows of partials per split
    scratch_rows = token_chunks * 8 * tiles if wgmma else m
    family = f"wgmma_{tiles}x{r}"
    clusters = groups * token_chunks  # one per row group and token chunk
    sizes = CLUSTER_SIZES.get(family, ()) if wgmma and USE_CLUSTERS else ()

    def capacity(c: int) -> int | None:  # clusters of c blocks (c = 1: blocks) resident at once
        if not (CLUSTERS_MUST_FIT and cluster_capacity):
            return None
        return max(1, cluster_capacity(family if c == 1 else f"{family}_c{c}", c, shared_bytes(tiles, wgmma)))

    # the cluster sizes whose clusters all fit the GPU at once
    fitting = tuple(c for c in sizes if capacity(c) is None or clusters <= capacity(c))
    if wgmma and WGMMA_SPLITS:
        target = WGMMA_SPLITS
    elif wgmma and token_chunks > 1 and WGMMA_CHUNKS_ONE_WAVE:
        target = max(1, WGMMA_CHUNK_BLOCKS_PER_SM.get(tiles, per_sm) * sms // clusters)
        # ... or the largest cluster size within it whose clusters fit at once (H100, 256 rows:
        # 2048x7168 in 4 splits through the global scratch 34.6 us -> 2 in clusters 30.8)
        target = max((c for c in fitting if c <= target), default=target)
    elif wgmma and groups * token_chunks >= sms:
        wide = groups * token_chunks < WGMMA_WIDE_MAX_GROUPS_PER_SM * sms
        target = min(WGMMA_WIDE_SPLITS, windows // WGMMA_WIDE_MIN_WINDOWS) if wide else 1
    elif wgmma and token_chunks == 1 and fitting:
        target = cluster_splits(groups, windows, fitting, sms)
    elif per_sm == 0 and groups * token_chunks >= UNSPLIT_MIN_GROUPS_PER_SM * sms:
        target = 1
    elif per_sm == 0:
        target = balanced_splits(groups * token_chunks, windows, sms)
    else:
        target = -(-per_sm * sms // (groups * token_chunks))
    splits = max(1, min(windows, target))
    per_split = -(-windows // splits) * window
    splits = -(-chunks // per_split)
    shape = LaunchShape(wgmma, tiles, r, fetch8, groups, splits, per_split, token_chunks, shared_bytes(tiles, wgmma))
    # the splits of a row group (and token chunk) are one cluster and reduce in distributed shared
    # memory (at equal splits faster than the global scratch: 4096x4096, 64 rows, 8 splits 20.0 ->
    # 18.0 us), where its clusters take no more waves than its blocks would without one
    if splits in sizes and (capacity(splits) is None
                            or -(-clusters // capacity(splits)) <= -(-clusters * splits // capacity(1))):
        return replace(shape, cluster=splits)
    scratch_splits = max(1, _PARTIALS_BYTES // (4 * scratch_rows * row_tiles * TILE_ROWS))
    if splits > scratch_splits:  # the global scratch holds fewer
        per_split = -(-windows // scratch_splits) * window
        shape = replace(shape, splits=-(-chunks // per_split), chunks_per_split=per_split)
    return shape


def _wide_blocks(m: int, n: int, k: int) -> bool:
    """Whether a wgmma launch of ``m`` rows of an ``[n, k]`` weight takes `WGMMA_WIDE_BLOCK_MIN`'s
    256-row blocks (None: never)."""
    low = WGMMA_WIDE_BLOCK_MIN
    return low is not None and m >= low["m"] and n >= low["n"] and k >= low["k"]


def gemv_launch(m: int, n: int, k: int, sms: int | None = None, nvfp4_act: bool = False) -> LaunchShape | None:
    """The GEMV launch (`gemv_config`) of ``m`` rows of an ``[n, k]`` weight if it takes the GEMV
    kernels (up to `GEMV_MAX_M` rows and `GEMV_MAX_BLOCKS_PER_SM` blocks per SM), else None."""
    if not USE_GEMV or m > GEMV_MAX_M:
        return None
    if sms is None:
        sms = loader.current_sm_count()
    per_sm = GEMV_MAX_BLOCKS_PER_SM[_m_bucket(m)]
    limit = _grid_limit(per_sm, sms) if m <= GEMV_HELD_MAX_M else None
    shape = gemv_config(m, n, k, sms, nvfp4_act, max_blocks=limit)
    return shape if shape.row_groups <= per_sm * sms else None


def _m_bucket(m: int) -> int:
    """The key of the GEMV tables (`GEMV_MAX_BLOCKS_PER_SM`, ...) that covers ``m`` rows."""
    return min(rows for rows in GEMV_MAX_BLOCKS_PER_SM if rows >= m)


def _grid_limit(per_sm, sms: int) -> int | None:
    """``per_sm`` blocks per SM as a grid to hold a launch to; None for no limit (0, None or infinite)."""
    blocks = per_sm * sms if per_sm else 0
    return max(1, int(blocks)) if 0 < blocks < 1 << 30 else None


def grouped_gemv_max_blocks(m: int, sms: int | None = None) -> int | None:
    """The grid a grouped GEMV (`gemm_grouped`) is held to by `GROUPED_GEMV_MAX_BLOCKS_PER_SM`
    (None: no limit, 8 K slices per row tile whatever the grid)."""
    return _grid_limit(GROUPED_GEMV_MAX_BLOCKS_PER_SM.get(_m_bucket(m)), sms or loader.current_sm_count())


def gemv_shared_bytes(m: int, fetch_tiles: int, warps: int = _WARPS) -> int:
    """Dynamic shared memory of a GEMV launch of ``m`` rows: two activation slots of ``m`` token
    rows (``fetch_tiles`` * 64 bf16 plus 16 bytes) per warp."""
    return warps * 2 * m * (fetch_tiles * TILE_K + 8) * 2


def gemv_resident_bytes(m: int, groups: int, row_tiles: int, warps: int) -> int:
    """Dynamic shared memory of a resident-activation GEMV launch: one slot of ``m + 1`` token rows
    (4 tiles of 64 bf16 plus 16 bytes each; the last row zero) per scale group of a split's
    ``groups``, staged once for the block's ``row_tiles`` > 1, or by each of the ``warps`` for its
    own K slice (at most ``ceil(groups / warps)`` groups) with one row tile per block."""
    slot = (m + 1) * (GROUP_CHUNKS * TILE_K + 8) * 2
    return groups * slot if row_tiles > 1 else warps * -(-groups // warps) * slot


def gemv_config(m: int, n: int, k: int, sms: int | None = None, nvfp4_act: bool = False,
                max_blocks: int | None = None) -> LaunchShape:
    """The GEMV launch of ``m <= 8`` rows: the K range of a row tile is split over 8, 4, 2 or 1
    warps (whole scale groups of 256 k each, as many as K has, up to 8), the block holds the rest
    of its 8 warps as more row tiles, and K is split over blocks as well only while the grid has
    fewer than `GEMV_SPLIT_BELOW_BLOCKS_PER_SM` blocks per SM. A grid of at most
    `GEMV_WIDE_MAX_BLOCKS_PER_SM` such blocks per SM over a K of 16+ scale groups takes 16-warp
    blocks of one row tile instead (16 K slices). ``max_blocks``: half the K slices per row tile
    (twice the row tiles per block, up to `GEMV_HELD_MAX_ROW_TILES`) while the grid has more blocks
    than that."""
    if sms is None:
        sms = loader.current_sm_count()
    row_tiles, chunks, groups = tiled_dims(n, k)
    warps = _WARPS
    slices = 1 << (min(warps, groups).bit_length() - 1)  # a power of two dividing the 8 warps
    f = GEMV_FETCH_TILES
    if (groups >= _WIDE_WARPS and -(-row_tiles // (warps // slices)) <= GEMV_WIDE_MAX_BLOCKS_PER_SM * sms
            and gemv_shared_bytes(m, f, _WIDE_WARPS) <= _GEMV_MAX_SHARED):
        warps = slices = _WIDE_WARPS
    while (max_blocks and slices > 1 and -(-row_tiles // (warps // slices)) > max_blocks
           and 2 * warps // slices <= GEMV_HELD_MAX_ROW_TILES):
        slices //= 2
    per_block = warps // slices
    blocks = -(-row_tiles // per_block)
    splits = 1
    if blocks < GEMV_SPLIT_BELOW_BLOCKS_PER_SM * sms:
        splits = max(1, min(groups // slices, -(-sms // blocks)))
    splits = min(splits, max(1, _PARTIALS_BYTES // (4 * m * row_tiles * TILE_ROWS)))  # within the scratch
    per_split = -(-groups // splits)
    whole_groups = f == GROUP_CHUNKS and chunks % GROUP_CHUNKS == 0  # every slice whole groups
    resident_bytes = gemv_resident_bytes(m, per_split, per_block, warps)
    pipelined = GEMV_RESIDENT_PIPELINED and per_block == 1 and warps in GEMV_RESIDENT_PIPELINED_WARPS and not nvfp4_act
    short_slices = -(-per_split // slices) <= GEMV_RESIDENT_MAX_SLICE_GROUPS  # groups in a warp's K slice
    resident = (GEMV_RESIDENT_ACTIVATION and (GEMV_RESIDENT_NVFP4_ACTIVATION or not nvfp4_act) and whole_groups
                and (short_slices or pipelined) and resident_bytes <= _GEMV_MAX_SHARED)
    whole = (GEMV_WHOLE_FETCHES and whole_groups) or resident
    shared = resident_bytes if resident else gemv_shared_bytes(m, f, warps)
    return LaunchShape(False, 1, per_block, f == 8, blocks, -(-groups // per_split), per_split * GROUP_CHUNKS, 1,
                       shared, gemv=True, warps=warps, whole=whole, resident=resident,
                       pipelined=resident and pipelined)


def _launch(w: Nvfp4Tensor, act: tuple, epilogue: tuple, m: int, n: int, k: int, wgmma: bool,
            grouped: tuple | None = None, parts=None) -> None:
    """One engine launch; ``grouped`` = (activation row stride, weight rows per group) takes the
    GEMV kernel of a grouped GEMM (`gemm_grouped`); ``parts``: the device boundaries of column
    blocks (`gemm` ``column_blocks``) or None."""
    kind = "nvfp4" if len(act) == 3 else "bf16"
    if grouped is not None:  # the GEMV kernels at any grid: one wave where the K slices allow
        shape = gemv_config(m, n, k, max_blocks=grouped_gemv_max_blocks(m))
    else:
        shape = (None if wgmma else gemv_launch(m, n, k, nvfp4_act=kind == "nvfp4")) or launch_config(m, n, k, wgmma=wgmma)
    span = 16 * shape.row_tiles_per_warp * (1 if shape.gemv else _WARPS)  # a thread block's output columns
    if parts is not None and COLUMN_BLOCK_ALIGN % span:
        raise AssertionError(f"gemm: a {shape.kernel} block covers {span} columns, not a divisor of {COLUMN_BLOCK_ALIGN}")
    if shape.splits > 1 and shape.row_groups * shape.token_chunks > _MAX_ROW_GROUPS:
        raise ValueError(f"gemm: N={n}, M={m} need more than {_MAX_ROW_GROUPS} split-K counters; split the call")
    if shape.wgmma and uses_image(m, n, k, kind == "nvfp4"):
        # the activation as window images (one staging launch); W4A4's 1/S_a in the epilogue
        act = (_stage_image(act, kind, m, k, shape), act[-1])
        kernel = loader.get_kernel(_MODULE, f"gemm_{shape.kernel}")
    else:
        kernel = loader.get_kernel(_MODULE, f"gemm_{shape.kernel}_{kind}")
    # split-K scratch of this stream: fp32 partials and row-group counters (zero between launches)
    partials = workspace.stream_buffer("gemm.partials", _PARTIALS_BYTES // 4, np.float32)
    counters = workspace.stream_buffer("gemm.counters", _MAX_ROW_GROUPS, np.uint32, zeroed=True)
    args = (w.packed, w.block_scales, *act, *epilogue, _U32(m), _U32(n), _U32(k), _ptr(parts), partials, counters,
            _U32(shape.splits), _U32(shape.chunks_per_split))
    if shape.gemv and kind == "bf16":  # the activation's row stride and the rows per weight group
        args += tuple(_U32(v) for v in (grouped or (0, 0)))
    if shape.gemv:
        blocks = shape.row_groups * shape.splits * shape.token_chunks
        single_wave = blocks <= kernel.resident_blocks(32 * shape.warps, shape.shared_bytes)
        args += (np.int32(GEMV_EARLY_RELEASE and single_wave),)
    kernel.launch((shape.row_groups, shape.splits, shape.token_chunks), 32 * shape.warps, args,
                  shared_mem=shape.shared_bytes)


def staging_grid(shape: LaunchShape, k: int) -> tuple[int, int]:
    """``(windows, token chunks)``: the grid of a wgmma launch's staging launch (`_stage_image`)."""
    return -(-k // (_window_chunks(shape.token_tiles, True) * TILE_K)), shape.token_chunks


def _stage_image(act: tuple, kind: str, m: int, k: int, shape: LaunchShape):
    """The wgmma kernels' activation: every window of every token chunk as the exact bytes of its
    shared-memory buffer (`gemm_stage_<T>_{bf16,nvfp4}`), in a workspace that a bulk copy per
    window reads."""
    window_bytes = shape.shared_bytes // 2
    windows, chunks = staging_grid(shape, k)
    image = workspace.capturable_buffer("gemm.image", chunks * windows * window_bytes)
    kernel = loader.get_kernel(_MODULE, f"gemm_stage_{shape.token_tiles}_{kind}")
    release = STAGE_EARLY_RELEASE and windows * chunks <= kernel.resident_blocks(32 * _WARPS, window_bytes)
    kernel.launch((windows, chunks), 32 * _WARPS,
                  (*act[:2 if kind == "nvfp4" else 1], image, _U32(m), _U32(k), np.int32(release)),
                  shared_mem=window_bytes)
    return image


def _ptr(v):
    return 0 if v is None else v


def _bias_kind(bias) -> int:
    if bias is None:
        return 0
    return 1 if bias.dtype == np.float32 else 2


def _dequantize_unscaled(q: Nvfp4Tensor, rows: int, k: int, name: str, capturable: bool = False):
    """``e2m1 * fp32(scale)`` of ``q`` as bf16 ``[rows, K]`` in a reusable workspace (one a captured
    graph may keep using if ``capturable``)."""
    buffer = workspace.capturable_buffer if capturable else workspace.device_buffer
    buf = buffer(name, rows * k * 2).view(arrays.BF16)[: rows * k].reshape(rows, k)
    kernel = loader.get_kernel(_MODULE, "dequantize_unscaled_bf16")
    blocks = rows * (k // BLOCK_SIZE)
    kernel(max(1, min(-(-blocks // 256), kernel.max_blocks * 4)), 256,
           (q.packed, q.block_scales, buf, _U32(rows), _U32(k // BLOCK_SIZE)))
    return buf


def _dequantize_tiled_unscaled(w: Nvfp4Tensor, n: int, k: int):
    """``e2m1 * fp32(scale)`` of the tiled weight ``w`` as bf16 ``[N, K]`` in a reusable workspace."""
    buf = workspace.device_buffer("gemm.w", n * k * 2).view(arrays.BF16)[: n * k].reshape(n, k)
    kernel = loader.get_kernel(_MODULE, "dequantize_tiled_unscaled_bf16")
    row_tiles, chunks, _ = tiled_dims(n, k)
    units = row_tiles * chunks  # one warp per (row tile, chunk)
    kernel(max(1, min(-(-units // 8), kernel.max_blocks * 4)), 256, (w.packed, w.block_scales, buf, _U32(n), _U32(k)))
    return buf


def _prefill(a, w: Nvfp4Tensor, m: int, n: int, k: int, epilogue: tuple, plain: bool) -> None:
    """Exact bf16 dequantization into workspaces + one cuBLAS bf16 GEMM (fp32 accumulation).

    Without a bias or per-row decode factors cuBLAS applies alpha itself (device pointer mode:
    alpha is computed on the device) and writes the output; otherwise it writes fp32 and the
    epilogue kernel applies alpha, bias and the cast.
    """
    import cupy

    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError as e:
        raise RuntimeError(
            f"gemm: M={m} takes the prefill path (M > decode_max_m), which needs the cuBLAS library: "
            "pip install nvidia-cublas (CUDA 13) or nvidia-cublas-cu12 (CUDA 12)"
        ) from e
    w_global, out = epilogue[0], epilogue[4]
    a_global = a.global_scale if isinstance(a, Nvfp4Tensor) else 0
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    # the host-side preparation first: the cuBLAS call follows the dequantization launches at once,
    # so the GPU does not wait on Python between them
    if plain:
        alpha_beta = workspace.device_buffer("gemm.alpha", 8).view(np.float32)[:2]
        loader.get_kernel(_MODULE, "gemm_alpha")(1, 32, (w_global, a_global, alpha_beta))
        c, c_type = out, _CUDA_R_32F if out.dtype == np.float32 else _CUDA_R_16BF
        alpha_ptr, beta_ptr = alpha_beta.data.ptr, alpha_beta.data.ptr + 4
    else:
        c, c_type = workspace.device_buffer("gemm.acc", m * n * 4).view(np.float32)[: m * n], _CUDA_R_32F
        one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
        alpha_ptr, beta_ptr = one.ctypes.data, zero.ctypes.data
    w_vals = _dequantize_tiled_unscaled(w, n, k)
    a_vals = _dequantize_unscaled(a, m, k, "gemm.a") if isinstance(a, Nvfp4Tensor) else a.reshape(m, k)
    if plain:
        cublas.setPointerMode(handle, _CUBLAS_POINTER_MODE_DEVICE)
    try:
        # row-major Y[M, N] = A[M, K] @ W[N, K]^T is column-major Y^T = W^T(op T) @ A(op N)
        cublas.gemmEx(handle, _CUBLAS_OP_T, _CUBLAS_OP_N, n, m, k, alpha_ptr, w_vals.data.ptr, _CUDA_R_16BF, k,
                      a_vals.data.ptr, _CUDA_R_16BF, k, beta_ptr, c.data.ptr, c_type, n,
                      _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
    finally:
        if plain:
            cublas.setPointerMode(handle, _CUBLAS_POINTER_MODE_HOST)
    if not plain:
        kernel = loader.get_kernel(_MODULE, "gemm_epilogue")
        kernel(max(1, min(-(-(m * n) // 256), kernel.max_blocks * 4)), 256, (c, a_global, *epilogue))
