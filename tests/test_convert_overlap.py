"""The overlap behind `fp4kit convert`: the read-ahead keeps order and raises a read's error where
its item would come, stops when left early; the write-behind runs one job at a time and raises a
job's error at the next submit or wait; the jobs report every finished task even when another
fails, then raise that error."""

import threading
import time

import pytest

from fp4kit.checkpoint.jobs import run_jobs
from fp4kit.checkpoint.overlap import ReadAhead, WriteBehind


def test_read_ahead_keeps_order_and_bounds_how_far_it_reads():
    read, reading = [], threading.Event()

    def slow(i):
        read.append(i)
        reading.set()
        return i * i

    with ReadAhead(range(20), slow, depth=3) as r:
        it = iter(r)
        assert next(it) == (0, 0)
        time.sleep(0.1)
        assert len(read) <= 1 + 3 + 1  # the one returned, the queue, the one waiting to be put
        assert list(it) == [(i, i * i) for i in range(1, 20)]


def test_read_ahead_raises_a_reads_error_in_place_and_stops_when_left():
    def read(i):
        if i == 3:
            raise ValueError("bad item 3")
        return i

    got = []
    with pytest.raises(ValueError, match="bad item 3"), ReadAhead(range(10), read, depth=2) as r:
        for item, _ in r:
            got.append(item)
    assert got == [0, 1, 2]
    with ReadAhead(range(1000), lambda i: i, depth=2) as r:  # left early: the thread ends
        next(iter(r))
    assert not r._thread.is_alive()


def test_write_behind_runs_one_at_a_time_and_raises_at_the_next_call():
    w, running, overlaps = WriteBehind(), [], []

    def job(i):
        def run():
            overlaps.append(len(running))
            running.append(i)
            time.sleep(0.01)
            running.remove(i)
            if i == 2:
                raise OSError("disk full")
        return run

    w.submit(job(0))
    w.submit(job(1))
    w.submit(job(2))
    with pytest.raises(OSError, match="disk full"):
        w.wait()
    assert overlaps == [0, 0, 0]
    w.wait()  # reported once


class _Job:
    """A picklable job: task i gives i * 10, task 3 fails (late: the task before it is taken by then)."""

    def __call__(self, task):
        if task == 3:
            time.sleep(0.3)
            raise ValueError("task 3 failed")
        return lambda: task * 10


@pytest.mark.parametrize("jobs", [1, 2])
def test_run_jobs_reports_the_finished_tasks_then_raises_the_first_error(jobs):
    done = {}
    run_jobs([0, 1, 2], jobs, _Job, lambda task, result: done.__setitem__(task, result))
    assert done == {0: 0, 1: 10, 2: 20}
    done.clear()
    with pytest.raises(ValueError, match="task 3 failed"):
        run_jobs([0, 3], jobs, _Job, lambda task, result: done.__setitem__(task, result))
    assert done == {0: 0}
