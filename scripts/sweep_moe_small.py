"""The small-T MoE launches' knobs timed against each other on the layer they serve: the launchers'
rules, then every block geometry of the first launch (`SMALL_GATE_UP_GEOMETRY`) at every pair
grouping it allows with the default down variant, then every down variant with the default first
launch (V4-Flash and V3 shapes, W4A16 and W4A4, graph-replayed as benchmarks/bench_moe.py times the
layer), each output compared with the rules'.

    .venv/bin/python scripts/sweep_moe_small.py [--configs=V4-Flash,V3] [--tokens=1,2,8] [--modes=w4a16,w4a4]
        [--gate-up-rule-only]
"""

import sys

import cupy as cp
import ml_dtypes
import numpy as np

from benchmarks.bench_moe import CONFIGS, ROTATE, build
from benchmarks.common import graph_us
from fp4kit.ops import moe as moe_ops

PAIRS = (None, 1, 2, 4, 8)  # None: the launcher's rule


def main() -> None:
    configs, tokens, modes = ("V4-Flash", "V3"), (1, 2, 8), ("w4a16", "w4a4")
    gate_up_rule_only = False
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key == "--configs":
            configs = tuple(value.split(","))
        elif key == "--tokens":
            tokens = tuple(int(v) for v in value.split(","))
        elif key == "--modes":
            modes = tuple(value.split(","))
        elif key == "--gate-up-rule-only":  # other gate|up variants at the launcher's pair rule only
            gate_up_rule_only = True
    default = moe_ops.SMALL_GATE_UP_VARIANT, moe_ops.SMALL_DOWN_VARIANT, moe_ops.SMALL_PAIRS_PER_BLOCK
    combos = [(default[0], default[1], None)]  # the launchers' rules first: the baseline
    combos += [(g, default[1], p) for g, (warps, *_) in moe_ops.SMALL_GATE_UP_GEOMETRY.items()
               for p in PAIRS if (p is None or p <= warps) and not (p is not None and gate_up_rule_only)]
    combos += [(default[0], d, None) for d in moe_ops.SMALL_DOWN_VARIANTS if d != default[1]]
    rng = np.random.default_rng(0)
    print("| shape | mode | T | gate_up | pairs | down | µs | vs default | max |diff| vs default |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in configs:
        cfg = CONFIGS[name]
        for mode in modes:
            layer, _ = build(cfg, mode)
            layer.small_max_assignments = 1 << 30
            for t in tokens:
                xs = [cp.asarray(rng.standard_normal((t, cfg["hidden"])).astype(ml_dtypes.bfloat16)) for _ in range(ROTATE)]
                base_us = base_out = None
                for g, d, p in combos:
                    moe_ops.SMALL_GATE_UP_VARIANT, moe_ops.SMALL_DOWN_VARIANT, moe_ops.SMALL_PAIRS_PER_BLOCK = g, d, p
                    out = cp.asnumpy(layer(xs[0])).astype(np.float32)
                    us = graph_us(lambda j: layer(xs[j % ROTATE]), calls=ROTATE, replays=30)
                    if base_us is None:
                        base_us, base_out = us, out
                    diff = float(np.abs(out - base_out).max())
                    print(f"| {name} | {mode} | {t} | {g} | {p} | {d} | {us:.1f} | {us / base_us:.3f} | {diff:.3g} |",
                          flush=True)
                moe_ops.SMALL_GATE_UP_VARIANT, moe_ops.SMALL_DOWN_VARIANT, moe_ops.SMALL_PAIRS_PER_BLOCK = default
            del layer
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
