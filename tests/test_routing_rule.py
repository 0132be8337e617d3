"""DeepSeek routing checked against the published rule, written here independently of
`fp4kit.reference.moe.route` (token by token, plain Python over float64):

* V3 ("noaux_tc"): selection scores = sigmoid(logits) + bias; the experts form ``n_group`` groups;
  a group scores the sum of its two largest selection scores; the ``topk_group`` best groups stay;
  the ``top_k`` best selection scores among their experts are chosen; the weights are the
  *unbiased* scores of the chosen experts, divided by their sum, times ``routed_scale``.
* softmax routing: the weights are the softmax probabilities over all experts of the chosen ids
  (renormalized over the top-k or not).

Ties (measure zero with random inputs) go to the lower index. The numpy reference is compared
here; the device router is bit-exact against it (tests/test_moe_gpu.py) and is also compared with
this rule directly when a GPU is present.
"""

import math

import numpy as np
import pytest

from fp4kit.layers.moe import RoutingConfig
from fp4kit.reference import moe as ref


def published_route(logits, bias, *, top_k, score_func, n_group=1, topk_group=1, renormalize=True,
                     routed_scale=1.0):
    """Expert ids (descending selection score) and weights per token, following the rule above."""
    ids_out, w_out = [], []
    for row, in zip(np.asarray(logits, np.float64)):
        e = len(row)
        if score_func == "sigmoid":
            scores = [1.0 / (1.0 + math.exp(-z)) for z in row]
        elif score_func == "softmax":
            top = max(row)
            ex = [math.exp(z - top) for z in row]
            scores = [v / math.fsum(ex) for v in ex]
        else:  # sqrtsoftplus (V4)
            scores = [math.sqrt(math.log1p(math.exp(z))) if z < 30 else math.sqrt(z) for z in row]
        sel = [s + (0.0 if bias is None else float(b)) for s, b in zip(scores, bias if bias is not None else [0] * e)]
        eligible = range(e)
        if n_group > 1:
            size = e // n_group
            group_score = []
            for g in range(n_group):
                best_two = sorted(sel[g * size:(g + 1) * size], reverse=True)[:2]
                group_score.append(best_two[0] + best_two[1])
            kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
            eligible = [i for g in sorted(kept) for i in range(g * size, (g + 1) * size)]
        chosen = sorted(eligible, key=lambda i: (-sel[i], i))[:top_k]
        w = [scores[i] for i in chosen]
        if renormalize:
            total = math.fsum(w)
            w = [v / total for v in w]
        ids_out.append(chosen)
        w_out.append([v * routed_scale for v in w])
    return np.array(ids_out, np.int64), np.array(w_out, np.float64)


V3 = RoutingConfig(top_k=8, score_func="sigmoid", n_group=8, topk_group=4, routed_scale=2.5)
SOFTMAX = RoutingConfig(top_k=6, score_func="softmax")
SOFTMAX_RAW = RoutingConfig(top_k=6, score_func="softmax", renormalize=False, routed_scale=1.5)


def inputs(rng, t, e, h=64, bias_scale=0.1):
    x = rng.standard_normal((t, h)).astype(np.float32)
    gate = (rng.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32)
    bias = (rng.standard_normal(e) * bias_scale).astype(np.float32)
    return x, gate, bias


def logits_of(x, gate):
    return np.asarray(x, np.float64) @ np.asarray(gate, np.float64).T


@pytest.mark.parametrize("routing,e", [(V3, 256), (V3, 64), (SOFTMAX, 256), (SOFTMAX_RAW, 72),
                                       (RoutingConfig(top_k=1, score_func="sigmoid", n_group=4, topk_group=1), 20)])
def test_reference_follows_the_published_rule(rng, routing, e):
    x, gate, bias = inputs(rng, 200, e)
    bias = bias if routing.score_func != "softmax" else None
    ids, w = ref.route(x, gate, bias=bias, **vars(routing))
    want_ids, want_w = published_route(logits_of(x, gate), bias, **vars(routing))
    assert np.array_equal(ids, want_ids)
    assert np.allclose(w, want_w, rtol=2e-7, atol=0)  # the reference rounds the weights to fp32 once


def test_v3_groups_decide_the_selection(rng):
    """A token whose single best expert sits in a group with a weak second is not routed there, and
    the grouped choice differs from a plain top-k: the check sees the group rule, not just top-k."""
    e, groups, size = 64, 8, 8
    logits = np.full((1, e), -4.0)
    logits[0, 3] = 6.0                        # group 0: the best expert, but its runner-up is weak
    for g in range(1, 5):                      # groups 1-4: two good experts each
        logits[0, g * size:g * size + 2] = [2.0, 1.9]
    cfg = dict(top_k=4, score_func="sigmoid", n_group=groups, topk_group=4)
    ids, _ = published_route(logits, None, **cfg)
    plain, _ = published_route(logits, None, **{**cfg, "n_group": 1})
    assert 3 in plain[0] and 3 not in ids[0]
    assert set(ids[0] // size) <= {1, 2, 3, 4}
    # the reference on the same logits (gate = identity, x = the logits as fp32)
    got, _ = ref.route(logits.astype(np.float32), np.eye(e, dtype=np.float32), **cfg)
    assert np.array_equal(got, ids)


def test_v3_bias_selects_but_the_weights_are_unbiased(rng):
    x, gate, _ = inputs(rng, 50, 64)
    bias = np.zeros(64, np.float32)
    bias[::7] = 5.0  # every 7th expert is forced into the selection where its group survives
    ids, w = ref.route(x, gate, bias=bias, **vars(RoutingConfig(top_k=4, score_func="sigmoid", n_group=4,
                                                                 topk_group=2, routed_scale=2.5)))
    want_ids, want_w = published_route(logits_of(x, gate), bias, top_k=4, score_func="sigmoid", n_group=4,
                                       topk_group=2, routed_scale=2.5)
    assert np.array_equal(ids, want_ids) and np.allclose(w, want_w, rtol=2e-7)
    unbiased = 1.0 / (1.0 + np.exp(-np.take_along_axis(logits_of(x, gate), ids.astype(np.int64), -1)))
    assert np.allclose(w, 2.5 * unbiased / unbiased.sum(-1, keepdims=True), rtol=2e-7)


def test_softmax_weights_are_the_probabilities_of_the_chosen_experts(rng):
    x, gate, _ = inputs(rng, 40, 32)
    logits = logits_of(x, gate)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids, w = ref.route(x, gate, **vars(SOFTMAX_RAW))
    assert np.array_equal(ids, np.argsort(-probs, axis=-1, kind="stable")[:, :6])
    assert np.allclose(w, 1.5 * np.take_along_axis(probs, ids.astype(np.int64), -1), rtol=2e-7)
    ids, w = ref.route(x, gate, **vars(SOFTMAX))
    chosen = np.take_along_axis(probs, ids.astype(np.int64), -1)
    assert np.allclose(w, chosen / chosen.sum(-1, keepdims=True), rtol=2e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", [V3, SOFTMAX, SOFTMAX_RAW])
def test_device_router_follows_the_published_rule(rng, routing):
    cp = pytest.importorskip("cupy")
    from fp4kit.ops import moe as moe_ops

    t, e = 64, 256
    x, gate, bias = inputs(rng, t, e, h=256)
    bias = bias if routing.score_func != "softmax" else np.zeros(e, np.float32)
    ids = cp.empty((t, routing.top_k), cp.int32)
    weights = cp.empty((t, routing.top_k), cp.float32)
    moe_ops.route(cp.asarray(x), cp.asarray(gate), cp.asarray(bias), None, None, routing, ids, weights,
                  cp.zeros(e, cp.uint32), cp.empty((t, routing.top_k), cp.uint32), cp.empty((t, e), cp.float32))
    want_ids, want_w = published_route(logits_of(x, gate), bias, **vars(routing))
    assert np.array_equal(cp.asnumpy(ids), want_ids)
    # the device computes logits and scores in fp32: weights agree to fp32 rounding of those steps
    assert np.allclose(cp.asnumpy(weights), want_w, rtol=2e-5, atol=0)
