"""Model configurations: the `tiny` preset (runs on numpy in seconds) and `v4-flash-slice`
(DeepSeek-V4-Flash widths with a few layers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from fp4kit.reference import hyper_connections


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    hidden: int
    layers: int
    heads: int  # query heads over one shared latent (MQA, K = V)
    head_dim: int  # latent width
    rope_dim: int  # RoPE on the last rope_dim channels of q and kv
    q_lora: int  # rank of the query's low-rank projection
    o_lora: int  # rank per group of the grouped output projection
    o_groups: int
    window: int  # sliding window of every layer
    compress_ratios: tuple[int, ...]  # per layer: 0 (window only), 4 (indexer top-k) or 128 (all entries)
    index_heads: int
    index_head_dim: int
    index_topk: int
    experts: int
    top_k: int
    inner: int  # expert and shared-expert inner size
    hash_layers: int  # the first layers route by token id
    routed_scale: float = 1.5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN RoPE scaling of the compressing layers (ratio 4 and 128: their queries, latents,
    # compressed entries and indexer, with compress_rope_theta; window-only layers keep plain
    # rope_theta), as the official inference builds it: rope_factor 1 is none
    rope_factor: float = 1.0
    rope_original: int = 0  # the context the model was trained at before scaling (YaRN's ramp)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    eps: float = 1e-6
    max_context: int = 4096  # tokens per sequence the compressed buffers hold
    # bf16 activations ("w4a16") or NVFP4 activations ("w4a4") for every GEMM. W4A16 by default: the
    # H200 multiplies both on its bf16 tensor cores, so W4A4 only adds its activation quantizations
    # (one launch before each GEMM): the decode step 1.10 -> 0.78 ms at batch 1 (docs/decode-step.md)
    mode: str = "w4a16"
    # manifold-constrained hyper-connections: hc_mult copies of the residual stream mixed around
    # every sublayer (fp4kit.reference.hyper_connections); 1 is one plain residual stream. The GPU
    # model builds 4 (fp4kit.ops.hyper: DeepSeek-V4's), the numpy model any
    hc_mult: int = 1
    hc_iters: int = 20  # Sinkhorn iterations of the copies' mixing matrix
    hc_eps: float = 1e-6
    # the official inference's simulated activation quantization (the latents' channels outside
    # RoPE through E4M3, the indexer's queries and keys through E2M1 after a Hadamard rotation:
    # fp4kit.reference.qat) and the de-rotation of the attention output's RoPE channels. Numpy
    # model only so far
    qat_sim: bool = False
    # the multi-token-prediction layers (the official `num_nextn_predict_layers`, checkpoint prefix
    # ``mtp.{j}``), by their compression ratio (the official `compress_ratios` entries after the
    # layers'): each is a whole block on the hidden state the layers leave and the next token's
    # embedding, drafting the token after it (`dsv4.model.MtpLayer`). Empty: none built
    mtp_ratios: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.compress_ratios) != self.layers:
            raise ValueError(f"compress_ratios: expected {self.layers} entries, got {len(self.compress_ratios)}")
        if any(r not in (0, 4, 128) for r in self.compress_ratios):
            raise ValueError(f"compress_ratios: expected entries in (0, 4, 128), got {self.compress_ratios}")
        if not isinstance(self.mtp_ratios, tuple) or any(r not in (0, 4, 128) for r in self.mtp_ratios):
            raise ValueError(f"mtp_ratios: expected a tuple of entries in (0, 4, 128), got {self.mtp_ratios!r}")
        if len(self.mtp_ratios) > 1:
            raise ValueError(f"mtp_ratios: this model drafts with one multi-token-prediction layer (DeepSeek-V4 has "
                             f"one), got {len(self.mtp_ratios)}")
        if (self.heads * self.head_dim) % self.o_groups:
            raise ValueError("o_groups: must divide heads * head_dim")
        if not 0 <= self.hash_layers <= self.layers:
            raise ValueError(f"hash_layers: expected 0..{self.layers}, got {self.hash_layers}")
        if isinstance(self.hc_mult, bool) or not isinstance(self.hc_mult, int) or self.hc_mult < 1:
            raise ValueError(f"hc_mult: expected a positive int, got {self.hc_mult!r}")
        if isinstance(self.hc_iters, bool) or not isinstance(self.hc_iters, int) or self.hc_iters < 1:
            raise ValueError(f"hc_iters: expected a positive int, got {self.hc_iters!r}")
        if not self.rope_factor >= 1.0:
            raise ValueError(f"rope_factor: expected 1 (no scaling) or more, got {self.rope_factor!r}")
        if self.rope_factor > 1.0 and not (self.rope_original > 0 and self.beta_fast > self.beta_slow > 0):
            raise ValueError(f"rope_factor {self.rope_factor}: YaRN needs rope_original > 0 and beta_fast > beta_slow > 0, "
                             f"got {self.rope_original}, {self.beta_fast}, {self.beta_slow}")
        if self.qat_sim and ((self.head_dim - self.rope_dim) % 64 or self.index_head_dim % 32
                             or self.index_head_dim & (self.index_head_dim - 1)):
            raise ValueError(f"qat_sim: needs head_dim - rope_dim a multiple of 64 and index_head_dim a power of two of "
                             f"32 or more; got {self.head_dim} - {self.rope_dim} and {self.index_head_dim}")

    def rope_theta_of(self, ratio: int):
        """What a layer of compression ``ratio`` rotates by: the base ``rope_theta`` (window-only
        layers), ``compress_rope_theta`` (compressing layers), or with ``rope_factor > 1`` the latter's
        YaRN-scaled inverse frequencies (float64 ``[rope_dim / 2]``), which the numpy ops take in
        place of a base."""
        if not ratio:
            return self.rope_theta
        if self.rope_factor == 1.0:
            return self.compress_rope_theta
        return hyper_connections.yarn_inv_freq(self.rope_dim, self.compress_rope_theta, self.rope_factor,
                                                self.rope_original, self.beta_fast, self.beta_slow)

    def blocks(self) -> list[tuple[str, int]]:
        """``(checkpoint prefix, compression ratio)`` of every block: the layers' (``layers.{i}``),
        then the multi-token-prediction layers' (``mtp.{j}``)."""
        return ([(f"layers.{i}", r) for i, r in enumerate(self.compress_ratios)]
                + [(f"mtp.{j}", r) for j, r in enumerate(self.mtp_ratios)])

    def hashed(self, prefix: str) -> bool:
        """Whether the block at ``prefix`` routes by token id: the first ``hash_layers`` layers (an
        MTP layer comes after every layer of the official model, so never)."""
        head, _, index = prefix.partition(".")
        return head == "layers" and int(index) < self.hash_layers

    def max_comp(self, ratio: int) -> int:
        """Compressed entries per sequence a layer of this ratio can hold (a whole context)."""
        return max(1, self.max_context // ratio) if ratio else 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["mtp_ratios"] = list(self.mtp_ratios)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return cls(**{**d, "compress_ratios": tuple(d["compress_ratios"]), "mtp_ratios": tuple(d.get("mtp_ratios", ()))})


def _ratios(layers: int) -> tuple[int, ...]:
    """V4-Flash's pattern for a slice: a window-only first layer when there is room, then CSA (4)
    and HCA (128) layers alternating, so a slice of two or more layers has both kinds."""
    if layers <= 2:
        return (4, 128)[:layers]
    return (0,) + tuple(4 if i % 2 == 0 else 128 for i in range(layers - 1))


def tiny(layers: int = 4, **overrides) -> ModelConfig:
    return replace(ModelConfig(
        vocab=1024, hidden=256, layers=layers, heads=4, head_dim=64, rope_dim=16, q_lora=128, o_lora=128,
        o_groups=2, window=16, compress_ratios=_ratios(layers), index_heads=8, index_head_dim=32, index_topk=16,
        experts=8, top_k=2, inner=128, hash_layers=1, max_context=1024), **overrides)


def v4_flash_slice(layers: int = 4, **overrides) -> ModelConfig:
    return replace(ModelConfig(
        vocab=129280, hidden=4096, layers=layers, heads=64, head_dim=512, rope_dim=64, q_lora=1024, o_lora=1024,
        o_groups=8, window=128, compress_ratios=_ratios(layers), index_heads=64, index_head_dim=128, index_topk=512,
        experts=256, top_k=6, inner=2048, hash_layers=1, max_context=8192), **overrides)


PRESETS = {"tiny": tiny, "v4-flash-slice": v4_flash_slice}

# An official DeepSeek-V4 config.json (Hugging Face key names; the `inference/` copy's renamed keys
# accepted too) -> this model's fields
_OFFICIAL_KEYS = {
    "vocab": ("vocab_size",), "hidden": ("hidden_size", "dim"), "layers": ("num_hidden_layers", "n_layers"),
    "heads": ("num_attention_heads", "n_heads"), "head_dim": ("head_dim",), "rope_dim": ("qk_rope_head_dim",),
    "q_lora": ("q_lora_rank",), "o_lora": ("o_lora_rank",), "o_groups": ("o_groups",),
    "window": ("sliding_window", "window_size"), "index_heads": ("index_n_heads",),
    "index_head_dim": ("index_head_dim",), "index_topk": ("index_topk",), "experts": ("n_routed_experts",),
    "top_k": ("num_experts_per_tok", "n_activated_experts"), "inner": ("moe_intermediate_size", "moe_inter_dim"),
    "hash_layers": ("num_hash_layers", "n_hash_layers"), "routed_scale": ("routed_scaling_factor", "route_scale"),
    "swiglu_limit": ("swiglu_limit",), "rope_theta": ("rope_theta",), "compress_rope_theta": ("compress_rope_theta",),
    "hc_mult": ("hc_mult",), "hc_iters": ("hc_sinkhorn_iters",), "hc_eps": ("hc_eps",),
}
_OPTIONAL = {"swiglu_limit", "rope_theta", "compress_rope_theta", "routed_scale", "hc_mult", "hc_iters", "hc_eps"}


def _yarn(d: dict) -> dict:
    """This model's YaRN fields from an official config: its ``rope_scaling`` entry (Hugging Face)
    or the `inference/` copy's ``rope_factor``, ``original_seq_len``, ``beta_fast``, ``beta_slow``;
    ``rope_factor`` 1 where it has neither. Refuses another kind of scaling, naming it."""
    scaling = d.get("rope_scaling")
    if scaling:
        kind = scaling.get("type", scaling.get("rope_type"))
        if kind != "yarn":
            raise ValueError(f"config: rope_scaling type {kind!r} (this model builds 'yarn')")
        src = {"rope_factor": scaling.get("factor"), "rope_original": scaling.get("original_max_position_embeddings"),
               "beta_fast": scaling.get("beta_fast", 32), "beta_slow": scaling.get("beta_slow", 1)}
        names = {"rope_factor": "factor", "rope_original": "original_max_position_embeddings"}
    else:
        scaled = d.get("rope_factor", 1) != 1
        src = {"rope_factor": d.get("rope_factor", 1), "rope_original": d.get("original_seq_len", None if scaled else 0),
               "beta_fast": d.get("beta_fast", 32), "beta_slow": d.get("beta_slow", 1)}
        names = {"rope_factor": "rope_factor", "rope_original": "original_seq_len"}
    missing = [names[k] for k, v in src.items() if v is None]
    if missing:
        raise ValueError(f"config: YaRN RoPE scaling without {', '.join(missing)}")
    return {"rope_factor": float(src["rope_factor"]), "rope_original": int(src["rope_original"]),
            "beta_fast": float(src["beta_fast"]), "beta_slow": float(src["beta_slow"])}


def from_official(d: dict, layers: int | None = None, mtp: bool = False, **overrides) -> ModelConfig:
    """This model's configuration from an official DeepSeek-V4 ``config.json`` (V4-Flash, V4-Pro),
    its first ``layers`` layers (all by default) and, with ``mtp``, its multi-token-prediction layers
    (``num_nextn_predict_layers``, their ratios the entries of ``compress_ratios`` after the layers';
    without, those entries are dropped). Refuses, naming them, what this model cannot express: missing keys, a key value other
    than the one the model builds (one key-value head, one shared expert, ``sqrtsoftplus`` routing,
    no expert groups, YaRN if any RoPE scaling). The GPU model refuses copies of the residual stream
    other than DeepSeek-V4's 4."""
    fields, missing = {}, []
    for name, keys in _OFFICIAL_KEYS.items():
        key = next((k for k in keys if k in d), None)
        if key is None:
            if name not in _OPTIONAL:
                missing.append(" or ".join(keys))
            continue
        fields[name] = d[key]
    if missing:
        raise ValueError(f"config: missing {', '.join(missing)}")
    fixed = {"num_key_value_heads": 1, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus"}
    wrong = [f"{k} {d[k]!r} (expected {v!r})" for k, v in fixed.items() if k in d and d[k] != v]
    wrong += [f"{k} {d[k]!r} (expected none: V4 routes without expert groups)" for k in ("n_group", "topk_group")
              if d.get(k) not in (None, 1)]
    if wrong:
        raise ValueError(f"config: this model builds {', '.join(wrong)}")
    ratios = tuple(d.get("compress_ratios", ()))
    total = fields["layers"]
    if len(ratios) < total:
        raise ValueError(f"config: compress_ratios has {len(ratios)} entries for {total} layers")
    n = total if layers is None else layers
    if not 1 <= n <= total:
        raise ValueError(f"layers: expected 1..{total}, got {n}")
    mtp_ratios = ()
    if mtp:
        count = d.get("num_nextn_predict_layers", d.get("n_mtp_layers", 0))
        if not count:
            raise ValueError("config: no multi-token-prediction layer (num_nextn_predict_layers is 0 or missing)")
        if len(ratios) < total + count:
            raise ValueError(f"config: compress_ratios has {len(ratios)} entries for {total} layers and {count} "
                             f"multi-token-prediction layer(s)")
        mtp_ratios = ratios[total:total + count]
    fields.update(layers=n, compress_ratios=ratios[:n], hash_layers=min(fields["hash_layers"], n),
                  eps=d.get("rms_norm_eps", 1e-6), qat_sim=True, mtp_ratios=mtp_ratios, **_yarn(d))
    return replace(ModelConfig(**fields), **overrides)
