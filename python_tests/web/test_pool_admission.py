"""When the replica pool starts waiting jobs (web/pool.Admission), against a stand-in engine that
records what each step found added: a burst of requests starts in one step (one prefill), with the
gap at 0 each starts at once, arrivals that never pause start after max_wait, a burst that fills the
free slots does not wait, and an Admission that cannot work is refused when built."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from nanochat_fast.web.pool import Admission, Job, Prepared, Replica, ReplicaPool


class Row:
    done = False


class RecordingEngine:
    """Every row ends with its first token; each step records (when, rows added since the last step)."""

    def __init__(self, slots: int):
        self.slots, self.active, self.steps = slots, [], []
        self._added = 0
        self._lock = threading.Lock()

    def add(self, request):
        row = Row()
        self.active.append(row)
        self._added += 1
        return [row]

    def cancel(self, row):
        self.active.remove(row)

    def step(self):
        with self._lock:
            self.steps.append((time.monotonic(), self._added))
        self._added = 0
        tokens = [SimpleNamespace(row=row, token=0, last=True) for row in self.active]
        self.active = []
        return tokens

    def recorded(self):
        with self._lock:
            return list(self.steps)


def make_pool(admission: Admission, slots: int = 8):
    engine = RecordingEngine(slots)
    replica = Replica(engine, lambda job: Prepared(request=job, decode=lambda token: "x"), "cpu")
    return ReplicaPool([replica], queue_limit=16, admission=admission), engine


def submit(pool, loop, n: int, every: float) -> list[float]:
    """n jobs, one every `every` seconds; for each, a time just before it was made and queued."""
    times = []
    for i in range(n):
        if i:
            time.sleep(every)
        times.append(time.monotonic())
        pool.submit(Job(messages=[], max_tokens=1, temperature=0.0, top_k=None, seed=0, loop=loop))
    return times


def steps_after(engine, count: int, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while sum(added for _, added in engine.recorded()) < count:
        assert time.monotonic() < deadline, engine.recorded()
        time.sleep(0.002)
    return engine.recorded()


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()  # the jobs' events go to it; nobody needs to read them here
    yield loop
    loop.close()


def test_a_burst_starts_in_one_step_after_the_gap(loop):
    pool, engine = make_pool(Admission(gap=0.2, max_wait=5.0))
    queued = submit(pool, loop, 4, every=0.01)
    steps = steps_after(engine, 4)
    pool.close()
    assert [added for _, added in steps] == [4]  # one prefill for all four
    assert steps[0][0] >= queued[-1] + 0.2  # once no request had arrived for the gap


def test_with_gap_zero_a_request_starts_at_the_next_step(loop):
    pool, engine = make_pool(Admission(gap=0.0, max_wait=0.0))
    submit(pool, loop, 1, every=0)
    steps_after(engine, 1)
    submit(pool, loop, 1, every=0)
    steps = steps_after(engine, 2)
    pool.close()
    assert [added for _, added in steps] == [1, 1]


def test_arrivals_that_never_pause_start_after_max_wait(loop):
    pool, engine = make_pool(Admission(gap=0.2, max_wait=0.4), slots=32)  # more than arrive
    queued = submit(pool, loop, 15, every=0.05)  # 0.7 s of arrivals, never the gap apart
    steps = steps_after(engine, 15)
    pool.close()
    first_when, first_added = steps[0]
    assert queued[0] + 0.4 <= first_when < queued[-1]  # the oldest waited max_wait, not for the end
    assert 2 <= first_added < 15


def test_a_burst_that_fills_the_free_slots_starts_at_once(loop):
    pool, engine = make_pool(Admission(gap=30.0, max_wait=30.0), slots=3)
    queued = submit(pool, loop, 3, every=0)
    steps = steps_after(engine, 3)
    pool.close()
    assert [added for _, added in steps] == [3] and steps[0][0] - queued[-1] < 5.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gap": -0.001}, "admission gap must be >= 0 seconds (and finite), got -0.001"),
        ({"max_wait": float("inf")}, "admission max_wait must be >= 0 seconds (and finite), got inf"),
        ({"gap": 0.01, "max_wait": 0.001}, "admission max_wait (0.001 s) must be at least its gap (0.01 s)"),
    ],
)
def test_an_admission_that_cannot_work_is_refused(kwargs, message):
    with pytest.raises(ValueError) as e:
        Admission(**kwargs)
    assert str(e.value) == message
