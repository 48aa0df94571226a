"""chat_web latency: time to first token and tokens/s for 1 and 8 concurrent streaming clients.

The model is demo-sized (depth 4: n_embd 256, 2 heads; 512 positions; the vocabulary of the
tokenizer under NANOCHAT_FAST_HOME, 8192 in the prepared home) with random weights written by the
package's checkpoint writer: serving speed does not depend on what the weights say. Greedy replies
of up to MAX_TOKENS tokens to one question, through a real `chat_web` process on 127.0.0.1 with one
replica, measured by the client (httpx, streaming). The baseline is the same reply generated in this
process by generation.assistant_reply with no server around it. Variants run in interleaved rounds
(each round: direct, 1 client, 8 clients, in rotating order); medians over rounds.

  TTFT         request sent -> first token event received (direct: call -> first text piece)
  tok/s/client one client's token events after its first / the time from its first to its last
  tok/s total  every token of the round (server's /stats count) / the round's wall time

    .venv/bin/python -m pytest benchmarks/bench_chat_web.py -o python_files='bench_*.py' --benchmark-json=/tmp/web.json
"""
import asyncio
import json
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
from nanochat_fast.model.gpt import config_from_depth  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests"))
from chat_web_support import chat_web_process, load_chat_model, random_model, save_chat_checkpoint  # noqa: E402
from harness import MIN_ROUNDS  # noqa: E402

MAX_TOKENS = 128
QUESTION = [{"role": "user", "content": "Why is the sky blue? Explain it to me in a few sentences."}]
ROUNDS = MIN_ROUNDS  # each round serves 1 + 1 + 8 replies: about 25 s on 2 busy cores


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
        generation.assistant_reply(model, tokenizer, QUESTION, MAX_TOKENS, temperature=0.0,
                                   on_text=lambda piece: pieces.append(time.perf_counter()),
                                   should_stop=lambda: tokens.append(1) and False)
    worker = threading.Thread(target=generate)
    start = time.perf_counter()
    worker.start()
    worker.join()
    return {"ttft": [pieces[0] - start], "rate": [rate(pieces)], "tokens": len(tokens),
            "wall": time.perf_counter() - start}


def rate(stamps: list[float]) -> float:
    """Text pieces per second after the first (a piece is a token, or the few that end a character)."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def one_client(c: httpx.AsyncClient, url: str) -> tuple[float, float, int]:
    """(ttft, tokens/s after the first, token events) of one streamed reply."""
    start = time.perf_counter()
    stamps = []
    async with c.stream("POST", url + "/chat/completions",
                        json={"messages": QUESTION, "temperature": 0, "max_tokens": MAX_TOKENS}) as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            if line.startswith('data: {"token"'):
                stamps.append(time.perf_counter())
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
    with chat_web_process(demo_home, ["--run=demo_random", f"--max-new-tokens={MAX_TOKENS}", "--queue-size=16"],
                          threads=threads) as server:
        variants = {"direct (no server)": lambda: direct(model, tokenizer),
                    "chat_web, 1 client": lambda: through_server(server.url, 1),
                    "chat_web, 8 concurrent clients": lambda: through_server(server.url, 8)}
        names = list(variants)
        samples = {name: [] for name in names}
        counter = {"round": 0}

        def one_round():
            r = counter["round"]
            counter["round"] += 1
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples[name].append(variants[name]())

        benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    rows = []
    for name in names:
        runs = samples[name][1:]  # the warmup round is recorded too
        ttft = [t for s in runs for t in s["ttft"]]
        rate = [x for s in runs for x in s["rate"]]
        total = statistics.median(s["tokens"] / s["wall"] for s in runs)
        rows.append([name, f"{statistics.median(ttft) * 1e3:.1f}", f"{max(ttft) * 1e3:.1f}",
                     f"{statistics.median(rate):.1f}", f"{total:.1f}", str(runs[-1]["tokens"])])
    cfg = model.config
    benchmark.extra_info["table"] = {
        "title": "chat_web: time to first token and tokens/s (cpu, 1 replica)",
        "columns": ["variant", "TTFT median (ms)", "TTFT max (ms)", "tok/s per client (median)", "tok/s total",
                    "tokens per round"],
        "rows": rows,
        "notes": f"depth-{cfg.n_layer} model (n_embd {cfg.n_embd}, vocab {cfg.vocab_size}, {cfg.sequence_len} "
                 f"positions), random weights; greedy replies of up to {MAX_TOKENS} tokens to a "
                 f"{len(tokenizer.render_for_completion({'messages': QUESTION}))}-token prompt; {threads} torch "
                 f"thread(s) in the server and in the direct baseline; {ROUNDS} interleaved rounds, medians. "
                 "With one replica, 8 clients are served one after another: TTFT max is the 8th client's wait."}
    print(json.dumps(benchmark.extra_info["table"], indent=1))
