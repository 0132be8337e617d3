"""The tiled GEMM weight layout: exact and invertible on numpy, and the bit operations the kernel
applies to it (gemm_engine.cuh: dequant_step, scale_pairs) give back every weight value at the
(row, k) the MMA fragment expects. No GPU needed: the kernel's integer steps are replayed here."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit import formats
from fp4kit.formats import E2M1_VALUES, E4M3_VALUES, Nvfp4Tensor, to_linear, to_tiled
from fp4kit.reference import gemm as ref
from fp4kit.reference import quant as qref

MASK = np.uint32(0x81C081C0)


def bf16_pair_values(words):
    """float64 values of the two bf16 halves (low, high) of uint32 words."""
    w = np.asarray(words, np.uint32)
    lo = (w & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    hi = (w >> 16).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    return lo, hi


def kernel_pairs(q):
    """dequant_step without the scale multiply: the four bf16 pairs of each word (e2m1 * 2^-126)."""
    q = np.asarray(q, np.uint32)
    a3 = ((q >> 4) & 0x00C000C0) | ((q >> 5) & 0x01000100) | ((q << 1) & 0x80008000)
    return [q & MASK, (q << 6) & MASK, (q << 3) & MASK, a3.astype(np.uint32)]


@pytest.mark.parametrize("shape", [(16, 64), (17, 48), (40, 16), (2056, 1040), (3, 33, 272), (1, 16)])
def test_tiling_is_exact_and_invertible(rng, shape):
    q = qref.quantize(rng.standard_normal(shape).astype(np.float32) * 3)
    t = to_tiled(q)
    assert t.scale_layout == "tiled" and t.shape == q.shape
    assert t.packed.shape == formats.packed_shape(q.shape, "tiled")
    back = to_linear(t)
    assert np.array_equal(back.packed, q.packed) and np.array_equal(back.block_scales, q.block_scales)
    assert np.array_equal(qref.dequantize(t), qref.dequantize(q))
    assert to_tiled(t) is t and to_linear(q) is q


def test_every_byte_pattern_round_trips(rng):
    n, k = 48, 320  # padding in both directions
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = rng.integers(0, 256, (n, k // 16), dtype=np.uint8)
    assert np.array_equal(formats.untile_codes(formats.tile_codes(codes, (n, k)), (n, k)), codes)
    assert np.array_equal(formats.untile_scales(formats.tile_scales(scales, (n, k)), (n, k)), scales)
    # padding is zero: a padded code is +0 and a padded scale is 0
    tiled = formats.tile_codes(codes, (n, k))
    assert tiled.size == 3 * 5 * 512 and formats.tile_scales(scales, (n, k)).size == 3 * 2 * 256


def test_kernel_bit_operations_recover_each_fragment(rng):
    """Word s of lane (g, t) in tile (r, c) holds a0 = row g, a1 = row g+8 at k = 16t+4s+{0,1} and a2, a3
    at k + {2, 3}; the masks and shifts give e2m1 * 2^-126 there, for every code."""
    n, k = 32, 128
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    words = formats.tile_codes(formats.pack_nibbles(codes), (n, k)).view(np.uint32).reshape(2, 2, 8, 4, 4)
    values = E2M1_VALUES[codes].astype(np.float64)
    for tile in range(2):
        for chunk in range(2):
            for g in range(8):
                for t in range(4):
                    for s in range(4):
                        pairs = kernel_pairs(words[tile, chunk, g, t, s])
                        for p, pair in enumerate(pairs):
                            row = tile * 16 + g + 8 * (p & 1)
                            kk = chunk * 64 + 16 * t + 4 * s + 2 * (p >> 1)
                            lo, hi = bf16_pair_values(pair)
                            assert lo * 2.0**126 == values[row, kk] and hi * 2.0**126 == values[row, kk + 1]
                            # the sign of -0 survives too
                            assert np.signbit(lo) == bool(codes[row, kk] & 8)


def test_kernel_scale_conversion_is_exact_for_every_e4m3_byte():
    """scale_pairs: (b & 0x7F) << 4 read as bf16 is s * 2^-120, subnormals and zero included; the kernel
    multiplies by 2^120 and 2^100 (exact bf16 multiplies) to get s * 2^100."""
    b = np.arange(0x7F, dtype=np.uint32)  # 0x7F is the NaN byte, refused by the loader
    lo, _ = bf16_pair_values(b << 4)
    assert np.array_equal(lo * 2.0**120, E4M3_VALUES[b].astype(np.float64))
    # every E2M1 x E4M3 product is a normal, exactly representable bf16 after the 2^-26 scaling
    prod = np.outer(E2M1_VALUES[:8], E4M3_VALUES[:0x7F]).astype(np.float64) * 2.0**-26
    assert np.array_equal(prod.astype(ml_dtypes.bfloat16).astype(np.float64), prod)
    assert prod[prod > 0].min() >= 2.0**-126


def test_tiled_scale_bytes_are_where_the_kernel_reads_them(rng):
    n, k = 32, 512
    scales = rng.integers(0, 0x7F, (n, k // 16), dtype=np.uint8)
    tiled = formats.tile_scales(scales, (n, k)).reshape(2, 2, 8, 4, 8)  # tile, group, g, t, bytes
    for tile in range(2):
        for group in range(2):
            for g in range(8):
                for t in range(4):
                    for j in range(4):
                        block = (group * 4 + j) * 4 + t
                        got = tiled[tile, group, g, t]
                        assert got[2 * j] == scales[tile * 16 + g, block]
                        assert got[2 * j + 1] == scales[tile * 16 + g + 8, block]


def test_reference_gemm_reads_tiled_weights(rng):
    w = qref.quantize(rng.standard_normal((40, 96)).astype(np.float32))
    x = rng.standard_normal((3, 96)).astype(ml_dtypes.bfloat16)
    assert np.array_equal(ref.gemm(x, to_tiled(w)), ref.gemm(x, w))


def test_tiled_layout_bad_inputs():
    q = qref.quantize(np.ones(64, np.float32))
    with pytest.raises(ValueError, match="tiled' describes \\[..., N, K\\] weights"):
        to_tiled(q)
    with pytest.raises(ValueError, match="the tiled GEMM weight layout comes from fp4kit.formats.to_tiled"):
        qref.quantize(np.ones((16, 64), np.float32), scale_layout="tiled")
    w = to_tiled(qref.quantize(np.ones((16, 64), np.float32)))
    with pytest.raises(ValueError, match="packed: expected shape"):
        Nvfp4Tensor(w.packed[:-16], w.block_scales, w.global_scale, "tiled", w.shape)


@pytest.mark.parametrize("chunk", [(16, 1), (8, 2)], ids=["128-token-chunks", "64-token-chunks"])
@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 33, 64, 65, 128, 129, 4096])
def test_launch_config_covers_k_in_nonempty_splits_within_the_scratch(m, wgmma, chunk, monkeypatch):
    """Every split of K gets at least one whole activation window and together they cover K; the
    split-K partials fit their per-stream scratch; more rows never split more than fits; the token
    chunks of a wgmma launch (of 128 or 64 tokens) cover M, each with its own scratch, and split K
    only within one wave."""
    from fp4kit.formats import tiled_dims
    from fp4kit.ops import gemm as gemm_ops

    monkeypatch.setattr(gemm_ops, "WGMMA_CHUNK_TILES", chunk[0])
    monkeypatch.setitem(gemm_ops.WGMMA_CHUNK_BLOCKS_PER_SM, chunk[0], chunk[1])

    if m > 64 and not wgmma:
        return  # the mma.sync kernels take at most 64 rows per launch
    for n, k in [(1, 16), (17, 48), (2048, 7168), (7168, 2048), (129280, 4096), (32768, 1024), (2056, 1040)]:
        for sms in (1, 132):
            shape = gemm_ops.launch_config(m, n, k, sms=sms, wgmma=wgmma)
            row_tiles, chunks, _ = tiled_dims(n, k)
            assert shape.wgmma == wgmma and shape.row_groups * 8 * shape.row_tiles_per_warp >= row_tiles
            assert (shape.token_chunks - 1) * 8 * shape.token_tiles < m <= shape.token_chunks * 8 * shape.token_tiles
            assert shape.chunks_per_split % gemm_ops._window_chunks(shape.token_tiles, wgmma) == 0
            assert shape.splits >= 1 and chunks <= shape.splits * shape.chunks_per_split
            assert (shape.splits - 1) * shape.chunks_per_split < chunks
            if shape.cluster:  # one cluster of the split blocks of a row group (and token chunk)
                assert shape.splits == shape.cluster
                assert shape.cluster in gemm_ops.CLUSTER_SIZES[shape.family]
                assert shape.kernel == f"{shape.family}_c{shape.cluster}"
            if wgmma and shape.token_chunks > 1 and shape.splits > 1:  # split only within one wave
                per_sm = gemm_ops.WGMMA_CHUNK_BLOCKS_PER_SM[shape.token_tiles]
                assert shape.row_groups * shape.splits * shape.token_chunks <= per_sm * sms
            if shape.splits > 1 and not shape.cluster:
                rows = shape.token_chunks * 8 * shape.token_tiles if wgmma else m
                assert shape.splits * rows * row_tiles * 16 * 4 <= gemm_ops._PARTIALS_BYTES
            assert shape.shared_bytes <= 227 * 1024
    assert gemm_ops.launch_config(1, 2048, 7168, sms=132).splits > 1  # small weights split K
    assert gemm_ops.launch_config(1, 129280, 4096, sms=132).splits == 1  # the lm_head fills the GPU by itself
    # two row groups per SM or more: no split even where the balanced rule would split (2.42 per SM)
    assert gemm_ops.launch_config(1, 40960, 1024, sms=132).splits == 1
    assert gemm_ops.launch_config(1, 18432, 7168, sms=132).splits == 4  # 1.09 per SM: the balanced split


def test_wgmma_split_rule_prefers_cluster_sizes():
    """Below a row group per SM the wgmma kernels split K into a cluster size (the reduction in
    distributed shared memory): the smallest giving half a block per SM among those that divide the
    windows evenly; a weight of many row groups per SM is not split."""
    from fp4kit.ops import gemm as gemm_ops

    def shape(m, n, k):
        return gemm_ops.launch_config(m, n, k, sms=132, wgmma=True)

    assert (shape(64, 7168, 2048).splits, shape(64, 7168, 2048).cluster) == (2, 2)  # 56 row groups
    assert (shape(32, 1024, 4096).splits, shape(32, 1024, 4096).cluster) == (8, 8)  # 8 row groups
    # 2048x7168: 28 windows do not split into 8 even parts (4 each covers them in 7): 4
    assert (shape(64, 2048, 7168).splits, shape(64, 2048, 7168).cluster) == (4, 4)
    assert shape(64, 129280, 4096).splits == 1  # 1010 row groups
    assert shape(64, 18432, 7168).splits == gemm_ops.WGMMA_WIDE_SPLITS  # 144 row groups: the wide split
    assert gemm_ops.cluster_splits(1, 3, (2, 4, 8), 132) == 2  # 3 windows: 2 + 1 (4 would leave one empty)
    assert gemm_ops.cluster_splits(1, 1, (2, 4, 8), 132) == 1


@pytest.mark.parametrize("m", [65, 96, 128, 129, 256, 512, 4096])
def test_wgmma_token_chunks_of_64_unless_they_split_k_fewer_ways(m):
    """Above 64 rows a wgmma launch runs token chunks of 64 rows at two blocks per SM, except where
    they would split K fewer ways than chunks of 128 rows: then it is the launch of 128-row chunks."""
    from fp4kit.ops import gemm as gemm_ops

    assert gemm_ops.WGMMA_CHUNK_TILES == 8 and gemm_ops.WGMMA_CHUNK_BLOCKS_PER_SM[8] == 2
    for n, k in [(1024, 4096), (2048, 7168), (4096, 2048), (7168, 2048), (18432, 7168), (32768, 1024), (129280, 4096)]:
        if gemm_ops._wide_blocks(m, n, k):  # long-K prefill: its own rule (below)
            continue
        got = gemm_ops.launch_config(m, n, k, sms=132, wgmma=True)
        short, full = (gemm_ops.launch_config(m, n, k, sms=132, wgmma=True, chunk_tiles=t) for t in (8, 16))
        assert short.token_tiles == 8 and short.token_chunks == -(-m // 64) and full.token_tiles == 16
        assert got == (short if short.splits >= full.splits else full), (n, k)
    # 144 row groups in 64-row chunks: 288 blocks, beyond one wave of two per SM, so K is not split;
    # in one chunk of 128 rows it is split 4 ways (measured 82 us against 124 on an H100)
    if m in (96, 128):
        assert gemm_ops.launch_config(m, 18432, 7168, sms=132, wgmma=True).token_tiles == 16
    assert gemm_ops.launch_config(m, 4096, 2048, sms=132, wgmma=True).token_tiles == 8


@pytest.mark.parametrize("m", [512, 1023, 1024, 4096])
def test_wgmma_wide_blocks_for_long_k_prefill(m, monkeypatch):
    """From `WGMMA_WIDE_BLOCK_MIN` rows, K and N a wgmma launch runs 128-token chunks of 256-row
    blocks (two row tiles per warp), split as the rule of 128-token chunks splits them; below any of
    the three, or with the rule off, the launch is the one of the chunk rule."""
    from fp4kit.ops import gemm as gemm_ops

    low = gemm_ops.WGMMA_WIDE_BLOCK_MIN
    for n, k in [(1024, 4096), (2048, 4096), (2048, 7168), (4096, 2048), (4096, 4096), (18432, 7168), (32768, 1024)]:
        got = gemm_ops.launch_config(m, n, k, sms=132, wgmma=True)
        wide = m >= low["m"] and n >= low["n"] and k >= low["k"]
        assert gemm_ops._wide_blocks(m, n, k) == wide
        if wide:
            assert got == gemm_ops.launch_config(m, n, k, sms=132, wgmma=True, chunk_tiles=16, row_tiles=2)
            assert got.family == "wgmma_16x2" and got.token_chunks == -(-m // 128)
            assert got.row_groups == -(-n // 256)
        else:
            assert got.row_tiles_per_warp == 1
        monkeypatch.setattr(gemm_ops, "WGMMA_WIDE_BLOCK_MIN", None)
        assert gemm_ops.launch_config(m, n, k, sms=132, wgmma=True).row_tiles_per_warp == 1
        monkeypatch.setattr(gemm_ops, "WGMMA_WIDE_BLOCK_MIN", low)


def gemv_warp_chunks(shape, n, k, block_row, split, warp):
    """gemv.cuh gemv_block: (row tile, first chunk, end chunk) of one warp of a GEMV launch."""
    from fp4kit.formats import tiled_dims

    _, chunks, groups = tiled_dims(n, k)
    slices = shape.warps // shape.row_tiles_per_warp
    per_split = shape.chunks_per_split // 4
    s_begin = split * per_split
    s_count = min(groups, s_begin + per_split) - s_begin
    slice_ = warp % slices
    c_begin = (s_begin + slice_ * s_count // slices) * 4
    c_end = min(chunks, (s_begin + (slice_ + 1) * s_count // slices) * 4)
    return block_row * shape.row_tiles_per_warp + warp // slices, c_begin, c_end


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("split_below", [0.5, 1 << 30])
@pytest.mark.parametrize("wide", [0.0, 1.0, float("inf")], ids=["8-warps", "16-warps-by-rule", "16-warps-always"])
@pytest.mark.parametrize("whole,resident", [(False, False), (True, False), (False, True)],
                         ids=["bounds-tested", "whole-fetches", "resident-activation"])
def test_gemv_config_covers_every_tile_once_within_the_scratch(m, split_below, wide, whole, resident, monkeypatch):
    """The GEMV launch: its warps (row tile x K slice, per block and split) take every (row tile,
    chunk) of the weight exactly once, slices start on scale groups (4 chunks), no split is empty,
    the split-K partials fit their scratch, and the activation slots fit in shared memory."""
    from fp4kit.formats import tiled_dims
    from fp4kit.ops import gemm as gemm_ops

    monkeypatch.setattr(gemm_ops, "GEMV_SPLIT_BELOW_BLOCKS_PER_SM", split_below)
    monkeypatch.setattr(gemm_ops, "GEMV_WIDE_MAX_BLOCKS_PER_SM", wide)
    monkeypatch.setattr(gemm_ops, "GEMV_WHOLE_FETCHES", whole)
    monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_ACTIVATION", resident)
    monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_MAX_SLICE_GROUPS", 1 << 30)  # every K slice length
    for f in (4, 8):
        monkeypatch.setattr(gemm_ops, "GEMV_FETCH_TILES", f)
        for n, k in [(1, 16), (17, 48), (2056, 1040), (2048, 7168), (1024, 4096), (32768, 1024), (4096, 65536)]:
            shape = gemm_ops.gemv_config(m, n, k, sms=132)
            row_tiles, chunks, groups = tiled_dims(n, k)
            is_wide = shape.warps == 16
            whole_groups = f == 4 and chunks % 4 == 0
            # resident wherever its slots fit; the largest M and K here do not
            assert shape.resident == (resident and whole_groups and shape.shared_bytes == gemm_ops.gemv_resident_bytes(
                m, shape.chunks_per_split // 4, shape.row_tiles_per_warp, shape.warps))
            assert shape.resident or not (resident and whole_groups and k <= 7168)
            assert shape.whole == ((whole or resident) and whole_groups and (whole or shape.resident))
            # a wait per group (pipelined) where the resident block is 16 warps over one row tile
            assert shape.pipelined == (shape.resident and is_wide and gemm_ops.GEMV_RESIDENT_PIPELINED)
            build = ("resp" if shape.pipelined else "res") if shape.resident else "whole" if shape.whole else ""
            assert shape.gemv and shape.family == (f"gemv_{shape.row_tiles_per_warp}f{f}" + ("w16" if is_wide else "")
                                                   + build)
            assert shape.warps in (8, 16) and (not is_wide or (groups >= 16 and shape.row_tiles_per_warp == 1))
            fits = gemm_ops.gemv_shared_bytes(m, f, 16) <= gemm_ops._GEMV_MAX_SHARED
            assert is_wide == (groups >= 16 and fits) or wide != float("inf")
            if is_wide and wide < float("inf"):  # by the rule: 8-warp blocks would leave an SM with 8 warps
                assert -(-row_tiles // (8 // min(8, 1 << (groups.bit_length() - 1)))) <= 132
            assert shape.row_tiles_per_warp in (1, 2, 4, 8) and shape.chunks_per_split % 4 == 0
            assert (shape.splits - 1) * shape.chunks_per_split < chunks <= shape.splits * shape.chunks_per_split
            if shape.splits > 1:
                assert shape.splits * m * row_tiles * 16 * 4 <= gemm_ops._PARTIALS_BYTES
            assert shape.shared_bytes <= 227 * 1024 - 8 * 1024  # beside the static buffers
            seen = np.zeros((row_tiles, chunks), np.int32)
            for block_row in range(shape.row_groups):
                for split in range(shape.splits):
                    for warp in range(shape.warps):
                        tile, c_begin, c_end = gemv_warp_chunks(shape, n, k, block_row, split, warp)
                        assert c_begin % 4 == 0
                        assert not shape.whole or (c_end - c_begin) % f == 0  # no fetch past the slice
                        if tile < row_tiles:
                            seen[tile, c_begin:c_end] += 1
            assert (seen == 1).all(), (n, k, shape)
    # an 8 MB weight fills the GPU with its row tiles: no split over blocks by default
    monkeypatch.setattr(gemm_ops, "GEMV_SPLIT_BELOW_BLOCKS_PER_SM", 0.5)
    monkeypatch.setattr(gemm_ops, "GEMV_WIDE_MAX_BLOCKS_PER_SM", 1.0)
    assert gemm_ops.gemv_config(1, 2048, 7168, sms=132).splits == 1
    assert gemm_ops.gemv_config(1, 2048, 7168, sms=132).warps == 16  # 128 row tiles, 28 scale groups
    assert gemm_ops.gemv_config(1, 4096, 4096, sms=132).warps == 8  # 256 blocks: two per SM already
    assert gemm_ops.gemv_config(1, 2048, 2048, sms=132).warps == 8  # 8 scale groups: no more K slices
    assert gemm_ops.gemv_config(1, 1024, 4096, sms=132).splits == 1  # 16 warps take the 16 scale groups
    monkeypatch.setattr(gemm_ops, "GEMV_WIDE_MAX_BLOCKS_PER_SM", 0.0)
    assert gemm_ops.gemv_config(1, 1024, 4096, sms=132).splits == 2  # 64 row tiles of 8 warps: two splits


def test_gemv_holds_its_grid_by_taking_fewer_k_slices(monkeypatch):
    """A GEMV grid above `max_blocks` (a grouped GEMV, with no tiled kernel to fall back to; a dense
    one at M = 1 before it does) halves the K slices of each row tile (twice the row tiles per block)
    up to `GEMV_HELD_MAX_ROW_TILES`; the launch still covers every (row tile, chunk) once; grids
    within the limit are unchanged."""
    from fp4kit.formats import tiled_dims
    from fp4kit.ops import gemm as gemm_ops

    assert gemm_ops.grouped_gemv_max_blocks(1, sms=132) == 264  # GROUPED_GEMV_MAX_BLOCKS_PER_SM
    assert gemm_ops.GEMV_HELD_MAX_ROW_TILES == 2
    assert gemm_ops.gemv_launch(1, 7168, 2048, sms=132).family == "gemv_2f4whole"  # 448 row tiles in 224 blocks
    assert gemm_ops.gemv_launch(8, 7168, 2048, sms=132) is None  # M = 8: the tiled kernel
    assert gemm_ops.gemv_launch(1, 32768, 1024, sms=132) is None  # 1024 blocks of two row tiles: tiled
    for m, max_blocks, rt in [(1, None, 1), (1, 264, 2), (1, 132, 2), (8, 64, 2)]:
        assert gemm_ops.gemv_config(m, 8192, 4096, sms=132, max_blocks=max_blocks).row_tiles_per_warp == rt
    monkeypatch.setattr(gemm_ops, "GEMV_HELD_MAX_ROW_TILES", 8)
    for m, max_blocks, rt in [(1, None, 1), (1, 264, 2), (1, 132, 4), (8, 64, 8), (8, 10, 8)]:
        shape = gemm_ops.gemv_config(m, 8192, 4096, sms=132, max_blocks=max_blocks)  # wo_a, V4-Flash: 512 row tiles
        assert (shape.row_tiles_per_warp, shape.row_groups, shape.warps) == (rt, 512 // rt, 8), (m, max_blocks, shape)
        seen = np.zeros(tiled_dims(8192, 4096)[:2], np.int32)
        for block_row in range(shape.row_groups):
            for warp in range(shape.warps):
                tile, c_begin, c_end = gemv_warp_chunks(shape, 8192, 4096, block_row, 0, warp)
                seen[tile, c_begin:c_end] += 1
        assert (seen == 1).all()
    # small grids keep their slices (and their 16-warp blocks)
    assert gemm_ops.gemv_config(1, 2048, 7168, sms=132, max_blocks=264) == gemm_ops.gemv_config(1, 2048, 7168, sms=132)


def test_gemv_resident_activation_rule():
    """By default the activation is resident where every warp's K slice is one scale group (K of
    4 groups at two row tiles per block, 8 groups over 8 warps, 16 over 16) or the block has 16
    warps (a wait per group), and staged per group where an 8-warp slice is longer; whole fetches
    wherever K is whole groups."""
    from fp4kit.ops import gemm as gemm_ops

    assert gemm_ops.GEMV_RESIDENT_ACTIVATION and gemm_ops.GEMV_WHOLE_FETCHES
    for m in (1, 8):
        assert gemm_ops.gemv_config(m, 4096, 1024, sms=132).family == "gemv_2f4res"
        assert gemm_ops.gemv_config(m, 2048, 2048, sms=132).family == "gemv_1f4res"
        assert gemm_ops.gemv_config(m, 2048, 4096, sms=132).family == "gemv_1f4w16resp"
        assert gemm_ops.gemv_config(m, 4096, 4096, sms=132).family == "gemv_1f4whole"  # 2 groups per slice
        assert gemm_ops.gemv_config(m, 2048, 7168, sms=132).family == "gemv_1f4w16resp"  # up to 2 of 28
        assert gemm_ops.gemv_config(m, 2048, 1040, sms=132).family.endswith("f4")  # K not whole groups


def test_gemv_resident_pipelined_rule(monkeypatch):
    """The pipelined resident build (a wait per group) takes 16-warp blocks of one row tile at any
    slice length, for a bf16 activation; 8-warp blocks keep the double buffer (slices of 2+ groups)
    or the one-wait build, several row tiles per block the block-shared build."""
    from fp4kit.ops import gemm as gemm_ops

    monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_PIPELINED", True)
    for m in (1, 8):
        assert gemm_ops.gemv_config(m, 4096, 4096, sms=132).family == "gemv_1f4whole"  # 8 warps, 2 groups per slice
        assert gemm_ops.gemv_config(m, 2048, 7168, sms=132).family == "gemv_1f4w16resp"
        assert gemm_ops.gemv_config(m, 2048, 2048, sms=132).family == "gemv_1f4res"
        assert gemm_ops.gemv_config(m, 4096, 1024, sms=132).family == "gemv_2f4res"
        assert gemm_ops.gemv_config(m, 2048, 7168, sms=132, nvfp4_act=True).family == "gemv_1f4w16whole"
        shape = gemm_ops.gemv_config(m, 2048, 7168, sms=132)
        assert shape.shared_bytes == gemm_ops.gemv_resident_bytes(m, 28, 1, 16) <= gemm_ops._GEMV_MAX_SHARED


def wgmma_pair_offset(m, kk, tiles):
    """gemm_engine.cuh Window<T, true>::pair: where token m's bf16 pair at window position kk is staged
    (K-columns of 8T tokens x 8 bf16 plus 8 bf16 of padding)."""
    c, t, s, h = kk // 64, kk // 16 % 4, kk // 4 % 4, kk // 2 % 2
    return m * 8 + ((c * 4 + s) * 2 + h) * (64 * tiles + 8) + 2 * t


def wgmma_block16(p, thread):
    """Window<T, true>::block16: (token, window position) of the p-th 16-element block of a thread."""
    u, lane = p * 8 + thread // 32, thread % 32
    return u // 4 * 8 + lane // 4, u % 4 * 64 + lane % 4 * 16


@pytest.mark.parametrize("tiles", [2, 4, 8, 16])
def test_wgmma_staging_stores_are_free_of_bank_conflicts(tiles):
    """Each warp-wide 4-byte store of the wgmma staging hits 32 different banks: the bf16 copies
    (a warp takes 32 consecutive pairs of one token) and the NVFP4 blocks (a warp takes 8 tokens x 4
    blocks, storing pair q of each at once); together they cover the window once."""
    pairs_per_row, seen = 256 // 2, set()
    for thread0 in range(0, 8 * tiles * pairs_per_row, 32):  # bf16: one warp instruction per 32 pairs
        words = [wgmma_pair_offset(i // pairs_per_row, i % pairs_per_row * 2, tiles) // 2
                 for i in range(thread0, thread0 + 32)]
        assert len({w % 32 for w in words}) == 32
        seen.update(words)
    assert len(seen) == 8 * tiles * pairs_per_row
    blocks = 8 * tiles * 256 // 16 // 256  # per thread and window
    for p in range(blocks):
        for warp in range(8):
            for q in range(8):
                words = [wgmma_pair_offset(*(lambda m, kk: (m, kk + 2 * q))(*wgmma_block16(p, 32 * warp + lane)), tiles) // 2
                         for lane in range(32)]
                assert len({w % 32 for w in words}) == 32, (p, warp, q)
    covered = {wgmma_block16(p, th) for p in range(blocks) for th in range(256)}
    assert covered == {(m, kk) for m in range(8 * tiles) for kk in range(0, 256, 16)}


@pytest.mark.parametrize("tiles", [2, 4, 16])
def test_wgmma_operands_pair_the_right_k(rng, tiles):
    """The warpgroup-MMA path, replayed: the activation staged by Window<T, true>::pair, read back as
    wgmma's B operand (K-major, no swizzle: cores of 8 tokens x 8 k, leading offset 128 T + 16
    bytes, stride offset 128 bytes) against each lane's A fragment from the tiled weight (row g / g + 8,
    k 16t + 4s + {0, 1} in registers 0, 1 and + {2, 3} in 2, 3), gives the exact product."""
    n, k, tokens = 16, 256, 8 * tiles  # one row tile, one window of 4 tiles
    w = rng.integers(-8, 8, (n, k)).astype(np.float64)
    x = rng.integers(-8, 8, (tokens, k)).astype(np.float64)
    smem = np.full(k // 8 * (64 * tiles + 8), np.nan)
    for m in range(tokens):
        for kk in range(0, k, 2):
            o = wgmma_pair_offset(m, kk, tiles)
            smem[o:o + 2] = x[m, kk:kk + 2]
    assert np.isnan(smem).sum() == k // 8 * 8  # every element staged once; the padding is left alone
    lead, stride = 64 * tiles + 8, 128 // 2  # in bf16 elements
    got = np.zeros((n, tokens))
    for c in range(4):
        for s in range(4):
            start = (c * 4 + s) * 2 * lead
            b = np.array([[smem[start + kk // 8 * lead + tok // 8 * stride + tok % 8 * 8 + kk % 8] for tok in range(tokens)]
                          for kk in range(16)])  # B[kk, token] as the MMA reads it
            a = np.zeros((16, 16))  # A[row, kk] from the lanes' fragments
            for g in range(8):
                for t in range(4):
                    for reg in range(4):  # reg 0: (g, 2t), 1: (g + 8, 2t), 2: (g, 2t + 8), 3: (g + 8, 2t + 8)
                        row, col = g + 8 * (reg & 1), 2 * t + 8 * (reg >> 1)
                        actual = c * 64 + 16 * t + 4 * s + 2 * (reg >> 1)
                        a[row, col:col + 2] = w[row, actual:actual + 2]
            got += a @ b
    assert np.array_equal(got, w @ x.T)


def test_kernel_launch_raises_the_shared_memory_limit_once_and_passes_the_grid():
    """`loader.Kernel.launch`, the launch of the GEMM, grouped-GEMM and attention kernels: a tuple
    grid, dynamic shared memory, and the 48 KB default limit raised only when needed."""
    from fp4kit.runtime import loader

    class Function:  # records what a cupy.RawKernel would be asked
        max_dynamic_shared_size_bytes = 48 * 1024

        def __init__(self):
            self.calls = []

        def __call__(self, grid, block, args, shared_mem=0):
            self.calls.append((grid, block, args, shared_mem))

    f = Function()
    kernel = loader.Kernel(f, False, 1)
    kernel.launch((3, 2), 256, ("a",), shared_mem=66560)
    assert f.max_dynamic_shared_size_bytes == 66560 and f.calls == [((3, 2), (256,), ("a",), 66560)]
    kernel.launch((5,), 128, (), shared_mem=1024)
    assert f.max_dynamic_shared_size_bytes == 66560 and f.calls[-1] == ((5,), (128,), (), 1024)


def test_activation_paths_by_rows_and_weight_size():
    """Where the activation is prepared: an NVFP4 activation on the mma.sync kernels is dequantized
    by its own launch on large weights only; the wgmma kernels read window images for
    NVFP4 always and for bf16 above 64 rows or on large weights."""
    from fp4kit.ops import gemm as gemm_ops

    big, small = (18432, 7168), (2048, 7168)
    assert gemm_ops.predequantizes(1, *big, wgmma=False) and gemm_ops.predequantizes(16, *big, wgmma=False)
    assert not gemm_ops.predequantizes(1, *small, wgmma=False)
    assert not gemm_ops.predequantizes(16, *small, wgmma=False) and not gemm_ops.predequantizes(16, *big, wgmma=True)
    assert gemm_ops.uses_image(17, *small, nvfp4=True) and not gemm_ops.uses_image(64, *small, nvfp4=False)
    assert gemm_ops.uses_image(65, *small, nvfp4=False) and gemm_ops.uses_image(17, *big, nvfp4=False)


def test_wgmma_cluster_only_where_its_clusters_fit():
    """The split rules choose among the cluster sizes whose clusters all fit at once, and a launch
    keeps its cluster only where the clusters take no more waves than its blocks without one
    (`CLUSTERS_MUST_FIT`; the device's capacities passed in, here those the H100 reports for the
    16-token-tile kernels, one block per SM: 66 clusters of 2, 30 of 4, 15 of 8)."""
    from fp4kit.ops import gemm as gemm_ops

    capacity = {1: 132, 2: 66, 4: 30, 8: 15}
    queried = []

    def h100(kernel, cluster, shared):
        queried.append((kernel, cluster))
        return capacity[cluster]

    def shape(m, n, k, cap=h100):
        s = gemm_ops.launch_config(m, n, k, sms=132, wgmma=True, cluster_capacity=cap)
        return s.splits, s.cluster

    # 128 rows, 4096x4096: 32 row groups; half a block per SM would be 4 splits, but 32 clusters of
    # 4 (or 8) do not fit: 2 splits in clusters of 2 (64 blocks). Without capacities: 4
    assert shape(128, 4096, 4096, None) == (4, 4)
    assert shape(128, 4096, 4096) == (2, 2)
    assert ("wgmma_16x1_c4", 4) in queried
    assert shape(128, 2048, 7168) == (4, 4)  # 16 clusters of 4 fit
    # token chunks: the one-wave split (4) or the largest cluster size within it that fits
    assert shape(256, 2048, 7168, None) == (4, 4)
    assert shape(256, 2048, 7168) == (2, 2)  # 32 chunk clusters of 4 do not fit
    assert shape(256, 1024, 4096) == (4, 4)  # 16 clusters: of 8 not, of 4 they do
    assert shape(256, 4096, 4096) == (2, 2)
    assert shape(256, 7168, 2048) == (1, 0)  # 112 row groups and chunks: one wave unsplit
    # nothing fits: the global scratch
    assert shape(128, 4096, 4096, lambda kernel, cluster, shared: 132 if cluster == 1 else 1)[1] == 0
    # a grid of several waves either way keeps its clusters (18432x7168 at 64 rows: 144 clusters of
    # 4 in 3 waves, as its 576 blocks at two per SM)
    assert shape(64, 18432, 7168, lambda kernel, cluster, shared: 264 // cluster) == (4, 4)
    gemm_ops.CLUSTERS_MUST_FIT, saved = False, gemm_ops.CLUSTERS_MUST_FIT
    try:
        assert shape(128, 4096, 4096) == (4, 4)
    finally:
        gemm_ops.CLUSTERS_MUST_FIT = saved
