"""Bad inputs on the device follow the numpy backend's rules (tests/test_bad_inputs.py): bad
configuration raises the same error, bad data is recorded in the device status word."""

import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.layers import KVCache, MoE, RoutingConfig, SharedExpert
from fp4kit.runtime import status

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16


def _scalar(v):
    return cp.asarray(np.float32(v))


@pytest.fixture(autouse=True)
def _clear_device_status():
    status.clear()
    yield
    status.clear()


def in_subprocess(body: str) -> int:
    """Run ``body`` (with ``cp``, ``np``, ``BF16``, ``fp4kit``, ``status`` and the layers in scope)
    in a fresh process and return the device status flags it leaves. A kernel fed bad data can
    fault, and a CUDA fault poisons the whole process: isolating the call keeps the rest of the GPU
    suite running, and a fault fails the test as an assertion."""
    code = textwrap.dedent("""
        import cupy as cp, ml_dtypes, numpy as np
        import fp4kit
        from fp4kit.formats import Nvfp4Tensor
        from fp4kit.layers import KVCache, MoE, RoutingConfig, SparseAttention
        from fp4kit.runtime import status
        BF16 = ml_dtypes.bfloat16
        rng = np.random.default_rng(0)
        status.clear()
    """) + textwrap.dedent(body) + "\nprint('FLAGS', status.read(0))\n"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:  # e.g. a kernel looping over a count it did not clamp
        raise AssertionError("the call did not finish within 120 s on the device") from None
    assert done.returncode == 0, f"the call failed on the device:\n{done.stderr[-3000:]}"
    return int(done.stdout.split("FLAGS")[-1])


@pytest.mark.parametrize("scale", ["0.0", "-300.0", "np.nan", "np.inf"])
def test_quantize_with_an_invalid_static_scale_is_recorded(scale):
    flags = in_subprocess(f"""
        x = cp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
        fp4kit.quantize(x, global_scale=cp.asarray(np.float32({scale})))
    """)
    assert flags & status.NONFINITE_INPUT


def test_quantize_with_a_valid_static_scale_records_nothing(rng):
    x = cp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
    for scale in (300.0, np.finfo(np.float32).max):
        fp4kit.quantize(x, global_scale=_scalar(scale))
    assert status.read() == 0


def test_dequantize_with_a_zero_global_scale_is_recorded():
    flags = in_subprocess("""
        q = fp4kit.quantize(cp.asarray(rng.standard_normal((4, 64)).astype(np.float32)))
        fp4kit.dequantize(Nvfp4Tensor(q.packed, q.block_scales, cp.asarray(np.float32(0)), "linear", q.shape))
    """)
    assert flags & status.NONFINITE_INPUT


@pytest.mark.parametrize("amax", [np.nan, np.inf])
def test_global_scale_from_a_nonfinite_amax_is_recorded(amax):
    fp4kit.global_scale_from_amax(_scalar(amax))
    assert not fp4kit.check_finite()


@pytest.mark.parametrize("amax", ["-1.0", pytest.param("-0.0", marks=pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="on the H200 a device -0.0 amax is not recorded although the kernel tests the stored sign bit: "
           "cause not found yet (the numpy backend records it)"))])
def test_global_scale_from_a_negative_amax_is_recorded(amax):
    flags = in_subprocess(f"fp4kit.global_scale_from_amax(cp.asarray(np.float32({amax})))")
    assert flags & status.NONFINITE_INPUT


MOE = """
    e, h, i = 8, 64, 32
    w = (rng.standard_normal((e, h)), rng.standard_normal((e, i, h)) / 8, rng.standard_normal((e, i, h)) / 8,
         rng.standard_normal((e, h, i)) / 8)
    moe = MoE.from_float(*(cp.asarray(a.astype(np.float32)) for a in w), RoutingConfig(top_k=2), mode={mode!r})
    x = rng.standard_normal((3, 64)).astype(BF16)
    x[1, 5] = {bad}
    moe(cp.asarray(x))
    cp.cuda.Device().synchronize()
"""


def test_moe_with_a_finite_input_records_nothing(rng):
    assert in_subprocess(MOE.format(mode="w4a4", bad="0.5")) == 0


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("bad", ["np.nan", "np.inf"])
def test_moe_records_a_nonfinite_input(mode, bad):
    assert in_subprocess(MOE.format(mode=mode, bad=bad)) & status.NONFINITE_INPUT


def test_moe_with_no_tokens_gives_an_empty_device_result(rng):
    e, h, i = 8, 64, 32
    w = (rng.standard_normal((e, h)), rng.standard_normal((e, i, h)), rng.standard_normal((e, i, h)),
         rng.standard_normal((e, h, i)))
    moe = MoE.from_float(*(cp.asarray(a.astype(np.float32)) for a in w), RoutingConfig(top_k=2))
    y = moe(cp.zeros((0, 64), BF16))
    assert isinstance(y, cp.ndarray) and y.shape == (0, 64) and y.dtype == BF16


@pytest.mark.parametrize("ratio", [0, 4])
@pytest.mark.parametrize("counts, pos", [([-3, 1], [0, 1]), ([5, 1], [2, 1])])
def test_kv_append_counts_outside_zero_to_t_are_clamped_and_recorded(ratio, counts, pos):
    flags = in_subprocess(f"""
        cache = KVCache(2, window=8, head_dim=64, ratio={ratio}, max_comp=8)
        kv = cp.asarray(rng.standard_normal((2, 2, 64)).astype(BF16))
        extra = {{}}
        if cache.ratio:
            c = cp.asarray(rng.standard_normal((2, 2, cache.compress_width)).astype(np.float32))
            extra = dict(comp_kv=c, comp_score=c)
        cache.append(kv, counts=cp.asarray(np.array({counts}, np.int32)), **extra)
        assert cache.pos.get().tolist() == {pos}, cache.pos.get()
    """)
    assert flags & status.KV_INPUT


@pytest.mark.parametrize("pos, comp_len", [([-4, 8], [0, 0]), ([4, 8], [9, 0])])
def test_sparse_attention_records_positions_and_lengths_out_of_range(pos, comp_len):
    flags = in_subprocess(f"""
        q = cp.asarray(rng.standard_normal((2, 16, 64)).astype(BF16))
        swa = cp.asarray(rng.standard_normal((2, 8, 64)).astype(BF16))
        comp = cp.asarray(rng.standard_normal((2, 4, 64)).astype(BF16))
        indices = cp.asarray(np.array([[0, 3], [-1, -1]], np.int32))
        SparseAttention(16, 64)(q, swa, cp.asarray(np.array({pos}, np.int32)), comp,
                                cp.asarray(np.array({comp_len}, np.int32)), indices)
    """)
    assert flags & status.KV_INPUT


def test_configuration_errors_are_the_numpy_ones_on_device_arrays(rng):
    g, u = (cp.asarray(rng.standard_normal((32, 64)).astype(np.float32)) for _ in range(2))
    with pytest.raises(ValueError, match=r"w_down: expected shape \[H, I\] = \(64, 32\)"):
        SharedExpert.from_float(g, u, cp.asarray(rng.standard_normal((48, 32)).astype(np.float32)))
    with pytest.raises(TypeError, match="limit: expected a positive finite float or None, got str '10'"):
        fp4kit.swiglu_quantize(cp.zeros((4, 64), cp.float32), limit="10")
    with pytest.raises(TypeError, match=r"global_scale: expected a 0-d float32 array .* scalar"):
        fp4kit.quantize(cp.zeros((4, 64), cp.float32), global_scale=np.float32(300))
    with pytest.raises(TypeError, match="batch: expected an int, got float 2.5"):
        KVCache(2.5, head_dim=64)
