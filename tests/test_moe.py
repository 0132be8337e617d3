"""MoE: the routing reference on hand cases, the layer on the numpy backend (fused and unfused paths
agree exactly), and every bad configuration getting a clear error."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.layers import ExpertStack, MoE, RoutingConfig, SharedExpert
from fp4kit.reference import moe as ref
from fp4kit.reference import quant as qref
from fp4kit.runtime import status

BF16 = ml_dtypes.bfloat16


def test_top_k_ties_go_to_the_lower_index():
    v = np.array([[1.0, 3.0, 3.0, 2.0, 3.0]])
    assert ref.top_k_lowest_index_ties(v, 3).tolist() == [[1, 2, 4]]


def test_score_functions():
    z = np.array([[-2.0, 0.0, 3.0]])
    assert np.allclose(ref.scores_from_logits(z, "sigmoid"), 1 / (1 + np.exp(-z)))
    assert np.allclose(ref.scores_from_logits(z, "sqrtsoftplus"), np.sqrt(np.log1p(np.exp(z))))
    assert np.allclose(ref.scores_from_logits(z, "softmax").sum(), 1.0)
    with pytest.raises(ValueError, match="score_func"):
        ref.scores_from_logits(z, "relu")


def test_route_bias_selects_but_does_not_weigh():
    x = np.eye(4, dtype=np.float32)[:1]  # logits = first column of the gate weight
    gate = np.array([[2.0], [1.0], [0.5], [0.0]], np.float32) * np.array([[1, 0, 0, 0]], np.float32)
    bias = np.array([0, 0, 10, 0], np.float32)
    ids, w = ref.route(x, gate, top_k=2, score_func="sigmoid", bias=bias, renormalize=False)
    assert ids.tolist() == [[2, 0]]
    assert np.allclose(w, [[1 / (1 + np.exp(-0.5)), 1 / (1 + np.exp(-2.0))]])


def test_route_groups_hash_and_scale():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    gate = rng.standard_normal((16, 16)).astype(np.float32)
    ids, w = ref.route(x, gate, top_k=4, score_func="sigmoid", n_group=4, topk_group=2, routed_scale=2.5)
    assert np.allclose(w.sum(-1), 2.5, rtol=1e-6)
    assert all(len(set(row // 4)) <= 2 for row in ids)  # only two groups per token
    tid2eid = rng.integers(0, 16, (10, 4)).astype(np.int32)
    ids, _ = ref.route(x, gate, top_k=4, tid2eid=tid2eid, token_ids=np.array([7, 0, 7]))
    assert np.array_equal(ids, tid2eid[[7, 0, 7]])
    ids, _ = ref.route(x, gate, top_k=4, tid2eid=tid2eid, token_ids=np.array([10, -1, 7]))  # out of range: row 0
    assert np.array_equal(ids, tid2eid[[0, 0, 7]])


def _weights(rng, e=8, h=64, i=32):
    return (rng.standard_normal((e, h)).astype(np.float32), rng.standard_normal((e, i, h)).astype(np.float32),
            rng.standard_normal((e, i, h)).astype(np.float32) * 0.1, rng.standard_normal((e, h, i)).astype(np.float32))


def _stack(ws):
    return ExpertStack.from_tensors([qref.quantize(w) for w in ws])


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_fused_and_unfused_paths_agree_exactly(rng, mode):
    gate, w1, w3, w2 = _weights(rng)
    s1, s3, s2 = _stack(w1), _stack(w3), _stack(w2)
    assert not np.array_equal(s1.global_scale, s3.global_scale)
    routing = RoutingConfig(top_k=2, score_func="sigmoid", routed_scale=1.5)
    fused = MoE(gate, s2, routing, w13=ExpertStack.fuse_gate_up(s1, s3), limit=10.0, mode=mode)
    unfused = MoE(gate, s2, routing, w1=s1, w3=s3, limit=10.0, mode=mode)
    x = rng.standard_normal((6, 64)).astype(BF16)
    assert np.array_equal(fused(x), unfused(x))


def test_layer_matches_a_token_by_token_loop(rng):
    """The reference MoE against a plain per-token loop of the same operations."""
    gate, w1, w3, w2 = _weights(rng)
    s1, s3, s2 = _stack(w1), _stack(w3), _stack(w2)
    w13 = ExpertStack.fuse_gate_up(s1, s3)
    routing = RoutingConfig(top_k=3, score_func="sqrtsoftplus", routed_scale=1.5)
    for before in (True, False):
        layer = MoE(gate, s2, routing, w13=w13, limit=5.0, weight_before_down=before, mode="w4a16")
        x = rng.standard_normal((4, 64)).astype(BF16)
        y = layer(x).astype(np.float32)
        ids, weights = ref.route(x, gate, **vars(routing))
        from fp4kit.reference.gemm import gemm

        # the same operations token by token: the slot outputs (fp32) summed exactly in float64, one
        # fp32 and one bf16 rounding, as the layer does, so the result is equal bit for bit
        expect = np.zeros((4, 64), np.float64)
        for t in range(4):
            for j in range(3):
                e, wt = ids[t, j], weights[t, j]
                h = gemm(x[t : t + 1], w13.expert(e), None, w13.row_decode[e], BF16)
                a = qref.swiglu(h, "interleaved", 5.0, np.array([wt], np.float32) if before else None).astype(BF16)
                out = gemm(a, s2.expert(e), None, None, np.float32)[0]
                expect[t] += out if before else out * wt
        assert np.array_equal(y, expect.astype(np.float32).astype(BF16).astype(np.float32))


def test_shared_expert_is_added(rng):
    gate, w1, w3, w2 = _weights(rng)
    shared = SharedExpert.from_float(w1[0], w3[0], w2[0], mode="w4a16")
    routing = RoutingConfig(top_k=2)
    plain = MoE(gate, _stack(w2), routing, w13=ExpertStack.fuse_gate_up(_stack(w1), _stack(w3)), mode="w4a16")
    with_shared = MoE(gate, plain.w2, routing, w13=plain.w13, mode="w4a16", shared=shared)
    x = rng.standard_normal((3, 64)).astype(BF16)
    diff = with_shared(x).astype(np.float32) - plain(x).astype(np.float32)
    assert np.allclose(diff, shared(x).astype(np.float32), rtol=2e-2, atol=2e-2 * np.abs(diff).max())


def test_residual_step_after_the_layer_is_add_rmsnorm_of_its_output(rng):
    """``then_norm``: the call returns `add_rmsnorm` of the layer's output into the residual stream
    (updated in place), on numpy as the device's fused launch must (tests/test_moe_gpu.py)."""
    from fp4kit.ops import elementwise as ew

    gate, w1, w3, w2 = _weights(rng)
    layer = MoE(gate, _stack(w2), RoutingConfig(top_k=2), w13=ExpertStack.fuse_gate_up(_stack(w1), _stack(w3)),
                mode="w4a16")
    x = rng.standard_normal((3, 64)).astype(BF16)
    base = rng.standard_normal((3, 64)).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    resid, expect_resid = base.copy(), base.copy()
    got = layer(x, then_norm=ew.ResidualNorm(resid, weight, 1e-5))
    expect = ew.add_rmsnorm(expect_resid, layer(x), weight, eps=1e-5)
    assert got.dtype == BF16 and np.array_equal(got, expect)
    assert np.array_equal(resid, expect_resid) and not np.array_equal(resid, base)
    assert layer(x[:0], then_norm=ew.ResidualNorm(np.zeros((0, 64), np.float32), weight)).shape == (0, 64)


@pytest.mark.parametrize("norm, error, message", [
    ("a tuple", TypeError, "then_norm: expected a fp4kit.ops.elementwise.ResidualNorm"),
    (dict(resid=np.zeros((3, 48), np.float32)), ValueError, r"then_norm.resid: expected float32 \[2, 64\]"),
    (dict(resid=np.zeros((2, 64), BF16)), TypeError, "then_norm.resid: expected float32, got bfloat16"),
    (dict(weight=np.ones(48, np.float32)), ValueError, r"then_norm.weight: expected float32 \[64\]"),
    (dict(weight=np.ones((1, 64), np.float32)), ValueError, "then_norm.weight: expected 1 dimensions"),
])
def test_bad_residual_step(rng, norm, error, message):
    from fp4kit.ops import elementwise as ew

    gate, w1, w3, w2 = _weights(rng)
    layer = MoE(gate, _stack(w2), RoutingConfig(top_k=2), w13=ExpertStack.fuse_gate_up(_stack(w1), _stack(w3)))
    resid = np.zeros((2, 64), np.float32)
    if norm == "a tuple":
        then_norm = (resid, np.ones(64, np.float32))
    else:
        then_norm = ew.ResidualNorm(**{"resid": resid, "weight": np.ones(64, np.float32), **norm})
    with pytest.raises(error, match=message):
        layer(np.zeros((2, 64), BF16), then_norm=then_norm)
    assert not resid.any()  # nothing written before the error


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(routing=RoutingConfig(top_k=9)), "top_k: expected 1..8 for 8 experts"),
        (dict(routing=RoutingConfig(top_k=2, n_group=3, topk_group=1)), "n_group/topk_group"),
        (dict(routing=RoutingConfig(top_k=8, n_group=4, topk_group=1)), "top_k: 8 exceeds the experts"),
        (dict(bias=np.zeros(7, np.float32)), r"bias: expected float32 \[8\]"),
        (dict(tid2eid=np.full((5, 2), 8, np.int32)), r"tid2eid: expert ids must lie in \[0, 8\)"),
        (dict(tid2eid=np.zeros((5, 3), np.int32)), r"tid2eid: expected int32 \[vocab, 2\]"),
        (dict(mode="w8a8"), "mode: expected"),
    ],
)
def test_bad_configuration(rng, kwargs, message):
    gate, w1, w3, w2 = _weights(rng)
    args = dict(routing=RoutingConfig(top_k=2))
    args.update(kwargs)
    routing = args.pop("routing")
    with pytest.raises(ValueError, match=message):
        MoE(gate, _stack(w2), routing, w13=ExpertStack.fuse_gate_up(_stack(w1), _stack(w3)), **args)


def test_bad_shapes_and_inputs(rng):
    gate, w1, w3, w2 = _weights(rng)
    s1, s3, s2 = _stack(w1), _stack(w3), _stack(w2)
    with pytest.raises(ValueError, match=r"w2: expected shape \(8, 64, 32\)"):
        MoE(gate, _stack(np.zeros((8, 48, 32), np.float32)), RoutingConfig(top_k=2), w13=ExpertStack.fuse_gate_up(s1, s3))
    with pytest.raises(ValueError, match="w13: expected shape"):
        MoE(gate, s1, RoutingConfig(top_k=2), w13=ExpertStack.fuse_gate_up(s1, s3))
    with pytest.raises(ValueError, match="w13: pass either"):
        MoE(gate, s2, RoutingConfig(top_k=2))
    layer = MoE(gate, s2, RoutingConfig(top_k=2), w13=ExpertStack.fuse_gate_up(s1, s3))
    with pytest.raises(ValueError, match=r"x: expected \[tokens, 64\]"):
        layer(np.zeros((2, 48), BF16))
    with pytest.raises(TypeError, match="x: expected bfloat16 or float32"):
        layer(np.zeros((2, 64), np.float16))
    hashed = MoE(gate, s2, RoutingConfig(top_k=2), w13=layer.w13, tid2eid=np.zeros((5, 2), np.int32))
    with pytest.raises(ValueError, match="token_ids: hash routing needs"):
        hashed(np.zeros((2, 64), BF16))
    status.clear(None)
    hashed(np.zeros((2, 64), BF16), np.array([4, 0], np.int32))
    assert not status.read(None) & status.TOKEN_RANGE
    hashed(np.zeros((2, 64), BF16), np.array([5, 0], np.int32))  # vocab is 5: routed like token 0, recorded
    assert status.read(None) & status.TOKEN_RANGE
    status.clear(None)
    def raw(e, n, k):  # a stack whose K need not be a multiple of 16
        return ExpertStack(np.zeros((e, n, k // 2), np.uint8), np.zeros((e, n, k // 16), np.uint8),
                           np.ones(e, np.float32), np.ones(e, np.float32))

    with pytest.raises(ValueError, match="hidden and inner sizes must be multiples of 16"):
        MoE(np.zeros((8, 24), np.float32), raw(8, 24, 16), RoutingConfig(top_k=2), w13=raw(8, 32, 24))


def test_from_checkpoint_equals_the_same_tensors(tmp_path, rng):
    from fp4kit.checkpoint import load_nvfp4, save_nvfp4

    gate, w1, w3, w2 = _weights(rng)
    weights = {}
    for i in range(8):
        weights[f"mlp.experts.{i}.gate_proj"] = qref.quantize(w1[i])
        weights[f"mlp.experts.{i}.up_proj"] = qref.quantize(w3[i])
        weights[f"mlp.experts.{i}.down_proj"] = qref.quantize(w2[i])
    bias = rng.standard_normal(8).astype(np.float32)
    save_nvfp4(tmp_path / "model.safetensors", weights, extra={"mlp.gate.weight": gate.astype(BF16),
                                                               "mlp.e_score_correction_bias": bias})
    ckpt = load_nvfp4(tmp_path)
    routing = RoutingConfig(top_k=2, score_func="sigmoid")
    loaded = MoE.from_checkpoint(ckpt, "mlp", routing, num_experts=8, bias="e_score_correction_bias", limit=10.0)
    stacks = [ExpertStack.from_tensors([weights[f"mlp.experts.{i}.{n}"] for i in range(8)])
              for n in ("gate_proj", "up_proj", "down_proj")]
    direct = MoE(gate.astype(BF16), stacks[2], routing, w13=ExpertStack.fuse_gate_up(stacks[0], stacks[1]),
                 bias=bias, limit=10.0)
    x = rng.standard_normal((5, 64)).astype(BF16)
    assert np.array_equal(loaded(x), direct(x))
    with pytest.raises(KeyError, match="mlp.experts.0.w1"):
        MoE.from_checkpoint(ckpt, "mlp", routing, num_experts=8, names=("w1", "w3", "w2"))


def test_expert_stack_tiling_round_trips(rng):
    """The grouped GEMM's tiled stacks are exact: to_linear gives every byte back and each expert
    dequantizes to the same values."""
    from fp4kit.layers.moe import ExpertStack
    experts = [qref.quantize(rng.standard_normal((40, 96)).astype(np.float32)) for _ in range(3)]
    stack = ExpertStack.from_tensors(experts)
    tiled = stack.to_tiled()
    assert tiled.layout == "tiled" and tiled.shape == stack.shape == (3, 40, 96)
    back = tiled.to_linear()
    assert np.array_equal(back.packed, stack.packed) and np.array_equal(back.block_scales, stack.block_scales)
    for e in range(3):
        assert np.array_equal(qref.dequantize(tiled.expert(e)), qref.dequantize(experts[e]))
    with pytest.raises(ValueError, match="fuse linear stacks"):
        ExpertStack.fuse_gate_up(tiled, tiled)


# -- dispatch and combine: the device steps' specification on hand cases -------------------------------

def test_dispatch_on_a_hand_case():
    from fp4kit.reference import dist as dist_ref

    ids = np.array([[2, 0], [2, 3], [0, 2]], np.int32)
    weights = np.array([[0.5, 0.25], [1.0, 2.0], [4.0, 8.0]], np.float32)
    counts, tickets = dist_ref.tickets(ids, 4)
    assert counts.tolist() == [2, 0, 3, 1] and tickets.tolist() == [[0, 0], [1, 0], [1, 2]]
    offsets, active, slot_row, row_token, row_weight = ref.dispatch(counts, tickets, ids, weights)
    assert offsets.tolist() == [0, 2, 2, 5, 6]
    assert active.tolist() == [0, 2, 3]  # expert 1 has no pair
    assert slot_row.tolist() == [2, 0, 3, 5, 1, 4]  # expert 0 owns rows 0-1, expert 2 rows 2-4, expert 3 row 5
    assert row_token.tolist() == [0, 2, 0, 1, 2, 1]
    assert row_weight.tolist() == [0.25, 4.0, 0.5, 1.0, 8.0, 2.0]


def test_dispatch_with_tickets_in_any_order(rng):
    """The router's atomics hand out tickets in any order: rows stay in their expert's range and
    every row keeps its pair's token and weight."""
    from fp4kit.reference import dist as dist_ref

    t, k, e = 9, 3, 6
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    counts, tickets = dist_ref.tickets(ids, e)
    flat, tk = ids.reshape(-1), tickets.reshape(-1).copy()
    for x in range(e):  # shuffle the tickets within each expert
        pairs = np.nonzero(flat == x)[0]
        tk[pairs] = rng.permutation(tk[pairs])
    offsets, active, slot_row, row_token, row_weight = ref.dispatch(counts, tk.reshape(t, k), ids, weights)
    assert sorted(slot_row.tolist()) == list(range(t * k))
    assert ((offsets[flat] <= slot_row) & (slot_row < offsets[flat + 1])).all()
    assert np.array_equal(row_token[slot_row], np.arange(t * k) // k)
    assert np.array_equal(row_weight[slot_row], weights.reshape(-1))
    assert active.tolist() == sorted(set(flat.tolist()))


def test_combine_on_a_hand_case():
    y = np.array([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0], [0.5, 0.25]], np.float32)  # sorted rows
    slot_row = np.array([2, 0, 1, 3], np.uint32)  # token 0: rows 2, 0; token 1: rows 1, 3
    weights = np.array([[0.5, 2.0], [0.25, 4.0]], np.float32)
    plain = ref.combine(y, slot_row, weights, weighted=False)
    assert plain.dtype == BF16 and plain.astype(np.float32).tolist() == [[101.0, 202.0], [10.5, 20.25]]
    weighted = ref.combine(y, slot_row, weights, weighted=True)
    assert weighted.astype(np.float32).tolist() == [[52.0, 104.0], [4.5, 6.0]]
    shared = np.array([[1.0, -2.0], [0.5, 0.0]], BF16)
    assert ref.combine(y, slot_row, weights, True, shared).astype(np.float32).tolist() == [[53.0, 102.0], [5.0, 6.0]]


def test_combine_rounds_in_fp32_in_slot_order_then_once_to_bf16():
    # 1 + 2^-24 + 2^-24 in fp32 slot order is 1 (each add rounds back); in one float64 sum it is
    # 1 + 2^-23, which bf16 also rounds to 1; 1 + 2^-8 + 2^-9 shows the single bf16 rounding
    y = np.array([[1.0], [2.0**-24], [2.0**-24], [2.0**-8], [2.0**-9]], np.float32)
    out = ref.combine(y, np.array([0, 1, 2], np.uint32), np.ones((1, 3), np.float32), weighted=False)
    assert out.astype(np.float32).item() == 1.0
    out = ref.combine(y, np.array([0, 3, 4], np.uint32), np.ones((1, 3), np.float32), weighted=False)
    assert out.astype(np.float32).item() == 1.0 + 2.0**-7  # 1 + 3 * 2^-9 rounds up to the next bf16


def test_the_shared_expert_folds_into_the_small_launches_by_the_measured_rule():
    """Up to FOLD_SHARED_MAX_TOKENS tokens (8: measured faster than apart at T = 1 .. 8) and while
    the top-k slots plus the shared one fit the 8 warps of a down-projection block."""
    from fp4kit.layers import moe as moe_layer

    limit = moe_layer.FOLD_SHARED_MAX_TOKENS
    assert moe_layer.fold_shared_pays(1, 6) and moe_layer.fold_shared_pays(limit, 7)
    assert not moe_layer.fold_shared_pays(limit + 1, 6)
    assert not moe_layer.fold_shared_pays(1, 8)  # V3's top-8: nine slots


@pytest.mark.parametrize("top_k", [6, 8])
@pytest.mark.parametrize("with_shared", [True, False])
def test_w4a4_quantizes_in_the_small_launches_by_the_measured_rule(monkeypatch, top_k, with_shared):
    """W4A4 on the small-T path quantizes inside the GEMV launches up to
    QUANTIZE_IN_BLOCKS_MAX_TOKENS tokens, and only with no shared expert or a folded one (a shared
    expert run apart needs the quantized input anyway). The rule on the host, for a layer whose
    weights it takes to be on the device (the only place it applies)."""
    from fp4kit.layers import moe as moe_layer

    rng = np.random.default_rng(0)
    e, h, i = 16, 64, 32
    gate, w1, w3, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((e, h), (e, i, h), (e, i, h), (e, h, i)))
    shared = SharedExpert.from_float(w1[0], w3[0], w2[0]) if with_shared else None
    layer = MoE.from_float(gate, w1, w3, w2, RoutingConfig(top_k=top_k), shared=shared)
    monkeypatch.setattr(moe_layer.arrays, "is_device_array", lambda a: True)
    limit = moe_layer.QUANTIZE_IN_BLOCKS_MAX_TOKENS
    folds = with_shared and moe_layer.fold_shared_pays(1, top_k)
    assert layer._folds_shared(1) == folds
    assert layer._quantizes_in_blocks(1) == (folds or not with_shared)
    assert not layer._quantizes_in_blocks(limit + 1)
    # at one token, once in the last block of the launch before (QUANTIZE_IN_LAST_BLOCK)
    assert layer._quantizes_in_last_block(1) == layer._quantizes_in_blocks(1)
    assert not layer._quantizes_in_last_block(2)
    monkeypatch.setattr(moe_layer, "QUANTIZE_IN_LAST_BLOCK", False)
    assert not layer._quantizes_in_last_block(1)
    layer.mode = "w4a16"
    assert not layer._quantizes_in_blocks(1)


def test_router_quantizes_one_token_row_only():
    """`route_small`'s ``x_act`` (the router's last block quantizes x): one token, a width of 16s up
    to ROUTER_QUANTIZE_MAX_HIDDEN; refused before any launch otherwise, naming the argument."""
    from fp4kit.ops import moe as moe_ops

    cfg = RoutingConfig(top_k=2)
    for shape in ((2, 64), (1, moe_ops.ROUTER_QUANTIZE_MAX_HIDDEN + 16), (1, 40)):
        x = np.zeros(shape, np.float32)
        with pytest.raises(ValueError, match="x_act"):
            moe_ops.route_small(x, np.zeros((4, shape[1]), np.float32), None, None, None, cfg, None, None, None,
                                None, None, x_act=object())


def test_small_pairs_per_block_rule():
    """The small-T first launch: one wave of two blocks per SM where the pair groups allow it (the
    fewest pairs per block that fit), else the most pairs that leave two blocks per SM."""
    from fp4kit.ops import moe as moe_ops

    assert moe_ops.small_pairs_per_block(2048, 7, 132) == 4  # V4-Flash T = 1 (shared folded): 224 blocks
    assert moe_ops.small_pairs_per_block(2048, 8, 132) == 4  # V3 T = 1 (shared apart): 256 blocks
    assert moe_ops.small_pairs_per_block(2048, 14, 132) == 8  # T = 2: 224 blocks
    assert moe_ops.small_pairs_per_block(256, 2, 132) == 1  # few pairs: one pair per block
    assert moe_ops.small_pairs_per_block(2048, 56, 132) == 8  # T = 8: no single wave; 896 blocks
    assert moe_ops.small_pairs_per_block(2048, 64 * 7, 132) == 8


def test_grouped_pass_rows_rule(monkeypatch):
    """The sorted path's rows per pass of an expert's weights: the narrowest pass (8, 16, 32 or 64
    rows) holding a third more than the mean rows per expert, never more than the tokens, at most 32
    rows for NVFP4 activations; the knob overrides."""
    from fp4kit.ops import moe as moe_ops

    assert moe_ops.grouped_pass_rows(16, 6, 256) == 8  # V4-Flash: 0.4 rows per expert
    assert moe_ops.grouped_pass_rows(128, 6, 256) == 8  # 3 rows: 4 after the margin
    assert moe_ops.grouped_pass_rows(512, 6, 256) == 16  # 12 rows
    assert moe_ops.grouped_pass_rows(512, 8, 256) == 32  # V3: 16 rows, 21.3 with the margin
    assert moe_ops.grouped_pass_rows(4096, 6, 256) == 64  # the widest pass
    assert moe_ops.grouped_pass_rows(4096, 6, 256, nvfp4_act=True) == moe_ops.GROUPED_PASS_ROWS_NVFP4_MAX == 32
    assert moe_ops.grouped_pass_rows(512, 6, 256, nvfp4_act=True) == 16
    assert moe_ops.grouped_pass_rows(3, 4, 16) == 3  # an expert gets at most one row per token
    assert moe_ops.grouped_pass_rows(1, 1, 1) == 1
    monkeypatch.setattr(moe_ops, "GROUPED_PASS_ROWS", 32)
    assert moe_ops.grouped_pass_rows(16, 6, 256) == 32


def test_grouped_gemm_build_by_occupancy(monkeypatch):
    """GROUPED_BLOCKS_PER_SM 3 (the default) picks the three-blocks-per-SM builds of the 8- and
    16-row passes (moe.cu ``moe_gemm_*_occ3``; the wider passes spill at that bound and keep theirs),
    2 the builds of the engine's bound everywhere."""
    from fp4kit.ops import moe as moe_ops

    assert moe_ops.GROUPED_BLOCKS_PER_SM == 3
    assert [moe_ops.grouped_kernel_name(t) for t in (1, 2, 4, 8)] == [
        "moe_gemm_{}_1_occ3", "moe_gemm_{}_2_occ3", "moe_gemm_{}_4", "moe_gemm_{}_8"]
    monkeypatch.setattr(moe_ops, "GROUPED_BLOCKS_PER_SM", 2)
    assert [moe_ops.grouped_kernel_name(t) for t in (1, 2, 4, 8)] == [f"moe_gemm_{{}}_{t}" for t in (1, 2, 4, 8)]


def test_last_quantize_spread_rule(monkeypatch):
    """W4A4 at T = 1: the last `LAST_QUANTIZE_SPREAD` blocks of the gate|up launch share its output's
    quantization, never more than the grid's blocks nor half the blocks the GPU holds at once (the
    sharing blocks wait for the rest, which must find room to run), never fewer than one."""
    from fp4kit.ops import moe as moe_ops

    monkeypatch.setattr(moe_ops, "LAST_QUANTIZE_SPREAD", 8)
    assert moe_ops.last_quantize_spread(896, 924) == 8  # V4-Flash: 7 assignments x 128 one-pair blocks
    assert moe_ops.last_quantize_spread(5, 924) == 5
    assert moe_ops.last_quantize_spread(896, 10) == 5
    assert moe_ops.last_quantize_spread(896, 1) == 1
    monkeypatch.setattr(moe_ops, "LAST_QUANTIZE_SPREAD", 1)
    assert moe_ops.last_quantize_spread(896, 924) == 1  # the last block alone
    monkeypatch.setattr(moe_ops, "LAST_QUANTIZE_SPREAD", 0)
    assert moe_ops.last_quantize_spread(896, 924) == 1


def test_small_gate_up_geometry_rule(monkeypatch):
    """Up to SMALL_NARROW_MAX_TOKENS tokens 4-warp blocks: one pair each (SMALL_MANY_BLOCKS) where
    they fill one wave or their last wave at least half, else two groups in flight at the pair rule
    (SMALL_FEW_BLOCKS); 8-warp blocks above; the knob overrides all. With 4-warp blocks the pair rule
    counts their blocks per SM and never groups more pairs than warps (each pair needs a warp)."""
    from fp4kit.ops import moe as moe_ops

    many, few = moe_ops.SMALL_MANY_BLOCKS, moe_ops.SMALL_FEW_BLOCKS
    assert moe_ops.SMALL_GATE_UP_GEOMETRY[many] == (4, 7, 1) and moe_ops.SMALL_GATE_UP_GEOMETRY[few] == (4, 4, None)
    assert moe_ops.SMALL_GATE_UP_GEOMETRY["d2c1"] == (8, 2, None)
    assert all(pairs is None or 1 <= pairs <= warps for warps, _, pairs in moe_ops.SMALL_GATE_UP_GEOMETRY.values())
    # 128 one-pair blocks per assignment on 132 SMs x 7 slots = 924
    assert moe_ops.small_gate_up_variant(1, 2048, 7, 132) == many  # V4-Flash T = 1: 896 blocks, one wave
    assert moe_ops.small_gate_up_variant(1, 2048, 8, 132) == few  # V3 T = 1: 1024, a last wave of 100
    assert moe_ops.small_gate_up_variant(3, 2048, 24, 132) == few  # 3072: 300 of 924 in the last wave
    assert moe_ops.small_gate_up_variant(2, 2048, 14, 132) == many  # V4-Flash T = 2: 1792, 868 of 924
    assert moe_ops.small_gate_up_variant(4, 2048, 28, 132) == many  # T = 4: 3584, 812 of 924
    assert moe_ops.small_gate_up_variant(4, 2112, 33, 132) == many  # 4356 blocks: 4.7 waves, half or more
    assert moe_ops.small_gate_up_variant(4, 16 * 33, 28, 132) == many  # 924 blocks: one whole wave
    assert moe_ops.small_gate_up_variant(moe_ops.SMALL_NARROW_MAX_TOKENS + 1, 2048, 35, 132) == "d2c1"
    monkeypatch.setattr(moe_ops, "SMALL_GATE_UP_VARIANT", "d2c1")
    assert moe_ops.small_gate_up_variant(1, 2048, 7, 132) == "d2c1"
    assert moe_ops.small_pairs_per_block(2048, 7, 132, 4, 4) == 2  # V4-Flash T = 1: 448 blocks, one wave of 528
    assert moe_ops.small_pairs_per_block(2048, 25, 132, 4, 4) == 4  # T = 4: 800 blocks, no single wave
    assert moe_ops.small_pairs_per_block(2048, 64 * 7, 132, 4, 4) == 4  # never 8 pairs over 4 warps
    monkeypatch.setattr(moe_ops, "SMALL_PAIRS_PER_BLOCK", 8)
    assert moe_ops.small_pairs_per_block(2048, 7, 132, 4, 4) == 4


def test_router_warps_per_expert_rule():
    """The router's logits: the most warps per expert (up to 8) that leave each a slice of 512+
    inputs in whole runs of 8 and keep the grid within two blocks per SM; one warp where H has no
    such split or the tokens alone fill the GPU."""
    from fp4kit.ops import moe as moe_ops

    assert moe_ops.router_warps_per_expert(4096, 256, 1, 132) == 8  # V4-Flash T = 1: 256 blocks
    assert moe_ops.router_warps_per_expert(4096, 256, 2, 132) == 4  # 256 blocks
    assert moe_ops.router_warps_per_expert(4096, 256, 8, 132) == 1  # the measured T = 8: 256 blocks
    assert moe_ops.router_warps_per_expert(4096, 256, 64, 132) == 1
    assert moe_ops.router_warps_per_expert(7168, 256, 1, 132) == 8  # V3: 896 inputs per warp
    assert moe_ops.router_warps_per_expert(1536, 96, 1, 132) == 2
    assert moe_ops.router_warps_per_expert(1024, 8, 1, 132) == 2
    assert moe_ops.router_warps_per_expert(512, 8, 1, 132) == 1
    assert moe_ops.router_warps_per_expert(2056, 8, 1, 132) == 1  # 2056 / 2 is not whole runs of 8
    assert moe_ops.router_warps_per_expert(1000, 8, 1, 132) == 1


def test_small_whole_fetch_variant_rule(monkeypatch):
    """The small-T launches take a variant's whole-fetch build (a "w" appended) only with the knob
    on, for a variant that has one, over a K of whole scale groups (256)."""
    from fp4kit.ops import moe as moe_ops

    assert moe_ops.SMALL_WHOLE_FETCHES  # on by default
    assert moe_ops._whole_variant("d2c1", 4096) == "d2c1w"
    assert moe_ops._whole_variant("d1c2b4", 2048) == "d1c2b4w"
    assert moe_ops._whole_variant("d1c2b4", 272) == "d1c2b4"  # 5 tiles of 64: not whole groups
    assert moe_ops._whole_variant("d2c1b2", 2048) == "d2c1b2"  # no whole-fetch build
    monkeypatch.setattr(moe_ops, "SMALL_WHOLE_FETCHES", False)
    assert moe_ops._whole_variant("d2c1", 4096) == "d2c1"


@pytest.mark.parametrize("inner", [256, 80, 16])
def test_swiglu_stage_reads_the_gate_and_up_rows_of_each_output(inner):
    """The SwiGLU epilogue of the grouped GEMM (moe.cu ``swiglu_from_stage``) finds output column
    c0 + c of block bx (c0 = 64 bx) at staged row c / 16 * 32 + c % 16 of the block's 128 weight
    rows (its gate) and 16 rows on (its up): replayed here on W13's interleaving
    (`formats.interleave_rows`) of gate and up row indices, for every block and column, including
    a part-filled last block (inner 80: 160 rows, the second block 32 of them)."""
    from fp4kit.formats import interleave_rows

    gate, up = np.arange(inner)[:, None], 1000 + np.arange(inner)[:, None]
    w13_row = interleave_rows(gate, up)[:, 0]  # which gate (i) or up (1000 + i) row sits at each W13 row
    block_rows = 128
    for bx in range(-(-2 * inner // block_rows)):
        c0 = bx * block_rows // 2
        for c in range(block_rows // 2):
            if c0 + c >= inner:
                continue
            staged = bx * block_rows + c // 16 * 32 + c % 16
            assert w13_row[staged] == c0 + c and w13_row[staged + 16] == 1000 + c0 + c


def test_dispatch_of_another_calls_counts_stays_in_the_calls_rows():
    """Overlapping calls of one layer share its counters: counts summing to more or fewer than the
    call's pairs, or a ticket past its expert's count, are not this call's. The dispatch (reference
    and kernel alike) then keeps every row inside [0, P) and says so (MOE_DISPATCH)."""
    from fp4kit.reference import dist as dist_ref

    ids = np.array([[2, 0], [2, 3], [0, 2]], np.int32)
    weights = np.arange(6, dtype=np.float32).reshape(3, 2)
    counts, tickets = dist_ref.tickets(ids, 4)
    assert ref.dispatch_is_consistent(counts, tickets, ids)
    doubled = counts * 2  # a second call's router added its counts before this dispatch ran
    assert not ref.dispatch_is_consistent(doubled, tickets, ids)
    offsets, active, slot_row, row_token, row_weight = ref.dispatch(doubled, tickets, ids, weights)
    assert offsets.tolist() == [0] * 5 and active.size == 0  # no expert runs
    assert slot_row.tolist() == list(range(6))
    assert row_token.tolist() == [0, 0, 1, 1, 2, 2] and row_weight.tolist() == weights.reshape(-1).tolist()
    late = tickets.copy()
    late[0, 0] = 7  # expert 2 holds three pairs: ticket 7 is another call's
    assert not ref.dispatch_is_consistent(counts, late, ids)
    offsets, active, slot_row, _, _ = ref.dispatch(counts, late, ids, weights)
    assert offsets.tolist() == [0, 2, 2, 5, 6] and active.tolist() == [0, 2, 3]
    assert slot_row.tolist() == [5, 0, 3, 5, 1, 4]  # the off pair at the last row, the others as before


def test_status_has_the_moe_dispatch_flag():
    from fp4kit.runtime import status

    assert status.MOE_DISPATCH == 512 and "MoE dispatch" in status.FLAG_NAMES[status.MOE_DISPATCH]


def test_small_l2_ahead_rule(monkeypatch):
    """The small-T launches request weight groups into L2 ahead (`SMALL_L2_AHEAD`) only up to
    `SMALL_L2_AHEAD_MAX_TOKENS` tokens; above, none."""
    from fp4kit.ops import moe as moe_ops

    monkeypatch.setattr(moe_ops, "SMALL_L2_AHEAD", (2, 3))
    monkeypatch.setattr(moe_ops, "SMALL_L2_AHEAD_MAX_TOKENS", 4)
    assert moe_ops.small_l2_ahead(1) == moe_ops.small_l2_ahead(4) == (2, 3)
    assert moe_ops.small_l2_ahead(5) == (0, 0)
