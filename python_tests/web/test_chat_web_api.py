"""chat_web's HTTP API through the ASGI test client (httpx, no sockets): streamed replies that match
the model's own reply, many replies decoded together in one replica's engine, every kind of invalid
body, the body-size cap, what is served and what is not, the bounded queue (503), the request
timeout, a failing step, the /stats counters, temperatures too small to divide by, and the command
line's one-line errors. Uploads cut short or stalled go through a real uvicorn on a loopback port,
byte by byte over a raw socket."""

import asyncio
import json
import logging
import math
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="chat_web needs the web extra: pip install -e '.[web]'")
import httpx  # noqa: E402
from support.chat_web_support import chat_home, load_chat_model, sse_events  # noqa: E402
from support.slow_chat_web import Slowed  # noqa: E402

from nanochat_fast.core import cli  # noqa: E402
from nanochat_fast.model import batch_engine, generation  # noqa: E402
from nanochat_fast.scripts import chat_web  # noqa: E402
from nanochat_fast.web import app as web_app  # noqa: E402
from nanochat_fast.web.app import Limits, Settings, create_app  # noqa: E402
from nanochat_fast.web.pool import ReplicaPool  # noqa: E402

QUESTION = [{"role": "user", "content": "what is 2 plus 3?"}]
LIMITS = Limits(max_tokens=64)


@pytest.fixture(scope="module")
def web_home(tiny_home):
    return chat_home(tiny_home)


@pytest.fixture(scope="module")
def model_and_tokenizer(web_home):
    return load_chat_model(web_home)


@pytest.fixture(scope="module")
def reference(model_and_tokenizer):
    """The greedy reply to QUESTION, computed directly (no server)."""
    model, tokenizer = model_and_tokenizer
    return generation.assistant_reply(model, tokenizer, QUESTION, LIMITS.max_tokens, temperature=0.0)


def make_app(
    model_and_tokenizer, wrap=None, slots=4, queue_limit=4, timeout=60.0, temperature=0.0, body_timeout=10.0, delay=0.0
):
    """The app over one CPU replica made as chat_web makes it; wrap(engine) stands in for its engine."""
    model, tokenizer = model_and_tokenizer
    replica = chat_web.replica(chat_web.make_engine(model, tokenizer, slots), model.config, tokenizer, "cpu")
    if delay > 0:
        replica.engine = Slowed(replica.engine, delay)
    if wrap is not None:
        replica.engine = wrap(replica.engine)
    pool = ReplicaPool([replica], queue_limit=queue_limit)
    settings = Settings(
        model_name="chat step 1 (mid)",
        temperature=temperature,
        top_k=0,
        request_timeout=timeout,
        body_timeout=body_timeout,
        limits=LIMITS,
    )
    return create_app(pool, settings), pool


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


async def chat(c: httpx.AsyncClient, body, **kwargs):
    """(status, headers, body chunks as text) of one POST /chat/completions."""
    if "content" not in kwargs:
        kwargs["json"] = body
    async with c.stream("POST", "/chat/completions", **kwargs) as r:
        return r.status_code, r.headers, [chunk async for chunk in r.aiter_text()]


def test_reply_streams_in_chunks_and_matches_the_model(model_and_tokenizer, reference):
    # a pause per token: a server that buffered the reply would write it in one piece
    app, pool = make_app(model_and_tokenizer, delay=0.01)
    body = json.dumps({"messages": QUESTION, "temperature": 0}).encode()
    status, chunks = asyncio.run(
        asgi_call(app, "POST", "/chat/completions", body, [(b"content-type", b"application/json")])
    )
    pool.close()
    assert status == 200
    events = sse_events(chunks)
    assert events[-1] == {"done": True} and all(set(e) == {"token"} for e in events[:-1])
    assert len(reference) >= 4 and "".join(e["token"] for e in events[:-1]) == reference
    assert len(chunks) >= 3, chunks  # streamed as generated, not sent at the end
    stats = pool.stats()
    assert stats["requests"]["completed"] == 1 and stats["replicas_busy"] == 0 and stats["tokens_generated"] >= 4
    assert stats["slots"]["in_use"] == 0 and stats["ttft_s"]["requests"] == 1 and stats["tokens_per_s"] > 0


def test_the_asgi_client_sees_the_event_stream(model_and_tokenizer, reference):
    app, pool = make_app(model_and_tokenizer)

    async def go():
        async with client(app) as c:
            return await chat(c, {"messages": QUESTION})  # the server's default temperature: 0 here

    status, headers, chunks = asyncio.run(go())
    pool.close()
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache"
    events = sse_events(chunks)
    assert events[-1] == {"done": True} and all(set(e) == {"token"} for e in events[:-1])
    assert "".join(e["token"] for e in events[:-1]) == reference


def conversation(n, content="hi"):
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": content} for i in range(n)]


INVALID = [  # (body, a piece of the one-line reason)
    (b"{", "Invalid JSON"),
    (b"[]", "body: Input should be an object"),
    ({}, "messages: Field required"),
    ({"messages": []}, "at least 1 item"),
    ({"messages": conversation(501)}, "at most 500 per request"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role: Input should be 'user' or 'assistant'"),
    ({"messages": [{"role": "user"}]}, "messages.0.content: Field required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content: Input should be a valid string"),
    ({"messages": [{"role": "user", "content": "a", "name": "x"}]}, "messages.0.name: Extra inputs are not permitted"),
    ({"messages": [{"role": "user", "content": "  "}]}, "must not be empty"),
    ({"messages": conversation(2) + [{"role": "assistant", "content": "x"}]}, "roles must alternate"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "message 0 must be from the user"),
    ({"messages": conversation(2)}, "the last message must be from the user"),
    ({"messages": [{"role": "user", "content": "x" * 8001}]}, "at most 8000 characters, got 8001"),
    ({"messages": conversation(5, "x" * 7000)}, "at most 32000 characters in all, got 35000"),
    ({"messages": QUESTION, "temperature": -0.1}, "temperature: Input should be greater than or equal to 0"),
    ({"messages": QUESTION, "temperature": 2.5}, "temperature: Input should be less than or equal to 2"),
    ({"messages": QUESTION, "temperature": "0.5"}, "temperature: Input should be a valid number"),
    ({"messages": QUESTION, "top_k": -1}, "top_k: Input should be greater than or equal to 0"),
    ({"messages": QUESTION, "top_k": 201}, "top_k: Input should be less than or equal to 200"),
    ({"messages": QUESTION, "top_k": 2.5}, "top_k: Input should be a valid integer"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
    ({"messages": QUESTION, "max_tokens": 65}, "max_tokens: at most 64 on this server"),
    ({"messages": QUESTION, "top-k": 5}, "top-k: Extra inputs are not permitted"),
]


def test_each_invalid_body_is_a_400_with_its_reason(model_and_tokenizer):
    app, pool = make_app(model_and_tokenizer)

    async def go():
        async with client(app) as c:
            out = []
            for body, _ in INVALID:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                out.append(
                    await c.post("/chat/completions", content=content, headers={"Content-Type": "application/json"})
                )
            return out

    responses = asyncio.run(go())
    pool.close()
    for (body, reason), r in zip(INVALID, responses):
        assert r.status_code == 400, (body, r.text)
        assert list(r.json()) == ["error"] and "\n" not in r.json()["error"]
        assert reason in r.json()["error"], (reason, r.json())
    assert pool.stats()["requests"] == dict.fromkeys(["completed", "cancelled", "timed_out", "failed", "rejected"], 0)


def test_body_size_content_type_paths_hosts_and_no_cors(model_and_tokenizer):
    app, pool = make_app(model_and_tokenizer)
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (LIMITS.max_body_bytes + 1)}]}).encode()

    async def chunked():  # no Content-Length: the cap must hold while the body streams in
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    async def go():
        async with client(app) as c:
            r = {
                "big": await c.post("/chat/completions", content=big, headers={"Content-Type": "application/json"}),
                "chunked": await c.post(
                    "/chat/completions", content=chunked(), headers={"Content-Type": "application/json"}
                ),
                "form": await c.post("/chat/completions", data={"messages": "hi"}),
                "evil host": await c.get("/health", headers={"Host": "attacker.example"}),
                "preflight": await c.options(
                    "/chat/completions",
                    headers={"Origin": "http://attacker.example", "Access-Control-Request-Method": "POST"},
                ),
                "health": await c.get("/health", headers={"Origin": "http://attacker.example"}),
                "stats": await c.get("/stats"),
                "page": await c.get("/"),
            }
            for path in ("/static/chat.js", "/static/chat.css", "/static/icon.svg"):
                r[path] = await c.get(path)
            for path in ("/nope", "/static/nope.js", "/static/", "/docs", "/openapi.json", "/static/index.html"):
                r["missing " + path] = await c.get(path)
            return r

    r = asyncio.run(go())
    assert "content-length" not in r["chunked"].request.headers
    for key in ("big", "chunked"):
        assert r[key].status_code == 413 and "larger than 163840 bytes" in r[key].json()["error"], key
    assert r["form"].status_code == 415 and "Content-Type: application/json" in r["form"].json()["error"]
    assert r["evil host"].status_code == 400  # a DNS-rebinding page cannot reach the loopback server
    assert r["preflight"].status_code == 405
    for resp in r.values():
        assert not any(h.startswith("access-control-") for h in resp.headers)
    assert r["health"].json()["status"] == "ok" and r["health"].json()["defaults"]["max_tokens"] == 64
    assert r["stats"].json()["queue_length"] == 0 and r["stats"].json()["replicas_busy"] == 0
    assert r["page"].status_code == 200 and "<textarea" in r["page"].text
    assert "default-src 'self'" in r["page"].headers["content-security-policy"]
    assert r["/static/chat.js"].headers["content-type"].startswith("text/javascript")
    assert r["/static/icon.svg"].headers["content-type"] == "image/svg+xml"
    for key, resp in r.items():
        if key.startswith("missing"):
            assert resp.status_code == 404 and resp.json() == {"error": "not found"}, key
    # paths as the client sent them, dot segments and encodings untouched (httpx would normalise them)
    for raw in (
        "/static/../app.py",
        "/../pool.py",
        "/static/..%2fapp.py",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/static/%2e%2e/replica_process.py",
        "/static//chat.js",
        "/static/./chat.js",
    ):
        assert asyncio.run(asgi_call(app, "GET", raw))[0] == 404, raw
    pool.close()


async def asgi_call(app, method: str, raw_path: str, body: bytes = b"", headers=(), leave: asyncio.Event = None):
    """(status, [body chunks]) of one request made straight through the ASGI interface: each chunk
    is one write the server made (httpx's ASGI client joins them), and the path reaches the app
    as sent, dot segments and encodings untouched (httpx normalises them). Setting `leave`
    disconnects the client."""
    from urllib.parse import unquote

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": unquote(raw_path),
        "raw_path": raw_path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    sent, finished, requested = [], asyncio.Event(), []

    async def receive():
        if not requested:
            requested.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        # the client stays connected until the response is complete, or until it leaves
        waits = [asyncio.ensure_future(e.wait()) for e in (finished, leave or asyncio.Event())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            finished.set()

    await app(scope, receive, send)
    return sent[0]["status"], [m["body"].decode() for m in sent[1:] if m.get("body")]


class Gated(Slowed):
    """An engine whose steps give nothing until `gate` is set (each waits up to 5 ms for it), so the
    worker still sees stops and admits requests between them; then it fails its first step if told."""

    def __init__(self, engine, gate: threading.Event, fail_once=False):
        super().__init__(engine, 0.0)
        self.gate, self.fail_once = gate, fail_once

    def step(self):
        if not self.gate.wait(0.005):
            return []
        if self.fail_once:
            self.fail_once = False
            raise RuntimeError("boom")
        return self.engine.step()


def gated(gate, **kwargs):
    return lambda engine: Gated(engine, gate, **kwargs)


async def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def slots_in_use(pool) -> int:
    return pool.stats()["slots"]["in_use"]


def test_queue_full_is_503_with_retry_after_and_queued_requests_complete(model_and_tokenizer, reference):
    # admission is every slot plus the queue: 2 slots generating and 1 request waiting, then 503
    gate = threading.Event()
    app, pool = make_app(model_and_tokenizer, wrap=gated(gate), slots=2, queue_limit=1)
    body = {"messages": QUESTION, "temperature": 0}

    async def go():
        async with client(app) as c:
            running = [asyncio.create_task(chat(c, body)) for _ in range(2)]
            await wait_for(lambda: slots_in_use(pool) == 2)
            queued = asyncio.create_task(chat(c, body))
            await wait_for(lambda: pool.stats()["queue_length"] == 1)
            refused = await c.post("/chat/completions", json=body)
            gate.set()
            return refused, *[await t for t in running], await queued

    refused, *served = asyncio.run(go())
    pool.close()
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert "server busy: all 2 slot(s) generating and 1 request(s) waiting" in refused.json()["error"]
    assert "\n" not in refused.json()["error"]
    for status, _, chunks in served:
        events = sse_events(chunks)
        assert status == 200 and events[-1] == {"done": True}
        assert "".join(e["token"] for e in events[:-1]) == reference
    assert pool.stats()["requests"] == {"completed": 3, "cancelled": 0, "timed_out": 0, "failed": 0, "rejected": 1}


QUESTIONS = [
    [{"role": "user", "content": f"what is {a} plus {b}?"}]
    for a, b in ((2, 3), (12, 7), (4, 4), (0, 9), (15, 15), (1, 20), (8, 3), (6, 11))
]


def test_eight_streams_are_decoded_together_in_one_engine(model_and_tokenizer):
    """8 requests held at the gate until all 8 hold a slot of the one replica: they are then decoded
    in the same steps, and each reply is the one its question gets decoded alone, greedily."""
    model, tokenizer = model_and_tokenizer
    alone = [generation.assistant_reply(model, tokenizer, q, LIMITS.max_tokens, temperature=0.0) for q in QUESTIONS]
    assert len(set(alone)) > 1
    gate = threading.Event()
    app, pool = make_app(model_and_tokenizer, wrap=gated(gate), slots=8, queue_limit=0)
    in_use = []

    async def go():
        async with client(app) as c:
            calls = [asyncio.create_task(chat(c, {"messages": q, "temperature": 0})) for q in QUESTIONS]
            await wait_for(lambda: slots_in_use(pool) == 8)
            gate.set()
            while not all(t.done() for t in calls):
                in_use.append(slots_in_use(pool))
                await asyncio.sleep(0.002)
            return [await t for t in calls]

    replies = asyncio.run(go())
    stats = pool.stats()
    pool.close()
    for (status, _, chunks), want in zip(replies, alone):
        events = sse_events(chunks)
        assert status == 200 and events[-1] == {"done": True}
        assert "".join(e["token"] for e in events[:-1]) == want
    assert max(in_use) > 1 and stats["slots"] == {
        "total": 8,
        "in_use": 0,
        "per_replica": [
            {
                "device": "cpu",
                "slots": 8,
                "in_use": 0,
                **{k: stats["slots"]["per_replica"][0][k] for k in ("tokens_generated", "tokens_per_s")},
            }
        ],
    }
    assert stats["requests"]["completed"] == 8 and stats["ttft_s"]["requests"] == 8
    assert 0 < stats["ttft_s"]["p50"] <= stats["ttft_s"]["p90"] <= stats["ttft_s"]["p99"]
    assert stats["tokens_generated"] >= sum(map(len, alone)) // 2 and stats["tokens_per_s"] > 0


def test_stats_decode_time_is_the_union_of_busy_replicas_and_ttft_is_nearest_rank():
    from nanochat_fast.web.pool import ServerStats, percentile

    stats = ServerStats(2)
    stats.started(0, 10.0, truncated=False)  # replica 0 busy 10..14, replica 1 busy 12..17:
    stats.started(1, 12.0, truncated=True)  # the server decoded for 7 s, not 4 + 5
    stats.stepped(0, 40, [0.5])
    stats.stepped(1, 30, [0.1, 0.2])
    stats.ended(0, "completed", 4.0, 14.0, busy=False)
    stats.ended(1, "cancelled", 5.0, 17.0, busy=False)
    s = stats.snapshot(20.0)
    assert s["decode_seconds"] == 7.0 and s["tokens_per_s"] == 10.0 and s["prompts_truncated"] == 1
    assert s["per_replica"] == [
        {"tokens_generated": 40, "tokens_per_s": 10.0},
        {"tokens_generated": 30, "tokens_per_s": 6.0},
    ]
    assert s["ttft_s"] == {"p50": 0.2, "p90": 0.5, "p99": 0.5, "requests": 3}
    assert s["requests"]["completed"] == 1 and s["requests"]["cancelled"] == 1 and stats.mean_reply_seconds() == 4.5
    assert [percentile(list(range(1, 101)), p) for p in (50, 90, 99)] == [50, 90, 99]
    stats.started(0, 30.0, truncated=False)  # busy now: the time so far counts
    assert stats.snapshot(32.5)["decode_seconds"] == 9.5


def test_a_conversation_longer_than_the_context_keeps_its_end_and_is_counted(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    long = [{"role": "user", "content": "what is 2 plus 3? " * 60}]  # ~ 500 tokens, the context is 256
    want = generation.assistant_reply(model, tokenizer, long, LIMITS.max_tokens, temperature=0.0)
    app, pool = make_app(model_and_tokenizer)

    async def go():
        async with client(app) as c:
            return await chat(c, {"messages": long}), await chat(c, {"messages": QUESTION})

    (status, _, chunks), _ = asyncio.run(go())
    pool.close()
    assert status == 200 and "".join(e.get("token", "") for e in sse_events(chunks)) == want
    assert pool.stats()["prompts_truncated"] == 1 and pool.stats()["requests"]["completed"] == 2


def test_a_client_that_leaves_while_queued_leaves_the_queue(model_and_tokenizer, reference):
    gate = threading.Event()
    app, pool = make_app(model_and_tokenizer, wrap=gated(gate), slots=1, queue_limit=1)
    body = json.dumps({"messages": QUESTION, "temperature": 0}).encode()
    headers = [(b"content-type", b"application/json")]

    async def go():
        leave = asyncio.Event()
        running = asyncio.create_task(asgi_call(app, "POST", "/chat/completions", body, headers))
        await wait_for(lambda: slots_in_use(pool) == 1)
        queued = asyncio.create_task(asgi_call(app, "POST", "/chat/completions", body, headers, leave=leave))
        await wait_for(lambda: pool.stats()["queue_length"] == 1)
        leave.set()
        await wait_for(lambda: pool.stats()["queue_length"] == 0)
        gate.set()
        return await running, await queued

    (status, chunks), (left_status, left_chunks) = asyncio.run(go())
    pool.close()
    assert status == 200 and "".join(e.get("token", "") for e in sse_events(chunks)) == reference
    assert left_status == 200 and left_chunks == []  # it left before its reply began
    assert pool.stats()["requests"]["cancelled"] == 1 and pool.stats()["requests"]["completed"] == 1


def test_request_timeout_ends_the_stream_and_frees_the_slot(model_and_tokenizer):
    gate = threading.Event()  # never set: the reply would never start
    app, pool = make_app(model_and_tokenizer, wrap=gated(gate), timeout=0.3)

    async def go():
        async with client(app) as c:
            started = time.monotonic()
            out = await chat(c, {"messages": QUESTION})
            return out, time.monotonic() - started

    (status, _, chunks), took = asyncio.run(go())
    events = sse_events(chunks)
    assert status == 200 and 0.3 <= took < 5
    assert "request timeout (0.3 s)" in events[0]["error"] and events[-1] == {"done": True}
    deadline = time.monotonic() + 5
    while slots_in_use(pool) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.stats()["replicas_busy"] == 0 and pool.stats()["requests"]["timed_out"] == 1
    pool.close()


def test_a_failing_step_ends_its_replies_with_an_error_and_the_replica_serves_on(
    model_and_tokenizer, reference, caplog
):
    gate = threading.Event()
    app, pool = make_app(model_and_tokenizer, wrap=gated(gate, fail_once=True))

    async def go():
        async with client(app) as c:
            calls = [asyncio.create_task(chat(c, {"messages": QUESTION})) for _ in range(3)]
            await wait_for(lambda: slots_in_use(pool) == 3)
            gate.set()  # the next step fails, with all 3 replies in it
            failed = [await t for t in calls]
            return failed, await chat(c, {"messages": QUESTION})

    failed, (s2, _, c2) = asyncio.run(go())
    pool.close()
    for status, _, chunks in failed:
        assert status == 200 and sse_events(chunks) == [
            {"error": "generation failed (RuntimeError); see the server log"},
            {"done": True},
        ]
    assert "".join(e.get("token", "") for e in sse_events(c2)) == reference
    stats = pool.stats()
    assert stats["requests"]["failed"] == 3 and stats["requests"]["completed"] == 1 and stats["slots"]["in_use"] == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "a decode step failed on cpu (RuntimeError: boom); 3 repl(ies) ended with an error"
    ]


# -- the command line -------------------------------------------------------------------------


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.run(chat_web.main, argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_missing_web_dependencies_is_one_line_saying_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)  # as if not installed
    code, err = run_main([], capsys)
    assert code == 2 and len(err) == 1
    assert "uvicorn is not installed" in err[0] and 'pip install -e ".[web]"' in err[0]


def test_bad_command_lines_exit_2_with_one_line(web_home, nanochat_home, monkeypatch, capsys):
    # nanochat_home: an empty home; a host that is not the loopback warns first, then the real error
    code, err = run_main(["--host=0.0.0.0"], capsys)
    assert code == 2 and len(err) == 2
    assert err[0].startswith("warning: --host 0.0.0.0 lets other machines reach this server")
    assert "no tokenizer" in err[1]
    for argv, reason in (
        (["--queue-size=-1"], "must be >= 0"),
        (["--request-timeout=0"], "must be > 0"),
        (["--workers=0"], "must be a positive integer"),
        (["--port=x"], "expected an integer"),
        (["--temperature=2.5"], "at most 2.0"),
        (["--top-k=201"], "at most 200"),
        (["--admission-gap-ms=-1"], "must be >= 0"),
        (["--admission-gap-ms=101"], "must be at most 100.0 (a burst waits 10x it)"),
    ):
        code, err = run_main(argv, capsys)
        assert code == 2 and len(err) == 1 and reason in err[0], (argv, err)
    for value in ("0", "-1", "nan", "inf"):
        code, err = run_main([f"--body-timeout={value}"], capsys)
        assert code == 2 and err == [f"error: --body-timeout must be > 0 seconds (and finite), got {float(value)}"], err
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(web_home))
    code, err = run_main(["--run=nope", "--port=0"], capsys)
    assert code == 2 and err == [f"error: no run named 'nope' (looked for {web_home}/runs/nope/checkpoints)"]
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, err = run_main([f"--port={port}", "--run=chat"], capsys)
    assert code == 2 and len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0]


def test_only_addresses_off_the_loopback_warn():
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert chat_web.remote_host_warning(host) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        assert chat_web.remote_host_warning(host).startswith(f"warning: --host {host} "), host


def test_closing_the_pool_stops_running_and_waiting_replies(model_and_tokenizer):
    gate = threading.Event()  # never set: replies wait until stopped
    app, pool = make_app(model_and_tokenizer, wrap=gated(gate), slots=1, queue_limit=1)
    body = json.dumps({"messages": QUESTION}).encode()
    headers = [(b"content-type", b"application/json")]

    async def go():
        calls = [asyncio.create_task(asgi_call(app, "POST", "/chat/completions", body, headers))]
        await wait_for(lambda: slots_in_use(pool) == 1)
        calls.append(asyncio.create_task(asgi_call(app, "POST", "/chat/completions", body, headers)))
        await wait_for(lambda: pool.stats()["queue_length"] == 1)
        pool.close()  # what the server's shutdown does
        return await asyncio.gather(*calls)

    (s1, running), (s2, waiting) = asyncio.run(go())
    assert s1 == s2 == 200
    assert sse_events(running) == [{"done": True}]  # stopped before its first token
    assert sse_events(waiting) == [{"error": "the server is shutting down"}, {"done": True}]
    assert pool.stats()["replicas_busy"] == 0 and pool.stats()["queue_length"] == 0


# -- temperatures too small to divide by ------------------------------------------------------

TINY_TEMPERATURES = (5e-324, 1e-45, 1e-40, 1e-38, 4.4e-38, 1e-20, 9.9e-7)  # all below MIN_TEMPERATURE: greedy


def test_the_temperature_floor_is_where_softmax_still_works():
    # the hazard: fp32 logits softcapped to +-15 over a temperature below 15 / 3.4e38 overflow to inf -> nan
    logits = torch.tensor([[15.0, -15.0, 3.0, -math.inf]])  # -inf: a token top-k left out
    assert torch.softmax(logits / 4.4e-38, dim=-1).isnan().all()
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.softmax(logits.to(dtype) / web_app.MIN_TEMPERATURE, dim=-1).isfinite().all()
        assert torch.softmax(logits.to(dtype) / web_app.MAX_TEMPERATURE, dim=-1).isfinite().all()
    assert batch_engine.MIN_TEMPERATURE == web_app.MIN_TEMPERATURE  # the library and the server agree
    rng = torch.Generator().manual_seed(0)
    for t in TINY_TEMPERATURES:  # a library caller of sample_next gets greedy too, not nan
        assert batch_engine.sample_next(logits, t, None, rng).tolist() == [[0]], t
        assert batch_engine.sample_next(logits, t, 2, rng).tolist() == [[0]], t
    assert batch_engine.sample_next(logits, web_app.MIN_TEMPERATURE, None, rng).tolist() == [[0]]


def test_tiny_temperatures_are_greedy_and_no_accepted_temperature_fails(model_and_tokenizer, reference, caplog):
    caplog.set_level(logging.INFO)
    for t in TINY_TEMPERATURES:
        assert (
            web_app.parse_request(json.dumps({"messages": QUESTION, "temperature": t}).encode(), LIMITS).temperature
            == 0.0
        ), t
    app, pool = make_app(model_and_tokenizer)
    accepted = TINY_TEMPERATURES + (web_app.MIN_TEMPERATURE, 1e-3, 0.7, web_app.MAX_TEMPERATURE)

    async def go():
        async with client(app) as c:
            replies = [await chat(c, {"messages": QUESTION, "temperature": t}) for t in accepted]
            refused = [
                await c.post("/chat/completions", json={"messages": QUESTION, "temperature": t})
                for t in (1e308, 2.0000001, -5e-324)
            ]
            return replies, refused

    replies, refused = asyncio.run(go())
    pool.close()
    for t, (status, _, chunks) in zip(accepted, replies):
        events = sse_events(chunks)
        assert status == 200 and events[-1] == {"done": True}, (t, events)
        assert all(set(e) == {"token"} for e in events[:-1]), (t, events)  # no error event
        if t < web_app.MIN_TEMPERATURE:
            assert "".join(e["token"] for e in events[:-1]) == reference, t
    assert [r.status_code for r in refused] == [400, 400, 400]
    assert pool.stats()["requests"]["failed"] == 0 and pool.stats()["requests"]["completed"] == len(accepted)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], caplog.text


def test_a_tiny_server_default_temperature_is_greedy(model_and_tokenizer, reference, caplog):
    app, pool = make_app(model_and_tokenizer, temperature=1e-40)  # chat_web --temperature=1e-40

    async def go():
        async with client(app) as c:
            return await chat(c, {"messages": QUESTION})

    status, _, chunks = asyncio.run(go())
    pool.close()
    events = sse_events(chunks)
    assert status == 200 and "".join(e["token"] for e in events[:-1]) == reference, events
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# -- uploads cut short or stalled, over a raw socket to a real uvicorn -------------------------

BODY_TIMEOUT = 0.5
POST = b"POST /chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture
def live_server(model_and_tokenizer):
    """The app on a free loopback port, served by uvicorn in a thread of this process (so caplog
    sees every log record, uvicorn's own included); yields (base url, pool)."""
    import uvicorn

    app, pool = make_app(model_and_tokenizer, body_timeout=BODY_TIMEOUT)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="info"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", pool
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def send_raw(url: str, data: bytes, then_close=True) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)
    s.sendall(data)
    if then_close:
        s.close()
    return s


def wait_for_record(caplog, text: str, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.01)


def our_records(caplog):
    return [r for r in caplog.records if r.name == "nanochat_fast.chat_web"]


def no_traceback(caplog):
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text
    assert "Traceback" not in caplog.text and "Exception in ASGI application" not in caplog.text, caplog.text


def serves_the_next_request(url, pool, reference):
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/chat/completions", json={"messages": QUESTION, "temperature": 0}) as r:
            status, chunks = r.status_code, list(r.iter_text())
        stats = c.get(url + "/stats").json()
    assert status == 200 and "".join(e.get("token", "") for e in sse_events(chunks)) == reference
    assert stats["replicas_busy"] == 0 and stats["queue_length"] == 0
    assert stats["requests"] == {"completed": 1, "cancelled": 0, "timed_out": 0, "failed": 0, "rejected": 0}


CUT_SHORT = [  # (what the client sends before it closes the connection, the log line)
    (POST + b"Content-Length: 100\r\n\r\n" + b'{"messages"', "client went away during its upload (11 of 100 bytes)"),
    (POST + b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"mes\r\n', "client went away during its upload (5 bytes)"),
    # a broken chunked body: uvicorn answers 400 and warns "Invalid HTTP request received." itself
    (POST + b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"mes\r\nZZ\r\n', "client went away during its upload (5 bytes)"),
]


@pytest.mark.parametrize("sent, line", CUT_SHORT, ids=["content-length", "chunked", "broken-chunked"])
def test_an_upload_cut_short_is_one_log_line_and_the_server_serves_on(live_server, reference, caplog, sent, line):
    caplog.set_level(logging.INFO)
    url, pool = live_server
    send_raw(url, sent)
    wait_for_record(caplog, "client went away")
    time.sleep(0.2)  # anything the server would log after its line has time to show
    assert [r.getMessage() for r in our_records(caplog)] == [line]
    no_traceback(caplog)
    serves_the_next_request(url, pool, reference)
    no_traceback(caplog)


def test_a_stalled_upload_is_a_408_after_the_body_timeout(live_server, reference, caplog):
    caplog.set_level(logging.INFO)
    url, pool = live_server
    started = time.monotonic()
    with send_raw(url, POST + b"Content-Length: 100\r\n\r\n" + b'{"messages"', then_close=False) as s:
        response = b""
        while chunk := s.recv(4096):  # the server closes the connection after its answer
            response += chunk
    took = time.monotonic() - started
    head, body = response.decode().split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 408 ") and "connection: close" in head.lower(), head
    assert json.loads(body) == {"error": f"the request body did not arrive within {BODY_TIMEOUT:g} s"}
    assert BODY_TIMEOUT <= took < BODY_TIMEOUT + 5, took
    assert [r.getMessage() for r in our_records(caplog)] == [
        f"request body not received within {BODY_TIMEOUT:g} s (11 of 100 bytes arrived): answered 408"
    ]
    no_traceback(caplog)
    serves_the_next_request(url, pool, reference)


def test_cpu_replicas_leave_a_core_to_the_server_unless_omp_num_threads_is_set():
    from nanochat_fast.core.threads import decide_threads

    assert chat_web.server_threads(decide_threads({}, cores=2, launcher_env={})) == 1
    assert chat_web.server_threads(decide_threads({}, cores=16, launcher_env={})) == 15
    assert chat_web.server_threads(decide_threads({}, cores=1, launcher_env={})) == 1
    assert chat_web.server_threads(decide_threads({"OMP_NUM_THREADS": "2"}, cores=2, launcher_env={})) == 2
    assert chat_web.server_threads(decide_threads({"OMP_NUM_THREADS": "1"}, cores=16, launcher_env={})) == 1
