"""benchmarks/torch_decode_peer.py, the decode step's PyTorch peer, runs the example model: built
from a tiny model's checkpoint and a state at a context, its logits follow the numpy model's
(teacher-forced, over steps that complete compressor blocks) within the bf16 rounding of its
weights, and its caches advance as the model's do. Needs PyTorch (skipped without)."""

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from benchmarks.torch_decode_peer import TorchDecodePeer, peer_weights  # noqa: E402
from dsv4 import config as configs  # noqa: E402
from dsv4 import runner  # noqa: E402

CONTEXT, STEPS, BATCH = 126, 4, 2  # positions 126..129: a ratio-4 block ends at 127, ratio-128 at 127


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(((a - b) ** 2).mean() / (b ** 2).mean()))


def tiny_model_and_peer():
    """The tiny numpy model at CONTEXT, and its peer from the same state."""
    cfg = configs.tiny(4)
    model, ckpt = runner.build(cfg, device=False, seed=0)
    state = model.new_state(BATCH, history_rows=8)
    runner.fill_context(model, state, CONTEXT, seed=1)
    return cfg, model, state, TorchDecodePeer(torch, cfg, peer_weights(torch, model, ckpt, "cpu"), state, "cpu")


def test_peer_follows_the_numpy_model():
    cfg, model, state, peer = tiny_model_and_peer()
    rng = np.random.default_rng(2)
    errors = []
    for _ in range(STEPS):
        tokens = rng.integers(0, cfg.vocab, BATCH).astype(np.int32)
        want = model.feed(state, tokens).astype(np.float32)
        peer.tokens.copy_(torch.from_numpy(tokens.astype(np.int64)))
        got = peer.forward().float().numpy()
        errors.append(rel_rms(got, want))
    for L, caches in zip(peer.layers, state.layers):  # the caches moved on alike
        for name in ("kv", "index"):
            if L[name] is None:
                continue
            assert np.array_equal(L[name]["pos"].numpy(), caches[name].pos)
            if L[name]["ratio"]:
                assert np.array_equal(L[name]["comp_len"].numpy(), caches[name].comp_len)
    assert max(errors) < 0.02, errors


def test_the_comparison_sees_a_broken_layer(monkeypatch):
    """The same comparison fails when the peer's attention ignores the compressed entries."""
    original = TorchDecodePeer._attend
    monkeypatch.setattr(TorchDecodePeer, "_attend",
                        lambda self, q, swa, pos, comp, comp_len, indices, sink: original(self, q, swa, pos, None, None,
                                                                                           None, sink))
    cfg, model, state, peer = tiny_model_and_peer()
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, BATCH).astype(np.int32)
    want = model.feed(state, tokens).astype(np.float32)
    peer.tokens.copy_(torch.from_numpy(tokens.astype(np.int64)))
    assert rel_rms(peer.forward().float().numpy(), want) > 0.1
