"""The example decoder on the numpy reference (what CI runs): seeded weights are identical however
they are made, decoding is deterministic, save -> load gives identical tokens, the script's
commands run, and the model's parts are wired as the config says."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402
from dsv4 import init, runner  # noqa: E402

import decode  # noqa: E402


def tiny_run(cfg, prompt, n, **kw):
    model, ckpt = runner.build(cfg, device=False, seed=kw.pop("seed", 7), **kw)
    tokens, logits, _ = runner.run(model, prompt, n, keep_logits=True)
    return model, ckpt, tokens, logits


def test_seeded_weights_do_not_depend_on_order_or_shape():
    a = init.uniform(np, 3, "w", (4, 6), 0.5)
    b = init.uniform(np, 3, "w", (24,), 0.5).reshape(4, 6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, init.uniform(np, 4, "w", (4, 6), 0.5))
    assert not np.array_equal(a, init.uniform(np, 3, "v", (4, 6), 0.5))
    big = init.uniform(np, 0, "big", (1 << 16,), 2.0)
    assert abs(big.std() - 2.0) < 0.05 and abs(big.mean()) < 0.05 and np.abs(big).max() <= 2.0 * 3**0.5


def test_hash_routing_table_holds_distinct_experts():
    cfg = configs.tiny()
    table = init._hash_table(np, 0, "t", cfg)
    assert table.shape == (cfg.vocab, cfg.top_k) and table.dtype == np.int32
    assert all(len(set(row)) == cfg.top_k for row in table.tolist())
    assert table.min() >= 0 and table.max() < cfg.experts


def test_tiny_decodes_deterministically_and_sanely():
    cfg = configs.tiny()
    prompt = runner.random_prompt(2, 6, cfg.vocab, seed=1)
    _, _, t1, l1 = tiny_run(cfg, prompt, 10)
    _, _, t2, l2 = tiny_run(cfg, prompt, 10)
    np.testing.assert_array_equal(t1, t2)
    np.testing.assert_array_equal(np.stack(l1), np.stack(l2))
    assert t1.shape == (2, 10) and t1.min() >= 0 and t1.max() < cfg.vocab
    logits = np.stack(l1)
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 3.0  # the scales keep logits O(1)
    assert len({tuple(r) for r in t1.T.tolist()}) > 5  # not stuck on one token
    _, _, t3, _ = tiny_run(cfg, prompt, 10, seed=8)
    assert not np.array_equal(t1, t3)


def test_greedy_decoding_takes_the_argmax():
    cfg = configs.tiny(layers=2)
    prompt = runner.random_prompt(1, 3, cfg.vocab, seed=2)
    _, _, tokens, logits = tiny_run(cfg, prompt, 4, temperature=0.0)
    np.testing.assert_array_equal(tokens[0], [int(np.argmax(lg[0])) for lg in logits])


def test_save_then_load_gives_identical_tokens(tmp_path):
    cfg = configs.tiny(layers=2)
    prompt = runner.random_prompt(2, 5, cfg.vocab, seed=3)
    _, ckpt, tokens, _ = tiny_run(cfg, prompt, 6)
    path = runner.save(tmp_path / "m", cfg, ckpt)
    assert path.exists() and (path.parent / runner.CONFIG_FILE).exists()
    assert runner.load_config(tmp_path / "m") == cfg
    model, _ = runner.build(runner.load_config(tmp_path / "m"), device=False, seed=7, load=str(tmp_path / "m"))
    again, _, _ = runner.run(model, prompt, 6)
    np.testing.assert_array_equal(tokens, again)


def test_caches_follow_the_compress_ratios():
    cfg = configs.tiny()
    prompt = runner.random_prompt(1, 9, cfg.vocab, seed=4)
    model, _ = runner.build(cfg, device=False, seed=7)
    _, _, dec = runner.run(model, prompt, 1)
    pos = 9  # 8 prompt tokens fed + the first decode step
    for ratio, st in zip(cfg.compress_ratios, dec.state.layers):
        assert int(st["kv"].pos[0]) == pos
        if ratio:
            assert int(st["kv"].comp_len[0]) == pos // ratio
        if ratio == 4:
            assert int(st["index"].comp_len[0]) == pos // 4


def test_kv_bytes_counts_window_selection_and_indexer_keys():
    cfg = configs.tiny(layers=2)  # ratios (4, 128)
    position = 600
    window = cfg.window * cfg.head_dim * 2
    csa = window + min(position // 4, cfg.index_topk) * cfg.head_dim * 2 + (position // 4) * cfg.index_head_dim * 2
    hca = window + (position // 128) * cfg.head_dim * 2
    assert runner.kv_bytes(cfg, 3, position) == 3 * (csa + hca)


def test_config_validation():
    with pytest.raises(ValueError, match="compress_ratios"):
        configs.tiny(layers=2, compress_ratios=(0, 4, 128))
    with pytest.raises(ValueError, match="compress_ratios"):
        configs.tiny(layers=1, compress_ratios=(8,))
    assert configs.v4_flash_slice(2).compress_ratios == (4, 128)
    assert configs.v4_flash_slice(4).compress_ratios == (0, 4, 128, 4)
    assert configs.ModelConfig.from_dict(configs.tiny().to_dict()) == configs.tiny()


def test_decode_progress_updates_one_line_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert decode.main(["--numpy", "--batch", "1", "--prompt-len", "2", "--new-tokens", "5", "--layers", "2",
                        "--print-every", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\r  decoded ") == 3 and "\r  decoded 5/5 tokens per sequence" in out
    assert re.search(r"seq 0 last token ids: \[[\d, ]+\]\n", out)  # the updated line is ended once


def test_decode_runs_an_official_config(tmp_path, capsys):
    """--config reads an official DeepSeek-V4 config.json (here with small widths, so numpy runs it):
    the model takes its widths, layer kinds, hyper-connections and activation simulation, and leaves
    nothing of it out."""
    import json

    official = {"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 1024, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128,
                "o_lora_rank": 128, "o_groups": 2, "sliding_window": 16, "n_routed_experts": 8,
                "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 128,
                "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "num_hash_layers": 2, "hc_mult": 4,
                "index_n_heads": 8, "index_head_dim": 64, "index_topk": 16, "compress_ratios": [0, 4, 128, 4, 0]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(official))
    assert decode.main(["--numpy", "--config", str(path), "--layers", "3", "--batch", "1", "--prompt-len", "3",
                        "--new-tokens", "2", "--max-context", "256"]) == 0
    out = capsys.readouterr().out
    assert (f"model: {path}, 3 layers, hidden 256, 8 experts top-2, vocab 1024, compress ratios [0, 4, 128], "
            "hyper-connections x4, simulated FP8/FP4 activations, w4a16, on numpy") in out
    assert "not built here" not in out  # numpy builds the hyper-connections; no RoPE scaling asked for
    assert "RoPE scaling" not in out  # none asked for
    assert re.search(r"^seq 0 generated token ids: \[\d+, \d+\]$", out, re.M)


def test_decode_script_runs_on_numpy(capsys):
    assert decode.main(["--numpy", "--batch", "2", "--prompt-len", "3", "--new-tokens", "5", "--layers", "2",
                        "--print-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "numpy reference" in out and "weights: random (seed 0), so the generated token ids mean nothing" in out
    assert re.search(r"^decode: +[\d.]+ ms/step = [\d.]+ ms/token over 2 sequence\(s\), \d+ tokens/s$", out, re.M)
    assert "bandwidth" not in out  # a numpy run says nothing about the kernels' bandwidth
    # prompt of 3: positions 0 and 1 are fed, the first as the warm-up, timed apart from the rate
    assert re.search(r"^warm-up: the first prompt position \(2 tokens\) in [\d.]+ ms \(buffers; not in the rates\)$", out, re.M)
    assert re.search(r"^prefill: 2 tokens in [\d.]+ ms \(\d+ tokens/s, token by token", out, re.M)
    assert re.search(r"^seq 0 generated token ids: \[\d+(, \d+){4}\]$", out, re.M)
    # captured stdout is not a terminal: progress as whole lines, no carriage returns
    assert "\r" not in out and len(re.findall(r"^  decoded \d/5 tokens per sequence.*seq 0 last token ids: \[", out, re.M)) == 3
    assert decode.main(["--numpy", "--check", "--batch", "1", "--prompt-len", "3", "--new-tokens", "3",
                        "--layers", "2"]) == 0
    assert "numpy vs numpy again: identical tokens and logits over 3 steps -> OK" in capsys.readouterr().out


@pytest.mark.parametrize("tp, ep", [(True, True), (False, True), (True, False)])
def test_sharded_decoding_over_two_simulated_ranks_matches_one(tp, ep):
    from fp4kit import distributed as dist

    cfg = configs.tiny(layers=2)
    prompt = runner.random_prompt(2, 4, cfg.vocab, seed=9)
    _, _, expect, expect_logits = tiny_run(cfg, prompt, 4)

    def rank(comm):
        model, _ = runner.build(cfg, device=False, seed=7)
        model.parallelize(comm, tp=tp, ep=ep)
        tokens, logits, _ = runner.run(model, prompt, 4, keep_logits=True)
        return tokens, np.stack(logits)

    for tokens, logits in dist.SimulatedGroup(2).run(rank):
        np.testing.assert_array_equal(tokens, expect)
        np.testing.assert_array_equal(logits, np.stack(expect_logits))


def test_decode_script_rejects_a_parallel_size_it_was_not_launched_with():
    with pytest.raises(SystemExit, match="--ep 2: expected 1 or the launched world size 1"):
        decode.main(["--numpy", "--ep", "2"])


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_batched_prefill_equals_token_by_token_feeding(mode):
    """`Model.prefill`: the 149 prompt tokens of two sequences through each layer once (the window
    of 16 wrapping, ratio-4 entries past the indexer's top-16, a ratio-128 entry, hash routing)
    leave the model where 149 `feed` calls do. W4A16 on numpy: the same logits bit for bit over the
    next three decode steps. W4A4 quantizes each GEMM's activation with one global scale over all
    149 tokens instead of one per token, so its logits differ by that quantization (within the
    numpy-vs-GPU check's largest-difference bound)."""
    cfg = configs.tiny(layers=4, mode=mode)
    prompt = runner.random_prompt(2, 150, cfg.vocab, seed=5)
    logits = {}
    for batched in (False, True):
        model, _ = runner.build(cfg, device=False, seed=3)
        state = model.new_state(2, history_rows=3)
        dec = runner.Decoder(model, state, prompt, use_graph=False, batched_prefill=batched)
        assert dec.prefill() == 149 and np.array_equal(state.positions, [149, 149])
        steps = []
        for _ in range(3):
            dec.decode_step()
            steps.append(np.asarray(state.logits, np.float32).copy())
        logits[batched] = np.stack(steps)
    if mode == "w4a16":
        assert np.array_equal(logits[True], logits[False])
    else:
        a, b = logits[True], logits[False]
        rel = np.sqrt(((a - b) ** 2).mean(axis=(1, 2)) / (b**2).mean(axis=(1, 2)))
        assert (rel <= runner.NUMPY_TOLERANCE["w4a4"]["max"]).all(), rel


def test_step_bytes_are_the_sum_of_the_layers():
    """The bandwidth figure's bytes (`Model.weight_bytes`, `runner.kv_bytes`) are the sums of the
    per-layer counts the step breakdown divides by (`layer_weight_bytes`, `layer_kv_bytes`), and
    the attention's count holds every projection weight of the layer."""
    cfg = configs.tiny()
    model, _ = runner.build(cfg, device=False, seed=3)
    touched = [2, 5] + [1] * (cfg.layers - 2)
    layers = [model.layer_weight_bytes(i, t) for i, t in enumerate(touched)]
    total = model.weight_bytes(touched)
    for part in ("attention", "shared", "routed", "router"):
        assert total[part] == sum(layer[part] for layer in layers) > 0
    attn = model.blocks[0].attn
    weights = [lin.weight for lin in (*attn.of_h.linears(), *attn.of_qr.linears(), attn.wo_b)]
    assert layers[0]["attention"] == sum(w.packed.nbytes + w.block_scales.nbytes + 4 for w in weights) + \
        attn.wo_a.weight_bytes()
    moe = model.blocks[1].moe
    assert layers[1]["routed"] == sum(s.packed.nbytes + s.block_scales.nbytes for s in (moe.w13, moe.w2)) * 5 // cfg.experts
    assert runner.kv_bytes(cfg, 3, 100) == sum(runner.layer_kv_bytes(cfg, r, 3, 100) for r in cfg.compress_ratios)
    assert runner.layer_kv_bytes(cfg, 0, 1, 5) == min(5, cfg.window) * cfg.head_dim * 2  # the window rows only
    assert "hyper" not in total
    hc_cfg = configs.tiny(2, hc_mult=4)
    hc_model, _ = runner.build(hc_cfg, device=False, seed=3)
    site, head = 24 * 4 * hc_cfg.hidden + 3 + 24, 4 * 4 * hc_cfg.hidden + 1 + 4  # fn, scale, base (fp32)
    assert hc_model.weight_bytes([1, 1])["hyper"] == 4 * (2 * 2 * site + head)


def test_query_norm_in_the_attention_call_gives_the_same_tokens_and_logits(monkeypatch):
    """`model.NORM_QUERY_IN_ATTENTION`: a decode step hands the raw query to the attention with its
    RMSNorm + RoPE (`fp4kit.ops.attention.QueryNorm`, at the cache's position less the token just
    appended; the indexer's query rotated by its scoring): every layer kind (ratios 0, 4, 128) gives
    the tokens and logits of the RMSNorm + RoPE launch."""
    from dsv4 import model as model_module

    cfg = configs.tiny()
    assert {0, 4, 128} <= set(cfg.compress_ratios)
    # past index_topk * 4 tokens, so the indexer's scores (its query's rotation) pick the entries
    prompt = runner.random_prompt(2, 4 * cfg.index_topk + 8, cfg.vocab, seed=3)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(model_module, "NORM_QUERY_IN_ATTENTION", on)
        runs[on] = tiny_run(cfg, prompt, 4)
    np.testing.assert_array_equal(runs[True][2], runs[False][2])
    np.testing.assert_array_equal(np.stack(runs[True][3]), np.stack(runs[False][3]))
