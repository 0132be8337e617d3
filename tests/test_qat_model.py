"""The example decoder with the official inference's simulated activations (``qat_sim``, numpy
model): the latent's channels outside RoPE rounded through E4M3 where they are stored (the window
rows, the compressed entries), the indexer's compressed keys (and queries) through E2M1 after a
Hadamard rotation, and the attention output's RoPE channels rotated back by the query's position.
Prefill still equals token-by-token feeding bit for bit."""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402
from dsv4.init import random_checkpoint  # noqa: E402
from dsv4.model import Model, QatSimulation  # noqa: E402

from fp4kit.reference import qat  # noqa: E402
from fp4kit.reference.elementwise import rope  # noqa: E402

from dsv4_helpers import assert_prefill_equals_feeding  # noqa: E402


def cfg_of(**overrides):
    # latent channels outside RoPE: 64 (one E4M3 block); the indexer's 64 (two E2M1 blocks)
    return configs.tiny(3, head_dim=128, rope_dim=64, index_head_dim=64, max_context=64, **overrides)


@pytest.mark.parametrize("hc", [1, 4])
def test_stored_values_are_on_their_grids_and_prefill_equals_feeding(hc):
    cfg = cfg_of(qat_sim=True, hc_mult=hc)
    model = Model(cfg, random_checkpoint(cfg, 0, device=False), device=False)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, (2, 9)).astype(np.int32)
    st = assert_prefill_equals_feeding(model, prompt)
    outside = cfg.head_dim - cfg.rope_dim
    for layer, ratio in zip(st.layers, cfg.compress_ratios):
        kv = layer["kv"]
        window = kv.swa[:, : min(prompt.shape[1], cfg.window), :outside]
        assert np.array_equal(qat.fp8_simulate(window, 64), window)  # rounding again changes nothing
        if ratio:
            n = int(kv.comp_len[0])
            assert n == prompt.shape[1] // ratio
            entries = kv.comp[:, :n, :outside]
            assert np.array_equal(qat.fp8_simulate(entries, 64), entries)
        if ratio == 4:
            keys = layer["index"].comp[:, : int(layer["index"].comp_len[0])]
            assert keys.size and np.array_equal(qat.fp4_simulate(keys, 32), keys)


def test_the_simulation_changes_the_model():
    plain_cfg, cfg = cfg_of(), cfg_of(qat_sim=True)
    ckpt = random_checkpoint(cfg, 0, device=False)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, (6, 2)).astype(np.int32)
    logits = []
    for c in (plain_cfg, cfg):
        model = Model(c, ckpt, device=False)
        st = model.new_state(2, 8)
        for t in tokens:
            last = np.asarray(model.feed(st, t)).astype(np.float32)
        logits.append(last)
    assert not np.array_equal(*logits)


def test_derotation_undoes_the_rotation_of_the_query_position():
    cfg = cfg_of(qat_sim=True)
    sim = QatSimulation(cfg, cfg.rope_theta)
    rng = np.random.default_rng(3)
    o = rng.standard_normal((3, 4, cfg.head_dim)).astype(ml_dtypes.bfloat16)
    assert np.array_equal(sim.derotate(o, np.zeros(3, np.int32)), o)  # position 0: no rotation
    positions = np.array([5, 77, 4000], np.int32)
    rotated = rope(o.astype(np.float32), positions[:, None], cfg.rope_dim, cfg.rope_theta).astype(ml_dtypes.bfloat16)
    back = sim.derotate(rotated, positions).astype(np.float32)
    np.testing.assert_array_equal(back[..., : -cfg.rope_dim], o.astype(np.float32)[..., : -cfg.rope_dim])
    # the RoPE channels went through two bf16 roundings (rotated, rotated back): 2^-8 of a pair's size each
    np.testing.assert_allclose(back, o.astype(np.float32), rtol=2**-7, atol=2**-7 * np.abs(o.astype(np.float32)).max())


def test_configuration_checks():
    with pytest.raises(ValueError, match="qat_sim: needs head_dim - rope_dim a multiple of 64"):
        configs.tiny(3, qat_sim=True)  # 64 - 16 latent channels outside RoPE
