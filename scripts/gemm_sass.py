#!/usr/bin/env python3
"""Instructions per weight of the NVFP4 GEMM mainloop, read off its SASS (no GPU needed).

Compiles ``raw_kernels/gemm.cu`` for sm_90a through fp4kit's own NVRTC path (the same source and
options the loader uses), disassembles it with ``cuobjdump -sass`` and, for each
``gemm_tiled_*``, ``gemm_wgmma_*`` and ``gemm_gemv_*`` kernel, counts the instructions of its
mainloop: the loop over activation windows (GEMV: over pairs of fetch groups), without the nested
staging loop. One pass of that loop is 8 weight tiles of 64 k for
each of the warp's R row tiles, i.e. ``8 * 32 * R`` weights per thread (every branch counted as
taken, so the figure is an upper bound for full windows). Prints the count per weight, split into
integer/logic instructions on the ALU pipe (LOP3, SHF, PRMT, LEA, IADD3, ...), IMAD (integer
multiply-add, FMA pipe: left shifts and address arithmetic), bf16 multiplies (HMUL2), tensor-core
MMAs and memory instructions.

    .venv/bin/python scripts/gemm_sass.py [--arch sm_90a] [--json FILE]

``cuobjdump`` (and the ``nvdisasm`` it calls) come from the PATH or from the pip packages
``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ALU = {"LOP3", "SHF", "PRMT", "LEA", "IADD3", "ISETP", "SEL", "LOP", "FLO", "POPC", "VIADD", "IABS", "IMNMX",
       "VIMNMX", "BMSK", "SGXT"}
MEM = {"LDG", "STG", "LDS", "STS", "LDSM", "LDGSTS", "LD", "ST", "LDC", "ULDC"}
# Weights per thread and row tile in one pass of the loop body: a window of 8 tiles of 64 k (T <= 2)
# holding two fetch groups of 4; or a window of 4 tiles (T > 2), or of 8 tiles fetched at once
# (``f8``), one group per window, where the body holds both parities of the register double buffer,
# i.e. two windows: 8 or 16 tiles. Each tile is 32 weights per thread (16 rows x 64 k / 32 lanes).
def body_weights(tiles: int, fetch8: bool) -> int:
    return (16 if fetch8 else 8) * 32


def find_tool(name: str) -> str | None:
    """``cuobjdump`` or ``nvdisasm`` from the PATH or from the pip packages, or None."""
    exe = shutil.which(name)
    if exe:
        return exe
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for path in glob.glob(os.path.join(base, "nvidia", "*", "bin", name)):
            return path
    return None


def _tool(name: str) -> str:
    return find_tool(name) or sys.exit(f"{name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
                                       "(no GPU needed)")


def _cuobjdump(cubin: bytes, option: str) -> subprocess.CompletedProcess:
    """``cuobjdump <option>`` of a cubin from `loader.compile_offline`."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(_tool("nvdisasm")) + os.pathsep + env.get("PATH", "")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin + b"\0")  # CuPy's compile path drops the ELF's last byte
        f.flush()
        return subprocess.run([_tool("cuobjdump"), option, f.name], capture_output=True, text=True, env=env)


def sass_of(cubin: bytes) -> subprocess.CompletedProcess:
    """``cuobjdump -sass`` of a cubin from `loader.compile_offline` (which calls ``nvdisasm``)."""
    return _cuobjdump(cubin, "-sass")


def resource_usage_of(cubin: bytes) -> subprocess.CompletedProcess:
    """``cuobjdump -res-usage`` of a cubin: registers, stack, shared and local memory per kernel."""
    return _cuobjdump(cubin, "-res-usage")


def disassemble(arch: str) -> str:
    from fp4kit.runtime import loader

    result = sass_of(loader.compile_offline("gemm", arch))
    if result.returncode:
        sys.exit(result.stderr.strip())
    return result.stdout


def parse(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """{function: [(address, opcode, modifiers and operands)]} of ``cuobjdump -sass`` output."""
    functions, current = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*(.*?);", line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2), f"{m.group(3)} {m.group(4)}"))
    return functions


def loops(ins) -> list[tuple[int, int]]:
    """(start, end) of every backward branch."""
    found = []
    for addr, op, args in ins:
        if op == "BRA":
            m = re.search(r"0x([0-9a-f]+)", args)
            if m and int(m.group(1), 16) <= addr:
                found.append((int(m.group(1), 16), addr))
    return found


def mainloop_mix(ins) -> collections.Counter:
    """Opcode counts of the innermost loop holding the MMAs, without the loops nested in it."""
    mma = [a for a, op, _ in ins if op in ("HMMA", "HGMMA")]
    all_loops = loops(ins)
    holding = [lp for lp in all_loops if any(lp[0] <= a <= lp[1] for a in mma)]
    start, end = min(holding, key=lambda lp: lp[1] - lp[0])
    nested = [lp for lp in all_loops if lp != (start, end) and start <= lp[0] and lp[1] <= end]
    return collections.Counter(op for a, op, _ in ins
                               if start <= a <= end and not any(s <= a <= e for s, e in nested))


def report(arch: str) -> list[dict]:
    rows = []
    for name, ins in parse(disassemble(arch)).items():
        gemv = re.fullmatch(r"gemm_gemv_(\d+)f(\d)(?:w16)?(?:whole|resp?)?_(?:bf16|nvfp4)", name)
        m = re.fullmatch(r"gemm_(?:tiled_(\d+)x(\d+)(f8)?_(?:bf16|nvfp4)|wgmma_(\d+)x(\d+)(?:_c\d+)?(?:_bf16)?)", name)
        if gemv:  # one pass of the GEMV loop: two fetch groups of F tiles of the warp's one row tile
            tiles, r, per = 1, 1, 2 * int(gemv.group(2)) * 32
        elif m:
            tiles, r = int(m.group(1) or m.group(4)), int(m.group(2) or m.group(5))
            per = body_weights(tiles, bool(m.group(3))) * r
        else:
            continue
        ops = mainloop_mix(ins)
        alu = sum(v for k, v in ops.items() if k in ALU)
        rows.append({"kernel": name, "token_tiles": tiles, "row_tiles_per_warp": r,
                     "instructions_per_weight": sum(ops.values()) / per,
                     "alu_int_logic_per_weight": alu / per, "imad_per_weight": ops["IMAD"] / per,
                     "int_total_per_weight": (alu + ops["IMAD"]) / per, "hmul2_per_weight": ops["HMUL2"] / per,
                     "mma_per_weight": (ops["HMMA"] + ops["HGMMA"]) / per,
                     "mem_per_weight": sum(v for k, v in ops.items() if k in MEM) / per,
                     "top_ops": dict(ops.most_common(10))})
    return sorted(rows, key=lambda row: row["kernel"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    rows = report(args.arch)
    print(f"NVFP4 GEMM mainloop, {args.arch}: instructions per weight and thread (static, one window)")
    print("| kernel | all | ALU int/logic | IMAD | int total | HMUL2 | HMMA | memory |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['kernel']} | {row['instructions_per_weight']:.2f} | {row['alu_int_logic_per_weight']:.2f} | "
              f"{row['imad_per_weight']:.2f} | {row['int_total_per_weight']:.2f} | {row['hmul2_per_weight']:.2f} | "
              f"{row['mma_per_weight']:.3f} | {row['mem_per_weight']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
