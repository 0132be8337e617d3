"""The PDL launcher's CPU side: argument packing as CuPy packs kernel arguments, and its setting
(the SASS contract of the PDL-ready kernels is in test_compile.py)."""

import ctypes
import importlib.util

import numpy as np
import pytest

from fp4kit.runtime import launch, loader

needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="packing imports CuPy")


@needs_cupy
def test_pack_encodes_each_argument_as_cupy_does():
    packed = launch.pack((np.uint32(7), np.int32(-2), np.float32(1.5), np.uint64(1 << 40), 3, 2.5, True))
    assert [bytes(p) for p in packed] == [
        np.uint32(7).tobytes(), np.int32(-2).tobytes(), np.float32(1.5).tobytes(), np.uint64(1 << 40).tobytes(),
        np.int64(3).tobytes(), np.float64(2.5).tobytes(), b"\x01"]
    assert all(ctypes.sizeof(p) == n for p, n in zip(packed, (4, 4, 4, 8, 8, 8, 1)))


@needs_cupy
def test_pack_names_an_argument_it_cannot_pass():
    with pytest.raises(TypeError, match=r"kernel argument 1: expected a cupy.ndarray, a numpy scalar, .* got str"):
        launch.pack((np.uint32(1), "x"))
    with pytest.raises(TypeError, match="kernel argument 0: .* got ndarray"):
        launch.pack((np.zeros(3),))  # a host array is not a device pointer


def test_setting_is_checked(monkeypatch):
    monkeypatch.delenv("FP4KIT_PDL", raising=False)
    assert launch.enabled()
    monkeypatch.setenv("FP4KIT_PDL", "0")
    assert not launch.enabled()
    monkeypatch.setenv("FP4KIT_PDL", "1")
    assert launch.enabled()
    monkeypatch.setenv("FP4KIT_PDL", "early")
    with pytest.raises(ValueError, match="FP4KIT_PDL: expected 0 or 1, got 'early'"):
        launch.enabled()


def test_pdl_modules_are_kernel_files():
    assert launch.PDL_MODULES <= set(loader.kernel_names())
    assert "sampling" not in launch.PDL_MODULES  # cooperative: launched by CuPy, no PDL contract
