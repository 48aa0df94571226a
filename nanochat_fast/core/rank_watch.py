"""
A stuck or dead rank, noticed: collectives wait generously until the first step is done, then
--collective-timeout (settle()); saves and evaluations stay generous and end in a barrier. A
collective failing inside a phase() is CollectiveFailed: one line naming the collective, phase and
step, and the ranks that did not arrive and their nodes (heartbeat stopped, or behind). Why and how:
docs/measurements.md#distributed-teardown-collective-timeouts-and-checkpoint-digests.
"""

import json
import os
import socket
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from .errors import CollectiveFailed

DEFAULT_TIMEOUT_S = 300.0  # after the first step (NCCL's own default is 600 s, gloo's 1800 s)
GENEROUS_S = 1800.0  # the first step, saves, evaluations: at least this long
BEAT_S = 1.0  # heartbeat period
STORE_TIMEOUT_S = 10.0  # a store read in the failure path never waits longer

_state = {"timeout": DEFAULT_TIMEOUT_S, "now": None, "what": "setup", "step": None, "entered": 0, "meetings": 0}
_beat = {"thread": None, "stop": None}


def here() -> dict:
    """This process's node: its hostname and torchrun's node rank (GROUP_RANK; 0 outside torchrun)."""
    return {"host": socket.gethostname(), "node": int(os.environ.get("GROUP_RANK", "0"))}


def describe_node(where: dict) -> str:
    return f"node {where['node']} ({where['host']})"


def generous_s() -> float:
    return max(GENEROUS_S, _state["timeout"])


def init_timeout(timeout_s: float | None) -> timedelta:
    """The process group's first timeout (generous); --collective-timeout is kept for settle()."""
    _state["timeout"] = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    _state["now"] = generous_s()
    return timedelta(seconds=_state["now"])


def _set(seconds: float):
    if dist.is_available() and dist.is_initialized() and seconds != _state["now"]:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))
    _state["now"] = seconds


def settle():
    """The first step is done: from now on collectives wait --collective-timeout."""
    _set(_state["timeout"])


def timeout_s() -> float:
    return _state["timeout"]


@contextmanager
def phase(what: str, step: int | None = None, generous: bool = False, sync: bool = False, seconds=None):
    """Collectives inside are `what` at `step` in a failure's line; generous (or seconds): a longer
    allowance; sync: a barrier at the end, under the same allowance (no rank leaves early)."""
    saved = (_state["what"], _state["step"], _state["now"])
    _state.update(what=what, step=step, entered=_state["entered"] + 1)
    if seconds is not None:
        _set(seconds)
    elif generous:
        _set(max(generous_s(), saved[2] or 0))
    try:
        yield
        if sync and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
    except RuntimeError as e:
        if not is_collective_failure(e):
            raise
        raise CollectiveFailed(describe(e)) from e
    finally:
        _state["what"], _state["step"] = saved[0], saved[1]
        _set(saved[2])


def is_collective_failure(e: BaseException) -> bool:
    """Raised by a collective (gloo/NCCL: a timeout, a peer's closed connection) of several processes."""
    if isinstance(e, CollectiveFailed) or not (dist.is_initialized() and dist.get_world_size() > 1):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    # a Work's wait() raises from C++ as a plain RuntimeError: known by the backend's own words
    text = str(e)
    if any(mark in text for mark in ("gloo/", "Timed out waiting", "Connection closed by peer", "NCCL")):
        return True
    frames = traceback.extract_tb(e.__traceback__)
    return any("torch/distributed/" in f.filename.replace("\\", "/") for f in frames)


def _collective_name(e: BaseException) -> str:
    """The torch.distributed call that failed (all_reduce, barrier, ...), else the package function."""
    frames = traceback.extract_tb(e.__traceback__)
    c10d = [f.name for f in frames if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    if c10d:
        return c10d[-1]
    ours = [f.name for f in frames if "nanochat_fast" in f.filename]
    return f"a collective in {ours[-1]}" if ours else "a collective"


def describe(e: BaseException) -> str:
    """One line: which collective, where, at which step, who did not arrive, what to do."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    step = f" at step {_state['step']}" if _state["step"] is not None else ""
    if "timed out" in str(e).lower():
        how = f"timed out after {_state['now']:g} s"
    else:  # the error's first line, without the source position gloo prefixes
        how = f"failed ({(str(e).strip() or type(e).__name__).splitlines()[0].split('] ', 1)[-1][:160]})"
    return (
        f"rank {rank}: {_collective_name(e)} in {_state['what']}{step} {how}; {missing_ranks()}. "
        "Resume with --resume auto (torchrun --max-restarts=N does it by itself); "
        "--collective-timeout sets the wait"
    )


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def start_heartbeat():
    """A daemon thread beating this rank's counter and position into the store once a second."""
    store = _store()
    if store is None or _beat["thread"] is not None or dist.get_world_size() < 2:
        return
    rank, stop, node = dist.get_rank(), threading.Event(), here()

    def beat():
        n = 0
        while not stop.is_set():
            n += 1
            try:
                store.set(f"rank_watch/{rank}", json.dumps({"n": n, "entered": _state["entered"], "node": node}))
            except Exception:  # the store is gone (teardown, the agent restarting): stop beating
                return
            stop.wait(BEAT_S)

    _beat.update(thread=threading.Thread(target=beat, name="rank_watch", daemon=True), stop=stop)
    _beat["thread"].start()


def stop_heartbeat():
    if _beat["thread"] is not None:
        _beat["stop"].set()
        _beat["thread"].join(timeout=2 * BEAT_S)
        _beat.update(thread=None, stop=None)


def _read_beats(store, ranks) -> dict:
    beats = {}
    for r in ranks:
        try:
            beats[r] = json.loads(store.get(f"rank_watch/{r}"))
        except Exception:
            beats[r] = None
    return beats


def missing_ranks() -> str:
    """Which ranks did not arrive: those whose heartbeat stopped or who are behind in the phases."""
    store = _store()
    if store is None or not dist.is_initialized():
        return "the backend cannot tell which rank did not arrive"
    me, others = dist.get_rank(), [r for r in range(dist.get_world_size()) if r != dist.get_rank()]
    try:
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        first = _read_beats(store, others)
        time.sleep(3 * BEAT_S)
        second = _read_beats(store, others)
    except Exception:
        return "the backend cannot tell which rank did not arrive (the store does not answer)"
    silent = [r for r in others if not second[r] or (first[r] and second[r]["n"] == first[r]["n"])]
    behind = [r for r in others if r not in silent and second[r]["entered"] < _state["entered"]]

    def named(ranks):  # "1 (node 1 (host))": the node from the rank's last heartbeat, if any
        beats = [second[r] or first[r] or {} for r in ranks]
        return ", ".join(f"{r} ({describe_node(b['node'])})" if "node" in b else str(r) for r, b in zip(ranks, beats))

    parts = []
    if silent:
        parts.append(f"rank {named(silent)} did not arrive (no heartbeat: stopped, frozen or dead)")
    if behind:
        parts.append(f"rank {named(behind)} did not arrive (alive but behind: a hung read or step)")
    return "; ".join(parts) or f"every other rank is alive and as far as rank {me}: cannot tell which did not arrive"


def meet_at_end(timeout_s: float) -> list[int]:
    """A barrier through the store (the ranks that did not come within timeout_s): once it returns,
    no rank is inside a collective, so closing the backend's connections aborts nobody (the
    backend's own barrier ends with a message that may still be in flight)."""
    store = _store()
    if store is None:
        return []
    _state["meetings"] += 1
    key = f"rank_watch/end{_state['meetings']}"
    me, world = dist.get_rank(), dist.get_world_size()
    waiting, deadline = set(range(world)) - {me}, time.monotonic() + timeout_s
    try:
        store.set(f"{key}/{me}", "1")
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting if not store.check([f"{key}/{r}"])}
            if waiting:
                time.sleep(0.02)
    except Exception:  # the store went with the rank that hosted it, which leaves only once all came
        return []
    return sorted(waiting)
