"""The sublayer check of the example decoder (`runner.compare_layers`) can fail: on the numpy
model, a copy of the same model passes it exactly, and each deliberate fault injected here (not in
the library) fails it: attention skipping the compressed entries, attention without its sink, the
MoE ignoring its routing weights, RoPE at the wrong position, the window off by one (newest entry
missing, or oldest entry missing). The clean run covers every path of the step: ratio-128 entries
emitted, the indexer truncating (live entries > index_topk), the window wrapping, hash- and
score-routed layers."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402
from dsv4 import model as model_mod  # noqa: E402
from dsv4 import runner  # noqa: E402

from fp4kit.reference import moe as moe_ref  # noqa: E402

CFG = configs.tiny(layers=3)  # compress ratios 0, 4, 128; layer 0 hash-routed
CFGS = {"w4a16": CFG, "w4a4": configs.tiny(layers=3, mode="w4a4")}
SEED = 3


def fresh(mode: str = "w4a16"):
    return runner.build(CFGS[mode], device=False, seed=SEED)[0]


@pytest.fixture(scope="module", params=["w4a16", "w4a4"])
def short(request):
    """40 positions: enough for every fault to show (window 16, ratio-4 entries from position 4), in
    both activation modes (each with its own bound, `runner.LAYER_TOLERANCE`)."""
    tokens = runner.random_prompt(1, 40, CFG.vocab, seed=1)
    return request.param, tokens, runner.record_layers(fresh(request.param), tokens)


def test_a_correct_model_passes_exactly_and_every_path_runs():
    tokens = runner.random_prompt(1, 140, CFG.vocab, seed=2)
    result = runner.compare_layers(fresh(), runner.record_layers(fresh(), tokens), tokens)
    assert result["ok"] and result["worst_max"][1] == 0.0
    names = {name for name, _ in result["rel"]}
    assert names == {"resid", "attn.in", "attn.out", "moe.in", "moe.out", "head.in", "logits"}
    assert all(len(v) == 140 for v in result["rel"].values())
    layers = result["state"].layers
    assert CFG.compress_ratios == (0, 4, 128) and CFG.hash_layers == 1
    assert int(layers[2]["kv"].comp_len[0]) >= 1                  # a ratio-128 entry was emitted
    assert int(layers[1]["index"].comp_len[0]) > CFG.index_topk   # the indexer selects among more
    assert int(layers[0]["kv"].pos[0]) > CFG.window                # the window wrapped


def _wrap_attention(model, change):
    """Every layer's SparseAttention call goes through ``change(call, q, swa, pos, comp, comp_len, indices)``."""
    for blk in model.blocks:
        call = blk.attn.attn
        blk.attn.attn = (lambda c: lambda *args, **kw: change(c, *args, **kw))(call)


def skip_compressed(model, monkeypatch):
    _wrap_attention(model, lambda c, q, swa, pos, comp, comp_len, idx, **kw: c(q, swa, pos, comp,
                                                                             np.zeros_like(comp_len), idx, **kw))


def drop_sink(model, monkeypatch):
    for blk in model.blocks:
        blk.attn.attn.sink = np.full(CFG.heads, -np.inf, np.float32)


def unweighted_moe(model, monkeypatch):
    route = moe_ref.route

    def ones(*args, **kw):
        ids, weights = route(*args, **kw)
        return ids, np.ones_like(weights)

    monkeypatch.setattr(moe_ref, "route", ones)


def rope_one_ahead(model, monkeypatch):
    rope = model_mod.ew.rmsnorm_rope
    monkeypatch.setattr(model_mod.ew, "rmsnorm_rope",
                        lambda x, w, pos=None, **kw: rope(x, w, None if pos is None else pos + 1, **kw))
    # the queries' RoPE where the attention and the indexer's scoring apply it (NORM_QUERY_IN_ATTENTION)
    deferred = model_mod.Attention._deferred_ropes

    def ahead(self, cache):
        return tuple(None if r is None else r._replace(offset=r.offset + 1) for r in deferred(self, cache))

    monkeypatch.setattr(model_mod.Attention, "_deferred_ropes", ahead)


def window_without_newest(model, monkeypatch):
    _wrap_attention(model, lambda c, q, swa, pos, *rest, **kw: c(q, swa, np.maximum(pos - 1, 0), *rest, **kw))


def window_without_oldest(model, monkeypatch):
    def change(c, q, swa, pos, *rest, **kw):
        swa = swa.copy()
        for b, p in enumerate(pos):
            if p > CFG.window:  # the slot the next token overwrites holds the oldest entry
                swa[b, p % CFG.window] = 0
        return c(q, swa, pos, *rest, **kw)

    _wrap_attention(model, change)


@pytest.mark.parametrize("fault", [skip_compressed, drop_sink, unweighted_moe, rope_one_ahead, window_without_newest,
                                   window_without_oldest], ids=lambda f: f.__name__)
def test_each_fault_fails_the_check(short, fault, monkeypatch):
    mode, tokens, recorded = short
    model = fresh(mode)
    fault(model, monkeypatch)
    result = runner.compare_layers(model, recorded, tokens)
    assert not result["ok"], (fault.__name__, result["worst_median"], result["worst_max"])


def test_the_script_runs_the_check():
    import decode

    assert decode.main(["--check-layers", "--numpy", "--layers", "3", "--prompt-len", "8", "--batch", "1"]) == 0
