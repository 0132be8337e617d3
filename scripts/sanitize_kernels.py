"""Every kernel family once, with shapes small enough for compute-sanitizer, each result checked
against the numpy backend: the workload `scripts/gpu_suite.sh sanitize` runs under memcheck and
racecheck.

    compute-sanitizer --tool memcheck --error-exitcode 9 .venv/bin/python scripts/sanitize_kernels.py
    compute-sanitizer --tool racecheck --error-exitcode 9 .venv/bin/python scripts/sanitize_kernels.py
    .venv/bin/python scripts/sanitize_kernels.py --numpy      # the same calls on numpy only (CPU test)
    .venv/bin/python scripts/sanitize_kernels.py --only quant,moe

On the device the script first calls ``cupy.cuda.set_allocator(None)``: memcheck cannot see an
out-of-bounds write that lands inside CuPy's memory pool, so every array gets its own cudaMalloc.
A family whose device result differs from the numpy one (beyond its documented tolerance) fails
the script, so a sanitizer run that "passes" also ran the kernels on meaningful data.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fp4kit  # noqa: E402
from fp4kit.layers import (  # noqa: E402
    Generator, Indexer, KVCache, Linear, MoE, RoutingConfig, Sampler, SharedExpert, SparseAttention)
from fp4kit.layers import moe as moe_layer  # noqa: E402
from fp4kit.layers.kv_cache import append_compressed  # noqa: E402
from fp4kit.ops import elementwise, gemm as gemm_ops, quant  # noqa: E402
from fp4kit.reference.gemm import calc_diff  # noqa: E402

BF16 = ml_dtypes.bfloat16
FAMILIES = ("quant", "gemm", "moe", "kv_cache", "indexer", "attention", "sampling", "elementwise", "hyper", "qat",
            "dist")


class Backend:
    """``to(a)`` moves a host array to the backend under test; ``host(a)`` brings a result back."""

    def __init__(self, device: bool):
        self.device = device
        if device:
            import cupy

            cupy.cuda.set_allocator(None)  # see the module docstring
            self.cp = cupy

    def to(self, a):
        return self.cp.asarray(a) if self.device else a

    def host(self, a):
        if isinstance(a, fp4kit.Nvfp4Tensor):
            return fp4kit.Nvfp4Tensor(self.host(a.packed), self.host(a.block_scales), self.host(a.global_scale),
                                      a.scale_layout, a.shape)
        return self.cp.asnumpy(a) if self.device else np.asarray(a)


def same_bits(a, b, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.tobytes() != b.tobytes():
        raise AssertionError(f"{what}: device and numpy results differ")


def close(a, b, what: str, bound: float) -> None:
    d = calc_diff(np.asarray(a, np.float64), np.asarray(b, np.float64))
    if not d <= bound:
        raise AssertionError(f"{what}: calc_diff {d:.3g} > {bound:g}")


def run_quant(be: Backend, rng) -> None:
    for shape in ((1, 16), (3, 64), (130, 48)):  # one block, several rows, a swizzle padding tile
        x = rng.standard_normal(shape).astype(BF16)
        d = be.to(x)
        same_bits(be.host(fp4kit.amax(d)), fp4kit.amax(x), "amax")
        s = fp4kit.global_scale_from_amax(fp4kit.amax(x))
        same_bits(be.host(fp4kit.global_scale_from_amax(fp4kit.amax(d))), s, "global_scale_from_amax")
        for layout in ("linear", "swizzled"):
            for scale in (None, s):
                got = be.host(fp4kit.quantize(d, global_scale=None if scale is None else be.to(scale),
                                              scale_layout=layout))
                want = fp4kit.quantize(x, global_scale=scale, scale_layout=layout)
                same_bits(got.packed, want.packed, f"quantize {shape} {layout}")
                same_bits(got.block_scales, want.block_scales, f"quantize {shape} {layout} scales")
            q = fp4kit.quantize(x, scale_layout=layout)
            same_bits(be.host(fp4kit.dequantize(_to_tensor(be, q), BF16)).view(np.uint16),
                      fp4kit.dequantize(q, BF16).view(np.uint16), "dequantize")
    for layout in ("interleaved", "concatenated"):
        h = rng.standard_normal((5, 64)).astype(np.float32) * 4
        rs = rng.random(5).astype(np.float32)
        got = be.host(fp4kit.swiglu_quantize(be.to(h), layout=layout, limit=3.0, row_scale=be.to(rs)))
        want = fp4kit.swiglu_quantize(h, layout=layout, limit=3.0, row_scale=rs)
        same_bits(got.packed, want.packed, f"swiglu_quantize {layout}")
        same_bits(be.host(quant.swiglu(be.to(h), layout=layout, limit=3.0)).view(np.uint16),
                  quant.swiglu(h, layout=layout, limit=3.0).view(np.uint16), f"swiglu {layout}")


def _to_tensor(be: Backend, q):
    return fp4kit.Nvfp4Tensor(be.to(q.packed), be.to(q.block_scales), be.to(q.global_scale), q.scale_layout, q.shape)


def run_gemm(be: Backend, rng) -> None:
    # 48 x 64: one row group, K unsplit; 256 x 2048: K split 8 ways (mma.sync: the global scratch;
    # wgmma: one cluster). M: mma.sync (1, 3), wgmma (17, 70), two wgmma token chunks (200), and
    # the dequantize + cuBLAS path (70 with decode_max_m = 64; on the small shape only: racecheck
    # reports 192 hazards inside cuBLAS's nvjet_sm90 kernel that 256 x 2048 selects, not in ours).
    for n, k in ((48, 64), (256, 2048)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32)
        for mode in ("w4a4", "w4a16"):
            lin_h = Linear.from_float(w, bias=bias, mode=mode)
            lin_d = Linear.from_float(be.to(w), bias=be.to(bias), mode=mode)
            for m, decode_max_m in ((1, 1024), (3, 1024), (17, 1024), (70, 1024), (200, 1024), (70, 64)):
                if decode_max_m < m and n > 48:
                    continue  # racecheck reports hazards inside cuBLAS's own sm90 kernel at this shape
                lin_d.decode_max_m = decode_max_m
                x = rng.standard_normal((m, k)).astype(BF16)
                close(be.host(lin_d(be.to(x))).astype(np.float32), lin_h(x).astype(np.float32),
                      f"Linear {n}x{k} {mode} M={m} decode_max_m={decode_max_m}", 1e-5)
    # the GEMV kernels (M <= 8) with K split over blocks as well (by default only for tiny grids)
    saved = gemm_ops.GEMV_SPLIT_BELOW_BLOCKS_PER_SM
    gemm_ops.GEMV_SPLIT_BELOW_BLOCKS_PER_SM = 1 << 30
    try:
        w = rng.standard_normal((40, 4096)).astype(np.float32)
        for mode in ("w4a4", "w4a16"):
            lin_h, lin_d = Linear.from_float(w, mode=mode), Linear.from_float(be.to(w), mode=mode)
            for m in (1, 5):
                x = rng.standard_normal((m, 4096)).astype(BF16)
                close(be.host(lin_d(be.to(x))).astype(np.float32), lin_h(x).astype(np.float32),
                      f"Linear 40x4096 {mode} M={m}, GEMV with K split over blocks", 1e-5)
    finally:
        gemm_ops.GEMV_SPLIT_BELOW_BLOCKS_PER_SM = saved
    for mode in ("w4a4", "w4a16"):
        g, u, dn = (rng.standard_normal(s).astype(np.float32) for s in ((32, 64), (32, 64), (64, 32)))
        se_h = SharedExpert.from_float(g, u, dn, limit=4.0, mode=mode)
        se_d = SharedExpert.from_float(be.to(g), be.to(u), be.to(dn), limit=4.0, mode=mode)
        x = rng.standard_normal((2, 64)).astype(BF16)
        close(be.host(se_d(be.to(x))).astype(np.float32), se_h(x).astype(np.float32), f"SharedExpert {mode}", 1e-4)


def _moe_weights(rng, e=8, h=64, i=32):
    return (rng.standard_normal((e, h)).astype(np.float32), rng.standard_normal((e, i, h)).astype(np.float32) / 8,
            rng.standard_normal((e, i, h)).astype(np.float32) / 8, rng.standard_normal((e, h, i)).astype(np.float32) / 8)


def run_moe(be: Backend, rng) -> None:
    weights = _moe_weights(rng)
    tid2eid = rng.integers(0, 8, (50, 2)).astype(np.int32)
    for fused in (True, False):
        for routing, kw in ((RoutingConfig(top_k=2, routed_scale=1.5), {"limit": 4.0}),
                            (RoutingConfig(top_k=4, score_func="sigmoid", n_group=4, topk_group=2),
                             {"weight_before_down": False}),
                            (RoutingConfig(top_k=2), {"tid2eid": tid2eid})):
            host = MoE.from_float(*weights, routing, fused=fused, **kw)
            dev_kw = {k: be.to(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
            dev = MoE.from_float(*(be.to(w) for w in weights), routing, fused=fused, **dev_kw)
            x = rng.standard_normal((3, 64)).astype(BF16)
            ids = rng.integers(0, 50, 3).astype(np.int32) if "tid2eid" in kw else None
            got = be.host(dev(be.to(x), None if ids is None else be.to(ids)))
            close(got.astype(np.float32), host(x, ids).astype(np.float32), f"MoE fused={fused} {routing}", 1e-4)
    # a shared expert of the layer's widths: folded into the small-T launches as one more expert
    g, u, dn = (rng.standard_normal(s).astype(np.float32) / 8 for s in ((32, 64), (32, 64), (64, 32)))
    for mode in ("w4a4", "w4a16"):
        host = MoE.from_float(*weights, RoutingConfig(top_k=2), mode=mode,
                              shared=SharedExpert.from_float(g, u, dn, limit=4.0, mode=mode))
        dev = MoE.from_float(*(be.to(w) for w in weights), RoutingConfig(top_k=2), mode=mode,
                             shared=SharedExpert.from_float(be.to(g), be.to(u), be.to(dn), limit=4.0, mode=mode))
        x = rng.standard_normal((3, 64)).astype(BF16)
        close(be.host(dev(be.to(x))).astype(np.float32), host(x).astype(np.float32), f"MoE + shared expert {mode}", 1e-4)
    # the expert-sorted path in W4A16: SwiGLU in a launch of its own or in the gate|up grouped GEMM's
    # epilogue, the shared expert apart or folded into the grouped GEMMs, the dispatch in a launch of
    # its own or in the router's last block, the combine in a launch of its own or in the down GEMM
    host = MoE.from_float(*weights, RoutingConfig(top_k=2), mode="w4a16", limit=4.0,
                          shared=SharedExpert.from_float(g, u, dn, limit=3.0, mode="w4a16"))
    dev = MoE.from_float(*(be.to(w) for w in weights), RoutingConfig(top_k=2), mode="w4a16", limit=4.0,
                         shared=SharedExpert.from_float(be.to(g), be.to(u), be.to(dn), limit=3.0, mode="w4a16"))
    dev.small_max_assignments = 0
    x = rng.standard_normal((5, 64)).astype(BF16)
    names = ("GROUPED_SWIGLU_EPILOGUE", "GROUPED_FOLD_SHARED", "ROUTER_DISPATCH_MAX_PAIRS", "GROUPED_COMBINE_IN_GEMM")
    saved = [getattr(moe_layer, n) for n in names]
    try:
        for setting in ((False, False, 0, False), (True, False, 0, True), (True, True, 1 << 30, True)):
            for n, v in zip(names, setting):
                setattr(moe_layer, n, v)
            close(be.host(dev(be.to(x))).astype(np.float32), host(x).astype(np.float32),
                  f"MoE sorted path, {dict(zip(names, setting))}", 1e-4)
    finally:
        for n, v in zip(names, saved):
            setattr(moe_layer, n, v)


def run_kv_cache(be: Backend, rng) -> None:
    for ratio in (0, 4, 128):
        kw = dict(window=8, head_dim=64, ratio=ratio, max_comp=4, rope_dim=16)
        host, dev = KVCache(2, device=False, **kw), KVCache(2, device=be.device, **kw)
        for t, counts in ((5, None), (1, None), (3, np.array([3, 1], np.int32)), (130, None)):
            kv = rng.standard_normal((2, t, 64)).astype(BF16)
            extra = {}
            if ratio:
                c = rng.standard_normal((2, t, host.compress_width)).astype(np.float32)
                z = rng.standard_normal((2, t, host.compress_width)).astype(np.float32)
                extra = {"comp_kv": c, "comp_score": z}
            host.append(kv, counts=counts, **extra)
            dev.append(be.to(kv), counts=None if counts is None else be.to(counts),
                       **{k: be.to(v) for k, v in extra.items()})
        back = np.array([1, 0], np.int32)  # one token taken back in the first sequence (kv_rewind)
        host.rewind(back)
        dev.rewind(be.to(back))
        same_bits(be.host(dev.pos), host.pos, f"KVCache ratio {ratio} pos")
        same_bits(be.host(dev.swa).view(np.uint16), host.swa.view(np.uint16), f"KVCache ratio {ratio} window")
        if ratio:  # max_comp 4 overflows: entries dropped on both, none overwritten
            same_bits(be.host(dev.comp_len), host.comp_len, f"KVCache ratio {ratio} comp_len")
            got, want = be.host(dev.comp).astype(np.float64), host.comp.astype(np.float64)
            # tests/test_kv_cache_gpu.py's bound: one bf16 ulp, plus the fp32 rounding of the pooled sum
            ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.maximum(np.abs(got), np.abs(want)), 2.0**-126))) - 7)
            if not (np.abs(got - want) <= ulp + 16 * 8 * 2.0**-24).all():
                raise AssertionError(f"KVCache ratio {ratio}: compressed entries differ by more than one bf16 ulp")
    # two caches' compressors in one launch (bf16 inputs), against the two appends on numpy
    kw = dict(window=8, ratio=4, max_comp=4, rope_dim=16)
    pairs = [(KVCache(2, device=False, head_dim=d, **kw), KVCache(2, device=be.device, head_dim=d, **kw)) for d in (64, 32)]
    for t in (5, 1, 3):
        data = [tuple(rng.standard_normal((2, t, h.compress_width)).astype(BF16) for _ in range(2)) for h, _ in pairs]
        for (host, _), (c, z) in zip(pairs, data):
            host.append(None, c, z)
        append_compressed(*((dev, be.to(c), be.to(z)) for (_, dev), (c, z) in zip(pairs, data)))
    for host, dev in pairs:
        same_bits(be.host(dev.pos), host.pos, "append_compressed pos")
        same_bits(be.host(dev.comp_len), host.comp_len, "append_compressed comp_len")


def run_indexer(be: Backend, rng) -> None:
    idx = Indexer(8, capacity=96, heads=8, head_dim=32)
    q = rng.standard_normal((2, 8, 32)).astype(BF16)
    w = rng.standard_normal((2, 8)).astype(np.float32)
    keys = rng.standard_normal((2, 96, 32)).astype(BF16)
    lengths = np.array([5, 96], np.int32)
    got = be.host(idx.score_topk(be.to(q), be.to(w), be.to(keys), be.to(lengths)))
    want = idx.score_topk(q, w, keys, lengths)
    same_bits(got[0], want[0], "Indexer, fewer live entries than k")
    # near-ties may order differently in fp32: compare the selected sets of the full row
    if len(set(got[1]) ^ set(want[1])) > 2:
        raise AssertionError("Indexer: device and numpy selections differ beyond a near-tie")
    # a capacity that selects in a thread-block cluster (distributed shared memory, cluster barriers)
    from fp4kit.ops import indexer as indexer_ops

    capacity = indexer_ops.CLUSTER_MIN_CAPACITY
    idx = Indexer(64, capacity=capacity, heads=8, head_dim=32)
    keys = rng.standard_normal((2, capacity, 32)).astype(BF16)
    lengths = np.array([capacity - 3, 4097], np.int32)
    got = be.host(idx.score_topk(be.to(q), be.to(w), be.to(keys), be.to(lengths)))
    want = idx.score_topk(q, w, keys, lengths)
    for b in range(2):
        if len(set(got[b]) ^ set(want[b])) > 2:
            raise AssertionError("Indexer (cluster select): device and numpy selections differ beyond a near-tie")


def run_attention(be: Backend, rng) -> None:
    layer = SparseAttention(16, 64, sink=rng.standard_normal(16).astype(np.float32))
    q = rng.standard_normal((2, 16, 64)).astype(BF16)
    swa = rng.standard_normal((2, 8, 64)).astype(BF16)
    comp = rng.standard_normal((2, 40, 64)).astype(BF16)
    pos, comp_len = np.array([3, 20], np.int32), np.array([40, 7], np.int32)
    indices = np.stack([rng.permutation(40)[:70 // 2], np.r_[np.arange(7), -np.ones(28, int)]]).astype(np.int32)
    want = layer(q, swa, pos, comp, comp_len, indices).astype(np.float32)
    args = [be.to(a) for a in (q, swa, pos, comp, comp_len, indices)]
    close(be.host(layer(*args)).astype(np.float32), want, "SparseAttention", 1e-5)
    if be.device:  # the split path and its combine kernel
        from fp4kit.ops.attention import sparse_decode_attention

        got = sparse_decode_attention(*args, be.to(layer.sink), num_splits=3)
        close(be.host(got).astype(np.float32), want, "SparseAttention, 3 splits", 1e-5)


def run_sampling(be: Backend, rng) -> None:
    logits = (rng.standard_normal((3, 1000)) * 3).astype(np.float32)
    logits[1, 17] = 40.0  # a certain token
    for kw in ({"temperature": 0.0}, {"temperature": 0.8}, {"top_k": 20}, {"top_p": 0.7}, {"min_p": 0.1}):
        sampler = Sampler(Generator(7, device=be.device), **kw)
        got = be.host(sampler(be.to(logits)))
        if not (got.shape == (3,) and ((got >= 0) & (got < 1000)).all() and got[1] == 17):
            raise AssertionError(f"Sampler {kw}: tokens {got}")
        if kw == {"temperature": 0.0}:
            same_bits(got, logits.argmax(-1).astype(np.int32), "greedy sampling")
    # Rows split over several blocks (16 at batch 2 on an H100): the row barriers, the gathered
    # top-k, top-p racing first with its verdict, the histogram path; row 1 has 700 tied top
    # tokens, more than a boundary bin's exact cut takes, so top-p falls back to the radix passes.
    wide = (rng.standard_normal((2, 16384)) * 3).astype(np.float32)
    wide[1, 100:800] = 20.0
    for kw in ({"temperature": 0.8}, {"top_k": 50}, {"top_p": 0.9}, {"top_k": 50, "top_p": 0.9}, {"top_p": 0.3},
               {"top_k": 1000}, {"top_p": 0.95, "min_p": 0.02}):
        sampler = Sampler(Generator(11, device=be.device), temperature=kw.get("temperature", 1.0),
                          top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0), min_p=kw.get("min_p", 0.0))
        for _ in range(2):
            got = be.host(sampler(be.to(wide)))
            for row, token in enumerate(got):
                rank, allowed = kept_rank(wide[row], int(token), **kw)
                if not rank < allowed + 1:  # one token of slack: float64 here, fixed-point masses there
                    raise AssertionError(f"Sampler {kw}: row {row} drew token {token} of rank {rank}, "
                                         f"{allowed} kept")


def kept_rank(logits: np.ndarray, token: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0) -> tuple[int, int]:
    """The rank of ``token`` in the order larger logit first, ties to the lower id, and how many
    tokens of that order the filters keep (top-k, then top-p over the survivors, then min-p), in
    float64."""
    order = np.lexsort((np.arange(logits.size), -logits.astype(np.float64)))
    rank = int(np.nonzero(order == token)[0][0])
    kept = logits.size if top_k <= 0 else min(top_k, logits.size)
    mass = np.exp((logits[order[:kept]].astype(np.float64) - float(logits.max())) / temperature)
    if top_p < 1.0:
        before = np.cumsum(mass) - mass
        kept = int((before < top_p * mass.sum()).sum())
    if min_p > 0.0:
        kept = min(kept, int((mass >= min_p).sum()))
    return rank, kept


def run_elementwise(be: Backend, rng) -> None:
    x = rng.standard_normal((3, 4, 64)).astype(BF16)
    wt = rng.random(64).astype(np.float32) + 0.5
    positions = np.array([0, 5, 300], np.int32)
    got = elementwise.rmsnorm_rope(be.to(x), be.to(wt), be.to(positions), rope_dim=32)
    close(be.host(got).astype(np.float32), elementwise.rmsnorm_rope(x, wt, positions, rope_dim=32).astype(np.float32),
          "rmsnorm_rope", 1e-5)
    resid = rng.standard_normal((3, 64)).astype(np.float32)
    delta = rng.standard_normal((3, 64)).astype(BF16)
    d_resid = be.to(resid.copy())
    got = elementwise.add_rmsnorm(d_resid, be.to(delta), be.to(wt))
    want = elementwise.add_rmsnorm(resid, delta, wt)
    close(be.host(got).astype(np.float32), want.astype(np.float32), "add_rmsnorm", 1e-5)
    close(be.host(d_resid), resid, "add_rmsnorm residual", 1e-9)
    table = rng.standard_normal((10, 64)).astype(BF16)
    tokens = np.array([3, 0, 9, 12], np.int32)  # 12: out of range, reads row 0
    same_bits(be.host(elementwise.embed(be.to(table), be.to(tokens))), elementwise.embed(table, tokens), "embed")
    d_resid = be.to(np.zeros((4, 64), np.float32))
    got = elementwise.embed_rmsnorm(be.to(table), be.to(tokens), be.to(wt), resid=d_resid)
    want = elementwise.add_rmsnorm(elementwise.embed(table, tokens), None, wt)
    close(be.host(got).astype(np.float32), want.astype(np.float32), "embed_rmsnorm", 1e-5)
    same_bits(be.host(d_resid), elementwise.embed(table, tokens), "embed_rmsnorm residual")


def run_hyper(be: Backend, rng) -> None:
    from fp4kit.ops import hyper

    rows, d, m = 2, 200, hyper.SITE_MIXES  # 200 channels: partial blocks of both kernels
    fn = (rng.standard_normal((m, 4 * d)) / np.sqrt(4 * d)).astype(np.float32)
    scale, base = np.array([0.5, 0.3, 0.2], np.float32), (rng.standard_normal(m) * 0.1).astype(np.float32)
    norm = (rng.random(d) + 0.5).astype(np.float32)
    x = rng.standard_normal((rows, 4, d)).astype(np.float32)
    y = rng.standard_normal((rows, d)).astype(BF16)
    post, comb = rng.random((rows, 4)).astype(np.float32), np.full((rows, 4, 4), 0.25, np.float32)
    d_x = be.to(x.copy())
    got = hyper.hc_site(d_x, *(be.to(a) for a in (fn, scale, base, norm)), y=be.to(y), post=be.to(post),
                        comb=be.to(comb))
    want = hyper.hc_site(x, fn, scale, base, norm, y=y, post=post, comb=comb)
    close(be.host(d_x), x, "hc_site copies", 1e-9)
    close(be.host(got[0]).astype(np.float32), want[0].astype(np.float32), "hc_site input", 1e-5)
    close(be.host(got[2]), want[2], "hc_site comb", 1e-9)


def run_qat(be: Backend, rng) -> None:
    from fp4kit.ops import qat

    latent = rng.standard_normal((3, 5, 192)).astype(BF16)  # 128 channels outside a RoPE of 64
    before, after = np.array([0, 2, 4], np.int32), np.array([1, 4, 7], np.int32)  # 4 .. 6: past cap 5
    d_latent = be.to(latent.copy())
    qat.latent_entries(d_latent, be.to(before), be.to(after), 64, max_new=3)
    same_bits(be.host(d_latent), qat.latent_entries(latent, before, after, 64, max_new=3), "latent_entries")
    keys = rng.standard_normal((3, 5, 128)).astype(BF16)
    d_keys = be.to(keys.copy())
    qat.index_entries(d_keys, be.to(before), be.to(after), max_new=3)
    same_bits(be.host(d_keys), qat.index_entries(keys, before, after, max_new=3), "index_entries")


def run_dist(be: Backend, rng) -> None:
    from fp4kit import distributed as dist

    weights = _moe_weights(rng)
    routing = RoutingConfig(top_k=2)
    dev = MoE.from_float(*(be.to(w) for w in weights), routing)
    x = rng.standard_normal((3, 64)).astype(BF16)
    want = be.host(dev(be.to(x)))  # sharding changes no value: bit for bit the single-device layer
    for tokens in ("sharded", "replicated"):  # world size 1: the same kernels as on several GPUs
        ep = dist.ExpertParallelMoE.shard(dev, dist.LocalCommunicator(), tokens=tokens)
        same_bits(be.host(ep(be.to(x))).view(np.uint16), want.view(np.uint16), f"ExpertParallelMoE {tokens}")
    # the tensor-parallel Linear pair at world size 1 (the row-parallel layer's bias + bf16 kernel)
    w_up, w_down = rng.standard_normal((128, 64)).astype(np.float32), rng.standard_normal((64, 128)).astype(np.float32)
    bias = rng.standard_normal(64).astype(np.float32)
    comm = dist.LocalCommunicator()
    up = dist.ColumnParallelLinear.from_float(be.to(w_up), comm, gather_output=False)
    down = dist.RowParallelLinear.from_float(be.to(w_down), comm, bias=be.to(bias))
    ref_up, ref_down = Linear.from_float(w_up), Linear.from_float(w_down, bias=bias)
    close(be.host(down(up(be.to(x)))).astype(np.float32), ref_down(ref_up(x)).astype(np.float32),
          "ColumnParallelLinear -> RowParallelLinear", 1e-4)
    if be.device:  # two ranks simulated as threads on one GPU: the all-to-all plans of world 2
        def rank(comm):
            ep = dist.ExpertParallelMoE.shard(dev, comm)
            return be.host(ep(be.to(x)))

        for out in dist.SimulatedGroup(2).run(rank):
            same_bits(out.view(np.uint16), want.view(np.uint16), "ExpertParallelMoE, 2 simulated ranks")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numpy", action="store_true", help="run every workload on numpy only (no GPU)")
    parser.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated subset of {FAMILIES}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    families = [f for f in args.only.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--only: unknown families {unknown}; have {FAMILIES}")
    be = Backend(device=not args.numpy)
    failed = []
    for name in families:
        try:
            globals()[f"run_{name}"](be, np.random.default_rng(args.seed))
            if be.device:
                be.cp.cuda.Device().synchronize()
            print(f"ok   {name}", flush=True)
        except Exception:
            traceback.print_exc()
            print(f"FAIL {name}", flush=True)
            failed.append(name)
    print(f"{len(families) - len(failed)} of {len(families)} kernel families passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
