"""benchmarks/fp8_peer.py, the MoE benchmark's FP8 peer, computes the layer: on the CPU (its GEMMs
as the same products in fp32) its output matches a float64 computation of the layer from the
peer's dequantized FP8 weights within the error of FP8 activations, for the routing weight before
and after the down projection, and a wrong dispatch would not. Needs PyTorch (skipped without)."""

import numpy as np
import pytest

from fp4kit.layers import RoutingConfig

torch = pytest.importorskip("torch")
from benchmarks.fp8_peer import Fp8MoePeer, random_weights  # noqa: E402

H, I, E, K, T = 64, 32, 6, 2, 5


def reference(peer, x, ids):
    """float64: dequantized FP8 weights, unquantized activations, the peer's routing rule."""
    x = x.double()
    logits = x @ peer.gate.double().t()
    scores = torch.sqrt(torch.nn.functional.softplus(logits))
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * peer.routing.routed_scale

    def expert(weights, xr, factor=None):
        w13, s13, w2, s2 = (v.double() for v in weights)
        h = xr @ (w13 * s13.t()).t()
        g, u = h[:, :I], h[:, I:]
        g, u = g.clamp(max=peer.limit), u.clamp(-peer.limit, peer.limit)
        a = torch.nn.functional.silu(g) * u
        if factor is not None:
            a = a * factor[:, None]
        return a @ (w2 * s2.t()).t()

    out = expert(peer.shared, x)
    for t in range(T):
        for s in range(K):
            e = int(ids[t, s])
            if peer.before:
                out[t] += expert(peer.experts[e], x[t:t + 1], w[t, s:s + 1])[0]
            else:
                out[t] += w[t, s] * expert(peer.experts[e], x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("before", [True, False])
def test_fp8_peer_computes_the_layer(before):
    rng = np.random.default_rng(0)
    xs = [torch.tensor(rng.standard_normal((T, H)), dtype=torch.bfloat16) for _ in range(2)]
    ids = [np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(2)]
    gate = torch.tensor(rng.standard_normal((E, H)) / 8, dtype=torch.float32)
    routing = RoutingConfig(top_k=K, score_func="sqrtsoftplus", routed_scale=1.5)
    weights = random_weights(torch, H, I, "cpu", seed=0)
    peer = Fp8MoePeer(torch, xs, ids, gate, routing, weights, random_weights(torch, H, I, "cpu", seed=100)(0),
                      limit=10.0, before=before)
    assert set(peer.experts) == {int(v) for a in ids for v in a.ravel()}
    for j in range(2):
        got = peer.forward(j).double()
        want = reference(peer, xs[j], torch.tensor(ids[j], dtype=torch.long))
        err = float(((got - want) ** 2).mean().sqrt() / (want ** 2).mean().sqrt())
        assert err < 0.05, err  # FP8 activations: a few percent
        wrong = reference(peer, xs[j], torch.tensor(np.roll(ids[j], 1, axis=0), dtype=torch.long))
        assert float(((got - wrong) ** 2).mean().sqrt() / (wrong ** 2).mean().sqrt()) > 0.2  # a wrong dispatch shows
