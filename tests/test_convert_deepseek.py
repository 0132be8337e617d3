"""`fp4kit convert`: official DeepSeek checkpoints to NVFP4. A miniature checkpoint is written here
in the official V4 format and names (FP8 E4M3 linears with UE8M0 128 x 128 block scales, MXFP4
experts with a UE8M0 scale per 32, plain norms, router, hash table, sink, compressor and
hyper-connection tensors, over two shards) and in the V3 format (FP8 with fp32 weight_scale_inv);
the conversion is checked tensor by tensor: MXFP4 bit for bit, FP8 as `fp4kit.quantize` of the
exact blockwise dequantization, everything else byte for byte; resuming, and bad inputs."""

import json

import ml_dtypes
import numpy as np
import pytest

import fp4kit
from fp4kit import checkpoint
from fp4kit.checkpoint import deepseek
from fp4kit.cli import CONVERT_STATE, main
from fp4kit.formats import E4M3_VALUES
from fp4kit.reference import quant as qref

E8M0 = ml_dtypes.float8_e8m0fnu
BF16 = ml_dtypes.bfloat16


def ue8m0(exponents) -> np.ndarray:
    return (np.asarray(exponents, np.int32) + 127).astype(np.uint8).view(E8M0)


def fp8_weight(rng, n, k):
    """An FP8 E4M3 weight with UE8M0 128 x 128 block scales, as the official checkpoints hold it."""
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    bn, bk = -(-n // 128), -(-k // 128)
    exps = np.zeros((bn, bk), np.int32)
    codes = np.empty((n, k), ml_dtypes.float8_e4m3fn)
    for i in range(bn):
        for j in range(bk):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            exps[i, j] = int(np.ceil(np.log2(np.abs(block).max() / 448.0)))
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / 2.0 ** exps[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return codes, ue8m0(exps)


def mxfp4_weight(rng, n, k, spread=10):
    """FP4 codes [N, K/2] (I8, the lower nibble first) and UE8M0 scales [N, K/32]."""
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8).view(np.int8)
    exps = rng.integers(-8, -8 + spread + 1, (n, k // 32))
    exps[0, 0], exps[-1, -1] = -8, -8 + spread  # the spread is reached
    return codes, ue8m0(exps)


def write_v4(folder, rng, *, expert_spread=10):
    """A two-layer miniature of the official DeepSeek-V4 checkpoint, over two shards."""
    h, i, e, q_rank, heads, hd = 256, 128, 4, 128, 2, 64
    shards = [{}, {}]
    shards[0]["embed.weight"] = rng.standard_normal((512, h)).astype(BF16)
    shards[1]["norm.weight"] = np.ones(h, BF16)
    shards[1]["head.weight"] = rng.standard_normal((512, h)).astype(BF16)
    for layer in range(2):
        t = shards[layer]
        p = f"layers.{layer}"
        t[f"{p}.attn_norm.weight"] = np.ones(h, BF16)
        t[f"{p}.ffn_norm.weight"] = np.ones(h, BF16)
        for name, (n, k) in {"wq_a": (q_rank, h), "wq_b": (heads * hd, q_rank), "wkv": (hd, h),
                             "wo_a": (q_rank, heads * hd), "wo_b": (h, q_rank)}.items():
            t[f"{p}.attn.{name}.weight"], t[f"{p}.attn.{name}.scale"] = fp8_weight(rng, n, k)
        t[f"{p}.attn.q_norm.weight"] = np.ones(q_rank, BF16)
        t[f"{p}.attn.kv_norm.weight"] = np.ones(hd, BF16)
        t[f"{p}.attn.attn_sink"] = rng.standard_normal(heads).astype(np.float32)
        t[f"{p}.attn.compressor.wkv.weight"] = rng.standard_normal((2 * hd, h)).astype(np.float32)
        t[f"{p}.attn.compressor.ape"] = rng.standard_normal((4, 2 * hd)).astype(np.float32)
        t[f"{p}.hc_attn_fn"] = rng.standard_normal((24, 4 * h)).astype(np.float32)
        t[f"{p}.ffn.gate.weight"] = rng.standard_normal((e, h)).astype(BF16)
        t[f"{p}.ffn.gate.bias"] = rng.standard_normal(e).astype(np.float32)
        if layer == 0:
            t[f"{p}.ffn.gate.tid2eid"] = rng.integers(0, e, (512, 2)).astype(np.int32)
        for x in range(e):
            spread = expert_spread if (layer, x) != (1, 3) else 20  # one expert beyond E4M3's reach
            for name, (n, k) in {"w1": (i, h), "w3": (i, h), "w2": (h, i)}.items():
                t[f"{p}.ffn.experts.{x}.{name}.weight"], t[f"{p}.ffn.experts.{x}.{name}.scale"] = \
                    mxfp4_weight(rng, n, k, spread)
        for name, (n, k) in {"w1": (i, h), "w3": (i, h), "w2": (h, i)}.items():
            t[f"{p}.ffn.shared_experts.{name}.weight"], t[f"{p}.ffn.shared_experts.{name}.scale"] = \
                fp8_weight(rng, n, k)
    folder.mkdir()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for tensors, name in zip(shards, names):
        checkpoint.write_safetensors(folder / name, tensors)
    index = {"metadata": {}, "weight_map": {t: n for tensors, n in zip(shards, names) for t in tensors}}
    (folder / checkpoint.INDEX_NAME).write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps({"hidden_size": h, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}}))
    return {k: v for tensors in shards for k, v in tensors.items()}


def test_e4m3_powers_of_two():
    p = np.arange(-9, 9)
    assert np.array_equal(E4M3_VALUES[deepseek._e4m3_power_of_two(p)], 2.0 ** p)


@pytest.mark.parametrize("spread", [0, 9, 17])
def test_mxfp4_converts_exactly_up_to_a_spread_of_17(rng, spread):
    codes, scale = mxfp4_weight(rng, 32, 256, spread)
    q, got_spread = deepseek.mxfp4_to_nvfp4(codes, scale, "w")
    assert got_spread == spread and q is not None
    assert np.array_equal(q.packed, codes.view(np.uint8))  # the codes are kept
    want = deepseek.mxfp4_dequantize(codes, scale, "w").astype(np.float64)
    assert np.array_equal(qref.dequantize(q).astype(np.float64), want)  # every value, bit for bit


def test_mxfp4_beyond_a_spread_of_17_has_no_exact_form(rng):
    codes, scale = mxfp4_weight(rng, 32, 256, 18)
    q, spread = deepseek.mxfp4_to_nvfp4(codes, scale, "w")
    assert q is None and spread == 18
    # blocks of zero codes do not count: a huge exponent there changes nothing
    codes = np.zeros((16, 64), np.int8)
    codes[0, :16] = 0x21
    scale = ue8m0(np.full((16, 4), 100))
    scale.view(np.uint8)[0, 0] = 127
    q, spread = deepseek.mxfp4_to_nvfp4(codes, scale, "w")
    assert spread == 0 and np.array_equal(qref.dequantize(q), deepseek.mxfp4_dequantize(codes, scale, "w"))


def test_fp8_block_dequantization(rng):
    codes, scale = fp8_weight(rng, 200, 300)
    got = deepseek.fp8_dequantize(codes, scale, "s")
    s = 2.0 ** (scale.view(np.uint8).astype(np.int32) - 127)
    want = codes.astype(np.float32) * np.kron(s, np.ones((128, 128)))[:200, :300]
    assert np.array_equal(got, want.astype(np.float32))


def convert(tmp_path, src, *extra):
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--device", "cpu", *extra]) == 0
    return out


def test_v4_checkpoint_converts_tensor_by_tensor(tmp_path, rng, capsys):
    src = tmp_path / "v4"
    tensors = write_v4(src, rng)
    out = convert(tmp_path, src)
    report = capsys.readouterr().out
    assert "layers.1.ffn.experts.3.w1.weight" in report.split("re-quantized: ")[1]
    ckpt = fp4kit.load_nvfp4(out)
    files = checkpoint.CheckpointFiles(src)
    sources = deepseek.find_sources({n: (f.tensors[n].dtype, f.tensors[n].shape) for n, f in files.where.items()})
    assert set(ckpt.weights) == {s.prefix for s in sources.values()}
    methods = {"exact": 0, "re-quantized": 0, "fp8": 0}
    for name, s in sources.items():
        w, scale = tensors[name], tensors[s.scale_name]
        got = ckpt.weights[s.prefix]
        if s.format == "mxfp4":
            values = deepseek.mxfp4_dequantize(w, scale, name)
            exact, _ = deepseek.mxfp4_to_nvfp4(w, scale, name)
            if exact is not None:
                assert np.array_equal(qref.dequantize(got), values), name  # bit for bit
                methods["exact"] += 1
                continue
            methods["re-quantized"] += 1
        else:
            values = deepseek.fp8_dequantize(w, scale, name)
            methods["fp8"] += 1
        want = qref.quantize(values)  # the TE recipe on the exact values
        assert np.array_equal(got.packed, want.packed) and np.array_equal(got.block_scales, want.block_scales), name
        assert got.global_scale == want.global_scale, name
    assert methods == {"exact": 2 * 4 * 3 - 3, "re-quantized": 3, "fp8": 2 * (5 + 3)}
    consumed = {s.scale_name for s in sources.values()}
    for name, t in tensors.items():
        if name not in sources and name not in consumed:
            assert ckpt.extra[name].dtype == t.dtype and np.array_equal(ckpt.extra[name].view(np.uint8),
                                                                        t.view(np.uint8)), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt" and config["hidden_size"] == 256
    quant = json.loads((out / checkpoint.QUANT_CONFIG_NAME).read_text())
    assert quant["quantization"]["quant_algo"] in ("NVFP4", "W4A16_NVFP4")


def test_a_stopped_conversion_resumes(tmp_path, rng, capsys):
    src = tmp_path / "v4"
    write_v4(src, rng)
    out = convert(tmp_path, src)
    first = {p.name: p.read_bytes() for p in out.glob("*.safetensors")}
    (out / "model-00002-of-00002.safetensors").unlink()  # as if the run had stopped there
    capsys.readouterr()
    convert(tmp_path, src)
    log = capsys.readouterr().out
    assert "model-00001-of-00002.safetensors: converted by an earlier run, kept" in log
    assert "model-00002-of-00002.safetensors: " in log and "weight(s) converted" in log
    assert {p.name: p.read_bytes() for p in out.glob("*.safetensors")} == first
    assert json.loads((out / CONVERT_STATE).read_text())["done"].keys() == {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}


def test_parallel_jobs_write_the_same_bytes(tmp_path, rng):
    src = tmp_path / "v4"
    write_v4(src, rng)
    one = convert(tmp_path, src)
    many = tmp_path / "many"
    assert main(["convert", str(src), str(many), "--device", "cpu", "--jobs", "2"]) == 0
    for p in one.glob("*.safetensors"):
        assert (many / p.name).read_bytes() == p.read_bytes()
    assert (many / checkpoint.INDEX_NAME).read_text() == (one / checkpoint.INDEX_NAME).read_text()


def test_v3_checkpoint_converts(tmp_path, rng):
    src = tmp_path / "v3"
    src.mkdir()
    codes, scale = fp8_weight(rng, 256, 384)
    inv = (2.0 ** (scale.view(np.uint8).astype(np.int32) - 127) * 1.25).astype(np.float32)  # any fp32 scale
    checkpoint.write_safetensors(src / "model.safetensors", {
        "model.layers.0.mlp.down_proj.weight": codes, "model.layers.0.mlp.down_proj.weight_scale_inv": inv,
        "model.norm.weight": np.ones(256, BF16)})
    out = convert(tmp_path, src)
    ckpt = fp4kit.load_nvfp4(out)
    want = qref.quantize(codes.astype(np.float32) * np.kron(inv, np.ones((128, 128), np.float32))[:256, :384])
    got = ckpt.weights["model.layers.0.mlp.down_proj"]
    assert np.array_equal(got.packed, want.packed) and np.array_equal(got.block_scales, want.block_scales)
    assert set(ckpt.extra) == {"model.norm.weight"}


def test_bad_inputs_are_refused_naming_the_tensor(tmp_path, rng):
    src = tmp_path / "bad"
    src.mkdir()
    codes, scale = mxfp4_weight(rng, 32, 64)
    scale.view(np.uint8)[3, 1] = 0xFF  # the UE8M0 NaN byte
    checkpoint.write_safetensors(src / "model.safetensors", {"e.w1.weight": codes, "e.w1.scale": scale})
    assert main(["convert", str(src), str(tmp_path / "o1"), "--device", "cpu"]) == 1
    with pytest.raises(ValueError, match="e.w1.*0xFF"):
        deepseek.mxfp4_to_nvfp4(codes, scale, "e.w1 (e.w1.scale)")
    with pytest.raises(ValueError, match=r"a\.weight \(F8_E4M3 \[256, 256\]\) with a\.scale .*one scale per 128 x 128"):
        deepseek.find_sources({"a.weight": ("F8_E4M3", (256, 256)), "a.scale": ("F8_E8M0", (1, 1))})
    with pytest.raises(ValueError, match="no DeepSeek FP8 or FP4 weight"):
        plain = tmp_path / "plain"
        plain.mkdir()
        checkpoint.write_safetensors(plain / "model.safetensors", {"x.weight": np.ones((16, 16), np.float32)})
        from fp4kit.cli import cmd_convert, build_parser
        cmd_convert(build_parser().parse_args(["convert", str(plain), str(tmp_path / "o2")]))
    # an OUT holding another conversion is refused, not overwritten
    good = tmp_path / "v4"
    write_v4(good, rng)
    out = convert(tmp_path, good)
    state = json.loads((out / CONVERT_STATE).read_text())
    state["inputs"] = {"other.safetensors": 1}
    (out / CONVERT_STATE).write_text(json.dumps(state))
    assert main(["convert", str(good), str(out), "--device", "cpu"]) == 1


# --------------------------------------------------------------------------------------------
# the overlapped conversion (memory-mapped input, read-ahead, write-behind, jobs)
# --------------------------------------------------------------------------------------------


def test_mxfp4_block_scales_with_blocks_of_zero_codes(rng):
    """Blocks of zero codes get block scale 0 and do not count towards the spread; the others get
    2^(e - e_max + 8) on both of their 16-element halves."""
    codes, scale = mxfp4_weight(rng, 64, 512, 12)
    blocks = codes.view(np.uint8).reshape(64, 16, 16)
    dead = rng.random((64, 16)) < 0.3
    blocks[dead] = 0
    q, spread = deepseek.mxfp4_to_nvfp4(codes, scale, "w")
    e = scale.view(np.uint8).astype(np.int32) - 127
    assert spread == e[~dead].max() - e[~dead].min()
    want = np.where(dead, 0.0, 2.0 ** (e - e[~dead].max() + 8))
    assert np.array_equal(E4M3_VALUES[q.block_scales], np.repeat(want, 2, axis=1))
    assert np.array_equal(qref.dequantize(q), deepseek.mxfp4_dequantize(codes, scale, "w"))


def test_mapped_tensors_equal_read_ones_and_a_truncated_file_is_refused(tmp_path, rng):
    path = tmp_path / "t.safetensors"
    tensors = {"a": rng.standard_normal((3, 5)).astype(BF16), "b": np.arange(7, dtype=np.uint8),
               "c": np.array(1.5, np.float32), "d": np.zeros((0, 4), np.float32)}
    tensors["e"], tensors["e.scale"] = fp8_weight(rng, 130, 128)
    checkpoint.write_safetensors(path, tensors)
    f = checkpoint.SafetensorsFile(path)
    mapped = f.map()
    assert list(mapped) == list(tensors)
    for name, t in tensors.items():
        assert mapped[name].dtype == t.dtype and mapped[name].shape == t.shape, name
        assert np.array_equal(mapped[name].reshape(-1).view(np.uint8), t.reshape(-1).view(np.uint8)), name
    mapped["b"][0] = 9  # a private copy of the page: the file keeps its bytes
    assert checkpoint.SafetensorsFile(path).read("b")[0] == 0
    with open(path, "r+b") as h:
        h.truncate(path.stat().st_size - 1)
    with pytest.raises(ValueError, match="truncated"):
        f.map()


def sequential_conversion(src, out_name, index):
    """One output shard the plain way: every tensor read (no map) and converted in file order,
    written once; what the overlapped conversion must reproduce byte for byte."""
    files = checkpoint.CheckpointFiles(src)
    sources = deepseek.find_sources({n: (f.tensors[n].dtype, f.tensors[n].shape) for n, f in files.where.items()})
    consumed = {s.scale_name for s in sources.values()}
    f = files.files[index]
    weights, extra = {}, {}
    for name in f.tensors:
        if name in consumed:
            continue
        if name not in sources:
            extra[name] = f.read(name)
            continue
        s = sources[name]
        c = deepseek.convert_weight(s, f.read(name), files.where[s.scale_name].read(s.scale_name),
                                    lambda where, w: (qref.quantize(w), 0.0))
        weights[c.prefix] = c.weight
    tensors, metadata = checkpoint.to_modelopt_tensors(weights, extra=extra)
    path = src.parent / f"expected-{out_name}"
    checkpoint.write_safetensors(path, tensors, metadata)
    return path.read_bytes()


@pytest.mark.parametrize("jobs", ["1", "3"])
def test_overlapped_conversion_writes_the_plain_conversions_bytes(tmp_path, rng, jobs):
    src = tmp_path / "v4"
    write_v4(src, rng)
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--device", "cpu", "--jobs", jobs]) == 0
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for index, name in enumerate(names):
        assert (out / name).read_bytes() == sequential_conversion(src, name, index), name
    assert not list(out.glob("*.partial*")) and not list(out.glob("*.tmp"))
    state = json.loads((out / CONVERT_STATE).read_text())
    assert list(state["done"]) == names


def _poke_scale(src, name, value):
    """Overwrites the first byte of tensor ``name`` in the input shard that holds it (same size)."""
    files = checkpoint.CheckpointFiles(src)
    info = files.where[name].tensors[name]
    with open(files.where[name].path, "r+b") as h:
        h.seek(info.begin)
        h.write(bytes([value]))


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_run_that_fails_on_a_later_shard_records_the_earlier_one_and_resumes(tmp_path, rng, capsys, jobs):
    """A shard written before (or while) another fails is still recorded; the failed one leaves no
    file; once the input is fixed, a second run keeps the first shard and converts the other to
    the bytes of an uninterrupted run."""
    src = tmp_path / "v4"
    write_v4(src, rng)
    bad = "layers.1.ffn.experts.0.w2.scale"  # in the second shard
    original = checkpoint.CheckpointFiles(src).where[bad].read(bad).view(np.uint8)[0, 0]
    _poke_scale(src, bad, 0xFF)  # the UE8M0 NaN byte
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--device", "cpu", "--jobs", jobs]) == 1
    assert "0xFF" in capsys.readouterr().err
    state = json.loads((out / CONVERT_STATE).read_text())
    assert list(state["done"]) == ["model-00001-of-00002.safetensors"]
    assert not (out / "model-00002-of-00002.safetensors").exists()
    assert not list(out.glob("*.partial*"))
    first = (out / "model-00001-of-00002.safetensors").read_bytes()
    _poke_scale(src, bad, int(original))
    assert main(["convert", str(src), str(out), "--device", "cpu", "--jobs", jobs]) == 0
    log = capsys.readouterr().out
    assert "model-00001-of-00002.safetensors: converted by an earlier run, kept" in log
    assert (out / "model-00001-of-00002.safetensors").read_bytes() == first
    (tmp_path / "again").mkdir()
    again = convert(tmp_path / "again", src)  # uninterrupted
    for p in again.glob("*.safetensors"):
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
