"""The example model built expert-parallel from the start (`runner.build(expert_comm=...)`): each
rank reads only its own routed experts from a checkpoint (saved or official), and decodes the same
logits as a model built whole and then sharded (`Model.parallelize`), on simulated ranks."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsv4 import config as configs  # noqa: E402
from dsv4 import official, runner  # noqa: E402
from fp4kit import distributed as dist  # noqa: E402
from test_official_checkpoint import miniature  # noqa: E402


def decode(model, tokens):
    st = model.new_state(tokens.shape[1], history_rows=8)
    return [np.asarray(model.feed(st, t)).astype(np.float32) for t in tokens]


def test_ranks_read_their_experts_only_and_decode_as_the_sharded_model(tmp_path):
    cfg = configs.tiny(2)
    _, ckpt = runner.build(cfg, device=False, seed=1)
    path = runner.save(tmp_path / "model", cfg, ckpt)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (4, 2)).astype(np.int32)

    def sharded(comm):
        model, _ = runner.build(cfg, device=False, load=str(path))
        model.parallelize(comm, ep=True)
        return decode(model, tokens)

    def from_start(comm):
        model, held = runner.build(cfg, device=False, load=str(path), expert_comm=comm)
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in held.weights if ".experts." in n}
        assert experts == set(dist.expert_range(cfg.experts, comm))
        assert all(isinstance(b.moe, dist.ExpertParallelMoE) for b in model.blocks)
        assert model.parallelize(comm, ep=True) == 0  # already expert-parallel: nothing to shard
        return decode(model, tokens)

    want = dist.SimulatedGroup(2).run(sharded)
    got = dist.SimulatedGroup(2).run(from_start)
    for rank in range(2):
        for step, (a, b) in enumerate(zip(got[rank], want[rank])):
            np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} step {step}")


def test_official_names_with_a_ranks_experts():
    cfg = configs.tiny(2)
    src = miniature(cfg)
    for name in [n for n in src.weights if ".experts." in n and int(n.split(".experts.")[1].split(".")[0]) >= 4]:
        del src.weights[name]
    with pytest.raises(KeyError, match=r"experts\.4\.w1"):
        official.from_official(src, cfg)
    ours, _ = official.from_official(src, cfg, experts=range(0, 4))
    assert {int(n.split(".experts.")[1].split(".")[0]) for n in ours.weights if ".experts." in n} == {0, 1, 2, 3}
    keep = official.needed(cfg, range(4, 8))
    assert keep("layers.0.ffn.experts.5.w1.weight") and not keep("layers.0.ffn.experts.3.w1.weight")
    assert keep("layers.0.ffn.shared_experts.w1.weight") and keep("layers.1.ffn.gate.weight")


def test_saving_a_ranks_share_is_refused_before_anything_runs(tmp_path):
    import decode

    with pytest.raises(SystemExit, match="--save: with --ep each rank reads and holds only its own experts"):
        decode.main(["--save", str(tmp_path / "out"), "--ep", "2"])
    assert not (tmp_path / "out").exists()


def test_the_mtp_layer_is_expert_parallel_too(tmp_path):
    """With the MTP layer: built expert-parallel from the start, each rank holds its share of the MTP
    layer's experts as well, and its drafts' logits equal the sharded model's; speculative greedy
    decoding over the ranks emits the same tokens as one model whole."""
    cfg = configs.tiny(2, mtp_ratios=(0,))
    _, ckpt = runner.build(cfg, device=False, seed=1)
    path = runner.save(tmp_path / "model", cfg, ckpt)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (4, 2)).astype(np.int32)

    def mtp_logits(model):
        st = model.new_state(tokens.shape[1], history_rows=8)
        for t in tokens:
            model.feed(st, t)
        return np.asarray(st.mtp_logits[0]).astype(np.float32)

    def sharded(comm):
        model, _ = runner.build(cfg, device=False, load=str(path))
        model.parallelize(comm, ep=True)
        return mtp_logits(model)

    def from_start(comm):
        model, held = runner.build(cfg, device=False, load=str(path), expert_comm=comm)
        mine = {int(n.split(".experts.")[1].split(".")[0]) for n in held.weights if n.startswith("mtp.0.ffn.experts.")}
        assert mine == set(dist.expert_range(cfg.experts, comm))
        assert isinstance(model.mtp[0].block.moe, dist.ExpertParallelMoE)
        return mtp_logits(model)

    def speculative(comm):
        model, _ = runner.build(cfg, device=False, load=str(path), expert_comm=comm, temperature=0.0)
        st = model.new_state(2, history_rows=16)
        dec = runner.Decoder(model, st, tokens.T.copy(), speculative=True)
        dec.prefill()
        for _ in range(4):
            dec.decode_step()
        return [st.history[: st.emitted[s], s].copy() for s in range(2)]

    want, got = dist.SimulatedGroup(2).run(sharded), dist.SimulatedGroup(2).run(from_start)
    for rank in range(2):
        np.testing.assert_array_equal(got[rank], want[rank], err_msg=f"rank {rank}")
    whole, _ = runner.build(cfg, device=False, load=str(path), temperature=0.0)
    plain, _, _ = runner.run(whole, tokens.T.copy(), 9)
    for rank_tokens in dist.SimulatedGroup(2).run(speculative):
        for s, emitted in enumerate(rank_tokens):
            np.testing.assert_array_equal(emitted, plain[s, : len(emitted)])
