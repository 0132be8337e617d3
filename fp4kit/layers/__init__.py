"""Layers composed from ops, owning their device buffers."""

from .attention import SparseAttention
from .indexer import Indexer
from .kv_cache import KVCache
from .linear import Linear
from .moe import ExpertStack, MoE, RoutingConfig
from .sampler import Generator, Sampler
from .shared_expert import SharedExpert, fuse_gate_up, interleave_rows

__all__ = [
    "ExpertStack",
    "Generator",
    "Indexer",
    "KVCache",
    "Linear",
    "MoE",
    "RoutingConfig",
    "Sampler",
    "SharedExpert",
    "SparseAttention",
    "fuse_gate_up",
    "interleave_rows",
]
