"""Shared checks of the example decoder's numpy model (examples/dsv4)."""

import numpy as np


def assert_prefill_equals_feeding(model, prompt, history: int = 8):
    """``model.prefill`` of ``prompt [B, T]`` gives the logits of feeding it token by token, bit for
    bit; returns the fed state for further checks."""
    batched = np.asarray(model.prefill(model.new_state(prompt.shape[0], history), prompt)).astype(np.float32)
    st = model.new_state(prompt.shape[0], history)
    for j in range(prompt.shape[1]):
        fed = np.asarray(model.feed(st, prompt[:, j])).astype(np.float32)
    np.testing.assert_array_equal(batched, fed)
    return st
