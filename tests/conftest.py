import os

import numpy as np
import pytest


from fp4kit.runtime.device import cuda_available

HAVE_GPU = cuda_available()

if HAVE_GPU and os.environ.get("FP4KIT_NO_POOL") == "1":
    # compute-sanitizer cannot see an out-of-bounds write that lands inside CuPy's pool:
    # give every array its own cudaMalloc so memcheck reports it
    import cupy

    cupy.cuda.set_allocator(None)


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id and a run-dependent entropy, so
    every run draws new data; the seed is printed on failure."""
    seed = np.random.SeedSequence().entropy % (2**32)
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _clean_status():
    from fp4kit.runtime import status

    status.clear(device=-1)  # host word only; device words are cleared by the tests that read them
    yield
