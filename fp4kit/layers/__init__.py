"""Layers composed from ops, owning their device buffers."""

from .linear import Linear
from .shared_expert import SharedExpert, fuse_gate_up, interleave_rows

__all__ = ["Linear", "SharedExpert", "fuse_gate_up", "interleave_rows"]
