"""Sampling on the numpy backend: Philox known-answer vectors, the reference distribution on
hand-computed cases (each filter, their order, ties, greedy, NaN / Inf rules), the reference
draw against the distribution, the op and layers (offset advance, reproducibility, status word),
and every bad parameter getting a clear error before anything runs.
(The kernel compiles for sm_90a and sm_100a in tests/test_compile.py.)"""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.layers.sampler import Generator, Sampler
from fp4kit.ops import sampling as ops
from fp4kit.reference import sampling as ref
from fp4kit.runtime import status

BF16 = ml_dtypes.bfloat16
INF, NAN = np.inf, np.nan


def host_flags() -> int:
    return status.read(device=-1)


# ---- Philox


def test_philox_random123_known_answers():
    got = ref.philox4x32_10([0, 0, 0, 0], [0, 0])
    assert got.tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    got = ref.philox4x32_10([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2)
    assert got.tolist() == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    got = ref.philox4x32_10([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0])
    assert got.tolist() == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_philox_words_counter_layout():
    w = ref.philox_words(seed=(7 << 32) | 5, offset=(3 << 32) | 9, rows=2, vocab=6)
    assert w.shape == (2, 6) and w.dtype == np.uint32
    for b in range(2):
        for i in range(6):
            x = ref.philox4x32_10([i // 4, b, 9, 3], [5, 7])
            assert w[b, i] == x[i % 4]
    u = ref.uniforms(np.array([0, 0xFFFFFFFF, 0x100], np.uint32))
    assert u.tolist() == [2.0**-24, 1 - 2.0**-24, 2.0**-24]
    assert (ref.uniforms(w) > 0).all() and (ref.uniforms(w) < 1).all()


# ---- reference distribution


def logp(values):
    return np.log(np.asarray(values, np.float64))[None, :]


def test_probabilities_plain_softmax_and_temperature():
    x = np.array([[1.0, 2.0, 3.0]])
    e = np.exp(x[0] - 3)
    assert np.allclose(ref.probabilities(x)[0], e / e.sum())
    e2 = np.exp((x[0] - 3) / 0.5)
    assert np.allclose(ref.probabilities(x, temperature=0.5)[0], e2 / e2.sum())


def test_top_k_with_boundary_ties_takes_lower_ids():
    x = logp([0.1, 0.3, 0.2, 0.3, 0.1])
    p = ref.probabilities(x, top_k=1)
    assert p[0].tolist() == [0, 1, 0, 0, 0]  # 0.3 at ids 1 and 3: lower id
    p = ref.probabilities(x, top_k=3)
    assert np.allclose(p[0], [0, 0.375, 0.25, 0.375, 0])
    p = ref.probabilities(x, top_k=4)
    assert np.allclose(p[0], np.array([0.1, 0.3, 0.2, 0.3, 0]) / 0.9)  # tie of 0.1: id 0
    assert np.allclose(ref.probabilities(x, top_k=99)[0], [0.1, 0.3, 0.2, 0.3, 0.1])


def test_top_p_smallest_prefix_reaching_the_mass():
    x = logp([0.5, 0.25, 0.125, 0.125])
    assert ref.kept_mask(x, top_p=0.5)[0].tolist() == [True, False, False, False]
    assert ref.kept_mask(x, top_p=0.6)[0].tolist() == [True, True, False, False]
    assert ref.kept_mask(x, top_p=0.76)[0].tolist() == [True, True, True, False]  # tie: lower id
    assert np.allclose(ref.probabilities(x, top_p=0.76)[0], np.array([0.5, 0.25, 0.125, 0]) / 0.875)
    assert ref.kept_mask(x, top_p=1.0)[0].all()


def test_top_p_is_over_the_renormalised_top_k():
    x = logp([0.4, 0.3, 0.2, 0.1])
    # top-2 renormalised: 4/7, 3/7; top_p 0.6 needs both (4/7 = 0.571 < 0.6)
    assert ref.kept_mask(x, top_k=2, top_p=0.6)[0].tolist() == [True, True, False, False]
    assert ref.kept_mask(x, top_p=0.6)[0].tolist() == [True, True, False, False]
    assert ref.kept_mask(x, top_k=2, top_p=0.5)[0].tolist() == [True, False, False, False]
    # without top-k, 0.4 < 0.5 needs two tokens; over the top-2 (4/7 >= 0.5) one is enough
    assert ref.kept_mask(x, top_p=0.5)[0].tolist() == [True, True, False, False]


def test_min_p_relative_to_the_max():
    x = logp([0.5, 0.25, 0.15, 0.1])
    assert ref.kept_mask(x, min_p=0.5)[0].tolist() == [True, True, False, False]  # >= 0.25
    assert ref.kept_mask(x, min_p=0.3)[0].tolist() == [True, True, True, False]
    assert ref.kept_mask(x, min_p=0.3, top_k=2)[0].tolist() == [True, True, False, False]
    assert ref.kept_mask(x, min_p=0.99)[0].tolist() == [True, False, False, False]


def test_greedy_and_special_rows():
    x = np.array([[1, 5, 5, 2], [NAN, -INF, 3, INF], [NAN, -INF, -INF, NAN], [0, INF, 1, INF], [-INF, 2, NAN, 2]])
    assert ref.greedy(x).tolist() == [1, 3, 0, 1, 1]
    p = ref.probabilities(x, temperature=np.array([0.0, 1, 1, 1, 1]))
    assert p[0].tolist() == [0, 1, 0, 0] and p[1].tolist() == [0, 0, 0, 1]
    assert p[2].tolist() == [1, 0, 0, 0] and p[3].tolist() == [0, 1, 0, 0]
    assert np.allclose(p[4], [0, 0.5, 0, 0.5])  # NaN and -inf are never drawn
    assert ref.row_events(x).tolist() == [False, True, True, True, True]
    assert ref.row_events(np.array([[-INF, 0.0]])).tolist() == [False]  # -inf masking is not an event
    tiny = ref.probabilities(np.array([[1.0, 2.0]]), temperature=1e-39)
    assert tiny[0].tolist() == [0, 1]


def test_sanitize_invalid_device_values():
    t, k, p, m, bad = ref.sanitize(5, [NAN, -1, 1, 1, 1], [0, 0, -2, 0, 0], [1, 1, 1, 0, 1], [0, 0, 0, 0, 1.5])
    assert t.tolist() == [0, 0, 1, 1, 1] and k.tolist() == [0, 0, 0, 0, 0]
    assert p.tolist() == [1] * 5 and m.tolist() == [0] * 5
    assert bad.tolist() == [True, True, True, True, True]


def test_reference_draws_follow_the_distribution():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 8)) * 1.5
    params = dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05)
    want = ref.probabilities(x, **params)[0]
    reps = 1500
    xs = np.repeat(x, reps, axis=0)
    counts = np.zeros(8)
    for off in range(4):
        counts += np.bincount(ref.sample(xs, 11, off, **params), minlength=8)
    freq = counts / counts.sum()
    assert (freq[want == 0] == 0).all()
    assert 0.5 * np.abs(freq - want).sum() < 0.03  # 6000 draws: E[TV] ~ 0.01


def test_reference_sample_depends_on_seed_offset_and_row():
    x = np.zeros((64, 1000))
    a = ref.sample(x, 1, 0)
    assert np.array_equal(a, ref.sample(x, 1, 0))
    assert not np.array_equal(a, ref.sample(x, 1, 1))
    assert not np.array_equal(a, ref.sample(x, 2, 0))
    assert len(set(a.tolist())) > 50  # identical rows draw independently


# ---- op and layers on the host


def test_op_advances_offset_and_reproduces():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 300)).astype(np.float32)
    g = Generator(123, device=False)
    a = ops.sample(x, generator=g, top_k=20)
    assert g.get_state() == (123, 1)
    b = ops.sample(x, generator=g, top_k=20)
    assert g.get_state() == (123, 2) and not np.array_equal(a, b)
    g.set_state(offset=0)
    assert np.array_equal(ops.sample(x, generator=g, top_k=20), a)
    assert np.array_equal(a, ref.sample(x, 123, 0, top_k=20))
    assert ((a >= 0) & (a < 300)).all() and a.dtype == np.int32


def test_op_bf16_per_row_and_greedy():
    x = np.array([[0, 3, 3, 1], [9, 1, 2, 9]], BF16)
    g = Generator(0, device=False)
    assert ops.sample(x, temperature=0.0, generator=g).tolist() == [1, 0]
    out = np.full(2, -5, np.int32)
    got = ops.sample(x, temperature=np.array([0, 1], np.float32), top_k=np.array([1, 1], np.int32), generator=g, out=out)
    assert got is out and out.tolist() == [1, 0]


def test_op_status_bit_for_nan_inf_and_empty_rows():
    g = Generator(0, device=False)
    ops.sample(np.array([[0.0, -INF, 1.0]], np.float32), generator=g)
    assert host_flags() & status.SAMPLER_INPUT == 0
    assert ops.sample(np.array([[NAN, 1.0, INF, INF]], np.float32), generator=g).tolist() == [2]
    assert host_flags() & status.SAMPLER_INPUT
    status.clear(device=-1)
    assert ops.sample(np.array([[NAN, -INF]], np.float32), generator=g).tolist() == [0]
    assert host_flags() & status.SAMPLER_INPUT


def test_sampler_layer_owns_its_buffer():
    s = Sampler(Generator(5, device=False), top_k=2)
    x = np.array([[0.0, 5.0, 4.0, -1.0]] * 3, np.float32)
    out = s(x)
    assert out is s.buffers(3, device=False) and set(out.tolist()) <= {1, 2}
    assert s(x, temperature=0.0).tolist() == [1, 1, 1]
    with pytest.raises(TypeError, match="unknown parameter"):
        s(x, top_q=1)
    with pytest.raises(ValueError, match="top_p"):
        Sampler(Generator(5, device=False), top_p=0.0)


def test_sampler_writes_into_a_callers_buffer():
    """``out=``: the tokens of the call without it, in the caller's buffer; a wrong buffer is named."""
    x = np.array([[0.0, 5.0, 4.0, -1.0], [3.0, 0.0, 0.0, 3.5]], np.float32)
    want = Sampler(Generator(5, device=False), top_k=3)(x).copy()
    s = Sampler(Generator(5, device=False), top_k=3)
    mine = np.full(2, -1, np.int32)
    assert s(x, out=mine) is mine and mine.tolist() == want.tolist()
    with pytest.raises(ValueError, match="out: expected shape"):
        s(x, out=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="out: expected shape"):
        s(x, out=np.zeros(2, np.int64))


# ---- errors


X = np.zeros((2, 8), np.float32)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(top_p=0.0), ValueError, "top_p: expected 0 < top_p <= 1"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=NAN), ValueError, "top_p"),
    (dict(top_k=-1), ValueError, "top_k: expected top_k >= 0"),
    (dict(top_k=2.5), TypeError, "top_k: expected an integer"),
    (dict(top_k=True), TypeError, "top_k"),
    (dict(min_p=1.0), ValueError, "min_p: expected 0 <= min_p < 1"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(temperature=-1.0), ValueError, "temperature: expected a finite number >= 0"),
    (dict(temperature=NAN), ValueError, "temperature"),
    (dict(temperature=INF), ValueError, "temperature"),
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(temperature=np.ones(3, np.float32)), ValueError, r"temperature: expected a scalar or a per-row array of shape \(2,\)"),
    (dict(temperature=np.ones(2, np.float64)), TypeError, "temperature: expected a per-row array of dtype float32"),
    (dict(top_k=np.ones(2, np.int64)), TypeError, "top_k: expected a per-row array of dtype int32"),
    (dict(top_p=np.array([0.5, 0.0], np.float32)), ValueError, "top_p: row 1 holds an invalid value"),
    (dict(min_p=np.array([0.5, 1.0], np.float32)), ValueError, "min_p: row 1"),
    (dict(top_k=np.array([1, -1], np.int32)), ValueError, "top_k: row 1"),
    (dict(temperature=np.array([NAN, 1], np.float32)), ValueError, "temperature: row 0"),
    (dict(out=np.zeros(3, np.int32)), ValueError, r"out: expected shape \(2,\)"),
    (dict(out=np.zeros(2, np.int64)), ValueError, "out: expected shape"),
])
def test_bad_parameters(kwargs, exc, match):
    g = Generator(0, device=False)
    with pytest.raises(exc, match=match):
        ops.sample(X, generator=g, **kwargs)
    assert g.get_state() == (0, 0)  # nothing ran


def test_bad_logits_and_generator():
    g = Generator(0, device=False)
    with pytest.raises(ValueError, match="logits: expected a 2-D array"):
        ops.sample(np.zeros(8, np.float32), generator=g)
    with pytest.raises(TypeError, match="logits: expected dtype bfloat16 or float32"):
        ops.sample(np.zeros((2, 8), np.float16), generator=g)
    with pytest.raises(ValueError, match="logits: expected a vocabulary"):
        ops.sample(np.zeros((2, 0), np.float32), generator=g)
    with pytest.raises(ValueError, match="logits: expected a C-contiguous"):
        ops.sample(np.zeros((8, 2), np.float32).T, generator=g)
    with pytest.raises(TypeError, match="logits: expected a numpy"):
        ops.sample([[0.0, 1.0]], generator=g)
    with pytest.raises(TypeError, match="generator: required"):
        ops.sample(X, generator=None)
    with pytest.raises(TypeError, match="generator: expected an object with seed"):
        ops.sample(X, generator=object())
    with pytest.raises(TypeError, match="seed: expected an integer"):
        Generator(1.5, device=False)
    with pytest.raises(ValueError, match="seed: expected 0 <= seed < 2\\*\\*64"):
        Generator(-1, device=False)


# ---- kernel geometry (no GPU needed)


def test_scratch_size_matches_the_kernel():
    import re

    from fp4kit.runtime import loader

    src = loader.kernel_source("sampling")
    const = {name: int(v) for name, v in re.findall(r"constexpr int (k\w+) = (\d+);", src)}
    hdr, bins, cap, posts = const["kHdrWords"], const["kBins"], const["kCap"], const["kPostSlots"]
    assert ops.ROW_WORDS == hdr + 3 * bins + 6 * bins + 4 * cap + posts and posts == ops.POST_SLOTS
    assert const["kGatherSlots"] == ops.GATHER_SLOTS and const["kGatherMaxK"] == ops.GATHER_MAX_K
    assert [ops.gather_slots(g) for g in (1, 2, 32, 127, 256)] == [256, 512, 8192, 8192, 8192]
    assert ops.row_words(127) == ops.ROW_WORDS + 2 * 8192 and ops.ROW_WORDS % 2 == 0  # 8-byte slots
    assert const["kThreads"] == ops._THREADS and const["kMaxPer"] == ops._MAX_PER


def test_register_builds_exist_and_hold_the_launch():
    """Every build `sample` may pick is a kernel of raw_kernels/sampling.cu, and the pick holds the
    launch's tokens per thread (the smallest such build)."""
    import re

    from fp4kit.runtime import loader

    src = loader.kernel_source("sampling")
    built = {(name, p) for name, p in re.findall(r"SMP_KERNEL\((sample_\w+), \w+, (\w+)\)", src)}
    for p in ops.PER_BUILDS:
        for dtype in ("bf16", "f32"):
            name = f"sample_{dtype}" + ("" if p == ops._MAX_PER else f"_p{p}")
            assert (name, "kMaxPer" if p == ops._MAX_PER else str(p)) in built, name
    assert ops._MAX_PER in ops.PER_BUILDS
    for per in range(4, ops._MAX_PER + 1, 4):
        p = ops.register_build(per)
        assert p >= per and all(q < per or q >= p for q in ops.PER_BUILDS)
    assert [ops.register_build(per) for per in (4, 8, 12, 16)] == [4, 8, 16, 16]


@pytest.mark.parametrize("batch", [1, 2, 7, 8, 64, 256, 5000])
@pytest.mark.parametrize("vocab", [1, 3, 100, 1024, 1025, 4097, 129280, 262144, ops.MAX_VOCAB])
def test_geometry_covers_the_row_with_resident_blocks(batch, vocab):
    max_blocks = 264  # 2 blocks per SM on a 132-SM H200
    per, g, grid = ops.geometry(batch, vocab, max_blocks)
    chunk = ops._THREADS * per
    assert per % 4 == 0 and 4 <= per <= ops._MAX_PER
    assert g * chunk >= vocab > (g - 1) * chunk  # every block holds at least one token
    assert grid % g == 0 and g <= grid <= max_blocks and grid // g <= batch
    if batch <= 8 and vocab >= 129280:
        assert grid >= 64  # a small batch still spreads over many SMs


def test_geometry_rejects_a_row_that_cannot_be_resident():
    with pytest.raises(ValueError, match="resident blocks per row"):
        ops.geometry(1, ops.MAX_VOCAB, 100)


@pytest.mark.parametrize("batch", [1, 2, 3, 8, 64, 256])
@pytest.mark.parametrize("vocab", [1, 2, 3, 5, 100, 1023, 1024, 1025, 2048, 4097, 12289, 129280, 262144])
@pytest.mark.parametrize("elem", [2, 4])  # bf16, fp32
def test_geometry_indices_stay_in_bounds(batch, vocab, elem):
    """A model of the kernel's indexing (sample_rows / sample_unit / smp_load_tile): every token of
    every row is held by exactly one thread, every load (scalar or vector) is inside its row and
    aligned, every block's scratch row lies inside the generator's buffer, and 64-bit / 128-bit
    scratch fields are aligned."""
    max_blocks = 264
    per, g, grid = ops.geometry(batch, vocab, max_blocks)
    rows = grid // g
    stride = ops.row_words(g)
    words = rows * stride  # what sample() asks the generator for
    vec = vocab % 4 == 0  # and a 16-byte aligned base pointer
    seen = np.zeros(vocab, np.int64)
    for chunk in range(g):
        for tid in range(ops._THREADS):
            first = chunk * ops._THREADS * per + tid * per
            n = min(per, vocab - first) if first < vocab else 0
            assert 0 <= n <= per <= ops._MAX_PER and first % 4 == 0
            for q in range(0, ops._MAX_PER, 4):
                m = n - q
                if vec and m >= 4:
                    assert first + q + 4 <= vocab and ((first + q) * elem) % (4 * elem) == 0
                for j in range(max(0, min(4, m))):
                    assert first + q + j < vocab
            seen[first:first + n] += 1
    assert (seen == 1).all()
    # rows in rounds: group r of `rows` handles rows r, r + rows, ...; its scratch row is r
    assert 1 <= rows <= batch
    handled = sorted(b for r in range(rows) for b in range(r, batch, rows))
    assert handled == list(range(batch))
    for block in range(grid):
        base = (block // g) * stride
        assert base + stride <= words
        cand = base + ops.ROW_WORDS - ops.POST_SLOTS - 4 * 512
        gather = base + ops.ROW_WORDS  # block c's k slots from gather + 2 * c * k: inside the row's
        assert (base * 4) % 8 == 0 and (cand * 4) % 16 == 0 and (gather * 4) % 8 == 0
        k = ops.gather_slots(g) // g  # the largest k the row gathers
        assert gather + 2 * (block % g + 1) * k <= base + stride


def _function_body(src: str, name: str) -> str:
    start = src.index(name + ("" if name.startswith("struct ") else "("))
    start = src.index("{", start)
    depth = 0
    for i in range(start, len(src)):
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            return src[start:i + 1]
    raise AssertionError(name)


def test_the_finisher_clears_every_scratch_field_the_kernel_writes():
    """Scratch must be zero between launches (graph replays): every field of the row's scratch that
    any code path writes (stores or atomics) is put back by smp_finish."""
    import re

    from fp4kit.runtime import loader

    src = loader.kernel_source("sampling")
    struct = _function_body(src, "struct RowScratch")
    fields = set(re.findall(r"[*\s](\w+)\s*[,;]", re.sub(r"//[^\n]*", "", struct)))
    # stores (cx.rs.f[i] = ..., *cx.rs.f = ...) and atomics (atomicX(&cx.rs.f ..), smp_red_add(..))
    written = set(re.findall(r"cx\.rs\.(\w+)\s*(?:\[[^\]]*\]\s*)?=[^=]", src))
    written |= set(re.findall(r"(?:atomic\w+|smp_red_add)\(\s*&?cx\.rs\.(\w+)", src))
    # and writes through a non-const pointer into a field (unsigned* gc = cx.rs.count + ...)
    for alias, field in re.findall(r"(?<!const )\b\w+(?:\s+long)*\*\s*(\w+)\s*=\s*cx\.rs\.(\w+)\b", src):
        if re.search(rf"(?:atomic\w+|smp_red_add)\(\s*{alias}\b|\b{alias}\s*\[[^\]]*\]\s*=[^=]", src):
            written.add(field)
    # the patterns must see every field the kernel writes; a field they miss is a field never checked
    assert fields == {"best", "race", "arrive", "done", "ncand", "round", "count", "mass", "cand", "gather", "ngather",
                      "posts", "verdict", "ack", "front_over", "cut_n", "cut_rem"}
    assert written == fields, f"fields written but not found by the patterns: {fields - written}"
    finish = _function_body(src, "__device__ void smp_finish")
    for field in written:
        assert re.search(r"cx\.rs\.%s\b" % field, finish), f"smp_finish never resets scratch field {field!r}"
    assert re.search(r"cx\.rs\.cand\[i\]\s*=\s*make_ulonglong2\(0ull, 0ull\)", finish)
