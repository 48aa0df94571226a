"""
A pool of model replicas serving chat requests from one bounded queue.

Each replica (a model on its own device) has one worker thread that takes the oldest waiting job
and generates its reply; torch releases the GIL inside its ops, so the event loop keeps serving
pages and streams while replicas compute. A job talks to the event loop through an asyncio queue
(the worker hands it text pieces with call_soon_threadsafe) and is stopped through a
threading.Event that the generation checks between tokens: a stop button, a client that went away
or a request past its time all free the replica before its next token.

Admission is decided when a request arrives: at most `queue_limit` jobs wait for a replica, and a
request beyond that is refused at once (HTTP 503) instead of waiting without bound.
"""
import asyncio
import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("nanochat_fast.chat_web")
OUTCOMES = ("completed", "cancelled", "timed_out", "failed")  # how a request that got in ended


@dataclass
class Replica:
    model: object
    tokenizer: object
    device: str


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

    def emit(self, kind: str, value=None):
        """Hand an event to the event loop (called from a worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody listens
            pass


class ReplicaPool:
    """`generate(model, tokenizer, messages, max_tokens, temperature, top_k, seed, on_text,
    should_stop)` is model/generation.assistant_reply (or a stand-in with its signature)."""

    def __init__(self, replicas: list[Replica], generate, queue_limit: int):
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas = replicas
        self.queue_limit = queue_limit
        self._generate = generate
        self._waiting = collections.deque()
        self._running = set()
        self._cond = threading.Condition()
        self._busy = 0
        self._closed = False
        self._tokens = 0
        self._busy_seconds = 0.0
        self.counts = collections.Counter()  # completed, cancelled, timed_out, failed, rejected
        self._threads = [threading.Thread(target=self._serve, args=(r,), name=f"replica-{i}", daemon=True)
                         for i, r in enumerate(replicas)]
        for t in self._threads:
            t.start()

    # -- event-loop side ------------------------------------------------------------------------

    def submit(self, job: Job):
        """Queue `job`, or raise QueueFull when every replica is busy and queue_limit jobs wait."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down", retry_after=5)
            if self._busy + len(self._waiting) >= len(self.replicas) + self.queue_limit:
                self.counts["rejected"] += 1
                raise QueueFull(f"server busy: {self._busy} replica(s) generating and {len(self._waiting)} "
                                f"request(s) waiting (the limit); retry shortly", self._retry_after())
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job, reason: str):
        """Stop `job`: dropped if it is still waiting, else its replica stops before the next token.
        Does nothing to a job that has finished."""
        with self._cond:
            if job.stop.is_set():
                return
            job.stop_reason = reason
            job.stop.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["timed_out" if reason == "timeout" else "cancelled"] += 1

    def stats(self) -> dict:
        with self._cond:
            return {"replicas": len(self.replicas), "replicas_busy": self._busy,
                    "queue_length": len(self._waiting), "queue_limit": self.queue_limit,
                    "requests": {k: self.counts[k] for k in OUTCOMES + ("rejected",)},
                    "tokens_generated": self._tokens,
                    # decode speed of one replica: tokens per second spent generating (prompts included)
                    "tokens_per_s": round(self._tokens / self._busy_seconds, 2) if self._busy_seconds else None}

    def close(self):
        """Stop every job and let the worker threads end (they finish the token in hand)."""
        with self._cond:
            self._closed = True
            for job in self._running:
                job.stop.set()
            for job in self._waiting:
                job.stop.set()
                job.emit("error", "the server is shutting down")
                job.emit("done")
            self._waiting.clear()
            self._cond.notify_all()

    def _retry_after(self) -> int:
        """Seconds until a place is likely free: one average request's time (1 s before any)."""
        finished = sum(self.counts[k] for k in OUTCOMES)
        mean = self._busy_seconds / finished if finished else 1.0
        return max(1, min(60, math.ceil(mean)))

    # -- worker side ----------------------------------------------------------------------------

    def _next_job(self) -> Job | None:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            self._busy += 1
            job = self._waiting.popleft()
            self._running.add(job)
            return job

    def _serve(self, replica: Replica):
        while (job := self._next_job()) is not None:
            start = time.perf_counter()
            outcome = "completed"

            def should_stop():
                if job.stop.is_set():
                    return True
                job.tokens += 1  # asked once per generated token, before that token is used
                return False

            try:
                self._generate(replica.model, replica.tokenizer, job.messages, job.max_tokens,
                               temperature=job.temperature, top_k=job.top_k, seed=job.seed,
                               on_text=lambda piece: job.emit("token", piece), should_stop=should_stop)
            except Exception as e:  # a failing request must not take the replica down with it
                log.exception("generation failed")
                outcome = "failed"
                job.emit("error", f"generation failed ({type(e).__name__}); see the server log")
            with self._cond:
                if job.stop.is_set() and outcome == "completed":
                    outcome = "timed_out" if job.stop_reason == "timeout" else "cancelled"
                job.stop.set()  # finished: a late cancel() is a no-op
                self.counts[outcome] += 1
                self._running.discard(job)
                self._busy -= 1
                self._tokens += job.tokens
                self._busy_seconds += time.perf_counter() - start
            job.emit("done")
