"""Layers composed from ops, owning their device buffers."""
