"""Overlap for `fp4kit convert` within one job: a bounded read-ahead of a shard's tensors and a
write-behind of finished shards, each on one thread. numpy's large operations and file reads and
writes release the GIL, so reading, converting and writing proceed at once.

Memory stays bounded: the read-ahead holds at most ``depth`` items beyond the one in use, and the
write-behind holds one shard while the next is built (`WriteBehind.submit` waits for the write
before it)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator


class ReadAhead:
    """``(item, read(item))`` for each of ``items`` in order, read up to ``depth`` items ahead on a
    thread; an error of ``read`` is raised where its item would have been returned. Use it as a
    context manager: leaving early stops the thread."""

    _END = object()

    def __init__(self, items: Iterable, read: Callable, depth: int = 4):
        self._items, self._read = list(items), read
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fp4kit-read-ahead", daemon=True)

    def __enter__(self) -> ReadAhead:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock a put on a full queue
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()

    def _put(self, entry) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        for item in self._items:
            try:
                entry = (item, self._read(item), None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                self._put((item, None, e))
                return
            if not self._put(entry):
                return
        self._put(self._END)

    def __iter__(self) -> Iterator:
        while True:
            entry = self._queue.get()
            if entry is self._END:
                return
            item, value, error = entry
            if error is not None:
                raise error
            yield item, value


class WriteBehind:
    """Runs one job at a time on a background thread. `submit` first waits for the job before it
    (so at most one waits in memory beside the one being built) and raises that job's error;
    `wait` waits for the last one."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - raised by the next submit or wait
            self._error = e

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job,), name="fp4kit-write-behind", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
