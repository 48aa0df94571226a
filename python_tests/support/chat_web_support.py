"""What the chat_web tests and its benchmark share: small models saved as chat checkpoints by the
package's own checkpoint writer (random weights to time serving; a few seconds of training for
replies that read as replies), a real chat_web process on a free port of 127.0.0.1, and a reader
for its server-sent events."""

import collections
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from support.repo_paths import ROOT, SUPPORT


def random_model(config, seed: int = 0):
    """A GPT with nanochat's init and its zero-initialised output projections filled in too (else
    every logit is equal): as fast as a trained model of its shape, its replies are noise."""
    from nanochat_fast.model import loading

    torch.manual_seed(seed)
    model = loading.new_model(config, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight" or name.endswith("c_proj.weight"):
                p.normal_(0.0, p.size(1) ** -0.5)
    return model


def arithmetic_chat_model(tokenizer, config, steps: int = 120, seed: int = 0):
    """A GPT taught, in a few seconds, the shape of the tiny corpus' chats ("what is 2 plus 3?" ->
    "2 plus 3 is 5."), loss on the assistant's tokens only: its replies read as replies (for the page
    and its screenshot); their arithmetic is mostly wrong."""
    from nanochat_fast.model import loading

    rng = random.Random(seed)
    chats = []
    for _ in range(400):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        chats.append(
            tokenizer.render_conversation(
                {
                    "messages": [
                        {"role": "user", "content": f"what is {a} plus {b}?"},
                        {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                    ]
                }
            )
        )
    width = max(len(ids) for ids, _ in chats)
    rows = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in chats])
    masks = torch.tensor([mask + [0] * (width - len(mask)) for _, mask in chats], dtype=torch.bool)
    torch.manual_seed(seed)
    model = loading.new_model(config, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this narrow gains nothing from a second thread, and a busy machine makes it wait
    try:
        for _ in range(steps):
            pick = torch.randint(0, len(rows), (32,))
            targets = rows[pick, 1:].masked_fill(~masks[pick, 1:], -1)
            loss = model(rows[pick, :-1], targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def save_chat_checkpoint(home: Path, run: str, model, step: int = 1) -> Path:
    """runs/<run>/checkpoints/step_<step> under `home`, written by the package's checkpoint writer
    as a "mid" checkpoint made with home's tokenizer, as training would leave it."""
    from nanochat_fast import checkpoints
    from nanochat_fast.data.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(home / "tokenizer")
    meta = {
        "phase": "mid",
        "model_config": asdict(model.config),
        "tokenizer": {"vocab_size": tokenizer.get_vocab_size(), "fingerprint": tokenizer.fingerprint},
    }
    return checkpoints.save_checkpoint(
        home / "runs" / run, step, model_state=model.state_dict(), rank_state={}, meta=meta
    )


# the tests' chat model: the tiny corpus' tokenizer, 2 layers of width 64, 256 positions (replies up to 128 tokens)
CHAT_MODEL = dict(sequence_len=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
_chat_homes = {}


def chat_home(tiny_home: Path) -> Path:
    """A copy of tiny_home with the arithmetic chat model saved as run "chat", built once per test
    run (every chat_web test module asks for it)."""
    if tiny_home not in _chat_homes:
        import shutil

        from nanochat_fast.data.tokenizer import get_tokenizer
        from nanochat_fast.model.gpt import GPTConfig

        home = tiny_home.parent / "chat_web_home"
        shutil.copytree(tiny_home, home)
        tokenizer = get_tokenizer(home / "tokenizer")
        model = arithmetic_chat_model(tokenizer, GPTConfig(vocab_size=tokenizer.get_vocab_size(), **CHAT_MODEL))
        save_chat_checkpoint(home, "chat", model)
        _chat_homes[tiny_home] = home
    return _chat_homes[tiny_home]


def load_chat_model(home: Path, run: str = "chat"):
    """(model, tokenizer) of a run, loaded the way chat_web loads it: the reference replies come from these."""
    from nanochat_fast.data.tokenizer import get_tokenizer
    from nanochat_fast.model import loading

    tokenizer = get_tokenizer(home / "tokenizer")
    model, _, _ = loading.load_model(home / "runs" / run, None, "cpu", tokenizer)
    return model, tokenizer


class Server:
    def __init__(self, process: subprocess.Popen, url: str, banner: str, log: collections.deque):
        self.process, self.url, self.banner, self.log = process, url, banner, log

    def rss_bytes(self) -> int:
        """Resident memory of the server process and all its descendants (a replica's own process
        among them), from Linux /proc."""
        total, pids = 0, [self.process.pid]
        while pids:
            proc = Path(f"/proc/{pids.pop()}")
            lines = [line for line in (proc / "status").read_text().splitlines() if line.startswith("VmRSS:")]
            total += int(lines[0].split()[1]) * 1024
            pids += [int(pid) for task in (proc / "task").iterdir() for pid in (task / "children").read_text().split()]
        return total


@contextmanager
def chat_web_process(
    home: Path, args: list[str], timeout: float = 120.0, threads: int | None = 1, token_delay: float | None = None
):
    """A real `python -m nanochat_fast.scripts.chat_web --port=0 ...` on 127.0.0.1; yields a Server
    once it answers /health, and stops it (SIGTERM, then SIGKILL) afterwards. Its output is read
    all along (an unread pipe would fill with access-log lines and stall the server); the last
    lines are kept in Server.log. threads: OMP_NUM_THREADS of the server (None: unset, chat_web's
    own choice). token_delay: seconds before every engine step (slow_chat_web.py: a slow model)."""
    import httpx

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(
        NANOCHAT_FAST_HOME=str(home), PYTHONUNBUFFERED="1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})
    )
    script = (
        ["-m", "nanochat_fast.scripts.chat_web"]
        if token_delay is None
        else [str(SUPPORT / "slow_chat_web.py"), f"--token-delay={token_delay}", "--"]
    )
    cmd = [sys.executable, *script, "--host=127.0.0.1", "--port=0", *args]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    log, lines = collections.deque(maxlen=200), queue.Queue()

    def drain():
        for line in process.stdout:
            log.append(line)
            lines.put(line)
        lines.put(None)  # the process closed its output: it has ended

    threading.Thread(target=drain, daemon=True).start()
    try:
        banner, deadline = None, time.monotonic() + timeout
        while banner is None:  # the banner line carries the port that --port=0 got
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError("chat_web did not start:\n" + "".join(log))
            if line.startswith("chat_web:"):
                banner = line.strip()
        url = banner.rsplit("open ", 1)[1].rstrip("/")
        while httpx.get(url + "/health").status_code != 200:
            time.sleep(0.05)
        yield Server(process, url, banner, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def sse_events(chunks) -> list[dict]:
    """The `data:` events of a server-sent event stream given as its body's text chunks."""
    text = "".join(chunks)
    assert text.endswith("\n\n"), text[-200:]
    return [
        json.loads(line[len("data: ") :])
        for block in text.split("\n\n")
        if block
        for line in block.split("\n")
        if line.startswith("data: ")
    ]
