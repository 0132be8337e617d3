"""fp4kit.runtime.workspace on the GPU: a buffer zeroed outside capture stays zero when the current
stream's pool has just freed a block that kernels still queued on that stream will write."""

import numpy as np
import pytest

from fp4kit.runtime import workspace

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

SLOW_WRITE = r"""
extern "C" __global__ void slow_write(unsigned* p, unsigned n, long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = 0xDEADBEEFu;
}
"""


def test_zeros_outside_capture_survives_queued_writes():
    n = 1 << 16
    slow_write = cp.RawKernel(SLOW_WRITE, "slow_write")
    for _ in range(3):
        tmp = cp.empty(n, cp.uint32)
        slow_write((4,), (256,), (tmp, np.uint32(n), np.int64(20_000_000)))  # ~10 ms of spinning, then writes
        del tmp  # back to the pool while the kernel is still queued on the current stream
        buf = workspace.zeros_outside_capture(n, cp.uint32)
        cp.cuda.get_current_stream().synchronize()
        assert int(cp.count_nonzero(buf)) == 0


def test_capturable_buffer_grows_in_powers_of_two_and_keeps_what_it_outgrew():
    """A captured graph keeps the pointer it was captured with: a capturable buffer that grows must
    leave the smaller one allocated (device_buffer frees it)."""
    small = workspace.capturable_buffer("test.grow", 1000)
    assert small.size == 1024 and workspace.capturable_buffer("test.grow", 1024) is small
    big = workspace.capturable_buffer("test.grow", 1025)
    assert big.size == 2048 and big.data.ptr != small.data.ptr
    assert any(b is small for b in workspace._retired)
    retired = len(workspace._retired)
    assert workspace.device_buffer("test.grow.dev", 100).size == 100
    assert workspace.device_buffer("test.grow.dev", 300).size == 300 and len(workspace._retired) == retired


def test_buffer_cache_keeps_a_large_buffer_made_during_a_capture(monkeypatch, capture_stream):
    """Above `KEEP_MAX_BYTES` a buffer made outside a capture is not kept (each call makes its own),
    but one made while a graph is captured is: the graph writes it at every replay."""
    from fp4kit.runtime import workspace

    monkeypatch.setattr(workspace, "KEEP_MAX_BYTES", 0)
    cache = workspace.BufferCache()
    cache.get("eager", lambda: cp.empty(16, cp.float32))
    assert cache.peek("eager") is None
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        try:
            made = cache.get("captured", lambda: cp.empty(16, cp.float32))
            made.fill(1.0)
        finally:
            graph = stream.end_capture()
    assert cache.peek("captured") is made
    graph.launch(stream)
    stream.synchronize()
    assert (made == 1.0).all()
