"""DeepSeek-V4's manifold-constrained hyper-connections: one mixing site per call.

The residual stream is ``HC`` copies ``x [rows, HC, D]`` (fp32). `hc_site` runs the site before a
sublayer (or the head): it first brings the copies up to date with the previous sublayer's
output ``y`` (``x'[j] = post[j] y + sum_i comb[i, j] x[i]``, with the previous site's ``post`` and
``comb``), or starts the stream (``x[j] = y``, the embedding), then mixes the copies into the
sublayer's input and returns its bf16 RMSNorm together with this site's ``post`` and ``comb``.

numpy arrays run `fp4kit.reference.hyper_connections` (float64; the copies stored in fp32);
device arrays launch ``raw_kernels/hyper.cu`` (two kernels, fp32, within rounding of the
reference) on CuPy's current stream, reading and writing only device memory, so a decode step
that uses them can be captured in a CUDA graph.
"""

from __future__ import annotations

import numpy as np

from ..reference import elementwise as ew_ref
from ..reference import hyper_connections as ref
from ..runtime import arrays, loader
from . import elementwise

_MODULE = "hyper"
HC = 4  # copies the kernels are built for (hc_mult of DeepSeek-V4-Flash and V4-Pro)
SITE_MIXES = (2 + HC) * HC  # the pre, post and comb logits of a sublayer's site
SITE_GROUPS = 4  # hc_mix blocks per column block at a sublayer's site, each 6 of the 24 dots (kSiteGroups)
_MIX_THREADS = 128  # channels per hc_mix block (raw_kernels/hyper.cu kMixThreads)
_PARTIAL_WORDS = 40  # fp32 words per (block, row) partial (raw_kernels/hyper.cu kPartialWords)
_NORM_THREADS = 128  # hc_pre_norm block (kNormThreads)
_NORM_CHANNELS = 512  # channels per hc_pre_norm block (kNormChannels)
#: hc_mix blocks along the rows: each block of channels runs its rows in this many strided groups
#: (one at decode batch 1; a batch of 32 rows in 16 blocks of 2 instead of one block of 32)
MIX_ROW_BLOCKS = 16
_U32 = np.uint32


def scratch_words(rows: int, d: int) -> int:
    """fp32 words of the scratch a site over ``rows`` rows of ``d`` channels needs on the device."""
    return -(-d // _MIX_THREADS) * rows * _PARTIAL_WORDS


def _check(name: str, a, dtype, shape: tuple):
    a = arrays.as_array(a, name)
    if a.dtype != np.dtype(dtype) or tuple(a.shape) != tuple(shape):
        want = "x".join(map(str, shape)) if shape else "scalar"
        raise ValueError(f"{name}: expected {np.dtype(dtype).name} [{want}], got {arrays.describe(a)}")
    arrays.check_contiguous(name, a)
    return a


def hc_site(x, fn, scale, base, norm, *, y=None, post=None, comb=None, start: bool = False, head: bool = False,
            iters: int = 20, hc_eps: float = 1e-6, norm_eps: float = 1e-6, eps: float = 1e-6, out=None,
            post_out=None, comb_out=None, scratch=None):
    """One site of the hyper-connections; ``x`` is updated in place.

    Parameters
    ----------
    x : fp32 ``[rows, HC, D]``
        The copies (HC = 4 on the device).
    fn, scale, base : fp32 ``[M, HC * D]``, ``[3]`` (``[1]`` for the head), ``[M]``
        The site's mixing weights: M = (2 + HC) * HC before a sublayer, HC at the head.
    norm : fp32 ``[D]``
        The RMSNorm weight applied to the mixed input (the sublayer's, or the final norm).
    y : bf16 or fp32 ``[rows, D]``, optional
        The previous sublayer's output (with ``post [rows, HC]`` and ``comb [rows, HC, HC]`` of the
        previous site, fp32), or with ``start`` the stream's start (each copy set to ``y``).
    head : the head's site (only ``pre``; returns no ``post`` / ``comb``).
    out, post_out, comb_out, scratch : optional preallocated results and the device scratch
        (fp32, `scratch_words` long) for a captured step.

    Returns
    -------
    ``(h, post, comb)``: the sublayer's input bf16 ``[rows, D]`` and this site's ``post`` and
    ``comb`` (None at the head).
    """
    x = arrays.as_array(x, "x")
    if x.ndim != 3 or x.dtype != np.float32:
        raise ValueError(f"x: expected the copies as float32 [rows, hc, D], got {arrays.describe(x)}")
    arrays.check_contiguous("x", x)
    rows, hc, d = x.shape
    m = hc if head else (2 + hc) * hc
    fn = _check("fn", fn, np.float32, (m, hc * d))
    scale = _check("scale", scale, np.float32, (1,) if head else (3,))
    base = _check("base", base, np.float32, (m,))
    norm = _check("norm", norm, np.float32, (d,))
    if isinstance(iters, bool) or not isinstance(iters, (int, np.integer)) or iters < 1:
        raise ValueError(f"iters: expected a positive int, got {iters!r}")
    mode = 0
    if y is not None:
        y = arrays.as_array(y, "y")
        if y.dtype not in (arrays.BF16, np.dtype(np.float32)) or tuple(y.shape) != (rows, d):
            raise ValueError(f"y: expected bfloat16 or float32 [{rows}, {d}], got {arrays.describe(y)}")
        arrays.check_contiguous("y", y)
        if start:
            mode = 2
        else:
            if post is None or comb is None:
                raise ValueError("post, comb: the previous site's post [rows, hc] and comb [rows, hc, hc] are needed "
                                 "to update the copies with y (start=True starts the stream instead)")
            post = _check("post", post, np.float32, (rows, hc))
            comb = _check("comb", comb, np.float32, (rows, hc, hc))
            mode = 1
    elif start:
        raise ValueError("start: needs y, the rows the copies start from (the embedding)")
    arrays.check_same_device(x=x, fn=fn, scale=scale, base=base, norm=norm, y=y, post=post, comb=comb, out=out,
                             post_out=post_out, comb_out=comb_out, scratch=scratch)
    if not arrays.is_device_array(x):
        return _host_site(x, fn, scale, base, norm, y, post, comb, mode, head, iters, hc_eps, norm_eps, eps, out)
    if hc != HC:
        raise ValueError(f"x: the device kernels are built for {HC} copies (DeepSeek-V4's hc_mult), got "
                         f"{arrays.describe(x)}")
    import cupy

    out = arrays.device_out("out", out, (rows, d), arrays.BF16, x)
    if not head:
        post_out = arrays.device_out("post_out", post_out, (rows, hc), np.float32, x)
        comb_out = arrays.device_out("comb_out", comb_out, (rows, hc, hc), np.float32, x)
        # the row's first block stores this site's post / comb while the others read the last site's
        for name, a in (("post_out", post_out), ("comb_out", comb_out)):
            if any(_overlap(a, b) for b in (post, comb) if b is not None):
                raise ValueError(f"{name}: must not overlap post or comb (the previous site's, still read while "
                                 "this site's are written); pass other buffers")
    words = scratch_words(rows, d)
    if scratch is None:
        scratch = cupy.empty(words, np.float32)
    elif scratch.dtype != np.float32 or scratch.size < words:
        raise ValueError(f"scratch: expected at least {words} float32 words, got {arrays.describe(scratch)}")
    if rows == 0:
        return out, (None if head else post_out), (None if head else comb_out)
    chunks = -(-d // _MIX_THREADS)
    copies = (x, 0 if y is None else y, np.int32(y is not None and y.dtype == np.float32),
              0 if post is None else post, 0 if comb is None else comb)
    mix = loader.get_kernel(_MODULE, "hc_mix_head" if head else "hc_mix_site", block=_MIX_THREADS)
    mix.launch((chunks * (1 if head else SITE_GROUPS), min(rows, MIX_ROW_BLOCKS)), _MIX_THREADS,
               (*copies, fn, scratch, _U32(rows), _U32(d), np.int32(mode)))
    norm_kernel = loader.get_kernel(_MODULE, "hc_pre_norm", block=_NORM_THREADS)
    norm_grid = (-(-d // _NORM_CHANNELS), min(rows, 65535))
    # like the row norms, it lets the next kernel's blocks start early, where its blocks fit one wave
    release = np.int32(elementwise.EARLY_RELEASE and norm_grid[0] * norm_grid[1] <= norm_kernel.max_blocks)
    norm_kernel.launch(norm_grid, _NORM_THREADS,
                       (*copies, np.int32(mode), scratch, _U32(chunks), _U32(rows), _U32(d), scale, base,
                        np.int32(head), _U32(iters), np.float32(hc_eps), np.float32(norm_eps), norm, np.float32(eps),
                        out, 0 if head else post_out, 0 if head else comb_out, release))
    return out, (None if head else post_out), (None if head else comb_out)


def _overlap(a, b) -> bool:
    return a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes




def _host_site(x, fn, scale, base, norm, y, post, comb, mode, head, iters, hc_eps, norm_eps, eps, out):
    if mode == 2:
        x[...] = np.asarray(y, np.float32)[:, None, :]
    elif mode == 1:
        x[...] = ref.hc_post(np.asarray(y).astype(np.float32), x, post, comb).astype(np.float32)
    if head:
        mixed = ref.hc_head(x, fn, scale, base, eps=hc_eps, norm_eps=norm_eps)
        post = comb = None
    else:
        mixed, post, comb = ref.hc_pre(x, fn, scale, base, iters=iters, eps=hc_eps, norm_eps=norm_eps)
        post, comb = post.astype(np.float32), comb.astype(np.float32)
    h = ew_ref.add_rmsnorm(mixed.astype(np.float32), None, norm, eps=eps)
    return arrays.host_result(h, out), post, comb
