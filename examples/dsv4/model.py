"""A DeepSeek-V4-style decoder assembled from fp4kit layers, for one decode token per sequence.

Per layer: RMSNorm -> attention -> RMSNorm -> MoE, on a plain fp32 residual stream, or on the
``hc_mult`` copies of manifold-constrained hyper-connections (`HyperConnection`; 4 on the GPU); then
the final norm, the NVFP4 ``lm_head`` and the sampler. Attention (one 512-d latent shared by all heads,
K = V): a low-rank query (``wq_a`` -> RMSNorm -> ``wq_b``, per-head RMS norm, RoPE), the latent
``wkv`` -> RMSNorm -> RoPE appended to the layer's `fp4kit.KVCache`, whose compressor emits
entries every ``ratio`` tokens; ratio-4 layers select compressed entries with the lightning
indexer's top-k (its own 128-d compressed key cache), ratio-128 layers take all of them, ratio-0
layers use the window alone; `fp4kit.SparseAttention` over window + selection with a per-head
sink; the grouped low-rank output projection (``wo_a`` per group, then ``wo_b``; W4A16 on the device
runs the groups as one grouped GEMM launch, `OutputProjection`). The projections
that read the same input (of the normed hidden state: ``wq_a``, ``wkv``, the compressors' and the
indexer's; of the query's low rank: ``wq_b`` and the indexer's query) run as one concatenated
`fp4kit.Linear` each (`Projections`). MoE: hash
routing on the first ``hash_layers`` layers, learned ``sqrtsoftplus`` routing after, one shared
expert, the V4 SwiGLU clamp.

The official inference's simulated activation quantization (the Hadamard rotation and FP4
simulation of the indexer's queries and keys, FP8 of the KV latents) and the output de-rotation
are built on both (`ModelConfig.qat_sim`, `QatSimulation` over `fp4kit.ops.qat`), and so is the
multi-token-prediction layer (`ModelConfig.mtp_ratios`, `MtpLayer`: a greedy draft of the next
token each step, verified by `Model.speculative_step`). YaRN RoPE scaling of the compressing layers (`ModelConfig.rope_factor`)
is built on both: they rotate by YaRN's frequencies (`ModelConfig.rope_theta_of`), which the
numpy ops take in place of a base and the kernels read from a table. `Model.prefill` runs a
prompt through each layer once as T tokens (the runner's ``batched_prefill``); by default the
prompt goes through the decode step one token at a time.

The same code runs on CuPy arrays (kernels) and on numpy arrays (the reference): `Model(...,
device=False)`. On the device a `DecodeState` owns every buffer a step writes, so after one eager
step the step can be captured in a CUDA graph (see `examples/decode.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import fp4kit
from fp4kit.checkpoint import Checkpoint
from fp4kit.formats import to_linear
from fp4kit.layers import (ExpertStack, Generator, Indexer, KVCache, Linear, MoE, RoutingConfig, Sampler,
                           SharedExpert, SparseAttention)
from fp4kit.layers.kv_cache import append_compressed
from fp4kit.layers.linear import split_columns
from fp4kit.ops import attention as attention_ops
from fp4kit.ops import elementwise as ew
from fp4kit.ops import gemm as gemm_ops
from fp4kit.ops import hyper
from fp4kit.ops import indexer as indexer_ops
from fp4kit.ops import moe as moe_ops
from fp4kit.ops import qat
from fp4kit.ops import sampling as sampling_ops
from fp4kit.runtime import arrays, workspace
from fp4kit.runtime.arrays import BF16

from .config import ModelConfig


#: the attention projections that read the same input run as one concatenated Linear each (one
#: activation quantization and one GEMM instead of one of each per projection)
FUSE_PROJECTIONS = True
#: a concatenated projection's GEMM writes its parts apart, each C-contiguous (`Linear.call_split`:
#: column blocks), instead of one output split by a launch of its own at more than one row
SPLIT_IN_GEMM = True
#: in a decode step the attention launch applies the query's per-head RMSNorm and RoPE as it loads
#: the heads (`fp4kit.ops.attention.QueryNorm`) and the indexer's scoring the RoPE of its query as it
#: stages it (`fp4kit.ops.indexer.QueryRope`), with the bits of the row kernel, instead of the
#: RMSNorm + RoPE launch after the query projection (one launch a layer fewer; with the activation
#: simulation the indexer's query keeps its rotation launch); and on a layer without compression the
#: latent's norm launch moves the positions on (no kv_advance launch). On: the step's time is unchanged
#: (H100, within the noise) with 5 launches fewer (15 a layer at batch 32)
NORM_QUERY_IN_ATTENTION = True


def _untapped(name, i, value):
    """`Model.forward`'s ``sync`` where nothing is tapped."""
    return value


class Projections:
    """Several projections of one input, called together: one `Linear.concatenate` of them (with
    ``fuse``; the parts are then dropped, so the weights are held once) or one Linear each. Returns
    the outputs in the order of ``names``."""

    def __init__(self, names: list[str], parts: list[Linear], fuse: bool):
        self.names, self.sizes = names, [p.out_features for p in parts]
        self.fused = Linear.concatenate(parts) if fuse and len(parts) > 1 else None
        self.parts = None if self.fused is not None else parts
        self._split = workspace.BufferCache()  # the parts of a multi-row output, by shape

    def __call__(self, x) -> list:
        if self.fused is None:
            return [p(x) for p in self.parts]
        if SPLIT_IN_GEMM and isinstance(self.fused, Linear):
            return self.fused.call_split(x)
        y = self.fused(x)  # its tensor-parallel form
        out = None
        if arrays.is_device_array(y) and y.size > y.shape[-1]:  # more than one row: one launch splits
            import cupy

            out = self._split.get(tuple(y.shape), lambda: cupy.empty(y.size, BF16))
        return split_columns(y, self.sizes, out=out)

    def linears(self) -> list:
        """The layers holding the weights (one when fused)."""
        return [self.fused] if self.fused is not None else list(self.parts)

    def map(self, fn) -> None:
        """Replace each layer holding weights by ``fn(layer)`` (e.g. a tensor-parallel shard of it)."""
        if self.fused is not None:
            self.fused = fn(self.fused)
        else:
            self.parts = [fn(p) for p in self.parts]


#: the grouped low-rank output projection (``wo_a``, one weight per group of heads) as one launch
#: over the groups instead of one Linear per group, with bf16 activations (W4A16; the same arithmetic
#: per group): up to `gemm.GEMV_MAX_M` tokens the GEMV kernels of `gemm_grouped` on the groups'
#: weights concatenated (each block reads its group's columns of the attention output, the result
#: lands in place), above that the MoE's expert GEMM with the groups as experts (a view of the same
#: weight). W4A4 keeps one Linear per group: each group's activation has its own global scale.
GROUP_OUTPUT_PROJECTION = True


@dataclass
class _GroupRows:
    """The grouped GEMM's row plan for ``b`` tokens and G groups: group g's rows are g * b .. (g +
    1) * b - 1 in the output, reading row t * G + g of the attention output ``[b * G, K_g]``."""

    offsets: object
    active: object
    num_active: object
    row_token: object
    slot_row: object


def _stack_view(fused: Linear, groups: int) -> ExpertStack:
    """The G groups of a concatenated tiled weight as a tiled expert stack, without a copy: the
    tiled layout keeps each 16-row tile's bytes together, so equal groups of whole tiles are
    consecutive equal slices; each row keeps its decode factor."""
    w, n = fused.weight, fused.out_features // groups
    scale = w.global_scale.reshape(1).repeat(groups)
    row_decode = None if fused.row_decode is None else fused.row_decode.reshape(groups, n)
    return ExpertStack(w.packed.reshape(groups, -1), w.block_scales.reshape(groups, -1), scale,
                       (1 / scale).astype(np.float32), row_decode, layout="tiled", nk=(n, fused.in_features))


class OutputProjection:
    """``wo_a``: group g of the attention output ``[b, G, K_g]`` through its own weight
    ``[N, K_g]``, the results side by side ``[b, G * N]``: one launch over the G weights held as one
    concatenated weight (``group``, W4A16 on the device; `gemm_grouped` up to `GEMV_MAX_M` tokens,
    the expert GEMM over a stack view of it above), or one Linear per group."""

    def __init__(self, linears: list[Linear], group: bool):
        self.groups, self.mode = len(linears), linears[0].mode
        self.k, self.n = linears[0].in_features, linears[0].out_features
        self.linears, self.stack, self.fused = linears, None, None
        self._plans, self._buffers = {}, workspace.BufferCache()
        if group and self.mode == "w4a16" and arrays.is_device_array(linears[0].weight.packed):
            if self.n % 128 == 0:  # the row tiles of a GEMV block stay in one group
                self.fused = Linear.concatenate(linears)
                self.stack = _stack_view(self.fused, self.groups)
            else:
                self.stack = ExpertStack.from_tensors([to_linear(lin.weight) for lin in linears]).to_tiled()
            self.linears = None  # the concatenated weight (or the stack) holds the weights

    def __call__(self, o):
        """``o [b, G * K_g]`` (C-contiguous) -> ``[b, G * N]`` bf16."""
        b, xp = o.shape[0], arrays.array_module(o)
        if self.stack is None:
            parts = xp.ascontiguousarray(o.reshape(b, self.groups, self.k).transpose(1, 0, 2))
            return xp.concatenate([self.linears[g](parts[g]) for g in range(self.groups)], axis=1)
        if self.fused is not None and b <= gemm_ops.GEMV_MAX_M:
            out = self._buffers.get(("grouped", b), lambda: xp.empty((b, self.groups * self.n), arrays.BF16))
            return gemm_ops.gemm_grouped(o, self.fused.weight, self.groups, row_decode=self.fused.row_decode, out=out)
        plan, y = self._device_buffers(b)
        rows = o.reshape(b * self.groups, self.k)  # row t * G + g: group g of token t
        # group g's row t lands in row t at columns g * N.. (no transposing copy)
        moe_ops.grouped_gemm(rows, self.stack, y, plan=plan, gather=True, max_rows=b, side_by_side=True)
        return y

    def _device_buffers(self, b: int):
        """The row plan for ``b`` tokens (kept) and the expert GEMM's output ``[b, G * N]`` (kept up
        to `workspace.KEEP_MAX_BYTES`)."""
        import cupy

        g = self.groups
        if b not in self._plans:
            u32 = lambda a: cupy.asarray(np.asarray(a, np.uint32))  # noqa: E731
            row_token = u32((np.arange(b)[None, :] * g + np.arange(g)[:, None]).reshape(-1))
            self._plans[b] = _GroupRows(u32(np.arange(g + 1) * b), u32(np.arange(g)), u32([g]), row_token, row_token)
        return self._plans[b], self._buffers.get(("rows", b), lambda: cupy.empty((b, g * self.n), arrays.BF16))

    def ungroup(self) -> None:
        """One Linear per group again (e.g. before sharding each of them): the same arithmetic."""
        if self.stack is not None:
            linear, rd = self.stack.to_linear(), self.stack.row_decode
            self.linears = [Linear(linear.expert(g), mode=self.mode, row_decode=None if rd is None else rd[g].copy())
                            for g in range(self.groups)]
            self.stack = self.fused = None

    def weight_bytes(self) -> int:
        if self.stack is not None:
            return int(self.stack.packed.nbytes + self.stack.block_scales.nbytes + 4 * self.groups)
        weights = [getattr(lin, "local", lin).weight for lin in self.linears]  # a tensor-parallel layer's own shard
        return sum(int(w.packed.nbytes + w.block_scales.nbytes + 4) for w in weights)


class QatSimulation:
    """The official inference's in-place activation rounding (`fp4kit.ops.qat`: the reference on
    numpy, raw_kernels/qat.cu on the device, bit for bit the same) and the attention output's
    de-rotation: the latent's channels outside RoPE through E4M3 (a power-of-two scale per 64),
    the indexer's queries and compressed keys through E2M1 (per 32) after a Hadamard rotation, and
    the output's RoPE channels rotated back by the query's position (`ModelConfig.qat_sim`)."""

    def __init__(self, cfg: ModelConfig, theta):  # the layer's RoPE base or inverse frequencies
        self.rope_dim, self.theta = cfg.rope_dim, theta

    def latent(self, kv):
        """Every row of ``kv [..., D]`` rounded in place."""
        return qat.latent_rows(kv, self.rope_dim)

    def latent_window(self, cache: KVCache, positions) -> None:
        """The row each sequence wrote into its window ring at ``positions`` (a decode step)."""
        qat.latent_window(cache.swa, positions, self.rope_dim)

    @staticmethod
    def index(x):
        """Every row of ``x [..., d]`` (indexer queries) rotated and rounded in place."""
        return qat.index_rows(x)

    def new_entries(self, cache: KVCache, before, tokens: int, index: bool = False) -> None:
        """The compressed entries ``cache`` emitted since its counts were ``before`` (at most one
        per ``ratio`` of the ``tokens`` appended per sequence), rounded as the official
        compressors do: latents (or, ``index``, the indexer's keys)."""
        max_new = tokens // cache.ratio + 1
        if index:
            qat.index_entries(cache.comp, before, cache.comp_len, max_new)
        else:
            qat.latent_entries(cache.comp, before, cache.comp_len, self.rope_dim, max_new)

    def derotate(self, o, positions):
        """``o [rows, heads, D]`` with its last rope_dim channels rotated by ``-positions[row]``."""
        xp = arrays.array_module(o)
        return ew.rmsnorm_rope(o, None, xp.negative(positions), normalize=False, rope_dim=self.rope_dim,
                               theta=self.theta)


class Attention:
    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, block: str, ratio: int, xp):
        p = f"{block}.attn"
        self.cfg, self.ratio, self.xp = cfg, ratio, xp
        self.theta = cfg.rope_theta_of(self.ratio)  # a base, or YaRN's inverse frequencies
        self.qat = QatSimulation(cfg, self.theta) if cfg.qat_sim else None

        def linear(name: str) -> Linear:
            return Linear.from_checkpoint(ckpt, f"{p}.{name}", mode=cfg.mode, static_input_scale=False)

        def projections(names: list[str]) -> Projections:
            return Projections(names, [linear(n) for n in names], FUSE_PROJECTIONS)

        # the projections of the normed input h, then those of the query's low-rank qr
        of_h = ["wq_a", "wkv"] + (["compressor.wkv", "compressor.wgate"] if self.ratio else [])
        of_h += ["indexer.compressor.wkv", "indexer.compressor.wgate", "indexer.weights_proj"] if self.ratio == 4 else []
        self.of_h = projections(of_h)
        self.of_qr = projections(["wq_b"] + (["indexer.wq"] if self.ratio == 4 else []))
        self.wo_b = linear("wo_b")
        self.wo_a = OutputProjection([linear(f"wo_a.{g}") for g in range(cfg.o_groups)], GROUP_OUTPUT_PROJECTION)
        self.q_norm, self.kv_norm = ckpt.extra[f"{p}.q_norm"], ckpt.extra[f"{p}.kv_norm"]
        self.attn = SparseAttention(cfg.heads, cfg.head_dim, sink=ckpt.extra[f"{p}.sink"])
        self.extra = {k[len(p) + 1:]: v for k, v in ckpt.extra.items() if k.startswith(p + ".")}
        if self.ratio == 4:
            self.index_w_scale = float(np.float32((cfg.index_head_dim * cfg.index_heads) ** -0.5))  # on the head weights
            self.indexer = Indexer(cfg.index_topk, capacity=cfg.max_comp(4), heads=cfg.index_heads,
                                   head_dim=cfg.index_head_dim)

    def caches(self, batch: int, device: bool) -> dict:
        """This layer's per-batch state: the KV cache (+ the indexer's key cache)."""
        cfg, e = self.cfg, self.extra
        common = dict(window=cfg.window, rope_theta=self.theta, eps=cfg.eps, device=device)
        state = {"kv": KVCache(batch, head_dim=cfg.head_dim, ratio=self.ratio, max_comp=max(1, cfg.max_comp(self.ratio)),
                               ape=e.get("compressor.ape"), norm_weight=e.get("compressor.norm"),
                               rope_dim=cfg.rope_dim if self.ratio else 0, **common)}
        xp = self.xp
        if self.ratio == 4:
            state["index"] = KVCache(batch, head_dim=cfg.index_head_dim, ratio=4, max_comp=cfg.max_comp(4),
                                     ape=e["indexer.compressor.ape"], norm_weight=e["indexer.compressor.norm"],
                                     rope_dim=cfg.rope_dim, **{**common, "window": 1})
        elif not self.ratio:
            state["indices"] = xp.full((batch, 1), -1, np.int32)
            state["comp"] = xp.zeros((batch, 1, cfg.head_dim), BF16)  # no compressed entries
            state["comp_len"] = xp.zeros(batch, np.int32)
        return state

    def _project_in(self, h, st: dict, positions, b: int, t: int, decode: bool = False):
        """The queries and latents of the ``b * t`` tokens of ``h`` (sequence-major, ``positions``
        int32 per token, read on the device): returns ``q [b * t, heads, D]``, ``kv [b, t, D]``, and
        on ratio-4 layers the indexer's query and head weights (else None, None), after appending the latents and the
        compressors' inputs to the caches (``t`` tokens per sequence). Every RoPE is launched before
        the appends, which move the positions on. ``decode`` (one token per sequence at the
        cache's positions): the latents' norm writes them straight into the window ring (no
        window-append launch) and ``kv`` is None."""
        q, kv, iq, w, compressor, index = self._project(h, st, positions, b, t, decode)
        self._append(st, kv, compressor, index, t, decode)
        return q, kv, iq, w

    def _project(self, h, st: dict, positions, b: int, t: int, decode: bool = False):
        """`_project_in` up to the appends: also returns the compressors' inputs (``[b, t, -1]``
        each: this layer's, then the indexer's) for `_append`."""
        cfg, cache = self.cfg, st["kv"]
        rope = dict(eps=cfg.eps, rope_dim=cfg.rope_dim, theta=self.theta)
        of_h = dict(zip(self.of_h.names, self.of_h(h)))
        # the norms (and RoPE) of the parts of one projection's output in one launch each
        qr, kv = ew.rmsnorm_rope_pair(ew.NormRope(of_h["wq_a"], self.q_norm),
                                      ew.NormRope(of_h["wkv"], self.kv_norm, rope_dim=cfg.rope_dim), positions,
                                      eps=cfg.eps, theta=self.theta, window=cache.swa if decode else None,
                                      advance=self._advances_in_norm(decode))
        if self.qat is not None:  # the latent's channels outside RoPE through E4M3, where it was written
            if decode:
                self.qat.latent_window(cache, positions)
            else:
                kv = self.qat.latent(kv)
        kv = None if decode else kv.reshape(b, t, cfg.head_dim)
        of_qr = dict(zip(self.of_qr.names, self.of_qr(qr)))
        wq_b = of_qr["wq_b"].reshape(b * t, cfg.heads, cfg.head_dim)
        iq = w = None
        # in a decode step with NORM_QUERY_IN_ATTENTION, the attention launch norms and rotates q itself
        defer_q = decode and NORM_QUERY_IN_ATTENTION
        if self.ratio == 4:  # the indexer's query, rotated at the same positions
            iq = of_qr["indexer.wq"].reshape(b * t, cfg.index_heads, cfg.index_head_dim)
            if defer_q:
                q = wq_b
                if not self._index_query_raw(decode):
                    iq = ew.rmsnorm_rope(iq, None, positions, normalize=False, **rope)
            else:
                q, iq = ew.rmsnorm_rope_pair(ew.NormRope(wq_b, rope_dim=cfg.rope_dim),
                                             ew.NormRope(iq, normalize=False, rope_dim=cfg.rope_dim), positions,
                                             eps=cfg.eps, theta=self.theta)
            if self.qat is not None:
                iq = self.qat.index(iq)
        else:
            q = wq_b if defer_q else ew.rmsnorm_rope(wq_b, None, positions, **rope)
        compressor = [of_h[f"compressor.{n}"].reshape(b, t, -1) for n in ("wkv", "wgate")] if self.ratio else []
        # the indexer's key cache: its compressor only (its window is never read: no append)
        index = [of_h[f"indexer.compressor.{n}"].reshape(b, t, -1) for n in ("wkv", "wgate")] if self.ratio == 4 else []
        w = of_h["indexer.weights_proj"] if self.ratio == 4 else None
        return q, kv, iq, w, compressor, index

    def _advances_in_norm(self, decode: bool) -> bool:
        """Whether the latent's norm launch, writing a decode token's window row, also moves the
        positions on (`rmsnorm_rope_pair`'s ``advance``): on a layer without compression (which would
        move them), where nothing after reads the old positions (the query's RoPE in the attention
        with `NORM_QUERY_IN_ATTENTION`; without the activation simulation's window pass)."""
        return decode and NORM_QUERY_IN_ATTENTION and not self.ratio and self.qat is None

    def _index_query_raw(self, decode: bool) -> bool:
        """Whether the indexer's query reaches its scoring unrotated (rotated there): in a decode step
        with `NORM_QUERY_IN_ATTENTION`, unless the activation simulation reads the rotated query."""
        return decode and NORM_QUERY_IN_ATTENTION and self.ratio == 4 and self.qat is None

    def _append(self, st: dict, kv, compressor: list, index: list, t: int, decode: bool) -> None:
        """Appends ``t`` tokens per sequence: the latents ``kv [b, t, D]`` (None where ``decode``
        wrote them into the window already) and the compressors' inputs."""
        cache = st["kv"]
        if self.qat is not None and self.ratio:  # the counts before the compressors emit
            before = [c.comp_len.copy() for c in (cache, st.get("index")) if c is not None]
        if decode and not self.ratio:
            if not self._advances_in_norm(decode):  # else the norm launch moved the positions on
                cache.advance(t)  # the window rows are written
        elif decode and index:  # both caches' compressors in one launch
            append_compressed((cache, *compressor), (st["index"], *index))
        else:
            cache.append(kv, *compressor)
            if index:
                st["index"].append(None, *index)
        if self.qat is not None and self.ratio:  # the entries just emitted, rounded as the official compressors do
            self.qat.new_entries(cache, before[0], t)
            if index:
                self.qat.new_entries(st["index"], before[1], t, index=True)

    def __call__(self, h, st: dict):
        cache = st["kv"]
        b = h.shape[0]
        positions = None if self.qat is None else cache.pos.copy()  # the query's, for the de-rotation
        q, _, iq, w = self._project_in(h, st, cache.pos, b, 1, decode=True)  # cache.pos: this token's position
        query_norm = index_rope = None
        if NORM_QUERY_IN_ATTENTION:  # the raw queries; cache.pos has moved past the token since
            query_norm, index_rope = self._deferred_ropes(cache)
        o = self._attend(q, iq, w, st, query_norm=query_norm, index_rope=index_rope)
        if self.qat is not None:
            o = self.qat.derotate(o, positions)
        return self._project_out(o)

    def _deferred_ropes(self, cache):
        """The query's RMSNorm + RoPE for the attention launch and, where the indexer's query
        reaches its scoring raw, its RoPE, at ``cache.pos - 1`` (read once the token is appended)."""
        cfg = self.cfg
        query_norm = attention_ops.QueryNorm(cache.pos, cfg.eps, cfg.rope_dim, self.theta, offset=-1)
        index_rope = None
        if self._index_query_raw(decode=True):
            index_rope = indexer_ops.QueryRope(cache.pos, cfg.rope_dim, self.theta, offset=-1)
        return query_norm, index_rope

    def extend(self, h, st: dict, positions, b: int, t: int):
        """``t`` more tokens of each of ``b`` sequences at their caches' positions (a speculative
        step's): ``h [t * b, hidden]`` token-major (row ``j * b + s`` is sequence s's token j),
        ``positions`` int32 ``[t * b]`` (each sequence's position + j, on the device). The
        projections run once over all rows; then token j is appended and its queries attend (over
        their window and the entries complete at them) before token j + 1 is appended, so no query
        sees a later token. Returns the attention output ``[t * b, hidden]`` (a rejected token is
        taken back with `fp4kit.KVCache.rewind`)."""
        cfg, xp = self.cfg, self.xp
        q, kv, iq, w, compressor, index = self._project(h, st, positions, t * b, 1)
        o = xp.empty((t * b, cfg.heads, cfg.head_dim), BF16)
        for j in range(t):
            rows = slice(j * b, (j + 1) * b)
            self._append(st, kv[rows], [c[rows] for c in compressor], [c[rows] for c in index], 1, False)
            self._attend(q[rows], None if iq is None else iq[rows], None if w is None else w[rows], st, out=o[rows])
        if self.qat is not None:
            o = self.qat.derotate(o, positions)
        return self._project_out(o)

    def _attend(self, q, iq, w, st: dict, out=None, query_norm=None, index_rope=None):
        """The attention of one token per sequence (queries ``q [B, heads, D]``; on ratio-4 layers the
        indexer's query and head weights) over the caches as they are (its token appended last),
        into ``out`` when given; ``query_norm`` / ``index_rope``: ``q`` / ``iq`` raw, normed and
        rotated by the attention / rotated by the indexer's scoring."""
        cache = st["kv"]
        if self.ratio == 4:
            keys = st["index"]
            indices = self.indexer.score_topk(iq, w, keys.comp, keys.comp_len, w_scale=self.index_w_scale,
                                              query_rope=index_rope)
            comp, comp_len = cache.comp, cache.comp_len
        elif self.ratio == 128:  # every live entry: the kernel walks them, no index list is built
            indices, comp, comp_len = None, cache.comp, cache.comp_len
        else:
            indices, comp, comp_len = st["indices"], st["comp"], st["comp_len"]
        return self.attn(q, cache.swa, cache.pos, comp, comp_len, indices, out=out, query_norm=query_norm)  # [B, heads, D]

    def _project_out(self, o):
        """The grouped low-rank output projection of the attention output ``o [rows, heads, D]``."""
        return self.wo_b(self.wo_a(o.reshape(o.shape[0], -1)))

    def prefill(self, h, st: dict, positions, b: int, t: int):
        """The first ``t`` tokens of each of ``b`` sequences at once (a fresh state): ``h [b * t,
        hidden]`` (sequence-major), ``positions`` int32 ``[b * t]`` (0 .. t - 1 per sequence). Appends
        all of them to the caches, as ``t`` decode steps would, and returns the attention output
        ``[b * t, hidden]``: each token over its causal window and the entries complete at it."""
        cfg, xp, cache = self.cfg, self.xp, st["kv"]
        q, kv, iq, w = self._project_in(h, st, positions, b, t)
        # entries complete at each position (the compressor emits one every `ratio` tokens)
        capacity = cache.comp.shape[1] if self.ratio else 1
        visible = np.minimum((np.arange(t) + 1) // self.ratio, capacity) if self.ratio else np.zeros(t)
        comp_len = xp.asarray(visible.astype(np.int32))
        start = xp.zeros(1, np.int32)
        if not self.ratio:
            none, no_entries = xp.full((t, 1), -1, np.int32), xp.zeros((1, cfg.head_dim), BF16)
        o = xp.empty((b * t, cfg.heads, cfg.head_dim), BF16)
        for s in range(b):
            rows = slice(s * t, (s + 1) * t)
            if self.ratio == 4:
                keys = st["index"].comp[s:s + 1]
                indices = self.indexer.score_topk(q=iq[rows], w=w[rows], keys=keys, lengths=comp_len,
                                                  w_scale=self.index_w_scale)
                comp = cache.comp[s]
            elif self.ratio == 128:  # every entry complete at each query
                indices, comp = None, cache.comp[s]
            else:
                indices, comp = none, no_entries
            self.attn.prefill(q[rows], kv[s], start, cfg.window, comp, comp_len, indices, out=o[rows])
        if self.qat is not None:
            o = self.qat.derotate(o, positions)
        return self._project_out(o)


class HyperConnection:
    """One mixing site of the manifold-constrained hyper-connections (`fp4kit.ops.hyper.hc_site`:
    the reference in float64 on numpy, raw_kernels/hyper.cu on the device; the copies kept in
    fp32): the copies ``x [rows, hc, D]`` are first brought up to date with the previous
    sublayer's output (or started from the embedding), then mixed into this sublayer's input,
    which the sublayer's RMSNorm normalises."""

    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, prefix: str, head: bool = False):
        self.cfg, self.head = cfg, head
        self.fn, self.scale, self.base = (ckpt.extra[f"{prefix}_{n}"] for n in ("fn", "scale", "base"))

    def site(self, x, norm, y=None, post=None, comb=None, start: bool = False) -> tuple:
        """``(normed bf16 [rows, D], post, comb)`` for the sublayer (post, comb None for the head);
        ``x`` updated in place with ``y`` and the previous site's ``post`` / ``comb``."""
        cfg = self.cfg
        return hyper.hc_site(x, self.fn, self.scale, self.base, norm, y=y, post=post, comb=comb, start=start,
                             head=self.head, iters=cfg.hc_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.eps, eps=cfg.eps)


class Block:
    """One decoder layer (``p`` its checkpoint prefix: ``layers.{i}``, or ``mtp.{j}``)."""

    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, p: str, ratio: int, xp, expert_comm=None):
        self.attn_norm, self.ffn_norm = ckpt.extra[f"{p}.attn_norm"], ckpt.extra[f"{p}.ffn_norm"]
        if cfg.hc_mult > 1:
            self.hc_attn = HyperConnection(cfg, ckpt, f"{p}.hc_attn")
            self.hc_ffn = HyperConnection(cfg, ckpt, f"{p}.hc_ffn")
        self.attn = Attention(cfg, ckpt, p, ratio, xp)
        routing = RoutingConfig(top_k=cfg.top_k, score_func="sqrtsoftplus", routed_scale=cfg.routed_scale)
        shared = SharedExpert.from_checkpoint(ckpt, f"{p}.ffn.shared", limit=cfg.swiglu_limit, mode=cfg.mode)
        common = dict(num_experts=cfg.experts, bias="gate.bias", tid2eid=ckpt.extra.get(f"{p}.ffn.tid2eid"),
                      limit=cfg.swiglu_limit, mode=cfg.mode, shared=shared)
        if expert_comm is None:
            self.moe = MoE.from_checkpoint(ckpt, f"{p}.ffn", routing, **common)
        else:  # this rank's experts only, as `Model.parallelize` would leave them
            from fp4kit import distributed as dist

            self.moe = dist.ExpertParallelMoE.from_checkpoint(ckpt, f"{p}.ffn", routing, expert_comm,
                                                              tokens="replicated", **common)


class MtpLayer:
    """A multi-token-prediction layer (checkpoint prefix ``mtp.{j}``; DeepSeek-V4 has one): from the
    hidden state ``h`` the layers leave at position p (the residual stream before the final norm, or
    its copies) and the token at p + 1, the logits of the token at p + 2::

        x = e_proj(enorm(embed(token))) + h_proj(hnorm(h))   # e_proj's output added to every copy of h
        x = block(x)                                          # a whole layer, its own KV cache, at position p
        logits = lm_head(norm(x))                             # through its own head site with copies

    with the model's embedding and ``lm_head``. `Model.forward` runs it at the start of each step on
    the hidden state of the step before and the step's input token, so its draft is for the token
    the step itself samples (`Model.step` logs both: `runner.draft_acceptance`)."""

    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, j: int, ratio: int, xp, expert_comm=None):
        p = f"mtp.{j}"
        self.block = Block(cfg, ckpt, p, ratio, xp, expert_comm)
        self.e_proj, self.h_proj = (Linear.from_checkpoint(ckpt, f"{p}.{n}", mode=cfg.mode, static_input_scale=False)
                                    for n in ("e_proj", "h_proj"))
        self.enorm, self.hnorm, self.norm = (ckpt.extra[f"{p}.{n}"] for n in ("enorm", "hnorm", "norm"))
        self.hc_head = HyperConnection(cfg, ckpt, f"{p}.hc_head", head=True) if cfg.hc_mult > 1 else None

    def buffers(self, xp, cfg: ModelConfig, rows: int) -> dict:
        """What a call on ``rows`` tokens writes besides the block's own buffers: the block's input
        ``x`` (fp32, shaped as the residual stream), the embedding, the two projections (fp32)."""
        hc = cfg.hc_mult
        shape = (rows, hc, cfg.hidden) if hc > 1 else (rows, cfg.hidden)
        return {"x": xp.zeros(shape, np.float32), "emb": xp.zeros((rows, cfg.hidden), np.float32),
                "e": xp.zeros((rows, cfg.hidden), np.float32), "h": xp.zeros((rows * hc, cfg.hidden), np.float32)}

    def input(self, model: "Model", h, tokens, buf: dict):
        """The block's input ``buf["x"]`` for hidden states ``h`` (shaped as the residual stream,
        fp32) and tokens int32 ``[rows]``."""
        cfg, x = model.cfg, buf["x"]
        e = ew.embed_rmsnorm(model.embed, tokens, self.enorm, eps=cfg.eps, resid=buf["emb"])
        hn = ew.add_rmsnorm(h.reshape(-1, cfg.hidden), None, self.hnorm, eps=cfg.eps)  # each copy on its own
        e = self.e_proj(e, out=buf["e"])
        hn = self.h_proj(hn, out=buf["h"])
        model.xp.add(hn.reshape(x.shape), e.reshape(x.shape[:1] + (1,) * (x.ndim - 2) + x.shape[-1:]), out=x)
        return x


class DecodeState:
    """Everything one decode step of ``batch`` sequences reads and writes: the caches, the
    residual stream, the current tokens (input of the step, overwritten by its samples), the
    logits, and a token log ``history [rows, batch]`` with its device step counter."""

    def __init__(self, model: "Model", batch: int, history_rows: int = 1024):
        xp = model.xp
        self.batch = batch
        self.layers = [blk.attn.caches(batch, model.device) for blk in model.blocks]
        # the multi-token-prediction layer's cache and buffers (empty, None without one): its logits
        # and greedy drafts, a draft log beside the token log (row r the draft for the token logged
        # in row r); for speculative steps (`Model.speculative_step`) their samples and drafts over
        # two positions, the MTP logits, each sequence's logged tokens and accepted drafts
        self.mtp_layers = [m.block.attn.caches(batch, model.device) for m in model.mtp]
        self.mtp_buffers = [m.buffers(xp, model.cfg, batch) for m in model.mtp]
        self.mtp_logits = [xp.zeros((batch, model.cfg.vocab), BF16) for _ in model.mtp]
        self.mtp_primed = False  # whether resid holds a position's hidden state (the MTP's input)
        self.mtp_runs = 0  # MTP calls made (host count: a graph is captured only after an eager one)
        self.drafts = self.draft_history = self.draft_step = self.emitted = self.accepted = None
        if model.mtp:
            self.drafts = xp.full(batch, -1, np.int32)  # -1: no draft (the first position has no hidden state before it)
            self.draft_history = xp.zeros((history_rows, batch), np.int32)
            self.draft_step = xp.zeros(1, np.int32)
            self.spec_samples = xp.zeros(2 * batch, np.int32)
            self.spec_drafts = xp.zeros(2 * batch, np.int32)
            self.spec_mtp_logits = xp.zeros((2 * batch, model.cfg.vocab), BF16)
            self.spec_mtp_buffers = model.mtp[0].buffers(xp, model.cfg, 2 * batch)
            self.emitted = xp.zeros(batch, np.int32)
            self.accepted = xp.zeros(batch, np.int32)
        # the residual stream: [batch, hidden], or its hc_mult copies [batch, hc_mult, hidden]
        hc = model.cfg.hc_mult
        self.resid = xp.zeros((batch, hc, model.cfg.hidden) if hc > 1 else (batch, model.cfg.hidden), np.float32)
        self.tokens = xp.zeros(batch, np.int32)
        self.history = xp.zeros((history_rows, batch), np.int32)
        self.step = xp.zeros(1, np.int32)
        self.logits = None

    @property
    def positions(self):
        """Tokens in each sequence so far (the first layer's cache position, on the device)."""
        return self.layers[0]["kv"].pos


class Model:
    """The decoder (see the module docstring). ``ckpt`` holds the weights (`init.random_checkpoint`
    or `fp4kit.load_nvfp4`), in the memory the model runs in: CuPy arrays for ``device=True``,
    numpy for ``device=False``. With ``expert_comm`` (`fp4kit.distributed`) every MoE is built
    expert-parallel from the start, from this rank's experts alone (what `parallelize` with ``ep``
    leaves), so ``ckpt`` needs to hold no other experts."""

    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, *, device: bool, seed: int = 0, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, expert_comm=None):
        if device:
            import cupy as xp
        else:
            xp = np
        if device and cfg.hc_mult not in (1, hyper.HC):
            raise ValueError(f"hc_mult {cfg.hc_mult}: the device kernels are built for {hyper.HC} copies (DeepSeek-V4's); "
                             f"this one runs on the numpy model only (device=False)")
        self.cfg, self.device, self.xp = cfg, device, xp
        self.embed = ckpt.extra["embed"]
        self.blocks = [Block(cfg, ckpt, f"layers.{i}", r, xp, expert_comm) for i, r in enumerate(cfg.compress_ratios)]
        self.mtp = [MtpLayer(cfg, ckpt, j, r, xp, expert_comm) for j, r in enumerate(cfg.mtp_ratios)]
        self.norm = ckpt.extra["norm"]
        self.hc_head = HyperConnection(cfg, ckpt, "hc_head", head=True) if cfg.hc_mult > 1 else None
        self.lm_head = Linear.from_checkpoint(ckpt, "lm_head", mode=cfg.mode, static_input_scale=False)
        self.generator = Generator(seed, device=device)
        self.sampler = Sampler(self.generator, temperature=temperature, top_k=top_k, top_p=top_p)
        # the MTP's drafts are greedy, from a generator of their own (the step's draws unchanged)
        self.draft_sampler = Sampler(Generator(seed + 1, device=device), temperature=0.0) if self.mtp else None

    def new_state(self, batch: int, history_rows: int = 1024) -> DecodeState:
        return DecodeState(self, batch, history_rows)

    def forward(self, st: DecodeState, tap=None):
        """Logits bf16 ``[B, vocab]`` for the current tokens; appends them to the caches.

        ``tap(name, layer, value)``, if given, sees every value that crosses a sublayer boundary
        (the residual stream and the normed input before each sublayer, each sublayer's output,
        the logits) and returns the value to go on with: `runner.compare_layers` records one
        model's values and feeds them to another, so each sublayer is compared on equal inputs."""
        def sync(name, i, value):
            if tap is None:
                return value
            new = tap(name, i, value)
            if new is not value:
                value[...] = new
            return value

        if self.mtp and st.mtp_primed:
            self._draft(st, sync)
        st.mtp_primed = bool(self.mtp)
        if self.hc_head is not None:
            return self._forward_hc(st, sync)
        # the embedding and the first layer's norm in one launch
        h = ew.embed_rmsnorm(self.embed, st.tokens, self.blocks[0].attn_norm, eps=self.cfg.eps, resid=st.resid)
        for i, (blk, caches) in enumerate(zip(self.blocks, st.layers)):
            sync("resid", 2 * i, st.resid)
            h = blk.attn(sync("attn.in", i, h), caches)
            h = ew.add_rmsnorm(st.resid, sync("attn.out", i, h), blk.ffn_norm, eps=self.cfg.eps)
            sync("resid", 2 * i + 1, st.resid)
            h = self._moe_then_norm(i, sync("moe.in", i, h), st.tokens, st.resid, None if tap is None else sync)
        st.logits = sync("logits", 0, self.lm_head(sync("head.in", 0, h)))
        return st.logits

    def _forward_hc(self, st: DecodeState, sync):
        """`forward` on the hyper-connections' copies: the embedding starts them, each sublayer
        runs between two sites (the second bringing the copies up to date with its output), the
        head's site mixes them once more."""
        emb = ew.embed(self.embed, st.tokens)
        y, post, comb = self._blocks_hc(st.resid, emb, self.blocks, st.layers,
                                        lambda blk, h, caches: blk.attn(h, caches), st.tokens, sync)
        h, _, _ = self.hc_head.site(st.resid, self.norm, y, post, comb)
        st.logits = sync("logits", 0, self.lm_head(sync("head.in", 0, h)))
        return st.logits

    def _blocks_hc(self, x, emb, blocks, layers, attend, token_ids, sync, tag: str = "") -> tuple:
        """``blocks`` on the copies ``x [rows, hc, D]`` (in place, started from ``emb``, or with
        ``emb`` None taken as they are); ``attend(blk, h, caches)`` runs a block's attention on its
        normed input. Returns the last sublayer's output and its site's ``post`` / ``comb``, for the
        head's site. ``tag`` prefixes the names ``sync`` sees."""
        y, post, comb = emb, None, None
        for i, (blk, caches) in enumerate(zip(blocks, layers)):
            h, post, comb = blk.hc_attn.site(x, blk.attn_norm, y, post, comb, start=i == 0 and emb is not None)
            sync(tag + "resid", 2 * i, x)
            y = sync(tag + "attn.out", i, attend(blk, sync(tag + "attn.in", i, h), caches))
            h, post, comb = blk.hc_ffn.site(x, blk.ffn_norm, y, post, comb)
            sync(tag + "resid", 2 * i + 1, x)
            y = sync(tag + "moe.out", i, blk.moe(sync(tag + "moe.in", i, h), token_ids=token_ids))
        return y, post, comb

    def _draft(self, st: DecodeState, sync) -> None:
        """The MTP layer on the hidden state of the step before (``st.resid``) and the step's input
        token: its logits into ``st.mtp_logits[0]``, their greedy token into ``st.drafts``; its cache
        advances one position (the previous step's)."""
        mtp, caches, buf = self.mtp[0], st.mtp_layers[0], st.mtp_buffers[0]
        st.mtp_runs += 1
        x = sync("mtp.in", 0, mtp.input(self, st.resid, st.tokens, buf))
        h = self._mtp_block(x, st.tokens, caches, lambda blk, h, c: blk.attn(h, c), sync)
        logits = sync("mtp.logits", 0, self.lm_head(sync("mtp.head.in", 0, h), out=st.mtp_logits[0]))
        self.draft_sampler(logits, out=st.drafts)

    def _mtp_block(self, x, tokens, caches, attend, sync=None, head: bool = True):
        """The MTP layer's block on its input ``x`` (in place; ``tokens`` for its router), its
        attention run by ``attend(blk, h, caches)``; returns the head's input (its norm, through its
        own head site with copies), or None with ``head`` False."""
        sync = sync or _untapped
        mtp, eps = self.mtp[0], self.cfg.eps
        blk = mtp.block
        if mtp.hc_head is not None:
            y, post, comb = self._blocks_hc(x, None, [blk], [caches], attend, tokens, sync, tag="mtp.")
            return mtp.hc_head.site(x, mtp.norm, y, post, comb)[0] if head else None
        h = ew.add_rmsnorm(x, None, blk.attn_norm, eps=eps)
        sync("mtp.resid", 0, x)
        y = sync("mtp.attn.out", 0, attend(blk, sync("mtp.attn.in", 0, h), caches))
        h = ew.add_rmsnorm(x, y, blk.ffn_norm, eps=eps)
        sync("mtp.resid", 1, x)
        delta = sync("mtp.moe.out", 0, blk.moe(sync("mtp.moe.in", 0, h), token_ids=tokens))
        return ew.add_rmsnorm(x, delta, mtp.norm, eps=eps) if head else None

    def _through_layers(self, st: DecodeState, tokens, attend, select=None) -> tuple:
        """Tokens ``[rows]`` through every layer at once, ``attend(blk, h, caches)`` running each
        attention (over all rows: batched prefill, a speculative step): returns the head's input
        (bf16, for the rows ``select(a)`` picks, all by default) and the final hidden states,
        shaped as the residual stream (with copies, up to date in every row only without
        ``select``)."""
        xp, cfg, rows = self.xp, self.cfg, tokens.shape[0]
        select = select or (lambda a: a)
        if self.hc_head is not None:
            x = xp.empty((rows, cfg.hc_mult, cfg.hidden), np.float32)
            y, post, comb = self._blocks_hc(x, ew.embed(self.embed, tokens), self.blocks, st.layers, attend, tokens,
                                            _untapped)
            h, _, _ = self.hc_head.site(select(x), self.norm, select(y), select(post), select(comb))
            return h, x
        x = xp.empty((rows, cfg.hidden), np.float32)
        h = ew.embed_rmsnorm(self.embed, tokens, self.blocks[0].attn_norm, eps=cfg.eps, resid=x)
        for i, (blk, caches) in enumerate(zip(self.blocks, st.layers)):
            h = ew.add_rmsnorm(x, attend(blk, h, caches), blk.ffn_norm, eps=cfg.eps)
            h = self._moe_then_norm(i, h, tokens, x)
        return select(h), x

    def _moe_then_norm(self, i: int, h, tokens, resid, sync=None):
        """Block ``i``'s MoE on its normed input ``h``, then the residual step into the next block's
        input norm (the head's after the last block), returned: in the MoE's last launch
        (`MoE.__call__`'s ``then_norm``) unless ``sync`` (a tap, `forward`) must see the MoE's output
        or the layer is expert-parallel."""
        blk = self.blocks[i]
        weight = self.blocks[i + 1].attn_norm if i + 1 < len(self.blocks) else self.norm
        if sync is None and isinstance(blk.moe, MoE):
            return blk.moe(h, token_ids=tokens, then_norm=ew.ResidualNorm(resid, weight, self.cfg.eps))
        delta = blk.moe(h, token_ids=tokens)
        return ew.add_rmsnorm(resid, delta if sync is None else sync("moe.out", i, delta), weight, eps=self.cfg.eps)

    def prefill(self, st: DecodeState, tokens):
        """The prompt ``tokens [B, T]`` through each layer once, as T tokens per sequence (batched
        prefill), on a fresh state: the caches end as T `feed` calls would leave them (the
        activations of a W4A4 GEMM are quantized with one global scale over all T tokens, not per
        token, so logits agree with token-by-token feeding within the quantization's error).
        Returns the logits of each sequence's last token, bf16 ``[B, vocab]``. No host sync."""
        xp = self.xp
        tokens = xp.ascontiguousarray(xp.asarray(tokens, dtype=np.int32))
        b, t = tokens.shape
        flat = tokens.reshape(-1)
        positions = xp.asarray(np.tile(np.arange(t, dtype=np.int32), b))

        def last(a):  # each sequence's last position: the only rows the head reads
            return xp.ascontiguousarray(a.reshape(b, t, *a.shape[1:])[:, -1])

        def attend(blk, h, caches):
            return blk.attn.prefill(h, caches, positions, b, t)

        # the head reads each sequence's last position, the MTP layer every position's hidden state
        h, hidden = self._through_layers(st, flat, attend, None if self.mtp else last)
        if self.mtp:
            h = last(h)
            self._prefill_mtp(st, hidden, tokens)
        st.logits = self.lm_head(h)
        return st.logits

    def _prefill_mtp(self, st: DecodeState, hidden, tokens) -> None:
        """The MTP layer over a prompt ``tokens [B, T]`` whose hidden states (every position's,
        shaped as the residual stream) the layers left in ``hidden``: position p with token p + 1 for
        p < T - 1, filling its cache as T - 1 decode steps would; the last position's hidden state
        goes to ``st.resid`` for the first step's draft. Its logits are not needed (no draft is
        compared in a prompt), so the head does not run."""
        xp, cfg = self.xp, self.cfg
        b, t = tokens.shape
        per_seq = hidden.reshape(b, t, *hidden.shape[1:])
        st.resid[...] = per_seq[:, -1]
        st.mtp_primed = True
        if t < 2:
            return
        mtp, caches = self.mtp[0], st.mtp_layers[0]
        rows = b * (t - 1)
        positions = xp.asarray(np.tile(np.arange(t - 1, dtype=np.int32), b))
        following = xp.ascontiguousarray(tokens[:, 1:]).reshape(-1)
        x = mtp.input(self, xp.ascontiguousarray(per_seq[:, :-1]), following, mtp.buffers(xp, cfg, rows))
        self._mtp_block(x, following, caches, lambda blk, h, c: blk.attn.prefill(h, c, positions, b, t - 1),
                        head=False)

    # -- speculative decoding with the MTP layer's drafts --------------------------------------
    def start_speculation(self, st: DecodeState) -> None:
        """After a decode step: the MTP layer's draft for the token after the one just sampled (on
        the step's hidden state), so `speculative_step` can verify it; the token log's per-sequence
        counts start from the steps logged so far."""
        if not self.mtp:
            raise ValueError("speculative decoding needs the MTP layer (ModelConfig.mtp_ratios)")
        self._draft(st, _untapped)
        st.emitted[...] = st.step
        st.accepted[...] = 0

    def speculative_step(self, st: DecodeState):
        """One speculative step: every sequence's input token (``st.tokens``, position p) and the
        MTP layer's draft of the next one (``st.drafts``, p + 1) go through the model as two tokens,
        in one pass over the weights. The token sampled after the input is kept always; the draft
        is accepted where it equals that sample, and then the token sampled after the draft is kept
        too (with a draft that is a single token, drawing the first sample from the model and
        accepting where it equals the draft is exact speculative sampling). A rejected draft's
        cache rows are taken back (`fp4kit.KVCache.rewind`). The MTP layer runs on both positions' hidden
        states and kept tokens and drafts again from the last kept one. The kept tokens go to the
        token log at each sequence's own count (``st.emitted``; ``st.accepted`` counts the accepted
        drafts). Launches only, no host sync: capturable once `start_speculation` has run."""
        xp, b = self.xp, st.batch
        tokens = xp.concatenate([st.tokens, st.drafts])  # token-major: the inputs, then the drafts
        positions = (st.positions[None, :] + xp.arange(2, dtype=np.int32)[:, None]).reshape(-1)
        logits, hidden = self._forward_rows(st, tokens, positions, 2)
        samples = self.sampler(logits, out=st.spec_samples)
        accept = samples[:b] == st.drafts
        kept = accept.astype(np.int32) + np.int32(1)
        mtp_logits = self._mtp_rows(st, hidden, samples, positions, 2)
        drafts = self.draft_sampler(mtp_logits, out=st.spec_drafts)
        rejected = np.int32(2) - kept  # a rejected draft's rows taken back in every cache
        for caches in st.layers + st.mtp_layers:
            for name in ("kv", "index"):
                if name in caches:
                    caches[name].rewind(rejected)
        rows, seq = st.history.shape[0], xp.arange(b)
        st.history[st.emitted % rows, seq] = samples[:b]
        second = (st.emitted + 1) % rows
        st.history[second, seq] = xp.where(accept, samples[b:], st.history[second, seq])
        st.emitted += kept
        st.accepted += accept
        st.tokens[...] = xp.where(accept, samples[b:], samples[:b])
        st.drafts[...] = xp.where(accept, drafts[b:], drafts[:b])
        last = hidden.reshape(2, b, *hidden.shape[1:])
        st.resid[...] = xp.where(accept.reshape(b, *([1] * (hidden.ndim - 1))), last[1], last[0])
        return st.tokens

    def _forward_rows(self, st: DecodeState, tokens, positions, t: int):
        """``t`` tokens of every sequence (``tokens [t * B]`` token-major, at ``positions``) through
        the layers at once (`Attention.extend`): their logits ``[t * B, vocab]`` and their final
        hidden states (shaped as the residual stream)."""
        h, hidden = self._through_layers(st, tokens,
                                         lambda blk, h, caches: blk.attn.extend(h, caches, positions, st.batch, t))
        return self.lm_head(h), hidden

    def _mtp_rows(self, st: DecodeState, hidden, tokens, positions, t: int):
        """The MTP layer on ``t`` (2) positions of every sequence at once (token-major rows: the
        hidden states ``hidden`` and the tokens after them): its logits ``[t * B, vocab]`` (into
        the state's buffers)."""
        mtp, b = self.mtp[0], st.batch
        x = mtp.input(self, hidden, tokens, st.spec_mtp_buffers)
        h = self._mtp_block(x, tokens, st.mtp_layers[0], lambda blk, h, c: blk.attn.extend(h, c, positions, b, t))
        return self.lm_head(h, out=st.spec_mtp_logits)

    def step(self, st: DecodeState):
        """One decode step: the next token of every sequence replaces ``st.tokens`` and is logged.
        Launches only (no host sync): capturable in a CUDA graph after one eager call."""
        logits = self.forward(st)
        self.sampler(logits, out=st.tokens)  # the samples land in the state's tokens: no copy
        ew.log_tokens(st.tokens, st.history, st.step)
        if self.mtp:  # the MTP's draft for the token just sampled, in the same row of its own log
            ew.log_tokens(st.drafts, st.draft_history, st.draft_step)
        return st.tokens

    def feed(self, st: DecodeState, tokens):
        """Teacher-force one token per sequence (a prompt position): logits are computed and the
        caches advance, the sampled token is discarded."""
        st.tokens[...] = tokens
        return self.forward(st)

    def parallelize(self, comm, *, tp: bool = False, ep: bool = False) -> int:
        """Shard this model over the ranks of ``comm`` (`fp4kit.distributed`), every rank holding the same
        tokens: ``ep`` splits each MoE's experts (``tokens="replicated"``: each rank runs its experts
        on every token, one all-gather of the results); ``tp`` splits the rows of every attention
        projection and of the lm_head (column-parallel, outputs all-gathered: the same values as one
        GPU up to the summation order a shard's GEMM picks). Returns the number of projections left whole (rows not divisible by the ranks)."""
        from fp4kit import distributed as dist

        whole = 0

        def column(lin):
            nonlocal whole
            try:
                return dist.ColumnParallelLinear.shard(lin, comm, gather_output=True)
            except ValueError:
                whole += 1
                return lin

        for blk in self.blocks + [m.block for m in self.mtp]:
            if ep and not isinstance(blk.moe, dist.ExpertParallelMoE):  # not built expert-parallel already
                blk.moe = dist.ExpertParallelMoE.shard(blk.moe, comm, tokens="replicated")
            if tp:
                a = blk.attn
                a.of_h.map(column)
                a.of_qr.map(column)
                a.wo_b = column(a.wo_b)
                a.wo_a.ungroup()
                a.wo_a.linears = [column(lin) for lin in a.wo_a.linears]
        if tp:
            self.lm_head = column(self.lm_head)
        return whole

    # -- bytes a decode step reads (for the bandwidth figure) -------------------------------------
    def weight_bytes(self, experts_touched: list[int]) -> dict:
        """NVFP4 + high-precision weight bytes a step reads on this GPU: every attention and
        shared-expert weight (this rank's shards), each layer's router and its share of the
        ``experts_touched[i]`` distinct experts, the lm_head, and the hyper-connections' mixing
        weights where the model has copies."""
        total = {"attention": 0, "shared": 0, "routed": 0, "router": 0}
        for i, touched in enumerate(experts_touched[: len(self.blocks)]):
            for part, n in self.layer_weight_bytes(i, touched).items():
                total[part] += n
        sites = [] if self.hc_head is None else [self.hc_head] + [s for b in self.blocks for s in (b.hc_attn, b.hc_ffn)]
        mixing = sum(int(s.fn.nbytes + s.scale.nbytes + s.base.nbytes) for s in sites)
        mtp = {}
        for m, touched in zip(self.mtp, experts_touched[len(self.blocks):]):  # the draft's layer, all of it
            head = [] if m.hc_head is None else [m.hc_head, m.block.hc_attn, m.block.hc_ffn]
            mtp["mtp"] = (sum(self._block_weight_bytes(m.block, touched).values()) + _weight_bytes(m.e_proj)
                          + _weight_bytes(m.h_proj) + sum(int(s.fn.nbytes + s.scale.nbytes + s.base.nbytes) for s in head))
        return {**total, "lm_head": _weight_bytes(self.lm_head), **({"hyper": mixing} if sites else {}), **mtp}

    def layer_weight_bytes(self, i: int, experts_touched: int) -> dict:
        """`weight_bytes` of layer ``i`` alone, with ``experts_touched`` distinct routed experts."""
        return self._block_weight_bytes(self.blocks[i], experts_touched)

    def _block_weight_bytes(self, blk: Block, experts_touched: int) -> dict:
        a = blk.attn
        attn = sum(_weight_bytes(lin) for lin in [*a.of_h.linears(), *a.of_qr.linears(), a.wo_b])
        stack_bytes = sum(int(s.packed.nbytes + s.block_scales.nbytes) for s in (blk.moe.w13, blk.moe.w2))
        return {"attention": attn + a.wo_a.weight_bytes(),
                "shared": _weight_bytes(blk.moe.shared.gate_up) + _weight_bytes(blk.moe.shared.down),
                "routed": stack_bytes * experts_touched // self.cfg.experts,
                "router": int(blk.moe.gate_weight.nbytes)}


def _weight_bytes(layer) -> int:
    """NVFP4 bytes of a Linear's weight (a tensor-parallel layer's own shard) and its global scale."""
    t = getattr(layer, "local", layer).weight
    return int(t.packed.nbytes + t.block_scales.nbytes + 4)
