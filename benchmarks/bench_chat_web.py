"""chat_web latency and throughput: time to first token and tokens/s for 1 and 8 concurrent
streaming clients, the 8 decoded together in one replica's batch engine.

Two loads through a real `chat_web` process on 127.0.0.1 (one replica of 8 slots), measured by the
client (httpx, streaming), in interleaved rounds, medians over rounds:
- long replies: a demo-sized model (depth 4) with random weights writes greedy replies of
  MAX_TOKENS tokens to one question, beside the same reply generated in this process with no server
  around it, alone and 8 together in one BatchEngine. Targets: 8 clients' tok/s total >= 6x one
  client's, TTFT median <= 0.5 s, each client at <= 2x one client's per-token latency;
- short replies: the demo's fine-tuned model (`make demo`'s run demo_sft) answers 8 different short
  prompts (greedy, at most SHORT_MAX_TOKENS), alone one after another and all 8 at once: requests
  that join and leave the batch all the time. Target: the 8 clients' per-token latency <= 2x one
  client's, TTFT median <= 0.5 s.
The set-up and each figure's definition: docs/measurements.md#benchmark-chat-serving.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests"))  # the support package
from harness import MIN_ROUNDS  # noqa: E402
from support.chat_web_support import chat_web_process, load_chat_model, random_model, save_chat_checkpoint  # noqa: E402

MAX_TOKENS = 128
QUESTION = [{"role": "user", "content": "Why is the sky blue? Explain it to me in a few sentences."}]
ROUNDS = MIN_ROUNDS  # each round decodes 1 + 8 + 1 + 8 replies: about 5 s on 2 busy cores
SFT_RUN = "demo_sft"  # make demo's fine-tuned model
SHORT_MAX_TOKENS = 48
SHORT_PROMPTS = [
    "Hi! How are you today?",
    "What is 3 plus 4?",
    "What color is the sky?",
    "Tell me a joke.",
    "What is the capital of France?",
    "Name a fruit.",
    "Can you help me?",
    "Good morning!",
]


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


def rate(stamps: list[float]) -> float | None:
    """Text pieces per second after the first (a piece is a token, or the few that end a character);
    None where no time between pieces was seen: a reply of one piece, or one whose pieces all came
    in one chunk (each piece is stamped with its chunk's arrival)."""
    span = stamps[-1] - stamps[0] if stamps else 0.0
    return (len(stamps) - 1) / span if span > 0 else None


async def one_client(c: httpx.AsyncClient, url: str, messages: list, max_tokens: int) -> tuple:
    """(ttft, tokens/s after the first, token events) of one streamed reply. The body is read as raw
    chunks and token events counted in them (each stamped with its chunk's arrival), not parsed
    line by line: the clients share this machine's cores with the server, and parsing 8 streams'
    lines in Python would take CPU time the server's replica then lacks."""
    marker = b'data: {"token"'
    start = time.perf_counter()
    stamps, tail = [], b""
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens}
    async with c.stream("POST", url + "/chat/completions", json=body) as r:
        assert r.status_code == 200, r.status_code
        async for chunk in r.aiter_raw():
            seen = tail + chunk  # an event split between chunks is counted once, in the chunk that ends it
            stamps += [time.perf_counter()] * seen.count(marker)
            tail = seen[-(len(marker) - 1) :]
    return stamps[0] - start, rate(stamps), len(stamps)


def through_server(url: str, conversations: list, max_tokens: int, together: bool = True) -> dict:
    """Every conversation's reply streamed, all at once (one client each) or one after another."""

    async def round_():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=len(conversations))) as c:
            if together:
                return await asyncio.gather(*(one_client(c, url, m, max_tokens) for m in conversations))
            return [await one_client(c, url, m, max_tokens) for m in conversations]

    before = httpx.get(url + "/stats").json()["tokens_generated"]
    start = time.perf_counter()
    results = asyncio.run(round_())
    wall = time.perf_counter() - start
    tokens = httpx.get(url + "/stats").json()["tokens_generated"] - before
    return {
        "ttft": [r[0] for r in results],
        "rate": [r[1] for r in results],
        "tokens": tokens,
        "wall": wall,
        "events": [r[2] for r in results],
    }


def interleaved(benchmark, variants: dict) -> dict:
    """Each variant once per round, in an order that rotates from round to round; the samples of
    the timed rounds (the warmup round is dropped)."""
    names = list(variants)
    samples = {name: [] for name in names}
    counter = {"round": 0}

    def one_round():
        r = counter["round"]
        counter["round"] += 1
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(variants[name]())

    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    return {name: runs[1:] for name, runs in samples.items()}


def summary(samples: dict) -> tuple[list, dict]:
    """The table's rows and, per variant, its TTFT median, per-token latencies and total tok/s."""
    rows, figures = [], {}
    for name, runs in samples.items():
        ttft = [t for s in runs for t in s["ttft"]]
        rates = [x for s in runs for x in s["rate"] if x is not None]
        total = statistics.median(s["tokens"] / s["wall"] for s in runs)
        figures[name] = {"ttft": statistics.median(ttft), "per_token": [1 / x for x in rates], "total": total}
        rows.append(
            [
                name,
                f"{statistics.median(ttft) * 1e3:.1f}",
                f"{max(ttft) * 1e3:.1f}",
                f"{statistics.median(rates):.1f}",
                f"{1e3 / statistics.median(rates):.2f}",
                f"{total:.1f}",
                str(runs[-1]["tokens"]),
            ]
        )
    return rows, figures


COLUMNS = [
    "variant",
    "TTFT median (ms)",
    "TTFT max (ms)",
    "tok/s per client (median)",
    "ms/token per client (median)",
    "tok/s total",
    "tokens per round",
]


def latency_targets(one: dict, eight: dict, min_total_ratio: float | None) -> list:
    """[figure, measured, target, met] rows: tok/s total 8 clients / 1 (a target when given), TTFT
    median, and every one of the 8 clients' per-token latency against one client's median."""
    single = statistics.median(one["per_token"])
    worst, typical = max(eight["per_token"]) / single, statistics.median(eight["per_token"]) / single
    ratio = eight["total"] / one["total"]
    rows = [
        ["tok/s total, 8 clients / 1 client", f"{ratio:.2f}x"]
        + ([f">= {min_total_ratio:g}x", ratio >= min_total_ratio] if min_total_ratio else ["-", None]),
        ["TTFT median, 8-client rounds", f"{eight['ttft']:.3f} s", "<= 0.5 s", eight["ttft"] <= 0.5],
        [
            "per-token latency, each of 8 clients / 1 client",
            f"{worst:.2f}x worst, {typical:.2f}x median",
            "<= 2x",
            worst <= 2,
        ],
    ]
    return [[f, m, t, "-" if ok is None else "yes" if ok else "no"] for f, m, t, ok in rows]


def server_setup(server) -> str:
    """How the server runs its replica, read from its banner: torch threads, and which process steps it."""
    threads = int(re.search(r"(\d+) thread\(s\)", server.banner).group(1))
    where = "a process of its own" if "process of its own" in server.banner else "the server's process"
    return f"{threads} torch thread(s) in the replica, stepped in {where}"


def test_chat_web_latency(benchmark, demo_home):
    model, tokenizer = load_chat_model(demo_home, "demo_random")
    threads = torch.get_num_threads()
    conversations = [QUESTION]
    # the server as deployed: its own thread choice (on a CPU one core fewer than the machine's)
    with chat_web_process(
        demo_home, ["--run=demo_random", f"--max-new-tokens={MAX_TOKENS}", "--queue-size=16"], threads=None
    ) as server:
        samples = interleaved(
            benchmark,
            {
                "direct (no server)": lambda: direct(model, tokenizer),
                "direct, 8 together in one engine (no server)": lambda: direct_together(model, tokenizer),
                "chat_web, 1 client": lambda: through_server(server.url, conversations, MAX_TOKENS),
                "chat_web, 8 concurrent clients": lambda: through_server(server.url, conversations * 8, MAX_TOKENS),
            },
        )
    rows, figures = summary(samples)
    targets = latency_targets(figures["chat_web, 1 client"], figures["chat_web, 8 concurrent clients"], 6)
    cfg = model.config
    benchmark.extra_info["table"] = {
        "title": "chat_web: time to first token and tokens/s (cpu, 1 replica of 8 slots)",
        "columns": COLUMNS,
        "rows": rows,
        "targets": targets,
        "notes": f"depth-{cfg.n_layer} model (n_embd {cfg.n_embd}, vocab {cfg.vocab_size}, {cfg.sequence_len} "
        f"positions), random weights; greedy replies of up to {MAX_TOKENS} tokens to a "
        f"{len(tokenizer.render_for_completion({'messages': QUESTION}))}-token prompt; {threads} torch "
        f"thread(s) in the direct baseline; {server_setup(server)} (the server's defaults: the event loop "
        f"keeps a core); {ROUNDS} interleaved rounds, medians. "
        "The 8 clients are decoded together, one row each of the replica's batch engine.",
    }
    print(json.dumps(benchmark.extra_info["table"], indent=1))


def test_chat_web_short_replies(benchmark):
    """The demo's fine-tuned model, 8 different short prompts: replies that end after a few tokens,
    so requests join and leave the batch all the time."""
    if not (paths.runs_dir() / SFT_RUN).is_dir():
        pytest.skip(f"needs the demo's fine-tuned model ({paths.runs_dir() / SFT_RUN}): run `make demo`")
    conversations = [[{"role": "user", "content": p}] for p in SHORT_PROMPTS]
    args = [f"--run={SFT_RUN}", f"--max-new-tokens={SHORT_MAX_TOKENS}", "--queue-size=16"]
    with chat_web_process(paths.home(), args, threads=None) as server:
        samples = interleaved(
            benchmark,
            {
                "chat_web, 1 client (the 8 prompts one after another)": lambda: through_server(
                    server.url, conversations, SHORT_MAX_TOKENS, together=False
                ),
                "chat_web, 8 concurrent clients (one prompt each)": lambda: through_server(
                    server.url, conversations, SHORT_MAX_TOKENS
                ),
            },
        )
    rows, figures = summary(samples)
    one, eight = figures.values()
    events = sorted(n for s in samples["chat_web, 8 concurrent clients (one prompt each)"] for n in s["events"])
    model, _ = load_chat_model(paths.home(), SFT_RUN)
    cfg = model.config
    benchmark.extra_info["table"] = {
        "title": "chat_web, short replies from the demo's fine-tuned model (cpu, 1 replica of 8 slots)",
        "columns": COLUMNS,
        "rows": rows,
        "targets": latency_targets(one, eight, None),
        "notes": f"run {SFT_RUN} (`make demo`: depth {cfg.n_layer}, n_embd {cfg.n_embd}, vocab {cfg.vocab_size}); "
        f"{len(SHORT_PROMPTS)} different short prompts, greedy, max_tokens {SHORT_MAX_TOKENS}; replies of "
        f"{events[0]}-{events[-1]} token events; {server_setup(server)}; "
        f"{ROUNDS} interleaved rounds, medians. Per-token latency: a client's time between token events after "
        "its first; 1 client's figure is the median over the 8 prompts sent one after another.",
    }
    print(json.dumps(benchmark.extra_info["table"], indent=1))
