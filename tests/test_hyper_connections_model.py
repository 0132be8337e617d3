"""The example decoder with manifold-constrained hyper-connections (``hc_mult > 1``, numpy model;
tests/test_decode_gpu.py checks the GPU model against it):
with mixing parameters that make the mix trivial it is the plain one-stream model bit for bit, so
the copies' wiring (the sublayer input, the output added back, the head's mix, every norm) is the
plain residual stream's; with random parameters the copies drift apart and prefill still equals
token-by-token feeding."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402
from dsv4.init import hc_shapes, random_checkpoint  # noqa: E402
from dsv4.model import Model  # noqa: E402


def trivial_mix(cfg):
    """A checkpoint of ``cfg`` whose hyper-connection parameters are all zero: with ``hc_eps = 0``
    every mix is exact, pre = sigmoid(0) = 1/2 per copy, post = 2 sigmoid(0) = 1, and the
    combination's rows and columns 1/2 (two copies), so the sublayer input is the stream itself and
    the new copies are stream + output, as the plain residual stream is."""
    ckpt = random_checkpoint(cfg, 0, device=False)
    for name in ckpt.extra:
        if "hc_" in name:
            ckpt.extra[name] = np.zeros_like(ckpt.extra[name])
    return ckpt


def feed(model, tokens):
    """Logits (fp32) of each teacher-forced step over ``tokens [steps, batch]``."""
    st = model.new_state(tokens.shape[1], history_rows=8)
    return [np.asarray(model.feed(st, t)).astype(np.float32) for t in tokens]


def test_a_trivial_mix_is_the_plain_residual_stream_bit_for_bit():
    plain_cfg = configs.tiny(3)
    cfg = configs.tiny(3, hc_mult=2, hc_eps=0.0)
    plain = Model(plain_cfg, random_checkpoint(plain_cfg, 0, device=False), device=False)
    model = Model(cfg, trivial_mix(cfg), device=False)
    tokens = np.random.default_rng(0).integers(0, plain_cfg.vocab, (12, 2)).astype(np.int32)
    for step, (a, b) in enumerate(zip(feed(plain, tokens), feed(model, tokens))):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")


def test_random_mixes_move_the_copies_apart_and_prefill_equals_feeding():
    cfg = configs.tiny(3, hc_mult=4)
    model = Model(cfg, random_checkpoint(cfg, 0, device=False), device=False)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, (2, 5)).astype(np.int32)
    st = model.new_state(2, history_rows=8)
    batched = np.asarray(model.prefill(st, prompt)).astype(np.float32)
    fed = feed(model, prompt.T)
    np.testing.assert_array_equal(batched, fed[-1])  # W4A16: the same logits bit for bit
    st = model.new_state(2, history_rows=8)
    model.step(st)
    assert st.resid.shape == (2, 4, cfg.hidden)
    spread = np.abs(st.resid - st.resid.mean(1, keepdims=True)).max()
    assert spread > 1e-2 * np.abs(st.resid).max()  # the copies are mixed apart
    plain = Model(configs.tiny(3), random_checkpoint(configs.tiny(3), 0, device=False), device=False)
    assert not np.array_equal(fed[-1], feed(plain, prompt.T)[-1])


def test_parameter_shapes_and_refusals():
    cfg = configs.tiny(2, hc_mult=4)
    assert hc_shapes(cfg, "layers.0.hc_attn") == {"layers.0.hc_attn_fn": (24, 4 * cfg.hidden),
                                                   "layers.0.hc_attn_scale": (3,), "layers.0.hc_attn_base": (24,)}
    assert hc_shapes(cfg, "hc_head", head=True) == {"hc_head_fn": (4, 4 * cfg.hidden), "hc_head_scale": (1,),
                                                    "hc_head_base": (4,)}
    assert hc_shapes(configs.tiny(2), "hc_head", head=True) == {}
    ckpt = random_checkpoint(cfg, 0, device=False)
    two = configs.tiny(2, hc_mult=2)
    with pytest.raises(ValueError, match="hc_mult 2: the device kernels are built for 4 copies"):
        Model(two, random_checkpoint(two, 0, device=False), device=True)
    del ckpt.extra["layers.1.hc_ffn_base"]
    with pytest.raises(KeyError, match="layers.1.hc_ffn_base"):
        Model(cfg, ckpt, device=False)
