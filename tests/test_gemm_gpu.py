"""NVFP4 GEMMs on the GPU against a float64 GEMM of the dequantized operands (calc_diff), both
paths (decode kernel and the prefill cuBLAS path), W4A16 and W4A4, odd shapes, determinism, and
the layers captured in a CUDA graph."""

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.layers import Linear, SharedExpert, fuse_gate_up
from fp4kit.ops.gemm import gemm
from fp4kit.reference import gemm as ref
from fp4kit.reference import quant as qref

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16
BOUND = 1e-5  # calc_diff of a bf16 output against float64: the output rounding is about 1e-6


def to_device(q):
    return fp4kit.Nvfp4Tensor(cp.asarray(q.packed), cp.asarray(q.block_scales), cp.asarray(q.global_scale),
                              q.scale_layout, q.shape)


def weight(rng, n, k):
    return qref.quantize((rng.standard_normal((n, k)) * rng.lognormal(0, 1, (n, 1))).astype(np.float32))


@pytest.mark.parametrize("k", [16, 2048, 7168, 1040])
@pytest.mark.parametrize("m", [1, 3, 17, 64, 300])
def test_gemm_paths_match_float64(rng, m, k):
    n = 2056  # not a multiple of the 16-row tile
    w = weight(rng, n, k)
    wd = to_device(w)
    x = (rng.standard_normal((m, k)) * 2).astype(BF16)
    bias = rng.standard_normal(n).astype(np.float32)
    for act in ("bf16", "nvfp4"):
        a = x if act == "bf16" else qref.quantize(x)
        ad = cp.asarray(x) if act == "bf16" else to_device(a)
        expect = ref.gemm(a, w, bias, None, np.float64)
        for out_dtype in (BF16, np.float32):
            out = cp.full((m, n), np.nan, out_dtype)
            y = gemm(ad, wd, bias=cp.asarray(bias), out=out)
            assert ref.calc_diff(cp.asnumpy(y), expect) < BOUND, (act, out_dtype)
        if m <= 64:  # the same call forced through the prefill path
            y = gemm(ad, wd, bias=cp.asarray(bias), out_dtype=np.float32, decode_max_m=0)
            assert ref.calc_diff(cp.asnumpy(y), expect) < BOUND, (act, "prefill")


def test_large_m_prefill_and_decode(rng):
    m, n, k = 4096, 1040, 7168
    w, x = weight(rng, n, k), rng.standard_normal((m, k)).astype(BF16)
    expect = ref.gemm(x, w, None, None, np.float64)
    y = gemm(cp.asarray(x), to_device(w))
    assert ref.calc_diff(cp.asnumpy(y), expect) < BOUND
    y = gemm(cp.asarray(x[:300]), to_device(w), decode_max_m=1 << 30)  # decode kernel, 64-row groups
    assert ref.calc_diff(cp.asnumpy(y), expect[:300]) < BOUND


def test_decode_is_deterministic_and_writes_every_output(rng):
    w = to_device(weight(rng, 4096, 7168))
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
    y = gemm(cp.asarray(x), fused, w_row_decode=row_decode, out_dtype=np.float32)
    expect = ref.gemm(x, fused_h, None, row_decode_h, np.float64)
    assert ref.calc_diff(cp.asnumpy(y), expect) < BOUND


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_layers_in_a_cuda_graph(rng, mode):
    h, i = 1024, 512
    wg, wu = rng.standard_normal((i, h)).astype(np.float32), rng.standard_normal((i, h)).astype(np.float32)
    wd = rng.standard_normal((h, i)).astype(np.float32)
    se = SharedExpert.from_float(cp.asarray(wg), cp.asarray(wu), cp.asarray(wd), limit=10.0, mode=mode)
    se_ref = SharedExpert(Linear(_host(se.gate_up.weight), mode=mode), Linear(_host(se.down.weight), mode=mode), limit=10.0)
    x = cp.zeros((8, h), BF16)
    y = se(x)  # eager first call: compiles, allocates the layer's buffers
    stream = cp.cuda.Stream(non_blocking=True)
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
    assert np.array_equal(cp.asnumpy(lin.weight.packed), r.packed)
    x = rng.standard_normal((3, 512)).astype(BF16)
    y = lin(cp.asarray(x))
    expect = Linear(r)(x)
    assert ref.calc_diff(cp.asnumpy(y).astype(np.float32), expect.astype(np.float32)) < BOUND


def test_device_bad_inputs(rng):
    w = to_device(weight(rng, 32, 64))
    with pytest.raises(ValueError, match="arrays must live on one device"):
        gemm(np.ones((2, 64), BF16), w)
    with pytest.raises(ValueError, match="bias: expected an array on the same device as w"):
        gemm(cp.ones((2, 64), BF16), w, bias=np.ones(32, np.float32))
