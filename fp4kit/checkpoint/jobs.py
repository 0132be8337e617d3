"""The jobs of `fp4kit convert`: each takes shards from a shared queue (so a slow shard does not hold
up the others), converts one while the previous one is written (`overlap.WriteBehind`), and reports
a shard only once its write has returned, i.e. once its file is complete and in place. One job runs
on a thread; several run in spawned processes (a fork of a process that has touched CUDA cannot use
it).

The caller records each reported shard as it arrives. On an error the jobs stop taking shards, the
shards in hand are finished and reported, and the first error is raised."""

from __future__ import annotations

import functools
import multiprocessing
import pickle
import queue
import threading
import traceback
from collections.abc import Callable, Sequence

from .overlap import WriteBehind


class RemoteTraceback(Exception):
    """The traceback of an error raised in a worker process (the ``__cause__`` of the error)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


def _report(results, task, write: Callable[[], object]) -> None:
    results.put(("done", task, write()))


def _sendable(error: BaseException) -> BaseException:
    """``error`` as it can cross to the parent process: with its traceback attached, or, if it does
    not pickle, a RuntimeError with its text."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001
        error = RuntimeError(f"{type(error).__name__}: {error}")
    error.__cause__ = RemoteTraceback(text)
    return error


def job_loop(tasks, results, stop, make_job: Callable, in_process: bool = False) -> None:
    """One job: ``convert = make_job()`` once, then for each task from ``tasks`` (until ``None`` or
    ``stop``) ``write = convert(task)`` here and ``write()`` on the write-behind thread; puts
    ``("done", task, write())`` on ``results`` after each write, or ``("error", None, error)``."""
    writer = WriteBehind()
    try:
        convert = make_job()
        for task in iter(tasks.get, None):
            if stop.is_set():
                break
            write = convert(task)
            writer.submit(functools.partial(_report, results, task, write))
            del write  # the write-behind holds the shard; nothing else here should
        writer.wait()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        try:
            writer.wait()  # the shard being written is still reported
        except BaseException:  # noqa: BLE001 - the first error is the one reported
            pass
        results.put(("error", None, e if in_process else _sendable(e)))


def run_jobs(todo: Sequence, jobs: int, make_job: Callable, on_done: Callable) -> None:
    """Runs every task of ``todo`` in ``min(jobs, len(todo))`` jobs (see `job_loop`; ``make_job``
    must pickle for several), calling ``on_done(task, result)`` here as each arrives; raises the
    first error once the jobs have stopped, or RuntimeError if a worker process died."""
    if not todo:
        return
    count = min(jobs, len(todo))
    if count == 1:
        tasks, results, stop = queue.Queue(), queue.Queue(), threading.Event()
        workers = [threading.Thread(target=job_loop, args=(tasks, results, stop, make_job, True),
                                    name="fp4kit-convert-job", daemon=True)]
    else:
        ctx = multiprocessing.get_context("spawn")
        tasks, results, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        tasks.cancel_join_thread()  # tasks left after an error must not hold up this process's exit
        workers = [ctx.Process(target=job_loop, args=(tasks, results, stop, make_job), daemon=True)
                   for _ in range(count)]
    for task in todo:
        tasks.put(task)
    for _ in workers:
        tasks.put(None)
    pending, error = len(todo), None
    try:
        for w in workers:
            w.start()
        while pending:
            try:
                kind, task, payload = results.get(timeout=0.2)
            except queue.Empty:
                if any(w.is_alive() for w in workers):
                    continue
                try:  # a last report may still be on its way from a job that has ended
                    kind, task, payload = results.get(timeout=1.0)
                except queue.Empty:
                    break
            if kind == "done":
                pending -= 1
                on_done(task, payload)
            elif error is None:
                error = payload
                stop.set()
    finally:
        stop.set()
        for w in workers:
            if isinstance(w, threading.Thread):
                continue  # a daemon thread: it ends with its shard, or with the interpreter
            w.join(timeout=5 if error is not None or not pending else 0)  # ended or ending, unless interrupted
            if w.is_alive():
                w.terminate()
                w.join()
    if error is not None:
        raise error
    if pending:
        codes = [getattr(w, "exitcode", None) for w in workers]
        raise RuntimeError(f"{pending} shard(s) not converted: a convert worker stopped without a report "
                           f"(exit codes {codes})")
