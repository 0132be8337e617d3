"""NVFP4 GEMM reference, the Linear and SharedExpert layers on the numpy backend, and bad inputs."""

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit.layers import Linear, SharedExpert, fuse_gate_up, interleave_rows
from fp4kit.ops.gemm import gemm
from fp4kit.reference import gemm as ref
from fp4kit.reference import quant as qref

BF16 = ml_dtypes.bfloat16


def test_unscaled_values_times_decode_is_dequantize(rng):
    w = rng.standard_normal((8, 64)).astype(np.float32)
    q = qref.quantize(w)
    direct = qref.dequantize(q, np.float64)
    via = ref.unscaled_values(q) * np.float64(ref.decode_factor(q.global_scale))
    # the reference dequantize rounds twice (fl(sf / S), then the product by e2m1), this path once
    # (fl(1 / S)): at most three half-ulps of fp32 apart, under 2**-22 relative
    assert np.all(np.abs(via - direct) <= 2**-22 * np.abs(direct))


def test_gemm_w4a16_and_w4a4_match_float64(rng):
    w = qref.quantize(rng.standard_normal((40, 96)).astype(np.float32))
    x = rng.standard_normal((5, 96)).astype(BF16)
    y = gemm(x, w, out_dtype=np.float32)
    expect = x.astype(np.float64) @ qref.dequantize(w, np.float64).T
    assert ref.calc_diff(y, expect) < 1e-12
    a = qref.quantize(x)
    y4 = gemm(a, w, out_dtype=np.float32)
    expect4 = qref.dequantize(a, np.float64) @ qref.dequantize(w, np.float64).T
    assert ref.calc_diff(y4, expect4) < 1e-12
    bias = rng.standard_normal(40).astype(np.float32)
    assert ref.calc_diff(gemm(x, w, bias=bias, out_dtype=np.float32), expect + bias) < 1e-12


def test_calc_diff():
    x = np.array([1.0, 2.0, 3.0])
    assert ref.calc_diff(x, x) == 0
    assert ref.calc_diff(x, -x) == pytest.approx(2.0)
    assert ref.calc_diff(np.zeros(3), np.zeros(3)) == 0


def test_fused_gate_up_with_different_global_scales_is_exact(rng):
    gate = qref.quantize(rng.standard_normal((32, 64)).astype(np.float32) * 3)
    up = qref.quantize(rng.standard_normal((32, 64)).astype(np.float32) * 0.01)
    assert gate.global_scale != up.global_scale
    fused, row_decode = fuse_gate_up(gate, up)
    assert fused.shape == (64, 64)
    x = rng.standard_normal((3, 64)).astype(BF16)
    y = gemm(x, fused, row_decode=row_decode, out_dtype=np.float32)
    yg = gemm(x, gate, out_dtype=np.float32)
    yu = gemm(x, up, out_dtype=np.float32)
    assert np.array_equal(y, interleave_rows(yg.T, yu.T).T)


def test_linear_modes_and_static_scale(rng):
    w = rng.standard_normal((48, 64)).astype(np.float32)
    x = rng.standard_normal((2, 3, 64)).astype(BF16)
    lin16 = Linear.from_float(w, mode="w4a16")
    y16 = lin16(x)
    assert y16.shape == (2, 3, 48) and y16.dtype == BF16
    assert ref.calc_diff(y16, gemm(x, lin16.weight)) == 0
    s = np.array(2688 / 4.0, np.float32)
    lin4 = Linear.from_float(w, input_scale=s)
    y4 = lin4(x)
    assert np.array_equal(y4, gemm(fp4kit.quantize(x, global_scale=s), lin4.weight))


def test_shared_expert_matches_composition(rng):
    h, i = 64, 32
    wg, wu = rng.standard_normal((i, h)).astype(np.float32), rng.standard_normal((i, h)).astype(np.float32)
    wd = rng.standard_normal((h, i)).astype(np.float32)
    x = rng.standard_normal((16, h)).astype(BF16)
    for mode in ("w4a4", "w4a16"):
        se = SharedExpert.from_float(wg, wu, wd, limit=4.0, mode=mode)
        y = se(x)
        hh = se.gate_up(x)
        if mode == "w4a4":
            a = qref.swiglu_quantize(hh, "interleaved", 4.0)
        else:
            a = qref.swiglu(hh, "interleaved", 4.0).astype(BF16)
        assert np.array_equal(y, gemm(a, se.down.weight))
        # against float64 math on the reference's own dequantized weights (and input, W4A4), so that
        # the weights' quantization error is not in the budget: what is left is the NVFP4 rounding
        # of the intermediate activation (W4A4; measured 0.8-1.2x its own calc_diff over 150
        # seeds) and bf16 roundings (W4A16: measured <= 3.6e-6). A wrong gate/up layout or clamp
        # gives ~0.4, an output scaled by 1.3 ~0.035.
        w13 = _dequantized(interleave_rows(wg, wu)).reshape(i // 16, 2, 16, h)
        xx = _dequantized(x) if mode == "w4a4" else x.astype(np.float64)
        g, u = xx @ w13[:, 0].reshape(i, h).T, xx @ w13[:, 1].reshape(i, h).T
        act = np.minimum(g, 4) / (1 + np.exp(-np.minimum(g, 4))) * np.clip(u, -4, 4)
        exact = act @ _dequantized(wd).T
        wrong = (np.minimum(u, 4) / (1 + np.exp(-np.minimum(u, 4))) * np.clip(g, -4, 4)) @ _dequantized(wd).T
        act32 = act.astype(np.float32)
        bound = 1.5 * ref.calc_diff(qref.dequantize(qref.quantize(act32)), act32) if mode == "w4a4" else 1e-5
        assert ref.calc_diff(y, exact) < bound
        assert bound < min(ref.calc_diff(1.3 * y.astype(np.float64), exact), ref.calc_diff(wrong, exact))


def _dequantized(a):
    """float64 values of ``a`` after an NVFP4 round trip through the reference."""
    return qref.dequantize(qref.quantize(np.asarray(a, np.float32))).astype(np.float64)


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda w, x: gemm(x, np.zeros((4, 32), np.uint8)), TypeError, "w: expected an Nvfp4Tensor"),
        (lambda w, x: gemm(x, qref.quantize(np.ones((32, 64), np.float32), scale_layout="swizzled")), ValueError, "w: expected scale_layout 'tiled' \\(or 'linear' on numpy\\), got 'swizzled'"),
        (lambda w, x: gemm(x[:, :32].copy(), w), ValueError, "a: expected last dimension K=64"),
        (lambda w, x: gemm(x.astype(np.float32), w), TypeError, "a: expected an Nvfp4Tensor or a bfloat16 array, got dtype float32"),
        (lambda w, x: gemm(x, w, bias=np.ones(5, np.float32)), ValueError, r"bias: expected shape \(16,\)"),
        (lambda w, x: gemm(x, w, row_decode=np.ones(16, np.float64)), ValueError, "row_decode: expected shape"),
        (lambda w, x: gemm(x, w, out=np.zeros((2, 15), BF16)), ValueError, r"out: expected shape \(2, 16\)"),
        (lambda w, x: gemm(x, w, out_dtype=np.float16), TypeError, "out_dtype: expected bfloat16 or float32"),
        (lambda w, x: gemm(x, w, decode_max_m=-1), ValueError, "decode_max_m: expected a non-negative int"),
        (lambda w, x: Linear(w, mode="w8a8"), ValueError, "mode: expected one of"),
        (lambda w, x: Linear(w, input_scale=2.0), TypeError, "input_scale: expected a 0-d float32 array"),
        (lambda w, x: SharedExpert(Linear(w), Linear(w)), ValueError, "down: expected in_features 8"),
    ],
)
def test_bad_input_gets_a_clear_error(call, exc, message):
    w = qref.quantize(np.ones((16, 64), np.float32))
    x = np.ones((2, 64), BF16)
    with pytest.raises(exc, match=message):
        call(w, x)


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_concatenated_linears_equal_the_parts(rng, mode):
    """`Linear.concatenate`: one quantization and one GEMM for several layers of one input give
    each part's output exactly (parts of different global scales and sizes, with biases; a part
    that is itself a fused gate|up with per-row decode factors)."""
    k = 96
    ws = [(rng.standard_normal((n, k)) * scale).astype(np.float32) for n, scale in ((40, 1.0), (16, 30.0), (8, 0.01))]
    biases = [rng.standard_normal(w.shape[0]).astype(np.float32) for w in ws]
    parts = [Linear.from_float(w, bias=b, mode=mode) for w, b in zip(ws, biases)]
    fused_gate_up, row_decode = fuse_gate_up(qref.quantize(ws[0][:16]), qref.quantize(ws[0][16:32] * 7))
    parts.append(Linear(fused_gate_up, bias=rng.standard_normal(32).astype(np.float32), mode=mode,
                        row_decode=row_decode))
    fused = Linear.concatenate(parts)
    assert fused.split_sizes == [40, 16, 8, 32] and fused.out_features == 96
    x = rng.standard_normal((3, k)).astype(BF16)
    for got, part in zip(fused.split(fused(x)), parts):
        want = part(x)
        assert got.flags.c_contiguous and got.shape == want.shape
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert Linear.concatenate(parts[:1]).split_sizes == [40]


def test_column_blocks_are_the_output_columns_apart(rng):
    """`gemm(..., column_blocks=)` writes block j as its own C-contiguous [M, N_j] matrix at element
    M * c_j of a flat output (numpy: the reference's columns copied there); `Linear.call_split`
    equals `split(self(x))`. Bad block lists are refused by name."""
    w = qref.quantize(rng.standard_normal((96, 64)).astype(np.float32))
    x = rng.standard_normal((2, 3, 64)).astype(BF16)
    full = gemm(x, w)
    flat = np.full(6 * 96, np.nan, BF16)
    blocks = gemm(x, w, out=flat, column_blocks=[40, 16, 40])
    for got, (c, n) in zip(blocks, ((0, 40), (40, 16), (56, 40))):
        assert got.shape == (2, 3, n) and got.flags.c_contiguous and np.shares_memory(got, flat)
        assert np.array_equal(got.view(np.uint16), full[..., c:c + n].view(np.uint16))
    assert np.array_equal(flat[:6 * 40].reshape(6, 40).view(np.uint16), full.reshape(6, 96)[:, :40].view(np.uint16))
    for bad in ([40, 16], [96, 0], [True, 95], [48.0, 48]):
        with pytest.raises(ValueError, match="column_blocks: expected positive ints adding up to N = 96"):
            gemm(x, w, column_blocks=bad)
    with pytest.raises(ValueError, match="out"):
        gemm(x, w, out=np.empty((6, 96), BF16), column_blocks=[40, 56])
    parts = [Linear.from_float(rng.standard_normal((n, 64)).astype(np.float32), mode="w4a16") for n in (32, 16)]
    fused = Linear.concatenate(parts)
    for got, want in zip(fused.call_split(x), fused.split(fused(x))):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_concatenate_refuses_parts_it_cannot_join(rng):
    w = rng.standard_normal((16, 64)).astype(np.float32)
    a = Linear.from_float(w)
    with pytest.raises(ValueError, match=r"parts\[1\]: expected in_features=64"):
        Linear.concatenate([a, Linear.from_float(rng.standard_normal((16, 32)).astype(np.float32))])
    with pytest.raises(ValueError, match=r"parts\[1\]: expected in_features=64 and mode='w4a4'"):
        Linear.concatenate([a, Linear.from_float(w, mode="w4a16")])
    with pytest.raises(ValueError, match="static input_scale"):
        Linear.concatenate([a, Linear.from_float(w, input_scale=np.array(100.0, np.float32))])
    with pytest.raises(ValueError, match="a bias or none"):
        Linear.concatenate([a, Linear.from_float(w, bias=np.zeros(16, np.float32))])
    with pytest.raises(TypeError, match="non-empty list of Linear"):
        Linear.concatenate([])


def test_grouped_gemm_is_each_group_against_its_weight(rng):
    """`gemm_grouped` on numpy: column block g of the output is the activation's column block g
    through the weight's row block g, against float64 on the dequantized weights, per-row decode
    factors of a concatenation included."""
    from fp4kit.formats import fuse_rows
    from fp4kit.ops.gemm import gemm_grouped

    groups, n_g, k, m = 3, 128, 64, 5
    parts = [qref.quantize((rng.standard_normal((n_g, k)) * (g + 1)).astype(np.float32)) for g in range(groups)]
    fused, row_decode = fuse_rows(parts, "concatenated")
    x = rng.standard_normal((m, groups * k)).astype(BF16)
    got = gemm_grouped(x, fused, groups, row_decode=row_decode, out_dtype=np.float32)
    want = np.concatenate([x[:, g * k:(g + 1) * k].astype(np.float64) @ fp4kit.dequantize(parts[g]).astype(np.float64).T
                           for g in range(groups)], axis=1)
    assert got.shape == (m, groups * n_g) and got.dtype == np.float32
    assert ref.calc_diff(got, want) < 1e-12


@pytest.mark.parametrize("change, exc, message", [
    (dict(groups=0), ValueError, "groups: expected a positive int, got 0"),
    (dict(groups=True), ValueError, "groups: expected a positive int, got True"),
    (dict(groups=3), ValueError, r"w: expected rows in 3 groups of a multiple of 128 rows, got shape \(256, 64\)"),
    (dict(n=192, groups=1), ValueError, r"w: expected rows in 1 groups of a multiple of 128 rows"),
    (dict(dtype=np.float32), TypeError, "a: expected dtype bfloat16 .*, got float32"),
    (dict(cols=100), ValueError, r"a: expected shape \(M, 128\) for 2 groups of K = 64"),
])
def test_grouped_gemm_bad_inputs(rng, change, exc, message):
    from fp4kit.ops.gemm import gemm_grouped

    n, groups = change.get("n", 256), change.get("groups", 2)
    w = qref.quantize(rng.standard_normal((n, 64)).astype(np.float32))
    a = np.zeros((2, change.get("cols", 2 * 64)), change.get("dtype", BF16))
    with pytest.raises(exc, match=message):
        gemm_grouped(a, w, groups)
