"""The ``fp4kit`` command on the numpy backend: quantize a tiny synthetic model, inspect it."""

import io
import json
import re

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import fp4kit
from fp4kit import checkpoint as ck
from fp4kit import cli
from fp4kit.runtime import device as runtime_device

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def tiny_model(rng) -> dict:
    """A two-layer-ish model: what must be quantized and what must not."""
    return {
        "model.embed_tokens.weight": rng.standard_normal((40, 64)).astype(BF16),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(64).astype(BF16),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((48, 64)).astype(np.float16),
        "model.layers.0.self_attn.q_proj.bias": rng.standard_normal(48).astype(BF16),
        "model.layers.0.self_attn.q_norm.weight": rng.standard_normal((1, 64)).astype(BF16),
        "model.layers.0.mlp.gate.weight": rng.standard_normal((4, 64)).astype(BF16),  # MoE router
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((32, 64)).astype(BF16),
        "model.layers.0.mlp.down_proj.weight": (rng.standard_normal((64, 32)) * 0.01).astype(F32),
        "model.layers.0.odd.weight": rng.standard_normal((8, 24)).astype(BF16),  # K not a multiple of 16
        "lm_head.weight": rng.standard_normal((40, 64)).astype(BF16),
    }


QUANTIZED = {
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.down_proj",
    "lm_head",
}


def check_quantized(out, model, quantized):
    loaded = ck.load_nvfp4(out)
    assert loaded.layout == "modelopt"
    assert set(loaded.weights) == quantized
    for prefix, w in loaded.weights.items():
        expected = fp4kit.quantize(model[f"{prefix}.weight"])
        assert np.array_equal(w.packed, expected.packed), prefix
        assert np.array_equal(w.block_scales, expected.block_scales), prefix
        assert w.global_scale.view(np.uint32) == expected.global_scale.view(np.uint32), prefix
    kept = {name for name in model if name.removesuffix(".weight") not in quantized}
    assert set(loaded.extra) == kept
    for name in kept:
        assert loaded.extra[name].dtype == model[name].dtype and np.array_equal(loaded.extra[name], model[name])
    return loaded


def test_quantize_then_inspect(rng, tmp_path, capsys):
    model = tiny_model(rng)
    src = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(model, src)
    out = tmp_path / "nvfp4"

    assert cli.main(["quantize", str(src), str(out), "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # the progress bar shows on a terminal only
    for prefix in QUANTIZED:
        assert re.search(rf"^{re.escape(prefix)}\.weight\s+\[\d+, \d+\]\s+\d", captured.out, re.M)
    # everything not quantized is listed with the reason
    reasons = {
        "model.embed_tokens.weight": r"BF16\s+\[40, 64\]\s+default name rule \(embed\)",
        "model.layers.0.input_layernorm.weight": r"BF16\s+\[64\]\s+1-D \(only 2-D \[N, K\] weights are quantized\)",
        "model.layers.0.self_attn.q_proj.bias": r"BF16\s+\[48\]\s+not a \*\.weight tensor",
        "model.layers.0.self_attn.q_norm.weight": r"BF16\s+\[1, 64\]\s+default name rule \(norm\)",
        "model.layers.0.mlp.gate.weight": r"BF16\s+\[4, 64\]\s+default name rule",
        "model.layers.0.odd.weight": r"BF16\s+\[8, 24\]\s+K = 24 is not a multiple of 16",
    }
    for name, reason in reasons.items():
        assert re.search(rf"^{re.escape(name)}\s+{reason}", captured.out, re.M), name
    assert "kept as they are (6 tensor(s)" in captured.out
    # the size of the quantized tensors and of the whole checkpoint
    before = sum(model[f"{p}.weight"].nbytes for p in QUANTIZED)
    after = sum(model[f"{p}.weight"].size // 2 + model[f"{p}.weight"].size // 16 + 4 for p in QUANTIZED)
    assert f"quantized 4 tensor(s) on cpu: {before:,} -> {after:,} bytes ({before / after:.2f}x smaller)" in captured.out
    size_in, size_out = src.stat().st_size, (out / "model.safetensors").stat().st_size
    assert f"checkpoint: {size_in:,} -> {size_out:,} bytes of safetensors files ({size_in / size_out:.2f}x smaller)" in captured.out

    assert sorted(p.name for p in out.iterdir()) == ["hf_quant_config.json", "model.safetensors"]
    check_quantized(out, model, QUANTIZED)
    config = json.loads((out / "hf_quant_config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W4A16_NVFP4"  # weight-only, as ModelOpt labels it
    assert config["quantization"]["exclude_modules"] == sorted(
        name.removesuffix(".weight") for name in reasons if name.endswith(".weight"))

    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "layout: modelopt" in text
    assert "producer fp4kit" in text
    assert re.search(r"^model\.layers\.0\.mlp\.down_proj\.weight_scale\s+F8_E4M3\s+\[64, 2\]\s+128$", text, re.M)
    assert re.search(r"^model\.embed_tokens\.weight\s+BF16\s+\[40, 64\]\s+5,120$", text, re.M)
    row = re.search(r"^model\.layers\.0\.mlp\.down_proj\s+64\s+32\s+(\S+)\s+(\S+)\s+-\s+(\S+)\s+(\S+)\s+(\d+)$", text, re.M)
    assert row, text
    q = fp4kit.quantize(model["model.layers.0.mlp.down_proj.weight"])
    assert float(row[1]) == pytest.approx(float(q.global_scale), rel=1e-8)
    nonzero = fp4kit.E4M3_VALUES[q.block_scales[q.block_scales != 0]]
    assert float(row[3]) == pytest.approx(nonzero.min(), rel=1e-6) and float(row[4]) == pytest.approx(nonzero.max(), rel=1e-6)
    assert int(row[5]) == int(np.count_nonzero(q.block_scales == 0))
    total = sum(t.nbytes for t in ck.SafetensorsFile(out / "model.safetensors").tensors.values())
    assert f"total: {total:,} bytes of tensor data in 18 tensors" in text


def test_quantize_sharded_folder_copies_side_files(rng, tmp_path, capsys):
    model = tiny_model(rng)
    names = list(model)
    src = tmp_path / "src"
    src.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for file, part in shards.items():
        safetensors.numpy.save_file({n: model[n] for n in part}, src / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (src / ck.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text('{"model_type": "tiny"}')
    out = tmp_path / "out"

    assert cli.main(["quantize", str(src), str(out), "--device", "cpu", "--exclude", "lm_head"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "hf_quant_config.json", ck.INDEX_NAME, *shards]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "tiny"  # copied, with ModelOpt's quantization_config added
    qc = config["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "W4A16_NVFP4"
    assert qc["ignore"] == json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert "lm_head" in qc["ignore"]
    index = json.loads((out / ck.INDEX_NAME).read_text())
    assert index["weight_map"]["model.layers.0.self_attn.q_proj.weight_scale_2"] == "model-00001-of-00002.safetensors"
    assert index["weight_map"]["lm_head.weight"] == "model-00002-of-00002.safetensors"
    check_quantized(out, model, QUANTIZED - {"lm_head"})


def test_include_replaces_the_name_rule(rng, tmp_path, capsys):
    model = tiny_model(rng)
    safetensors.numpy.save_file(model, tmp_path / "m.safetensors")
    out = tmp_path / "out"
    assert cli.main(["quantize", str(tmp_path / "m.safetensors"), str(out), "--device", "cpu",
                     "--include", r"embed|odd|\.bias"]) == 0
    capsys.readouterr()
    check_quantized(out, model, {"model.embed_tokens"})  # odd (K=24) and the bias stay out by shape


@pytest.mark.parametrize(
    "name, shape, dtype, selected",
    [
        ("model.layers.3.mlp.gate_proj.weight", (32, 64), "BF16", True),
        ("model.layers.3.mlp.experts.7.down_proj.weight", (64, 32), "F16", True),
        ("lm_head.weight", (128, 64), "F32", True),
        ("model.layers.3.mlp.gate.weight", (8, 64), "BF16", False),  # router
        ("model.layers.3.block_sparse_moe.gate.weight", (8, 64), "BF16", False),
        ("model.layers.3.mlp.shared_expert_gate.weight", (1, 64), "BF16", False),
        ("model.layers.3.mlp.router.weight", (8, 64), "BF16", False),
        ("model.embed_tokens.weight", (128, 64), "BF16", False),
        ("transformer.wte.weight", (128, 64), "BF16", False),
        ("model.layers.3.post_attention_layernorm.weight", (64,), "BF16", False),
        ("transformer.h.0.ln_1.weight", (64,), "BF16", False),
        ("model.layers.3.self_attn.o_proj.bias", (64,), "BF16", False),
        ("model.layers.3.self_attn.o_proj.weight", (64, 40), "BF16", False),  # K % 16 != 0
        ("model.layers.3.mlp.experts.gate_up_proj.weight", (4, 64, 32), "BF16", False),  # 3-D
        ("model.layers.3.self_attn.o_proj.weight", (64, 64), "I8", False),
    ],
)
def test_default_selection(name, shape, dtype, selected):
    assert cli.Selection()(ck.TensorInfo(name, dtype, shape, 0, 0)) is selected


def test_errors_exit_with_a_message(rng, tmp_path, capsys):
    model = tiny_model(rng)
    src = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(model, src)
    out = tmp_path / "out"
    assert cli.main(["quantize", str(src), str(out), "--device", "cpu"]) == 0
    capsys.readouterr()

    assert cli.main(["quantize", str(src), str(out), "--device", "cpu"]) == 1
    assert "already holds *.safetensors files" in capsys.readouterr().err
    assert cli.main(["quantize", str(out), str(tmp_path / "again"), "--device", "cpu"]) == 1
    assert "already holds modelopt NVFP4 tensors" in capsys.readouterr().err

    model["lm_head.weight"][3, 5] = np.nan
    safetensors.numpy.save_file(model, src)
    assert cli.main(["quantize", str(src), str(tmp_path / "nan"), "--device", "cpu"]) == 1
    assert "lm_head.weight: holds 1 non-finite value(s)" in capsys.readouterr().err
    assert not (tmp_path / "nan").exists()  # nothing half-written, no empty folder left behind
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "notes.txt").write_text("mine")
    assert cli.main(["quantize", str(src), str(tmp_path / "existing"), "--device", "cpu"]) == 1
    capsys.readouterr()
    assert [p.name for p in (tmp_path / "existing").iterdir()] == ["notes.txt"]  # a folder it did not create stays

    bad = out / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[:-3])
    assert cli.main(["inspect", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fp4kit inspect: error: ") and f"{bad}: truncated safetensors file" in err

    with pytest.raises(SystemExit):
        cli.main(["quantize", str(src), str(out), "--include", "("])
    assert "not a valid regular expression" in capsys.readouterr().err


def test_inspect_plain_file(rng, tmp_path, capsys):
    path = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file({"w": np.ones((2, 16), BF16)}, path)
    assert cli.main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "layout: plain" in text and "quantized prefixes" not in text
    assert re.search(r"^w\s+BF16\s+\[2, 16\]\s+64$", text, re.M)


def test_error_stats_and_progress():
    w = np.array([[3.0, 4.0]], F32)
    rel, max_abs = cli.error_stats([(w, np.array([[3.0, 4.5]], F32))])
    assert rel == pytest.approx(0.1) and max_abs == 0.5
    assert cli.error_stats([(np.zeros((1, 2), F32), np.zeros((1, 2), F32))]) == (0.0, 0.0)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, shown in ((io.StringIO(), False), (Terminal(), True)):
        with cli.progress(4, stream) as bar:
            bar.update(2)
        assert ("2/4" in stream.getvalue()) is shown


def test_device_cuda_without_a_gpu_is_an_error(rng, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runtime_device, "_probe", lambda: (0, "CuPy cannot be imported (no cupy)"))
    safetensors.numpy.save_file({"w.weight": np.ones((2, 16), BF16)}, tmp_path / "m.safetensors")
    assert cli.main(["quantize", str(tmp_path / "m.safetensors"), str(tmp_path / "out"), "--device", "cuda"]) == 1
    assert "--device cuda: no CUDA device is available (CuPy cannot be imported" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_selecting_nothing_is_an_error(rng, tmp_path, capsys):
    model = tiny_model(rng)
    src = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(model, src)
    out = tmp_path / "out"
    assert cli.main(["quantize", str(src), str(out), "--device", "cpu", "--include", "no_such_layer"]) == 1
    assert "--include 'no_such_layer' matches no tensor of" in capsys.readouterr().err
    # matches, but only tensors that cannot be quantized
    assert cli.main(["quantize", str(src), str(out), "--device", "cpu", "--include", r"odd|\.bias"]) == 1
    err = capsys.readouterr().err
    assert "nothing to quantize" in err and "K = 24 is not a multiple of 16" in err
    assert cli.main(["quantize", str(src), str(out), "--device", "cpu", "--exclude", "."]) == 1
    assert "nothing to quantize" in capsys.readouterr().err
    assert not out.exists()


def test_subfolders_are_copied_and_weights_listed(rng, tmp_path, capsys):
    src = tmp_path / "st-model"
    (src / "1_Pooling").mkdir(parents=True)
    (src / "2_Dense").mkdir()
    safetensors.numpy.save_file({"encoder.layer.0.dense.weight": rng.standard_normal((32, 64)).astype(BF16)},
                                src / "model.safetensors")
    (src / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (src / "modules.json").write_text("[]")
    (src / "pytorch_model.bin").write_bytes(b"old weights")
    safetensors.numpy.save_file({"linear.weight": np.ones((4, 32), F32)}, src / "2_Dense" / "model.safetensors")
    (src / "2_Dense" / "config.json").write_text("{}")
    out = tmp_path / "out"
    assert cli.main(["quantize", str(src), str(out), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert (out / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'
    assert (out / "modules.json").is_file() and (out / "2_Dense" / "config.json").is_file()
    assert not (out / "pytorch_model.bin").exists() and not (out / "2_Dense" / "model.safetensors").exists()
    assert "copied 3 other file(s): 1_Pooling/config.json, 2_Dense/config.json, modules.json" in text
    assert "not copied (2 weight file(s) of other formats or of subfolders): 2_Dense/model.safetensors, pytorch_model.bin" in text
    assert set(ck.load_nvfp4(out).weights) == {"encoder.layer.0.dense"}


def test_calibrate_writes_input_scales(rng, tmp_path, capsys):
    model = tiny_model(rng)
    src = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(model, src)
    x_q = (rng.standard_normal((5, 64)) * 3).astype(BF16)
    x_down = rng.standard_normal((2, 3, 32)).astype(F32)
    calib = tmp_path / "calib.safetensors"
    safetensors.numpy.save_file({"model.layers.0.self_attn.q_proj": x_q, "model.layers.0.mlp.down_proj": x_down}, calib)
    out = tmp_path / "out"
    assert cli.main(["quantize", str(src), str(out), "--device", "cpu", "--calibrate", str(calib)]) == 0
    assert "input scales from --calibrate for 2 of 4 quantized layer(s); the others are weight-only" in capsys.readouterr().out
    loaded = check_quantized(out, model, QUANTIZED)
    assert set(loaded.input_scales) == {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"}
    for prefix, x in (("model.layers.0.self_attn.q_proj", x_q), ("model.layers.0.mlp.down_proj", x_down)):
        expected = fp4kit.global_scale_from_amax(fp4kit.amax(x))
        assert loaded.input_scales[prefix].view(np.uint32) == expected.view(np.uint32)
        assert loaded.decode_scales[f"{prefix}.input_scale"] == np.float32(1) / expected
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "MIXED_PRECISION"
    assert quant["quantized_layers"]["model.layers.0.mlp.down_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert quant["quantized_layers"]["lm_head"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}

    bad = [({"model.embed_tokens": x_q}, "name no quantized layer"),
           ({"lm_head": x_down}, r"lm_head: expected BF16/F16/F32 activations \[\.\.\., 64\] \(K of the layer\), got F32 \[2, 3, 32\]"),
           ({"lm_head": np.zeros((2, 64), F32)}, "lm_head: all zero")]
    for i, (tensors, message) in enumerate(bad):
        safetensors.numpy.save_file(tensors, calib)
        assert cli.main(["quantize", str(src), str(tmp_path / f"bad{i}"), "--device", "cpu", "--calibrate", str(calib)]) == 1
        assert re.search(message, capsys.readouterr().err)
        assert not (tmp_path / f"bad{i}").exists()


def test_quantization_error_in_row_chunks_matches_the_whole_dequantization(rng, monkeypatch):
    w = (rng.standard_normal((50, 64)) * np.exp(rng.uniform(-3, 3, (50, 1)))).astype(F32)
    q = fp4kit.quantize(w)
    expected = cli.error_stats([(w, fp4kit.dequantize(q))])  # one chunk: the whole tensor
    monkeypatch.setattr(cli, "_ROW_CHUNK_ELEMENTS", 3 * 64)  # 17 chunks, the last one of 2 rows
    got = cli.quantization_error(w, q)
    assert got[0] == pytest.approx(expected[0], rel=1e-12) and got[1] == expected[1]
    assert 0.02 < got[0] < 0.2  # an NVFP4 error, not zero
