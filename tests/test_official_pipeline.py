"""The official-weights path end to end, on the numpy reference: a miniature DeepSeek-V4 checkpoint
written here in the official formats and names (FP8 E4M3 linears with UE8M0 128 x 128 block scales,
MXFP4 routed experts with a UE8M0 scale per 32, the compressors' fp32 and the head's and indexer
head weights' bf16 linears, bf16 norms, the hyper-connections' fp32 parameters, the MTP layer
``mtp.0.*``), over two shards with its config.json; converted by ``fp4kit convert``; loaded by the
example model (``runner.load_config`` / ``runner.build``, `official.from_official`) and decoded.

Checked: every routed expert the model loads holds the unconverted MXFP4 values bit for bit (the
exact re-encode), every FP8 linear the TE recipe's NVFP4 of its exact blockwise dequantization;
the converted model's logits, teacher-forced, against the same model computed from the unconverted
weights (each linear quantized from its exact values by the numpy reference) within the NVFP4
bound; and the same comparison failing for a conversion that is off by one scale exponent."""

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit import checkpoint
from fp4kit.checkpoint import Checkpoint, deepseek
from fp4kit.cli import main as fp4kit_main
from fp4kit.reference import quant as qref

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsv4 import official, runner  # noqa: E402
from dsv4.model import Model  # noqa: E402
from test_convert_deepseek import fp8_weight, ue8m0  # noqa: E402
from test_official_checkpoint import official_json, tiny_official  # noqa: E402

BF16 = ml_dtypes.bfloat16
CFG = tiny_official(2, hc_mult=4, mtp_ratios=(0,))
#: relative RMS difference of the teacher-forced logits allowed between the converted model and the
#: model quantized from the unconverted weights: they differ only where the TE recipe re-rounds
#: the MXFP4 experts' exact values (its global scale is 2688 / amax, the re-encode's a power of two)
NVFP4_BOUND = 0.05


def mxfp4_weight(rng, n: int, k: int):
    """FP4 codes [N, K/2] (the lower nibble first) and UE8M0 scales [N, K/32] of weights around
    0.02 (exponents -10 .. -6: a spread of 4, so the NVFP4 re-encode is exact)."""
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8).view(np.int8)
    return codes, ue8m0(rng.integers(-10, -5, (n, k // 32)))


def high_precision(name: str) -> bool:
    """Linears the official checkpoint keeps unquantized: the compressors' (fp32), the head and the
    indexer's head weights (bf16)."""
    return ".compressor." in name or name == "head" or name.endswith("indexer.weights_proj")


def write_official(folder: Path, rng) -> dict:
    """``CFG``'s every tensor under its official name and format, in two shards; returns them."""
    tensors = {}
    for name, (_, (n, k)) in official._linears(CFG).items():
        if high_precision(name):
            w = (rng.standard_normal((n, k)) * k**-0.5).astype(np.float32)
            tensors[f"{name}.weight"] = w if ".compressor." in name else w.astype(BF16)
        elif ".ffn.experts." in name:
            tensors[f"{name}.weight"], tensors[f"{name}.scale"] = mxfp4_weight(rng, n, k)
        else:
            codes, scale = fp8_weight(rng, n, k)
            tensors[f"{name}.weight"], tensors[f"{name}.scale"] = codes, scale
    for name, (_, shape, dtype) in official._others(CFG).items():
        if name.endswith("tid2eid"):
            tensors[name] = rng.integers(0, CFG.experts, shape).astype(np.int32)
        elif name.endswith("norm.weight"):
            tensors[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(BF16)
        elif name == "embed.weight":
            tensors[name] = rng.standard_normal(shape).astype(BF16)
        else:
            tensors[name] = (0.1 * rng.standard_normal(shape)).astype(dtype or BF16)
    folder.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, members in shards.items():
        checkpoint.write_safetensors(folder / shard, {n: tensors[n] for n in members})
    index = {"metadata": {}, "weight_map": {n: shard for shard, members in shards.items() for n in members}}
    (folder / checkpoint.INDEX_NAME).write_text(json.dumps(index))
    config = official_json(CFG.layers)
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def exact_values(tensors: dict, name: str) -> np.ndarray:
    """The float values of official linear ``name`` (its codes times its scales, exactly)."""
    w = tensors[f"{name}.weight"]
    if f"{name}.scale" not in tensors:
        return np.asarray(w, np.float32)
    if ".ffn.experts." in name:
        return deepseek.mxfp4_dequantize(w, tensors[f"{name}.scale"], name)
    return deepseek.fp8_dequantize(w, tensors[f"{name}.scale"], name)


def unconverted_model(tensors: dict, cfg) -> Model:
    """The model the numpy reference builds from the unconverted weights: every linear quantized
    from its exact values (`fp4kit.quantize`, the TE recipe), every other tensor as stored."""
    ckpt = Checkpoint(layout="modelopt")
    for name in official._linears(CFG):
        ckpt.weights[name] = fp4kit.quantize(np.asarray(exact_values(tensors, name), np.float32))
    for name in official._others(CFG):
        ckpt.extra[name] = tensors[name]
    ours, report = official.from_official(ckpt, cfg)
    assert report.left_out == [] and report.quantized_here == []
    return Model(cfg, ours, device=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("official")
    tensors = write_official(tmp / "v4-mini", np.random.default_rng(0))
    out = tmp / "v4-mini-nvfp4"
    assert fp4kit_main(["convert", str(tmp / "v4-mini"), str(out), "--device", "cpu"]) == 0
    return tensors, out


def test_the_loaded_weights_are_the_unconverted_ones(converted, capsys):
    tensors, out = converted
    cfg = runner.load_config(out, mtp=True)
    for field in ("hidden", "layers", "compress_ratios", "mtp_ratios", "hc_mult", "experts", "vocab"):
        assert getattr(cfg, field) == getattr(CFG, field), field
    assert cfg.qat_sim  # an official config runs the official activation simulation
    model, ours = runner.build(cfg, device=False, load=str(out))
    assert any("quantized at load" in line for line in model.load_report)
    assert not any("left out" in line for line in model.load_report)
    for name, (mine, _) in official._linears(CFG).items():
        values = exact_values(tensors, name)
        if mine.endswith(".wo_a"):  # split into its head groups by rows, exactly
            got = np.concatenate([qref.dequantize(ours.weights[f"{mine}.{g}"]) for g in range(CFG.o_groups)])
        else:
            got = qref.dequantize(ours.weights[mine])
        if ".ffn.experts." in name:
            assert np.array_equal(got, values), name  # the MXFP4 re-encode keeps every value
        else:  # FP8 and high-precision linears: the TE recipe on the exact values
            assert np.array_equal(got, qref.dequantize(qref.quantize(np.asarray(values, np.float32)))), name
    assert {"mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.ffn.experts.7.down_proj"} <= set(ours.weights)


def test_the_converted_model_decodes_the_unconverted_models_logits(converted):
    tensors, out = converted
    cfg = runner.load_config(out, mtp=True)
    model, _ = runner.build(cfg, device=False, load=str(out))
    reference = unconverted_model(tensors, cfg)
    tokens = runner.random_prompt(2, 12, CFG.vocab, seed=1)
    a, b = runner.teacher_forced_logits(model, tokens), runner.teacher_forced_logits(reference, tokens)
    assert np.isfinite(a).all() and float(np.abs(b).max()) > 0
    rel = np.sqrt(((a - b) ** 2).mean(axis=(1, 2)) / (b**2).mean(axis=(1, 2)))
    assert rel.max() <= NVFP4_BOUND, rel
    # the MTP layer's drafts too: its logits after the last position
    drafts = []
    for m in (model, reference):
        st = m.new_state(2, history_rows=1)
        for p in range(tokens.shape[1]):
            st.tokens[...] = tokens[:, p]
            m.forward(st)
        drafts.append(np.asarray(st.mtp_logits[0], np.float64))
    rel_mtp = np.sqrt(((drafts[0] - drafts[1]) ** 2).mean() / (drafts[1] ** 2).mean())
    assert rel_mtp <= NVFP4_BOUND, rel_mtp


def test_a_conversion_off_by_one_scale_exponent_fails_the_bound(converted):
    """The check can fail: the converted shared expert of layer 1 with every block scale doubled
    (an off-by-one UE8M0 exponent) moves the logits past the bound."""
    tensors, out = converted
    cfg = runner.load_config(out, mtp=True)
    model, _ = runner.build(cfg, device=False, load=str(out))
    broken = dict(tensors)
    for part in ("w1", "w3", "w2"):
        name = f"layers.1.ffn.shared_experts.{part}.scale"
        broken[name] = ue8m0(np.asarray(tensors[name].view(np.uint8), np.int32) - 127 + 1)
    tokens = runner.random_prompt(2, 12, CFG.vocab, seed=1)
    a = runner.teacher_forced_logits(model, tokens)
    b = runner.teacher_forced_logits(unconverted_model(broken, cfg), tokens)
    rel = np.sqrt(((a - b) ** 2).mean(axis=(1, 2)) / (b**2).mean(axis=(1, 2)))
    assert rel.max() > NVFP4_BOUND, rel
