"""Decode with a DeepSeek-V4-style NVFP4 model built from fp4kit layers.

    .venv/bin/python examples/decode.py                        # tiny model (numpy without a GPU)
    .venv/bin/python examples/decode.py --preset v4-flash-slice --layers 4 --batch 8 --prompt-len 512 --new-tokens 128
    .venv/bin/python examples/decode.py --check                # graph = eager (= numpy for tiny)
    .venv/bin/python examples/decode.py --save /tmp/m && .venv/bin/python examples/decode.py --load /tmp/m
    .venv/bin/python -m fp4kit.distributed.launch --nproc 2 examples/decode.py --preset v4-flash-slice --ep 2 --tp 2
    .venv/bin/python examples/decode.py --config DeepSeek-V4-Flash/config.json --layers 4   # its widths and layer kinds
    .venv/bin/python examples/decode.py --speculative --temperature 0   # MTP drafts verified two tokens a step

The weights are random (an integer hash of the seed, each tensor's name and index), so the token
ids it prints are not text and mean nothing: the example measures and checks the machinery.
Prefill feeds the prompt through the decode step one token at a time, or with --batched-prefill
through each layer once as T tokens (`Model.prefill`); decode samples N tokens per sequence. On a GPU both steps are captured
once into CUDA graphs and replayed: a step makes no host sync (the capture would fail if it did),
token ids stay on the device and are read back in chunks for printing (progress on one updated
line on a terminal, one line per chunk otherwise). The report gives prefill tokens/s, decode
ms per step and per token and tokens/s, and on a GPU the bandwidth the decode step achieves over
the bytes it must read (weights of the attention, the routed experts it touches, the shared
experts, the lm_head, and its KV entries), also as a fraction of the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsv4 import config as configs  # noqa: E402
from dsv4 import runner  # noqa: E402

from fp4kit.runtime.device import cuda_available  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(configs.PRESETS), default="tiny")
    ap.add_argument("--config", type=str, default=None,
                    help="an official DeepSeek-V4 config.json: its widths, layer kinds and routing instead of a "
                         "preset (what the model leaves out of it is printed)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: 4)")
    ap.add_argument("--mode", choices=("w4a16", "w4a4"), default="w4a16",
                    help="activation format of the GEMMs (W4A16: bf16 activations, the faster on Hopper)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32, help="random prompt length (ignored with --prompt)")
    ap.add_argument("--prompt", type=str, default=None, help="comma-separated token ids, used for every sequence")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="weights, prompt and sampling seed")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-context", type=int, default=None, help="tokens per sequence the caches hold")
    ap.add_argument("--numpy", action="store_true", help="run on the numpy reference even with a GPU")
    ap.add_argument("--no-graph", action="store_true", help="launch every step eagerly")
    ap.add_argument("--batched-prefill", action="store_true",
                    help="the prompt through each layer once as T tokens (Model.prefill), not token by token")
    ap.add_argument("--check", action="store_true",
                    help="compare graph, eager (and, for tiny, numpy: logits and sublayers) decoding")
    ap.add_argument("--check-layers", action="store_true",
                    help="compare the GPU model with the numpy model sublayer by sublayer on equal inputs "
                         "(runner.compare_layers, runner.LAYER_TOLERANCE)")
    ap.add_argument("--save", type=str, default=None, help="write the weights as an NVFP4 checkpoint folder")
    ap.add_argument("--load", type=str, default=None, help="read the weights (and config) from a saved folder")
    ap.add_argument("--print-every", type=int, default=16, help="decode steps between token read-backs")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks for the attention projections and "
                    "the lm_head (one process per GPU: start with python -m fp4kit.distributed.launch --nproc N)")
    ap.add_argument("--ep", type=int, default=None, help="expert-parallel ranks for the MoE layers (idem)")
    ap.add_argument("--mtp", action="store_true",
                    help="build the multi-token-prediction layer (an official config's, or one window-only layer on a "
                         "preset) and report how often its greedy draft equals the sampled token")
    ap.add_argument("--speculative", action="store_true",
                    help="decode speculatively with the MTP layer's drafts (implies --mtp): each step verifies the "
                         "draft in one two-token pass and keeps one or two tokens per sequence")
    return ap.parse_args(argv)


def make_config(args, official: dict | None = None) -> configs.ModelConfig:
    """The model's configuration: a saved folder's, an official config.json's (``official``, read
    from ``--config``) or a preset's."""
    overrides = {"mode": args.mode}
    if args.max_context:
        overrides["max_context"] = args.max_context
    args.mtp = args.mtp or args.speculative
    if args.load:  # a saved folder's own config, or an official config.json beside converted weights
        cfg = runner.load_config(args.load, args.layers, mtp=args.mtp, **overrides)
        if args.mtp and not cfg.mtp_ratios:
            raise SystemExit(f"--mtp: the model saved in {args.load} has no multi-token-prediction layer")
        return cfg
    if official is not None:
        return configs.from_official(official, args.layers or 4, mtp=args.mtp, **overrides)
    if args.mtp:
        overrides["mtp_ratios"] = (0,)  # DeepSeek-V4's MTP layer attends over its window only
    return configs.PRESETS[args.preset](args.layers or 4, **overrides)


def read_official(path: str) -> dict:
    import json

    with open(path) as f:
        return json.load(f)


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + written), 256 MiB buffers."""
    import cupy

    a = cupy.empty(256 << 20, np.uint8)
    b = cupy.empty_like(a)
    for _ in range(3):
        b[...] = a
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(10):
        b[...] = a
    stop.record()
    stop.synchronize()
    return 2 * 10 * a.nbytes / (cupy.cuda.get_elapsed_time(start, stop) * 1e-3)


def decode(model, cfg, prompt, args, device: bool) -> dict:
    """Prefill, then decode with a progress line; returns the timings and the tokens."""
    b, p = prompt.shape
    spec = args.speculative
    state = model.new_state(b, history_rows=max(1, args.new_tokens) * (2 if spec else 1))
    xp = model.xp
    dec = runner.Decoder(model, state, xp.asarray(prompt, dtype=np.int32), use_graph=not args.no_graph,
                         batched_prefill=args.batched_prefill, speculative=spec)
    t0 = time.perf_counter()
    marks = []
    if args.batched_prefill and p > 1:
        # the same prefill on a scratch state first: kernel compilation and buffers, timed apart
        model.prefill(model.new_state(b, history_rows=1), dec.prompt[:, : p - 1])
        dec.synchronize()
        marks.append(time.perf_counter())
        fed = dec.prefill()
    else:
        fed = dec.prefill(warmed_up=lambda: marks.append(time.perf_counter()))
    dec.synchronize()
    t_end = time.perf_counter()
    # the first token fed (or the scratch prefill) compiles the kernels and makes the buffers (and
    # the graph is captured): reported apart from the prefill rate
    t_warm = (marks[0] if marks else t_end) - t0
    t_prefill = t_end - t0 - t_warm
    untimed = 2 if spec else 1  # the first step captures the decode graph (speculative: the second)
    for _ in range(min(untimed, args.new_tokens)):
        dec.decode_step()
    dec.synchronize()
    before = logged(state, spec)
    t0 = time.perf_counter()
    shown = 1
    live = sys.stdout.isatty()
    for i in range(untimed, args.new_tokens):
        dec.decode_step()
        if (i + 1) % args.print_every == 0 or i + 1 == args.new_tokens:
            history = runner.to_host(state.history)  # one read-back per chunk
            shown = i + 1
            n = int(logged(state, spec)[0])
            rate = (i + 1 - untimed) / max(time.perf_counter() - t0, 1e-9)
            done = (f"{shown}/{args.new_tokens} steps ({n} tokens of sequence 0)" if spec else
                    f"{shown}/{args.new_tokens} tokens per sequence")
            line = (f"  decoded {done}, {rate:.1f} steps/s; "
                    f"seq 0 last token ids: {history[max(0, n - 8):n, 0].tolist()}")
            if live:  # one line updated in place on a terminal; whole lines into a file or pipe
                print(f"\r{line}", end="", flush=True)
            else:
                print(line, flush=True)
    dec.synchronize()
    t_decode = time.perf_counter() - t0
    if live and shown > 1:
        print()
    steps = max(args.new_tokens - untimed, 1)
    counts = logged(state, spec)
    history = np.asarray(runner.to_host(state.history))
    tokens = [history[: counts[s], s].copy() for s in range(b)]
    batched = args.batched_prefill and fed > 0
    # fed eagerly before the capture: the first position, and the second with an MTP layer (it
    # runs from the second position on)
    eager = fed if batched else min(fed, 2 if model.mtp else 1)
    return {"prefill_s": t_prefill, "prefill_tokens": (fed - eager) * b, "warmup_s": t_warm,
            "warmup_tokens": eager * b, "decode_s": t_decode, "decode_steps": steps,
            "tokens": tokens, "position": p + int(counts.max()), "decoder": dec, "batched_prefill": batched,
            "draft_acceptance": None if spec else runner.draft_acceptance(state, args.new_tokens),
            "tokens_per_step": float((counts - before).mean()) / steps if args.new_tokens > untimed else 1.0,
            "accepted": np.asarray(runner.to_host(state.accepted)) if spec else None}


def logged(state, speculative: bool) -> np.ndarray:
    """Tokens logged per sequence so far (a host read): the step count, or speculative decoding's
    per-sequence counts."""
    if speculative:
        return np.asarray(runner.to_host(state.emitted)).astype(np.int64)
    return np.full(state.batch, int(runner.to_host(state.step)[0]), np.int64)


def report(model, cfg, res: dict, batch: int, device: bool) -> None:
    if res["warmup_tokens"]:
        what = "kernel compilation or cache load, buffers, graph capture" if device else "buffers"
        first = ("a first batched prefill on a scratch state" if res.get("batched_prefill") else
                 "the first prompt position" + ("s" if res["warmup_tokens"] > batch else ""))
        print(f"warm-up: {first} ({res['warmup_tokens']} tokens) in {res['warmup_s'] * 1e3:.1f} ms "
              f"({what}; not in the rates)")
    if res["prefill_tokens"]:
        how = "each layer once over the prompt" if res.get("batched_prefill") else "token by token through the decode step"
        print(f"prefill: {res['prefill_tokens']} tokens in {res['prefill_s'] * 1e3:.1f} ms "
              f"({res['prefill_tokens'] / res['prefill_s']:.0f} tokens/s, {how})")
    step_s = res["decode_s"] / res["decode_steps"]
    per_step = res.get("tokens_per_step", 1.0)
    print(f"decode:  {step_s * 1e3:.3f} ms/step = {step_s * 1e3 / (batch * per_step):.3f} ms/token over {batch} "
          f"sequence(s), {batch * per_step / step_s:.0f} tokens/s"
          + (f" ({per_step:.2f} tokens per step and sequence, speculative)" if res.get("accepted") is not None else ""))
    touched = runner.experts_touched(model, batch)
    weights = model.weight_bytes(touched)
    kv = runner.kv_bytes(cfg, batch, res["position"])
    total = sum(weights.values()) + kv
    line = (f"bytes per step: {total / 1e6:.1f} MB (attention {weights['attention'] / 1e6:.1f}, routed experts "
            f"{weights['routed'] / 1e6:.1f} for {touched[:cfg.layers]} experts touched, shared {weights['shared'] / 1e6:.1f}, "
            f"router {weights['router'] / 1e6:.1f}, lm_head {weights['lm_head'] / 1e6:.1f}, "
            + (f"hyper-connections {weights['hyper'] / 1e6:.1f}, " if "hyper" in weights else "")
            + (f"MTP layer {weights['mtp'] / 1e6:.1f}, " if "mtp" in weights else "") + f"KV {kv / 1e6:.2f})")
    print(line)
    if device:  # a bandwidth of the numpy reference says nothing about the kernels: left out
        achieved = total / step_s
        copy = copy_bandwidth()
        print(f"bandwidth: {achieved / 1e9:.0f} GB/s achieved = {100 * achieved / copy:.1f}% of the measured copy "
              f"bandwidth ({copy / 1e9:.0f} GB/s)")


def check(cfg, args, prompt, device: bool, model) -> bool:
    """On the GPU: graph-replayed vs eager decoding (identical tokens and logits) and, for small
    vocabularies, the teacher-forced logits against the numpy model (first position bit-identical,
    later ones within `runner.NUMPY_TOLERANCE`) and the sublayer comparison (`check_layers`). On
    numpy: two runs give identical tokens."""
    runs = {}
    for name, graph in ([("graph", True), ("eager", False)] if device else [("numpy", False), ("numpy again", False)]):
        model.generator.set_state(args.seed, 0)
        tokens, logits, _ = runner.run(model, prompt, args.new_tokens, use_graph=graph, keep_logits=True)
        runs[name] = (tokens, np.stack(logits))
    (n1, (t1, l1)), (n2, (t2, l2)) = runs.items()
    ok = bool(np.array_equal(t1, t2) and np.array_equal(l1, l2))
    print(f"check {n1} vs {n2}: identical tokens and logits over {args.new_tokens} steps -> {'OK' if ok else 'FAIL'}")
    if device and cfg.vocab <= 4096:
        cmp = runner.compare_with_numpy(cfg, args.seed, np.concatenate([prompt, t1], axis=1))
        print(f"check GPU vs numpy (teacher-forced, {len(cmp['rel'])} positions): relative RMS logit difference at the "
              f"first position {cmp['first']:.2g} (bit-identical: {cmp['first'] == 0}), median {cmp['median']:.4f} max {cmp['max']:.4f} "
              f"(bounds {cmp['tolerance']}) -> {'OK' if cmp['ok'] else 'FAIL'}")
        ok &= cmp["ok"]
        # the logit bounds above cannot see a broken layer; the sublayer comparison on equal inputs can
        ok &= check_layers(cfg, args, np.concatenate([prompt, t1], axis=1), device)
    if args.speculative:
        ok &= check_speculative(model, prompt, args, device, t1)
    return ok


def check_speculative(model, prompt, args, device: bool, plain_tokens) -> bool:
    """Speculative decoding captured vs eager (two runs on numpy): the same tokens; with greedy
    sampling also the plain decoder's tokens (``plain_tokens``), which it must reproduce."""
    names = ("graph", "eager") if device else ("numpy", "numpy again")
    runs = []
    for graph in (True, False) if device else (False, False):
        model.generator.set_state(args.seed, 0)
        model.draft_sampler.generator.set_state(args.seed + 1, 0)
        runs.append(runner.run_speculative(model, prompt, args.new_tokens, use_graph=graph)[0])
    ok = all(np.array_equal(a, b) for a, b in zip(*runs))
    line = f"check speculative {names[0]} vs {names[1]}: identical tokens over {args.new_tokens} steps"
    if args.temperature == 0:
        same = all(np.array_equal(t[: plain_tokens.shape[1]], plain_tokens[s, : len(t)]) for s, t in enumerate(runs[0]))
        line += f", greedy = the plain decoder's tokens: {same}"
        ok &= same
    print(f"{line} -> {'OK' if ok else 'FAIL'}")
    return ok


def check_layers(cfg, args, prompt, device: bool) -> bool:
    """The sublayer comparison (`runner.compare_layers`) of the GPU model (numpy without one)
    against the numpy model, teacher-forced over the prompt: per sublayer, the median and largest
    relative RMS difference, worst first, against `runner.LAYER_TOLERANCE`."""
    model, _ = runner.build(cfg, device=device, seed=args.seed)
    reference, _ = runner.build(cfg, device=False, seed=args.seed)
    result = runner.compare_layers(model, runner.record_layers(reference, prompt), prompt)
    rows = sorted(result["rel"].items(), key=lambda kv: -float(np.median(kv[1])))
    for (name, layer), rel in rows[:12]:
        print(f"  {name:9s} layer {layer}: median {np.median(rel):.2e}  max {rel.max():.2e}")
    print(f"check layers ({'GPU' if device else 'numpy'} vs numpy, {prompt.shape[1]} positions): worst median "
          f"{result['worst_median'][1]:.3g} at {result['worst_median'][0]}, worst max {result['worst_max'][1]:.3g} at "
          f"{result['worst_max'][0]} (bounds {result['tolerance']}) -> {'OK' if result['ok'] else 'FAIL'}")
    return result["ok"]


def parallel_group(args):
    """The communicator for ``--tp``/``--ep`` (None without them); every rank holds every token."""
    if args.tp is None and args.ep is None:
        return None
    from fp4kit import distributed as dist

    comm = dist.init()
    for name, n in (("--tp", args.tp), ("--ep", args.ep)):
        if n is not None and n not in (1, comm.world_size):
            raise SystemExit(f"{name} {n}: expected 1 or the launched world size {comm.world_size} "
                             f"(start one process per GPU with python -m fp4kit.distributed.launch --nproc {n} ...)")
    return comm


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.save and args.ep is not None:
        raise SystemExit("--save: with --ep each rank reads and holds only its own experts; save without --ep")
    comm = parallel_group(args)
    if comm is not None and comm.rank != 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 reports; the others run the same steps silently
    device = cuda_available() and not args.numpy
    official = read_official(args.config) if args.config and not args.load else None
    cfg = make_config(args, official)
    name = args.load or args.config or args.preset
    if not device:
        if cfg.hidden > 1024 and not args.numpy:
            print(f"no CUDA GPU found: {name!r} needs one; running 'tiny' on the numpy reference")
            name = "tiny"
            cfg = configs.tiny(args.layers or 4, mode=args.mode)
        else:
            print("--numpy: running on the numpy reference" if args.numpy else
                  "no CUDA GPU found: running on the numpy reference")
    print(f"model: {name}, {cfg.layers} layers, hidden {cfg.hidden}, "
          f"{cfg.experts} experts top-{cfg.top_k}, vocab {cfg.vocab}, compress ratios {list(cfg.compress_ratios)}, "
          + (f"hyper-connections x{cfg.hc_mult}, " if cfg.hc_mult > 1 else "")
          + ("simulated FP8/FP4 activations, " if cfg.qat_sim else "")
          + (f"MTP layer (ratio {cfg.mtp_ratios[0]}), " if cfg.mtp_ratios else "")
          + f"{cfg.mode}, on {'the GPU' if device else 'numpy'}")
    t0 = time.perf_counter()
    # with --ep every rank builds (and reads) its own routed experts only
    model, ckpt = runner.build(cfg, device=device, seed=args.seed, load=args.load, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, expert_comm=comm if args.ep is not None else None)
    print(f"built in {time.perf_counter() - t0:.1f} s; weights: "
          + (f"read from {args.load}" if args.load else f"random (seed {args.seed}), so the generated token ids "
                                                         "mean nothing"))
    for line in model.load_report:
        print(f"{args.load}: {line}")
    if comm is not None:
        whole = model.parallelize(comm, tp=args.tp is not None, ep=args.ep is not None)
        print(f"sharded over {comm.world_size} rank(s): tensor-parallel {args.tp is not None} "
              f"({whole} projections too small to split, kept whole), expert-parallel {args.ep is not None}")
    if args.save:
        print(f"saved {runner.save(args.save, cfg, ckpt)}")
    del ckpt
    if args.prompt:
        ids = np.array([int(t) for t in args.prompt.split(",")], np.int32)
        prompt = np.tile(ids, (args.batch, 1))
    else:
        prompt = runner.random_prompt(args.batch, max(1, args.prompt_len), cfg.vocab, args.seed)
    if prompt.shape[1] + args.new_tokens > cfg.max_context:
        print(f"note: {prompt.shape[1] + args.new_tokens} tokens exceed the caches' {cfg.max_context}; "
              "compressed entries past it are dropped (and recorded in the status word)")
    if args.check_layers:
        ok = check_layers(cfg, args, prompt, device)
    elif args.check:
        ok = check(cfg, args, prompt, device, model)
    else:
        res = decode(model, cfg, prompt, args, device)
        report(model, cfg, res, args.batch, device)
        if res["accepted"] is not None:
            verified = max(args.new_tokens - 1, 1)
            print(f"speculative: drafts accepted {res['accepted'].tolist()} of {verified} verified per sequence "
                  f"({100 * res['accepted'].mean() / verified:.1f}%; with random weights ~ 1 / vocab)")
        elif model.mtp:
            accepted = res["draft_acceptance"]
            print("MTP: " + ("no draft to compare" if accepted is None else
                             f"the greedy draft equals the sampled token in {100 * accepted:.1f}% of the steps "
                             f"(what a one-token speculative step would accept; with random weights ~ 1 / vocab)"))
        for b in range(min(args.batch, 4)):
            ids = res["tokens"][b]
            print(f"seq {b} generated token ids: {ids[:24].tolist()}{' ...' if len(ids) > 24 else ''}")
        ok = True
    if comm is not None:  # every rank: a barrier, then the communicator released, before exiting
        from fp4kit import distributed as dist

        dist.shutdown(comm)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
