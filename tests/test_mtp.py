"""The example model's multi-token-prediction layer (`dsv4.model.MtpLayer`, DeepSeek-V4's
``mtp.0``) on the numpy reference: its configuration from an official config.json, its input
against a float64 computation of the published formula (``e_proj(enorm(embed(token))) +
h_proj(hnorm(h))`` on every copy of the previous position's hidden state), its norms and head, the
draft log's alignment with the token log, batched prefill against token-by-token feeding, the
main model's tokens unchanged by it, loading converted official ``mtp.0.*`` tensors by name, and
the sublayer check failing on a broken MTP input."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.checkpoint import save_nvfp4

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsv4 import config as configs  # noqa: E402
from dsv4 import memory, official, runner  # noqa: E402
from dsv4.init import random_checkpoint  # noqa: E402
from test_official_checkpoint import miniature, official_json, tiny_official  # noqa: E402

BF16 = ml_dtypes.bfloat16
SEED = 5


def mtp_config(hc: int = 1, layers: int = 2, **overrides):
    return configs.tiny(layers, mtp_ratios=(0,), hc_mult=hc, **overrides)


def test_the_official_config_names_the_mtp_layer_and_its_ratio():
    d = official_json(3)  # compress_ratios: the 3 layers', then the MTP layer's 0
    d["num_nextn_predict_layers"] = 1
    d["compress_ratios"][-1] = 128
    assert configs.from_official(d, 2, mtp=True).mtp_ratios == (128,)
    assert configs.from_official(d, 2).mtp_ratios == ()
    cfg = configs.from_official(d, mtp=True)
    assert configs.ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="no multi-token-prediction layer"):
        configs.from_official(official_json(3), mtp=True)
    d["compress_ratios"] = d["compress_ratios"][:3]
    with pytest.raises(ValueError, match="compress_ratios has 3 entries for 3 layers and 1 multi-token"):
        configs.from_official(d, mtp=True)
    with pytest.raises(ValueError, match="one multi-token-prediction layer"):
        configs.tiny(2, mtp_ratios=(0, 0))
    with pytest.raises(ValueError, match="mtp_ratios: expected a tuple of entries in"):
        configs.tiny(2, mtp_ratios=(3,))


def _dequant(t) -> np.ndarray:
    return np.asarray(fp4kit.dequantize(t), np.float64)


def _bf16_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm in float64, rounded to bf16 as the model hands it to a GEMM."""
    x = np.asarray(x, np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)
    return y.astype(np.float32).astype(BF16).astype(np.float64)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("hc", [1, 4])
def test_the_mtp_input_and_head_follow_the_published_formula(hc):
    """Teacher-forced positions 0..3: at position p the MTP layer reads the hidden state position
    p - 1 left (every copy) and token p; its input is checked against float64 from the dequantized
    weights, its attention input and (one stream) its head input against float64 norms."""
    cfg = mtp_config(hc)
    model, _ = runner.build(cfg, device=False, seed=SEED)
    mtp, eps = model.mtp[0], cfg.eps
    tokens = runner.random_prompt(2, 4, cfg.vocab, seed=1)
    st = model.new_state(2, history_rows=1)
    seen = {}

    def tap(name, i, value):
        seen[(name, i)] = np.array(value, np.float64)
        return value

    w_e, w_h = _dequant(mtp.e_proj.weight), _dequant(mtp.h_proj.weight)
    for p in range(tokens.shape[1]):
        before = np.array(st.resid, np.float64)  # the hidden state position p - 1 left
        seen.clear()
        st.tokens[...] = tokens[:, p]
        model.forward(st, tap=tap)
        if p == 0:  # no position before the first: the MTP layer does not run
            assert not any(name.startswith("mtp.") for name, _ in seen) and st.mtp_runs == 0
            continue
        e = _bf16_rmsnorm(np.asarray(model.embed, np.float64)[tokens[:, p]], mtp.enorm, eps)
        h = _bf16_rmsnorm(before, mtp.hnorm, eps)  # each copy normed on its own
        want = h @ w_h.T + (e @ w_e.T).reshape(e.shape[0], *([1] * (before.ndim - 2)), -1)
        assert _rel(seen[("mtp.in", 0)], want) < 1e-6
        if hc == 1:
            blk = mtp.block
            assert _rel(seen[("mtp.attn.in", 0)], _bf16_rmsnorm(seen[("mtp.in", 0)], blk.attn_norm, eps)) < 1e-6
            final = seen[("mtp.resid", 1)] + seen[("mtp.moe.out", 0)]
            assert _rel(seen[("mtp.head.in", 0)], _bf16_rmsnorm(final, mtp.norm, eps)) < 1e-6
        assert _rel(seen[("mtp.logits", 0)], seen[("mtp.head.in", 0)] @ _dequant(model.lm_head.weight).T) < 4e-3  # bf16 logits
    assert st.mtp_runs == tokens.shape[1] - 1
    assert int(st.mtp_layers[0]["kv"].pos[0]) == tokens.shape[1] - 1  # one cache row per position before the last


def test_each_logged_draft_is_the_greedy_token_of_that_steps_mtp_logits():
    cfg = mtp_config(1)
    model, _ = runner.build(cfg, device=False, seed=SEED)
    prompt = runner.random_prompt(2, 3, cfg.vocab, seed=2)
    st = model.new_state(2, history_rows=6)
    dec = runner.Decoder(model, st, prompt)
    dec.prefill()
    for r in range(6):
        dec.decode_step()
        logits = np.asarray(st.mtp_logits[0], np.float32)
        assert np.array_equal(st.draft_history[r], logits.argmax(-1))
        assert np.array_equal(st.history[r], st.tokens)
    assert int(st.step[0]) == int(st.draft_step[0]) == 6
    acc = runner.draft_acceptance(st, 6)
    assert acc == float((st.history == st.draft_history).mean())


def test_draft_acceptance_counts_only_steps_with_a_draft():
    cfg = mtp_config(1)
    model, _ = runner.build(cfg, device=False, seed=SEED)
    st = model.new_state(3, history_rows=4)
    st.history[:] = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]]
    st.draft_history[:] = [[-1, -1, -1], [4, 0, 6], [7, 8, 0], [0, 0, 0]]
    st.step[0] = st.draft_step[0] = 3
    assert runner.draft_acceptance(st, 3) == pytest.approx(4 / 6)
    assert runner.draft_acceptance(st, 1) == pytest.approx(2 / 3)
    st.draft_step[0] = 2
    assert runner.draft_acceptance(st, 3) is None
    plain, _ = runner.build(configs.tiny(2), device=False, seed=SEED)
    assert runner.draft_acceptance(plain.new_state(1, history_rows=2), 2) is None


@pytest.mark.parametrize("hc", [1, 4])
def test_the_mtp_layer_leaves_the_main_models_tokens_and_logits_unchanged(hc):
    prompt = runner.random_prompt(2, 4, 1024, seed=3)
    with_mtp, _ = runner.build(mtp_config(hc), device=False, seed=SEED)
    without, _ = runner.build(replace(mtp_config(hc), mtp_ratios=()), device=False, seed=SEED)
    a = runner.run(with_mtp, prompt, 5, keep_logits=True)
    b = runner.run(without, prompt, 5, keep_logits=True)
    assert np.array_equal(a[0], b[0]) and np.array_equal(np.stack(a[1]), np.stack(b[1]))
    assert int(a[2].state.draft_step[0]) == 5 and b[2].state.draft_step is None  # no draft log without the layer


@pytest.mark.parametrize("hc", [1, 4])
def test_batched_prefill_fills_the_mtp_cache_as_token_by_token_feeding(hc):
    cfg = mtp_config(hc, layers=3)
    model, _ = runner.build(cfg, device=False, seed=SEED)
    prompt = runner.random_prompt(2, 7, cfg.vocab, seed=4)
    states = []
    for batched in (False, True):
        st = model.new_state(2, history_rows=2)
        dec = runner.Decoder(model, st, prompt, batched_prefill=batched)
        dec.prefill()
        dec.decode_step()
        states.append(st)
    fed, batched = states
    kv_fed, kv_batched = fed.mtp_layers[0]["kv"], batched.mtp_layers[0]["kv"]
    assert int(kv_fed.pos[0]) == int(kv_batched.pos[0]) == prompt.shape[1] - 1
    assert np.array_equal(np.asarray(kv_fed.swa), np.asarray(kv_batched.swa))
    a, b = (np.asarray(s.mtp_logits[0], np.float64) for s in states)
    assert np.sqrt(((a - b) ** 2).mean() / (b**2).mean()) < 1e-3
    assert np.array_equal(fed.drafts, batched.drafts)


def test_random_weights_and_the_memory_plan_count_the_mtp_layer():
    cfg = mtp_config(4)
    ckpt = random_checkpoint(cfg, SEED, device=False)
    names = set(ckpt.weights) | set(ckpt.extra)
    assert {"mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.attn.wq_a", "mtp.0.ffn.experts.7.down_proj",
            "mtp.0.enorm", "mtp.0.hnorm", "mtp.0.norm", "mtp.0.hc_head_fn", "mtp.0.hc_attn_fn"} <= names
    assert "mtp.0.ffn.tid2eid" not in names  # only the first layers route by token id
    plain = random_checkpoint(replace(cfg, mtp_ratios=()), SEED, device=False)
    assert np.array_equal(plain.extra["layers.1.ffn_norm"], ckpt.extra["layers.1.ffn_norm"])  # same values
    nvfp4 = sum(t.packed.nbytes + t.block_scales.nbytes + 4 for t in ckpt.weights.values())
    plan = memory.weight_bytes(cfg)
    assert plan["routed experts"] + plan["attention and shared experts"] + plan["lm_head"] == nvfp4


def test_converted_official_mtp_tensors_load_by_name(tmp_path, capsys):
    import decode

    cfg = tiny_official(2, mtp_ratios=(0,), hc_mult=4)  # the official copies: nothing left out
    src = miniature(cfg)
    assert "mtp.0.e_proj" in src.weights and "mtp.0.hc_head_fn" in src.extra and "mtp.0.enorm.weight" in src.extra
    ours, report = official.from_official(src, cfg)
    assert report.left_out == [] and ours.weights["mtp.0.h_proj"] is src.weights["mtp.0.h_proj"]
    assert ours.extra["mtp.0.hnorm"].dtype == np.float32
    keep, plain_keep = official.needed(cfg), official.needed(replace(cfg, mtp_ratios=()))
    assert keep("mtp.0.attn.wq_a") and not plain_keep("mtp.0.attn.wq_a") and not keep("mtp.1.attn.wq_a")
    without_mtp, report = official.from_official(src, replace(cfg, mtp_ratios=()))
    assert "mtp.0.enorm.weight" in report.left_out and "mtp.0.e_proj" in report.left_out
    broken = miniature(cfg)
    del broken.weights["mtp.0.e_proj"]
    with pytest.raises(KeyError, match=r"no weight 'mtp.0.e_proj' \(expected \[256, 256\]"):
        official.from_official(broken, cfg)

    folder = tmp_path / "v4-mini"
    save_nvfp4(folder, src.weights, extra=src.extra)
    d = official_json(2)
    d["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(d))
    args = ["--load", str(folder), "--numpy", "--batch", "1", "--prompt-len", "3", "--new-tokens", "3"]
    assert decode.main(args + ["--mtp"]) == 0
    out = capsys.readouterr().out
    assert "MTP layer (ratio 0)" in out and "MTP: the greedy draft equals the sampled token in" in out
    assert "left out (" not in out
    assert decode.main(args) == 0
    assert "MTP" not in capsys.readouterr().out


def test_the_sublayer_check_fails_on_a_broken_mtp_input():
    """`runner.compare_layers` covers the MTP layer: a copy passes exactly, an MTP layer whose
    hidden-state projection reads the unnormed hidden state fails it."""
    cfg = mtp_config(1)
    tokens = runner.random_prompt(1, 12, cfg.vocab, seed=6)
    recorded = runner.record_layers(runner.build(cfg, device=False, seed=SEED)[0], tokens)
    clean = runner.compare_layers(runner.build(cfg, device=False, seed=SEED)[0], recorded, tokens)
    assert clean["ok"] and clean["worst_max"][1] == 0.0
    assert {"mtp.in", "mtp.attn.in", "mtp.moe.out", "mtp.head.in", "mtp.logits"} <= {n for n, _ in clean["rel"]}
    broken = runner.build(cfg, device=False, seed=SEED)[0]
    broken.mtp[0].hnorm = np.ones_like(broken.mtp[0].hnorm) * 3.0
    result = runner.compare_layers(broken, recorded, tokens)
    assert not result["ok"] and result["worst_max"][0] == ("mtp.in", 0)
