"""The one meaning of ``device=`` and the one CUDA probe (`fp4kit.runtime.device`), on the CPU.

A machine without a usable GPU is simulated by replacing the probe's answer, so these tests say
the same on a GPU machine."""

import numpy as np
import pytest

import fp4kit
from fp4kit.runtime import device as runtime_device

NO_GPU = (0, "CuPy finds no usable CUDA driver (CUDARuntimeError: cudaErrorInsufficientDriver)")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(runtime_device, "_probe", lambda: NO_GPU)


@pytest.mark.parametrize("host", [None, False, np.False_, "cpu"])
def test_host_choices(host):
    assert runtime_device.resolve(host) is None


@pytest.mark.parametrize("cuda", [True, "cuda", "cuda:0", 0, np.int64(1)])
def test_cuda_choices_without_gpu_raise_one_clear_error(no_gpu, cuda):
    with pytest.raises(RuntimeError, match=r"device=.* asks for a CUDA device, but none is usable: CuPy finds no "
                                           r"usable CUDA driver .*Pass device=False \(or 'cpu'\) to run on the numpy"):
        runtime_device.resolve(cuda)


def test_ordinals_with_gpus(monkeypatch):
    monkeypatch.setattr(runtime_device, "_probe", lambda: (2, None))
    assert runtime_device.resolve("cuda:1") == 1 and runtime_device.resolve(np.int32(0)) == 0
    with pytest.raises(ValueError, match=r"device: CUDA device 2 does not exist \(2 visible: 0..1\)"):
        runtime_device.resolve(2)


@pytest.mark.parametrize("bad, exc, message", [
    ("gpu", ValueError, "got 'gpu'"), ("cuda:", ValueError, "got 'cuda:'"), ("cuda:-1", ValueError, "got 'cuda:-1'"),
    (-1, ValueError, "non-negative CUDA device ordinal, got -1"), (1.5, TypeError, "got float"),
    ([0], TypeError, "got list"),
])
def test_bad_values_name_the_argument(bad, exc, message):
    with pytest.raises(exc, match=f"where: .*{message}"):
        runtime_device.resolve(bad, "where")


def test_probe_never_raises():
    count, reason = runtime_device._probe()
    assert (count > 0) == (reason is None) == runtime_device.cuda_available()
    assert runtime_device.device_count() == count and runtime_device.unavailable_reason() == reason


def test_layers_and_loader_without_gpu(no_gpu, tmp_path):
    # the defaults ask for the GPU: one clear error that says what to pass ...
    for make in (lambda: fp4kit.KVCache(2, head_dim=16, rope_dim=0), lambda: fp4kit.Generator(7),
                 lambda: fp4kit.load_nvfp4(tmp_path, device="cuda")):
        with pytest.raises(RuntimeError, match=r"Pass device=False \(or 'cpu'\)"):
            make()
    # ... and device=False is the numpy backend
    cache = fp4kit.KVCache(2, head_dim=16, rope_dim=0, device=False)
    assert cache.xp is np and isinstance(cache.swa, np.ndarray)
    gen = fp4kit.Generator(7, device="cpu")
    assert not gen.device and gen.get_state() == (7, 0)
    sampler = fp4kit.Sampler(gen)
    assert isinstance(sampler.buffers(3, device="cpu"), np.ndarray)
    with pytest.raises(RuntimeError, match=r"Pass device=False"):
        sampler.buffers(3)
    q = fp4kit.quantize(np.ones((2, 16), np.float32))
    fp4kit.save_nvfp4(tmp_path, {"p": q})
    assert isinstance(fp4kit.load_nvfp4(tmp_path, device=False).weights["p"].packed, np.ndarray)
