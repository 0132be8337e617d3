"""Layers composed from ops, owning their device buffers."""

from .attention import SparseAttention
from .indexer import Indexer
from .kv_cache import KVCache
from .linear import Linear
from .moe import ExpertStack, MoE, RoutingConfig
from .shared_expert import SharedExpert, fuse_gate_up, interleave_rows

__all__ = ["ExpertStack", "Indexer", "KVCache", "Linear", "SparseAttention", "MoE", "RoutingConfig", "SharedExpert", "fuse_gate_up", "interleave_rows"]
