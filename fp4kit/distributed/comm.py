"""Communicators: the collectives the sharded layers need, over three backends.

Every communicator has ``rank``, ``world_size`` and the same four collectives, so a layer is
written once:

* ``all_reduce(x, op)``: in place, ``op`` in ``"sum" | "max" | "min"``;
* ``all_gather(x, out)``: ``out[r] = x`` of rank ``r`` (``out`` is ``[world, *x.shape]``; ``x``
  may be ``out[rank]`` itself, which saves a copy);
* ``all_to_all(sends, recvs)``: for every pair of arrays, ``recv[r] = send[rank]`` of rank ``r``
  (axis 0 of both is the world); several pairs travel in one group;
* ``barrier()``.

Backends:

* `LocalCommunicator`: world size 1, no NCCL; numpy or CuPy arrays;
* `SimulatedGroup`: ``N`` ranks in one process over numpy arrays (CPU tests): each rank runs in
  its own thread (`SimulatedGroup.run`) and a collective is a rendezvous of all ranks' arrays;
  sums add the ranks' arrays in rank order. It also moves CuPy arrays of one GPU (every rank on
  CuPy's legacy default stream, so the copies are ordered; not capturable): the multi-rank device
  code paths can be tested on one GPU;
* `NcclCommunicator`: one process per GPU, NCCL through ``cupy.cuda.nccl``, every collective
  enqueued on CuPy's current stream (so it can be captured in a CUDA graph; nothing syncs the host).

Every rank must call the same collectives in the same order with the same shapes (as with NCCL);
the simulated group checks that and raises instead of hanging.
"""

from __future__ import annotations

import threading

import numpy as np

from ..runtime import arrays

REDUCE_OPS = ("sum", "max", "min")


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op: expected one of {REDUCE_OPS}, got {op!r}")


def _as_list(a) -> list:
    return list(a) if isinstance(a, (list, tuple)) else [a]


class Communicator:
    """The interface (see the module docstring)."""

    rank: int = 0
    world_size: int = 1

    def all_reduce(self, x, op: str = "sum"):
        raise NotImplementedError

    def all_gather(self, x, out):
        raise NotImplementedError

    def all_to_all(self, sends, recvs) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release the communicator's resources (nothing to release here)."""

    # shared validation, before anything is enqueued
    def _check_gather(self, x, out) -> None:
        if tuple(out.shape) != (self.world_size, *x.shape) or out.dtype != x.dtype:
            raise ValueError(f"out: expected shape {(self.world_size, *x.shape)} and dtype {x.dtype}, "
                             f"got {arrays.describe(out)}")
        arrays.check_contiguous("out", out)
        arrays.check_contiguous("x", x)

    def _check_all_to_all(self, sends: list, recvs: list) -> None:
        if len(sends) != len(recvs):
            raise ValueError(f"recvs: expected {len(sends)} arrays (one per send), got {len(recvs)}")
        for i, (s, r) in enumerate(zip(sends, recvs)):
            if s.ndim == 0 or s.shape[0] != self.world_size:
                raise ValueError(f"sends[{i}]: expected axis 0 of length world_size={self.world_size}, "
                                 f"got {arrays.describe(s)}")
            if tuple(r.shape) != tuple(s.shape) or r.dtype != s.dtype:
                raise ValueError(f"recvs[{i}]: expected shape {tuple(s.shape)} and dtype {s.dtype} like sends[{i}], "
                                 f"got {arrays.describe(r)}")
            arrays.check_contiguous(f"sends[{i}]", s)
            arrays.check_contiguous(f"recvs[{i}]", r)


def copy_bits(dst, src) -> None:
    """``dst[...] = src`` moving the bits as unsigned integers of the same width: no dtype-specific
    kernel is needed (CuPy's elementwise support of bfloat16 is not relied on)."""
    if src.dtype != dst.dtype:
        raise ValueError(f"dst: expected dtype {src.dtype} like the source, got {dst.dtype}")
    as_uint = np.dtype(f"u{src.dtype.itemsize}") if src.dtype.itemsize in (1, 2, 4, 8) else None
    if as_uint is None:
        dst[...] = src
    else:
        dst.view(as_uint)[...] = src.view(as_uint)


def _same_memory(a, b) -> bool:
    if arrays.is_device_array(a) and arrays.is_device_array(b):
        return a.data.ptr == b.data.ptr and a.nbytes == b.nbytes
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes
    return False


class LocalCommunicator(Communicator):
    """World size 1: every collective is the identity (a copy where source and destination
    differ). Works on numpy and device arrays; needs no NCCL."""

    rank, world_size = 0, 1

    def all_reduce(self, x, op: str = "sum"):
        _check_op(op)
        return x

    def all_gather(self, x, out):
        self._check_gather(x, out)
        if not _same_memory(x, out[0]):
            copy_bits(out[0], x)
        return out

    def all_to_all(self, sends, recvs) -> None:
        sends, recvs = _as_list(sends), _as_list(recvs)
        self._check_all_to_all(sends, recvs)
        for s, r in zip(sends, recvs):
            if not _same_memory(s, r):
                copy_bits(r, s)

    def barrier(self) -> None:
        pass

    def __repr__(self) -> str:
        return "LocalCommunicator(rank=0, world_size=1)"


class SimulatedGroup:
    """``world_size`` simulated ranks in one process, for tests on numpy arrays.

    >>> group = SimulatedGroup(4)
    >>> outputs = group.run(lambda comm: layer_for(comm)(x_for(comm.rank)))

    `run` calls ``fn(comm)`` once per rank, each in its own thread, and returns the results in
    rank order. A collective waits for every rank (a barrier with ``timeout`` seconds); an
    exception on one rank breaks the barrier for the others and is re-raised by `run`.
    """

    def __init__(self, world_size: int, *, timeout: float = 120.0):
        if not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
        self.world_size = int(world_size)
        self._barrier = threading.Barrier(self.world_size, timeout=timeout)
        self._slots: list = [None] * self.world_size
        self.comms = [SimulatedCommunicator(self, r) for r in range(self.world_size)]

    def exchange(self, rank: int, payload):
        """Every rank's ``payload`` (a list in rank order), once all ranks have posted theirs."""
        self._slots[rank] = payload
        self._barrier.wait()
        everything = list(self._slots)
        self._barrier.wait()  # nobody posts the next payload before all have read this one
        return everything

    def run(self, fn) -> list:
        self._barrier.reset()  # a previous failure may have broken it
        results: list = [None] * self.world_size
        errors: list = [None] * self.world_size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.comms[rank])
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                errors[rank] = e
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if real:
            raise real[0]
        if any(e is not None for e in errors):
            raise errors[next(i for i, e in enumerate(errors) if e is not None)]
        return results


class SimulatedCommunicator(Communicator):
    """One rank of a `SimulatedGroup` (numpy arrays, or CuPy arrays of one GPU)."""

    def __init__(self, group: SimulatedGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def _exchange(self, what: str, signature, payload):
        posted = self.group.exchange(self.rank, (what, signature, payload))
        for r, (w, sig, _) in enumerate(posted):
            if (w, sig) != (what, signature):
                raise RuntimeError(f"collective mismatch: rank {self.rank} called {what}{signature}, "
                                   f"rank {r} called {w}{sig} (every rank must make the same calls)")
        return [p for _, _, p in posted]

    @staticmethod
    def _host(name: str, x):
        if not (isinstance(x, np.ndarray) or arrays.is_device_array(x)):
            raise TypeError(f"{name}: the simulated communicator takes numpy (or CuPy) arrays, got {type(x).__name__}")
        return x

    def all_reduce(self, x, op: str = "sum"):
        _check_op(op)
        self._host("x", x)
        parts = self._exchange("all_reduce", (op, tuple(x.shape), str(x.dtype)), x.copy())
        result = parts[0].copy()
        for p in parts[1:]:  # rank order, in x's dtype (as NCCL reduces)
            xp = arrays.array_module(x)
            if op == "sum":
                result = (result + p).astype(x.dtype)
            elif op == "max":
                result = xp.maximum(result, p)
            else:
                result = xp.minimum(result, p)
        x[...] = result
        return x

    def all_gather(self, x, out):
        self._host("x", x)
        self._host("out", out)
        self._check_gather(x, out)
        parts = self._exchange("all_gather", (tuple(x.shape), str(x.dtype)), x.copy())
        for r, p in enumerate(parts):
            copy_bits(out[r], p)
        return out

    def all_to_all(self, sends, recvs) -> None:
        sends, recvs = _as_list(sends), _as_list(recvs)
        for i, (s, r) in enumerate(zip(sends, recvs)):
            self._host(f"sends[{i}]", s)
            self._host(f"recvs[{i}]", r)
        self._check_all_to_all(sends, recvs)
        signature = tuple((tuple(s.shape), str(s.dtype)) for s in sends)
        parts = self._exchange("all_to_all", signature, [s.copy() for s in sends])
        for i, r in enumerate(recvs):
            for src in range(self.world_size):
                copy_bits(r[src], parts[src][i][self.rank])

    def barrier(self) -> None:
        self._exchange("barrier", (), None)

    def __repr__(self) -> str:
        return f"SimulatedCommunicator(rank={self.rank}, world_size={self.world_size})"


class NcclCommunicator(Communicator):
    """One rank of an NCCL communicator (one process per GPU); collectives run on CuPy's current
    stream and are capturable in a CUDA graph (run each once eagerly first: NCCL connects peers
    lazily). Build it with `fp4kit.distributed.init` or from a unique id shared by all ranks."""

    def __init__(self, rank: int, world_size: int, unique_id):
        from . import nccl_lib

        self._nccl = nccl_lib.load()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
        self.rank, self.world_size = int(rank), int(world_size)
        # CuPy takes the id as the 128 bytes of ncclUniqueId (the rendezvous file holds them as ints)
        self._comm = self._nccl.NcclCommunicator(self.world_size, bytes(int(v) & 0xFF for v in unique_id), self.rank)
        self._ops = {"sum": self._nccl.NCCL_SUM, "max": self._nccl.NCCL_MAX, "min": self._nccl.NCCL_MIN}

    def _dtype(self, name: str, x) -> int:
        table = {np.dtype(np.float32): "NCCL_FLOAT32", np.dtype(np.float64): "NCCL_FLOAT64",
                 np.dtype(np.float16): "NCCL_FLOAT16", arrays.BF16: "NCCL_BFLOAT16",
                 np.dtype(np.int32): "NCCL_INT32", np.dtype(np.uint32): "NCCL_UINT32",
                 np.dtype(np.int64): "NCCL_INT64", np.dtype(np.uint64): "NCCL_UINT64",
                 np.dtype(np.uint8): "NCCL_UINT8", np.dtype(np.int8): "NCCL_INT8"}
        if x.dtype not in table:
            raise TypeError(f"{name}: NCCL cannot reduce dtype {x.dtype}; expected one of {sorted(map(str, table))}")
        return getattr(self._nccl, table[x.dtype])

    @staticmethod
    def _device(name: str, x):
        if not arrays.is_device_array(x):
            raise TypeError(f"{name}: the NCCL communicator takes CuPy arrays, got {type(x).__name__}")
        arrays.check_contiguous(name, x)
        return x

    @staticmethod
    def _stream() -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr

    def all_reduce(self, x, op: str = "sum"):
        _check_op(op)
        self._device("x", x)
        self._comm.allReduce(x.data.ptr, x.data.ptr, x.size, self._dtype("x", x), self._ops[op], self._stream())
        return x

    def all_gather(self, x, out):
        self._device("x", x)
        self._device("out", out)
        self._check_gather(x, out)
        # bytes: any dtype travels; x may be out[rank] (NCCL's in-place all-gather)
        self._comm.allGather(x.data.ptr, out.data.ptr, x.nbytes, self._nccl.NCCL_UINT8, self._stream())
        return out

    def all_to_all(self, sends, recvs) -> None:
        sends, recvs = _as_list(sends), _as_list(recvs)
        for i, (s, r) in enumerate(zip(sends, recvs)):
            self._device(f"sends[{i}]", s)
            self._device(f"recvs[{i}]", r)
        self._check_all_to_all(sends, recvs)
        stream, u8 = self._stream(), self._nccl.NCCL_UINT8
        self._nccl.groupStart()
        try:
            for s, r in zip(sends, recvs):
                chunk = s.nbytes // self.world_size
                for peer in range(self.world_size):
                    self._comm.send(s.data.ptr + peer * chunk, chunk, u8, peer, stream)
                    self._comm.recv(r.data.ptr + peer * chunk, chunk, u8, peer, stream)
        finally:
            self._nccl.groupEnd()

    def barrier(self) -> None:
        import cupy

        token = cupy.zeros(1, np.float32)
        self.all_reduce(token)
        cupy.cuda.get_current_stream().synchronize()

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None

    def __repr__(self) -> str:
        return f"NcclCommunicator(rank={self.rank}, world_size={self.world_size})"
