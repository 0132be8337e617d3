"""The MoE layer on the GPU against the numpy reference: routing (ids exactly, weights to fp32
rounding) for DeepSeek shapes, the whole layer (calc_diff), adversarial routing, hash routing, the
fused and unfused paths, and the layer captured in a CUDA graph replayed with new inputs."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.layers import ExpertStack, MoE, RoutingConfig, SharedExpert
from fp4kit.layers import moe as moe_layer
from fp4kit.ops import elementwise as ew
from fp4kit.ops import moe as moe_ops
from fp4kit.reference import gemm as gref
from fp4kit.reference import moe as ref
from fp4kit.runtime import status

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16
BOUND = 1e-4  # kernel vs reference differ by fp32 summation order, seen through two roundings


def host_stack(s: ExpertStack) -> ExpertStack:
    """The device stack on the host, in the checkpoint layout (the layer keeps it tiled)."""
    host = ExpertStack(*(None if a is None else cp.asnumpy(a) for a in
                         (s.packed, s.block_scales, s.global_scale, s.decode, s.row_decode)), layout=s.layout, nk=s.nk)
    return host.to_linear()


def build(rng, e, h, i, routing, host_shared=None, **kwargs):
    gate = (rng.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32)
    w1 = cp.asarray((rng.standard_normal((e, i, h)) / np.sqrt(h)).astype(np.float32))
    w3 = cp.asarray((rng.standard_normal((e, i, h)) / np.sqrt(h)).astype(np.float32))
    w2 = cp.asarray((rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32))
    dev_kwargs = {k: (cp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    dev = MoE.from_float(cp.asarray(gate), w1, w3, w2, routing, **dev_kwargs)
    host_kwargs = {k: (cp.asnumpy(v) if isinstance(v, cp.ndarray) else v) for k, v in kwargs.items()}
    if host_shared is not None:  # the same shared expert with host weights
        host_kwargs["shared"] = host_shared
    host = MoE(gate, host_stack(dev.w2), routing, w13=host_stack(dev.w13), **host_kwargs)
    return dev, host


@pytest.fixture(params=["small", "small-quantize-launches", "small-shared-apart", "sorted", "sorted-swiglu-epilogue",
                        "sorted-shared-folded"])
def path(request, monkeypatch):
    """Both device paths of the layer at every T: the small-T GEMVs over the (token, slot)
    assignments (a shared expert folded in as one more expert, or run apart; W4A4 quantized in
    the GEMV blocks or by launches of their own), and the expert-sorted grouped GEMMs (W4A16 with
    the SwiGLU in the gate|up GEMM's epilogue or in a launch of its own, a shared expert folded
    into the grouped GEMMs or run apart)."""
    monkeypatch.setattr(moe_layer, "SMALL_MAX_ASSIGNMENTS", 1 << 30 if request.param.startswith("small") else 0)
    monkeypatch.setattr(moe_layer, "GROUPED_SWIGLU_EPILOGUE", request.param in ("sorted-swiglu-epilogue",
                                                                              "sorted-shared-folded"))
    monkeypatch.setattr(moe_layer, "GROUPED_FOLD_SHARED", request.param == "sorted-shared-folded")
    monkeypatch.setattr(moe_layer, "GROUPED_FOLD_SHARED_MAX_TOKENS", 1 << 30)
    # the last sorted variant takes every fusion of the path: the dispatch in the router and the
    # combine in the down GEMM too
    monkeypatch.setattr(moe_layer, "ROUTER_DISPATCH_MAX_PAIRS", 1 << 30 if request.param == "sorted-shared-folded" else 0)
    monkeypatch.setattr(moe_layer, "GROUPED_COMBINE_IN_GEMM", request.param == "sorted-shared-folded")
    monkeypatch.setattr(moe_layer, "FOLD_SHARED", request.param != "small-shared-apart")
    monkeypatch.setattr(moe_layer, "QUANTIZE_IN_BLOCKS_MAX_TOKENS", 0 if request.param == "small-quantize-launches" else 1 << 30)
    return request.param


V4 = RoutingConfig(top_k=6, score_func="sqrtsoftplus", routed_scale=1.5)
V3 = RoutingConfig(top_k=8, score_func="sigmoid", n_group=8, topk_group=4, routed_scale=2.5)


@pytest.mark.parametrize("routing", [V4, V3, RoutingConfig(top_k=6, score_func="softmax", renormalize=False)])
@pytest.mark.parametrize("t", [1, 3, 64, 512])
def test_routing_matches_reference(rng, routing, t):
    # H of 8, 2 and 1 warps per expert's logits (moe.py `router_warps_per_expert`), one with a partial run
    for e, h in ((256, 4096), (256, 7168), (96, 1536), (8 * routing.n_group if routing.n_group > 1 else 8, 256)):
        if routing.top_k > e:
            continue
        gate = (rng.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32)
        bias = rng.standard_normal(e).astype(np.float32) * 0.1
        x = rng.standard_normal((t, h)).astype(BF16)
        ids, weights, counts = route_on_device(x, gate, bias, routing)
        assert_routing_matches(ids, weights, x, gate, bias, routing)
        assert int(counts.sum()) == t * routing.top_k


def route_on_device(x, gate, bias, routing):
    """The sorted path's router (`moe_ops.route`) on host inputs: ids, weights (host) and the
    per-expert counts (device)."""
    t, e = x.shape[0], gate.shape[0]
    ids = cp.empty((t, routing.top_k), cp.int32)
    weights = cp.empty((t, routing.top_k), cp.float32)
    counts = cp.zeros(e, cp.uint32)
    tickets = cp.empty((t, routing.top_k), cp.uint32)
    logits = cp.empty((t, e), cp.float32)
    moe_ops.route(cp.asarray(x), cp.asarray(gate), cp.asarray(bias), None, None, routing, ids, weights, counts,
                  tickets, logits)
    return cp.asnumpy(ids), cp.asnumpy(weights), counts


@pytest.mark.parametrize("routing", [V4, V3])
@pytest.mark.parametrize("t", [1, 64])
def test_routing_breaks_exact_ties_toward_the_lower_expert(rng, routing, t):
    """Experts 32..63 copy the gate rows and biases of experts 0..31, so every score is tied exactly
    with another expert's (the same fp32 arithmetic): the top-k takes the lower id first and the
    higher one only after it, as the reference does (V3: the tied groups g and g + 4 too)."""
    e, h = 64, 1024
    half = (rng.standard_normal((e // 2, h)) / np.sqrt(h)).astype(np.float32)
    gate = np.concatenate([half, half])
    bias = np.tile(rng.standard_normal(e // 2).astype(np.float32) * 0.1, 2)
    x = rng.standard_normal((t, h)).astype(BF16)
    got, weights, _ = route_on_device(x, gate, bias, routing)
    for row in got:
        picked = list(row)
        for j in (j for j in picked if j >= e // 2):
            assert j - e // 2 in picked and picked.index(j - e // 2) < picked.index(j), row
    assert_routing_matches(got, weights, x, gate, bias, routing)


def assert_routing_matches(ids, weights, x, gate, bias, routing, tie=1e-6):
    """The kernel's ids equal the float64 reference's slot for slot, except where the reference's
    own selection scores of the two experts are tied within fp32 resolution (``tie``, relative to
    the row's largest): the kernel computes logits and scores in fp32, so such a pair may come out
    in either order, or either one at the k-th place (seen: 0.19718749 vs 0.1971875 swapped at
    T = 512). Such rows must be rare; their weights are the reference's weights of the experts the
    kernel chose (a tie at the k-th place between experts of different bias selects another score,
    so the renormalized weights differ from the reference row's: seen at T = 512, row 488), the
    other rows' weights equal the reference's slot for slot."""
    ref_ids, ref_w = ref.route(x, gate, bias=bias, **vars(routing))
    differ = (ids != ref_ids).any(-1)
    if differ.any():
        logits = x.astype(np.float64) @ gate.astype(np.float64).T
        scores = ref.scores_from_logits(logits, routing.score_func)
        sel = scores + bias.astype(np.float64)
        for r in np.nonzero(differ)[0]:
            slots = ids[r] != ref_ids[r]
            gap = np.abs(sel[r, ids[r][slots]] - sel[r, ref_ids[r][slots]])
            assert (gap <= tie * np.abs(sel[r]).max()).all(), (r, ids[r], ref_ids[r], gap)
            chosen = scores[r, ids[r]]
            if routing.renormalize:
                chosen = chosen / chosen.sum()
            assert np.allclose(weights[r], chosen * routing.routed_scale, rtol=1e-5, atol=1e-7), r
        assert differ.sum() <= max(1, len(ids) // 100), f"{differ.sum()} of {len(ids)} rows differ"
    assert np.allclose(weights[~differ], ref_w[~differ], rtol=1e-5, atol=1e-7)


def assert_layer_matches(dev, host, x):
    """The device layer's output against the reference layer's on the rows routed to the same
    experts, routing checked by `assert_routing_matches`: a tie at the k-th place within fp32
    resolution may route a row elsewhere (seen at T = 512 over 256 experts: the 6th and 7th scores
    of a row 5.5e-8 apart relative, the row's output then off, calc_diff 2.5e-4 over the layer)."""
    e = host.gate_weight.shape[0]
    bias = np.zeros(e, np.float32) if host.bias is None else np.asarray(host.bias, np.float32)
    ids, weights = (cp.asnumpy(a) for a in dev.route(cp.asarray(x)))
    assert_routing_matches(ids, weights, x, host.gate_weight, bias, host.routing)
    same_experts = (np.sort(ids, -1) == np.sort(host.route(x)[0], -1)).all(-1)
    assert same_experts.sum() >= len(x) - max(1, len(x) // 100)
    y = cp.asnumpy(dev(cp.asarray(x))).astype(np.float32)
    assert gref.calc_diff(y[same_experts], host(x).astype(np.float32)[same_experts]) < BOUND


@pytest.mark.parametrize("t", [1, 3, 64, 512])
def test_layer_matches_reference_256_experts(rng, path, t):
    dev, host = build(rng, 256, 256, 128, V4, limit=10.0)
    assert_layer_matches(dev, host, rng.standard_normal((t, 256)).astype(BF16))


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("t", [1, 64])
def test_layer_matches_reference_wide(rng, path, t, mode):
    dev, host = build(rng, 8, 4096, 512, RoutingConfig(top_k=6, score_func="sigmoid"), limit=10.0,
                      weight_before_down=False, mode=mode)
    assert_layer_matches(dev, host, rng.standard_normal((t, 4096)).astype(BF16))


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("t", [1, 5, 64])
@pytest.mark.parametrize("shared_inner", [256, 128])
def test_layer_with_a_shared_expert_matches_reference(rng, path, mode, t, shared_inner):
    """A shared expert with its own clamp: of the layer's inner size (folded into the small-T
    launches up to `FOLD_SHARED_MAX_TOKENS` tokens) or not (run apart on every path)."""
    e, h, i = 32, 512, 256
    ws = [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)
          for s in ((shared_inner, h), (shared_inner, h), (h, shared_inner))]
    dev_shared = SharedExpert.from_float(*(cp.asarray(w) for w in ws), limit=7.0, mode=mode)
    host_shared = SharedExpert.from_float(*ws, limit=7.0, mode=mode)
    dev, host = build(rng, e, h, i, V4, limit=10.0, mode=mode, shared=dev_shared, host_shared=host_shared)
    folds = shared_inner == i and (path in ("small", "small-quantize-launches") and t <= moe_layer.FOLD_SHARED_MAX_TOKENS
                                   or path == "sorted-shared-folded" and mode == "w4a16")
    assert dev._folds_shared(t) == folds
    assert dev._quantizes_in_blocks(t) == (mode == "w4a4" and folds and path != "small-quantize-launches")
    assert_layer_matches(dev, host, (rng.standard_normal((t, h)) * 2).astype(BF16))


@pytest.mark.parametrize("t", [2, 5, 8, 9, 19])
def test_folded_shared_expert_rows_equal_single_token_calls(rng, monkeypatch, t):
    """A folded shared expert's gate|up blocks take up to 8 tokens, one per MMA column (the
    routed blocks repeat their one token there): in W4A16 every launch of the small-T path is per
    token, so each output row is bit for bit the layer's output for that token alone, whichever
    column and block (9 and 19 tokens: two and three blocks, the last part-filled) it took."""
    monkeypatch.setattr(moe_layer, "SMALL_MAX_ASSIGNMENTS", 1 << 30)
    monkeypatch.setattr(moe_layer, "FOLD_SHARED_MAX_TOKENS", 1 << 30)
    # the same K split (summation order) at every T: one block geometry, one pair grouping
    monkeypatch.setattr(moe_ops, "SMALL_GATE_UP_VARIANT", "d2c1")
    monkeypatch.setattr(moe_ops, "SMALL_PAIRS_PER_BLOCK", 2)
    ws = [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in ((256, 512), (256, 512), (512, 256))]
    shared = SharedExpert.from_float(*(cp.asarray(w) for w in ws), limit=7.0, mode="w4a16")
    dev, _ = build(rng, 32, 512, 256, V4, limit=10.0, mode="w4a16", shared=shared)
    assert dev._folds_shared(t) and dev._folds_shared(1)
    x = cp.asarray((rng.standard_normal((t, 512)) * 2).astype(BF16))
    y = dev(x).copy()
    assert float(cp.abs(y.astype(cp.float32)).max()) > 0
    for i in range(t):
        alone = dev(x[i:i + 1])
        assert cp.array_equal(y[i:i + 1].view(cp.uint16), alone.view(cp.uint16)), f"token {i} of {t}"


@pytest.mark.parametrize("x_dtype", [BF16, np.float32])
@pytest.mark.parametrize("t", [1, 3, 8])
def test_in_block_quantization_equals_the_quantize_launches(rng, monkeypatch, x_dtype, t):
    """W4A4 on the small-T path: quantizing the input and the SwiGLU output inside the GEMV blocks
    (from the previous launch's maxima) gives the quantize kernels' codes and scales, so the
    layer's output is bit for bit that of the path with quantize launches; the folded shared
    expert's rows keep their own global scale (a large input row checks the per-token amax). A
    shared expert up to the tokens it is folded for; past them none (one run apart turns the
    in-block quantization off)."""
    monkeypatch.setattr(moe_layer, "SMALL_MAX_ASSIGNMENTS", 1 << 30)
    monkeypatch.setattr(moe_layer, "QUANTIZE_IN_LAST_BLOCK", False)  # the in-block path at T = 1 too
    ws = [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in ((256, 512), (256, 512), (512, 256))]
    shared = SharedExpert.from_float(*(cp.asarray(w) for w in ws), limit=7.0)
    folded = t <= moe_layer.FOLD_SHARED_MAX_TOKENS
    dev, _ = build(rng, 32, 512, 256, V4, limit=10.0, shared=shared if folded else None)
    x = rng.standard_normal((t, 512)).astype(np.float32)
    x[-1] *= 40
    x = cp.asarray(x.astype(x_dtype))
    dev.quantize_in_blocks_max_tokens = 1 << 30
    assert dev._quantizes_in_blocks(t) and dev._folds_shared(t) == folded
    in_blocks = dev(x).copy()
    dev.quantize_in_blocks_max_tokens = 0
    launches = dev(x)
    assert cp.array_equal(in_blocks.view(cp.uint16), launches.view(cp.uint16))


@pytest.mark.parametrize("x_dtype", [BF16, np.float32])
@pytest.mark.parametrize("h, with_shared", [(512, True), (512, False), (7168, True)])
@pytest.mark.parametrize("spread", [1, 8, 10**6])
def test_last_block_quantization_equals_the_quantize_launches(rng, monkeypatch, x_dtype, h, with_shared, spread):
    """W4A4 at T = 1: the router's last block quantizes the input and the gate|up launch's last
    blocks the SwiGLU output (the routed rows and a folded shared expert's, each with its own global
    scale; the last block alone, the last 8 in shares, or every block of the grid), then
    NVFP4-activation GEMV launches read them: the codes, scales and global scales of the quantize
    launches, so the layer's output is bit for bit that path's, and again on a second call (the
    arrival counter is back at zero). 7168 columns: two 16-value blocks per router thread."""
    monkeypatch.setattr(moe_layer, "QUANTIZE_IN_LAST_BLOCK", True)
    monkeypatch.setattr(moe_ops, "LAST_QUANTIZE_SPREAD", spread)
    i = 256
    ws = [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in ((i, h), (i, h), (h, i))]
    shared = SharedExpert.from_float(*(cp.asarray(w) for w in ws), limit=7.0) if with_shared else None
    dev, _ = build(rng, 32, h, i, V4, limit=10.0, shared=shared)
    x = rng.standard_normal((1, h)).astype(np.float32)
    x[0, 5] = 300.0  # the global scale comes from this one value
    x = cp.asarray(x.astype(x_dtype))
    assert dev._quantizes_in_last_block(1) and dev._folds_shared(1) == with_shared
    first = dev(x).copy()
    plan = dev._plan(x)
    assert int(plan.h_done[0]) == 0
    codes = [cp.asnumpy(a).copy() for a in (plan.x_act.packed, plan.x_act.block_scales, plan.h_act.packed,
                                             plan.h_act.block_scales)]
    again = dev(x).copy()
    dev.quantize_in_blocks_max_tokens = 0
    assert not dev._quantizes_in_last_block(1)
    launches = dev(x)
    ref = dev._plan(x)
    assert np.array_equal(codes[0], cp.asnumpy(ref.x_act.packed)) and np.array_equal(codes[1], cp.asnumpy(ref.x_act.block_scales))
    assert np.array_equal(codes[2], cp.asnumpy(ref.h_act.packed)) and np.array_equal(codes[3], cp.asnumpy(ref.h_act.block_scales))
    assert float(plan.x_act.global_scale) == float(ref.x_act.global_scale)
    assert float(plan.h_act.global_scale) == float(ref.h_act.global_scale)
    if with_shared:
        assert cp.array_equal(plan.hs_act.packed, ref.hs_act.packed)
        assert float(plan.hs_act.global_scale) == float(ref.hs_act.global_scale)
    assert float(cp.abs(first.astype(cp.float32)).max()) > 0
    assert cp.array_equal(first.view(cp.uint16), launches.view(cp.uint16))
    assert cp.array_equal(first.view(cp.uint16), again.view(cp.uint16))


@pytest.mark.parametrize("h, e", [(512, 32), (4096, 256)])
@pytest.mark.parametrize("t", [1, 3, 8])
def test_shared_expert_beside_the_router_gives_the_same_bits(rng, monkeypatch, capture_stream, h, e, t):
    """W4A16, a folded shared expert: the router launch releases the gate|up launch after its own
    wait and the shared expert's blocks, first in launch order, run without waiting
    (`SHARED_EXPERT_BESIDE_ROUTER`). Eager and in a CUDA graph (where the launches overlap), with
    new inputs at each replay, the output is bit for bit that of the launches in order, and
    matches the reference layer."""
    monkeypatch.setattr(moe_layer, "SMALL_MAX_ASSIGNMENTS", 1 << 30)
    i = 256
    ws = [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in ((i, h), (i, h), (h, i))]
    dev_shared = SharedExpert.from_float(*(cp.asarray(w) for w in ws), limit=7.0, mode="w4a16")
    host_shared = SharedExpert.from_float(*ws, limit=7.0, mode="w4a16")
    dev, host = build(rng, e, h, i, V4, limit=10.0, mode="w4a16", shared=dev_shared, host_shared=host_shared)
    assert dev._folds_shared(t)
    released = []
    route_small = moe_ops.route_small
    monkeypatch.setattr(moe_ops, "route_small", lambda *a, **k: released.append(route_small(*a, **k)) or released[-1])

    def in_order(xn):  # the output's bits with the launches in order, on the host
        monkeypatch.setattr(moe_layer, "SHARED_EXPERT_BESIDE_ROUTER", False)
        out = cp.asnumpy(dev(cp.asarray(xn))).view(np.uint16)
        monkeypatch.setattr(moe_layer, "SHARED_EXPERT_BESIDE_ROUTER", True)
        assert released[-1] is False
        return out

    xn = (rng.standard_normal((t, h)) * 2).astype(BF16)
    beside = cp.asnumpy(dev(cp.asarray(xn))).view(np.uint16)
    assert released[-1] is True
    assert np.abs(beside.view(BF16).astype(np.float32)).max() > 0
    assert np.array_equal(beside, in_order(xn))
    assert_layer_matches(dev, host, xn)
    x = cp.zeros((t, h), BF16)
    y = dev(x)
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        dev(x)
        graph = stream.end_capture()
    assert released[-1] is True
    for _ in range(3):
        xn = (rng.standard_normal((t, h)) * 2).astype(BF16)
        x.set(xn, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        got = cp.asnumpy(y).view(np.uint16)
        with cp.cuda.Stream(non_blocking=True):
            assert np.array_equal(got, in_order(xn))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize("ahead", [(1, 2), (3, 7), (50, 50)])
def test_l2_requests_ahead_give_the_same_bits(rng, monkeypatch, mode, t, ahead):
    """The small-T launches' warps requesting weight groups into L2 ahead of their loads
    (`SMALL_L2_AHEAD`; 50: past every warp's last group, the requests stop at its range): the
    layer's output bit for bit that without, with a folded shared expert, K of whole groups (512)
    and not (272: the last group part-filled)."""
    monkeypatch.setattr(moe_layer, "SMALL_MAX_ASSIGNMENTS", 1 << 30)
    monkeypatch.setattr(moe_ops, "SMALL_L2_AHEAD_MAX_TOKENS", 1 << 30)
    for h, i in ((512, 256), (272, 144)):
        ws = [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in ((i, h), (i, h), (h, i))]
        shared = SharedExpert.from_float(*(cp.asarray(w) for w in ws), limit=7.0, mode=mode)
        dev, _ = build(rng, 32, h, i, V4, limit=10.0, mode=mode, shared=shared)
        assert dev._small(t)
        x = cp.asarray((rng.standard_normal((t, h)) * 2).astype(BF16))
        monkeypatch.setattr(moe_ops, "SMALL_L2_AHEAD", (0, 0))
        base = cp.asnumpy(dev(x)).view(np.uint16)
        monkeypatch.setattr(moe_ops, "SMALL_L2_AHEAD", ahead)
        got = cp.asnumpy(dev(x)).view(np.uint16)
        assert np.abs(base.view(BF16).astype(np.float32)).max() > 0
        assert np.array_equal(got, base), (h, i)


def test_routed_ids_are_those_of_the_last_call(rng, path):
    """`MoE.routed_ids` (what the decode benchmark counts experts from) on either path."""
    dev, _ = build(rng, 32, 256, 128, V4, limit=10.0)
    x = cp.asarray(rng.standard_normal((3, 256)).astype(BF16))
    assert dev.routed_ids(3) is None
    dev(x)
    got = cp.asnumpy(dev.routed_ids(3))
    assert got.shape == (3, V4.top_k) and np.array_equal(got, cp.asnumpy(dev.route(x)[0]))


def test_adversarial_routing(rng, path):
    e, h, i = 32, 256, 128
    bias = np.zeros(e, np.float32)
    bias[5] = 1e3  # every token picks expert 5 first; most experts get nothing
    dev, host = build(rng, e, h, i, RoutingConfig(top_k=6, score_func="sigmoid"), bias=bias)
    for t in (1, 300):
        x = rng.standard_normal((t, h)).astype(BF16)
        y = cp.asnumpy(dev(cp.asarray(x))).astype(np.float32)
        assert gref.calc_diff(y, host(x).astype(np.float32)) < BOUND
    # all experts hit, and hash routing
    tid2eid = rng.integers(0, e, (1000, 6)).astype(np.int32)
    dev_h, host_h = build(rng, e, h, i, RoutingConfig(top_k=6), tid2eid=cp.asarray(tid2eid))
    tokens = rng.integers(0, 1000, 256).astype(np.int32)
    x = rng.standard_normal((256, h)).astype(BF16)
    ids, _ = dev_h.route(cp.asarray(x), cp.asarray(tokens))
    assert np.array_equal(cp.asnumpy(ids), tid2eid[tokens])
    y = cp.asnumpy(dev_h(cp.asarray(x), cp.asarray(tokens))).astype(np.float32)
    assert gref.calc_diff(y, host_h(x, tokens).astype(np.float32)) < BOUND
    # token ids outside [0, vocab) route like token 0 and are recorded, never read out of bounds
    status.clear(0)
    bad = tokens.copy()
    bad[[3, 77]] = [1 << 30, -5]
    ids, _ = dev_h.route(cp.asarray(x), cp.asarray(bad))
    assert np.array_equal(cp.asnumpy(ids), tid2eid[np.where((bad >= 0) & (bad < 1000), bad, 0)])
    assert status.read(0) & status.TOKEN_RANGE
    status.clear(0)


@pytest.mark.parametrize("t", [1, 3, 63, 64, 65, 4096])
@pytest.mark.parametrize("e, k, routing_kw", [(24, 1, dict(score_func="sigmoid")),           # E not a power of two, top-1
                                              (40, 6, dict(score_func="sqrtsoftplus")),
                                              (48, 4, dict(score_func="sigmoid", n_group=4, topk_group=2))])
def test_odd_shapes_match_reference(rng, path, t, e, k, routing_kw):
    """Expert counts that are not powers of two, top-1, and token counts around the kernels' tile
    edges (63/64/65) up to 4096: the same layer on both backends. Routing as the other routing
    tests check it: slot for slot but for pairs tied within fp32 resolution (seen at T = 4096:
    scores 0.80464011 and 0.80464013 in float64 came out swapped); the outputs on the rows routed
    to the same experts (a tie at the k-th place routes a row elsewhere, checked by its gap)."""
    dev, host = build(rng, e, 128, 64, RoutingConfig(top_k=k, **routing_kw))
    assert_layer_matches(dev, host, rng.standard_normal((t, 128)).astype(BF16))


def test_all_tokens_to_one_expert_and_repeat_runs_bitwise(rng, path):
    """Every token routed to the same expert (top-1, a dominant bias): one expert gets all rows, the
    others none; repeated calls give the same bits."""
    e = 16
    bias = np.zeros(e, np.float32)
    bias[11] = 1e3
    dev, host = build(rng, e, 256, 128, RoutingConfig(top_k=1, score_func="sigmoid"), bias=bias)
    for t in (1, 65, 1000):
        x = rng.standard_normal((t, 256)).astype(BF16)
        ids, _ = dev.route(cp.asarray(x))
        assert (cp.asnumpy(ids) == 11).all()
        first = dev(cp.asarray(x)).copy()
        assert gref.calc_diff(cp.asnumpy(first).astype(np.float32), host(x).astype(np.float32)) < BOUND
        for _ in range(2):
            again = dev(cp.asarray(x))
            assert cp.array_equal(first.view(cp.uint16), again.view(cp.uint16))


def test_fused_and_unfused_agree_on_device(rng, path):
    e, h, i = 16, 512, 256
    from fp4kit.ops.quant import quantize

    w1 = ExpertStack.from_tensors([quantize(cp.asarray(rng.standard_normal((i, h)).astype(np.float32))) for _ in range(e)])
    w3 = ExpertStack.from_tensors([quantize(cp.asarray(rng.standard_normal((i, h)).astype(np.float32) * 0.1)) for _ in range(e)])
    w2 = ExpertStack.from_tensors([quantize(cp.asarray(rng.standard_normal((h, i)).astype(np.float32))) for _ in range(e)])
    gate = cp.asarray(rng.standard_normal((e, h)).astype(np.float32))
    fused = MoE(gate, w2, V4, w13=ExpertStack.fuse_gate_up(w1, w3), limit=10.0)
    unfused = MoE(gate, w2, V4, w1=w1, w3=w3, limit=10.0)
    x = cp.asarray(rng.standard_normal((40, h)).astype(BF16))
    assert cp.array_equal(fused(x).view(cp.uint16), unfused(x).view(cp.uint16))


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_layers_share_the_sorted_paths_intermediates(rng, mode, monkeypatch):
    """Two layers on the expert-sorted path write their gate|up, SwiGLU and expert outputs into one
    buffer each (not one per layer and token count); called in turn, each gives what it gives alone,
    and a larger token count grows the buffer without moving the smaller plan's view."""
    monkeypatch.setattr(moe_layer, "SMALL_MAX_ASSIGNMENTS", 0)
    a, _ = build(rng, 16, 256, 128, V4, mode=mode)
    b, _ = build(rng, 16, 256, 128, V4, mode=mode)
    x = cp.asarray(rng.standard_normal((64, 256)).astype(BF16))
    alone = [a(x).copy(), b(x).copy()]
    for _ in range(2):
        for layer, want in zip((a, b), alone):
            assert cp.array_equal(layer(x).view(cp.uint16), want.view(cp.uint16))
    plan_a, plan_b = a._plan(x), b._plan(x)
    # shared: the expert outputs y, the gate|up output h (none where W4A16 runs SwiGLU in the
    # gate|up GEMM's epilogue, GROUPED_SWIGLU_EPILOGUE) and the bf16 SwiGLU output h_act (W4A16)
    held = ["y"] + (["h"] if plan_a.h is not None else []) + (["h_act"] if mode == "w4a16" else [])
    assert ("h" in held) == (mode == "w4a4" or not moe_layer.GROUPED_SWIGLU_EPILOGUE)
    assert all(getattr(plan_a, n).data.ptr == getattr(plan_b, n).data.ptr for n in held)
    assert plan_a.out.data.ptr != plan_b.out.data.ptr  # each layer's output stays its own
    big = cp.asarray(rng.standard_normal((4096, 256)).astype(BF16))
    b(big)
    assert a._plan(x).y.data.ptr == plan_a.y.data.ptr  # the small plan's buffer kept alive
    assert cp.array_equal(a(x).view(cp.uint16), alone[0].view(cp.uint16))


def test_layer_in_a_cuda_graph(rng, path, capture_stream):
    e, h, i, t = 64, 512, 256, 16
    shared = SharedExpert.from_float(*(cp.asarray((rng.standard_normal(s) / 16).astype(np.float32))
                                       for s in ((i, h), (i, h), (h, i))), limit=10.0)
    dev, _ = build(rng, e, h, i, V4, limit=10.0, shared=shared)
    x = cp.zeros((t, h), BF16)
    y = dev(x)  # eager first call: compiles, allocates the layer's buffers
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        dev(x)
        graph = stream.end_capture()
    for _ in range(3):
        xn = rng.standard_normal((t, h)).astype(BF16)
        x.set(xn, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        got = cp.asnumpy(y).astype(np.float32)
        with cp.cuda.Stream(non_blocking=True):
            expect = cp.asnumpy(dev(cp.asarray(xn)).copy()).astype(np.float32)
        assert gref.calc_diff(got, expect) == 0  # replay = eager, bit for bit


# -- the residual step in the layer's last launch (``then_norm``) --------------------------------------

def _residual(base, aligned: bool):
    """``base`` on the device as the residual stream: 16-byte aligned rows (the step's quad layout)
    or a view one element off (channel by channel, as `add_rmsnorm` takes such rows)."""
    if aligned:
        return cp.asarray(base)
    view = cp.empty(base.size + 1, cp.float32)[1:].reshape(base.shape)
    view.set(base)
    return view


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("t", [1, 3, 8, 64])
@pytest.mark.parametrize("aligned", [True, False])
def test_residual_step_in_the_last_launch_gives_the_bits_of_its_own_launch(rng, path, monkeypatch, mode, t, aligned):
    """`MoE(x, then_norm=...)` (`FUSE_RESIDUAL_NORM`: the step in the combine's block of each token
    on the sorted path; its own launch on the small-T path and with the combine in the down GEMM)
    returns the bits of the layer's output then `add_rmsnorm`, and leaves the residual stream with
    the same bits, in either thread layout of the row, call after call."""
    monkeypatch.setattr(moe_layer, "FUSE_RESIDUAL_NORM", True)
    e, h, i = 32, 2048, 256
    ws = [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in ((i, h), (i, h), (h, i))]
    shared = SharedExpert.from_float(*(cp.asarray(w) for w in ws), limit=7.0, mode=mode)
    dev, _ = build(rng, e, h, i, V4, limit=10.0, mode=mode, shared=shared)
    weight = cp.asarray(rng.uniform(0.5, 1.5, h).astype(np.float32))
    for _ in range(2):
        x = cp.asarray((rng.standard_normal((t, h)) * 2).astype(BF16))
        base = (rng.standard_normal((t, h)) * 3).astype(np.float32)
        apart, fused = _residual(base, aligned), _residual(base, aligned)
        assert ew.quad_rows(h, apart) == aligned
        want = ew.add_rmsnorm(apart, dev(x), weight, eps=1e-5)
        got = dev(x, then_norm=ew.ResidualNorm(fused, weight, 1e-5))
        assert got.shape == (t, h) and got.dtype == BF16
        assert cp.array_equal(got.view(cp.uint16), want.view(cp.uint16))
        assert cp.array_equal(fused.view(cp.uint32), apart.view(cp.uint32))
        assert not cp.array_equal(fused, cp.asarray(base))


def test_residual_step_in_a_cuda_graph(rng, path, monkeypatch, capture_stream):
    """The layer with its residual step captured once and replayed with new inputs and residual
    streams equals the eager layer then `add_rmsnorm`, bit for bit."""
    monkeypatch.setattr(moe_layer, "FUSE_RESIDUAL_NORM", True)
    e, h, i, t = 64, 1024, 256, 4
    dev, _ = build(rng, e, h, i, V4, limit=10.0)
    weight = cp.asarray(rng.uniform(0.5, 1.5, h).astype(np.float32))
    x, resid = cp.zeros((t, h), BF16), cp.zeros((t, h), cp.float32)
    dev(x, then_norm=ew.ResidualNorm(resid, weight))  # eager first call: compiles, allocates the layer's buffers
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        y = dev(x, then_norm=ew.ResidualNorm(resid, weight))
        graph = stream.end_capture()
    for _ in range(3):
        xn, rn = rng.standard_normal((t, h)).astype(BF16), rng.standard_normal((t, h)).astype(np.float32)
        x.set(xn, stream=stream)
        resid.set(rn, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        with cp.cuda.Stream(non_blocking=True) as side:
            r = cp.asarray(rn)
            want = ew.add_rmsnorm(r, dev(cp.asarray(xn)), weight)
            side.synchronize()
        assert cp.array_equal(y.view(cp.uint16), want.view(cp.uint16))
        assert cp.array_equal(resid.view(cp.uint32), r.view(cp.uint32))


# -- dispatch and combine kernels against their specification (fp4kit.reference.moe) -----------------

def _plan_buffers(e, pairs):
    """The dispatch outputs, poisoned (0xFF bytes) so that an unwritten entry shows."""
    from types import SimpleNamespace

    full = lambda n, dt: cp.full(n, 0xFFFFFFFF, cp.uint32).view(dt)  # noqa: E731
    return SimpleNamespace(offsets=full(e + 1, cp.uint32), active=full(e, cp.uint32), num_active=full(1, cp.uint32),
                           slot_row=full(pairs, cp.uint32), row_token=full(pairs, cp.uint32),
                           row_weight=full(pairs, cp.float32))


@pytest.mark.parametrize("t, k, e", [(1, 6, 256), (37, 6, 64), (300, 8, 256), (5, 2, 1024)])
def test_dispatch_kernel_matches_reference(rng, t, k, e):
    from fp4kit.reference import dist as dist_ref

    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    ids[: t // 2, 0] = 3  # a hot expert
    weights = rng.random((t, k)).astype(np.float32)
    counts, tickets = dist_ref.tickets(ids, e)
    d_counts = cp.asarray(counts)
    plan = _plan_buffers(e, t * k)
    moe_ops.dispatch(d_counts, cp.asarray(tickets), cp.asarray(ids), cp.asarray(weights), k, plan)
    assert_plan_equals(plan, ref.dispatch(counts, tickets, ids, weights))
    assert int(d_counts.sum()) == 0  # zeroed for the next call


@pytest.mark.parametrize("case", ["counts of two calls", "a ticket of another call"])
def test_dispatch_of_another_calls_counts_records_it_and_stays_in_bounds(rng, case):
    """Two overlapping calls of one layer share its counters: the dispatch then records
    MOE_DISPATCH, runs no expert (counts off) or sends the off pair to the last row (a ticket off),
    and every row it writes lies inside the call's buffers: the reference's plan, where a row has
    one pair."""
    from fp4kit.reference import dist as dist_ref
    from fp4kit.runtime import status

    t, k, e = 37, 6, 64
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    counts, tickets = dist_ref.tickets(ids, e)
    if case == "counts of two calls":
        counts = counts * 2
    else:
        tickets = tickets.copy()
        tickets[3, 2] = 10_000
    assert not ref.dispatch_is_consistent(counts, tickets, ids)
    plan = _plan_buffers(e, t * k)
    d_counts = cp.asarray(counts)
    status.clear()
    moe_ops.dispatch(d_counts, cp.asarray(tickets), cp.asarray(ids), cp.asarray(weights), k, plan)
    offsets, active, slot_row, row_token, row_weight = ref.dispatch(counts, tickets, ids, weights)
    assert status.read() & status.MOE_DISPATCH
    status.clear()
    assert np.array_equal(cp.asnumpy(plan.offsets), offsets)
    n = int(plan.num_active.get()[0])
    assert n == active.size and np.array_equal(cp.asnumpy(plan.active[:n]), active)
    assert np.array_equal(cp.asnumpy(plan.slot_row), slot_row) and slot_row.max() < t * k
    once = np.bincount(slot_row, minlength=t * k) == 1
    assert np.array_equal(cp.asnumpy(plan.row_token)[once], row_token[once])
    assert np.array_equal(cp.asnumpy(plan.row_weight)[once], row_weight[once])
    assert int(d_counts.sum()) == 0  # zeroed for the next call


def assert_plan_equals(plan, want):
    """The device dispatch's outputs equal the reference's (offsets, active, slot_row, row_token,
    row_weight) bit for bit."""
    offsets, active, slot_row, row_token, row_weight = want
    assert np.array_equal(cp.asnumpy(plan.offsets), offsets)
    n = int(plan.num_active.get()[0])
    assert n == active.size and np.array_equal(cp.asnumpy(plan.active[:n]), active)
    assert np.array_equal(cp.asnumpy(plan.slot_row), slot_row)
    assert np.array_equal(cp.asnumpy(plan.row_token), row_token)
    assert cp.asnumpy(plan.row_weight).tobytes() == row_weight.tobytes()


@pytest.mark.parametrize("t, k, routing, e", [(1, 6, V4, 256), (40, 6, V4, 64), (300, 8, V3, 256),
                                          (33, 8, RoutingConfig(top_k=8, score_func="sigmoid"), 1024)])
def test_router_last_block_dispatch_matches_reference(rng, t, k, routing, e):
    """``route(..., dispatch_into=)``: the router's last block runs the dispatch (256 threads, four
    experts each): bit for bit the plan the reference dispatch makes from the router's own ids,
    tickets and weights (up to 2400 pairs: several turns of its loop); counts and the arrival
    counter back to zero, so a second call in a row is right too."""
    from fp4kit.reference import dist as dist_ref

    h = 256
    gate = cp.asarray((rng.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32))
    counts, done = cp.zeros(e, cp.uint32), cp.zeros(1, cp.uint32)
    for _ in range(2):
        x = cp.asarray(rng.standard_normal((t, h)).astype(BF16))
        ids, weights, tickets = cp.empty((t, k), cp.int32), cp.empty((t, k), cp.float32), cp.empty((t, k), cp.uint32)
        plan = _plan_buffers(e, t * k)
        moe_ops.route(x, gate, None, None, None, routing, ids, weights, counts, tickets, cp.empty((t, e), cp.float32),
                      dispatch_into=(plan, done))
        h_ids, h_tickets, h_weights = (cp.asnumpy(a) for a in (ids, tickets, weights))
        assert_plan_equals(plan, ref.dispatch(dist_ref.tickets(h_ids, e)[0], h_tickets, h_ids, h_weights))
        assert int(counts.sum()) == 0 and int(done[0]) == 0


@pytest.mark.parametrize("t, in_router", [(40, False), (40, True), (300, True)])
def test_dispatch_after_the_device_router_is_a_consistent_plan(rng, monkeypatch, t, in_router):
    """Tickets from the router's atomics come in any order: every pair still gets a row of its
    expert's range, each row once, with the pair's token and weight; by the dispatch launch or by
    the router's last block (`ROUTER_DISPATCH_MAX_PAIRS`)."""
    e, h, i = 64, 512, 256
    monkeypatch.setattr(moe_layer, "ROUTER_DISPATCH_MAX_PAIRS", 1 << 30 if in_router else 0)
    dev, _ = build(rng, e, h, i, V4, limit=10.0)
    dev.small_max_assignments = 0  # the sorted path: the one with a dispatch
    x = cp.asarray(rng.standard_normal((t, h)).astype(BF16))
    ids, weights = (cp.asnumpy(a) for a in dev.route(x))
    plan = dev._plan(x)  # the plan the call above filled (one per token count)
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=e)
    offsets = cp.asnumpy(plan.offsets)
    slot_row = cp.asnumpy(plan.slot_row).astype(np.int64)
    assert np.array_equal(offsets, np.concatenate([[0], np.cumsum(counts)]))
    assert sorted(slot_row.tolist()) == list(range(t * V4.top_k))
    assert ((offsets[flat] <= slot_row) & (slot_row < offsets[flat + 1])).all()
    assert np.array_equal(cp.asnumpy(plan.row_token)[slot_row], np.arange(t * V4.top_k) // V4.top_k)
    assert cp.asnumpy(plan.row_weight)[slot_row].tobytes() == weights.reshape(-1).tobytes()


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("with_shared", [None, "bf16", "fp32 rows"])
@pytest.mark.parametrize("t, k, h", [(1, 6, 4096), (33, 8, 7168), (64, 2, 16)])
def test_combine_kernel_matches_reference(rng, weighted, with_shared, t, k, h):
    """The combine in slot order, plus a shared expert's bf16 output, or a folded shared expert's
    fp32 rows (`shared_rows`), rounded to bf16 as its dense GEMM would round them."""
    pairs = t * k
    y = (rng.standard_normal((pairs, h)) * rng.lognormal(0, 2, (pairs, 1))).astype(np.float32)
    slot_row = rng.permutation(pairs).astype(np.uint32)
    weights = rng.random((t, k)).astype(np.float32)
    rows = rng.standard_normal((t, h)).astype(np.float32) if with_shared else None
    want = ref.combine(y, slot_row, weights, weighted, None if rows is None else rows.astype(BF16))
    out = cp.full((t, h), 0x4B4B, cp.uint16).view(BF16)  # poison: a finite value
    moe_ops.combine(cp.asarray(y), cp.asarray(slot_row), cp.asarray(weights), weighted,
                    cp.asarray(rows.astype(BF16)) if with_shared == "bf16" else None, out,
                    shared_rows=cp.asarray(rows) if with_shared == "fp32 rows" else None)
    assert np.array_equal(cp.asnumpy(out).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("pass_rows", [8, 16])
def test_three_blocks_per_sm_builds_give_the_same_bits(rng, monkeypatch, mode, pass_rows):
    """The grouped GEMM's ``_occ3`` builds (GROUPED_BLOCKS_PER_SM 3, the default) are the same
    arithmetic under a tighter register bound: the sorted path's output bit for bit that of the
    two-blocks-per-SM builds, with experts over one pass and over several."""
    dev, _ = build(rng, 32, 512, 256, V4, limit=10.0, mode=mode)
    dev.small_max_assignments = 0  # the sorted path
    monkeypatch.setattr(moe_ops, "GROUPED_PASS_ROWS", pass_rows)
    x = cp.asarray((rng.standard_normal((96, 512)) * 2).astype(BF16))  # 18 rows per expert on average
    monkeypatch.setattr(moe_ops, "GROUPED_BLOCKS_PER_SM", 2)
    want = dev(x).copy()
    monkeypatch.setattr(moe_ops, "GROUPED_BLOCKS_PER_SM", 3)
    got = dev(x)
    assert float(cp.abs(want.astype(cp.float32)).max()) > 0
    assert cp.array_equal(got.view(cp.uint16), want.view(cp.uint16))


@pytest.mark.parametrize("routing, before, limit", [(V4, True, 10.0), (V3, False, None)])
@pytest.mark.parametrize("pass_rows, inner", [(8, 256), (16, 80), (64, 256)])
@pytest.mark.parametrize("blocks_per_sm", [2, 3])
def test_swiglu_in_the_grouped_gemm_epilogue_gives_the_same_bits(rng, monkeypatch, swiglu_epilogue_launches, routing,
                                                                 before, limit, pass_rows, inner, blocks_per_sm):
    """``moe_gemm_swiglu_bf16_*`` (GROUPED_SWIGLU_EPILOGUE): the sorted path's output bit for bit
    that of the grouped GEMM into h followed by the SwiGLU launch, with experts over one pass and
    several, a partial last block of 128 weight rows (inner 80: 160 W13 rows), with and without
    the clamp and the routing weight before the down projection, at both occupancy builds."""
    dev, _ = build(rng, 32, 512, inner, routing, limit=limit, weight_before_down=before, mode="w4a16")
    dev.small_max_assignments = 0  # the sorted path
    monkeypatch.setattr(moe_ops, "GROUPED_PASS_ROWS", pass_rows)
    monkeypatch.setattr(moe_ops, "GROUPED_BLOCKS_PER_SM", blocks_per_sm)
    monkeypatch.setattr(moe_layer, "GROUPED_SWIGLU_EPILOGUE", False)  # the SwiGLU launch first
    x = cp.asarray((rng.standard_normal((96, 512)) * 2).astype(BF16))  # 18 rows per expert on average
    want = dev(x).copy()
    epilogues = swiglu_epilogue_launches(moe_ops)
    monkeypatch.setattr(moe_layer, "GROUPED_SWIGLU_EPILOGUE", True)
    got = dev(x)
    assert epilogues == [True, False]  # gate|up with the SwiGLU, then down
    assert float(cp.abs(want.astype(cp.float32)).max()) > 0
    assert cp.array_equal(got.view(cp.uint16), want.view(cp.uint16))


@pytest.mark.parametrize("t, pass_rows", [(5, 8), (32, 8), (96, 16), (300, 64)])
def test_shared_expert_folded_into_the_grouped_gemms(rng, monkeypatch, t, pass_rows):
    """GROUPED_FOLD_SHARED: the shared expert rides in the sorted path's two grouped GEMMs as one
    more expert (its rows after the routed ones, passes of its own, its own clamp) and in the
    combine, so it makes no launch of its own; the layer's output is the unfolded layer's to the
    summation order of the shared expert's GEMMs (several passes over its weights at 96 and 300
    tokens), and within the bound of the numpy layer."""
    ws = [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in ((256, 512), (256, 512), (512, 256))]
    dev_shared = SharedExpert.from_float(*(cp.asarray(w) for w in ws), limit=7.0, mode="w4a16")
    host_shared = SharedExpert.from_float(*ws, limit=7.0, mode="w4a16")
    dev, host = build(rng, 32, 512, 256, V4, limit=10.0, mode="w4a16", shared=dev_shared, host_shared=host_shared)
    dev.small_max_assignments = 0  # the sorted path
    monkeypatch.setattr(moe_ops, "GROUPED_PASS_ROWS", pass_rows)
    monkeypatch.setattr(moe_layer, "GROUPED_SWIGLU_EPILOGUE", True)
    monkeypatch.setattr(moe_layer, "GROUPED_FOLD_SHARED", False)
    monkeypatch.setattr(moe_layer, "GROUPED_FOLD_SHARED_MAX_TOKENS", 1 << 30)
    x_host = (rng.standard_normal((t, 512)) * 2).astype(BF16)
    x = cp.asarray(x_host)
    apart = dev(x).copy()
    calls = []
    grouped, shared_call = moe_ops.grouped_gemm, SharedExpert.__call__
    monkeypatch.setattr(moe_ops, "grouped_gemm", lambda *a, **kw: (calls.append(kw.get("dense") is not None),
                                                                    grouped(*a, **kw))[1])
    monkeypatch.setattr(SharedExpert, "__call__", lambda *a, **kw: (calls.append("shared apart"), shared_call(*a, **kw))[1])
    monkeypatch.setattr(moe_layer, "GROUPED_FOLD_SHARED", True)
    assert dev._folds_shared(t)
    folded = dev(x)
    assert calls == [True, True]  # gate|up and down, each with the shared expert; no launch of its own
    assert float(cp.abs(apart.astype(cp.float32)).max()) > 0
    got = cp.asnumpy(folded).astype(np.float32)
    assert gref.calc_diff(got, cp.asnumpy(apart).astype(np.float32)) < 1e-5
    assert gref.calc_diff(got, host(x_host).astype(np.float32)) < BOUND


@pytest.mark.parametrize("mode, shared", [("w4a16", None), ("w4a16", "apart"), ("w4a16", "folded"), ("w4a4", "apart")])
@pytest.mark.parametrize("routing, before", [(V4, True), (V3, False)])
@pytest.mark.parametrize("pass_rows", [8, 64])
def test_combine_in_the_down_gemm_gives_the_same_bits(rng, monkeypatch, mode, shared, routing, before, pass_rows):
    """GROUPED_COMBINE_IN_GEMM (``moe_gemm_combine_*``): the block whose rows complete a token's
    slots in a column group adds them as the combine launch does, so the layer's output is bit for
    bit that of the combine launch: with the routing weight in the combine (V3) or before the down
    projection (V4), with no shared expert, one run apart or one folded into the grouped GEMMs,
    with experts over one pass or several; twice in a row (the arrival counts are left zero)."""
    ws = [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in ((256, 512), (256, 512), (512, 256))]
    sh = None if shared is None else SharedExpert.from_float(*(cp.asarray(w) for w in ws), limit=7.0, mode=mode)
    dev, _ = build(rng, 32, 512, 256, routing, limit=10.0, weight_before_down=before, mode=mode, shared=sh)
    dev.small_max_assignments = 0  # the sorted path
    monkeypatch.setattr(moe_ops, "GROUPED_PASS_ROWS", pass_rows)
    monkeypatch.setattr(moe_layer, "GROUPED_SWIGLU_EPILOGUE", shared == "folded")
    monkeypatch.setattr(moe_layer, "GROUPED_FOLD_SHARED", shared == "folded")
    monkeypatch.setattr(moe_layer, "GROUPED_FOLD_SHARED_MAX_TOKENS", 1 << 30)
    assert dev._folds_shared(96) == (shared == "folded")
    xs = [cp.asarray((rng.standard_normal((96, 512)) * 2).astype(BF16)) for _ in range(2)]
    want = [dev(x).copy() for x in xs]
    launches = []
    combine = moe_ops.combine
    monkeypatch.setattr(moe_ops, "combine", lambda *a, **kw: (launches.append(1), combine(*a, **kw))[1])
    monkeypatch.setattr(moe_layer, "GROUPED_COMBINE_IN_GEMM", True)
    for x, w in zip(xs, want):
        got = dev(x)
        assert float(cp.abs(w.astype(cp.float32)).max()) > 0
        assert cp.array_equal(got.view(cp.uint16), w.view(cp.uint16))
    assert not launches  # no combine launch
