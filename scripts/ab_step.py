#!/usr/bin/env python3
"""The replayed decode step under several library settings and kernel sources, in one process
(needs a GPU): the benchmark's model (v4-flash-slice, 4 layers, context 4096) is built once, and for
each batch the step is rebuilt and captured under each setting in turn, over rounds of alternating
order, from one state (each step moves the positions on, so the order is balanced). A setting is a
label, module attributes to set, and optionally ``kernels=DIR``: a folder of kernel files laid out
as ``fp4kit/raw_kernels`` (``attention.cu``, ``common/gemv.cuh``, ...) that replace the library's
for that setting. Everything else keeps the library's values and files:

    PYTHONPATH=. python3 scripts/ab_step.py [--batches=1,8] [--rounds=3] [--mode=w4a16] \\
        base "no-release:ops.gemm.GEMV_EARLY_RELEASE=False" "late:kernels=/tmp/late_release"

Attributes are named under ``fp4kit.`` (the example model's under ``dsv4.``, e.g.
``dsv4.model.NORM_QUERY_IN_ATTENTION``) and must exist; values are Python literals (dicts and
tuples too); a replacement file must replace one of the library's. Every kernel module a setting
needs is compiled first, side by side in spawned processes, into CuPy's disk cache. Prints each
measurement as it comes and a table of every round's µs per step and the kernels in the graph.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import phase_probe  # noqa: E402


def split_items(body: str) -> list[str]:
    """``body`` split at the commas outside brackets and quotes (a value may be a dict or a tuple)."""
    items, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(body):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    return [item for item in items + [body[start:]] if item.strip()]


def parse_setting(text: str) -> tuple[str, dict[tuple[str, str], object], Path | None]:
    """``"label:mod.ATTR=value,...[,kernels=DIR]"`` (or a bare label: the library's settings) as
    ``(label, {(module, attr): value}, DIR or None)``; raises ValueError naming what is malformed."""
    label, _, body = text.partition(":")
    if not label:
        raise ValueError(f"setting {text!r}: expected LABEL or LABEL:module.ATTR=value,...")
    values, kernels = {}, None
    for item in split_items(body):
        name, eq, literal = item.partition("=")
        if name.strip() == "kernels" and eq:
            kernels = Path(literal.strip())
            continue
        module, dot, attr = name.strip().rpartition(".")
        if not eq or not dot or not module:
            raise ValueError(f"setting {label!r}: expected module.ATTR=value or kernels=DIR, got {item!r}")
        try:
            values[(module, attr)] = ast.literal_eval(literal.strip())
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"setting {label!r}: {literal!r} is not a Python literal") from e
    return label, values, kernels


def resolve(values: dict[tuple[str, str], object]) -> list[tuple[object, str, object]]:
    """``(module object, attr, value)`` for each of ``values``; raises ValueError for a module or an
    attribute that does not exist (a typo would otherwise time the library's own setting)."""
    out = []
    for (module, attr), value in values.items():
        # the example model's modules by their own name (dsv4.model), the library's under fp4kit.
        name = module if module.split(".")[0] == "dsv4" else f"fp4kit.{module}"
        if name.startswith("dsv4") and str(ROOT / "examples") not in sys.path:
            sys.path.insert(0, str(ROOT / "examples"))
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"no module {name}") from e
        if not hasattr(mod, attr):
            raise ValueError(f"{name} has no attribute {attr!r}")
        out.append((mod, attr, value))
    return out


def kernel_tree(overlay: Path, into: Path) -> Path:
    """A copy of the library's kernel folder under ``into`` with ``overlay``'s files in place of
    theirs; raises ValueError for an overlay that is not a folder or holds a file the library lacks."""
    from fp4kit.runtime import loader

    if not overlay.is_dir():
        raise ValueError(f"kernels={overlay}: not a folder")
    tree = into / f"raw_kernels_{len(list(into.iterdir()))}"
    shutil.copytree(loader.KERNEL_DIR, tree)
    for file in sorted(p for p in overlay.rglob("*") if p.is_file()):
        rel = file.relative_to(overlay)
        if not (tree / rel).is_file():
            raise ValueError(f"kernels={overlay}: {rel} replaces no file of fp4kit/raw_kernels")
        shutil.copyfile(file, tree / rel)
    return tree


def use_kernels(tree: Path | None) -> None:
    """Build kernels from ``tree`` (None: the library's folder) from the next launch on."""
    from fp4kit.runtime import loader

    if not hasattr(loader, "_library_kernel_dir"):
        loader._library_kernel_dir = loader.KERNEL_DIR
    loader.KERNEL_DIR = tree or loader._library_kernel_dir
    loader._kernels = type(loader._kernels)()  # handles are cached by name, not by source


def builds(trees: list[Path | None]) -> list[tuple[str, str | None, bool]]:
    """``(module, source, cooperative)`` for every module build the settings need
    (`phase_probe.build_side_by_side`): each of the library's (source None), and each module of a
    replacement tree whose source differs from the library's."""
    from fp4kit.runtime import loader
    from precompile_kernels import COOPERATIVE_MODULES

    names = loader.kernel_names()
    library = [(n, None, False) for n in names] + [(n, None, True) for n in COOPERATIVE_MODULES if n in names]
    sources = {n: loader.kernel_source(n) for n in names}
    jobs = list(library)
    for tree in dict.fromkeys(filter(None, trees)):
        use_kernels(tree)
        try:
            changed = {n: src for n in names if (src := loader.kernel_source(n)) != sources[n]}
        finally:
            use_kernels(None)
        jobs += [(n, changed[n], c) for n, _, c in library if n in changed]
    return jobs


def main(argv: list[str]) -> int:
    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    settings = [parse_setting(a) for a in argv if not a.startswith("--")]
    if len(settings) < 2:
        raise SystemExit("ab_step: expected two or more settings (e.g. base 'off:ops.gemm.GEMV_EARLY_RELEASE=False')")
    resolved = {label: resolve(values) for label, values, _ in settings}
    batches = [int(b) for b in opts.get("batches", "1,8").split(",")]
    rounds = int(opts.get("rounds", 3))
    scratch = Path(tempfile.mkdtemp(prefix="ab_step_"))
    trees = {label: kernel_tree(kernels, scratch) if kernels else None for label, _, kernels in settings}
    phase_probe.build_side_by_side(builds(list(trees.values())))

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
    labels = [label for label, _, _ in settings]
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
                    use_kernels(trees[label])
                    dec = runner.Decoder(model, state, cp.zeros((batch, 1), cp.int32))
                    us = step_ms(dec) * 1e3
                    kernels = len(graph_kernels(dec.decode_graph.graph))
                    del dec
                finally:
                    for mod, attr, value in saved:
                        setattr(mod, attr, value)
                    use_kernels(None)
                rows.setdefault((batch, label), ([], kernels))[0].append(us)
                print(f"batch {batch} round {r + 1} {label}: {us:.1f} us, {kernels} kernels", flush=True)
        del state
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nDecode step A/B, v4-flash-slice {LAYERS} layers, {mode.upper()}, context {CONTEXT}, "
          f"graph-replayed ({device_name()})\n")
    print("| batch | setting | µs per round | best | kernels |\n| --- | --- | --- | --- | --- |")
    for (batch, label), (values, kernels) in rows.items():
        print(f"| {batch} | {label} | {', '.join(f'{v:.1f}' for v in values)} | {min(values):.1f} | {kernels} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
