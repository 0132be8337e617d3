"""KVCache on the GPU against the numpy cache, step by step: ring rows bit for bit, positions and
compressed lengths exactly, compressed entries to bf16 rounding; the decode append captured once in
a CUDA graph and replayed many times, advancing the positions on the device."""

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.layers.kv_cache import KVCache

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16


def bf16_ulp(x):
    """The bf16 spacing at ``|x|`` (8 significant bits; subnormals share the smallest normal's)."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 2.0**-126))) - 7)


def pair(b, ratio, rng, **kw):
    d = kw.get("head_dim", 512)
    cf = 2 if ratio == 4 else 1
    ape = rng.standard_normal((ratio, cf * d)).astype(np.float32) if ratio else None
    nw = rng.uniform(0.5, 1.5, d).astype(np.float32) if ratio else None
    host = KVCache(b, ratio=ratio, ape=ape, norm_weight=nw, device=False, **kw)
    dev = KVCache(b, ratio=ratio, ape=None if ape is None else cp.asarray(ape),
                  norm_weight=None if nw is None else cp.asarray(nw), **kw)
    return host, dev


def inputs(rng, b, t, cache):
    kv = rng.standard_normal((b, t, cache.head_dim)).astype(BF16)
    if not cache.ratio:
        return kv, {}
    w = cache.compress_width
    return kv, dict(comp_kv=rng.standard_normal((b, t, w)).astype(np.float32),
                    comp_score=rng.standard_normal((b, t, w)).astype(np.float32))


def assert_same(host, dev):
    assert np.array_equal(cp.asnumpy(dev.pos), host.pos)
    assert np.array_equal(cp.asnumpy(dev.swa).view(np.uint16), host.swa.view(np.uint16))
    if host.ratio:
        assert np.array_equal(cp.asnumpy(dev.comp_len), host.comp_len)
        n = int(host.comp_len.max())
        got = cp.asnumpy(dev.comp[:, :n]).astype(np.float64)
        want = host.comp[:, :n].astype(np.float64)
        # fp32 on the device, float64 in the reference, each rounded once to bf16: one bf16 ulp
        # apart at most, plus the fp32 rounding of the pooled sum near zero (16 terms of |v| < ~8)
        bound = bf16_ulp(np.maximum(np.abs(got), np.abs(want))) + 16 * 8 * 2.0**-24
        assert (np.abs(got - want) <= bound).all(), (np.abs(got - want) / bf16_ulp(want)).max()


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("steps", [[1] * 200, [5] * 40, [300, 1, 300]])
@pytest.mark.parametrize("yarn", [False, True])
def test_device_cache_equals_reference(rng, ratio, steps, yarn):
    """Also with YaRN-scaled RoPE frequencies (V4-Flash's: factor 16 over 65536 tokens)."""
    from fp4kit.reference.hyper_connections import yarn_inv_freq

    kw = dict(rope_theta=yarn_inv_freq(64, 160000.0, 16.0, 65536)) if yarn else {}
    host, dev = pair(2, ratio, rng, max_comp=128, **kw)
    for t in steps:
        kv, kw = inputs(rng, 2, t, host)
        host.append(kv, **kw)
        dev.append(cp.asarray(kv), **{k: cp.asarray(v) for k, v in kw.items()})
    assert_same(host, dev)


def test_counts_and_overflow_on_device(rng):
    fp4kit.clear_status()
    host, dev = pair(3, 4, rng, max_comp=3, head_dim=64, rope_dim=16)
    for counts in ([9, 4, 0], [8, 1, 12]):
        kv, kw = inputs(rng, 3, 12, host)
        c = np.array(counts, np.int32)
        host.append(kv, counts=c, **kw)
        dev.append(cp.asarray(kv), counts=cp.asarray(c), **{k: cp.asarray(v) for k, v in kw.items()})
        assert_same(host, dev)
    assert dev.overflowed()  # sequence 0 reached 17 tokens: block 4 did not fit in 3 entries
    fp4kit.clear_status()


@pytest.mark.parametrize("ratio", [4, 128])
def test_decode_append_in_a_cuda_graph(rng, ratio, capture_stream):
    host, dev = pair(2, ratio, rng, max_comp=64)
    kv, kw = inputs(rng, 2, 1, host)
    kv_d = cp.asarray(kv)
    kw_d = {k: cp.asarray(v) for k, v in kw.items()}
    dev.append(kv_d, **kw_d)  # eager first use: compiles
    host.append(kv, **kw)
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        dev.append(kv_d, **kw_d)
        graph = stream.end_capture()
    for _ in range(300):  # 300 replays: positions advance on the device, entries emitted on time
        kv, kw = inputs(rng, 2, 1, host)
        kv_d.set(kv, stream=stream)
        for k, v in kw.items():
            kw_d[k].set(v, stream=stream)
        graph.launch(stream)
        host.append(kv, **kw)
    stream.synchronize()
    assert_same(host, dev)


@pytest.mark.parametrize("ratio", [4, 128])
def test_append_without_window_rows_on_device(rng, ratio, capture_stream):
    """``append(None, ...)`` on the device: the window rows stay as they were (bit for bit), the
    compressed entries, lengths, compressor state and positions are those of an append with window
    rows (bit for bit), equal to the numpy cache; captured, it is the compressor's launch alone; a
    count out of range is still recorded."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from common import graph_kernels

    from fp4kit.runtime import status

    host, dev = pair(2, ratio, rng, max_comp=64, head_dim=128, window=1)
    _, with_rows = pair(2, ratio, rng, max_comp=64, head_dim=128, window=1)
    with_rows.ape[...] = dev.ape
    with_rows.norm_weight[...] = dev.norm_weight
    window = cp.asarray(rng.standard_normal(dev.swa.shape).astype(BF16))
    dev.swa[...] = window
    host.swa[...] = cp.asnumpy(window)
    for t in (1, 3, 300, 1):
        kv, kw = inputs(rng, 2, t, host)
        kw_d = {k: cp.asarray(v) for k, v in kw.items()}
        dev.append(None, **kw_d)
        with_rows.append(cp.asarray(kv), **kw_d)
        host.append(None, **kw)
    assert cp.array_equal(dev.swa.view(cp.uint16), window.view(cp.uint16))
    for name in ("pos", "comp", "comp_len", "kv_state", "score_state"):
        assert cp.array_equal(getattr(dev, name), getattr(with_rows, name)), name
    assert_same(host, dev)

    kv, kw = inputs(rng, 2, 1, host)
    kw_d = {k: cp.asarray(v) for k, v in kw.items()}
    dev.append(None, **kw_d)
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        dev.append(None, **kw_d)
        graph = stream.end_capture()
    assert graph_kernels(graph) == ["kv_compress_f32"]

    status.clear()
    dev.append(None, **{k: cp.ascontiguousarray(v[:, :2]) for k, v in kw_d.items()},
               counts=cp.asarray(np.array([3, 1], np.int32)))
    assert status.read() & status.KV_INPUT
    status.clear()


@pytest.mark.parametrize("counts", [None, [1, 0, 3]])
def test_two_compressors_in_one_launch_equal_two_appends(rng, counts):
    """`append_compressed` (one kv_compress2 launch) leaves both caches bit for bit as two
    `append(None, ...)` calls do, over steps that emit entries, with and without counts."""
    from fp4kit.layers.kv_cache import append_compressed

    b = 3
    sets = []
    for _ in range(2):  # (fused, apart): the same caches twice
        sets.append([pair(b, 4, np.random.default_rng(7), head_dim=d, max_comp=8)[1] for d in (512, 128)])
    dev_counts = None if counts is None else cp.asarray(np.array(counts, np.int32))
    for step in range(6):
        t = 1 if step % 2 else 3
        data = [{k: cp.asarray(v.astype(BF16)) for k, v in inputs(rng, b, t, c)[1].items()} for c in sets[0]]
        fused, apart = sets
        append_compressed((fused[0], data[0]["comp_kv"], data[0]["comp_score"]),
                          (fused[1], data[1]["comp_kv"], data[1]["comp_score"]), counts=dev_counts)
        for cache, d in zip(apart, data):
            cache.append(None, d["comp_kv"], d["comp_score"], counts=dev_counts)
        for f, a in zip(fused, apart):
            for name in ("pos", "comp_len", "kv_state", "score_state"):
                np.testing.assert_array_equal(cp.asnumpy(getattr(f, name)), cp.asnumpy(getattr(a, name)), err_msg=name)
            np.testing.assert_array_equal(cp.asnumpy(f.comp).view(np.uint16), cp.asnumpy(a.comp).view(np.uint16))
    assert int(sets[0][0].comp_len.get().max()) > 0  # entries were emitted


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_rewind_on_device_equals_reference(rng, ratio):
    """`KVCache.rewind` (raw_kernels/kv_cache.cu kv_rewind) after appends of two tokens, taking back
    the second in some sequences, against the numpy cache: positions, lengths, rows, entries; a
    count outside [0, 1] clamped and reported."""
    from fp4kit.runtime import status

    host, dev = pair(3, ratio, rng, window=8, head_dim=64, max_comp=64, rope_dim=16)
    for step in range(150 if ratio == 128 else 30):
        kv, comp = inputs(rng, 3, 2, host)
        host.append(kv, **comp)
        dev.append(cp.asarray(kv), **{k: cp.asarray(v) for k, v in comp.items()})
        back = np.array([step % 2, 1, (step // 3) % 2], np.int32)
        host.rewind(back)
        dev.rewind(cp.asarray(back))
        assert_same(host, dev)
    status.clear()
    dev.rewind(cp.asarray(np.array([2, -1, 0], np.int32)))
    host.rewind(np.array([2, -1, 0], np.int32))
    assert_same(host, dev)
    assert status.read() & status.KV_INPUT
    status.clear()
