"""The example decoder with YaRN RoPE scaling (``ModelConfig.rope_factor > 1``, numpy model): the
compressing layers (ratio 4 and 128) rotate their queries, latents, compressed entries and
indexer by YaRN's inverse frequencies over ``compress_rope_theta``, the window-only layers by
plain ``rope_theta``; the numpy ops take the frequencies in place of a base. Prefill still equals
token-by-token feeding bit for bit. (The GPU model against this one: tests/test_decode_gpu.py.)"""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402
from dsv4.init import random_checkpoint  # noqa: E402
from dsv4.model import Model  # noqa: E402

from fp4kit.reference import elementwise as ref_ew  # noqa: E402
from fp4kit.reference import kv_cache as ref_kv  # noqa: E402
from fp4kit.reference.hyper_connections import yarn_inv_freq  # noqa: E402

from dsv4_helpers import assert_prefill_equals_feeding  # noqa: E402

YARN = dict(rope_factor=4.0, rope_original=64)


def logits_of(cfg, ckpt, tokens):
    model = Model(cfg, ckpt, device=False)
    st = model.new_state(tokens.shape[1], 8)
    return [np.asarray(model.feed(st, t)).astype(np.float32) for t in tokens]


def test_rope_takes_a_base_or_its_inverse_frequencies():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 32)).astype(np.float32)
    pos = np.array([[0], [5], [1000]])
    freqs = ref_ew.rope_inv_freq(16, 160000.0)
    assert np.array_equal(ref_ew.rope(x, pos, 16, freqs), ref_ew.rope(x, pos, 16, 160000.0))
    assert np.array_equal(ref_kv.rope(x[0], 7, 16, freqs), ref_kv.rope(x[0], 7, 16, 160000.0))
    yarn = yarn_inv_freq(16, 160000.0, 4.0, 64)
    assert not np.array_equal(ref_ew.rope(x, pos, 16, yarn), ref_ew.rope(x, pos, 16, 160000.0))
    with pytest.raises(ValueError, match=r"theta: expected a RoPE base or 8 inverse frequencies .* got shape \(7,\)"):
        ref_ew.rope(x, pos, 16, np.ones(7))


def test_each_layer_rotates_by_its_frequencies():
    cfg = configs.tiny(3, **YARN)
    assert cfg.compress_ratios == (0, 4, 128)
    model = Model(cfg, random_checkpoint(cfg, 0, device=False), device=False)
    want = yarn_inv_freq(cfg.rope_dim, cfg.compress_rope_theta, 4.0, 64, cfg.beta_fast, cfg.beta_slow)
    st = model.new_state(2, 8)
    for block, layer, ratio in zip(model.blocks, st.layers, cfg.compress_ratios):
        theta = block.attn.theta
        if ratio:
            assert np.array_equal(theta, want) and np.array_equal(layer["kv"].rope_theta, want)
        else:
            assert theta == cfg.rope_theta
        if ratio == 4:  # the indexer's key cache rotates as the layer does
            assert np.array_equal(layer["index"].rope_theta, want)
    # the ramp: the fastest pair keeps its frequency, the slowest is divided by the factor
    plain = ref_ew.rope_inv_freq(cfg.rope_dim, cfg.compress_rope_theta)
    assert want[0] == plain[0] and np.isclose(want[-1], plain[-1] / 4.0, rtol=1e-15, atol=0)


def test_prefill_equals_feeding_bit_for_bit():
    cfg = configs.tiny(3, max_context=64, **YARN)
    model = Model(cfg, random_checkpoint(cfg, 0, device=False), device=False)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, (2, 9)).astype(np.int32)
    st = assert_prefill_equals_feeding(model, prompt)
    assert int(st.layers[1]["kv"].comp_len[0]) == 2  # ratio 4: entries rotated by YaRN were attended


def test_yarn_changes_the_compressing_layers_only():
    tokens = np.random.default_rng(2).integers(0, 1024, (6, 2)).astype(np.int32)
    window_only = dict(compress_ratios=(0, 0))
    cfg = configs.tiny(2, **window_only)
    ckpt = random_checkpoint(cfg, 0, device=False)
    same = zip(logits_of(cfg, ckpt, tokens), logits_of(configs.tiny(2, **window_only, **YARN), ckpt, tokens))
    assert all(np.array_equal(a, b) for a, b in same)
    cfg = configs.tiny(3)
    ckpt = random_checkpoint(cfg, 0, device=False)
    plain, yarn = logits_of(cfg, ckpt, tokens), logits_of(configs.tiny(3, **YARN), ckpt, tokens)
    assert np.array_equal(plain[0], yarn[0])  # position 0: no rotation at all
    assert not np.array_equal(plain[-1], yarn[-1])
