"""Checkpoints straight into device buffers, and layers built from them on the GPU."""

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.checkpoint import load_nvfp4, save_nvfp4
from fp4kit.layers import Linear, SharedExpert
from fp4kit.reference import gemm as ref
from fp4kit.reference import quant as qref

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16


def test_load_to_device_and_layers(tmp_path, rng):
    h, i = 256, 128
    weights = {
        "mlp.gate_proj": qref.quantize(rng.standard_normal((i, h)).astype(np.float32) * 4),
        "mlp.up_proj": qref.quantize(rng.standard_normal((i, h)).astype(np.float32) * 0.01),
        "mlp.down_proj": qref.quantize(rng.standard_normal((h, i)).astype(np.float32)),
    }
    input_scales = {"mlp.gate_proj": np.array(2688 / 5.0, np.float32)}
    save_nvfp4(tmp_path / "model.safetensors", weights, input_scales=input_scales,
               extra={"norm.weight": np.ones(h, BF16)})
    host = load_nvfp4(tmp_path)
    dev = load_nvfp4(tmp_path, device="cuda")
    for name, q in host.weights.items():
        d = dev.weights[name]
        assert isinstance(d.packed, cp.ndarray) and isinstance(d.global_scale, cp.ndarray)
        assert np.array_equal(cp.asnumpy(d.packed), q.packed)
        assert np.array_equal(cp.asnumpy(d.block_scales), q.block_scales)
        assert cp.asnumpy(d.global_scale).tobytes() == np.asarray(weights[name].global_scale).tobytes()
    x = rng.standard_normal((4, h)).astype(BF16)
    for mode in ("w4a4", "w4a16"):
        se_dev = SharedExpert.from_checkpoint(dev, "mlp", limit=10.0, mode=mode)
        se_host = SharedExpert.from_checkpoint(host, "mlp", limit=10.0, mode=mode)
        y = cp.asnumpy(se_dev(cp.asarray(x))).astype(np.float32)
        assert ref.calc_diff(y, se_host(x).astype(np.float32)) < 1e-4
    lin = Linear.from_checkpoint(dev, "mlp.down_proj", mode="w4a16")
    xd = rng.standard_normal((2, i)).astype(BF16)
    expect = ref.gemm(xd, host.weights["mlp.down_proj"], None, None, np.float64)
    assert ref.calc_diff(cp.asnumpy(lin(cp.asarray(xd))).astype(np.float32), expect) < 1e-5
