"""`dsv4.memory`: the weights and KV caches counted from a configuration's shapes equal the bytes
of a built (numpy) model's checkpoint and decode state, for every layer kind."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402
from dsv4 import memory, runner  # noqa: E402
from fp4kit.layers import KVCache  # noqa: E402


@pytest.mark.parametrize("overrides", [{}, {"hc_mult": 4}])
def test_counts_equal_a_built_model(overrides):
    cfg = configs.tiny(4, max_context=512, **overrides)  # ratios 0, 4, 128 and hash-routed layers
    model, ckpt = runner.build(cfg, device=False, seed=0)
    weights = sum(int(w.packed.nbytes + w.block_scales.nbytes + w.global_scale.nbytes) for w in ckpt.weights.values())
    weights += sum(int(a.nbytes) for a in ckpt.extra.values())
    assert sum(memory.weight_bytes(cfg).values()) == weights
    state = model.new_state(3)
    caches = 0
    for layer in state.layers:
        for part in layer.values():
            if isinstance(part, KVCache):  # its position bias and norm weight are the checkpoint's arrays
                caches += sum(int(a.nbytes) for name, a in vars(part).items()
                              if isinstance(a, np.ndarray) and name not in ("ape", "norm_weight"))
            else:
                caches += int(part.nbytes)
    assert memory.kv_cache_bytes(cfg, 3) == caches


def test_experts_split_over_ranks():
    cfg = configs.tiny(2)
    whole, halves = memory.weight_bytes(cfg), memory.weight_bytes(cfg, ep=2)
    assert halves["routed experts"] * 2 == whole["routed experts"]
    assert {k: v for k, v in halves.items() if k != "routed experts"} == \
        {k: v for k, v in whole.items() if k != "routed experts"}
    with pytest.raises(ValueError, match="ep: expected 1 to 8"):
        memory.weight_bytes(cfg, ep=9)
