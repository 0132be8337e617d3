#!/usr/bin/env python3
"""The replayed decode step under several library settings, in one process (needs a GPU): the
benchmark's model (v4-flash-slice, 4 layers, context 4096) is built once, and for each batch the
step is rebuilt and captured under each setting in turn, over rounds of alternating order, from one
state (each step moves the positions on, so the order is balanced). A setting is a label and
module attributes to set (the rest keep the library's values):

    PYTHONPATH=. python3 scripts/ab_step.py [--batches=1,8] [--rounds=3] [--mode=w4a16] \\
        base "no-release:ops.gemm.GEMV_EARLY_RELEASE=False" \\
        "no-gemv:ops.gemm.USE_GEMV=False,ops.elementwise.EARLY_RELEASE=False"

Attributes are named under ``fp4kit.`` and must exist; values are Python literals without commas.
Prints each measurement as it comes and a table of every round's µs per step and the kernels in the graph.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_setting(text: str) -> tuple[str, dict[tuple[str, str], object]]:
    """``"label:mod.ATTR=value,..."`` (or a bare label: the library's settings) as ``(label,
    {(module, attr): value})``; raises ValueError naming what is malformed."""
    label, _, body = text.partition(":")
    if not label:
        raise ValueError(f"setting {text!r}: expected LABEL or LABEL:module.ATTR=value,...")
    values = {}
    for item in filter(None, body.split(",")):
        name, eq, literal = item.partition("=")
        module, dot, attr = name.strip().rpartition(".")
        if not eq or not dot or not module:
            raise ValueError(f"setting {label!r}: expected module.ATTR=value, got {item!r}")
        try:
            values[(module, attr)] = ast.literal_eval(literal.strip())
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"setting {label!r}: {literal!r} is not a Python literal") from e
    return label, values


def resolve(values: dict[tuple[str, str], object]) -> list[tuple[object, str, object]]:
    """``(module object, attr, value)`` for each of ``values``; raises ValueError for a module or an
    attribute that does not exist (a typo would otherwise time the library's own setting)."""
    out = []
    for (module, attr), value in values.items():
        try:
            mod = importlib.import_module(f"fp4kit.{module}")
        except ImportError as e:
            raise ValueError(f"no module fp4kit.{module}") from e
        if not hasattr(mod, attr):
            raise ValueError(f"fp4kit.{module} has no attribute {attr!r}")
        out.append((mod, attr, value))
    return out


def main(argv: list[str]) -> int:
    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    settings = [parse_setting(a) for a in argv if not a.startswith("--")]
    if len(settings) < 2:
        raise SystemExit("ab_step: expected two or more settings (e.g. base 'off:ops.gemm.GEMV_EARLY_RELEASE=False')")
    resolved = {label: resolve(values) for label, values in settings}
    batches = [int(b) for b in opts.get("batches", "1,8").split(",")]
    rounds = int(opts.get("rounds", 3))

    import cupy as cp

    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_decode import CONTEXT, LAYERS, step_ms
    from common import device_name, graph_kernels
    from dsv4 import config as configs
    from dsv4 import runner

    mode = opts.get("mode", "w4a16")
    cfg = configs.v4_flash_slice(LAYERS, max_context=2 * CONTEXT, mode=mode)
    model, ckpt = runner.build(cfg, device=True, seed=0)
    del ckpt
    labels = [label for label, _ in settings]
    rows = {}
    for batch in batches:
        state = model.new_state(batch, history_rows=64)
        runner.fill_context(model, state, CONTEXT, seed=batch)
        for r in range(rounds):
            for label in labels if r % 2 == 0 else labels[::-1]:
                saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in resolved[label]]
                try:
                    for mod, attr, value in resolved[label]:
                        setattr(mod, attr, value)
                    dec = runner.Decoder(model, state, cp.zeros((batch, 1), cp.int32))
                    us = step_ms(dec) * 1e3
                    kernels = len(graph_kernels(dec.decode_graph.graph))
                    del dec
                finally:
                    for mod, attr, value in saved:
                        setattr(mod, attr, value)
                rows.setdefault((batch, label), ([], kernels))[0].append(us)
                print(f"batch {batch} round {r + 1} {label}: {us:.1f} us, {kernels} kernels", flush=True)
        del state
    print(f"\nDecode step A/B, v4-flash-slice {LAYERS} layers, {mode.upper()}, context {CONTEXT}, "
          f"graph-replayed ({device_name()})\n")
    print("| batch | setting | µs per round | best | kernels |\n| --- | --- | --- | --- | --- |")
    for (batch, label), (values, kernels) in rows.items():
        print(f"| {batch} | {label} | {', '.join(f'{v:.1f}' for v in values)} | {min(values):.1f} | {kernels} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
