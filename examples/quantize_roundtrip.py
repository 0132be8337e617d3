"""Quantize a tensor to NVFP4 and back, and print the error.

Runs the CUDA kernels when a GPU is present, the numpy reference otherwise (and says which).

    python examples/quantize_roundtrip.py --rows 64 --cols 7168
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

import fp4kit
from fp4kit.runtime.device import cuda_available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cols", type=int, default=7168, help="a multiple of 16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="use the numpy reference even with a GPU")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    # activations with a few outliers, as a decode step sees them
    x = rng.standard_normal((args.rows, args.cols)).astype(np.float32)
    x[rng.random(x.shape) < 1e-3] *= 30
    x = x.astype(ml_dtypes.bfloat16)

    on_gpu = cuda_available() and not args.cpu
    if on_gpu:
        import cupy

        xd = cupy.asarray(x)
        fp4kit.quantize(xd)  # compile and warm up
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        q = fp4kit.quantize(xd)
        back = fp4kit.dequantize(q, np.float32)
        cupy.cuda.Device().synchronize()
        elapsed = time.perf_counter() - t0
        back, scale = cupy.asnumpy(back), float(q.global_scale.get())
        backend = f"CUDA kernels on {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
    else:
        t0 = time.perf_counter()
        q = fp4kit.quantize(x)
        back = fp4kit.dequantize(q, np.float32)
        elapsed = time.perf_counter() - t0
        scale = float(q.global_scale)
        backend = "numpy reference (no GPU found)" if not args.cpu else "numpy reference (--cpu)"

    ref = x.astype(np.float64)
    err = back.astype(np.float64) - ref
    rel = np.linalg.norm(err) / np.linalg.norm(ref)
    nbytes = q.packed.nbytes + q.block_scales.nbytes + 4
    print(f"backend            : {backend}")
    print(f"tensor             : {args.rows} x {args.cols} bf16 ({x.nbytes / 1e6:.2f} MB)")
    print(f"NVFP4              : {nbytes / 1e6:.2f} MB ({x.nbytes / nbytes:.2f}x smaller), global scale S = {scale:.6g}")
    print(f"relative L2 error  : {rel:.4%}")
    print(f"max abs error      : {np.abs(err).max():.4g} (max |x| = {np.abs(ref).max():.4g})")
    print(f"quantize+dequantize: {elapsed * 1e3:.2f} ms (host clock, one call)")
    print(f"finite inputs      : {fp4kit.check_finite()}")


if __name__ == "__main__":
    main()
