"""Bad inputs on the numpy backend: configuration errors raise with the argument's name and what
was expected; bad *data* (values that live in device memory on the GPU path and are never read
back) is recorded in the status word, exactly where the device records it, and the call returns."""

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.formats import Nvfp4Tensor
from fp4kit.layers import KVCache, Linear, MoE, RoutingConfig, SharedExpert, SparseAttention
from fp4kit.runtime import status

BF16 = ml_dtypes.bfloat16
E, H, I = 8, 64, 32
HOST = -1  # the numpy path records in the host word: read it alone (no GPU has ordinal -1)


def _f32(v):
    return np.asarray(np.float32(v))


def _moe_weights(rng):
    return (rng.standard_normal((E, H)).astype(np.float32), rng.standard_normal((E, I, H)).astype(np.float32),
            rng.standard_normal((E, I, H)).astype(np.float32), rng.standard_normal((E, H, I)).astype(np.float32))


# -- silently wrong before: now recorded (data) -------------------------------------------------------

@pytest.mark.parametrize("scale", [0.0, -300.0, np.nan, np.inf, -np.inf])
def test_quantize_with_an_invalid_static_scale_is_recorded(rng, scale):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    fp4kit.quantize(x, global_scale=_f32(scale))
    assert not fp4kit.check_finite(HOST)
    status.clear(HOST)
    fp4kit.swiglu_quantize(rng.standard_normal((4, 64)).astype(np.float32), global_scale=_f32(scale))
    assert not fp4kit.check_finite(HOST)


def test_quantize_with_a_valid_static_scale_records_nothing(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    for scale in (300.0, np.finfo(np.float32).max, np.finfo(np.float32).tiny):
        fp4kit.quantize(x, global_scale=_f32(scale))
    assert status.read(HOST) == 0


def test_dequantize_with_a_zero_global_scale_is_recorded(rng):
    q = fp4kit.quantize(rng.standard_normal((4, 64)).astype(np.float32))
    fp4kit.dequantize(q)
    assert status.read(HOST) == 0
    bad = Nvfp4Tensor(q.packed, q.block_scales, _f32(0.0), "linear", q.shape)
    fp4kit.dequantize(bad)
    assert not fp4kit.check_finite(HOST)


@pytest.mark.parametrize("amax", [-1.0, -0.0, np.nan, np.inf])
def test_global_scale_from_a_negative_or_nonfinite_amax_is_recorded(amax):
    fp4kit.global_scale_from_amax(_f32(amax))
    assert not fp4kit.check_finite(HOST)


def test_global_scale_from_a_valid_amax_records_nothing():
    for amax in (0.0, 1.0, 6e4):
        fp4kit.global_scale_from_amax(_f32(amax))
    assert status.read(HOST) == 0


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_moe_records_a_nonfinite_input(rng, mode, bad):
    moe = MoE.from_float(*_moe_weights(rng), RoutingConfig(top_k=2), mode=mode)
    x = rng.standard_normal((3, H)).astype(BF16)
    moe(x)
    assert fp4kit.check_finite(HOST)
    x[1, 5] = bad
    with np.errstate(invalid="ignore", over="ignore"):
        moe(x)
    assert not fp4kit.check_finite(HOST)


def _cache(**kw):
    return KVCache(2, window=8, head_dim=64, device=False, **kw)


@pytest.mark.parametrize("counts, pos", [([-3, 1], [0, 1]), ([5, 1], [2, 1]), ([2, 0], None)])
def test_kv_append_counts_outside_zero_to_t_are_clamped_and_recorded(rng, counts, pos):
    cache = _cache()
    kv = rng.standard_normal((2, 2, 64)).astype(BF16)
    cache.append(kv, counts=np.array(counts, np.int32))
    if pos is None:  # in range: no event
        assert status.read(-1) == 0
        assert cache.pos.tolist() == counts
        return
    assert status.read(-1) & status.KV_INPUT
    assert cache.pos.tolist() == pos
    # the clamped append wrote exactly the rows a valid count would have
    ref = _cache()
    ref.append(kv, counts=np.array(pos, np.int32))
    assert np.array_equal(cache.swa.view(np.uint16), ref.swa.view(np.uint16))


def _attention_inputs(rng):
    q = rng.standard_normal((2, 4, 64)).astype(BF16)
    swa = rng.standard_normal((2, 8, 64)).astype(BF16)
    comp = rng.standard_normal((2, 4, 64)).astype(BF16)
    return q, swa, comp


@pytest.mark.parametrize("pos, comp_len", [([-4, 8], [0, 0]), ([4, 8], [9, 0]), ([4, 8], [0, -1])])
def test_sparse_attention_records_positions_and_lengths_out_of_range(rng, pos, comp_len):
    q, swa, comp = _attention_inputs(rng)
    layer = SparseAttention(4, 64)
    indices = np.array([[0, 3], [-1, -1]], np.int32)
    got = layer(q, swa, np.array(pos, np.int32), comp, np.array(comp_len, np.int32), indices)
    assert status.read(-1) & status.KV_INPUT
    # the documented meaning: a negative position is 0, a length is clamped to [0, C]
    clamped = layer(q, swa, np.maximum(np.array(pos, np.int32), 0), comp,
                    np.clip(np.array(comp_len, np.int32), 0, 4), indices)
    assert np.array_equal(got.view(np.uint16), clamped.view(np.uint16))


def test_sparse_attention_in_range_records_nothing(rng):
    q, swa, comp = _attention_inputs(rng)
    SparseAttention(4, 64)(q, swa, np.array([0, 30], np.int32), comp, np.array([4, 0], np.int32),
                           np.array([[0, 3], [-1, -1]], np.int32))
    assert status.read(-1) == 0


# -- silently wrong before: now an error (configuration) -----------------------------------------------

def test_shared_expert_whose_down_does_not_return_to_the_hidden_size(rng):
    g, u = (rng.standard_normal((32, 64)).astype(np.float32) for _ in range(2))
    with pytest.raises(ValueError, match=r"w_down: expected shape \[H, I\] = \(64, 32\)"):
        SharedExpert.from_float(g, u, rng.standard_normal((48, 32)).astype(np.float32))
    gate_up = SharedExpert.from_float(g, u, rng.standard_normal((64, 32)).astype(np.float32)).gate_up
    down48 = Linear.from_float(rng.standard_normal((48, 32)).astype(np.float32))
    with pytest.raises(ValueError, match="down: expected out_features 64"):
        SharedExpert(gate_up, down48)


@pytest.mark.parametrize("kwargs, message", [
    ({"routed_scale": -1.0}, "routed_scale: expected a positive finite number, got -1.0"),
    ({"routed_scale": 0.0}, "routed_scale"),
    ({"routed_scale": np.nan}, "routed_scale"),
    ({"score_func": "relu"}, "score_func: expected one of"),
])
def test_routing_config_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(top_k=2, **kwargs)


@pytest.mark.parametrize("limit", [-1.0, 0.0, np.inf])
def test_moe_limit_is_checked_like_the_shared_expert_and_swiglu(rng, limit):
    with pytest.raises(ValueError, match="limit: expected a positive finite float or None"):
        MoE.from_float(*_moe_weights(rng), RoutingConfig(top_k=2), limit=limit)


# -- unhelpful crashes before: now a clear message -----------------------------------------------------

def test_swiglu_limit_of_the_wrong_type(rng):
    h = rng.standard_normal((4, 64)).astype(np.float32)
    for fn in (fp4kit.swiglu_quantize, fp4kit.ops.quant.swiglu):
        with pytest.raises(TypeError, match="limit: expected a positive finite float or None, got str '10'"):
            fn(h, limit="10")


@pytest.mark.parametrize("name", ["top_k", "n_group", "topk_group"])
@pytest.mark.parametrize("value", ["2", 2.0, True, 0])
def test_routing_config_integer_fields(name, value):
    kwargs = {"top_k": 2, name: value}
    with pytest.raises(TypeError, match=f"{name}: expected a positive int"):
        RoutingConfig(**kwargs)


def test_moe_with_no_tokens_gives_an_empty_result(rng):
    moe = MoE.from_float(*_moe_weights(rng), RoutingConfig(top_k=2))
    y = moe(np.zeros((0, H), BF16))
    assert y.shape == (0, H) and y.dtype == BF16


def test_moe_with_a_shared_expert_of_another_hidden_size(rng):
    se = SharedExpert.from_float(*(rng.standard_normal(s).astype(np.float32) for s in ((32, 48), (32, 48), (48, 32))))
    with pytest.raises(ValueError, match="shared: expected a shared expert of hidden size 64"):
        MoE.from_float(*_moe_weights(rng), RoutingConfig(top_k=2), shared=se)
    with pytest.raises(TypeError, match="shared: expected a callable"):
        MoE.from_float(*_moe_weights(rng), RoutingConfig(top_k=2), shared=3)


@pytest.mark.parametrize("kwargs, message", [
    ({"batch": 2.5}, "batch: expected an int, got float 2.5"),
    ({"batch": "2"}, "batch: expected an int, got str '2'"),
    ({"batch": 2, "window": 8.0}, "window: expected an int"),
    ({"batch": 2, "ratio": 4.0}, "ratio: expected an int, got float 4.0"),
])
def test_kv_cache_sizes_must_be_ints(kwargs, message):
    with pytest.raises(TypeError, match=message):
        KVCache(head_dim=64, device=False, **kwargs)


# -- vague before: now names the argument and what was expected ----------------------------------------

def test_scalar_global_scale_says_how_to_pass_it(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    for scale in (np.float32(300), 300.0):
        with pytest.raises(TypeError, match=r"global_scale: expected a 0-d float32 array .* scalar .*np\.asarray"):
            fp4kit.quantize(x, global_scale=scale)


def test_linear_of_a_float_array_points_to_from_float(rng):
    with pytest.raises(TypeError, match=r"weight: expected a 2-D Nvfp4Tensor \[N, K\], got ndarray .*Linear\.from_float"):
        Linear(rng.standard_normal((48, 64)).astype(np.float32))


def test_from_float_names_the_weight(rng):
    with pytest.raises(ValueError, match=r"weight: expected \[N, K\] with K a multiple of 16, got shape \(48, 50\)"):
        Linear.from_float(np.zeros((48, 50), np.float32))
    gate, w1, w3, w2 = _moe_weights(rng)
    bad = np.zeros((E, I, 50), np.float32)
    with pytest.raises(ValueError, match=r"w1: expected \[experts, inner, hidden\].*\(8, 32, 50\)"):
        MoE.from_float(gate, bad, bad, w2, RoutingConfig(top_k=2))
    with pytest.raises(ValueError, match=r"w3: expected the shape of w1"):
        MoE.from_float(gate, w1, w3[:, :16], w2, RoutingConfig(top_k=2))
    with pytest.raises(ValueError, match=r"w2: expected \[experts, hidden, inner\] = \(8, 64, 32\)"):
        MoE.from_float(gate, w1, w3, w2[:, :, :16], RoutingConfig(top_k=2))


def test_gate_weight_of_the_wrong_expert_count_names_gate_weight(rng):
    gate, w1, w3, w2 = _moe_weights(rng)
    with pytest.raises(ValueError, match=r"gate_weight: expected \[experts, hidden\] with 8 experts.*got shape \(6, 64\)"):
        MoE.from_float(gate[:6], w1, w3, w2, RoutingConfig(top_k=2))
