"""Sparse decode attention on the GPU against the float64 reference: DeepSeek-V4 shapes (64 heads,
D = 512, window 128, 512 selected entries) at batch 1, 3 and 32, positions below / at / far beyond
the window, live compressed lengths below / at / above the selected range, padding indices and
duplicates; odd shapes; every split plan; outputs and scratch poisoned with NaN before each launch;
invalid rows never read; determinism; the op and the layer captured in a CUDA graph and replayed
while positions, lengths, indices and caches change on the device."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.layers.attention import SparseAttention
from fp4kit.ops import attention as ops
from fp4kit.ops.attention import sparse_decode_attention
from fp4kit.reference import attention as ref
from fp4kit.reference.gemm import calc_diff

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
BF16 = ml_dtypes.bfloat16

# bf16 inputs (exact in fp32), fp32 scores and accumulation, probabilities rounded to bf16 for the
# value MMA, bf16 output. The output rounding alone gives calc_diff ~1e-6; the probability rounding
# adds as much; the model of the kernel's arithmetic in tests/test_attention.py measures ~2e-6 on
# these distributions (fp32 output: ~1e-6).
BOUND = 1e-5
# elementwise: half a bf16 ulp of the output (2^-8 relative) plus the probability rounding
# (2^-9 relative per weight, bounded by the largest |value| of the sequence's rows); the model
# stays within 0.4 of it
ABS_FACTOR = 2.0**-8

H, D, W, N, C = 64, 512, 128, 512, 1024
SCENARIOS = ("short", "full", "wrapped", "mixed")


def inputs(rng, b, *, hq=H, d=D, w=W, n=N, c=C, scenario="mixed", q_scale=1.0, selected_range=None):
    """Host inputs. scenario: positions below / at / far beyond the window and live compressed
    lengths below / at / above the selected range (10 % of the indices are -1; duplicates occur)."""
    selected_range = selected_range or max(1, (c * 2) // 3)
    kinds = {"short": 0, "full": 1, "wrapped": 2}
    pos = np.empty(b, np.int32)
    comp_len = np.empty(b, np.int32)
    indices = rng.integers(0, selected_range, (b, n)).astype(np.int32)
    indices[rng.random((b, n)) < 0.1] = -1
    for i in range(b):
        kind = kinds[scenario] if scenario in kinds else i % 3
        top = int(indices[i].max(initial=-1)) + 1
        if kind == 0:
            pos[i] = rng.integers(1, w) if w > 1 else 0
            comp_len[i] = rng.integers(0, max(top, 1))
        elif kind == 1:
            pos[i] = w
            comp_len[i] = top
        else:
            pos[i] = rng.integers(10 * w + 1, 2**30)
            comp_len[i] = rng.choice([c, c + 1000])  # beyond the capacity: clamped to it
    return dict(
        q=(rng.standard_normal((b, hq, d)) * q_scale).astype(BF16),
        swa=rng.standard_normal((b, w, d)).astype(BF16),
        pos=pos,
        comp=rng.standard_normal((b, c, d)).astype(BF16),
        comp_len=comp_len,
        indices=indices,
        sink=rng.uniform(-2, 4, hq).astype(np.float32),
    )


def to_device(args):
    return {k: cp.asarray(v) for k, v in args.items()}


def row_max(args):
    """Largest |value| of each sequence's rows (window and compressed cache; NaN rows left out)."""
    m = [np.nan_to_num(np.abs(args[k].astype(np.float32)), nan=0.0).max(axis=(1, 2), initial=0.0) for k in ("swa", "comp")]
    return np.maximum(*m).astype(np.float64)


def check(got, args, scale=None):
    want = ref.sparse_decode_attention(**args, scale=scale)
    got = cp.asnumpy(got).astype(np.float64)
    assert np.isfinite(got).all(), "an output element was not written (NaN poison) or is not finite"
    diff = calc_diff(got, want)
    assert diff < BOUND, diff
    err = np.abs(got - want)
    limit = ABS_FACTOR * (np.abs(want) + row_max(args)[:, None, None])
    assert np.all(err <= limit), f"max abs error {err.max():.3g} (limit there {limit.flat[np.argmax(err - limit)]:.3g})"
    return want


def poisoned(shape, dtype=BF16):
    return cp.full(shape, np.nan, dtype)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("b", [1, 3, 32])
def test_deepseek_shapes_match_reference(rng, b, scenario):
    args = inputs(rng, b, scenario=scenario)
    dev = to_device(args)
    out = poisoned((b, H, D))
    assert sparse_decode_attention(**dev, out=out) is out
    check(out, args)
    out32 = sparse_decode_attention(**dev, out=poisoned((b, H, D), np.float32))
    assert out32.dtype == np.float32
    check(out32, args)
    for splits in (1, 7, 20):  # the single-split path and the combine path at any batch
        ws = cp.full(ops.workspace_size(b, H, D, splits) or 1, np.nan, cp.float32)
        check(sparse_decode_attention(**dev, out=poisoned((b, H, D)), num_splits=splits, workspace=ws), args)


@pytest.mark.parametrize("q_scale", [4.0, 12.0])
def test_peaked_softmax_and_a_dominant_late_row(rng, q_scale):
    """Large logits: the running max moves across tiles and splits; a row far above the rest sits
    in the last selected position (sequence 0) and the last window slot (sequence 1)."""
    b = 3
    args = inputs(rng, b, q_scale=q_scale, scenario="wrapped")
    u = rng.standard_normal(D)
    args["q"][:] = (u * q_scale).astype(BF16)  # every head the same direction
    hot = (3 * u).astype(BF16)
    args["comp"][0, 5] = hot
    args["indices"][0, -1] = 5
    args["swa"][1, W - 1] = hot
    dev = to_device(args)
    for splits in (None, 1, 10):
        check(sparse_decode_attention(**dev, out=poisoned((b, H, D)), num_splits=splits), args)


@pytest.mark.parametrize(
    "b, hq, d, w, n, c",
    [
        (2, 20, 80, 5, 3, 7),  # heads not a multiple of 16, D not a multiple of 128
        (1, 1, 16, 1, 0, 1),  # one head, the smallest D, no selected entries
        (5, 17, 48, 40, 33, 50),
        (3, 128, 512, 128, 1024, 2048),  # V4-Pro heads and top-k
        (2, 64, 512, 128, 4000, 8192),  # more candidates than one block compacts: at least 3 splits
        (2, 64, 512, 0, 512, 600),  # no window
        (2, 64, 512, 128, 0, 1),  # window only
        (4, 64, 272, 33, 61, 70),
    ],
)
def test_odd_shapes(rng, b, hq, d, w, n, c):
    args = inputs(rng, b, hq=hq, d=d, w=w, n=n, c=c)
    dev = to_device(args)
    r = w + n
    for splits in sorted({None, ops.min_num_splits(r), min(r, 13) if r else 1}, key=lambda s: s or 0):
        if splits is not None and splits < ops.min_num_splits(r):
            continue
        for dtype in (BF16, np.float32):
            check(sparse_decode_attention(**dev, out=poisoned((b, hq, d), dtype), num_splits=splits), args)


def test_scale_argument(rng):
    args = inputs(rng, 3)
    check(sparse_decode_attention(**to_device(args), scale=0.1), args, scale=0.1)


def test_invalid_rows_are_never_read(rng):
    """NaN in every window slot at or beyond pos (before the ring wraps) and in every compressed
    row at or beyond comp_len: the output stays finite and equal to the reference."""
    b = 4
    args = inputs(rng, b, scenario="short")
    for i in range(b):
        args["swa"][i, args["pos"][i]:] = np.nan
        args["comp"][i, args["comp_len"][i]:] = np.nan
    dev = to_device(args)
    for splits in (None, 1, 10):
        check(sparse_decode_attention(**dev, out=poisoned((b, H, D)), num_splits=splits), args)


@pytest.mark.parametrize("sink", [0.0, 5.0, -np.inf])
def test_no_valid_row_gives_exact_zero(rng, sink):
    b = 3
    args = inputs(rng, b)
    args["pos"][:] = [0, -3, 0]
    args["comp_len"][:] = [0, 0, 400]
    args["indices"][2] = -1  # sequence 2: live entries, none selected
    args["sink"][:] = sink
    dev = to_device(args)
    for splits in (None, 1, 10):
        for dtype in (BF16, np.float32):
            got = sparse_decode_attention(**dev, out=poisoned((b, H, D), dtype), num_splits=splits)
            assert np.all(cp.asnumpy(got).astype(np.float32) == 0)
    # one sequence empty, the others not
    args["pos"][1] = W + 3
    check(sparse_decode_attention(**to_device(args), out=poisoned((b, H, D))), args)


def test_sink_minus_infinity_is_plain_softmax(rng):
    args = inputs(rng, 3)
    args["sink"][:] = -np.inf
    want = check(sparse_decode_attention(**to_device(args)), args)
    assert np.abs(want).max() > 0


def test_deterministic(rng):
    for b in (1, 32):
        dev = to_device(inputs(rng, b))
        for splits in (None, 1):
            first = sparse_decode_attention(**dev, num_splits=splits)
            second = sparse_decode_attention(**dev, num_splits=splits)
            assert cp.asnumpy(first).tobytes() == cp.asnumpy(second).tobytes()


def test_graph_replay_reads_positions_lengths_and_indices_on_the_device(rng, capture_stream):
    b = 3
    host = inputs(rng, b, scenario="short")
    dev = to_device(host)
    splits_many = 10
    ws = cp.full(ops.workspace_size(b, H, D, splits_many), np.nan, cp.float32)
    out_one, out_many = poisoned((b, H, D)), poisoned((b, H, D), np.float32)

    def step():
        sparse_decode_attention(**dev, out=out_one, num_splits=1)
        sparse_decode_attention(**dev, out=out_many, num_splits=splits_many, workspace=ws)

    step()  # eager first use: compiles and sets the shared-memory limit
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        step()
        graph = stream.end_capture()

    def replay():
        with stream:
            out_one.fill(np.nan)
            out_many.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        check(out_one, host)
        check(out_many, host)

    replay()
    with stream:
        # the ring wraps and the compressed cache grows, by device arithmetic
        dev["pos"] += cp.int32(3 * W)
        dev["comp_len"] += cp.int32(C // 2)
        host["pos"] += np.int32(3 * W)
        host["comp_len"] += np.int32(C // 2)
        # new cache contents and a new query
        for name in ("swa", "comp", "q"):
            host[name] = rng.standard_normal(host[name].shape).astype(BF16)
            dev[name].set(host[name], stream=stream)
    replay()
    with stream:
        # a new selection with padding and duplicates; positions back below the window
        host["indices"] = rng.integers(-1, C, (b, N)).astype(np.int32)
        host["indices"][:, ::7] = host["indices"][:, :1]
        host["pos"][:] = [0, 1, W - 1]
        host["comp_len"][:] = [C, 17, 0]
        for name in ("indices", "pos", "comp_len"):
            dev[name].set(host[name], stream=stream)
    replay()
    with stream:
        host["sink"] = rng.uniform(-2, 4, H).astype(np.float32)
        dev["sink"].set(host["sink"], stream=stream)
        dev["comp"][:, :64] = dev["swa"][:, :64]  # a device-side cache write
        host["comp"][:, :64] = host["swa"][:, :64]
    replay()


def test_layer_buffers_and_graph_capture(rng, capture_stream):
    b = 2
    host = inputs(rng, b, scenario="wrapped")
    sink = host.pop("sink")
    layer = SparseAttention(H, D, sink=sink)  # a host sink: copied to the device at the first call
    dev = to_device(host)
    first = layer(**dev)
    assert isinstance(first, cp.ndarray) and first.dtype == BF16
    check(first, dict(host, sink=sink))
    assert layer(**dev) is first  # the same buffer for the same batch size
    other = to_device(inputs(rng, 5))
    other.pop("sink")
    assert layer(**other) is not first
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        out = layer(**dev)
        graph = stream.end_capture()
    assert out is first
    for shift in (1, W, 5 * W + 3):
        with stream:
            dev["pos"] += cp.int32(shift)
            first.fill(np.nan)
        host["pos"] += np.int32(shift)
        graph.launch(stream)
        stream.synchronize()
        check(first, dict(host, sink=sink))
    layer.sink = cp.asarray(sink + 1)  # a device sink is used in place
    got = layer(**dev)
    check(got, dict(host, sink=sink + 1))
    layer32 = SparseAttention(H, D, sink=cp.asarray(sink), out_dtype=np.float32, scale=0.05)
    check(layer32(**dev), dict(host, sink=sink), scale=0.05)


def test_device_bad_inputs(rng):
    dev = to_device(inputs(rng, 2, hq=16, d=32, w=4, n=4, c=8))
    host_pos = cp.asnumpy(dev["pos"])
    with pytest.raises(ValueError, match="arrays must live on one device .*pos on host"):
        sparse_decode_attention(**dict(dev, pos=host_pos))
    with pytest.raises(ValueError, match="out: expected an array on the same device as the input"):
        sparse_decode_attention(**dev, out=np.zeros((2, 16, 32), BF16))
    with pytest.raises(ValueError, match="workspace: expected a 1-D float32 array of at least"):
        sparse_decode_attention(**dev, num_splits=4, workspace=cp.zeros(10, cp.float32))
    with pytest.raises(ValueError, match="workspace: expected an array on the same device as q"):
        sparse_decode_attention(**dev, num_splits=4, workspace=np.zeros(10**5, np.float32))
    with pytest.raises(ValueError, match="q: expected a 16-byte aligned device pointer"):
        sparse_decode_attention(**dict(dev, q=cp.zeros(2 * 16 * 32 + 1, BF16)[1:].reshape(2, 16, 32)))


def test_dlpack_inputs_from_torch(rng):
    torch = pytest.importorskip("torch")
    args = inputs(rng, 3)
    tensors = {k: torch.from_dlpack(cp.asarray(v)) for k, v in args.items()}
    check(sparse_decode_attention(**tensors), args)


@pytest.mark.parametrize("t, window, start, splits", [(1, 128, 0, None), (23, 4, 5, None), (200, 128, 0, None),
                                                      (200, 128, 300, 3), (64, 1, 17, 1), (150, 128, 70, None)])
def test_prefill_matches_reference(rng, t, window, start, splits):
    """`sparse_prefill_attention`: T prompt tokens of one sequence at once (windows that grow, wrap
    and slide; entries that complete as the prompt advances; a selection per query; split or not)
    against the specification, every output element written, repeat runs bitwise identical."""
    from fp4kit.runtime import status

    heads, d, cap, n = 64, 512, 96, 64
    q = (rng.standard_normal((t, heads, d)) * 0.1).astype(BF16)
    kv = rng.standard_normal((start + t + 7, d)).astype(BF16)
    comp = rng.standard_normal((cap, d)).astype(BF16)
    comp_len = np.minimum((start + np.arange(t) + 1) // 4, cap).astype(np.int32)
    indices = rng.integers(-1, cap, (t, n)).astype(np.int32)
    sink = rng.standard_normal(heads).astype(np.float32)
    want = ref.prefill_attention(q, kv, start, window, comp, comp_len, indices, sink)
    dev = [cp.asarray(a) for a in (q, kv, np.array([start], np.int32), comp, comp_len, indices, sink)]
    status.clear()
    outs = []
    for _ in range(2):
        out = cp.full((t, heads, d), np.nan, np.float32)
        ops.sparse_prefill_attention(dev[0], dev[1], dev[2], window, *dev[3:], out=out, num_splits=splits)
        outs.append(out)
    assert status.read() == 0
    assert cp.array_equal(outs[0].view(cp.uint32), outs[1].view(cp.uint32))
    assert calc_diff(cp.asnumpy(outs[0]), want) < BOUND


def test_prefill_past_the_rows_is_clamped_and_recorded(rng):
    """On the device a query position past the K = V rows attends to the rows that exist (the
    kernel never reads past them) and sets the KV_INPUT status bit."""
    from fp4kit.runtime import status

    heads, d = 16, 64
    q = cp.asarray(rng.standard_normal((4, heads, d)).astype(BF16))
    kv = cp.asarray(rng.standard_normal((5, d)).astype(BF16))  # start 3 + T 4 needs 7 rows
    comp = cp.zeros((4, d), BF16)
    status.clear()
    out = ops.sparse_prefill_attention(q, kv, cp.asarray(np.array([3], np.int32)), 8, comp, cp.zeros(4, cp.int32),
                                       cp.full((4, 2), -1, cp.int32), cp.full(heads, -np.inf, cp.float32))
    assert status.read() & status.KV_INPUT
    assert cp.isfinite(out.astype(cp.float32)).all()
    status.clear()


# ---- the splits merged inside the attention kernel (ops.FUSED_COMBINE) against the combine kernel


def _kernel_names(fn, capture_stream):
    """The kernels one call of ``fn`` launches, read off a captured graph."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from common import graph_kernels

    stream = capture_stream()
    with stream:
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
    return graph_kernels(graph)


def _counters_zero():
    return not cp.asnumpy(ops._arrival_counters()).any()


def _bits(x):
    return cp.asnumpy(x).view(np.uint32 if x.dtype == np.float32 else np.uint16)


@pytest.mark.parametrize("b, hq, d, w, n, c, splits", [
    (1, 64, 512, 128, 512, 1024, 10),  # the decode step's shape and split count
    (3, 64, 512, 128, 512, 1024, 7),
    (2, 20, 80, 5, 3, 7, 4),  # a partial head group, D not a multiple of 64
    (5, 17, 48, 40, 33, 50, 13),
    (2, 64, 512, 128, 4000, 8192, 3),
    (1, 128, 512, 128, 1024, 2048, 20),
])
def test_fused_combine_is_bit_identical_to_the_combine_kernel(rng, monkeypatch, b, hq, d, w, n, c, splits):
    """The last block of each (row, head group) merging the splits gives the bits of
    sparse_decode_combine (bf16 and fp32 outputs, empty rows and a -inf sink included), every
    output element written (NaN poison), the counters back at zero after each launch, and a
    second launch (counters reused) the same bits."""
    args = inputs(rng, b, hq=hq, d=d, w=w, n=n, c=c)
    args["pos"][0], args["comp_len"][0] = 0, 0  # row 0 empty: 0 (or the sink alone gives 0 too)
    args["sink"][0] = -np.inf
    dev = to_device(args)
    got = {}
    for fused in (False, True, True):
        monkeypatch.setattr(ops, "FUSED_COMBINE", fused)
        for dtype in (BF16, np.float32):
            ws = cp.full(ops.workspace_size(b, hq, d, splits), np.nan, cp.float32)
            out = sparse_decode_attention(**dev, out=poisoned((b, hq, d), dtype), num_splits=splits, workspace=ws)
            assert _counters_zero()
            got.setdefault((fused, np.dtype(dtype).name), []).append(_bits(out))
    for dtype in ("bfloat16", "float32"):
        apart, fused_runs = got[(False, dtype)][0], got[(True, dtype)]
        assert all(np.array_equal(apart, f) for f in fused_runs), dtype
    check(sparse_decode_attention(**dev, out=poisoned((b, hq, d)), num_splits=splits), args)


def test_fused_combine_launches_one_kernel_and_the_knob_brings_the_combine_back(rng, monkeypatch, capture_stream):
    dev = to_device(inputs(rng, 1))
    out = poisoned((1, H, D))
    call = lambda: sparse_decode_attention(**dev, out=out, num_splits=10)  # noqa: E731
    call()
    assert _kernel_names(call, capture_stream) == ["sparse_decode_attention"]
    monkeypatch.setattr(ops, "FUSED_COMBINE", False)
    assert sorted(_kernel_names(call, capture_stream)) == ["sparse_decode_attention", "sparse_decode_combine"]
    monkeypatch.setattr(ops, "FUSED_COMBINE", True)
    monkeypatch.setattr(ops, "MAX_FUSED_GROUPS", 3)  # more (row, head group)s than counters: the combine kernel
    assert sorted(_kernel_names(call, capture_stream)) == ["sparse_decode_attention", "sparse_decode_combine"]


def test_fused_combine_graph_replays_reset_their_counters(rng, monkeypatch, capture_stream):
    """A captured step of two split attention launches on one stream (they share the counters),
    replayed 20 times with changing positions: each replay equals the combine kernel's eager bits,
    and the counters are zero after every replay."""
    b, splits = 3, 10
    host = inputs(rng, b, scenario="short")
    dev = to_device(host)
    outs = [poisoned((b, H, D)), poisoned((b, H, D), np.float32)]
    ws = cp.full(ops.workspace_size(b, H, D, splits), np.nan, cp.float32)

    def step():
        for out in outs:
            sparse_decode_attention(**dev, out=out, num_splits=splits, workspace=ws)

    step()
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    for i in range(20):
        with stream:
            dev["pos"] += cp.int32(7)
            for out in outs:
                out.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        with stream:
            assert _counters_zero()
        monkeypatch.setattr(ops, "FUSED_COMBINE", False)
        for out in outs:
            want = sparse_decode_attention(**dev, out=cp.empty_like(out), num_splits=splits)
            assert np.array_equal(_bits(out), _bits(want)), i
        monkeypatch.setattr(ops, "FUSED_COMBINE", True)


@pytest.mark.parametrize("t, splits", [(200, 3), (23, 5)])
def test_fused_combine_in_prefill_is_bit_identical(rng, monkeypatch, t, splits):
    heads, d, cap, n, window, start = 64, 512, 96, 64, 128, 40
    q = cp.asarray((rng.standard_normal((t, heads, d)) * 0.1).astype(BF16))
    kv = cp.asarray(rng.standard_normal((start + t, d)).astype(BF16))
    comp = cp.asarray(rng.standard_normal((cap, d)).astype(BF16))
    comp_len = cp.asarray(np.minimum((start + np.arange(t) + 1) // 4, cap).astype(np.int32))
    indices = cp.asarray(rng.integers(-1, cap, (t, n)).astype(np.int32))
    sink = cp.asarray(rng.standard_normal(heads).astype(np.float32))
    first = cp.asarray(np.array([start], np.int32))
    got = []
    for fused in (False, True):
        monkeypatch.setattr(ops, "FUSED_COMBINE", fused)
        out = cp.full((t, heads, d), np.nan, np.float32)
        ops.sparse_prefill_attention(q, kv, first, window, comp, comp_len, indices, sink, out=out, num_splits=splits)
        got.append(_bits(out))
    assert np.array_equal(got[0], got[1]) and _counters_zero()


# ---- indices=None: every live compressed entry, without an index list


@pytest.mark.parametrize("b, w, c, splits", [(1, 128, 32, None), (3, 128, 1024, 10), (2, 16, 300, 1), (4, 0, 70, 3)])
def test_indices_none_equals_every_index(rng, b, w, c, splits):
    """``indices=None`` gives the bits of the list ``all_entries`` builds (0 .. comp_len-1, then
    -1) and of the list 0 .. C-1 (lengths below, at and beyond the capacity), through the op, the
    layer and prefill, and matches the reference."""
    from fp4kit.ops import elementwise as ew

    args = inputs(rng, b, w=w, c=c, n=c)
    args["comp_len"][:] = rng.integers(0, c + 5, b)
    args["comp_len"][0] = 0
    dev = to_device(args)
    listed = {"all_entries": ew.all_entries(dev["comp_len"], c),
              "every slot": cp.asarray(np.broadcast_to(np.arange(c, dtype=np.int32), (b, c)).copy())}
    for dtype in (BF16, np.float32):
        got = sparse_decode_attention(**dict(dev, indices=None), out=poisoned((b, H, D), dtype), num_splits=splits)
        for name, indices in listed.items():
            want = sparse_decode_attention(**dict(dev, indices=indices), out=poisoned((b, H, D), dtype),
                                           num_splits=splits)
            assert np.array_equal(_bits(got), _bits(want)), name
    check(got, dict(args, indices=None))
    sink = dev.pop("sink")
    layer = SparseAttention(H, D, sink=sink)
    got = cp.array(layer(**dict(dev, indices=None)))
    assert np.array_equal(_bits(got), _bits(layer(**dict(dev, indices=listed["all_entries"]))))


def test_prefill_indices_none_equals_every_index(rng):
    from fp4kit.ops import elementwise as ew

    t, heads, d, cap, window, start = 150, 64, 512, 96, 128, 30
    q = cp.asarray((rng.standard_normal((t, heads, d)) * 0.1).astype(BF16))
    kv = cp.asarray(rng.standard_normal((start + t, d)).astype(BF16))
    comp = cp.asarray(rng.standard_normal((cap, d)).astype(BF16))
    comp_len = cp.asarray(np.minimum((start + np.arange(t) + 1) // 4, cap).astype(np.int32))
    sink = cp.asarray(rng.standard_normal(heads).astype(np.float32))
    first = cp.asarray(np.array([start], np.int32))
    got = [ops.sparse_prefill_attention(q, kv, first, window, comp, comp_len, i, sink, out_dtype=np.float32)
           for i in (None, ew.all_entries(comp_len, cap))]
    assert np.array_equal(_bits(got[0]), _bits(got[1]))


@pytest.mark.parametrize("b, hq, d, rope_dim, splits", [
    (1, 64, 512, 64, 10),  # the decode step's shape and split count
    (3, 64, 512, 64, 1),
    (2, 20, 80, 16, 4),    # a partial head group, D not a multiple of 64
    (5, 17, 48, 48, 3),    # RoPE over the whole head
    (2, 16, 512, 0, 7),    # no RoPE
    (4, 128, 512, 64, 20),
])
def test_query_norm_in_the_launch_gives_the_bits_of_the_norm_launch(rng, b, hq, d, rope_dim, splits):
    """``query_norm``: the kernel's RMSNorm + RoPE of the raw query heads (in the fragments it loads)
    gives the bits of `rmsnorm_rope` then the attention, at positions from 0 to 2**30 (the sine and
    cosine's slow path), fused combine and split output alike."""
    from fp4kit.ops import elementwise as ew

    args = inputs(rng, b, hq=hq, d=d, w=min(W, 64), n=33, c=64)
    raw = (args["q"].astype(np.float32) * 5).astype(BF16)
    dev = to_device(args)
    normed = ew.rmsnorm_rope(cp.asarray(raw), None, dev["pos"] - 1, eps=1e-6, rope_dim=rope_dim, theta=10000.0)
    want = sparse_decode_attention(**{**dev, "q": normed}, num_splits=splits)
    got = sparse_decode_attention(**{**dev, "q": cp.asarray(raw)}, num_splits=splits,
                                  query_norm=ops.QueryNorm(dev["pos"], 1e-6, rope_dim, 10000.0, offset=-1))
    assert np.array_equal(_bits(got), _bits(want))
    check(got, {**args, "q": cp.asnumpy(normed)})
