"""
A pool of model replicas serving chat requests from one bounded queue, each replica decoding many
replies at once in one continuous-batching engine.

The event loop (FastAPI) creates jobs, queues them (submit) and stops them (cancel); it never
touches an engine. Each replica has one worker thread, the only one that drives its engine: it
admits waiting jobs while the engine has free slots, runs one engine step, hands each token to its
job and ends or cancels rows before the next step. A job is one reply, one row of one engine once
admitted, through the replica's prepare(job), which chat_web provides: this package knows nothing
of models. Admission is decided when a request arrives: at most every slot busy plus `queue_limit`
waiting; a request beyond that is refused at once (HTTP 503). Requests that arrive close together
start together (Admission): one prefill for all of them. The threads, jobs and failures in full:
docs/measurements.md#chat-server.
"""

import asyncio
import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .stats import ServerStats

log = logging.getLogger("nanochat_fast.chat_web")


@dataclass
class Prepared:
    """What a replica's prepare(job) gives: the engine request for the job and its reply's text."""

    request: object  # what engine.add takes (model/batch_engine.Request)
    decode: Callable[[int], str]  # a token id -> the text it completes ("" for the end token, a partial character)
    truncated: bool = False  # the conversation was cut from its start to fit the model's context


@dataclass
class Replica:
    """One model on one device. engine: model/batch_engine.BatchEngine or a stand-in with `slots`,
    add(request) -> [row], cancel(row), step() -> tokens (.row, .token, .last), `active`.
    prepare(job) -> Prepared."""

    engine: object
    prepare: Callable
    device: str


@dataclass(frozen=True)
class Admission:
    """When waiting jobs start. A step's prefill runs every prompt admitted since the last step, and
    every row in that step waits for it: a burst of requests split over two steps makes the first
    one's second token wait for the others' prompts (on a CPU, many decode steps' worth). So a
    waiting job starts once no other request has arrived for `gap` seconds, or it has waited
    `max_wait` (arrivals that never pause), or the waiting jobs fill the replica's free slots. gap 0:
    every job starts at the next step. A lone request pays `gap` in time to its first token."""

    gap: float = 0.001
    max_wait: float = 0.01

    def __post_init__(self):
        for name in ("gap", "max_wait"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"admission {name} must be >= 0 seconds (and finite), got {value}")
        if self.max_wait < self.gap:
            raise ValueError(f"admission max_wait ({self.max_wait} s) must be at least its gap ({self.gap} s)")


class QueueFull(Exception):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    """One reply to generate. Created on the event loop; its events are ("token", str),
    ("error", str) and finally ("done", None)."""

    messages: list
    max_tokens: int
    temperature: float
    top_k: int | None
    seed: int
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stop: threading.Event = field(default_factory=threading.Event)
    stop_reason: str = ""  # "client" (stop button, disconnect) or "timeout"
    tokens: int = 0
    created: float = field(default_factory=time.monotonic)
    # set by the worker that admits it
    row: object = None
    decode: Callable = None
    admitted: float = 0.0
    first_token: float | None = None

    def emit(self, kind: str, value=None):
        """Hand an event to the event loop (called from a worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody listens
            pass


def failure(e: Exception) -> str:
    return f"generation failed ({type(e).__name__}); see the server log"


def deliver(events: list):
    """Hand (job, kind, value) events to their event loops with one wake-up per loop, not one per
    event: a step's tokens for many replies reach the loop together, and the loop (which shares
    the GIL with the worker) is woken once per step instead of once per reply."""
    by_loop = collections.defaultdict(list)
    for job, kind, value in events:
        by_loop[job.loop].append((job.events, (kind, value)))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody listens
            pass


def _put_all(items):
    for queue, event in items:
        queue.put_nowait(event)


class ReplicaPool:
    def __init__(self, replicas: list[Replica], queue_limit: int, admission: Admission = Admission()):
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas = replicas
        self.queue_limit = queue_limit
        self.admission = admission
        self._last_arrival = -math.inf
        self.slots = [r.engine.slots for r in replicas]
        self._waiting = collections.deque()
        self._held = [set() for _ in replicas]  # per replica: the jobs holding (or about to hold) a slot
        self._rows = [dict() for _ in replicas]  # per replica: row -> job; its worker's alone
        self._cond = threading.Condition()
        self._closed = False
        self.counts = ServerStats(len(replicas))  # read and written under _cond
        self._threads = [
            threading.Thread(target=self._serve, args=(i,), name=f"replica-{i}", daemon=True)
            for i in range(len(replicas))
        ]
        for t in self._threads:
            t.start()

    # -- event-loop side ------------------------------------------------------------------------

    def submit(self, job: Job):
        """Queue `job`, or raise QueueFull when every slot is busy and queue_limit jobs wait."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down", retry_after=5)
            busy = sum(len(h) for h in self._held)
            if busy + len(self._waiting) >= sum(self.slots) + self.queue_limit:
                self.counts.outcomes["rejected"] += 1
                raise QueueFull(
                    f"server busy: all {sum(self.slots)} slot(s) generating and {len(self._waiting)} "
                    f"request(s) waiting (the limit); retry shortly",
                    self._retry_after(),
                )
            self._waiting.append(job)
            self._last_arrival = time.monotonic()
            self._cond.notify_all()

    def cancel(self, job: Job, reason: str):
        """Stop `job`: dropped if it is still waiting, else its row is cancelled before the next step.
        Does nothing to a job that has finished."""
        with self._cond:
            if job.stop.is_set():
                return
            job.stop_reason = reason
            job.stop.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts.outcomes["timed_out" if reason == "timeout" else "cancelled"] += 1

    def stats(self) -> dict:
        with self._cond:
            in_use = [len(h) for h in self._held]
            counts = self.counts.snapshot(time.monotonic())
            per_replica = counts.pop("per_replica")
            return {
                "replicas": len(self.replicas),
                "replicas_busy": sum(1 for n in in_use if n),
                "queue_length": len(self._waiting),
                "queue_limit": self.queue_limit,
                "slots": {
                    "total": sum(self.slots),
                    "in_use": sum(in_use),
                    "per_replica": [
                        {"device": r.device, "slots": n, "in_use": used, **own}
                        for r, n, used, own in zip(self.replicas, self.slots, in_use, per_replica)
                    ],
                },
                **counts,
            }

    def close(self):
        """Stop every job and let the worker threads end (they finish the step in hand)."""
        with self._cond:
            self._closed = True
            for held in self._held:
                for job in held:
                    job.stop.set()
            for job in self._waiting:
                job.stop.set()
                job.emit("error", "the server is shutting down")
                job.emit("done")
            self._waiting.clear()
            self._cond.notify_all()

    def join(self, timeout: float):
        """Wait at most `timeout` seconds in all for the worker threads to end, after close() (each
        finishes the step in hand): then no engine is in use, and a replica's own process can stop."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _retry_after(self) -> int:
        """Seconds until a place is likely free: a place frees when any running reply ends, so one
        average reply's time over the slots (1 s before any reply ended)."""
        mean = self.counts.mean_reply_seconds()
        return max(1, min(60, math.ceil(mean / sum(self.slots)))) if mean else 1

    # -- worker side: the only code that touches replica i's engine ------------------------------

    def _take(self, i: int) -> list[Job] | None:
        """The waiting jobs replica i admits now (they are due, it has free slots and no other
        replica has more); waits while it has no rows and nothing to admit. None once the pool is
        closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                free = [n - len(h) for n, h in zip(self.slots, self._held)]
                others = max((f for j, f in enumerate(free) if j != i), default=0)
                due_in = self._due_in(free[i])
                take = []
                while due_in <= 0 and self._waiting and free[i] > 0 and free[i] >= others:
                    take.append(self._waiting.popleft())
                    self._held[i].add(take[-1])
                    free[i] -= 1
                if take or self._held[i]:
                    return take
                self._cond.wait(due_in if 0 < due_in < math.inf else None)

    def _due_in(self, free: int) -> float:
        """Seconds until the waiting jobs start (Admission); <= 0: now, inf: none waits."""
        if not self._waiting:
            return math.inf
        if len(self._waiting) >= free:
            return 0.0
        a = self.admission
        return min(self._last_arrival + a.gap, self._waiting[0].created + a.max_wait) - time.monotonic()

    def _admit(self, i: int, job: Job):
        """Job -> a row of replica i's engine; a job that cannot start fails alone."""
        replica = self.replicas[i]
        try:
            prepared = replica.prepare(job)
            [row] = replica.engine.add(prepared.request)
        except Exception as e:
            log.error("a request could not start on %s (%s: %s)", replica.device, type(e).__name__, e)
            job.emit("error", failure(e))
            self._finish(i, job, "failed")
            return
        job.row, job.decode, job.admitted = row, prepared.decode, time.monotonic()
        self._rows[i][row] = job
        with self._cond:
            self.counts.started(i, job.admitted, prepared.truncated)
        if row.done:  # max_tokens 0: nothing to generate
            del self._rows[i][row]
            self._finish(i, job, "completed")

    def _finish(self, i: int, job: Job, outcome: str, emit=True):
        """End a job: its slot is no longer counted, its outcome is, its stream gets "done" (unless
        the caller delivers that itself)."""
        now = time.monotonic()
        with self._cond:
            if job.stop.is_set() and outcome in ("completed", "cancelled"):  # stopped before it ended
                outcome = "timed_out" if job.stop_reason == "timeout" else "cancelled"
            job.stop.set()  # finished: a late cancel() is a no-op
            self._held[i].discard(job)
            self.counts.ended(i, outcome, now - job.admitted if job.admitted else None, now, busy=bool(self._held[i]))
            self._cond.notify_all()  # a slot is free: another replica may be waiting to balance
        if emit:
            job.emit("done")

    def _cancel_stopped(self, i: int):
        """Free the slots of jobs stopped since the last step (stop button, client gone, timeout)."""
        for row, job in list(self._rows[i].items()):
            if job.stop.is_set():
                self.replicas[i].engine.cancel(row)
                del self._rows[i][row]
                self._finish(i, job, "cancelled")

    def _step(self, i: int):
        """One engine step; each token to its job; jobs whose rows ended are finished."""
        rows = self._rows[i]
        tokens = self.replicas[i].engine.step()
        now = time.monotonic()
        ttfts, ended, events = [], [], []
        for t in tokens:
            job = rows.get(t.row)
            if job is None:  # a row of no job (none today): nothing to route
                continue
            job.tokens += 1
            if job.first_token is None:
                job.first_token = now
                ttfts.append(now - job.created)
            piece = job.decode(t.token)
            if piece:
                events.append((job, "token", piece))
            if t.last:
                ended.append(job)
        with self._cond:
            self.counts.stepped(i, len(tokens), ttfts)
        for job in ended:
            del rows[job.row]
            self._finish(i, job, "completed", emit=False)
            events.append((job, "done", None))
        deliver(events)

    def _fail(self, i: int, e: Exception):
        """A step (or the routing of its tokens) failed: every reply the replica holds ends with an
        error event and the engine's rows are cancelled, so the replica starts clean and serves on.
        One log line for the step, not one per reply (the traceback at DEBUG level)."""
        replica, jobs = self.replicas[i], list(self._rows[i].values())
        self._rows[i].clear()
        log.error(
            "a decode step failed on %s (%s: %s); %d repl(ies) ended with an error",
            replica.device,
            type(e).__name__,
            e,
            len(jobs),
        )
        log.debug("the failed step", exc_info=e)
        for job in jobs:
            job.emit("error", failure(e))
            self._finish(i, job, "failed")
        try:
            for row in replica.engine.active:
                replica.engine.cancel(row)
        except Exception as e2:
            log.error("could not reset the engine on %s (%s: %s)", replica.device, type(e2).__name__, e2)

    def _serve(self, i: int):
        while (taken := self._take(i)) is not None:
            try:
                for job in taken:
                    self._admit(i, job)
                self._cancel_stopped(i)
                if self._rows[i]:
                    self._step(i)
            except Exception as e:  # a failing step must not take the replica down: its replies fail
                self._fail(i, e)
        for row, job in list(self._rows[i].items()):  # closed: the rows in hand end here
            self.replicas[i].engine.cancel(row)
            self._finish(i, job, "cancelled")
        self._rows[i].clear()
