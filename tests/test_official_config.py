"""The example model's configuration from an official DeepSeek-V4 config.json (examples/dsv4/config.py
`from_official`): the V4-Flash and V4-Pro key values as published, a slice of their first layers, the
`inference/` copy's renamed keys, and refusals that name what is missing or cannot be built."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402

RATIOS_FLASH = [0, 0] + [4, 128] * 20 + [4, 0]  # 43 layers and the MTP layer


def flash() -> dict:
    return {
        "hidden_size": 4096, "num_hidden_layers": 43, "vocab_size": 129280, "max_position_embeddings": 1048576,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "sliding_window": 128,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3, "num_nextn_predict_layers": 1,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "compress_ratios": RATIOS_FLASH,
    }


def test_v4_flash_config_maps_every_width():
    cfg = configs.from_official(flash())
    assert (cfg.vocab, cfg.hidden, cfg.layers, cfg.heads, cfg.head_dim, cfg.rope_dim) == (129280, 4096, 43, 64, 512, 64)
    assert (cfg.q_lora, cfg.o_lora, cfg.o_groups, cfg.window) == (1024, 1024, 8, 128)
    assert (cfg.experts, cfg.top_k, cfg.inner, cfg.hash_layers) == (256, 6, 2048, 3)
    assert (cfg.index_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 512)
    assert (cfg.routed_scale, cfg.swiglu_limit, cfg.rope_theta, cfg.compress_rope_theta) == (1.5, 10.0, 10000, 160000)
    assert cfg.compress_ratios == tuple(RATIOS_FLASH[:43])
    # the widths of the benchmark's slice are V4-Flash's
    ref = configs.v4_flash_slice(4)
    for name in ("vocab", "hidden", "heads", "head_dim", "rope_dim", "q_lora", "o_lora", "o_groups", "window",
                 "index_heads", "index_head_dim", "index_topk", "experts", "top_k", "inner"):
        assert getattr(cfg, name) == getattr(ref, name), name


def test_a_slice_keeps_the_first_layers():
    cfg = configs.from_official(flash(), layers=4, max_context=8192, mode="w4a4")
    assert cfg.layers == 4 and cfg.compress_ratios == (0, 0, 4, 128) and cfg.hash_layers == 3
    assert cfg.max_context == 8192 and cfg.mode == "w4a4"
    assert configs.from_official(flash(), layers=2).hash_layers == 2
    for bad in (0, 44):
        with pytest.raises(ValueError, match="layers: expected 1..43"):
            configs.from_official(flash(), layers=bad)


def test_yarn_keys():
    """YaRN from the Hugging Face ``rope_scaling`` entry (V4-Flash: factor 16 over 65536 tokens,
    beta 32 / 1), from the `inference/` copy's keys, none without either; another kind of scaling
    or a factor without its original context is refused, naming it."""
    cfg = configs.from_official(flash())
    assert (cfg.rope_factor, cfg.rope_original, cfg.beta_fast, cfg.beta_slow) == (16.0, 65536, 32.0, 1.0)
    plain = configs.from_official({k: v for k, v in flash().items() if k != "rope_scaling"})
    assert plain.rope_factor == 1.0 and plain.rope_theta_of(4) == 160000.0
    d = {k: v for k, v in flash().items() if k != "rope_scaling"}
    d.update(rope_factor=8, original_seq_len=4096, beta_fast=16, beta_slow=2)
    cfg = configs.from_official(d)
    assert (cfg.rope_factor, cfg.rope_original, cfg.beta_fast, cfg.beta_slow) == (8.0, 4096, 16.0, 2.0)
    assert configs.from_official(flash(), rope_factor=1.0).rope_factor == 1.0  # plain RoPE if asked
    d = flash()
    d["rope_scaling"] = {"type": "linear", "factor": 4}
    with pytest.raises(ValueError, match="rope_scaling type 'linear'"):
        configs.from_official(d)
    d["rope_scaling"] = {"type": "yarn", "factor": 4}
    with pytest.raises(ValueError, match="without original_max_position_embeddings"):
        configs.from_official(d)
    d = {k: v for k, v in flash().items() if k != "rope_scaling"}
    d["rope_factor"] = 16
    with pytest.raises(ValueError, match="without original_seq_len"):
        configs.from_official(d)
    with pytest.raises(ValueError, match="rope_factor: expected 1"):
        configs.tiny(rope_factor=0.5)
    with pytest.raises(ValueError, match="YaRN needs rope_original > 0"):
        configs.tiny(rope_factor=4.0)


def test_hyper_connection_keys():
    cfg = configs.from_official(flash())
    assert (cfg.hc_mult, cfg.hc_iters, cfg.hc_eps) == (4, 20, 1e-6)
    plain = configs.from_official({k: v for k, v in flash().items() if not k.startswith("hc_")})
    assert (plain.hc_mult, plain.hc_iters) == (1, 20)
    assert configs.from_official(flash(), hc_mult=1).hc_mult == 1  # an override still applies
    assert cfg.qat_sim and not configs.from_official(flash(), qat_sim=False).qat_sim
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="hc_mult: expected a positive int"):
            configs.tiny(hc_mult=bad)


def test_v4_pro_config():
    d = flash()
    d.update(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
             n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5, index_topk=1024,
             compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0])
    cfg = configs.from_official(d)
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.q_lora, cfg.o_groups) == (7168, 61, 128, 1536, 16)
    assert (cfg.experts, cfg.inner, cfg.routed_scale, cfg.index_topk) == (384, 3072, 2.5, 1024)
    assert cfg.compress_ratios[:3] == (128, 128, 4) and len(cfg.compress_ratios) == 61


def test_inference_copy_renamed_keys():
    d = flash()
    renames = {"hidden_size": "dim", "moe_intermediate_size": "moe_inter_dim", "num_hash_layers": "n_hash_layers",
               "routed_scaling_factor": "route_scale", "sliding_window": "window_size"}
    for old, new in renames.items():
        d[new] = d.pop(old)
    del d["rope_scaling"]
    d.update(rope_factor=16, original_seq_len=65536)
    cfg = configs.from_official(d)
    assert (cfg.hidden, cfg.inner, cfg.hash_layers, cfg.routed_scale, cfg.window) == (4096, 2048, 3, 1.5, 128)
    assert (cfg.rope_factor, cfg.rope_original) == (16.0, 65536)


@pytest.mark.parametrize("change,match", [
    ({"n_shared_experts": 2}, r"n_shared_experts 2 \(expected 1\)"),
    ({"num_key_value_heads": 8}, r"num_key_value_heads 8 \(expected 1\)"),
    ({"scoring_func": "sigmoid"}, r"scoring_func 'sigmoid'"),
    ({"n_group": 8}, r"n_group 8 \(expected none"),
    ({"compress_ratios": [0, 4]}, r"compress_ratios has 2 entries for 43 layers"),
    ({"compress_ratios": [3] * 44}, r"compress_ratios: expected entries in \(0, 4, 128\)"),
])
def test_refusals_name_the_key(change, match):
    d = flash()
    d.update(change)
    with pytest.raises(ValueError, match=match):
        configs.from_official(d)


def test_missing_keys_are_named():
    d = flash()
    del d["hidden_size"], d["index_topk"]
    with pytest.raises(ValueError, match="missing hidden_size or dim, index_topk"):
        configs.from_official(d)
    d = flash()
    del d["swiglu_limit"], d["compress_rope_theta"]  # optional: the model's defaults
    cfg = configs.from_official(d)
    assert cfg.swiglu_limit == 10.0 and cfg.compress_rope_theta == 160000.0
