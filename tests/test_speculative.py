"""Speculative decoding with the MTP layer's drafts (`dsv4.model.Model.speculative_step`,
`runner.Decoder(speculative=True)`) on the numpy reference: with greedy sampling it emits exactly
the tokens of plain decoding whatever the drafts are (all accepted, every other one rejected, the
MTP layer's own), and leaves every layer's cache (positions, window rows, compressed entries,
compressor state) as plain decoding of the same tokens does; with sampling, the counts agree with
the positions. Drafts are forced through an oracle standing in for the MTP layer's greedy pick."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402
from dsv4 import runner  # noqa: E402

SEED = 4
PROMPT = runner.random_prompt(2, 9, 1024, seed=3)
STEPS = 7  # speculative steps after the first plain one


def config(hc: int):
    # ratios 0, 4, 128: a window-only layer, the indexer's layer and an all-entries layer, entries
    # emitted within the run (ratio 4 every 4 tokens)
    return configs.tiny(3, mtp_ratios=(0,), hc_mult=hc, window=8)


def plain_run(cfg, steps: int):
    """Greedy plain decoding: the tokens [B, steps] and the decode state."""
    model, _ = runner.build(cfg, device=False, seed=SEED, temperature=0.0)
    tokens, _, dec = runner.run(model, PROMPT, steps)
    return tokens, dec.state


def install_oracle(model, state, reference: np.ndarray, right) -> None:
    """The MTP layer's greedy pick replaced by the reference token it is drafting (or that token
    + 1 where ``right(seq, index)`` is false): the draft of generated token ``index``."""
    sampler = model.draft_sampler

    def oracle(logits, out):
        sampler(logits, out=out)  # the layer still runs; its pick is overwritten
        b = state.batch
        if logits.shape[0] == b:  # `start_speculation`: the draft of the token after the first step's
            index = [int(state.step[0])] * b
            rows = [(s, index[s]) for s in range(b)]
        else:  # a speculative step: row s drafts after the kept sample, row b + s after the second
            rows = [(s, int(state.emitted[s]) + 1) for s in range(b)] + [(s, int(state.emitted[s]) + 2)
                                                                            for s in range(b)]
        for r, (s, index) in enumerate(rows):
            want = int(reference[s, index]) if index < reference.shape[1] else 0
            out[r] = want if right(s, index) else (want + 1) % model.cfg.vocab
        return out

    model.draft_sampler = oracle


def speculative_run(cfg, reference, right=None, steps: int = STEPS, temperature: float = 0.0):
    model, _ = runner.build(cfg, device=False, seed=SEED, temperature=temperature)
    state = model.new_state(PROMPT.shape[0], history_rows=64)
    if right is not None:
        install_oracle(model, state, reference, right)
    dec = runner.Decoder(model, state, PROMPT, speculative=True)
    dec.prefill()
    for _ in range(steps + 1):
        dec.decode_step()
    return state


def live_slots(pos: int, first: int, slots: int) -> list[int]:
    """Ring slots of positions ``first .. pos - 1`` (a ring of ``slots`` indexed by position)."""
    return [p % slots for p in range(max(0, first), pos)]


def assert_same_caches(a, b):
    """Every cache of ``a`` as ``b`` where a later step can read it: positions, compressed lengths
    and entries, the window rows of the last W - 1 positions, the compressors' running state of
    the current and the previous group. (A rejected draft's rows stay in ring slots that no later
    step reads before they are overwritten.)"""
    for la, lb in zip(a.layers, b.layers):
        for name in la:
            ca, cb = la[name], lb[name]
            if not hasattr(ca, "pos"):  # the window-only layer's empty entry list
                assert np.array_equal(ca, cb), name
                continue
            assert np.array_equal(ca.pos, cb.pos), name
            for s, pos in enumerate(ca.pos.tolist()):
                rows = live_slots(pos, pos - ca.window + 1, ca.window)
                assert np.array_equal(ca.swa[s, rows], cb.swa[s, rows]), (name, s)
                if ca.ratio:
                    n, slots = int(ca.comp_len[s]), ca.kv_state.shape[1]
                    assert n == int(cb.comp_len[s]) and np.array_equal(ca.comp[s, :n], cb.comp[s, :n]), (name, s)
                    rows = live_slots(pos, (pos // ca.ratio) * ca.ratio - slots + ca.ratio, slots)
                    assert np.array_equal(ca.kv_state[s, rows], cb.kv_state[s, rows]), (name, s)
                    assert np.array_equal(ca.score_state[s, rows], cb.score_state[s, rows]), (name, s)


@pytest.mark.parametrize("hc", [1, 4])
@pytest.mark.parametrize("drafts", ["all right", "one in three wrong", "the MTP layer's"])
def test_greedy_speculative_decoding_emits_the_plain_tokens(hc, drafts):
    cfg = config(hc)
    reference, _ = plain_run(cfg, 1 + 2 * STEPS + 2)
    right = {"all right": lambda s, i: True, "one in three wrong": lambda s, i: (i + s) % 3 != 1,
             "the MTP layer's": None}[drafts]
    st = speculative_run(cfg, reference, right)
    emitted, accepted = st.emitted.copy(), st.accepted.copy()
    assert np.array_equal(emitted, 1 + STEPS + accepted)
    for s in range(PROMPT.shape[0]):
        assert np.array_equal(st.history[: emitted[s], s], reference[s, : emitted[s]]), (s, drafts)
    if drafts == "all right":
        assert (accepted == STEPS).all()
    elif drafts == "one in three wrong":  # both outcomes occur
        assert (0 < accepted).all() and (accepted < STEPS).any()
    # the caches hold what plain decoding of the same tokens leaves
    for s in range(PROMPT.shape[0]):
        _, plain = plain_run(cfg, int(emitted[s]))
        assert int(st.positions[s]) == int(plain.positions[s]) == PROMPT.shape[1] - 1 + emitted[s]
    if (emitted == emitted[0]).all():
        assert_same_caches(st, plain_run(cfg, int(emitted[0]))[1])


def test_speculative_decoding_with_the_official_activation_simulation():
    """The official configuration's parts together: four residual copies, the simulated FP8 / FP4
    activations (their entry rounding at each token's append), YaRN."""
    cfg = configs.tiny(3, mtp_ratios=(0,), hc_mult=4, window=8, head_dim=128, rope_dim=64, index_head_dim=64,
                       qat_sim=True, rope_factor=4.0, rope_original=64)
    reference, _ = plain_run(cfg, 1 + 2 * STEPS + 2)
    st = speculative_run(cfg, reference, lambda s, i: (i + s) % 3 != 1)
    assert 0 < int(st.accepted.sum()) < 2 * STEPS
    for s in range(PROMPT.shape[0]):
        n = int(st.emitted[s])
        assert np.array_equal(st.history[:n, s], reference[s, :n])
    if (st.emitted == st.emitted[0]).all():
        assert_same_caches(st, plain_run(cfg, int(st.emitted[0]))[1])


def test_a_rejected_draft_leaves_the_caches_of_plain_decoding():
    """Every draft wrong: each step keeps one token and takes the draft's rows back, including a
    compressed entry the draft completed (ratio 4: one in four steps)."""
    cfg = config(1)
    reference, _ = plain_run(cfg, 1 + STEPS)
    st = speculative_run(cfg, reference, lambda s, i: False)
    assert (st.accepted == 0).all() and (st.emitted == 1 + STEPS).all()
    assert_same_caches(st, plain_run(cfg, 1 + STEPS)[1])


def test_sampled_speculative_decoding_keeps_its_counts():
    cfg = config(4)
    reference, _ = plain_run(cfg, 1 + 2 * STEPS + 2)
    st = speculative_run(cfg, reference, lambda s, i: i % 3 != 0, temperature=1.0)
    assert np.array_equal(st.emitted, 1 + STEPS + st.accepted)
    assert np.array_equal(st.positions, PROMPT.shape[1] - 1 + st.emitted)
    for s in range(PROMPT.shape[0]):
        logged = st.history[: st.emitted[s], s]
        assert ((0 <= logged) & (logged < cfg.vocab)).all()


def test_speculation_needs_the_mtp_layer():
    model, _ = runner.build(configs.tiny(2), device=False, seed=SEED)
    with pytest.raises(ValueError, match="speculative decoding needs the MTP layer"):
        model.start_speculation(model.new_state(1))


def test_the_decode_scripts_check_covers_speculative_decoding(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import decode

    args = ["--numpy", "--batch", "2", "--prompt-len", "4", "--new-tokens", "5", "--layers", "2", "--temperature", "0"]
    assert decode.main(args + ["--check", "--speculative"]) == 0
    out = capsys.readouterr().out
    assert "check speculative numpy vs numpy again: identical tokens over 5 steps, greedy = the plain decoder's " \
           "tokens: True -> OK" in out
