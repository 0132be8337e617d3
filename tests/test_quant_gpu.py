"""Quantization kernels on the GPU: bit-exact against the numpy reference on fresh random,
adversarial and DeepSeek shapes; deterministic; every output byte written (outputs poisoned
first); graph-capturable with new inputs per replay; zero-copy DLPack with PyTorch."""

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit import formats
from fp4kit.reference import quant as ref

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16
DTYPES = [BF16, np.float16, np.float32]
POISON = 0xAB


def poisoned_out(shape, layout):
    """A preallocated result whose every byte is garbage, so unwritten bytes show up."""
    return fp4kit.Nvfp4Tensor(
        cp.full((*shape[:-1], shape[-1] // 2), POISON, cp.uint8),
        cp.full(formats.block_scale_shape(shape, layout), POISON, cp.uint8),
        cp.full((), np.nan, cp.float32),
        layout,
        shape,
    )


def assert_same(q, r):
    assert np.array_equal(cp.asnumpy(q.packed), r.packed), "packed codes differ"
    assert np.array_equal(cp.asnumpy(q.block_scales), r.block_scales), "block scales differ"
    assert cp.asnumpy(q.global_scale).tobytes() == np.asarray(r.global_scale, np.float32).tobytes()


def activations(rng, shape, dtype):
    """Normal values with per-row magnitudes spanning decades and sparse outliers."""
    x = rng.standard_normal(shape) * rng.lognormal(0, 2, (*shape[:-1], 1))
    x[rng.random(shape) < 1e-3] *= 50
    return x.astype(dtype)


@pytest.mark.parametrize("k", [16, 2048, 4096, 7168])
@pytest.mark.parametrize("m", [1, 3, 64, 4096])
def test_fused_quantize_bit_exact_bf16(rng, m, k):
    x = activations(rng, (m, k), BF16)
    for layout in ("linear", "swizzled"):
        q = fp4kit.quantize(cp.asarray(x), scale_layout=layout, out=poisoned_out((m, k), layout))
        assert_same(q, ref.quantize(x, None, layout))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7168), (3, 16), (2, 5, 2048), (300, 4096)])
def test_quantize_dtypes_and_leading_dims(rng, dtype, shape):
    x = activations(rng, shape, dtype)
    xd = cp.asarray(x)
    assert_same(fp4kit.quantize(xd), ref.quantize(x))
    s = np.array(rng.uniform(1, 1e4), np.float32)
    q = fp4kit.quantize(xd, global_scale=cp.asarray(s))
    assert_same(q, ref.quantize(x, s))


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_quantize_bit_exact(rng, dtype, layout):
    for rows, inner in [(1, 2048), (3, 16), (64, 2048), (517, 256)]:
        h = activations(rng, (rows, 2 * inner), dtype)
        w = rng.uniform(0, 1, rows).astype(np.float32)
        for limit, row_scale in [(None, None), (10.0, None), (3.0, w)]:
            rs = None if row_scale is None else cp.asarray(row_scale)
            q = fp4kit.swiglu_quantize(cp.asarray(h), layout=layout, limit=limit, row_scale=rs,
                                       out=poisoned_out((rows, inner), "linear"))
            assert_same(q, ref.swiglu_quantize(h, layout, limit, None, row_scale))
        s = np.array(200.0, np.float32)
        q = fp4kit.swiglu_quantize(cp.asarray(h), layout=layout, limit=10.0, global_scale=cp.asarray(s),
                                   scale_layout="swizzled", out=poisoned_out((rows, inner), "swizzled"))
        assert_same(q, ref.swiglu_quantize(h, layout, 10.0, s, None, "swizzled"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_bit_exact(rng, dtype):
    for shape, layout in [((1, 7168), "linear"), ((130, 64), "swizzled"), ((2, 3, 48), "linear")]:
        x = activations(rng, shape, np.float32)
        r = ref.quantize(x, None, layout)
        q = fp4kit.Nvfp4Tensor(cp.asarray(r.packed), cp.asarray(r.block_scales), cp.asarray(r.global_scale), layout, shape)
        out = cp.full(shape, np.nan, dtype)
        got = fp4kit.dequantize(q, dtype, out=out)
        assert got is out
        assert cp.asnumpy(got).tobytes() == ref.dequantize(r, dtype).tobytes()


@pytest.mark.parametrize("where", ["last", "every", "negative", "first"])
@pytest.mark.parametrize("m", [1, 64, 4096, 16384])
def test_amax_across_thread_blocks(rng, m, where):
    k = 7168
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    if where == "last":
        x[-1, -1] = 7.5
    elif where == "first":
        x[0, 0] = -7.5
    elif where == "every":
        x[:, ::16] = 7.5  # every 16-element block holds the maximum
    else:
        x = -np.abs(x)
        x[m // 2, k // 3] = -9.25
    xd = cp.asarray(x)
    a = fp4kit.amax(xd)
    assert float(a.get()) == float(np.abs(x).max())
    s = fp4kit.global_scale_from_amax(a)
    assert s.get().tobytes() == ref.global_scale_from_amax(ref.amax(x)).tobytes()
    q = fp4kit.quantize(xd)
    assert q.global_scale.get().tobytes() == s.get().tobytes()


def test_edge_values_and_status_word():
    fp4kit.clear_status()
    x = np.zeros((3, 64), np.float32)
    x[0, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.0, -0.1, 1e-40, -1e-40, 1e30, -1e30, 0, 3]
    x[1, 16:32] = 1e-3  # underflowing block
    xd = cp.asarray(x)
    assert_same(fp4kit.quantize(xd), ref.quantize(x))
    assert_same(fp4kit.quantize(xd, global_scale=cp.asarray(np.float32(64))), ref.quantize(x, np.float32(64)))
    assert fp4kit.check_finite()
    assert_same(fp4kit.quantize(cp.zeros((2, 32), cp.float32)), ref.quantize(np.zeros((2, 32), np.float32)))
    for bad in (np.nan, np.copysign(np.nan, -1), np.inf, -np.inf):
        y = x.copy()
        y[2, 40] = bad
        fp4kit.clear_status()
        assert_same(fp4kit.quantize(cp.asarray(y)), ref.quantize(y))
        assert not fp4kit.check_finite()
        fp4kit.clear_status()
        fp4kit.quantize(cp.asarray(y), global_scale=cp.asarray(np.float32(10)))
        assert not fp4kit.check_finite()
    fp4kit.clear_status()


def test_empty_tensor_on_device():
    q = fp4kit.quantize(cp.zeros((0, 32), BF16))
    assert q.packed.shape == (0, 16) and float(q.global_scale.get()) == np.finfo(np.float32).max


def test_deterministic_across_runs(rng):
    x = cp.asarray(activations(rng, (4096, 7168), BF16))
    a, b = fp4kit.quantize(x), fp4kit.quantize(x)
    assert cp.array_equal(a.packed, b.packed) and cp.array_equal(a.block_scales, b.block_scales)
    assert cp.array_equal(a.global_scale, b.global_scale)


def test_graph_replay_with_new_inputs(rng, capture_stream):
    shape, inner = (8, 7168), 2048
    x = cp.zeros(shape, BF16)
    h = cp.zeros((8, 2 * inner), BF16)
    q = poisoned_out(shape, "linear")
    qs = poisoned_out((8, inner), "swizzled")
    deq = cp.zeros(shape, cp.float32)
    fp4kit.quantize(x, out=q)  # eager first use: compiles and allocates scratch
    fp4kit.swiglu_quantize(h, limit=10.0, scale_layout="swizzled", out=qs)
    fp4kit.dequantize(q, np.float32, out=deq)
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        fp4kit.quantize(x, out=q)
        fp4kit.swiglu_quantize(h, limit=10.0, scale_layout="swizzled", out=qs)
        fp4kit.dequantize(q, np.float32, out=deq)
        graph = stream.end_capture()
    for _ in range(3):
        xn, hn = activations(rng, shape, BF16), activations(rng, (8, 2 * inner), BF16)
        x.set(xn, stream=stream)
        h.set(hn, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        r = ref.quantize(xn)
        assert_same(q, r)
        assert_same(qs, ref.swiglu_quantize(hn, "interleaved", 10.0, None, None, "swizzled"))
        assert cp.asnumpy(deq).tobytes() == ref.dequantize(r).tobytes()


def test_dlpack_zero_copy_with_torch(rng):
    torch = pytest.importorskip("torch")
    t = torch.randn(64, 7168, device="cuda", dtype=torch.bfloat16)
    q = fp4kit.quantize(t)
    assert isinstance(q.packed, cp.ndarray)
    packed_t = torch.from_dlpack(q.packed)
    assert packed_t.data_ptr() == q.packed.data.ptr  # export is zero-copy
    assert cp.from_dlpack(t).data.ptr == t.data_ptr()  # import is zero-copy
    x = t.float().cpu().numpy().astype(BF16)
    assert_same(q, ref.quantize(x))
    # a torch output buffer, written in place through DLPack
    out_t = torch.empty(64, 7168, device="cuda", dtype=torch.float32)
    out = cp.from_dlpack(out_t)
    fp4kit.dequantize(q, np.float32, out=out)
    torch.cuda.synchronize()
    assert np.array_equal(out_t.cpu().numpy(), ref.dequantize(ref.quantize(x)))


def test_device_bad_inputs():
    x = cp.zeros((2, 32), cp.float32)
    with pytest.raises(ValueError, match="global_scale: expected an array on cuda:0 like the input"):
        fp4kit.quantize(x, global_scale=np.array(1.0, np.float32))
    with pytest.raises(ValueError, match="global_scale: expected an array on host"):
        fp4kit.quantize(np.zeros((2, 32), np.float32), global_scale=cp.ones((), cp.float32))
    with pytest.raises(ValueError, match="out.packed: expected an array on the same device"):
        fp4kit.quantize(x, out=ref.quantize(np.zeros((2, 32), np.float32)))
    with pytest.raises(ValueError, match="must live in the same memory"):
        fp4kit.Nvfp4Tensor(cp.zeros((2, 16), cp.uint8), np.zeros((2, 2), np.uint8), cp.ones((), cp.float32), "linear", (2, 32))
    with pytest.raises(ValueError, match="x: expected a 16-byte aligned device pointer"):
        fp4kit.quantize(cp.zeros(40, cp.float32)[1:33].reshape(2, 16))
    with pytest.raises(ValueError, match="x: expected a C-contiguous array"):
        fp4kit.quantize(cp.zeros((32, 2), cp.float32).T)
    with pytest.raises(ValueError, match="arrays must live on one device"):
        fp4kit.swiglu_quantize(cp.zeros((2, 64), cp.float32), row_scale=np.ones(2, np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("shape", [(1, 32), (3, 4096), (2, 5, 512), (300, 2 * 2048)])
def test_swiglu_bf16_bit_exact(rng, dtype, layout, shape):
    """The six swiglu kernels (three input dtypes x two layouts): bit for bit the reference's bf16,
    every output element written, the same bits on a second run."""
    from fp4kit.ops.quant import swiglu

    h = activations(rng, shape, dtype)
    h[..., :1] = np.nan  # a NaN stays a NaN
    rs = rng.uniform(0.1, 2, shape[:-1]).astype(np.float32)
    hd = cp.asarray(h)
    for limit, row_scale in ((None, None), (10.0, rs)):
        want = swiglu(h, layout=layout, limit=limit, row_scale=row_scale)
        nan = np.isnan(want.astype(np.float32))
        assert nan.any() and not nan.all()
        out = cp.full((*shape[:-1], shape[-1] // 2), 0x4B4B, cp.uint16).view(BF16)  # poison: a finite value
        d_rs = None if row_scale is None else cp.asarray(row_scale)
        got = swiglu(hd, layout=layout, limit=limit, row_scale=d_rs, out=out)
        assert got is out
        host = cp.asnumpy(out)
        # NaN payloads may differ between numpy and CUDA: NaN where the reference has NaN, bits elsewhere
        assert np.array_equal(np.isnan(host.astype(np.float32)), nan)
        assert np.array_equal(host.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
        again = swiglu(hd, layout=layout, limit=limit, row_scale=d_rs)
        assert cp.array_equal(again.view(cp.uint16), out.view(cp.uint16))


def test_loader_compiles_once_under_concurrent_first_use(monkeypatch):
    import threading

    from fp4kit.runtime import loader

    # earlier tests have compiled "quant" already: start from empty caches so that this is the
    # first use, and count the compilations
    monkeypatch.setattr(loader, "_modules", loader.OnceCache())
    monkeypatch.setattr(loader, "_kernels", loader.OnceCache())
    builds = []
    raw_module = cp.RawModule

    def counting(*args, **kwargs):
        builds.append(1)
        return raw_module(*args, **kwargs)

    monkeypatch.setattr(cp, "RawModule", counting)
    results = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(loader.get_module("quant", cooperative=True))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len({id(m) for m in results}) == 1
    assert len(builds) == 1, f"{len(builds)} compilations for one module"
