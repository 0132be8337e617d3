"""Checks of scale values read from or written to a checkpoint (the header-level checks of names,
dtypes and shapes live with the reader, `CheckpointFiles`)."""

from __future__ import annotations

import numpy as np

from .. import formats


def check_positive_finite(value: np.ndarray, where: str, what: str) -> None:
    """Raise ValueError unless the fp32 scalar ``value`` is finite and > 0."""
    v = np.asarray(value, np.float32).reshape(())
    if not (np.isfinite(v) and v > 0):
        raise ValueError(f"{where}: expected a positive finite {what}, got {float(v)!r}")


def check_block_scale_bytes(scales: np.ndarray, where: str) -> None:
    """Raise ValueError if any E4M3 block-scale byte is NaN (0x7F / 0xFF) or negative (sign bit set).

    The message gives the count of bad bytes and the index and value of the first one.
    """
    flat = np.asarray(scales).reshape(-1)
    bad = (flat >= 0x80) | (flat == 0x7F)
    count = int(np.count_nonzero(bad))
    if not count:
        return
    first = int(np.argmax(bad))
    nan = int(np.count_nonzero(np.isin(flat, formats.E4M3_NAN_BYTES)))
    index = [int(i) for i in np.unravel_index(first, np.shape(scales))]
    raise ValueError(
        f"{where}: {count} invalid E4M3 block-scale byte(s) ({nan} NaN 0x7F/0xFF, {count - nan} negative "
        f"with the sign bit set), first at index {index} = 0x{int(flat[first]):02X}; block scales must be "
        "finite and non-negative"
    )
