"""What ``import fp4kit`` presents: every public name reachable from the package, the heavy parts
imported only when first used."""

import subprocess
import sys

import pytest

import fp4kit


def test_every_public_name_resolves():
    for name in fp4kit.__all__:
        assert getattr(fp4kit, name) is not None, name
    assert sorted(fp4kit.__all__) == fp4kit.__all__ and len(set(fp4kit.__all__)) == len(fp4kit.__all__)
    assert set(fp4kit.__all__) <= set(dir(fp4kit))


def test_layers_checkpoint_distributed_reachable():
    from fp4kit import checkpoint, distributed, layers

    assert fp4kit.layers is layers and fp4kit.checkpoint is checkpoint and fp4kit.distributed is distributed
    for name in ("Linear", "SharedExpert", "MoE", "RoutingConfig", "KVCache", "Indexer", "SparseAttention",
                 "Sampler", "Generator"):
        assert getattr(fp4kit, name) is getattr(layers, name), name
        assert getattr(fp4kit.layers, name).__name__ == name
    assert fp4kit.load_nvfp4 is checkpoint.load_nvfp4 and fp4kit.save_nvfp4 is checkpoint.save_nvfp4
    assert fp4kit.distributed.ExpertParallelMoE.__name__ == "ExpertParallelMoE"


def test_unknown_attribute_names_it():
    with pytest.raises(AttributeError, match="has no attribute 'Linaer'"):
        fp4kit.Linaer  # noqa: B018


def test_import_is_lazy():
    # a fresh interpreter: importing the package loads neither the layers, the checkpoint code,
    # the distributed layers nor CuPy; touching a name loads what it needs
    code = (
        "import sys, fp4kit\n"
        "heavy = ('fp4kit.layers', 'fp4kit.checkpoint', 'fp4kit.distributed', 'cupy')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "fp4kit.KVCache\n"
        "print('fp4kit.layers' in sys.modules, 'fp4kit.checkpoint' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "True False"]


def test_checkpoint_package_exports():
    from fp4kit import checkpoint

    for name in checkpoint.__all__:
        assert getattr(checkpoint, name) is not None, name
    # one module per concern
    for module in ("safetensors_io", "modelopt", "compressed_tensors", "reader", "validation", "fusion"):
        assert hasattr(checkpoint, module), module


def test_buffer_cache_makes_each_buffer_once():
    import numpy as np

    from fp4kit.runtime.workspace import BufferCache

    cache, made = BufferCache(), []

    def make():
        made.append(1)
        return np.empty(3)

    a = cache.get(("out", None, 3), make)
    assert cache.get(("out", None, 3), make) is a and len(made) == 1
    assert cache.get(("out", None, 4), make) is not a and len(made) == 2 and len(cache) == 2
    assert cache.peek(("out", None, 3)) is a and cache.peek(("out", None, 5)) is None and len(made) == 2


def test_buffer_cache_keeps_no_buffer_above_the_limit(monkeypatch):
    """A buffer larger than `KEEP_MAX_BYTES` (a batched prefill's) is made for each call and not
    kept, so the layers share that memory through the pool instead of each holding its own."""
    import numpy as np

    from fp4kit.runtime import workspace

    monkeypatch.setattr(workspace, "KEEP_MAX_BYTES", 64)
    cache = workspace.BufferCache()
    small, large = cache.get("small", lambda: np.empty(8)), cache.get("large", lambda: np.empty(9))
    assert cache.get("small", lambda: np.empty(8)) is small and cache.peek("small") is small
    assert cache.get("large", lambda: np.empty(9)) is not large and cache.peek("large") is None and len(cache) == 1


def test_host_result_writes_into_out():
    import numpy as np

    from fp4kit.runtime.arrays import host_result

    r = np.arange(3.0)
    assert host_result(r) is r
    out = np.zeros(3)
    assert host_result(r, out) is out and np.array_equal(out, r)
