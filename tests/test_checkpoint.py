"""NVFP4 checkpoints on the host: exact save/load round trips, the ModelOpt and compressed-tensors
layouts, sharded folders, fused shards, and a clear error for every corrupt file."""

import json
import sys
import types

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import fp4kit
from fp4kit import checkpoint as ck
from fp4kit.reference import quant as ref
from fp4kit.runtime import device as runtime_device

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
F32 = np.float32
P = "model.layers.0.mlp.down_proj"


def bits(a) -> int:
    return int(np.asarray(a, F32).reshape(()).view(np.uint32))


def inexact_reciprocal_scale(rng, low=10, high=5000) -> np.ndarray:
    """An encode scale S with fp32(1 / fp32(1 / S)) != S (about one value in seven)."""
    while True:
        s = F32(rng.uniform(low, high))
        if F32(1) / (F32(1) / s) != s:
            return np.array(s, F32)


def modelopt_tensors(rng, prefix=P, n=4, k=64) -> dict:
    """A valid ModelOpt NVFP4 prefix as numpy arrays (what a file holds)."""
    q = ref.quantize(rng.standard_normal((n, k)).astype(F32))
    return {
        f"{prefix}.weight": q.packed,
        f"{prefix}.weight_scale": q.block_scales.view(E4M3),
        f"{prefix}.weight_scale_2": np.array(F32(1) / q.global_scale, F32),
        f"{prefix}.input_scale": np.array(0.0125, F32),
    }


def write(path, tensors, metadata=None):
    ck.write_safetensors(path, tensors, metadata)
    return path


# --------------------------------------------------------------------------------------------
# round trips and the two layouts
# --------------------------------------------------------------------------------------------


def test_save_load_round_trip_is_exact(rng, tmp_path):
    x = rng.standard_normal((96, 64)).astype(BF16)
    s_inexact = inexact_reciprocal_scale(rng)
    weights = {
        "a.q_proj": fp4kit.quantize(x, global_scale=s_inexact),  # 1/(1/S) != S for this one
        "a.o_proj": fp4kit.quantize(x[:, :32].copy(), scale_layout="swizzled"),  # saved linear
        "a.experts": fp4kit.quantize(rng.standard_normal((2, 8, 32)).astype(F32)),  # leading dims
        "a.zero": fp4kit.quantize(np.zeros((2, 16), F32)),  # S = FLT_MAX, decode scale written as 0
    }
    input_scales = {"a.q_proj": inexact_reciprocal_scale(rng)}
    extra = {"embed.weight": x, "norm.weight": rng.standard_normal(64).astype(F32), "ids": np.arange(5)}
    path = ck.save_nvfp4(tmp_path / "ckpt", weights, input_scales=input_scales, extra=extra)
    assert path == tmp_path / "ckpt" / "model.safetensors"

    loaded = ck.load_nvfp4(tmp_path / "ckpt")
    assert loaded.layout == "modelopt" and loaded.files == [path]
    assert loaded.weights.keys() == weights.keys()
    for prefix, w in weights.items():
        got = loaded.weights[prefix]
        assert got.scale_layout == "linear" and got.shape == w.shape
        assert isinstance(got.packed, np.ndarray)
        assert np.array_equal(got.packed, w.packed)
        assert np.array_equal(got.block_scales, w.linear_block_scales)
        assert bits(got.global_scale) == bits(w.global_scale), prefix
    assert bits(loaded.input_scales["a.q_proj"]) == bits(input_scales["a.q_proj"])
    assert loaded.extra.keys() == extra.keys()
    for name, a in extra.items():
        assert loaded.extra[name].dtype == a.dtype and np.array_equal(loaded.extra[name], a)


def test_load_reads_only_what_keep_keeps(rng, tmp_path):
    """``keep``: a predicate on quantized prefixes and other tensors' names; the rest is not read."""
    weights = {f"layers.{i}.w": fp4kit.quantize(rng.standard_normal((4, 64)).astype(np.float32)) for i in range(3)}
    extra = {f"layers.{i}.norm": np.ones(4, np.float32) for i in range(3)} | {"embed": np.zeros((2, 4), np.float32)}
    path = ck.save_nvfp4(tmp_path / "ckpt", weights, extra=extra)
    loaded = ck.load_nvfp4(path, keep=lambda name: not name.startswith("layers.2."))
    assert sorted(loaded.weights) == ["layers.0.w", "layers.1.w"]
    assert sorted(loaded.extra) == ["embed", "layers.0.norm", "layers.1.norm"]
    assert np.array_equal(loaded.weights["layers.1.w"].packed, weights["layers.1.w"].packed)
    with pytest.raises(TypeError, match="keep: expected a callable name -> bool or None, got list"):
        ck.load_nvfp4(path, keep=["embed"])


def test_tiled_load_is_the_gemm_layout_and_saves_back_the_same_bytes(rng, tmp_path):
    """load_nvfp4(tiled=True) gives the layout the layers use (one copy in a model built from it);
    saving a tiled weight writes the checkpoint layout, byte for byte."""
    from fp4kit.formats import to_linear
    from fp4kit.layers import Linear

    weights = {"m.up": fp4kit.quantize(rng.standard_normal((48, 96)).astype(F32)),
               "m.experts": fp4kit.quantize(rng.standard_normal((2, 16, 32)).astype(F32))}
    ck.save_nvfp4(tmp_path / "a", weights)
    plain, tiled = ck.load_nvfp4(tmp_path / "a"), ck.load_nvfp4(tmp_path / "a", tiled=True)
    for prefix, w in weights.items():
        t = tiled.weights[prefix]
        assert t.scale_layout == "tiled" and t.shape == w.shape
        back = to_linear(t)
        assert np.array_equal(back.packed, w.packed) and np.array_equal(back.block_scales, w.block_scales)
    x = rng.standard_normal((3, 96)).astype(BF16)
    y_tiled = Linear.from_checkpoint(tiled, "m.up", mode="w4a16")(x)
    assert np.array_equal(y_tiled.view(np.uint16), Linear.from_checkpoint(plain, "m.up", mode="w4a16")(x).view(np.uint16))
    ck.save_nvfp4(tmp_path / "b", tiled.weights)
    a, b = (ck.load_nvfp4(tmp_path / d) for d in ("a", "b"))
    for prefix in weights:
        assert np.array_equal(a.weights[prefix].packed, b.weights[prefix].packed)
        assert np.array_equal(a.weights[prefix].block_scales, b.weights[prefix].block_scales)


def test_file_layout_on_disk_is_modelopt(rng, tmp_path):
    q = fp4kit.quantize(rng.standard_normal((4, 32)).astype(F32))
    s_a = np.array(300.0, F32)
    path = ck.save_nvfp4(tmp_path / "w.safetensors", {P: q}, input_scales={P: s_a})
    # an independent reader: the safetensors package (its numpy backend has no float8, so the
    # scale bytes are checked through our own reader and the raw header)
    with safetensors.safe_open(path, framework="numpy") as f:
        meta = f.metadata()
        assert np.array_equal(f.get_tensor(f"{P}.weight"), q.packed)
        ws2 = f.get_tensor(f"{P}.weight_scale_2")
        assert ws2.shape == () and ws2.dtype == F32 and bits(ws2) == bits(F32(1) / q.global_scale)
        assert bits(f.get_tensor(f"{P}.input_scale")) == bits(F32(1) / s_a)
    assert meta["format"] == "pt"
    assert json.loads(meta[ck.METADATA_KEY]) == {
        f"{P}.weight_scale_2": f"0x{bits(q.global_scale):08x}",
        f"{P}.input_scale": f"0x{bits(s_a):08x}",
    }
    header = ck.SafetensorsFile(path).tensors
    assert header[f"{P}.weight"].dtype == "U8" and header[f"{P}.weight"].shape == (4, 16)
    assert header[f"{P}.weight_scale"].dtype == "F8_E4M3" and header[f"{P}.weight_scale"].shape == (4, 2)


def test_hf_quant_config_labels_what_was_written(rng, tmp_path):
    q = fp4kit.quantize(rng.standard_normal((4, 32)).astype(F32))
    s_a = np.array(300.0, F32)
    exclude = ["model.layers.0.mlp.gate", "lm_head"]
    # weight-only: W4A16_NVFP4, as ModelOpt labels it (a W4A4 loader would look for input scales)
    ck.save_nvfp4(tmp_path / "w4a16", {P: q}, exclude_modules=exclude)
    # every layer with an input scale: NVFP4; some: MIXED_PRECISION with the per-layer detail
    ck.save_nvfp4(tmp_path / "w4a4", {P: q}, input_scales={P: s_a})
    ck.save_nvfp4(tmp_path / "mixed", {P: q, "other": q}, input_scales={P: s_a})
    configs = {name: json.loads((tmp_path / name / "hf_quant_config.json").read_text())
               for name in ("w4a16", "w4a4", "mixed")}
    producer = {"name": "fp4kit", "version": fp4kit.__version__}
    assert configs["w4a16"] == {"producer": producer, "quantization": {
        "quant_algo": "W4A16_NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", "model.layers.0.mlp.gate"]}}
    assert configs["w4a4"]["quantization"]["quant_algo"] == "NVFP4"
    assert configs["mixed"]["quantization"] == {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": [],
        "quantized_layers": {P: {"quant_algo": "NVFP4", "group_size": 16},
                             "other": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}}
    for name, config in configs.items():
        assert ck.load_nvfp4(tmp_path / name).quant_config == config


def test_config_json_gets_a_modelopt_quantization_config(rng, tmp_path):
    q = fp4kit.quantize(rng.standard_normal((4, 32)).astype(F32))
    tmp_path.joinpath("config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    ck.save_nvfp4(tmp_path, {P: q, "b": q}, input_scales={P: np.array(3.0, F32)}, exclude_modules=["lm_head"])
    config = json.loads(tmp_path.joinpath("config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_size"] == 32
    qc = config["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MIXED_PRECISION"
    assert qc["ignore"] == ["lm_head"] and qc["producer"]["name"] == "fp4kit"
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert qc["config_groups"] == {"group_0": {"weights": fp4, "targets": ["b"]},
                                   "group_1": {"input_activations": fp4, "weights": fp4, "targets": [P]}}
    ck.save_nvfp4(tmp_path, {P: q})  # rewritten: one weight-only group for every Linear
    qc = json.loads(tmp_path.joinpath("config.json").read_text())["quantization_config"]
    assert qc["quant_algo"] == "W4A16_NVFP4" and qc["config_groups"] == {"group_0": {"weights": fp4, "targets": ["Linear"]}}


def test_quant_config_of_other_algorithms_is_refused(rng, tmp_path):
    write(tmp_path / "model.safetensors", modelopt_tensors(rng))
    bad = [({"quant_algo": "FP8"}, "expected quant_algo 'NVFP4' or 'W4A16_NVFP4' with group_size 16, got quant_algo 'FP8'"),
           ({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"a": {"quant_algo": "FP8"}}},
            r"quantized_layers\['a'\]: expected quant_algo"),
           ({"quant_algo": "MIXED_PRECISION"}, "needs a non-empty 'quantized_layers'")]
    for quantization, message in bad:
        tmp_path.joinpath("hf_quant_config.json").write_text(json.dumps({"quantization": quantization}))
        with pytest.raises(ValueError, match=message):
            ck.load_nvfp4(tmp_path)


def test_modelopt_file_without_metadata_uses_the_reciprocal(rng, tmp_path):
    tensors = modelopt_tensors(rng)
    ws2 = np.array(F32(1) / inexact_reciprocal_scale(rng), F32)
    tensors[f"{P}.weight_scale_2"] = ws2
    tensors["model.norm.weight"] = np.ones(64, BF16)
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")  # written by another tool

    loaded = ck.load_nvfp4(tmp_path / "model.safetensors")
    w = loaded.weights[P]
    assert w.shape == (4, 64) and w.global_scale.dtype == F32 and w.global_scale.shape == ()
    assert bits(w.global_scale) == bits(F32(1) / ws2)  # one IEEE fp32 division
    assert bits(loaded.input_scales[P]) == bits(F32(1) / F32(0.0125))
    assert np.array_equal(w.block_scales, tensors[f"{P}.weight_scale"].view(np.uint8))
    assert loaded.quant_config is None and list(loaded.extra) == ["model.norm.weight"]


def test_foreign_modelopt_file_round_trips_byte_identical(rng, tmp_path):
    # decode scales D with fp32(1/fp32(1/D)) != D: loading gives S = fp32(1/D), and writing
    # fp32(1/S) would move D by an ulp; the loaded scale must be written back as it was
    tensors, moved = {}, 0
    for i in range(12):
        prefix = f"model.layers.{i}.mlp.down_proj"
        part = modelopt_tensors(rng, prefix)
        # odd layers: a decode scale that 1/(1/D) moves
        d = inexact_reciprocal_scale(rng, 1e-4, 1e-1) if i % 2 else part[f"{prefix}.weight_scale_2"]
        part[f"{prefix}.weight_scale_2"] = d
        part[f"{prefix}.input_scale"] = np.array(F32(rng.uniform(1e-3, 1.0)), F32)
        moved += bits(F32(1) / (F32(1) / d)) != bits(d)
        tensors |= part
    tensors["model.norm.weight"] = rng.standard_normal(64).astype(BF16)
    assert moved  # the case the bit-for-bit rule is about is present
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")  # another producer, no metadata

    loaded = ck.load_nvfp4(tmp_path)
    assert set(loaded.decode_scales) == {n for n in tensors if n.endswith(("weight_scale_2", "input_scale"))}
    out = ck.save_nvfp4(tmp_path / "again", loaded)
    written, metadata = ck.read_safetensors(out)
    assert written.keys() == tensors.keys()
    for name, a in tensors.items():
        assert written[name].dtype == a.dtype and written[name].tobytes() == a.tobytes(), name
    assert ck.METADATA_KEY not in metadata  # nothing to record: every S is fp32(1/D) again
    again = ck.load_nvfp4(out)
    for prefix, w in loaded.weights.items():
        assert bits(again.weights[prefix].global_scale) == bits(w.global_scale)
    # a weight changed after loading gets the decode scale of its new S
    loaded.weights["model.layers.1.mlp.down_proj"] = fp4kit.quantize(rng.standard_normal((4, 64)).astype(F32))
    written, _ = ck.read_safetensors(ck.save_nvfp4(tmp_path / "changed", loaded))
    new = loaded.weights["model.layers.1.mlp.down_proj"].global_scale
    assert bits(written["model.layers.1.mlp.down_proj.weight_scale_2"]) == bits(F32(1) / new)


def test_all_zero_weight_is_written_as_modelopt_does(tmp_path, rng):
    zero = fp4kit.quantize(np.zeros((4, 32), F32))
    assert bits(zero.global_scale) == bits(np.finfo(F32).max) and not zero.block_scales.any()
    static = fp4kit.quantize(np.zeros((4, 32), F32), global_scale=np.array(7.0, F32))
    path = ck.save_nvfp4(tmp_path, {"zero": zero, "static": static})
    written, metadata = ck.read_safetensors(path)
    # ModelOpt's weight_scale_2 = amax / 2688 = 0, not the subnormal fp32(1/FLT_MAX) = 2.9e-39
    for prefix in ("zero", "static"):
        assert bits(written[f"{prefix}.weight_scale_2"]) == 0
        assert not written[f"{prefix}.weight_scale"].view(np.uint8).any() and not written[f"{prefix}.weight"].any()
    assert json.loads(metadata[ck.METADATA_KEY]) == {"static.weight_scale_2": "0x40e00000"}  # S = 7 kept
    loaded = ck.load_nvfp4(tmp_path)
    assert bits(loaded.weights["zero"].global_scale) == bits(np.finfo(F32).max)
    assert loaded.weights["static"].global_scale == 7.0
    assert not fp4kit.dequantize(loaded.weights["zero"]).any()
    # a zero decode scale is only valid for an all-zero weight
    tensors = modelopt_tensors(rng)
    tensors[f"{P}.weight_scale_2"] = np.zeros((), F32)
    with pytest.raises(ValueError, match=rf"{P}.weight_scale_2 .*expected a positive finite decode scale, got 0.0"):
        ck.load_nvfp4(write(tmp_path / "bad.safetensors", tensors))


def test_bf16_global_scale_of_older_modelopt_is_converted_exactly(rng, tmp_path):
    tensors = modelopt_tensors(rng)
    ws2_bf16 = np.array(0.00123, BF16)
    tensors[f"{P}.weight_scale_2"] = ws2_bf16
    loaded = ck.load_nvfp4(write(tmp_path / "m.safetensors", tensors))
    assert bits(loaded.weights[P].global_scale) == bits(F32(1) / ws2_bf16.astype(F32))


def test_inconsistent_metadata_falls_back_to_the_stored_decode_scale(rng, tmp_path):
    q = fp4kit.quantize(rng.standard_normal((4, 32)).astype(F32))
    path = ck.save_nvfp4(tmp_path, {P: q})
    tensors, metadata = ck.read_safetensors(path)
    tensors[f"{P}.weight_scale_2"] = np.array(0.5, F32)  # edited after saving
    write(path, tensors, metadata)
    with pytest.warns(UserWarning, match=rf"{P}.weight_scale_2 .*records encode scale"):
        loaded = ck.load_nvfp4(path)
    assert loaded.weights[P].global_scale == 2.0


def test_compressed_tensors_file(rng, tmp_path):
    x = rng.standard_normal((8, 48)).astype(F32)
    q = ref.quantize(x)
    tensors = {
        f"{P}.weight_packed": q.packed,
        f"{P}.weight_scale": q.block_scales.view(E4M3),
        f"{P}.weight_global_scale": q.global_scale.reshape(1),  # a divisor: the encode scale S
        f"{P}.input_global_scale": np.array([250.0], F32),
        f"{P}.weight_shape": np.array([8, 48], np.int64),
        "lm_head.weight": x.astype(BF16),
    }
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    loaded = ck.load_nvfp4(tmp_path)
    assert loaded.layout == "compressed-tensors"
    w = loaded.weights[P]
    assert bits(w.global_scale) == bits(q.global_scale) and w.global_scale.shape == ()
    assert np.array_equal(fp4kit.dequantize(w), ref.dequantize(q))
    assert loaded.input_scales[P] == 250.0 and loaded.input_scales[P].shape == ()
    assert list(loaded.extra) == ["lm_head.weight"]


def test_sharded_folder_with_and_without_index(rng, tmp_path):
    tensors = modelopt_tensors(rng) | modelopt_tensors(rng, "model.layers.1.mlp.up_proj", 8, 32)
    names = list(tensors)
    shard_a = {n: tensors[n] for n in names[:3]}  # a prefix split across two shards
    shard_b = {n: tensors[n] for n in names[3:]} | {"model.norm.weight": np.ones(8, F32)}
    write(tmp_path / "model-00001-of-00002.safetensors", shard_a)
    write(tmp_path / "model-00002-of-00002.safetensors", shard_b)
    without_index = ck.load_nvfp4(tmp_path)
    assert sorted(without_index.weights) == [P, "model.layers.1.mlp.up_proj"]
    weight_map = dict.fromkeys(shard_a, "model-00001-of-00002.safetensors")
    weight_map |= dict.fromkeys(shard_b, "model-00002-of-00002.safetensors")
    (tmp_path / ck.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with_index = ck.load_nvfp4(tmp_path)
    for prefix, w in with_index.weights.items():
        assert np.array_equal(w.packed, without_index.weights[prefix].packed)
    assert len(with_index.files) == 2 and list(with_index.extra) == ["model.norm.weight"]


def test_safetensors_package_reads_and_writes_compatible_files(rng, tmp_path):
    tensors = {"a": rng.standard_normal((3, 5)).astype(BF16), "b": np.arange(7, dtype=np.uint8),
               "c": np.array(1.5, F32)}
    safetensors.numpy.save_file(tensors, tmp_path / "theirs.safetensors", metadata={"k": "v"})
    ours, meta = ck.read_safetensors(tmp_path / "theirs.safetensors")
    assert meta == {"k": "v"}
    write(tmp_path / "ours.safetensors", tensors, {"k": "v"})
    theirs = safetensors.numpy.load_file(tmp_path / "ours.safetensors")
    for name, a in tensors.items():
        assert ours[name].dtype == a.dtype and ours[name].shape == a.shape and np.array_equal(ours[name], a)
        assert theirs[name].dtype == a.dtype and theirs[name].shape == a.shape and np.array_equal(theirs[name], a)


# --------------------------------------------------------------------------------------------
# fused shards
# --------------------------------------------------------------------------------------------


def modelopt_dequantize(q) -> np.ndarray:
    """ModelOpt's definition, written independently: e2m1 * fp32(sf) * weight_scale_2 (fp32)."""
    codes = np.stack([q.packed & 0xF, q.packed >> 4], axis=-1).reshape(q.shape)
    e2m1 = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(F32)
    sf = np.repeat(q.linear_block_scales.view(E4M3).astype(F32), 16, axis=-1)
    return (e2m1 * sf) * (F32(1) / q.global_scale)  # e2m1 * sf is exact in fp32


def test_fuse_rows_keeps_shards_with_different_global_scales_exact(rng):
    k = 64
    parts = [fp4kit.quantize((rng.standard_normal((n, k)) * amp).astype(BF16))
             for n, amp in ((3, 0.02), (5, 1.0), (2, 40.0))]
    assert len({bits(p.global_scale) for p in parts}) == 3
    fused, row_decode = ck.fuse_rows(parts)
    assert fused.shape == (10, k) and fused.scale_layout == "linear" and fused.global_scale == 1
    assert np.array_equal(fused.packed, np.concatenate([p.packed for p in parts]))
    assert np.array_equal(fused.block_scales, np.concatenate([p.block_scales for p in parts]))
    assert row_decode.dtype == F32 and row_decode.shape == (10,)
    expected_decode = np.repeat([F32(1) / p.global_scale for p in parts], [p.shape[0] for p in parts])
    assert np.array_equal(row_decode.view(np.uint32), expected_decode.astype(F32).view(np.uint32))

    # per-row dequantization: e2m1 * sf (exact, the fused tensor has S = 1) times the row's decode scale
    rows = fp4kit.dequantize(fused) * row_decode[:, None]
    start = 0
    for p in parts:
        got = rows[start : start + p.shape[0]]
        start += p.shape[0]
        # bit for bit: the shard's own ModelOpt dequantization, e2m1 * sf * weight_scale_2
        assert np.array_equal(got.view(np.uint32), modelopt_dequantize(p).view(np.uint32))
        # fp4kit's reference divides by S (e2m1 * fp32(sf / S)) instead of multiplying by fp32(1/S):
        # the two round differently, and both are within 2**-23 of the exact e2m1 * sf / S
        exact = fp4kit.dequantize(fp4kit.Nvfp4Tensor(p.packed, p.block_scales, np.ones((), F32), "linear", p.shape))
        exact = exact.astype(np.float64) / np.float64(p.global_scale)
        nz = exact != 0
        for approx in (got, ref.dequantize(p)):
            assert np.all(np.abs(approx[nz] / exact[nz] - 1) <= 2.0**-23)
            assert np.array_equal(approx[~nz], exact[~nz])


def test_fuse_rows_with_one_shared_scale_gives_a_constant_vector(rng):
    x = rng.standard_normal((12, 32)).astype(F32)
    s = fp4kit.global_scale_from_amax(fp4kit.amax(x))
    parts = [fp4kit.quantize(x[:4], global_scale=s), fp4kit.quantize(x[4:], global_scale=s, scale_layout="swizzled")]
    fused, row_decode = ck.fuse_rows(parts)
    assert np.all(row_decode == F32(1) / s)
    assert np.array_equal(fused.packed, fp4kit.quantize(x, global_scale=s).packed)
    assert np.array_equal(fused.block_scales, fp4kit.quantize(x, global_scale=s).block_scales)


@pytest.mark.parametrize(
    "parts, exc, message",
    [
        ([], ValueError, "parts: expected at least one Nvfp4Tensor"),
        ([np.zeros((2, 8), np.uint8)], TypeError, r"parts\[0\]: expected an Nvfp4Tensor, got ndarray"),
        ([ref.quantize(np.ones((2, 32), F32)), ref.quantize(np.ones((2, 48), F32))], ValueError,
         r"parts\[1\]: expected a 2-D \[N, 32\] tensor like parts\[0\], got shape \[2, 48\]"),
        ([ref.quantize(np.ones((2, 2, 32), F32))], ValueError, r"parts\[0\]: expected a 2-D"),
    ],
)
def test_fuse_rows_bad_input(parts, exc, message):
    with pytest.raises(exc, match=message):
        ck.fuse_rows(parts)


# --------------------------------------------------------------------------------------------
# corrupt files: every one raises before anything is returned, naming the tensor and the file
# --------------------------------------------------------------------------------------------


def corrupt(tensors, **changes):
    """``tensors`` with entries replaced (an array) or removed (None)."""
    out = dict(tensors)
    for suffix, value in changes.items():
        name = f"{P}.{suffix}"
        if value is None:
            del out[name]
        else:
            out[name] = value
    return out


def nan_scales(t):
    s = t[f"{P}.weight_scale"].view(np.uint8).copy()
    s[1, 2], s[3, 0] = 0x7F, 0xFF
    return s.view(E4M3)


def negative_scales(t):
    s = t[f"{P}.weight_scale"].view(np.uint8).copy()
    s[2, 3] = 0xB8  # -1.0
    return s.view(E4M3)


TENSOR_CASES = {
    "missing weight_scale": (lambda t: corrupt(t, weight_scale=None),
                             rf"{P}.weight_scale: missing from .*has weight, weight_scale_2, input_scale but no weight_scale\b"),
    "missing weight_scale_2": (lambda t: corrupt(t, weight_scale_2=None), rf"{P}.weight_scale_2: missing from"),
    "missing weight": (lambda t: corrupt(t, weight=None), rf"{P}.weight: missing from"),
    "weight not uint8": (lambda t: corrupt(t, weight=t[f"{P}.weight"].view(np.int8)),
                         rf"{P}.weight \(.*m.safetensors\): expected U8 .*got I8 \[4, 32\]"),
    "weight_scale wrong shape": (lambda t: corrupt(t, weight_scale=t[f"{P}.weight_scale"][:, :2].copy()),
                                 rf"{P}.weight_scale \(.*\): expected F8_E4M3 \[4, 4\] .*got F8_E4M3 \[4, 2\]"),
    "weight_scale as uint8": (lambda t: corrupt(t, weight_scale=t[f"{P}.weight_scale"].view(np.uint8)),
                              rf"{P}.weight_scale \(.*\): expected F8_E4M3 \[4, 4\] .*got U8 \[4, 4\]"),
    "packed width": (lambda t: corrupt(t, weight=np.zeros((4, 12), np.uint8), weight_scale=np.zeros((4, 1), E4M3)),
                     rf"{P}.weight \(.*\): expected U8 \[N, K/2\] with K a multiple of 16 .*got shape \[4, 12\]"),
    "weight_scale_2 not a scalar": (lambda t: corrupt(t, weight_scale_2=np.ones(2, F32)),
                                    rf"{P}.weight_scale_2 \(.*\): expected an F32 \(or BF16\) scalar .*got F32 \[2\]"),
    "weight_scale_2 as fp16": (lambda t: corrupt(t, weight_scale_2=np.array(0.5, np.float16)),
                               rf"{P}.weight_scale_2 \(.*\): expected an F32 \(or BF16\) scalar .*got F16 \[\]"),
    "NaN block scales": (lambda t: corrupt(t, weight_scale=nan_scales(t)),
                         rf"{P}.weight_scale \(.*m.safetensors\): 2 invalid E4M3 block-scale byte\(s\) \(2 NaN .*, 0 negative.*first at index \[1, 2\] = 0x7F"),
    "negative block scale": (lambda t: corrupt(t, weight_scale=negative_scales(t)),
                             rf"{P}.weight_scale \(.*\): 1 invalid .*\(0 NaN 0x7F/0xFF, 1 negative .*first at index \[2, 3\] = 0xB8"),
    "zero weight_scale_2": (lambda t: corrupt(t, weight_scale_2=np.array(0.0, F32)),
                            rf"{P}.weight_scale_2 \(.*\): expected a positive finite decode scale, got 0.0"),
    "negative weight_scale_2": (lambda t: corrupt(t, weight_scale_2=np.array(-0.5, F32)),
                                rf"{P}.weight_scale_2 \(.*\): expected a positive finite decode scale, got -0.5"),
    "inf weight_scale_2": (lambda t: corrupt(t, weight_scale_2=np.array(np.inf, F32)),
                           rf"{P}.weight_scale_2 .*got inf"),
    "NaN weight_scale_2 (bf16)": (lambda t: corrupt(t, weight_scale_2=np.array(np.nan, BF16)),
                                  rf"{P}.weight_scale_2 .*got nan"),
    "negative input_scale": (lambda t: corrupt(t, input_scale=np.array(-2.0, F32)),
                             rf"{P}.input_scale \(.*\): expected a positive finite decode scale, got -2.0"),
    "mixed layouts": (lambda t: t | {"other.weight_packed": np.zeros((4, 8), np.uint8)},
                      r"mixes quantized layouts: .*'model.layers.0.mlp.down_proj' is ModelOpt, 'other' is compressed-tensors"),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_corrupt_tensors_raise_a_clear_error(case, rng, tmp_path):
    make, message = TENSOR_CASES[case]
    path = write(tmp_path / "m.safetensors", make(modelopt_tensors(rng)))
    with pytest.raises(ValueError, match=message):
        ck.load_nvfp4(path)


def test_compressed_tensors_bad_global_scale_and_shape(rng, tmp_path):
    q = ref.quantize(rng.standard_normal((4, 32)).astype(F32))
    base = {f"{P}.weight_packed": q.packed, f"{P}.weight_scale": q.block_scales.view(E4M3),
            f"{P}.weight_global_scale": np.zeros(1, F32)}
    with pytest.raises(ValueError, match=rf"{P}.weight_global_scale \(.*\): expected a positive finite encode scale, got 0.0"):
        ck.load_nvfp4(write(tmp_path / "a.safetensors", base))
    base[f"{P}.weight_global_scale"] = np.ones(1, F32)
    base[f"{P}.weight_shape"] = np.array([4, 64], np.int64)
    with pytest.raises(ValueError, match=rf"{P}.weight_shape \(.*\): records shape \[4, 64\], but {P}.weight_packed \[4, 16\] holds \[4, 32\]"):
        ck.load_nvfp4(write(tmp_path / "a.safetensors", base))


def raw_file(path, header: dict, data: bytes, header_len: int | None = None):
    raw = json.dumps(header).encode()
    path.write_bytes((len(raw) if header_len is None else header_len).to_bytes(8, "little") + raw + data)
    return path


def test_truncated_file_names_the_file(rng, tmp_path):
    path = ck.save_nvfp4(tmp_path, {P: fp4kit.quantize(rng.standard_normal((8, 64)).astype(F32))})
    content = path.read_bytes()
    path.write_bytes(content[:-10])
    with pytest.raises(ValueError, match=rf"{path}: truncated safetensors file: {P}\.\w+ ends at byte \d+, the file has {len(content) - 10} bytes"):
        ck.load_nvfp4(tmp_path)


@pytest.mark.parametrize(
    "header, data, header_len, message",
    [
        (None, b"", None, "truncated safetensors file: 4 bytes, fewer than the 8-byte header length"),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0", 10**6,
         "truncated safetensors file: the header needs 1000000 bytes"),
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}},
         b"\0" * 6, None, r"corrupt header: the data of b \(bytes .*\) overlaps a"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8, None,
         r"a \(.*\): data_offsets \[0, 8\] hold 8 bytes, but F32 \[4\] needs 16"),
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"\0\0", None,
         r"truncated safetensors file: a ends at byte"),
        ({"a": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, None, r"a \(.*\): unknown dtype 'Q4'"),
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "shape must be a list of non-negative"),
        ({"__metadata__": {"k": 1}}, b"", None, "__metadata__ must map strings to strings"),
    ],
)
def test_corrupt_headers_name_the_file(tmp_path, header, data, header_len, message):
    path = tmp_path / "bad.safetensors"
    if header is None:
        path.write_bytes(b"\x01\x02\x03\x04")
    else:
        raw_file(path, header, data, header_len)
    with pytest.raises(ValueError, match=message) as error:
        ck.load_nvfp4(path)
    assert str(path) in str(error.value)


def test_header_that_is_not_json(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes((5).to_bytes(8, "little") + b"{nope")
    with pytest.raises(ValueError, match=r"bad.safetensors: the safetensors header is not valid JSON"):
        ck.load_nvfp4(path)


def test_folder_level_errors(rng, tmp_path):
    tensors = modelopt_tensors(rng)
    write(tmp_path / "a.safetensors", tensors)
    write(tmp_path / "b.safetensors", {f"{P}.weight": tensors[f"{P}.weight"]})
    with pytest.raises(ValueError, match=rf"{P}.weight: stored twice, in .*a.safetensors and in .*b.safetensors"):
        ck.load_nvfp4(tmp_path)
    (tmp_path / "b.safetensors").unlink()
    (tmp_path / ck.INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "missing.safetensors"}}))
    with pytest.raises(ValueError, match=r"index.json: names shards that do not exist: .*missing.safetensors"):
        ck.load_nvfp4(tmp_path)
    (tmp_path / ck.INDEX_NAME).unlink()
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(ValueError, match=r"hf_quant_config.json: expected quant_algo 'NVFP4' or 'W4A16_NVFP4' with group_size 16, got quant_algo 'FP8'"):
        ck.load_nvfp4(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ck.load_nvfp4(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty: no \*.safetensors files"):
        ck.load_nvfp4(empty)


def test_plain_model_is_not_an_nvfp4_checkpoint(tmp_path):
    path = write(tmp_path / "plain.safetensors", {"lm_head.weight": np.ones((4, 16), BF16)})
    with pytest.raises(ValueError, match="plain.safetensors: no NVFP4 tensors found"):
        ck.load_nvfp4(path)
    assert ck.CheckpointFiles(path).layout == "plain"


@pytest.mark.parametrize(
    "device, exc, message",
    [("tpu", ValueError, "device: expected None/False/'cpu' .* got 'tpu'"),
     ("cuda:x", ValueError, "device: expected None/False/'cpu' .* got 'cuda:x'"),
     (-1, ValueError, "device: expected a non-negative CUDA device ordinal, got -1"),
     (1.0, TypeError, "device: expected .* got float")],
)
def test_bad_device_is_rejected_before_reading(device, exc, message, tmp_path):
    with pytest.raises(exc, match=message):
        ck.load_nvfp4(tmp_path / "not-even-there", device=device)


def test_cpu_device_gives_numpy(rng, tmp_path):
    ck.save_nvfp4(tmp_path, {P: fp4kit.quantize(rng.standard_normal((4, 32)).astype(F32))})
    w = ck.load_nvfp4(tmp_path, device="cpu").weights[P]
    assert all(isinstance(a, np.ndarray) for a in (w.packed, w.block_scales, w.global_scale))


# --------------------------------------------------------------------------------------------
# save validates its arguments before writing
# --------------------------------------------------------------------------------------------


def test_save_rejects_bad_arguments_and_writes_nothing(rng, tmp_path):
    q = fp4kit.quantize(rng.standard_normal((4, 32)).astype(F32))
    bad_scale = fp4kit.Nvfp4Tensor(q.packed, q.block_scales, np.zeros((), F32), "linear", q.shape)
    nan_bytes = fp4kit.Nvfp4Tensor(q.packed, np.full_like(q.block_scales, 0x7F), q.global_scale, "linear", q.shape)
    cases = [
        (dict(weights={P: q.packed}), TypeError, rf"weights\['{P}'\]: expected an Nvfp4Tensor, got ndarray"),
        (dict(weights={P: bad_scale}), ValueError, rf"weights\['{P}'\].global_scale: expected a positive finite encode scale, got 0.0"),
        (dict(weights={P: nan_bytes}), ValueError, rf"weights\['{P}'\].block_scales: 8 invalid E4M3"),
        (dict(weights={P: q}, input_scales={"other": np.array(1.0, F32)}), ValueError, r"input_scales\['other'\]: no quantized weight"),
        (dict(weights={P: q}, input_scales={P: 1.0}), TypeError, rf"input_scales\['{P}'\]: expected a 0-d float32 array, got float"),
        (dict(weights={P: q}, input_scales={P: np.array(-1.0, F32)}), ValueError, "positive finite encode scale, got -1.0"),
        (dict(weights={P: q}, extra={f"{P}.weight": np.ones(2)}), ValueError, r"extra\[.*\]: the name is already used"),
        (dict(weights={P: q}, extra={"x": np.ones(2, np.complex64)}), TypeError, "x: dtype complex64 has no safetensors code"),
    ]
    for kwargs, exc, message in cases:
        with pytest.raises(exc, match=message):
            ck.save_nvfp4(tmp_path / "out", **kwargs)
        assert not list((tmp_path / "out").glob("*.safetensors*"))


class _FakeDevice:
    """Stands in for ``cupy.cuda.Device`` on a machine without a GPU: records the device in use."""

    current = None

    def __init__(self, device_id=0):
        self.id = device_id

    def __enter__(self):
        _FakeDevice.current = self.id

    def __exit__(self, *exc):
        _FakeDevice.current = None


class _OnDevice(np.ndarray):
    """A host array tagged with the device it was 'copied' to."""


def test_device_placement_goes_through_cupy_asarray(rng, tmp_path, monkeypatch):
    def asarray(a):
        assert _FakeDevice.current == 1, "every copy must run under the requested device"
        assert a.dtype in (np.uint8, F32, np.dtype(BF16)), a.dtype  # float8 travels as uint8
        out = np.array(a).view(_OnDevice)
        out.device_id = _FakeDevice.current
        return out

    q = fp4kit.quantize(rng.standard_normal((4, 32)).astype(F32))
    extra = {"emb": np.ones((2, 16), BF16), "fp8": np.ones(4, E4M3)}
    ck.save_nvfp4(tmp_path, {P: q}, input_scales={P: np.array(3.0, F32)}, extra=extra)
    fake = types.SimpleNamespace(asarray=asarray, ndarray=_OnDevice, cuda=types.SimpleNamespace(Device=_FakeDevice))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(runtime_device, "_probe", lambda: (2, None))  # two devices, as far as fp4kit can tell
    loaded = ck.load_nvfp4(tmp_path, device="cuda:1")
    w = loaded.weights[P]
    placed = [w.packed, w.block_scales, w.global_scale, loaded.input_scales[P], *loaded.extra.values()]
    assert all(isinstance(a, _OnDevice) and a.device_id == 1 for a in placed)
    assert loaded.extra["fp8"].dtype == np.uint8 and np.array_equal(loaded.extra["fp8"], extra["fp8"].view(np.uint8))
    assert np.array_equal(w.packed, q.packed) and w.global_scale == q.global_scale


def test_paths_of_the_wrong_type_name_the_argument(tmp_path, rng):
    q = fp4kit.quantize(rng.standard_normal((4, 32)).astype(F32))
    for bad in (None, 123):
        with pytest.raises(TypeError, match=r"path: expected a str or os.PathLike .* got (NoneType|int)"):
            ck.load_nvfp4(bad)
        with pytest.raises(TypeError, match=r"path: expected a str or os.PathLike"):
            ck.save_nvfp4(bad, {P: q})
    with pytest.raises(ValueError, match="weights: expected at least one Nvfp4Tensor"):
        ck.save_nvfp4(tmp_path / "empty", {})
    assert not (tmp_path / "empty").exists()
