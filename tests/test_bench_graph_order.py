"""benchmarks/common.py graph_us on a model of CUDA stream ordering (no GPU): the graph it times must
not start while its eager first call may still run.

The eager call goes to the current stream (the legacy default stream in the benchmark scripts), the
graph to a non-blocking stream, which by definition does not wait for the default stream. Without a
synchronisation in between, the graph's first calls ran alongside the eager call over the same layer
state: for the MoE layer with the dispatch in the router's last block, one call's router arrivals
erased by the other's reset and dispatch counts left for the next call, whose sorted rows then run
past the plan's buffers (bench_moe's "sorted, every fusion" row at V3 T = 4096).
"""

import itertools

import pytest

common = pytest.importorskip("benchmarks.common")


class _Device:
    """Legacy-stream semantics: work on a blocking stream waits for the default stream's earlier
    work; a non-blocking stream waits only for what it was ordered after (a synchronisation or an
    event it waits on)."""

    def __init__(self):
        self.seq = itertools.count(1)
        self.done_upto = 0  # every item up to this sequence number is known finished
        self.pending = {}  # stream id -> sequence numbers of its unfinished items
        self.races = []
        self.current = None

    def enqueue(self, stream, what):
        if stream.capturing:
            stream.captured.append(what)
            return
        n = next(self.seq)
        if stream.non_blocking:
            legacy = [s for s in self.pending.get(0, []) if s > max(self.done_upto, stream.ordered_after)]
            if legacy:
                self.races.append((what, legacy))
        self.pending.setdefault(stream.id, []).append(n)

    def synchronize(self):
        self.done_upto = next(self.seq)
        self.pending.clear()


def _fake_cupy(device):
    ids = itertools.count(1)

    class Stream:
        def __init__(self, non_blocking=False, _id=None):
            self.id = next(ids) if _id is None else _id
            self.non_blocking, self.capturing, self.captured, self.ordered_after = non_blocking, False, [], 0
            self.ptr = self.id
            self._saved = []

        def __enter__(self):
            self._saved.append(device.current)
            device.current = self
            return self

        def __exit__(self, *exc):
            device.current = self._saved.pop()

        def begin_capture(self):
            self.capturing, self.captured = True, []

        def end_capture(self):
            self.capturing = False
            return Graph(list(self.captured))

        def is_capturing(self):
            return self.capturing

        def synchronize(self):
            device.pending.pop(self.id, None)

        def wait_event(self, event):
            self.ordered_after = max(self.ordered_after, event.upto)

    class Graph:
        def __init__(self, nodes):
            self.nodes = nodes

        def launch(self, stream=None):
            for what in self.nodes:
                device.enqueue(stream or device.current, "graph " + what)

    class Event:
        def __init__(self, *args, **kwargs):
            self.upto = 0

        def record(self, stream=None):
            self.upto = next(device.seq)
            return self

        def synchronize(self):
            pass

    class _Device:
        def __init__(self, *args):
            pass

        def synchronize(self):
            device.synchronize()

    null = Stream(_id=0)
    device.current = null

    class cuda:  # noqa: N801 - the attribute path cupy.cuda.*
        pass

    cuda.Stream, cuda.Event, cuda.Device = Stream, Event, _Device
    cuda.Stream.null = null
    cuda.get_current_stream = staticmethod(lambda: device.current)
    cuda.get_elapsed_time = staticmethod(lambda a, b: 1.0)

    class cp:
        pass

    cp.cuda = cuda
    return cp


def test_graph_us_starts_the_graph_after_the_eager_first_call(monkeypatch):
    device = _Device()
    monkeypatch.setattr(common, "cp", _fake_cupy(device))

    def fn(i):  # one layer call: its launches go to the current stream (recorded while capturing)
        stream = common.cp.cuda.get_current_stream()
        for kernel in ("router", "gemm"):
            device.enqueue(stream, f"call {i} {kernel}")

    common.graph_us(fn, calls=4, replays=2)
    assert not device.races, f"graph work launched while the eager call may still run: {device.races[0]}"


def test_the_stream_model_flags_an_unordered_graph():
    """The model itself: work on a non-blocking stream after unsynchronised default-stream work is
    a race; after a device synchronisation, or on a blocking stream, it is not."""
    device = _Device()
    cp = _fake_cupy(device)
    device.enqueue(cp.cuda.Stream.null, "eager")
    device.enqueue(cp.cuda.Stream(), "blocking stream")  # waits for the default stream
    assert not device.races
    device.enqueue(cp.cuda.Stream(non_blocking=True), "non-blocking")
    assert len(device.races) == 1
    cp.cuda.Device().synchronize()
    device.enqueue(cp.cuda.Stream(non_blocking=True), "after sync")
    assert len(device.races) == 1
