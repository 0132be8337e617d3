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


def test_compressed_tensors_layout_loads_onto_the_device(tmp_path, rng):
    """A compressed-tensors file (weight_packed, weight_global_scale as the encode scale) straight
    into device buffers: the same bytes and scales as the host load, and layers built from it."""
    import safetensors.numpy

    p = "model.layers.0.mlp.down_proj"
    w = rng.standard_normal((64, 128)).astype(np.float32)
    q = qref.quantize(w)
    tensors = {
        f"{p}.weight_packed": q.packed,
        f"{p}.weight_scale": q.block_scales.view(ml_dtypes.float8_e4m3fn),
        f"{p}.weight_global_scale": q.global_scale.reshape(1),
        f"{p}.input_global_scale": np.array([250.0], np.float32),
        f"{p}.weight_shape": np.array([64, 128], np.int64),
        "lm_head.weight": rng.standard_normal((32, 128)).astype(BF16),
    }
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    host = load_nvfp4(tmp_path)
    dev = load_nvfp4(tmp_path, device="cuda")
    assert dev.layout == host.layout == "compressed-tensors"
    d = dev.weights[p]
    assert all(isinstance(a, cp.ndarray) for a in (d.packed, d.block_scales, d.global_scale))
    assert np.array_equal(cp.asnumpy(d.packed), q.packed) and np.array_equal(cp.asnumpy(d.block_scales), q.block_scales)
    assert cp.asnumpy(d.global_scale).tobytes() == np.asarray(q.global_scale).tobytes() and d.global_scale.shape == ()
    s = dev.input_scales[p]
    assert isinstance(s, cp.ndarray) and s.shape == () and float(s) == 250.0
    assert isinstance(dev.extra["lm_head.weight"], cp.ndarray)
    assert np.array_equal(cp.asnumpy(fp4kit.dequantize(d)), qref.dequantize(q))  # bit for bit
    x = rng.standard_normal((3, 128)).astype(BF16)
    for mode in ("w4a4", "w4a16"):
        lin_d = Linear.from_checkpoint(dev, p, mode=mode)
        lin_h = Linear.from_checkpoint(host, p, mode=mode)
        got = cp.asnumpy(lin_d(cp.asarray(x))).astype(np.float32)
        assert ref.calc_diff(got, lin_h(x).astype(np.float32)) < 1e-5, mode


def test_cli_quantize_on_the_device_equals_the_cpu_run(tmp_path, rng, capsys):
    """`fp4kit quantize --device cuda`: the quantizers are bit-exact, so the files hold the same
    tensors as `--device cpu`."""
    import safetensors.numpy

    from fp4kit import cli

    model = {
        "model.embed_tokens.weight": rng.standard_normal((40, 64)).astype(BF16),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((32, 64)).astype(BF16),
        "model.layers.0.mlp.down_proj.weight": (rng.standard_normal((64, 32)) * 0.01).astype(np.float32),
        "lm_head.weight": rng.standard_normal((40, 64)).astype(np.float16),
    }
    src = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(model, src)
    assert cli.main(["quantize", str(src), str(tmp_path / "gpu"), "--device", "cuda"]) == 0
    assert "on cuda" in capsys.readouterr().out
    assert cli.main(["quantize", str(src), str(tmp_path / "cpu"), "--device", "cpu"]) == 0
    on_gpu, on_cpu = load_nvfp4(tmp_path / "gpu"), load_nvfp4(tmp_path / "cpu")
    assert set(on_gpu.weights) == set(on_cpu.weights) == {"model.layers.0.mlp.gate_proj",
                                                           "model.layers.0.mlp.down_proj", "lm_head"}
    for name, q in on_cpu.weights.items():
        g = on_gpu.weights[name]
        assert np.array_equal(g.packed, q.packed) and np.array_equal(g.block_scales, q.block_scales), name
        assert np.asarray(g.global_scale).tobytes() == np.asarray(q.global_scale).tobytes(), name
    assert {k: v.tobytes() for k, v in on_gpu.extra.items()} == {k: v.tobytes() for k, v in on_cpu.extra.items()}


def test_convert_on_the_gpu_writes_the_cpu_bytes(tmp_path, rng, capsys):
    """`fp4kit convert --device cuda` uploads each FP8 / FP4 weight's bytes and dequantizes,
    quantizes and measures the error on the device: every file it writes is byte for byte the CPU
    run's (the quantizers are bit-exact), and so is the report (errors to the digits printed), for
    a V4 checkpoint with a re-quantized expert (exponent spread 20) and an FP8 weight of partial
    128 x 128 blocks with a V3 fp32 scale; with ``--jobs 2`` too (workers spawned: a forked worker
    of a process that has used CUDA cannot)."""
    from test_convert_deepseek import fp8_weight, write_v4

    from fp4kit import checkpoint
    from fp4kit.cli import main

    src = tmp_path / "v4"
    write_v4(src, rng)
    codes, scale = fp8_weight(rng, 200, 320)
    inv = (2.0 ** (scale.view(np.uint8).astype(np.int32) - 127) * 1.25).astype(np.float32)
    v3 = tmp_path / "v3"
    v3.mkdir()
    checkpoint.write_safetensors(v3 / "model.safetensors", {"model.layers.0.mlp.down_proj.weight": codes,
                                                            "model.layers.0.mlp.down_proj.weight_scale_inv": inv})
    for name, folder in (("v4", src), ("v3", v3)):
        rows = {}
        for device in ("cpu", "cuda"):
            assert main(["convert", str(folder), str(tmp_path / f"{name}-{device}"), "--device", device]) == 0
            # the report's rows: tensor, shape, source, method, [spread,] relative error (not the
            # shards' summaries, "model.safetensors: ... in 0.1 s", which carry timings)
            rows[device] = [line.split() for line in capsys.readouterr().out.splitlines()
                            if line.startswith(("layers.", "model.")) and not line.split()[0].endswith(":")]
        assert [r[:-1] for r in rows["cuda"]] == [r[:-1] for r in rows["cpu"]] and rows["cpu"]
        assert any("re-quantized" in r for r in rows["cpu"]) == (name == "v4")
        for got, want in zip(rows["cuda"], rows["cpu"]):  # device norms add in another order: the 3rd digit may move
            assert abs(float(got[-1]) - float(want[-1])) <= 1e-3 * float(want[-1]), (got, want)
        assert main(["convert", str(folder), str(tmp_path / f"{name}-jobs"), "--device", "cuda", "--jobs", "2"]) == 0
        capsys.readouterr()
        files = sorted(p.name for p in (tmp_path / f"{name}-cpu").iterdir())
        for run in ("cuda", "jobs"):
            assert files == sorted(p.name for p in (tmp_path / f"{name}-{run}").iterdir())
            for f in (f for f in files if f.endswith(".safetensors")):
                got, want = tmp_path / f"{name}-{run}" / f, tmp_path / f"{name}-cpu" / f
                assert got.read_bytes() == want.read_bytes(), (run, f)
