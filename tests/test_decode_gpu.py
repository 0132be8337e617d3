"""The example decoder on the GPU: graph-replayed decoding equals eager decoding (identical tokens
and logits), the tiny model agrees with its numpy run (logits, and sublayer by sublayer), a 2-layer v4-flash-slice captures and
matches eager, 1000 replayed steps allocate nothing, and the captured step's kernels by name."""

import collections
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from dsv4 import config as configs  # noqa: E402
from dsv4 import runner  # noqa: E402

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def graph_and_eager(model, prompt, n):
    out = {}
    for name, graph in (("graph", True), ("eager", False)):
        model.generator.set_state(11, 0)
        tokens, logits, dec = runner.run(model, prompt, n, use_graph=graph, keep_logits=True)
        out[name] = (tokens, np.stack(logits), dec)
    return out


def check_sublayers(cfg, tokens):
    """The GPU model against the numpy model (same weights) sublayer by sublayer over ``tokens``
    (`runner.compare_layers`): within `runner.LAYER_TOLERANCE`."""
    model, _ = runner.build(cfg, device=True, seed=3)
    reference, _ = runner.build(cfg, device=False, seed=3)
    result = runner.compare_layers(model, runner.record_layers(reference, tokens), tokens)
    print(cfg.mode, result["worst_median"], result["worst_max"])
    assert result["ok"], (result["worst_median"], result["worst_max"], result["tolerance"])


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_sublayer_check_on_the_gpu(mode):
    """Over 140 positions (ratio-128 entries, the indexer truncating, the window wrapping)."""
    cfg = configs.tiny(layers=3, mode=mode)
    check_sublayers(cfg, runner.random_prompt(1, 140, cfg.vocab, seed=2))


def test_sublayer_check_with_yarn_on_the_gpu():
    """YaRN RoPE scaling (factor 4 over 64 tokens, 140 positions): the kernels read the compressing
    layers' frequency tables."""
    cfg = configs.tiny(layers=3, rope_factor=4.0, rope_original=64)
    check_sublayers(cfg, runner.random_prompt(1, 140, cfg.vocab, seed=2))


def test_sublayer_check_with_hyper_connections_on_the_gpu():
    """Four copies of the residual stream (raw_kernels/hyper.cu's sites): the copies, each
    sublayer's input and output, the logits."""
    cfg = configs.tiny(layers=3, hc_mult=4, mode="w4a16")
    check_sublayers(cfg, runner.random_prompt(2, 40, cfg.vocab, seed=7))


def qat_config(**overrides):
    """The tiny model with the official inference's activation simulation: 64 latent channels
    outside RoPE (one E4M3 block), an indexer of 64 channels (two E2M1 blocks)."""
    return configs.tiny(head_dim=128, rope_dim=64, index_head_dim=64, qat_sim=True, **overrides)


def test_sublayer_check_with_the_activation_simulation_on_the_gpu():
    """raw_kernels/qat.cu in the model: the window rows, the compressed entries of both caches,
    the indexer's queries and the output's de-rotation, over 140 positions (ratio-128 entries,
    the window wrapping), against the numpy model sublayer by sublayer."""
    check_sublayers(qat_config(layers=3, mode="w4a16"), runner.random_prompt(1, 140, 1024, seed=2))


def check_graph_and_numpy(cfg, prompt, n):
    """Decoding ``n`` tokens after ``prompt``: the captured step gives the eager step's tokens and
    logits bit for bit, and its logits track the numpy model's within `runner.NUMPY_TOLERANCE`.
    Returns the runs (`graph_and_eager`)."""
    model, _ = runner.build(cfg, device=True, seed=3)
    runs = graph_and_eager(model, prompt, n)
    np.testing.assert_array_equal(runs["graph"][0], runs["eager"][0])
    np.testing.assert_array_equal(runs["graph"][1], runs["eager"][1])
    cmp = runner.compare_with_numpy(cfg, 3, np.concatenate([prompt, runs["graph"][0]], axis=1))
    print(cfg.mode, cmp["rel"])
    assert cmp["first_ok"], cmp
    assert cmp["median"] <= cmp["tolerance"]["median"] and cmp["max"] <= cmp["tolerance"]["max"], cmp
    return runs


def test_hyper_connections_graph_equals_eager_and_tracks_numpy():
    cfg = configs.tiny(max_context=2048, hc_mult=4, mode="w4a16")
    check_graph_and_numpy(cfg, runner.random_prompt(2, 10, cfg.vocab, seed=8), 16)


def test_activation_simulation_graph_equals_eager_and_tracks_numpy():
    cfg = qat_config(max_context=2048, mode="w4a16")
    check_graph_and_numpy(cfg, runner.random_prompt(2, 10, cfg.vocab, seed=8), 16)


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_tiny_graph_equals_eager_and_tracks_numpy(mode):
    cfg = configs.tiny(max_context=2048, mode=mode)
    runs = check_graph_and_numpy(cfg, runner.random_prompt(3, 12, cfg.vocab, seed=5), 24)
    assert runs["graph"][2].decode_graph is not None and runs["graph"][2].prefill_graph is not None


def test_v4_flash_slice_two_layers_graph_equals_eager():
    cfg = configs.v4_flash_slice(2, max_context=1024)
    prompt = runner.random_prompt(2, 6, cfg.vocab, seed=6)
    model, ckpt = runner.build(cfg, device=True, seed=4)
    del ckpt
    runs = graph_and_eager(model, prompt, 6)
    np.testing.assert_array_equal(runs["graph"][0], runs["eager"][0])
    np.testing.assert_array_equal(runs["graph"][1], runs["eager"][1])
    assert np.isfinite(runs["graph"][1]).all()


@pytest.mark.alone  # the device's free memory: other test processes change it
def test_no_memory_growth_over_1000_replays():
    cfg = configs.tiny(max_context=4096)
    model, _ = runner.build(cfg, device=True, seed=1)
    prompt = runner.random_prompt(4, 4, cfg.vocab, seed=1)
    state = model.new_state(4, history_rows=64)
    dec = runner.Decoder(model, state, cp.asarray(prompt))
    dec.prefill()
    for _ in range(3):
        dec.decode_step()
    dec.synchronize()
    pool = cp.get_default_memory_pool()
    used, free = pool.used_bytes(), cp.cuda.runtime.memGetInfo()[0]
    graph_pool = dec.decode_graph.pool.used_bytes()
    for _ in range(1000):
        dec.decode_step()
    dec.synchronize()
    assert pool.used_bytes() == used
    assert dec.decode_graph.pool.used_bytes() == graph_pool
    assert cp.cuda.runtime.memGetInfo()[0] == free
    assert int(state.step[0]) == 1003 and int(state.positions[0]) == prompt.shape[1] - 1 + 1003


def test_decode_script_on_the_gpu_times_the_warm_up_apart(capsys):
    """The README's main command on a GPU: the first prompt position (compilation, buffers, graph
    captures) is reported as the warm-up, the rest of the prompt as the prefill rate, and the
    graph-replayed tokens equal the eager ones (--check)."""
    import decode

    args = ["--batch", "1", "--prompt-len", "5", "--new-tokens", "4", "--layers", "2"]
    assert decode.main(args) == 0  # the report (--check prints the comparison instead)
    out = capsys.readouterr().out
    assert "numpy reference" not in out
    assert "warm-up: the first prompt position (1 tokens) in" in out and "graph capture; not in the rates" in out
    assert "prefill: 3 tokens in" in out
    assert decode.main(args + ["--check"]) == 0
    assert "bit-identical: True" in capsys.readouterr().out


@pytest.mark.parametrize("b", [1, 5, 12, 130])
def test_grouped_output_projection_equals_one_linear_per_group(b):
    """The example's ``wo_a`` as one launch (W4A16: `gemm_grouped` up to 8 tokens, the MoE's expert
    GEMM over a stack view of the concatenated weight above, writing each group's rows side by side
    in place; 130 tokens: three passes of 64 rows) against one Linear per group, its buffers reused
    by a second call, and ungrouped again with the same results."""
    import ml_dtypes

    from dsv4 import model as model_module

    from fp4kit.layers import Linear
    from fp4kit.reference.gemm import calc_diff

    rng = np.random.default_rng(4)
    groups, k, n = 4, 256, 128
    ws = [rng.standard_normal((n, k)).astype(np.float32) * (g + 1) for g in range(groups)]
    grouped = model_module.OutputProjection([Linear.from_float(cp.asarray(w), mode="w4a16") for w in ws], True)
    apart = model_module.OutputProjection([Linear.from_float(cp.asarray(w), mode="w4a16") for w in ws], False)
    assert grouped.stack is not None and apart.stack is None
    for _ in range(2):
        o = cp.asarray(rng.standard_normal((b, groups * k)).astype(ml_dtypes.bfloat16))
        got, want = grouped(o), apart(o)
        assert got.shape == want.shape == (b, groups * n) and got.flags.c_contiguous
        assert calc_diff(cp.asnumpy(got).astype(np.float32), cp.asnumpy(want).astype(np.float32)) < 1e-5
    grouped.ungroup()
    assert grouped.stack is None and grouped.fused is None and len(grouped.linears) == groups
    again = grouped(o)
    assert cp.array_equal(again.view(cp.uint16), apart(o).view(cp.uint16))


@pytest.mark.parametrize("mode,qat", [("w4a16", False), ("w4a4", False), ("w4a16", True)])
def test_batched_prefill_on_the_gpu_matches_token_by_token(mode, qat):
    """`Model.prefill` on the device (sparse_prefill_attention, the indexer on one shared key
    cache, the large-T MoE and GEMM paths) against token-by-token feeding on the device: the next
    step's logits within the numpy check's bound (the two differ by GEMM summation orders, the
    attention splits' rounding and, in W4A4, the activation scale over T tokens), the same cache
    positions, and the status word clean. With the activation simulation (``qat``), prefill rounds
    every latent and the emitted entries of all T tokens at once."""
    from fp4kit.runtime import status

    cfg = qat_config(layers=4, mode=mode) if qat else configs.tiny(layers=4, mode=mode)
    prompt = runner.random_prompt(2, 150, cfg.vocab, seed=5)
    status.clear()
    logits = {}
    for batched in (False, True):
        model, _ = runner.build(cfg, device=True, seed=3)
        state = model.new_state(2, history_rows=3)
        dec = runner.Decoder(model, state, cp.asarray(prompt), use_graph=False, batched_prefill=batched)
        assert dec.prefill() == 149
        dec.decode_step()
        dec.synchronize()
        assert cp.asnumpy(state.positions).tolist() == [150, 150]
        logits[batched] = cp.asnumpy(state.logits).astype(np.float32)
    assert status.read() == 0
    a, b = logits[True], logits[False]
    rel = np.sqrt(((a - b) ** 2).mean(axis=1) / (b**2).mean(axis=1))
    print(mode, rel)
    assert (rel <= runner.NUMPY_TOLERANCE[mode]["max"]).all(), rel


def test_decode_graph_kernels_fused_combine_no_index_lists_no_unread_window():
    """The 4-layer v4-flash-slice step at batch 1 (layers of ratio 0, 4, 128, 4), captured with the
    attention's splits merged in its kernel and with the separate combine kernel
    (`ops.attention.FUSED_COMBINE`): the same tokens and the same logits bit for bit; counted off
    the graph (`benchmarks/common.graph_kernels`, what bench_decode.py counts): one attention launch
    per layer and no combine, no `all_entries` (ratio 128 passes indices=None), one window append
    per layer written by the latents' norm itself (no window-append launch; the indexer's key
    caches append none), the norms and RoPE of each projection's parts two at a time (with
    `model.NORM_QUERY_IN_ATTENTION` one launch per layer: the query's in the attention and indexer
    launches, and no position advance), no copy of the sampled tokens, one launch per layer fewer
    than the separate combine, and at most 81 - 23 kernels (81: the step before these changes)."""
    from common import graph_kernels
    from dsv4 import model as model_module

    from fp4kit.ops import attention as attention_ops

    cfg = configs.v4_flash_slice(4, max_context=1024)
    model, ckpt = runner.build(cfg, device=True, seed=4)
    del ckpt
    prompt = runner.random_prompt(1, 6, cfg.vocab, seed=6)
    runs = {}
    try:
        for fused in (False, True):
            attention_ops.FUSED_COMBINE = fused
            model.generator.set_state(11, 0)
            tokens, logits, dec = runner.run(model, prompt, 5, keep_logits=True)
            runs[fused] = (tokens, np.stack(logits), collections.Counter(graph_kernels(dec.decode_graph.graph)))
            del dec
    finally:
        attention_ops.FUSED_COMBINE = True
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    assert np.array_equal(runs[True][1].view(np.uint32), runs[False][1].view(np.uint32))
    fused, apart = runs[True][2], runs[False][2]
    print(sum(fused.values()), dict(fused.most_common()))
    layers = cfg.layers
    assert fused["sparse_decode_attention"] == layers and fused["sparse_decode_combine"] == 0
    assert apart["sparse_decode_combine"] == layers  # every layer splits at batch 1
    assert fused["all_entries"] == 0 and apart["all_entries"] == 0
    assert fused["kv_append_swa"] == 0
    ratio4 = sum(r == 4 for r in cfg.compress_ratios)
    if model_module.NORM_QUERY_IN_ATTENTION:  # the query's norm + RoPE in the attention and indexer launches
        assert fused["rmsnorm_rope2_bf16"] == layers and fused["rmsnorm_rope_bf16"] == 0
        assert fused["kv_advance"] == 0  # the ratio-0 layer's latent norm moves the positions on
    else:
        assert fused["rmsnorm_rope2_bf16"] == layers + ratio4 and fused["rmsnorm_rope_bf16"] == layers - ratio4
        assert fused["kv_advance"] == sum(r == 0 for r in cfg.compress_ratios)
    assert not [name for name in fused if name.startswith("cupy_copy")]  # the sampler writes st.tokens
    assert sum(apart.values()) - sum(fused.values()) == layers
    assert sum(fused.values()) <= 81 - (23 if model_module.NORM_QUERY_IN_ATTENTION else 18)


@pytest.mark.parametrize("mode,hc", [("w4a16", 1), ("w4a4", 1), ("w4a16", 4)])
def test_sublayer_check_with_the_mtp_layer_on_the_gpu(mode, hc):
    """The multi-token-prediction layer's kernels (its input projections, block, head; the copies
    with ``hc``) against the numpy model sublayer by sublayer over 40 positions."""
    cfg = configs.tiny(layers=2, mode=mode, hc_mult=hc, mtp_ratios=(0,))
    check_sublayers(cfg, runner.random_prompt(2, 40, cfg.vocab, seed=9))


@pytest.mark.parametrize("hc", [1, 4])
def test_mtp_layer_graph_equals_eager_and_tracks_numpy(hc):
    """With the MTP layer in the captured step: graph = eager bit for bit (tokens, logits and the
    draft log), the drafts are the greedy tokens of the MTP logits, the logits track numpy."""
    cfg = configs.tiny(max_context=2048, hc_mult=hc, mtp_ratios=(0,))
    runs = check_graph_and_numpy(cfg, runner.random_prompt(2, 10, cfg.vocab, seed=8), 16)
    drafts = {name: cp.asnumpy(dec.state.draft_history) for name, (_, _, dec) in runs.items()}
    np.testing.assert_array_equal(drafts["graph"], drafts["eager"])
    state = runs["graph"][2].state
    assert int(state.draft_step[0]) == 16 and state.mtp_runs >= 2
    last = cp.asnumpy(state.mtp_logits[0]).astype(np.float32).argmax(-1)
    np.testing.assert_array_equal(drafts["graph"][15], last)


def test_batched_prefill_on_the_gpu_fills_the_mtp_cache_as_feeding():
    cfg = configs.tiny(layers=3, mtp_ratios=(0,))
    prompt = runner.random_prompt(2, 60, cfg.vocab, seed=5)
    logits = {}
    for batched in (False, True):
        model, _ = runner.build(cfg, device=True, seed=3)
        state = model.new_state(2, history_rows=3)
        dec = runner.Decoder(model, state, cp.asarray(prompt), use_graph=False, batched_prefill=batched)
        dec.prefill()
        dec.decode_step()
        dec.synchronize()
        assert cp.asnumpy(state.mtp_layers[0]["kv"].pos).tolist() == [59, 59]
        logits[batched] = cp.asnumpy(state.mtp_logits[0]).astype(np.float32)
    a, b = logits[True], logits[False]
    rel = np.sqrt(((a - b) ** 2).mean(axis=1) / (b**2).mean(axis=1))
    assert (rel <= runner.NUMPY_TOLERANCE["w4a16"]["max"]).all(), rel


@pytest.mark.parametrize("hc", [1, 4])
def test_speculative_decoding_on_the_gpu(hc):
    """The speculative step captured = eager (tokens, counts), every cache's position at the prompt
    plus the logged tokens, and greedy speculative decoding emitting the plain greedy tokens."""
    cfg = configs.tiny(layers=3, hc_mult=hc, mtp_ratios=(0,), max_context=2048)
    prompt = runner.random_prompt(2, 10, cfg.vocab, seed=8)
    model, _ = runner.build(cfg, device=True, seed=3, temperature=0.0)
    graph_tokens, dec = runner.run_speculative(model, prompt, 12, use_graph=True)
    eager_tokens, _ = runner.run_speculative(model, prompt, 12, use_graph=False)
    state = dec.state
    for a, b in zip(graph_tokens, eager_tokens):
        np.testing.assert_array_equal(a, b)
    emitted = cp.asnumpy(state.emitted)
    for caches in state.layers + state.mtp_layers:
        for cache in caches.values():
            if hasattr(cache, "pos"):
                np.testing.assert_array_equal(cp.asnumpy(cache.pos), prompt.shape[1] - 1 + emitted)
    plain, _, _ = runner.run(model, prompt, int(emitted.max()))
    for s, tokens in enumerate(graph_tokens):
        np.testing.assert_array_equal(tokens, plain[s, : len(tokens)])


@pytest.mark.parametrize("hc", [False, True])
def test_query_norm_in_the_attention_launch_gives_the_same_bits(monkeypatch, hc):
    """`model.NORM_QUERY_IN_ATTENTION`: the attention launch norms and rotates the raw query itself
    (the RMSNorm + RoPE launch after the query projection gone, or rotating the indexer's query
    alone): graph-replayed tokens and logits equal, bit for bit, those of the launch of its own,
    on every layer kind of the tiny model (ratios 0, 4, 128), with and without hyper-connections."""
    from dsv4 import model as model_module

    cfg = configs.tiny(hc_mult=4) if hc else configs.tiny()
    prompt = runner.random_prompt(2, 5, cfg.vocab, seed=3)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(model_module, "NORM_QUERY_IN_ATTENTION", on)
        model, _ = runner.build(cfg, device=True, seed=3)
        model.generator.set_state(11, 0)
        tokens, logits, _ = runner.run(model, prompt, 4, use_graph=True, keep_logits=True)
        runs[on] = (tokens, np.stack(logits))
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    assert np.array_equal(runs[True][1].view(np.uint32), runs[False][1].view(np.uint32))
