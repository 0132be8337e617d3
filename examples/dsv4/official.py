"""A converted official DeepSeek-V4 checkpoint as this model's checkpoint.

``fp4kit convert`` keeps the official tensor names (the ``inference/`` layout) and writes the
quantized linears in the ModelOpt NVFP4 layout. `from_official` maps such a checkpoint onto the
names `Model` reads (`init.random_checkpoint`'s), for the architecture of ``cfg``:

* linears keep their prefixes (``layers.{i}.attn.wq_a``, ``...ffn.experts.{e}.w1`` ...), but for
  ``attn.wo_a`` (one ``[G * o_lora, H * D / G]`` weight, split here into its G group weights
  ``wo_a.{g}`` by rows: exact, the block scales run along K), ``attn.indexer.wq_b`` (``indexer.wq``),
  the shared expert ``ffn.shared_experts.{w1,w3,w2}`` (``ffn.shared.{gate,up,down}_proj``), the
  routed experts' ``w1 / w3 / w2`` (``gate_proj / up_proj / down_proj``) and ``head`` (``lm_head``);
* a linear the official checkpoint keeps in high precision (the compressors' fp32 ``wkv`` and
  ``wgate``, a bf16 head or indexer projection) is quantized here with `fp4kit.quantize` (the TE
  recipe) and listed in the report: this model runs every linear in NVFP4;
* norms (``P.weight``) become fp32 ``P``, ``embed.weight`` ``embed``, ``attn.attn_sink``
  ``attn.sink``, ``ffn.gate.tid2eid`` ``ffn.tid2eid``; the router's weight and bias keep theirs;
* the hyper-connections' parameters (``layers.{i}.hc_attn_fn`` ... ``hc_head_base``, fp32) keep
  their names when ``cfg.hc_mult > 1``; with ``hc_mult = 1`` they are left out;
* the multi-token-prediction layers (``mtp.{j}.*``: a block under the layers' names, its
  ``e_proj`` / ``h_proj``, ``enorm`` / ``hnorm`` / ``norm`` and its head site ``hc_head_*``) are
  mapped like the layers when ``cfg.mtp_ratios`` builds them;
* tensors of parts this model does not build (MTP layers without ``cfg.mtp_ratios``; the
  hyper-connections of a one-stream model) are left out and listed.

Every tensor ``cfg`` needs is checked for presence and shape before anything is converted; a
missing or misshapen one is refused naming it and what was expected. `needed` selects what to read
of a checkpoint for ``cfg`` (its layers only), so a slice of V4-Flash does not read the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

import fp4kit
from fp4kit.checkpoint import Checkpoint
from fp4kit.formats import Nvfp4Tensor, to_linear

from .config import ModelConfig
from .init import hc_shapes, linear_shapes

#: this model's names -> the official ones, where they differ (a suffix of the prefix)
_RENAMED = {".shared.gate_proj": ".shared_experts.w1", ".shared.up_proj": ".shared_experts.w3",
            ".shared.down_proj": ".shared_experts.w2", ".gate_proj": ".w1", ".up_proj": ".w3", ".down_proj": ".w2",
            ".indexer.wq": ".indexer.wq_b"}


@dataclass
class Report:
    """What `from_official` did beyond renaming."""

    quantized_here: list[str] = field(default_factory=list)  # high-precision linears quantized at load
    left_out: list[str] = field(default_factory=list)  # tensors of parts this model does not build

    def lines(self) -> list[str]:
        out = []
        if self.quantized_here:
            out.append(f"quantized at load ({len(self.quantized_here)}, kept in high precision by the checkpoint): "
                       + ", ".join(self.quantized_here[:6]) + (" ..." if len(self.quantized_here) > 6 else ""))
        if self.left_out:
            out.append(f"left out ({len(self.left_out)}, parts this model does not build): "
                       + ", ".join(self.left_out[:6]) + (" ..." if len(self.left_out) > 6 else ""))
        return out


def is_official(ckpt: Checkpoint) -> bool:
    """Whether ``ckpt`` uses the official names (``embed.weight``) rather than this model's (``embed``)."""
    return "embed.weight" in ckpt.extra and "embed" not in ckpt.extra


def needed(cfg: ModelConfig, experts: range | None = None):
    """``keep(name)`` for `fp4kit.checkpoint.load_nvfp4`: the tensors of ``cfg``'s layers and the
    model-wide ones (embedding, final norm, head, ...) and of the multi-token-prediction layers
    ``cfg`` builds; not those of later layers or of MTP layers it does not build, so a slice of a
    large checkpoint reads only what it runs; with ``experts`` (an expert-parallel rank's) no other
    routed expert either."""
    counts = {"layers": cfg.layers, "mtp": len(cfg.mtp_ratios)}

    def keep(name: str) -> bool:
        head, _, rest = name.partition(".")
        if head in counts:
            index = rest.split(".", 1)[0]
            return index.isdigit() and int(index) < counts[head] and routed_expert_kept(name, experts)
        return True

    return keep


def routed_expert_kept(name: str, experts: range | None) -> bool:
    """Whether tensor ``name`` is not a routed expert's (``...ffn.experts.{e}...``) or is one of
    ``experts`` (None: all)."""
    if experts is None or ".ffn.experts." not in name:
        return True
    index = name.split(".ffn.experts.", 1)[1].split(".", 1)[0]
    return not index.isdigit() or int(index) in experts


def _official_name(ours: str) -> str:
    for suffix, theirs in _RENAMED.items():  # the shared expert's before the routed experts'
        if ours.endswith(suffix):
            return ours[: -len(suffix)] + theirs
    return ours


def _linears(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, int]]]:
    """``{official prefix: (this model's prefix, (out, in))}`` of every linear ``cfg`` needs (from
    `init.linear_shapes`; the G groups of ``wo_a`` as one official weight)."""
    out = {"head": ("lm_head", (cfg.vocab, cfg.hidden))}
    for block, ratio in cfg.blocks():
        for ours, (n, k) in linear_shapes(cfg, block, ratio).items():
            base, _, group = ours.rpartition(".")
            if base.endswith(".wo_a"):  # wo_a.{g}: one [G * o_lora, K] weight, split by rows at load
                if group == "0":
                    out[base] = (base, (cfg.o_groups * n, k))
                continue
            out[_official_name(ours)] = (ours, (n, k))
    return out


def _others(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], object]]:
    """``{official name: (this model's name, shape, dtype)}`` of every other tensor ``cfg`` needs."""
    f32, bf16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
    out = {"embed.weight": ("embed", (cfg.vocab, cfg.hidden), bf16), "norm.weight": ("norm", (cfg.hidden,), f32)}
    for p, ratio in cfg.blocks():
        out[f"{p}.attn_norm.weight"] = (f"{p}.attn_norm", (cfg.hidden,), f32)
        out[f"{p}.ffn_norm.weight"] = (f"{p}.ffn_norm", (cfg.hidden,), f32)
        out[f"{p}.attn.q_norm.weight"] = (f"{p}.attn.q_norm", (cfg.q_lora,), f32)
        out[f"{p}.attn.kv_norm.weight"] = (f"{p}.attn.kv_norm", (cfg.head_dim,), f32)
        out[f"{p}.attn.attn_sink"] = (f"{p}.attn.sink", (cfg.heads,), f32)
        coff = 2 if ratio == 4 else 1
        if ratio:
            out[f"{p}.attn.compressor.ape"] = (f"{p}.attn.compressor.ape", (ratio, coff * cfg.head_dim), f32)
            out[f"{p}.attn.compressor.norm.weight"] = (f"{p}.attn.compressor.norm", (cfg.head_dim,), f32)
        if ratio == 4:
            c = f"{p}.attn.indexer.compressor"
            out[f"{c}.ape"] = (f"{c}.ape", (ratio, 2 * cfg.index_head_dim), f32)
            out[f"{c}.norm.weight"] = (f"{c}.norm", (cfg.index_head_dim,), f32)
        f = f"{p}.ffn"
        out[f"{f}.gate.weight"] = (f"{f}.gate.weight", (cfg.experts, cfg.hidden), None)  # bf16 or fp32, as stored
        out[f"{f}.gate.bias"] = (f"{f}.gate.bias", (cfg.experts,), f32)
        if cfg.hashed(p):
            out[f"{f}.gate.tid2eid"] = (f"{f}.tid2eid", (cfg.vocab, cfg.top_k), np.dtype(np.int32))
        for part in ("attn", "ffn"):
            out.update({n: (n, shape, f32) for n, shape in hc_shapes(cfg, f"{p}.hc_{part}").items()})
        if p.startswith("mtp."):  # its input norms, its final norm and its own head site
            for norm in ("enorm", "hnorm", "norm"):
                out[f"{p}.{norm}.weight"] = (f"{p}.{norm}", (cfg.hidden,), f32)
            out.update({n: (n, shape, f32) for n, shape in hc_shapes(cfg, f"{p}.hc_head", head=True).items()})
    out.update({n: (n, shape, f32) for n, shape in hc_shapes(cfg, "hc_head", head=True).items()})
    return out


def _split_rows(w: Nvfp4Tensor, parts: int) -> list[Nvfp4Tensor]:
    """``parts`` equal row blocks of a weight, exactly (same codes, block scales and global scale)."""
    w = to_linear(w)
    n, k = w.shape
    rows = n // parts
    return [Nvfp4Tensor(w.packed[g * rows:(g + 1) * rows].copy(), w.block_scales[g * rows:(g + 1) * rows].copy(),
                        w.global_scale, "linear", (rows, k)) for g in range(parts)]


def from_official(ckpt: Checkpoint, cfg: ModelConfig, experts: range | None = None) -> tuple[Checkpoint, Report]:
    """``(checkpoint in this model's names, report)`` of a converted official checkpoint (host or
    device arrays, as loaded); with ``experts`` (an expert-parallel rank's) only those routed
    experts are expected. Raises KeyError naming the first missing tensor, ValueError naming the
    first one of the wrong shape."""
    linears = {n: v for n, v in _linears(cfg).items() if routed_expert_kept(n, experts)}
    others = _others(cfg)
    for name, (_, shape) in linears.items():  # every check before any conversion
        if name in ckpt.weights:
            have = tuple(ckpt.weights[name].shape)
        elif f"{name}.weight" in ckpt.extra:
            have = tuple(ckpt.extra[f"{name}.weight"].shape)
        else:
            raise KeyError(f"checkpoint: no weight {name!r} (expected [{shape[0]}, {shape[1]}] for this config)")
        if have != shape:
            raise ValueError(f"checkpoint: {name!r} has shape {list(have)}, expected {list(shape)} for this config")
    for name, (_, shape, _) in others.items():
        if name not in ckpt.extra:
            raise KeyError(f"checkpoint: no tensor {name!r} (expected shape {list(shape)} for this config)")
        if tuple(ckpt.extra[name].shape) != shape:
            raise ValueError(f"checkpoint: {name!r} has shape {list(ckpt.extra[name].shape)}, expected {list(shape)} "
                             f"for this config")
    out, report = Checkpoint(layout=ckpt.layout, quant_config=ckpt.quant_config, files=list(ckpt.files)), Report()
    for name, (ours, _) in linears.items():
        if name in ckpt.weights:
            w = ckpt.weights[name]
        else:  # kept in high precision by the checkpoint
            w = fp4kit.quantize(ckpt.extra[f"{name}.weight"].astype(np.float32))
            report.quantized_here.append(name)
        if ours.endswith(".wo_a"):
            for g, part in enumerate(_split_rows(w, cfg.o_groups)):
                out.weights[f"{ours}.{g}"] = part
        else:
            out.weights[ours] = w
        if name in ckpt.input_scales:
            out.input_scales[ours] = ckpt.input_scales[name]
    for name, (ours, _, dtype) in others.items():
        v = ckpt.extra[name]
        out.extra[ours] = v if dtype is None or v.dtype == dtype else v.astype(dtype)
    used = set(others) | {f"{n}.weight" for n in linears}
    report.left_out = sorted(n for n in ckpt.extra if n not in used)
    report.left_out += sorted(n for n in ckpt.weights if n not in linears)
    return out, report
