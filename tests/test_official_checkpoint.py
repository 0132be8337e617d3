"""A converted official DeepSeek-V4 checkpoint loaded by the example model (examples/dsv4/official.py):
a miniature in the official names and the layout ``fp4kit convert`` writes (ModelOpt NVFP4 linears,
the compressors' fp32 and the head's bf16 weights kept as they are, bf16 norms, hyper-connection
tensors), saved beside an official config.json, then loaded and decoded on the numpy reference;
the renaming is exact (codes, block scales and global scales), the high-precision linears are
quantized with the TE recipe, and a missing or misshapen tensor is refused by name."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.checkpoint import Checkpoint, save_nvfp4

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402
from dsv4 import official, runner  # noqa: E402
from dsv4.model import Model  # noqa: E402

BF16 = ml_dtypes.bfloat16


def tiny_official(layers: int, **overrides):
    """`configs.tiny` with widths the official inference's activation simulation accepts (latent
    channels outside RoPE a multiple of 64, the indexer's a power of two of 32 or more)."""
    return configs.tiny(layers, head_dim=128, rope_dim=64, index_head_dim=64, **overrides)


def official_json(layers: int) -> dict:
    """An official-style config.json with `tiny_official`'s widths."""
    t = tiny_official(layers)
    return {
        "hidden_size": t.hidden, "num_hidden_layers": layers, "vocab_size": t.vocab, "num_attention_heads": t.heads,
        "num_key_value_heads": 1, "head_dim": t.head_dim, "qk_rope_head_dim": t.rope_dim, "q_lora_rank": t.q_lora,
        "o_lora_rank": t.o_lora, "o_groups": t.o_groups, "sliding_window": t.window, "n_routed_experts": t.experts,
        "num_experts_per_tok": t.top_k, "n_shared_experts": 1, "moe_intermediate_size": t.inner,
        "scoring_func": "sqrtsoftplus", "num_hash_layers": t.hash_layers, "index_n_heads": t.index_heads,
        "index_head_dim": t.index_head_dim, "index_topk": t.index_topk, "hc_mult": 4,
        "compress_ratios": list(t.compress_ratios) + [0],  # and the MTP layer's
    }


def miniature(cfg, seed: int = 0) -> Checkpoint:
    """Every tensor of ``cfg``'s model under its official name, as `fp4kit convert` leaves it:
    NVFP4 linears, the compressors' weights fp32 and the head bf16 (not quantized by the official
    checkpoint), bf16 norms, fp32 hyper-connection parameters of 4 copies (whatever ``cfg.hc_mult``:
    an official checkpoint has them)."""
    rng = np.random.default_rng(seed)
    ckpt = Checkpoint(layout="modelopt")
    for name, (_, (n, k)) in official._linears(cfg).items():
        w = (rng.standard_normal((n, k)) * k**-0.5).astype(np.float32)
        if ".compressor." in name:
            ckpt.extra[f"{name}.weight"] = w
        elif name == "head":
            ckpt.extra["head.weight"] = w.astype(BF16)
        else:
            ckpt.weights[name] = fp4kit.quantize(w)
    for name, (_, shape, dtype) in official._others(cfg).items():
        if name.endswith("tid2eid"):
            ckpt.extra[name] = rng.integers(0, cfg.experts, shape).astype(np.int32)
        elif name.endswith("norm.weight"):
            ckpt.extra[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(BF16)
        else:
            ckpt.extra[name] = (0.1 * rng.standard_normal(shape)).astype(dtype or BF16)
    for name, (_, shape, _) in official._others(replace(cfg, hc_mult=4)).items():
        if "hc_" in name and name not in ckpt.extra:
            ckpt.extra[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return ckpt


def hc_names(layers: int) -> list[str]:
    """The official names of the hyper-connection parameters of ``layers`` layers and the head."""
    sites = [f"layers.{i}.hc_{part}" for i in range(layers) for part in ("attn", "ffn")] + ["hc_head"]
    return sorted(f"{site}_{n}" for site in sites for n in ("fn", "scale", "base"))


def test_renaming_is_exact_and_high_precision_linears_are_quantized_at_load():
    cfg = configs.tiny(3)  # ratios 0, 4, 128: the compressors and the indexer
    src = miniature(cfg)
    assert official.is_official(src)
    ours, report = official.from_official(src, cfg)
    assert not official.is_official(ours)
    # wo_a splits into its groups by rows, bit for bit
    wo_a = src.weights["layers.1.attn.wo_a"]
    for g in range(cfg.o_groups):
        part, rows = ours.weights[f"layers.1.attn.wo_a.{g}"], slice(g * cfg.o_lora, (g + 1) * cfg.o_lora)
        assert part.shape == (cfg.o_lora, cfg.heads * cfg.head_dim // cfg.o_groups)
        assert np.array_equal(part.packed, wo_a.packed[rows]) and np.array_equal(part.block_scales, wo_a.block_scales[rows])
        assert part.global_scale == wo_a.global_scale
    # renamed linears are the same tensors
    assert ours.weights["layers.1.attn.indexer.wq"] is src.weights["layers.1.attn.indexer.wq_b"]
    assert ours.weights["layers.0.ffn.shared.up_proj"] is src.weights["layers.0.ffn.shared_experts.w3"]
    assert ours.weights["layers.2.ffn.experts.5.down_proj"] is src.weights["layers.2.ffn.experts.5.w2"]
    # kept in high precision by the checkpoint: the TE recipe here, and reported
    q = ours.weights["layers.1.attn.compressor.wgate"]
    want = fp4kit.quantize(src.extra["layers.1.attn.compressor.wgate.weight"])
    assert np.array_equal(q.packed, want.packed) and np.array_equal(q.block_scales, want.block_scales)
    assert "head" in report.quantized_here and "layers.2.attn.compressor.wkv" in report.quantized_here
    assert ours.weights["lm_head"].shape == (cfg.vocab, cfg.hidden)
    # the other tensors: renamed, norms to fp32 exactly
    assert ours.extra["layers.1.attn.sink"] is src.extra["layers.1.attn.attn_sink"]
    norm = ours.extra["layers.2.attn.compressor.norm"]
    assert norm.dtype == np.float32 and np.array_equal(norm, src.extra["layers.2.attn.compressor.norm.weight"].astype(np.float32))
    assert ours.extra["layers.0.ffn.tid2eid"] is src.extra["layers.0.ffn.gate.tid2eid"]
    assert report.left_out == hc_names(3)  # a one-stream model (hc_mult 1) builds none of them
    assert any("left out (21" in line for line in report.lines())


def test_hyper_connection_parameters_are_mapped_and_run_on_numpy():
    """With ``hc_mult = 4`` (the official config's) the hyper-connections' parameters keep their
    names, fp32, nothing is left out, and the numpy model decodes on the copies; the GPU model
    refuses such a configuration, naming it."""
    cfg = configs.tiny(3, hc_mult=4)
    src = miniature(cfg)
    ours, report = official.from_official(src, cfg)
    assert report.left_out == []
    for name in hc_names(3):
        assert ours.extra[name] is src.extra[name] and ours.extra[name].dtype == np.float32
    assert ours.extra["hc_head_fn"].shape == (4, 4 * cfg.hidden) and ours.extra["layers.2.hc_ffn_fn"].shape == (24, 4 * cfg.hidden)
    model = Model(cfg, ours, device=False)
    st = model.new_state(2, history_rows=8)
    assert st.resid.shape == (2, 4, cfg.hidden)
    first = np.array(model.step(st))
    assert first.shape == (2,) and ((first >= 0) & (first < cfg.vocab)).all()
    assert not np.array_equal(st.resid[:, 0], st.resid[:, 1])  # the copies were mixed apart


def first_layers(cfg, n: int):
    """``cfg``'s first ``n`` layers (as `config.from_official` slices)."""
    from dataclasses import replace

    return replace(cfg, layers=n, compress_ratios=cfg.compress_ratios[:n], hash_layers=min(cfg.hash_layers, n))


def test_a_slice_leaves_the_other_layers_out():
    ours, report = official.from_official(miniature(configs.tiny(3)), first_layers(configs.tiny(3), 2))
    assert "layers.2.attn.wq_a" not in ours.weights and "layers.2.attn.wq_a" in report.left_out
    assert "layers.2.attn_norm.weight" in report.left_out


def test_missing_or_misshapen_tensors_are_refused_by_name():
    cfg = configs.tiny(2)
    src = miniature(cfg)
    del src.weights["layers.1.ffn.experts.3.w1"]
    with pytest.raises(KeyError, match=r"no weight 'layers.1.ffn.experts.3.w1' \(expected \[128, 256\]"):
        official.from_official(src, cfg)
    src = miniature(cfg)
    src.extra["layers.0.attn.attn_sink"] = np.zeros(5, np.float32)
    with pytest.raises(ValueError, match=r"'layers.0.attn.attn_sink' has shape \[5\], expected \[4\]"):
        official.from_official(src, cfg)
    src = miniature(cfg)
    del src.extra["norm.weight"]
    with pytest.raises(KeyError, match="no tensor 'norm.weight'"):
        official.from_official(src, cfg)
    with pytest.raises(ValueError, match=r"'head' has shape \[1024, 256\], expected \[1024, 512\]"):
        official.from_official(miniature(cfg), configs.tiny(2, hidden=512))


def test_decode_script_loads_converted_official_weights(tmp_path, capsys):
    """``decode.py --load`` on a folder of converted official weights and its config.json: the
    configuration from the official keys (a two-layer slice with --layers, its hyper-connections),
    the report of what was quantized at load, and a decode on the numpy reference."""
    import decode

    cfg = tiny_official(3)
    folder = tmp_path / "v4-mini"
    src = miniature(cfg)
    save_nvfp4(folder, src.weights, extra=src.extra)
    (folder / "config.json").write_text(json.dumps(official_json(3)))
    assert runner.load_config(folder, 2).compress_ratios == (0, 4)
    args = ["--load", str(folder), "--layers", "2", "--numpy", "--batch", "1", "--prompt-len", "3", "--new-tokens", "2"]
    assert decode.main(args) == 0
    out = capsys.readouterr().out
    assert "read from" in out and "quantized at load (" in out
    assert "left out (" not in out  # the slice reads its own layers only, and builds their hyper-connections
    assert "hyper-connections x4, simulated FP8/FP4 activations" in out  # built on numpy from the official config
    assert not any("not built here" in line and "hyper-connections" in line for line in out.splitlines())
    assert "decode:" in out


def test_a_slice_reads_only_its_layers(tmp_path):
    """`runner.build` on converted official weights with a two-layer configuration reads neither the
    third layer's tensors nor the MTP layer's (`official.needed`)."""
    cfg3 = tiny_official(3)
    src = miniature(cfg3)
    src.extra["mtp.0.enorm.weight"] = np.ones(cfg3.hidden, BF16)
    folder = tmp_path / "v4-mini"
    save_nvfp4(folder, src.weights, extra=src.extra)
    (folder / "config.json").write_text(json.dumps(official_json(3)))
    cfg = runner.load_config(folder, 2)
    model, ckpt = runner.build(cfg, device=False, load=str(folder))
    assert not any(n.startswith("layers.2.") for n in [*ckpt.weights, *ckpt.extra])
    assert not any("left out" in line for line in model.load_report)  # the slice's hyper-connections are built
    keep = official.needed(cfg)
    assert keep("layers.1.attn.wq_a") and keep("embed.weight") and keep("head")
    assert not keep("layers.2.attn.wq_a") and not keep("mtp.0.enorm.weight") and not keep("layers.x.y")


def test_a_folder_without_a_config_is_refused(tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="no fp4kit_model.json .* and no config.json"):
        runner.load_config(folder)
