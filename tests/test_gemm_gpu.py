"""NVFP4 GEMMs on the GPU against a float64 GEMM of the dequantized operands (calc_diff), both
paths (the tiled decode kernel with and without split-K, and the prefill cuBLAS path), W4A16 and
W4A4, odd shapes, determinism, graph replay, and the layers captured in a CUDA graph."""

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.formats import to_linear, to_tiled
from fp4kit.layers import Linear, SharedExpert, fuse_gate_up
from fp4kit.ops import gemm as gemm_ops
from fp4kit.ops.gemm import gemm
from fp4kit.reference import gemm as ref
from fp4kit.reference import quant as qref

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16
BOUND = 1e-5  # calc_diff of a bf16 output against float64: the output rounding is about 1e-6
BOUND_F32 = 1e-9  # fp32 output: exact products, fp32 sums (a 0.4 % scale error gives ~1e-5)


def to_device(q):
    return fp4kit.Nvfp4Tensor(cp.asarray(q.packed), cp.asarray(q.block_scales), cp.asarray(q.global_scale),
                              q.scale_layout, q.shape)


def tiled(q):
    """A host weight on the device in the GEMM's tiled layout."""
    return to_tiled(to_device(q))


def weight(rng, n, k):
    return qref.quantize((rng.standard_normal((n, k)) * rng.lognormal(0, 1, (n, 1))).astype(np.float32))


@pytest.fixture(scope="session")
def shape_weight(run_seed):
    """``get(n, k)``: a weight of that shape drawn once per run (from the run seed and the shape) and
    shared by the tests that sweep engines and sizes over it: quantizing the larger ones on the host
    (about a second at 2056 x 7168) was most of those tests' time."""
    cache = {}

    def get(n, k):
        if (n, k) not in cache:
            cache[(n, k)] = weight(np.random.default_rng([run_seed, n, k]), n, k)
        return cache[(n, k)]

    return get


ENGINES = ["gemv", "gemv-f8", "gemv-split", "gemv-16-warps", "gemv-whole", "gemv-held", "gemv-resident", "gemv-resident-16-warps", "gemv-resident-pipelined", "mma.sync", "mma.sync-predequantized", "wgmma", "wgmma-images",
           "wgmma-2-row-tiles", "wgmma-128-token-chunks", "wgmma-128-token-chunks-2-row-tiles"]


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    """Every M on one tensor-core path: up to 8 rows the GEMV kernels (K split over the 8 warps of a
    block, or over 16 wherever K has 16+ scale groups with "16-warps"; 4 or 8 weight tiles per
    fetch; without per-tile bounds tests on a K of whole scale groups with "whole", and with the
    block's activation staged once, resident in shared memory, with "resident"; K split over
    blocks too, at every size, with "split"; every grid held to 4 blocks, i.e. up to 8 row tiles
    per block over fewer K slices, with "held"),
    the mma.sync kernels (an NVFP4 activation decoded in the blocks, or dequantized by its own
    launch first: "predequantized"), or (on Hopper) the warpgroup-MMA ones, with one or two row tiles per
    warp; their bf16 activation up to 64 rows staged in the blocks (these test weights are small)
    or, with "images", as window images at every M; above 64 rows token chunks of 64 rows at two
    blocks per SM (where they split K no fewer ways), or of 128 at one with "128-token-chunks"."""
    if request.param.startswith("wgmma") and cp.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma kernels need sm_90")
    gemv = request.param.startswith("gemv")
    monkeypatch.setattr(gemm_ops, "USE_GEMV", gemv)
    monkeypatch.setattr(gemm_ops, "GEMV_MAX_BLOCKS_PER_SM", {gemm_ops.GEMV_MAX_M: float("inf")})
    monkeypatch.setattr(gemm_ops, "GEMV_FETCH_TILES", 8 if request.param == "gemv-f8" else 4)
    monkeypatch.setattr(gemm_ops, "GEMV_WIDE_MAX_BLOCKS_PER_SM", float("inf") if request.param.endswith("16-warps") else 0.0)
    monkeypatch.setattr(gemm_ops, "GEMV_WHOLE_FETCHES", request.param in ("gemv-whole", "gemv-held"))
    if request.param == "gemv-held":
        monkeypatch.setattr(gemm_ops, "GEMV_HELD_MAX_ROW_TILES", 8)
        monkeypatch.setattr(gemm_ops, "gemv_launch", lambda m, n, k, sms=None, nvfp4_act=False: gemm_ops.gemv_config(
            m, n, k, sms, nvfp4_act, max_blocks=4) if m <= gemm_ops.GEMV_MAX_M else None)
    monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_ACTIVATION", request.param.startswith("gemv-resident"))
    monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_MAX_SLICE_GROUPS", 1 << 30)  # long K slices too
    monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_NVFP4_ACTIVATION", True)  # W4A4 through the resident build too
    monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_PIPELINED", request.param == "gemv-resident-pipelined")
    if request.param == "gemv-split":
        monkeypatch.setattr(gemm_ops, "GEMV_SPLIT_BELOW_BLOCKS_PER_SM", 1 << 30)
    monkeypatch.setattr(gemm_ops, "WGMMA_MIN_M", 1 << 30 if request.param.startswith(("mma.sync", "gemv")) else 1)
    monkeypatch.setattr(gemm_ops, "PREDEQUANTIZE_MIN_WEIGHT", 0 if request.param.endswith("predequantized") else 1 << 62)
    monkeypatch.setattr(gemm_ops, "WGMMA_IMAGE_MIN_WEIGHT", 0 if request.param == "wgmma-images" else 1 << 62)
    if request.param.startswith("wgmma-128-token-chunks"):
        monkeypatch.setattr(gemm_ops, "WGMMA_CHUNK_TILES", 16)
    if request.param.endswith("2-row-tiles"):
        monkeypatch.setitem(gemm_ops.WGMMA_ROW_TILES_PER_WARP, 4, 2)
        monkeypatch.setitem(gemm_ops.WGMMA_ROW_TILES_PER_WARP, 8, 2)
        monkeypatch.setitem(gemm_ops.WGMMA_ROW_TILES_PER_WARP, 16, 2)
    return request.param


@pytest.mark.parametrize("k", [16, 48, 1040, 2048, 7168])
@pytest.mark.parametrize("engine,m", [(e, m) for e in ENGINES for m in (1, 3, 8, 17, 64, 65, 300)
                                      if m <= 8 or not e.startswith("gemv")], indirect=["engine"])
def test_gemm_paths_match_float64(rng, shape_weight, m, k, engine):
    n = 2056  # not a multiple of the 16-row tile nor of a 128-row group
    w = shape_weight(n, k)
    wd = tiled(w)
    x = (rng.standard_normal((m, k)) * 2).astype(BF16)
    bias = rng.standard_normal(n).astype(np.float32)
    for act in ("bf16", "nvfp4"):
        a = x if act == "bf16" else qref.quantize(x)
        ad = cp.asarray(x) if act == "bf16" else to_device(a)
        expect = ref.gemm(a, w, bias, None, np.float64)
        for out_dtype, bound in ((BF16, BOUND), (np.float32, BOUND_F32)):
            # m = 65 and 300: mma.sync once per 64 rows, wgmma as token chunks; the prefill path too
            for decode_max_m in ({64, m} if m > 64 else {64, 0}):
                out = cp.full((m, n), np.nan, out_dtype)
                y = gemm(ad, wd, bias=cp.asarray(bias), out=out, decode_max_m=decode_max_m)
                diff = ref.calc_diff(cp.asnumpy(y), expect)
                assert diff < bound, (act, out_dtype, decode_max_m, diff)


@pytest.mark.parametrize("n,k", [(1, 16), (17, 48), (2048, 7168), (7168, 2048), (129, 4096)])
@pytest.mark.parametrize("clusters", [True, False], ids=["cluster-reduction", "global-reduction"])
def test_split_k_is_deterministic_and_exact(rng, shape_weight, n, k, engine, clusters, monkeypatch):
    """Small weights split K over many blocks; the reduction adds the splits in a fixed order, in a
    thread-block cluster or through the global scratch."""
    monkeypatch.setattr(gemm_ops, "USE_CLUSTERS", clusters)
    w = shape_weight(n, k)
    wd = tiled(w)
    for m in (1, 8) if engine.startswith("gemv") else (1, 16, 64, 128, 256):  # 256: two token chunks
        splits = launch_shape(m, n, k, engine).splits
        x = rng.standard_normal((m, k)).astype(BF16)
        expect = ref.gemm(x, w, None, None, np.float64)
        first = cp.full((m, n), np.nan, np.float32)
        gemm(cp.asarray(x), wd, out=first)
        assert ref.calc_diff(cp.asnumpy(first), expect) < BOUND_F32, (m, splits)
        for _ in range(3):
            again = cp.full((m, n), np.nan, np.float32)
            gemm(cp.asarray(x), wd, out=again)
            assert cp.array_equal(first.view(cp.uint32), again.view(cp.uint32)), (m, splits)
    if not engine.startswith("gemv") or engine == "gemv-split":  # the split path is exercised
        assert launch_shape(1, 2048, 7168, engine).splits > 1


def launch_shape(m, n, k, engine):
    if engine.startswith("gemv"):
        return gemm_ops.gemv_config(m, n, k)
    return gemm_ops.launch_config(m, n, k, wgmma=not engine.startswith("mma.sync"))


def test_graph_replay_equals_eager(rng, capture_stream):
    w = tiled(weight(rng, 2048, 7168))
    xs = [cp.asarray(rng.standard_normal((m, 7168)).astype(BF16)) for m in (1, 8, 64)]
    eager = [gemm(x, w, out_dtype=np.float32) for x in xs]
    outs = [cp.full(e.shape, np.nan, np.float32) for e in eager]
    stream = capture_stream()
    with stream:
        for x, o in zip(xs, outs):
            gemm(x, w, out=o)  # first use on this stream allocates its split-K scratch outside the graph
        stream.begin_capture()
        for x, o in zip(xs, outs):
            gemm(x, w, out=o)
        graph = stream.end_capture()
        for o in outs:
            o.fill(np.nan)
        for _ in range(2):
            graph.launch(stream)
        stream.synchronize()
    for e, o in zip(eager, outs):
        assert cp.array_equal(e.view(cp.uint32), o.view(cp.uint32))


def assert_replayed_chain_gives_eager_bits(chain, bufs, capture_stream):
    """``chain()`` captured in a graph and replayed three times (``bufs`` zeroed before each) writes
    into ``bufs`` the bits of its eager run."""
    chain()
    want = [cp.asnumpy(b).view(np.uint16).copy() for b in bufs]
    stream = capture_stream()
    with stream:
        chain()  # first use on this stream allocates its split-K scratch outside the graph
        stream.begin_capture()
        chain()
        graph = stream.end_capture()
        for _ in range(3):
            for b in bufs:
                b.fill(0)
            graph.launch(stream)
            stream.synchronize()
            for b, w in zip(bufs, want):
                np.testing.assert_array_equal(cp.asnumpy(b).view(np.uint16), w)


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("release", [True, False])
def test_gemv_chain_released_early_in_a_graph_gives_the_same_bits(rng, capture_stream, monkeypatch, m, release):
    """With `GEMV_EARLY_RELEASE` a single-wave GEMV lets the next kernel launch once its first weights
    are in flight (common/pdl.cuh): a captured chain of GEMMs, each reading the one before's output
    (8-warp, 16-warp, resident and grouped GEMV builds; at M = 8 the 4096-row links take the tiled
    kernels), replayed, gives the bits of the chain launched eagerly (each next kernel still waits
    for the GEMV's completion before it reads)."""
    from fp4kit.runtime import loader

    monkeypatch.setattr(gemm_ops, "GEMV_EARLY_RELEASE", release)
    links = [(4096, 4096), (2048, 4096), (2 * 1024, 1024), (4096, 2048)]  # (N, K); the third is 2 groups of K
    ws = [tiled(weight(rng, n, k)) for n, k in links]
    x = cp.asarray(rng.standard_normal((m, 4096)).astype(BF16))
    bufs = [cp.empty((m, n), BF16) for n, _ in links]

    def chain():
        gemm(x, ws[0], out=bufs[0])
        gemm(bufs[0], ws[1], out=bufs[1])
        gemm_ops.gemm_grouped(bufs[1], ws[2], 2, out=bufs[2])
        gemm(bufs[2], ws[3], out=bufs[3])

    dense = [gemm_ops.gemv_launch(m, n, k) for n, k in links[:2] + links[3:]]
    assert dense[1] is not None  # the 16-warp GEMV at either M
    for shape in filter(None, dense):  # the GEMV links are single waves, so they release when asked
        kernel = loader.get_kernel("gemm", f"gemm_{shape.kernel}_bf16")
        assert shape.row_groups * shape.splits <= kernel.resident_blocks(32 * shape.warps, shape.shared_bytes)
    assert_replayed_chain_gives_eager_bits(chain, bufs, capture_stream)


@pytest.mark.parametrize("m", [32, 64, 256])
@pytest.mark.parametrize("release", [True, False])
def test_wgmma_chain_with_early_staging_release_in_a_graph_gives_the_same_bits(rng, capture_stream, monkeypatch,
                                                                                m, release):
    """With `STAGE_EARLY_RELEASE` the wgmma GEMM's staging launch lets the GEMM's blocks be scheduled
    right after its own wait (common/pdl.cuh): a captured chain of wgmma GEMMs reading window images
    (W4A16 and W4A4, the NVFP4 activation quantized from the link before), each reading the one
    before's output, replayed, gives the bits of the chain launched eagerly."""
    from fp4kit.runtime import loader

    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma kernels need sm_90")
    monkeypatch.setattr(gemm_ops, "STAGE_EARLY_RELEASE", release)
    monkeypatch.setattr(gemm_ops, "WGMMA_IMAGE_MIN_WEIGHT", 0)  # images for these small weights too
    links = [(2048, 4096), (4096, 2048), (2048, 4096)]  # (N, K)
    ws = [tiled(weight(rng, n, k)) for n, k in links]
    x = cp.asarray(rng.standard_normal((m, 4096)).astype(BF16))
    bufs = [cp.empty((m, n), BF16) for n, _ in links]

    def chain():
        gemm(x, ws[0], out=bufs[0])
        gemm(fp4kit.quantize(bufs[0]), ws[1], out=bufs[1])  # W4A4
        gemm(bufs[1], ws[2], out=bufs[2])

    for n, k in links:  # every link's staging grid is one wave, so it releases when asked
        shape = gemm_ops.launch_config(m, n, k, wgmma=True)
        assert shape.wgmma
        stage = loader.get_kernel("gemm", f"gemm_stage_{shape.token_tiles}_bf16")
        windows, chunks = gemm_ops.staging_grid(shape, k)
        assert windows * chunks <= stage.resident_blocks(256, shape.shared_bytes // 2)
    assert_replayed_chain_gives_eager_bits(chain, bufs, capture_stream)


def test_large_m_prefill_and_decode(rng):
    m, n, k = 4096, 1040, 7168
    w, x = weight(rng, n, k), rng.standard_normal((m, k)).astype(BF16)
    expect = ref.gemm(x, w, None, None, np.float64)
    y = gemm(cp.asarray(x), tiled(w), out_dtype=np.float32)
    assert ref.calc_diff(cp.asnumpy(y), expect) < BOUND_F32
    y = gemm(cp.asarray(x[:300]), tiled(w), decode_max_m=1 << 30)  # the engine: 64-row launches or token chunks
    assert ref.calc_diff(cp.asnumpy(y), expect[:300]) < BOUND
    y = gemm(cp.asarray(x), tiled(w), decode_max_m=1 << 30, out_dtype=np.float32)
    assert ref.calc_diff(cp.asnumpy(y), expect) < BOUND_F32


def test_linear_weight_on_device_is_refused_with_a_pointer_to_to_tiled(rng):
    with pytest.raises(ValueError, match="to_tiled"):
        gemm(cp.ones((1, 64), BF16), to_device(weight(rng, 32, 64)))


def test_decode_is_deterministic_and_writes_every_output(rng):
    w = tiled(weight(rng, 4096, 7168))
    x = cp.asarray(rng.standard_normal((16, 7168)).astype(BF16))
    a = cp.full((16, 4096), np.nan, BF16)
    b = cp.full((16, 4096), np.nan, BF16)
    gemm(x, w, out=a)
    gemm(x, w, out=b)
    assert not cp.isnan(a).any()
    assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))


def test_row_decode_for_fused_shards(rng):
    gate = qref.quantize(rng.standard_normal((1024, 2048)).astype(np.float32) * 5)
    up = qref.quantize(rng.standard_normal((1024, 2048)).astype(np.float32) * 0.02)
    fused, row_decode = fuse_gate_up(to_device(gate), to_device(up))
    fused_h, row_decode_h = fuse_gate_up(gate, up)
    assert np.array_equal(cp.asnumpy(row_decode), row_decode_h)
    x = rng.standard_normal((4, 2048)).astype(BF16)
    y = gemm(cp.asarray(x), to_tiled(fused), row_decode=row_decode, out_dtype=np.float32)
    expect = ref.gemm(x, fused_h, None, row_decode_h, np.float64)
    assert ref.calc_diff(cp.asnumpy(y), expect) < BOUND


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_layers_in_a_cuda_graph(rng, mode, capture_stream):
    h, i = 1024, 512
    wg, wu = rng.standard_normal((i, h)).astype(np.float32), rng.standard_normal((i, h)).astype(np.float32)
    wd = rng.standard_normal((h, i)).astype(np.float32)
    se = SharedExpert.from_float(cp.asarray(wg), cp.asarray(wu), cp.asarray(wd), limit=10.0, mode=mode)
    se_ref = SharedExpert(Linear(_host(se.gate_up.weight), mode=mode), Linear(_host(se.down.weight), mode=mode), limit=10.0)
    x = cp.zeros((8, h), BF16)
    y = se(x)  # eager first call: compiles, allocates the layer's buffers
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        se(x)
        graph = stream.end_capture()
    for _ in range(3):
        xn = rng.standard_normal((8, h)).astype(BF16)
        x.set(xn, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        expect = se_ref(xn)
        assert ref.calc_diff(cp.asnumpy(y).astype(np.float32), expect.astype(np.float32)) < 1e-4


def _host(q):
    return fp4kit.Nvfp4Tensor(cp.asnumpy(q.packed), cp.asnumpy(q.block_scales), cp.asnumpy(q.global_scale),
                              q.scale_layout, q.shape)


def test_linear_from_float_on_device_equals_reference(rng):
    w = rng.standard_normal((256, 512)).astype(np.float32)
    lin = Linear.from_float(cp.asarray(w))
    r = qref.quantize(w)
    assert lin.weight.scale_layout == "tiled"
    assert np.array_equal(cp.asnumpy(to_linear(lin.weight).packed), r.packed)
    x = rng.standard_normal((3, 512)).astype(BF16)
    y = lin(cp.asarray(x))
    expect = Linear(r)(x)
    assert ref.calc_diff(cp.asnumpy(y).astype(np.float32), expect.astype(np.float32)) < BOUND


def test_device_bad_inputs(rng):
    w = tiled(weight(rng, 32, 64))
    with pytest.raises(ValueError, match="arrays must live on one device"):
        gemm(np.ones((2, 64), BF16), w)
    with pytest.raises(ValueError, match="bias: expected an array on the same device as w"):
        gemm(cp.ones((2, 64), BF16), w, bias=np.ones(32, np.float32))


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_concatenated_linears_on_the_device(rng, mode):
    """`Linear.concatenate` on the device (one quantization, one GEMM over the fused tiled weight
    with per-row decode factors) against each part on the numpy reference, at one and eight rows
    (where the column views of the split are copied to contiguous arrays)."""
    k = 2048
    ws = [(rng.standard_normal((n, k)) * s).astype(np.float32) for n, s in ((1024, 1.0), (512, 40.0), (64, 0.01))]
    fused = Linear.concatenate([Linear.from_float(cp.asarray(w), mode=mode) for w in ws])
    hosts = [Linear.from_float(w, mode=mode) for w in ws]
    for m in (1, 8):
        x = (rng.standard_normal((m, k)) * 3).astype(BF16)
        outs = fused.split(fused(cp.asarray(x)))
        for got, host in zip(outs, hosts):
            assert got.flags.c_contiguous
            assert ref.calc_diff(cp.asnumpy(got).astype(np.float32), host(x).astype(np.float32)) < BOUND, (m, mode)


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("m", [2, 8, 12, 40, 600])
@pytest.mark.parametrize("sizes", [(1024, 512, 256, 768, 256, 72), (1024, 520, 72, 200)])
def test_column_blocked_output_equals_the_split(rng, mode, m, sizes):
    """`Linear.call_split`: the parts of a concatenated projection come out C-contiguous (column
    blocks) with the bits of `split(self(x))` on every path: the GEMV (2, 8 rows), mma.sync (12),
    wgmma (40) write them themselves where the interior boundaries are multiples of
    `COLUMN_BLOCK_ALIGN` (else they are copied apart after), the prefill epilogue (600) always;
    with a bias and per-row decode factors, a last part that is not a whole tile."""
    k = 512
    ws = [(rng.standard_normal((n, k)) * (j + 1) ** 2).astype(np.float32) for j, n in enumerate(sizes)]
    parts = [Linear.from_float(cp.asarray(w), mode=mode, bias=cp.asarray(rng.standard_normal(w.shape[0]).astype(np.float32)))
             for w in ws]
    fused = Linear.concatenate(parts)
    x = cp.asarray((rng.standard_normal((m, k)) * 3).astype(BF16))
    want = [p.copy() for p in fused.split(fused(x))]
    got = fused.call_split(x)
    assert [g.shape for g in got] == [w.shape for w in want]
    for j, (g, w) in enumerate(zip(got, want)):
        assert g.flags.c_contiguous and cp.array_equal(g.view(cp.uint16), w.view(cp.uint16)), (m, j)


@pytest.mark.parametrize("m, sizes", [(130, (256, 64)), (12, (8,) * 9 + (24,)), (40, (10,) * 9 + (6,))])
def test_column_blocks_copied_apart_after_the_gemm(rng, monkeypatch, m, sizes):
    """Where the GEMM takes several launches (mma.sync, 64 rows each: Hopper with the wgmma
    kernels off here), or a thread block could straddle two blocks (boundaries off multiples of
    `COLUMN_BLOCK_ALIGN`), the blocks are copied apart after it: the same bits."""
    monkeypatch.setattr(gemm_ops, "WGMMA_MIN_M", 1 << 30 if m > 64 else gemm_ops.WGMMA_MIN_M)
    n = sum(sizes)
    w = tiled(weight(rng, n, 256))
    x = cp.asarray(rng.standard_normal((m, 256)).astype(BF16))
    full = gemm(x, w)
    blocks = gemm(x, w, out=cp.empty(m * n, BF16), column_blocks=sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for j, block in enumerate(blocks):
        assert cp.array_equal(block.view(cp.uint16), full[:, starts[j]:starts[j + 1]].view(cp.uint16)), j


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("groups, n_g, k", [(8, 128, 256), (2, 256, 512), (1, 128, 4096)])
def test_grouped_gemm_equals_one_gemm_per_group(rng, m, groups, n_g, k):
    """`gemm_grouped` (one GEMV launch, each block reading its group's columns of the activation)
    against `gemm` on each group's rows and columns, bit for bit, with a decode factor per row."""
    from fp4kit.formats import fuse_rows

    host = [qref.quantize((rng.standard_normal((n_g, k)) * (g + 1)).astype(np.float32)) for g in range(groups)]
    parts = [tiled(h) for h in host]  # each with its own global scale
    fused, row_decode = fuse_rows(host, "concatenated")
    fused, row_decode = tiled(fused), cp.asarray(row_decode)
    x = cp.asarray(rng.standard_normal((m, groups * k)).astype(BF16))
    got = gemm_ops.gemm_grouped(x, fused, groups, row_decode=row_decode, out=cp.full((m, groups * n_g), np.nan, np.float32))
    for g in range(groups):
        want = gemm(cp.ascontiguousarray(x[:, g * k:(g + 1) * k]), parts[g], out_dtype=np.float32)
        assert cp.array_equal(got[:, g * n_g:(g + 1) * n_g].view(cp.uint32), want.view(cp.uint32)), g


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("per_sm", [2.0, 1.0, 0.0])
def test_grouped_gemm_held_to_a_grid_against_float64(rng, m, per_sm, monkeypatch):
    """A grouped GEMM of more row tiles than `GROUPED_GEMV_MAX_BLOCKS_PER_SM` allows (8 groups of
    1024 x 4096: 512 row tiles) on fewer K slices per row tile: each group against a float64 GEMM
    of its dequantized operands, fp32 output; bitwise equal on repeat."""
    monkeypatch.setattr(gemm_ops, "GROUPED_GEMV_MAX_BLOCKS_PER_SM", {1: per_sm, 8: per_sm})
    groups, n_g, k = 8, 1024, 4096
    shape = gemm_ops.gemv_config(m, groups * n_g, k, max_blocks=gemm_ops.grouped_gemv_max_blocks(m))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    rt = 1
    while per_sm and -(-512 // rt) > per_sm * sms and rt < gemm_ops.GEMV_HELD_MAX_ROW_TILES:
        rt *= 2
    assert shape.row_tiles_per_warp == rt
    host = [qref.quantize((rng.standard_normal((n_g, k)) * (g + 1)).astype(np.float32)) for g in range(groups)]
    from fp4kit.formats import fuse_rows

    fused, row_decode = fuse_rows(host, "concatenated")
    fused, row_decode = tiled(fused), cp.asarray(row_decode)
    x = (rng.standard_normal((m, groups * k)) * 3).astype(BF16)
    got = gemm_ops.gemm_grouped(cp.asarray(x), fused, groups, row_decode=row_decode, out_dtype=np.float32)
    again = gemm_ops.gemm_grouped(cp.asarray(x), fused, groups, row_decode=row_decode, out_dtype=np.float32)
    assert cp.array_equal(got.view(cp.uint32), again.view(cp.uint32))
    for g in range(groups):
        expect = ref.gemm(x[:, g * k:(g + 1) * k], host[g], None, None, np.float64)
        assert ref.calc_diff(cp.asnumpy(got[:, g * n_g:(g + 1) * n_g]), expect) < BOUND_F32, g


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(2056, 7168), (1024, 4096), (4096, 2048), (40, 256)])
@pytest.mark.parametrize("wide", [0.0, float("inf")], ids=["8-warps", "16-warps"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["one-wait", "wait-per-group"])
def test_gemv_resident_activation_is_bit_identical(rng, m, n, k, wide, pipelined, monkeypatch):
    """The block-resident activation changes where the activation is staged, not the arithmetic:
    the same bits as the per-warp double buffer, for both activation kinds."""
    monkeypatch.setattr(gemm_ops, "GEMV_MAX_BLOCKS_PER_SM", {gemm_ops.GEMV_MAX_M: float("inf")})
    monkeypatch.setattr(gemm_ops, "GEMV_WIDE_MAX_BLOCKS_PER_SM", wide)
    monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_MAX_SLICE_GROUPS", 1 << 30)  # long K slices too
    monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_NVFP4_ACTIVATION", True)
    monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_PIPELINED", pipelined)
    w = tiled(weight(rng, n, k))
    x = (rng.standard_normal((m, k)) * 2).astype(BF16)
    for act in (cp.asarray(x), to_device(qref.quantize(x))):
        outs = []
        for resident in (False, True):
            monkeypatch.setattr(gemm_ops, "GEMV_RESIDENT_ACTIVATION", resident)
            assert gemm_ops.gemv_config(m, n, k).resident == resident
            out = cp.full((m, n), np.nan, np.float32)
            outs.append(gemm(act, w, out=out))
        assert cp.array_equal(outs[0].view(cp.uint32), outs[1].view(cp.uint32))
