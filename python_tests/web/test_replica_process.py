"""A replica's engine in a process of its own (web/replica_process.ProcessEngine), against stand-in
engines in the child whose every row's tokens are known in advance (support/stand_in_engines.py):
the tokens come through whole and in order, requests added together start in one step, a bad request
is refused at add as the engine refuses it, a cancelled row yields nothing more and frees its slot, a
failing step ends its rows and the engine serves on, a child that dies fails its rows and is started
anew at the next request, a scoring request between steps loses none of them, and the pool drives it as
an engine of its own process, scores included."""

import asyncio
import functools
import threading

import pytest
from support.stand_in_engines import CRASH, FAIL_STEP, counting_engine, refuse_to_build

from nanochat_fast.model.batch_engine import Request
from nanochat_fast.web import replica_process
from nanochat_fast.web.pool import Job, Prepared, Replica, ReplicaPool
from nanochat_fast.web.replica_process import ProcessEngine, ReplicaProcessError

SLOTS = 4


@pytest.fixture(scope="module")
def engine():
    engine = ProcessEngine(functools.partial(counting_engine, SLOTS), threads=1)
    yield engine
    engine.close()


def expected(first: int, max_tokens: int) -> list[int]:
    return [first * 100 + i for i in range(max_tokens)]


def run(engine, rows) -> dict:
    """Step until none of `rows` is left; each row's tokens, checking `last` comes with the final one."""
    got = {row.id: [] for row in rows}
    while engine.active:
        for t in engine.step():
            assert not t.row.done or t.last
            got[t.row.id].append((t.token, t.last))
    for tokens in got.values():
        assert [last for _, last in tokens] == [False] * (len(tokens) - 1) + [True]
    return {id: [token for token, _ in tokens] for id, tokens in got.items()}


def test_each_rows_tokens_come_whole_and_in_order_as_rows_join_and_leave(engine):
    a = engine.add(Request([1], 5))[0]
    b = engine.add(Request([2], 2))[0]
    first = engine.step()
    assert [(t.row, t.token) for t in first] == [(a, 100), (b, 200)]  # added together: one step
    c = engine.add(Request([3], 4))[0]  # joins while the others decode
    got = run(engine, [a, b, c])
    assert got == {a.id: expected(1, 5)[1:], b.id: expected(2, 2)[1:], c.id: expected(3, 4)}
    assert a.done and b.done and c.done and engine.active == []


def test_requests_added_together_start_in_one_step(engine):
    rows = [engine.add(Request([10 + i], 3))[0] for i in range(SLOTS)]
    assert [t.row for t in engine.step()] == rows
    run(engine, rows)


def test_a_bad_request_is_refused_at_add_as_the_engine_refuses_it(engine):
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 100\), got 100..100"):
        engine.add(Request([100], 3))
    with pytest.raises(ValueError, match="exceeds the engine's max_len"):
        engine.add(Request([1] * 60, 10))
    [done] = engine.add(Request([1], 0))  # max_tokens 0: done at once, as BatchEngine's add
    assert done.done and engine.active == []
    row = engine.add(Request([4], 2))[0]  # nothing of the refused ones reached the child
    assert run(engine, [row]) == {row.id: expected(4, 2)}


def test_a_cancelled_row_yields_nothing_more_and_frees_its_slot(engine):
    rows = [engine.add(Request([20 + i], 30))[0] for i in range(SLOTS)]
    engine.step()
    engine.step()
    engine.cancel(rows[0])
    assert rows[0].done and rows[0] not in engine.active
    late = engine.add(Request([30], 3))[0]  # in its slot: the child's engine refuses a fifth row
    seen = [t for _ in range(5) for t in engine.step()]
    for row in rows[1:]:
        engine.cancel(row)
    while engine.active:
        seen += engine.step()
    assert rows[0].id not in [t.row.id for t in seen]
    assert [t.token for t in seen if t.row is late] == expected(30, 3) and late.done


def test_a_failing_step_ends_its_rows_with_its_error_and_the_engine_serves_on(engine):
    rows = [engine.add(Request([FAIL_STEP], 5))[0], engine.add(Request([5], 5))[0]]
    engine.step()
    with pytest.raises(RuntimeError, match="^boom$"):
        engine.step()
    assert all(row.done for row in rows) and engine.active == []
    row = engine.add(Request([6], 3))[0]
    assert run(engine, [row]) == {row.id: expected(6, 3)}


def test_a_dead_child_fails_its_rows_and_the_next_add_starts_a_new_one(caplog):
    engine = ProcessEngine(functools.partial(counting_engine, SLOTS), threads=1, name="replica cpu")
    try:
        rows = [engine.add(Request([CRASH], 5))[0], engine.add(Request([1], 5))[0]]
        engine.step()
        engine._process.join(10)  # dead before anything notices
        with pytest.raises(ReplicaProcessError, match=r"^the replica's process ended \(exit code 3\)$"):
            engine.add(Request([3], 3))  # its rows fail first
        assert engine.active == rows
        with pytest.raises(ReplicaProcessError, match=r"^the replica's process ended \(exit code 3\)$"):
            engine.step()
        assert engine.active == [] and all(row.done for row in rows) and engine.step() == []
        engine.cancel(rows[1])  # a row of the dead child: nothing to do
        row = engine.add(Request([2], 3))[0]
        assert run(engine, [row]) == {row.id: expected(2, 3)}
    finally:
        engine.close()
    assert [r.getMessage() for r in caplog.records] == [
        "replica cpu: its process ended (exit code 3); starting a new one"
    ]


def test_a_child_that_keeps_dying_is_not_restarted_until_the_window_has_room(monkeypatch):
    """RESTARTS replacements in RESTART_SECONDS, then add() refuses at once, saying when the next
    may start; once the window has room, a new child again."""
    monkeypatch.setattr(replica_process, "RESTARTS", 1)
    engine = ProcessEngine(functools.partial(counting_engine, SLOTS), threads=1)

    def crash():
        [row] = engine.add(Request([CRASH], 5))
        with pytest.raises(ReplicaProcessError, match=r"^the replica's process ended \(exit code 3\)$"):
            while True:
                engine.step()
        assert row.done

    try:
        crash()
        crash()  # the one restart the window allows
        dead = engine._process
        with pytest.raises(
            ReplicaProcessError,
            match=r"keeps ending \(exit code 3; restarted 1x in the last 60 s\): the next restart in [1-6]?\d s$",
        ):
            engine.add(Request([2], 3))
        assert engine._process is dead and not dead.is_alive()
        monkeypatch.setattr(replica_process, "RESTART_SECONDS", 0.0)  # as if the minute had passed
        row = engine.add(Request([2], 3))[0]
        assert run(engine, [row]) == {row.id: expected(2, 3)}
    finally:
        engine.close()


def test_an_engine_that_cannot_be_built_raises_its_error_and_leaves_no_process():
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="^no such run$"):
        ProcessEngine(functools.partial(refuse_to_build, "no such run"), threads=1)
    assert set(multiprocessing.active_children()) == before


def test_the_pool_drives_it_as_an_engine_of_its_own_process(engine):
    replica = Replica(engine, lambda job: Prepared(Request([job.seed], 4), decode=str), "cpu")
    threads = set(threading.enumerate())
    pool = ReplicaPool([replica], queue_limit=8)

    async def reply(seed):
        job = Job(messages=[], max_tokens=4, temperature=0.0, top_k=None, seed=seed)
        pool.submit(job)
        events = []
        while (event := await job.events.get())[0] != "done":
            events.append(event)
        return events

    async def replies():
        return await asyncio.gather(*(reply(40 + i) for i in range(6)))  # more than the slots: 2 wait

    try:
        got = asyncio.run(replies())
    finally:
        pool.close()
        pool.join(10)
    assert set(threading.enumerate()) == threads  # its worker ended: the engine may be closed
    assert got == [[("token", str(t)) for t in expected(40 + i, 4)] for i in range(6)]
    assert pool.stats()["requests"]["completed"] == 6


def test_a_score_between_steps_loses_no_step_and_a_failing_one_raises_alone(engine):
    rows = [engine.add(Request([50 + i], 8))[0] for i in range(2)]
    first = engine.step()  # the child steps on while the score waits: its steps come after
    assert engine.score([3, 4, 5], 2) == ([2.0, 2.5], [[4, 4], [5, 5]], [[2.0, 2.0], [2.5, 2.5]])
    with pytest.raises(RuntimeError, match="^no score$"):
        engine.score([FAIL_STEP, 1], 1)
    with pytest.raises(ValueError, match=r"top must be an int in \[0, 20\]"):
        engine.score([1, 2], 21)
    got = run(engine, rows)
    assert [t.token for t in first] == [5000, 5100]
    assert got == {rows[0].id: expected(50, 8)[1:], rows[1].id: expected(51, 8)[1:]}


def test_the_pool_scores_a_job_that_asks_for_logprobs_once_it_ends(engine):
    def prepare(job):  # rows of prompt[0] == 0: tokens 0, 1, 2, ... within the stand-in's vocabulary
        return Prepared(Request([0, job.seed], job.max_tokens), decode=str, stop={2}, prompt=(0, job.seed))

    pool = ReplicaPool([Replica(engine, prepare, "cpu")], queue_limit=8)

    async def reply(seed, max_tokens):
        job = Job(messages=[], max_tokens=max_tokens, temperature=0.0, top_k=None, seed=seed, logprobs=1)
        pool.submit(job)
        while (await job.events.get())[0] != "done":
            pass
        return job

    async def replies():
        return await asyncio.gather(reply(40, 3), reply(41, 2))

    try:
        jobs = asyncio.run(replies())
    finally:
        pool.close()
        pool.join(10)
    for job, seed, max_tokens in zip(jobs, (40, 41), (3, 2)):
        ids = [0, seed] + expected(0, max_tokens)
        assert job.prompt_ids == [0, seed] and job.token_ids == expected(0, max_tokens)
        assert job.scores == ([t / 2 for t in ids[1:]], [[t] for t in ids[1:]], [[t / 2] for t in ids[1:]])
    assert [job.finish_reason for job in jobs] == ["stop", "length"]  # the first ends with 2, a stop token here
