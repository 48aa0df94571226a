"""chat_web latency and throughput: time to first token and tokens/s for 1 and 8 concurrent
streaming clients, the 8 decoded together in one replica's batch engine.

A demo-sized model (depth 4) with random weights behind a real `chat_web` process on 127.0.0.1 (one
replica of 8 slots), greedy replies measured by the client (httpx, streaming), against the same
reply generated in this process with no server around it, alone and 8 together in one BatchEngine.
Variants run in interleaved rounds; medians over rounds. Targets, from the same run: 8 clients' tok/s
total >= 4x one client's; the 8-client rounds' TTFT median <= 0.5 s; every client of the 8-client
rounds at <= 2x one client's per-token latency. The set-up and each figure's definition:
docs/measurements.md#benchmark-chat-serving.

    .venv/bin/python -m pytest benchmarks/bench_chat_web.py -o python_files='bench_*.py' --benchmark-json=/tmp/web.json
"""

import asyncio
import json
import re
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi", reason="chat_web needs the web extra: pip install -e '.[web]'")
import httpx  # noqa: E402

from nanochat_fast.core import paths  # noqa: E402
from nanochat_fast.data.tokenizer import RANKS_FILE, get_tokenizer  # noqa: E402
from nanochat_fast.model import generation  # noqa: E402
from nanochat_fast.model.batch_engine import BatchEngine, Request  # noqa: E402
from nanochat_fast.model.gpt import config_from_depth  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests" / "support"))
from chat_web_support import chat_web_process, load_chat_model, random_model, save_chat_checkpoint  # noqa: E402
from harness import MIN_ROUNDS  # noqa: E402

MAX_TOKENS = 128
QUESTION = [{"role": "user", "content": "Why is the sky blue? Explain it to me in a few sentences."}]
ROUNDS = MIN_ROUNDS  # each round decodes 1 + 8 + 1 + 8 replies: about 5 s on 2 busy cores


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory):
    """A home with NANOCHAT_FAST_HOME's tokenizer and the random-weight model as run demo_random."""
    if not (paths.tokenizer_dir() / RANKS_FILE).is_file():
        pytest.skip(f"needs a tokenizer in {paths.tokenizer_dir()}: run `make demo` (or prepare_data + tok_train)")
    home = tmp_path_factory.mktemp("web_bench") / "home"
    shutil.copytree(paths.tokenizer_dir(), home / "tokenizer")
    vocab = get_tokenizer(home / "tokenizer").get_vocab_size()
    save_chat_checkpoint(home, "demo_random", random_model(config_from_depth(4, vocab, 512)))
    return home


def direct(model, tokenizer) -> dict:
    """One reply generated in this process, in a worker thread as the server's replicas run it (on a
    busy machine a worker thread and the main thread can differ several-fold in speed)."""
    pieces, tokens = [], []

    def generate():
        generation.assistant_reply(
            model,
            tokenizer,
            QUESTION,
            MAX_TOKENS,
            temperature=0.0,
            on_text=lambda piece: pieces.append(time.perf_counter()),
            should_stop=lambda: tokens.append(1) and False,
        )

    worker = threading.Thread(target=generate)
    start = time.perf_counter()
    worker.start()
    worker.join()
    return {
        "ttft": [pieces[0] - start],
        "rate": [rate(pieces)],
        "tokens": len(tokens),
        "wall": time.perf_counter() - start,
    }


def direct_together(model, tokenizer, rows: int = 8) -> dict:
    """`rows` replies to the question decoded together in one engine in this process (a worker
    thread), no server, timed per token: the engine's own scaling, the ceiling of what the server's 8
    clients get."""
    prompt = tokenizer.render_for_completion({"messages": QUESTION})
    stamps = {}

    def generate():
        engine = BatchEngine(model, tokenizer, slots=rows, max_len=model.config.sequence_len)
        for _ in range(rows):
            engine.add(Request(prompt, MAX_TOKENS))
        while engine.active:
            tokens = engine.step()
            now = time.perf_counter()
            for t in tokens:
                stamps.setdefault(id(t.row), []).append(now)

    worker = threading.Thread(target=generate)
    start = time.perf_counter()
    worker.start()
    worker.join()
    return {
        "ttft": [s[0] - start for s in stamps.values()],
        "rate": [rate(s) for s in stamps.values()],
        "tokens": sum(map(len, stamps.values())),
        "wall": time.perf_counter() - start,
    }


def rate(stamps: list[float]) -> float:
    """Text pieces per second after the first (a piece is a token, or the few that end a character)."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def one_client(c: httpx.AsyncClient, url: str) -> tuple[float, float, int]:
    """(ttft, tokens/s after the first, token events) of one streamed reply. The body is read as raw
    chunks and token events counted in them (each stamped with its chunk's arrival), not parsed
    line by line: the clients share this machine's cores with the server, and parsing 8 streams'
    lines in Python would take CPU time the server's replica then lacks."""
    marker = b'data: {"token"'
    start = time.perf_counter()
    stamps, tail = [], b""
    async with c.stream(
        "POST", url + "/chat/completions", json={"messages": QUESTION, "temperature": 0, "max_tokens": MAX_TOKENS}
    ) as r:
        assert r.status_code == 200, r.status_code
        async for chunk in r.aiter_raw():
            seen = tail + chunk  # an event split between chunks is counted once, in the chunk that ends it
            stamps += [time.perf_counter()] * seen.count(marker)
            tail = seen[-(len(marker) - 1) :]
    return stamps[0] - start, rate(stamps), len(stamps)


def through_server(url: str, clients: int) -> dict:
    async def round_():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients)) as c:
            return await asyncio.gather(*(one_client(c, url) for _ in range(clients)))

    before = httpx.get(url + "/stats").json()["tokens_generated"]
    start = time.perf_counter()
    results = asyncio.run(round_())
    wall = time.perf_counter() - start
    tokens = httpx.get(url + "/stats").json()["tokens_generated"] - before
    return {"ttft": [r[0] for r in results], "rate": [r[1] for r in results], "tokens": tokens, "wall": wall}


def test_chat_web_latency(benchmark, demo_home):
    model, tokenizer = load_chat_model(demo_home, "demo_random")
    threads = torch.get_num_threads()
    # the server as deployed: its own thread choice (on a CPU one core fewer than the machine's)
    with chat_web_process(
        demo_home, ["--run=demo_random", f"--max-new-tokens={MAX_TOKENS}", "--queue-size=16"], threads=None
    ) as server:
        server_threads = int(re.search(r"(\d+) thread\(s\)", server.banner).group(1))
        variants = {
            "direct (no server)": lambda: direct(model, tokenizer),
            "direct, 8 together in one engine (no server)": lambda: direct_together(model, tokenizer),
            "chat_web, 1 client": lambda: through_server(server.url, 1),
            "chat_web, 8 concurrent clients": lambda: through_server(server.url, 8),
        }
        names = list(variants)
        samples = {name: [] for name in names}
        counter = {"round": 0}

        def one_round():
            r = counter["round"]
            counter["round"] += 1
            for name in names[r % len(names) :] + names[: r % len(names)]:
                samples[name].append(variants[name]())

        benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    rows, figures = [], {}
    for name in names:
        runs = samples[name][1:]  # the warmup round is recorded too
        ttft = [t for s in runs for t in s["ttft"]]
        rate = [x for s in runs for x in s["rate"]]
        total = statistics.median(s["tokens"] / s["wall"] for s in runs)
        figures[name] = {"ttft": statistics.median(ttft), "per_token": [1 / x for x in rate], "total": total}
        rows.append(
            [
                name,
                f"{statistics.median(ttft) * 1e3:.1f}",
                f"{max(ttft) * 1e3:.1f}",
                f"{statistics.median(rate):.1f}",
                f"{1e3 / statistics.median(rate):.2f}",
                f"{total:.1f}",
                str(runs[-1]["tokens"]),
            ]
        )
    one, eight = figures["chat_web, 1 client"], figures["chat_web, 8 concurrent clients"]
    single = statistics.median(one["per_token"])
    worst, typical = max(eight["per_token"]) / single, statistics.median(eight["per_token"]) / single
    targets = [  # figure, measured, target, met
        [
            "tok/s total, 8 clients / 1 client",
            f"{eight['total'] / one['total']:.2f}x",
            ">= 4x",
            eight["total"] / one["total"] >= 4,
        ],
        ["TTFT median, 8-client rounds", f"{eight['ttft']:.3f} s", "<= 0.5 s", eight["ttft"] <= 0.5],
        [
            "per-token latency, each of 8 clients / 1 client",
            f"{worst:.2f}x worst, {typical:.2f}x median",
            "<= 2x",
            worst <= 2,
        ],
    ]
    cfg = model.config
    benchmark.extra_info["table"] = {
        "title": "chat_web: time to first token and tokens/s (cpu, 1 replica of 8 slots)",
        "columns": [
            "variant",
            "TTFT median (ms)",
            "TTFT max (ms)",
            "tok/s per client (median)",
            "ms/token per client (median)",
            "tok/s total",
            "tokens per round",
        ],
        "rows": rows,
        "targets": [[f, m, t, "yes" if ok else "no"] for f, m, t, ok in targets],
        "notes": f"depth-{cfg.n_layer} model (n_embd {cfg.n_embd}, vocab {cfg.vocab_size}, {cfg.sequence_len} "
        f"positions), random weights; greedy replies of up to {MAX_TOKENS} tokens to a "
        f"{len(tokenizer.render_for_completion({'messages': QUESTION}))}-token prompt; {threads} torch "
        f"thread(s) in the direct baseline, {server_threads} in the server (its default: the event loop "
        f"keeps a core); {ROUNDS} interleaved rounds, medians. "
        "The 8 clients are decoded together, one row each of the replica's batch engine.",
    }
    print(json.dumps(benchmark.extra_info["table"], indent=1))
