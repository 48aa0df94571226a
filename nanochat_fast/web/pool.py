"""
The replicas behind the chat server: one bounded queue of jobs (replies to write), and per replica one
worker thread, the only one that drives its engine: it admits waiting jobs into free slots, steps the
engine, hands each token to its job and ends or cancels rows between steps. A job becomes a row through
the replica's prepare(job), which chat_web provides (web/ knows nothing of models). /stats counts come
from here (ServerStats). The threads, jobs and failures in full: docs/measurements.md#chat-server.
"""

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

log = logging.getLogger("nanochat_fast.chat_web")

OUTCOMES = ("completed", "cancelled", "timed_out", "failed")  # how a request that got in ended
TTFT_WINDOW = 1000  # /stats' time to first token: its percentiles over the last this many replies


class Prepared(NamedTuple):  # what a replica's prepare(job) gives
    request: object  # what engine.add takes (model/batch_engine.Request)
    decode: Callable[[int], str]  # a token id -> the text it completes ("" for the end token, a partial character)
    truncated: bool = False  # the conversation was cut from its start to fit the model's context
    stop: frozenset = frozenset()  # the token ids that end a reply (its finish_reason "stop", else "length")
    prompt: tuple = ()  # the prompt's token ids, as the engine gets them (counted in usage, scored for logprobs)


@dataclass
class Replica:
    """One model on one device: an engine with BatchEngine's `slots`, add, cancel, step, score and `active`."""

    engine: object
    prepare: Callable  # job -> Prepared (or a tuple of its first fields)
    device: str


@dataclass(frozen=True)
class Admission:
    """When waiting jobs start, so that a burst's prompts run in one step: once no request has arrived for
    `gap` seconds, or after `max_wait`, or when they fill the replica's free slots (gap 0: at the next step)."""

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
    """One reply, made on the event loop; its events: ("token", str), ("error", str), then ("done", None).
    Before "done" the worker fills in what the OpenAI API reports: the prompt's and the reply's token ids,
    why the reply ended, and (when `logprobs` is set) the scores of both (Engine.score)."""

    messages: list  # a chat reply's conversation
    max_tokens: int
    temperature: float
    top_k: int | None
    seed: int
    top_p: float | None = None
    prompt: list | None = None  # a base model's completion of these token ids, in place of `messages`
    logprobs: int | None = None  # once the reply ends: prompt + reply scored, this many most likely tokens listed
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stop: threading.Event = field(default_factory=threading.Event)
    stop_reason: str = ""  # "client" (stop button, disconnect) or "timeout"
    created: float = field(default_factory=time.monotonic)
    # set by the worker that admits it
    row: object = None
    decode: Callable = None
    admitted: float = 0.0
    first_token: float | None = None
    stop_ids: frozenset = frozenset()
    prompt_ids: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (a stop token, or a stop string the caller found) or "length"
    scores: tuple | None = None

    def emit(self, kind: str, value=None):
        deliver([(self, kind, value)])


def deliver(events: list):
    """Hand (job, kind, value) events to their event loops, one wake-up a loop (which shares the GIL)."""
    by_loop = collections.defaultdict(list)
    for job, kind, value in events:
        by_loop[job.loop].append((job.events, (kind, value)))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down, nobody listens
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items):
    for queue, event in items:
        queue.put_nowait(event)


def failure(e: Exception) -> str:
    return f"generation failed ({type(e).__name__}); see the server log"


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


class ServerStats:
    """/stats' counts, under the pool's lock: tokens_generated (end and forced tokens included) over
    decode_seconds (wall time with a reply admitted; per replica its own); ttft_s: arrival to first token."""

    def __init__(self, replicas: int):
        self.outcomes = collections.Counter()  # OUTCOMES and "rejected"
        self.tokens = [0] * replicas
        self.ttft = collections.deque(maxlen=TTFT_WINDOW)
        self.truncated = 0
        self.replies, self.reply_seconds = 0, 0.0  # admitted replies that ended, their time from admission
        self.busy_since = [None] * replicas  # when each replica last went from no reply to one
        self.busy_seconds = [0.0] * replicas
        self.any_busy_since = None  # the same for the server: at least one replica busy
        self.decode_seconds = 0.0

    def started(self, replica: int, now: float, truncated: bool):
        self.truncated += bool(truncated)
        if self.busy_since[replica] is None:
            if self.any_busy_since is None:
                self.any_busy_since = now
            self.busy_since[replica] = now

    def stepped(self, replica: int, tokens: int, ttfts: list[float]):
        self.tokens[replica] += tokens
        self.ttft.extend(ttfts)

    def ended(self, replica: int, outcome: str, seconds: float | None, now: float, busy: bool):
        """seconds: since its admission (None: never admitted); busy: the replica holds other replies."""
        self.outcomes[outcome] += 1
        if seconds is not None:
            self.replies += 1
            self.reply_seconds += seconds
        if not busy and self.busy_since[replica] is not None:
            self.busy_seconds[replica] += now - self.busy_since[replica]
            self.busy_since[replica] = None
            if all(since is None for since in self.busy_since):
                self.decode_seconds += now - self.any_busy_since
                self.any_busy_since = None

    def mean_reply_seconds(self) -> float | None:
        return self.reply_seconds / self.replies if self.replies else None

    def snapshot(self, now: float) -> dict:
        def rate(tokens, seconds):
            return round(tokens / seconds, 2) if seconds > 0 else None

        def busy(seconds, since):
            return seconds + (now - since if since is not None else 0.0)

        decode, ttft = busy(self.decode_seconds, self.any_busy_since), list(self.ttft)
        own = [busy(seconds, since) for seconds, since in zip(self.busy_seconds, self.busy_since)]
        ttft_s = {f"p{p}": round(percentile(ttft, p), 4) if ttft else None for p in (50, 90, 99)}
        return {
            "requests": {k: self.outcomes[k] for k in OUTCOMES + ("rejected",)},
            "tokens_generated": sum(self.tokens),
            "decode_seconds": round(decode, 3),
            "tokens_per_s": rate(sum(self.tokens), decode),
            "ttft_s": ttft_s | {"requests": len(ttft)},
            "prompts_truncated": self.truncated,
            "per_replica": [{"tokens_generated": t, "tokens_per_s": rate(t, s)} for t, s in zip(self.tokens, own)],
        }


class ReplicaPool:
    """At most every slot busy plus `queue_limit` waiting: a request beyond that is refused as it arrives
    (HTTP 503). A waiting job goes to the replica with the most free slots when Admission says it starts."""

    def __init__(self, replicas: list[Replica], queue_limit: int, admission: Admission = Admission()):
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas, self.queue_limit, self.admission = replicas, queue_limit, admission
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
        """Stop `job`: dropped if waiting, else its row cancelled before the next step. reason: "client",
        "timeout", or "stop" (the caller found a stop string: the reply is complete)."""
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
        """Stop every job; the worker threads end after the step in hand."""
        with self._cond:
            self._closed = True
            for job in (job for held in self._held for job in held):
                job.stop.set()
            for job in self._waiting:
                job.stop.set()
                deliver([(job, "error", "the server is shutting down"), (job, "done", None)])
            self._waiting.clear()
            self._cond.notify_all()

    def join(self, timeout: float):
        """Wait at most `timeout` seconds in all for the workers to end after close()."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _retry_after(self) -> int:
        """Seconds until a place is likely free: an average reply's time over the slots (1 before any)."""
        mean = self.counts.mean_reply_seconds()
        return max(1, min(60, math.ceil(mean / sum(self.slots)))) if mean else 1

    # -- worker side: the only code that touches replica i's engine ------------------------------

    def _take(self, i: int) -> list[Job] | None:
        """The waiting jobs replica i admits now (due, in free slots, no replica with more), waiting while it
        has no rows and nothing to admit; None once the pool is closed."""
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
        """A job that cannot start fails alone."""
        replica = self.replicas[i]
        try:
            prepared = Prepared(*replica.prepare(job))
            [row] = replica.engine.add(prepared.request)
        except Exception as e:
            log.error("a request could not start on %s (%s: %s)", replica.device, type(e).__name__, e)
            job.emit("error", failure(e))
            self._finish(i, job, "failed")
            return
        job.row, job.decode, job.admitted = row, prepared.decode, time.monotonic()
        job.stop_ids, job.prompt_ids = prepared.stop, list(prepared.prompt)
        with self._cond:
            self.counts.started(i, job.admitted, prepared.truncated)
        if row.done:  # max_tokens 0: nothing to generate
            job.finish_reason = "length"
            self._finish(i, job, "completed" if self._score(i, job) else "failed")
        else:
            self._rows[i][row] = job

    def _score(self, i: int, job: Job) -> bool:
        """A job that asked for logprobs: its prompt and reply scored by the engine (False: that failed, said)."""
        if job.logprobs is None:
            return True
        try:
            job.scores = self.replicas[i].engine.score(job.prompt_ids + job.token_ids, job.logprobs)
            return True
        except Exception as e:
            log.error("scoring failed on %s (%s: %s)", self.replicas[i].device, type(e).__name__, e)
            job.emit("error", failure(e))
            return False

    def _finish(self, i: int, job: Job, outcome: str, emit=True):
        """A job's slot freed, its outcome counted, its stream given "done" (unless the caller does)."""
        now = time.monotonic()
        with self._cond:
            if job.stop.is_set() and outcome in ("completed", "cancelled"):  # stopped before it ended
                outcome = {"timeout": "timed_out", "stop": "completed"}.get(job.stop_reason, "cancelled")
            job.stop.set()  # finished: a late cancel() is a no-op
            self._held[i].discard(job)
            self.counts.ended(i, outcome, now - job.admitted if job.admitted else None, now, busy=bool(self._held[i]))
            self._cond.notify_all()  # a slot is free: another replica may be waiting to balance
        if emit:
            job.emit("done")

    def _cancel_stopped(self, i: int):
        """Free the slots of jobs stopped since the last step (stop button, client gone, timeout, close)."""
        for row, job in list(self._rows[i].items()):
            if job.stop.is_set():
                self.replicas[i].engine.cancel(row)
                del self._rows[i][row]
                self._finish(i, job, "cancelled")

    def _step(self, i: int):
        rows = self._rows[i]
        tokens = self.replicas[i].engine.step()
        now = time.monotonic()
        ttfts, ended, events = [], [], []
        for t in tokens:
            job = rows.get(t.row)
            if job is None:  # a row of no job (none today): nothing to route
                continue
            if job.first_token is None:
                job.first_token = now
                ttfts.append(now - job.created)
            job.token_ids.append(t.token)
            piece = job.decode(t.token)
            if piece:
                events.append((job, "token", piece))
            if t.last:
                job.finish_reason = "stop" if t.token in job.stop_ids else "length"
                ended.append(job)
        with self._cond:
            self.counts.stepped(i, len(tokens), ttfts)
        if any(job.logprobs is not None for job in ended):  # the tokens go before the scoring's forward
            deliver(events)
            events = []
        for job in ended:
            del rows[job.row]
            self._finish(i, job, "completed" if self._score(i, job) else "failed", emit=False)
            events.append((job, "done", None))
        deliver(events)

    def _fail(self, i: int, e: Exception):
        """A step failed: the replica's replies end with an error, its rows are cancelled, it serves on."""
        replica, jobs = self.replicas[i], list(self._rows[i].values())
        self._rows[i].clear()
        what = (replica.device, type(e).__name__, e, len(jobs))
        log.error("a decode step failed on %s (%s: %s); %d repl(ies) ended with an error", *what)
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
        self._cancel_stopped(i)  # closed: close() stopped every job, the rows in hand end here
