"""The small-T MoE launches' tuning knobs on the GPU (ops/moe.py): every down-projection variant
(``SMALL_DOWN_VARIANTS``), every pair grouping of the first launch (``SMALL_PAIRS_PER_BLOCK``) and
every block geometry of it (``SMALL_GATE_UP_GEOMETRY``) gives the reference layer's output within the layer bound, bitwise the same on a repeat."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.layers import MoE, RoutingConfig, SharedExpert
from fp4kit.layers import moe as moe_layer
from fp4kit.ops import moe as moe_ops
from fp4kit.reference import gemm as gref

from test_moe_gpu import host_stack

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16
BOUND = 1e-4  # as tests/test_moe_gpu.py: fp32 summation order seen through two roundings


def build(rng, e, h, i, top_k, mode):
    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    routing = RoutingConfig(top_k=top_k, score_func="sigmoid")
    mats = [w(i, h), w(i, h), w(h, i)]
    shared = SharedExpert.from_float(*(cp.asarray(m) for m in mats), limit=10.0, mode=mode)
    gate, w1, w3, w2 = w(e, h), w(e, i, h), w(e, i, h), w(e, h, i)
    dev = MoE.from_float(cp.asarray(gate), cp.asarray(w1), cp.asarray(w3), cp.asarray(w2), routing, limit=10.0,
                         shared=shared, mode=mode)
    host_shared = SharedExpert.from_float(*mats, limit=10.0, mode=mode)
    host = MoE(gate, host_stack(dev.w2), routing, w13=host_stack(dev.w13), limit=10.0, shared=host_shared, mode=mode)
    return dev, host


def run_twice(dev, xd, want, label):
    """The layer's output for ``xd``, checked bitwise equal on a repeat and within the bound of the
    reference's ``want``."""
    got = cp.asnumpy(dev(xd))
    again = cp.asnumpy(dev(xd))
    assert np.array_equal(got.view(np.uint16), again.view(np.uint16)), label
    assert gref.calc_diff(got.astype(np.float32), want) < BOUND, label
    return got


@pytest.fixture(params=["last-block", "in-blocks", "launches"])
def quantize_where(request, monkeypatch):
    """W4A4's quantization at T = 1 in the last block of the launch before (other T: inside the
    GEMV blocks), inside the GEMV blocks at every T, or by launches of their own (W4A16 ignores it)."""
    monkeypatch.setattr(moe_layer, "QUANTIZE_IN_BLOCKS_MAX_TOKENS", 0 if request.param == "launches" else 1 << 30)
    monkeypatch.setattr(moe_layer, "QUANTIZE_IN_LAST_BLOCK", request.param == "last-block")
    return request.param


# H 4096 and 7168 (V3: 28 scale groups, so with 8 K parts the last warp's part is empty), an inner
# size of 17 pair tiles (a pair group past I with 2, 4 and 8 pairs per block), top-k 6 (the shared
# expert folded in as a 7th slot) and 8 (the shared expert apart)
@pytest.mark.parametrize("h,i,top_k", [(4096, 272, 6), (7168, 256, 8)])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_small_path_knobs_match_reference(rng, monkeypatch, quantize_where, h, i, top_k, t, mode):
    monkeypatch.setattr(moe_layer, "SMALL_MAX_ASSIGNMENTS", 1 << 30)
    dev, host = build(rng, 16, h, i, top_k, mode)
    x = rng.standard_normal((t, h)).astype(BF16)
    want = host(x).astype(np.float32)
    xd = cp.asarray(x)
    for down in moe_ops.SMALL_DOWN_VARIANTS:
        for pairs in (None, 1, 2, 4, 8):
            monkeypatch.setattr(moe_ops, "SMALL_DOWN_VARIANT", down)
            monkeypatch.setattr(moe_ops, "SMALL_PAIRS_PER_BLOCK", pairs)
            run_twice(dev, xd, want, (down, pairs))


@pytest.mark.parametrize("h,i,top_k", [(4096, 272, 6), (7168, 256, 8)])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_gate_up_block_geometries(rng, monkeypatch, quantize_where, h, i, top_k, t, mode):
    """Every first-launch block geometry (`SMALL_GATE_UP_GEOMETRY`: 8- and 4-warp blocks) at
    every pair grouping it allows: within the bound of the reference, bitwise the same on a repeat,
    and bitwise the same as the 8-warp blocks wherever a pair's K is split the same number of ways
    (the same partial sums added in the same order)."""
    monkeypatch.setattr(moe_layer, "SMALL_MAX_ASSIGNMENTS", 1 << 30)
    dev, host = build(rng, 16, h, i, top_k, mode)
    x = rng.standard_normal((t, h)).astype(BF16)
    want = host(x).astype(np.float32)
    xd = cp.asarray(x)
    by_split = {}
    for variant, (warps, *_) in moe_ops.SMALL_GATE_UP_GEOMETRY.items():
        for pairs in (None, 1, 2, 4, 8):
            if pairs is not None and pairs > warps:
                continue
            monkeypatch.setattr(moe_ops, "SMALL_GATE_UP_VARIANT", variant)
            monkeypatch.setattr(moe_ops, "SMALL_PAIRS_PER_BLOCK", pairs)
            got = run_twice(dev, xd, want, (variant, pairs))
            if pairs is not None:
                first = by_split.setdefault(warps // pairs, (variant, pairs, got))
                assert np.array_equal(got.view(np.uint16), first[2].view(np.uint16)), (variant, pairs, first[:2])
    assert len(by_split) == 4  # K in 8, 4, 2 and 1 parts


@pytest.mark.parametrize("h,i,top_k", [(4096, 256, 6), (7168, 512, 8), (4096, 272, 6)])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_whole_fetch_builds_are_bit_identical(rng, monkeypatch, quantize_where, h, i, top_k, mode):
    """The small-T launches without per-tile bounds tests (`SMALL_WHOLE_FETCHES`) over K of whole
    scale groups: the same bits as the bounds-tested builds (an I of 272 keeps those for the down
    projection), within the bound of the reference."""
    monkeypatch.setattr(moe_layer, "SMALL_MAX_ASSIGNMENTS", 1 << 30)
    dev, host = build(rng, 16, h, i, top_k, mode)
    x = rng.standard_normal((3, h)).astype(BF16)
    want = host(x).astype(np.float32)
    outs = []
    for whole in (False, True):
        monkeypatch.setattr(moe_ops, "SMALL_WHOLE_FETCHES", whole)
        outs.append(cp.asnumpy(dev(cp.asarray(x))))
    assert np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))
    assert gref.calc_diff(outs[1].astype(np.float32), want) < BOUND
