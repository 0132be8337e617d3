"""Benchmark: the example decoder's whole decode step (examples/decode.py), graph-replayed.

`v4-flash-slice` with 4 layers (V4-Flash widths: hidden 4096, 64 heads over a 512-d latent, 256
experts top-6 of inner 2048 + one shared expert, vocab 129280; compress ratios 0, 4, 128, 4),
W4A16 (the example's default), batch 1, 8 and 32, at a context of 4096 tokens (caches filled with
random entries). Reports ms per step, tokens/s, the bytes the step must read (all attention and
shared-expert weights, the routers, the distinct routed experts the step touched, the lm_head and
the KV entries it attends to or scores), the bandwidth achieved over them and the kernels of the
captured step (counted, and listed by name for batch 1). Targets: batch 1 >= 60 % of the measured
copy bandwidth, batch 8 >= 45 %, batch 32 >= 40 %; <= 15 kernels per layer. Then the rate of a
4096-token batched prefill, the step's parts captured alone, and the device memory beyond the
weights and the KV caches that the decode steps of each batch and the prefill add (each in a fresh
process, through cudaMemGetInfo).

    .venv/bin/python benchmarks/bench_decode.py [--mode=w4a4] [--projections-apart] [--batches=1,8] [--step-only]
        [--peer] [--hc-mult=4] [--qat-sim] [--speculative] [--grouped-swiglu-epilogue] [--grouped-fold-shared]
        [--ab-moe-sorted]

``--mode`` picks the activation format of every GEMM (default W4A16); ``--projections-apart`` runs
each attention projection as its own Linear instead of one concatenated Linear per input
(`examples/dsv4/model.py` ``FUSE_PROJECTIONS``), to compare the two in one session. ``--batches``
times those batches only; ``--step-only`` times the steps alone (no prefill, parts or memory
probes, nothing saved), for comparing settings within one session. ``--peer`` (needs PyTorch) also
times the same model's step in PyTorch with bf16 weights and cuBLAS GEMMs, graph-captured
(`torch_decode_peer.py`), from the same state, and reports fp4kit's speedup over it.
``--hc-mult=4`` runs the model on DeepSeek-V4's four copies of the residual stream
(hyper-connections) instead of the preset's one (with ``--step-only``; the peer has one stream).
``--qat-sim`` adds the official inference's activation simulation and output de-rotation
(`ModelConfig.qat_sim`, as an official config builds it; with ``--step-only``).
``--speculative`` (with ``--step-only``) builds the MTP layer and times, per batch, the plain step
without it, the plain step with its draft, and the speculative step (`Model.speculative_step`:
two tokens per sequence in one pass over the weights, the MTP layer on both): the cost of a
two-token step against a one-token one, the draft acceptance rate at which speculation breaks
even, and the tokens/s it would give at a given acceptance rate (random weights draft almost
nothing right, so the measured rate is not the point; trained MTP weights are reported to draft
80-90 % right).
``--grouped-swiglu-epilogue`` turns on `fp4kit.layers.moe.GROUPED_SWIGLU_EPILOGUE` (the sorted MoE
path, batch 32 here, computes SwiGLU in its gate|up grouped GEMM), ``--grouped-fold-shared`` that
and `GROUPED_FOLD_SHARED` (the shared expert rides in the sorted path's grouped GEMMs), to compare
within one session; ``--ab-moe-sorted`` (with ``--step-only``, W4A16) times the step under each of
`SORTED_MOE_SETTINGS` (those two, then the dispatch in the router's last block and the combine in the
down GEMM too) in one process,
from one state per batch, in two rounds of opposite order.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
from pathlib import Path

import cupy as cp
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402
from dsv4 import model as model_module  # noqa: E402
from dsv4 import runner  # noqa: E402

from fp4kit.layers import moe as moe_layer  # noqa: E402
from fp4kit.ops import elementwise as ew  # noqa: E402

BF16 = ml_dtypes.bfloat16

try:
    from benchmarks.common import (Table, command_line, copy_bandwidth, device_name, events_us, graph_kernels,
                                   int_list, torch_graph_us)
    from benchmarks.torch_decode_peer import TorchDecodePeer, peer_weights
except ImportError:
    from common import (Table, command_line, copy_bandwidth, device_name, events_us, graph_kernels, int_list,
                        torch_graph_us)
    from torch_decode_peer import TorchDecodePeer, peer_weights

LAYERS, CONTEXT, BATCHES, REPLAYS = 4, 4096, (1, 8, 32), 30
PREFILL_TOKENS = 4096


def median_ms(launch) -> float:
    """Median ms of ``launch()`` (events around each call, after warm-up calls)."""
    return events_us(launch, iters=REPLAYS) / 1e3


def step_ms(dec: runner.Decoder) -> float:
    """One replayed decode step (the first call runs eagerly and captures the graph)."""
    dec.decode_step()
    return median_ms(dec.decode_step)


def replay_ms(fn) -> float:
    """``fn`` captured alone into a graph (after one eager call), replayed."""
    fn()
    return median_ms(runner.CapturedStep(fn).replay)


# the expert-sorted MoE path's W4A16 variants (`fp4kit.layers.moe`), for --ab-moe-sorted
# (label, GROUPED_SWIGLU_EPILOGUE, GROUPED_FOLD_SHARED, ROUTER_DISPATCH_MAX_PAIRS, GROUPED_COMBINE_IN_GEMM)
SORTED_MOE_SETTINGS = (("SwiGLU and shared expert apart", False, False, 0, False),
                       ("SwiGLU in the gate|up GEMM", True, False, 0, False),
                       ("and the shared expert folded in", True, True, 0, False),
                       ("and the dispatch in the router", True, True, 1 << 30, False),
                       ("and the combine in the down GEMM", True, True, 1 << 30, True))


def sorted_moe_ab(model, batch: int) -> list[dict]:
    """The step at ``batch`` (from one state at ``CONTEXT`` tokens) under each of
    `SORTED_MOE_SETTINGS`, in two rounds of opposite order (each step moves the positions on, so
    the order is balanced): ms per step and kernels per layer."""
    state = model.new_state(batch, history_rows=64)
    runner.fill_context(model, state, CONTEXT, seed=batch)
    names = ("GROUPED_SWIGLU_EPILOGUE", "GROUPED_FOLD_SHARED", "ROUTER_DISPATCH_MAX_PAIRS", "GROUPED_COMBINE_IN_GEMM")
    saved = [getattr(moe_layer, n) for n in names]
    rows = []
    try:
        for rnd, order in enumerate((SORTED_MOE_SETTINGS, SORTED_MOE_SETTINGS[::-1])):
            for label, *setting in order:
                for n, v in zip(names, setting):
                    setattr(moe_layer, n, v)
                dec = runner.Decoder(model, state, cp.zeros((batch, 1), cp.int32))
                ms = step_ms(dec)
                rows.append({"batch": batch, "setting": label, "round": rnd + 1, "ms/step": ms,
                             "kernels per layer": len(graph_kernels(dec.decode_graph.graph)) / LAYERS})
                del dec
    finally:
        for n, v in zip(names, saved):
            setattr(moe_layer, n, v)
    return rows


def speculative_row(model, batch: int, acceptance: float = 0.85) -> dict:
    """The plain step without and with the MTP layer's draft and the speculative step, each
    captured and replayed from a state at ``CONTEXT`` tokens: a speculative step makes 1 + a tokens
    per sequence at acceptance rate a, so it pays where (1 + a) / its cost over the plain step's > 1."""
    state = model.new_state(batch, history_rows=256)
    runner.fill_context(model, state, CONTEXT, seed=batch)
    with_draft = step_ms(runner.Decoder(model, state, cp.zeros((batch, 1), cp.int32)))
    saved, model.mtp = model.mtp, []  # the same step without the MTP layer
    try:
        plain = step_ms(runner.Decoder(model, state, cp.zeros((batch, 1), cp.int32)))
    finally:
        model.mtp = saved
    spec = replay_ms(lambda: model.speculative_step(state))
    ratio = spec / plain
    return {"batch": batch, "plain ms": plain, "plain + MTP draft ms": with_draft, "speculative ms": spec,
            "x plain": ratio, "break-even acceptance": ratio - 1,
            "tokens/s at 85 % acceptance": batch * (1 + acceptance) / (spec * 1e-3),
            "x plain tokens/s": (1 + acceptance) / ratio}


def prefill_rate(model, tokens: int) -> dict:
    """A batched prefill of ``tokens`` random tokens on a fresh batch-1 state, after one warm-up on
    another (compilation, buffers): ms and tokens/s."""
    prompt = cp.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab, (1, tokens)), np.int32)
    model.prefill(model.new_state(1, history_rows=1), prompt)
    state = model.new_state(1, history_rows=1)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    model.prefill(state, prompt)
    end.record()
    end.synchronize()
    ms = cp.cuda.get_elapsed_time(start, end)
    return {"tokens": tokens, "ms": ms, "tokens/s": tokens / ms * 1e3}


def memory_probe(mode: str, batch: int, prefill_tokens: int) -> None:
    """In a fresh process: device memory (`cudaMemGetInfo`) the first decode steps at ``batch`` (eager,
    then captured and replayed) or a batched prefill of ``prefill_tokens`` add beyond the weights and
    the KV caches, allocated from a CuPy pool made after the build (which keeps the blocks a step
    freed, so the growth is its peak). Prints ``peak_mb=...``."""
    cfg = configs.v4_flash_slice(LAYERS, max_context=2 * CONTEXT, mode=mode)
    model, ckpt = runner.build(cfg, device=True, seed=0)
    del ckpt
    state = model.new_state(batch, history_rows=64)
    cp.cuda.Device().synchronize()
    gc.collect()  # arrays of the build held in reference cycles: freed now, not into the pool mid-run
    build_pool = cp.get_default_memory_pool()
    build_pool.free_all_blocks()  # the build's temporaries
    # ... but a freed block split from a larger allocation stays in the pool, and the run would reuse
    # it unseen by cudaMemGetInfo: the run allocates from a pool of its own
    held = build_pool.free_bytes()
    cp.cuda.set_allocator(cp.cuda.MemoryPool().malloc)
    free, total = cp.cuda.runtime.memGetInfo()
    if prefill_tokens:
        model.prefill(state, cp.zeros((batch, prefill_tokens), np.int32))
    else:
        dec = runner.Decoder(model, state, cp.zeros((batch, 1), cp.int32))
        for _ in range(3):
            dec.decode_step()
    cp.cuda.Device().synchronize()
    print(f"peak_mb={(free - cp.cuda.runtime.memGetInfo()[0]) / 1e6:.1f}")
    print(f"build_pool_free_mb={held / 1e6:.1f}")  # what the run could have reused before it had its own pool


def peak_memory_mb(mode: str, batch: int, prefill_tokens: int = 0) -> float:
    """`memory_probe` in a subprocess (no buffers left by earlier shapes), its ``peak_mb``."""
    import subprocess

    run = subprocess.run([sys.executable, __file__, f"--mode={mode}", f"--memory-probe={batch},{prefill_tokens}"],
                         capture_output=True, text=True, check=True)
    return float(next(line for line in run.stdout.splitlines() if line.startswith("peak_mb="))[len("peak_mb="):])


def breakdown(model, state, copy: float) -> Table:
    """Where a batch's step goes: each part captured and replayed on its own, against the bytes it
    must read (weights, KV rows, logits) at the copy bandwidth ``copy``."""
    cfg = model.cfg
    b = state.batch
    h = cp.asarray(np.random.default_rng(0).standard_normal((b, cfg.hidden)).astype(BF16))
    parts = Table(f"Decode step parts, batch {b} (each captured alone)", ["part", "ms", "byte floor ms", "x floor"])

    def add(part: str, ms: float, nbytes: int) -> None:
        floor = nbytes / copy * 1e3
        parts.add(part=part, ms=ms, **{"byte floor ms": floor, "x floor": ms / floor})

    for i, (blk, caches) in enumerate(zip(model.blocks, state.layers)):
        weights = model.layer_weight_bytes(i, 0)
        add(f"layer {i} attention (ratio {blk.attn.ratio})", replay_ms(lambda: blk.attn(h, caches)),
            weights["attention"] + runner.layer_kv_bytes(cfg, blk.attn.ratio, b, CONTEXT))
        # with the residual step into the next norm, which the step runs in the MoE's last launch
        then_norm = ew.ResidualNorm(state.resid, model.norm, cfg.eps)
        ms = replay_ms(lambda: blk.moe(h, token_ids=state.tokens, then_norm=then_norm))
        weights = model.layer_weight_bytes(i, runner.experts_touched(model, b)[i])  # the replays' experts
        add(f"layer {i} MoE{' (hash)' if i < cfg.hash_layers else ''} + shared expert + residual step", ms,
            weights["shared"] + weights["routed"] + weights["router"])
    lm_head = model.weight_bytes([0] * cfg.layers)["lm_head"]
    add("lm_head", replay_ms(lambda: model.lm_head(h)), lm_head)
    logits = model.lm_head(h)
    add("sampler", replay_ms(lambda: model.sampler(logits)), logits.nbytes)
    # the post-attention ones (the others run in the MoE's last launch); each reads its residual row
    # (fp32), the delta (bf16) and the weight
    norms = cfg.layers
    add(f"residual add + RMSNorm x {norms}", replay_ms(lambda: [
        ew.add_rmsnorm(state.resid, h, model.norm) for _ in range(norms)]),
        norms * (state.resid.nbytes + h.nbytes + model.norm.nbytes))
    return parts


def flags(parser) -> None:
    parser.add_argument("--mode", choices=("w4a16", "w4a4"), default="w4a16")
    parser.add_argument("--projections-apart", action="store_true")
    parser.add_argument("--batches", type=int_list, default=BATCHES)
    parser.add_argument("--step-only", action="store_true")
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--hc-mult", type=int, default=1)
    parser.add_argument("--qat-sim", action="store_true")
    parser.add_argument("--speculative", action="store_true")
    parser.add_argument("--grouped-swiglu-epilogue", action="store_true")
    parser.add_argument("--grouped-fold-shared", action="store_true")
    parser.add_argument("--ab-moe-sorted", action="store_true")
    # internal: one memory probe, "BATCH,PREFILL_TOKENS" (peak_memory_mb runs it in a fresh process)
    parser.add_argument("--memory-probe", type=lambda v: tuple(int(x) for x in v.split(",")), help=argparse.SUPPRESS)


def main() -> None:
    args = command_line(__doc__, flags)
    mode = args.mode
    model_module.FUSE_PROJECTIONS = not args.projections_apart
    # the sorted MoE path (batch 32) with SwiGLU in the gate|up grouped GEMM: one launch per layer fewer
    if args.grouped_swiglu_epilogue:
        moe_layer.GROUPED_SWIGLU_EPILOGUE = True
    if args.grouped_fold_shared:  # and the shared expert in its grouped GEMMs: three fewer
        moe_layer.GROUPED_SWIGLU_EPILOGUE = moe_layer.GROUPED_FOLD_SHARED = True
    if args.memory_probe is not None:
        batch, tokens = args.memory_probe
        memory_probe(mode, batch, tokens)
        return
    batches, step_only = args.batches, args.step_only
    torch = None
    if args.peer:
        import torch
    hc = args.hc_mult
    if hc != 1 and (torch is not None or not step_only):
        raise SystemExit("--hc-mult: with --step-only and without --peer (the peer and the probes run one stream)")
    qat_sim = args.qat_sim
    if qat_sim and (torch is not None or not step_only):
        raise SystemExit("--qat-sim: with --step-only and without --peer")
    speculative = args.speculative
    if speculative and (torch is not None or not step_only):
        raise SystemExit("--speculative: with --step-only and without --peer")
    ab_sorted = args.ab_moe_sorted
    if ab_sorted and (torch is not None or not step_only or speculative or mode != "w4a16"):
        raise SystemExit("--ab-moe-sorted: W4A16, with --step-only, without --peer or --speculative")
    cfg = configs.v4_flash_slice(LAYERS, max_context=2 * CONTEXT, mode=mode, hc_mult=hc, qat_sim=qat_sim,
                                 mtp_ratios=(0,) if speculative else ())
    model, ckpt = runner.build(cfg, device=True, seed=0)
    try:
        peer_w = None if torch is None else peer_weights(torch, model, ckpt, "cuda")
    except torch.OutOfMemoryError:  # its dense bf16 experts beside fp4kit's model: ~80 GB at these widths
        torch.cuda.empty_cache()
        peer_w = None
        print("note: the PyTorch bf16 peer does not fit in this GPU's memory beside the model; its columns stay empty")
    del ckpt
    copy = copy_bandwidth()
    projections = "concatenated" if model_module.FUSE_PROJECTIONS else "apart"
    streams = (f", {hc} residual copies" if hc > 1 else "") + (", activation simulation" if qat_sim else "")
    table = Table(f"Decode step, v4-flash-slice {LAYERS} layers{streams}, {mode.upper()}, projections {projections}, "
                  f"context {CONTEXT}, graph-replayed ({device_name()}; copy bandwidth {copy / 1e12:.2f} TB/s)",
                  ["batch", "ms/step", "tokens/s", "MB read", "experts touched", "GB/s", "% of copy BW",
                   "kernels in graph", "kernels per layer", "target", "PyTorch bf16 ms", "x PyTorch"])
    spec_table = Table(f"Speculative decoding with the MTP layer, v4-flash-slice {LAYERS} layers, {mode.upper()}, "
                       f"context {CONTEXT}, graph-replayed ({device_name()})",
                       ["batch", "plain ms", "plain + MTP draft ms", "speculative ms", "x plain",
                        "break-even acceptance", "tokens/s at 85 % acceptance", "x plain tokens/s"])
    ab_table = Table(f"Decode step with the expert-sorted MoE's W4A16 variants, v4-flash-slice {LAYERS} layers, "
                     f"context {CONTEXT}, graph-replayed ({device_name()})",
                     ["batch", "setting", "round", "ms/step", "kernels per layer"])
    launches = {}  # kernel name -> launches in one step, by batch
    for batch in batches:
        if speculative:
            spec_table.add(**speculative_row(model, batch))
            continue
        if ab_sorted:
            for row in sorted_moe_ab(model, batch):
                ab_table.add(**row)
            continue
        state = model.new_state(batch, history_rows=64)
        runner.fill_context(model, state, CONTEXT, seed=batch)
        dec = runner.Decoder(model, state, cp.zeros((batch, 1), cp.int32))
        ms = step_ms(dec)
        peer_ms = None
        if peer_w is not None:  # the PyTorch model from the same state (its own copy of it)
            cp.cuda.Device().synchronize()  # the state as the last replayed step left it
            step = TorchDecodePeer(torch, cfg, peer_w, state, "cuda").step
            peer_ms = torch_graph_us(torch, lambda i: step(), calls=1, replays=REPLAYS) / 1e3
        touched = runner.experts_touched(model, batch)
        nbytes = sum(model.weight_bytes(touched).values()) + runner.kv_bytes(cfg, batch, CONTEXT)
        pct = 100 * nbytes / (ms * 1e-3) / copy
        names = graph_kernels(dec.decode_graph.graph)
        kernels = len(names)
        launches[batch] = dict(collections.Counter(names).most_common())
        per_layer = kernels / LAYERS  # the head, the sampler and the embedding counted in
        goal = {1: 60, 8: 45, 32: 40}.get(batch)
        target = ", ".join(filter(None, [f">= {goal}%: " + ("met" if pct >= goal else "MISSED") if goal else "",
                                         "<= 15 kernels/layer: " + ("met" if per_layer <= 15 else "MISSED")]))
        table.add(**{"batch": batch, "ms/step": ms, "tokens/s": batch / (ms * 1e-3), "MB read": nbytes / 1e6,
                     "experts touched": sum(touched), "GB/s": nbytes / (ms * 1e-3) / 1e9, "% of copy BW": pct,
                     "kernels in graph": kernels, "kernels per layer": per_layer, "target": target,
                     "PyTorch bf16 ms": peer_ms, "x PyTorch": peer_ms / ms if peer_ms else None})
        if batch == 1 and not step_only:
            parts = breakdown(model, state, copy)
        del dec, state
    if step_only:
        print()
        print(spec_table.markdown() if speculative else ab_table.markdown() if ab_sorted else table.markdown())
        return
    prefill = prefill_rate(model, PREFILL_TOKENS)
    print()
    print(table.markdown())
    print()
    print(f"batched prefill of {PREFILL_TOKENS} tokens (batch 1): {prefill['ms']:.1f} ms, "
          f"{prefill['tokens/s']:.0f} tokens/s")
    print()
    print(parts.markdown())
    print()
    print("kernels of one step at batch 1 (launches per step, by name):")
    for name, count in launches.get(1, {}).items():
        print(f"  {count:4d}  {name}")
    meta = {"device": device_name(), "layers": LAYERS, "context": CONTEXT, "cupy": cp.__version__,
            "copy_bandwidth": copy, "mode": mode, "projections": projections, "kernels_by_name": launches,
            "prefill": prefill}
    print("saved", table.save("bench_decode", meta))
    parts.save("decode_step_parts", meta)  # not "bench_*": run_all treats those as benchmarks with a floor
    del model, parts, peer_w
    cp.get_default_memory_pool().free_all_blocks()  # room for the probes' models
    memory = Table(f"Device memory beyond the weights and the KV caches, v4-flash-slice {LAYERS} layers, "
                   f"{mode.upper()} ({device_name()}; each run in a fresh process)", ["run", "peak MB"])
    for batch in BATCHES:
        memory.add(run=f"decode steps, batch {batch}", **{"peak MB": peak_memory_mb(mode, batch)})
    memory.add(run=f"batched prefill, {PREFILL_TOKENS} tokens, batch 1",
               **{"peak MB": peak_memory_mb(mode, 1, PREFILL_TOKENS)})
    print()
    print(memory.markdown())
    memory.save("decode_memory", meta)


if __name__ == "__main__":
    main()
