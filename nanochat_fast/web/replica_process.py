"""
A replica's engine in a process of its own, behind the engine's interface (slots, add, cancel, step,
score, active), so web/pool.py's worker drives it as one and only waits on a pipe: the engine's Python never
takes turns with the event loop's on one GIL. Adds and cancels go over together before each wait; a
request is checked here against the engine's limits first; a child that dies fails its rows and the next
add() starts a new one (RESTARTS in RESTART_SECONDS at most). Messages: docs/measurements.md#chat-server.
"""

import collections
import contextlib
import logging
import multiprocessing
import pickle
import signal
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

log = logging.getLogger("nanochat_fast.chat_web")

CLOSE_SECONDS = 5.0  # how long close() waits for the child to end before it is killed
# A dead child is replaced at the next add(), at most RESTARTS times in RESTART_SECONDS: one that dies at
# every request would cost each a spawn and a model load; beyond that requests are refused at once.
RESTARTS, RESTART_SECONDS = 3, 60.0


class ReplicaProcessError(RuntimeError):
    """The replica's process is gone (it crashed or was killed): nothing it held can go on."""


@dataclass(eq=False)
class RowHandle:  # the server side's handle of one row of the child's engine
    id: int
    done: bool = False


class StepToken(NamedTuple):
    row: RowHandle
    token: int
    forced: bool
    last: bool


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling (the parent raises it as raised here), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _serve(conn, build: Callable, threads: int):
    """The child: build the engine, then step it while it has rows, applying the server's messages between."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        engine, info = build()
    except BaseException as e:
        conn.send(("refused", _portable(e)))
        return
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):  # the server is gone
        conn.send(("ready", {**info, "limits": engine.limits}))
        rows = {}  # id -> the engine's row
        while True:
            while not engine.active or conn.poll():
                message = conn.recv()
                if message[0] == "close":
                    return
                if message[0] == "score":
                    try:
                        conn.send(("scored", engine.score(*message[1:])))
                    except Exception as e:  # checked by the server: the forward itself failed
                        conn.send(("score_failed", _portable(e)))
                    continue
                for op, id, *request in message[1]:
                    if op == "add":
                        try:
                            [row] = engine.add(*request)
                        except Exception as e:  # checked by the server: not a request's own fault
                            conn.send(("failed", (_portable(e), [id])))
                            continue
                        if not row.done:
                            rows[id] = row
                    elif (row := rows.pop(id, None)) is not None:
                        engine.cancel(row)
            try:
                tokens = engine.step()
            except Exception as e:  # its rows end; the engine serves on
                for row in list(engine.active):
                    engine.cancel(row)
                conn.send(("failed", (_portable(e), list(rows))))
                rows.clear()
                continue
            ids = {row: id for id, row in rows.items()}
            conn.send(("step", [(ids[t.row], t.token, t.forced, t.last) for t in tokens]))
            rows = {id: row for id, row in rows.items() if not row.done}


class ProcessEngine:
    """The engine `build()` (-> (engine, info dict); it must pickle) makes in a spawned child, raising here."""

    def __init__(self, build: Callable, threads: int, name: str = "replica"):
        self._build, self._threads, self._name = build, threads, name
        self._rows: dict[int, RowHandle] = {}
        self._ops = []  # adds and cancels not yet sent
        self._early = collections.deque()  # step messages that arrived while a score() waited for its answer
        self._next_id = 0
        self._restarts = collections.deque()  # when dead children were replaced (time.monotonic)
        self._start()

    def _start(self):
        context = multiprocessing.get_context("spawn")  # a forked torch with threads running can hang
        self._conn, child_end = context.Pipe()
        args = (child_end, self._build, self._threads)
        self._process = context.Process(target=_serve, args=args, name=self._name, daemon=True)
        self._process.start()
        child_end.close()  # the child's end lives in the child alone: its death is an EOF here
        kind, value = self._receive()
        if kind == "refused":
            self.close()
            raise value
        self.info, self.limits, self.slots = value, value["limits"], value["slots"]

    @property
    def active(self) -> list[RowHandle]:
        return list(self._rows.values())

    def _receive(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # the child is gone: every row it held ends
            for row in self._rows.values():
                row.done = True
            self._rows.clear()
            raise self._ended() from None

    def _flush(self):
        """Send the ops not yet sent; a child that is gone raises, its rows left for the next step() to end."""
        if self._ops:
            ops, self._ops = self._ops, []
            try:
                self._conn.send(("ops", ops))
            except OSError:
                raise self._ended() from None

    def _ended(self) -> ReplicaProcessError:
        self._process.join(1.0)
        return ReplicaProcessError(f"the replica's process ended (exit code {self._process.exitcode})")

    def add(self, request) -> list[RowHandle]:
        """The request's row (max_tokens 0: done at once), joining the child's engine at the next step()."""
        self.limits.check(request)
        if not self._process.is_alive():
            if self._rows:  # they fail first, at the next step() (the pool fails their replies)
                raise self._ended()
            self._restart()
        self._next_id += 1
        row = RowHandle(self._next_id, done=request.max_tokens == 0)
        if not row.done:
            self._rows[row.id] = row
            self._ops.append(("add", row.id, request))
        return [row]

    def _restart(self):
        """A new child in place of the dead one, unless RESTARTS were started in the last RESTART_SECONDS."""
        now, code = time.monotonic(), self._process.exitcode
        while self._restarts and now - self._restarts[0] >= RESTART_SECONDS:
            self._restarts.popleft()
        if len(self._restarts) >= RESTARTS:
            wait = RESTART_SECONDS - (now - self._restarts[0])
            raise ReplicaProcessError(
                f"the replica's process keeps ending (exit code {code}; restarted {len(self._restarts)}x in the last "
                f"{RESTART_SECONDS:g} s): the next restart in {wait:.0f} s"
            )
        log.warning("%s: its process ended (exit code %s); starting a new one", self._name, code)
        self._restarts.append(now)
        self._ops.clear()
        self._early.clear()
        self._conn.close()
        self._start()

    def cancel(self, row: RowHandle):
        """Nothing more of `row` reaches the caller; the child frees its slot before its next step."""
        if self._rows.pop(row.id, None) is not None:
            row.done = True
            self._ops.append(("cancel", row.id))
            with contextlib.suppress(ReplicaProcessError):  # the child is gone, and the row with it
                self._flush()

    def score(self, ids: list[int], top: int):
        """BatchEngine.score in the child, between two of its steps; the steps it sends meanwhile wait for step()."""
        self.limits.check_scoring(ids, top)
        if not self._process.is_alive():
            raise self._ended()
        self._flush()
        try:
            self._conn.send(("score", ids, top))
        except OSError:
            raise self._ended() from None
        while (message := self._receive())[0] not in ("scored", "score_failed"):
            self._early.append(message)
        if message[0] == "score_failed":
            raise message[1]
        return message[1]

    def step(self) -> list[StepToken]:
        """Send the adds and cancels, then wait for the child's next step's tokens of the rows held here."""
        self._flush()
        while self._rows:
            kind, value = self._early.popleft() if self._early else self._receive()
            if kind == "failed":
                error, ended = value
                for id in ended:
                    if (row := self._rows.pop(id, None)) is not None:
                        row.done = True
                raise error
            tokens = [StepToken(self._rows[id], *rest) for id, *rest in value if id in self._rows]
            for t in tokens:
                if t.last:
                    t.row.done = True
                    del self._rows[t.row.id]
            if tokens:
                return tokens
        return []

    def close(self):
        """Stop the child, killed if not ended within CLOSE_SECONDS; once nothing else uses this engine."""
        with contextlib.suppress(OSError):
            self._conn.send(("close",))
        self._process.join(CLOSE_SECONDS)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
