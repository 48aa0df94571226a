"""A tiny but real pipeline for the training tests: a made-up prose corpus and conversations,
prepared with prepare_data --input, a 320-token tokenizer from tok_train, and the flags of a
~50k-parameter model. Nothing is downloaded."""

import errno
import json
import os
import random
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from support.repo_paths import ROOT, SUPPORT

# depth 2 -> n_embd 64 (aspect 32, head_dim 32 -> 2 heads); 4 rows of 64 tokens per micro-step
TINY_MODEL = ["--depth=2", "--aspect-ratio=32", "--head-dim=32", "--max-seq-len=64"]
# fp32 pinned: tests compare runs to 1e-4..1e-6 on every CPU, and CPUs with native bf16 would
# otherwise train in bf16 by default (the tests of the defaults leave FP32 out)
FP32 = ["--dtype=fp32", "--ns-dtype=fp32"]
DEFAULT_LOOP = ["--eval-tokens=512", "--sample-every=-1", "--warmdown-ratio=0.2"]
TINY_LOOP = DEFAULT_LOOP + FP32
# a short run without evaluation, 4 rows of 64 tokens a micro-step, 512 tokens a step (2 steps on 1 process)
TINY_STEPS = ["--eval-tokens=512", "--sample-every=-1", "--eval-every=-1", "--device-batch-size=4"]
TINY_STEPS += ["--total-batch-size=512"]
# mid_train run `m`, 2 steps from the base run `b`, in fp32
TINY_MID = ["--device-batch-size=4", "--total-batch-size=512", "--num-iterations=2", "--eval-every=-1"]
TINY_MID += ["--base-run=b", "--run=m", *FP32]
WORDS = {
    "adj": ["red", "small", "old", "quiet", "bright", "green"],
    "noun": ["cat", "dog", "king", "ship", "tree", "bird", "house"],
    "verb": ["sees", "finds", "follows", "paints", "likes"],
}


def sentence(rng: random.Random) -> str:
    w = {k: rng.choice(v) for k, v in WORDS.items()}
    return f"the {w['adj']} {w['noun']} {w['verb']} the {rng.choice(WORDS['noun'])}."


def write_corpus(folder: Path, n_docs=400, seed=0):
    """Prose with a simple grammar (learnable in a few dozen steps) and arithmetic chats."""
    rng = random.Random(seed)
    (folder / "prose").mkdir(parents=True)
    for i in range(4):
        docs = [" ".join(sentence(rng) for _ in range(rng.randint(3, 12))) for _ in range(n_docs // 4)]
        (folder / "prose" / f"part{i}.txt").write_text("\n\n".join(docs))
    (folder / "chat").mkdir()
    with open(folder / "chat" / "convs.jsonl", "w") as f:
        for _ in range(n_docs):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"what is {a} plus {b}?"},
                            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                        ]
                    }
                )
                + "\n"
            )


def private_home(home: Path, dst: Path, monkeypatch) -> Path:
    """A copy of `home` at `dst`, set as NANOCHAT_FAST_HOME for this test: a test that trains,
    damages or deletes in it leaves the shared home alone."""
    import shutil

    shutil.copytree(home, dst)
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(dst))
    return dst


@contextmanager
def home_env(home: Path):
    old = os.environ.get("NANOCHAT_FAST_HOME")
    os.environ["NANOCHAT_FAST_HOME"] = str(home)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("NANOCHAT_FAST_HOME", None)
        else:
            os.environ["NANOCHAT_FAST_HOME"] = old


@contextmanager
def disk_full_at(checkpoint_name: str):
    """While active, saving any file of checkpoint `checkpoint_name` (e.g. "step_000008") fails
    with ENOSPC, as on a full disk."""
    from nanochat_fast.checkpoints import checkpoint

    real_write = checkpoint.write_tensors

    def write_tensors(path, obj):
        if checkpoint_name in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, obj)

    checkpoint.write_tensors = write_tensors
    try:
        yield
    finally:
        checkpoint.write_tensors = real_write


def build_tiny_home(root: Path) -> Path:
    from nanochat_fast.scripts import prepare_data, tok_train

    src, home = root / "src", root / "home"
    write_corpus(src)
    with home_env(home):
        for name in ("prose", "chat"):
            dataset = "base" if name == "prose" else "chat"
            assert prepare_data.main([f"--input={src / name}", f"--name={dataset}", "--val-every=10"]) == 0
        assert tok_train.main(["--vocab-size=320"]) == 0
    return home


def home_with_base_run(tiny_home: Path, dst: Path, argv: list[str]) -> Path:
    """A copy of tiny_home at dst with one in-process base_train run (argv) made in it."""
    import shutil

    from nanochat_fast.scripts import base_train

    shutil.copytree(tiny_home, dst)
    with home_env(dst):
        assert base_train.main(argv) == 0
    return dst


def torchrun(nproc: int) -> list[str]:
    """The start of a command line that runs a script on nproc local processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run_script(name: str, args: list[str], home: Path, nproc: int = 1, timeout: int = 300, env=None, faults=()):
    """Run a script as a real process (under torchrun when nproc > 1); returns CompletedProcess.
    faults: options of faults.py (e.g. ["--preempt-at-step=5"]), which then runs the script."""
    target = ["-m", f"nanochat_fast.scripts.{name}"]
    if faults:
        target, args = [str(SUPPORT / "faults.py")], [*faults, name, *args]
    if nproc > 1:
        cmd = [*torchrun(nproc), *target, "--", *args]  # `--`: torchrun would take --run as its --run-path
    else:
        cmd = [sys.executable, *target, *args]
    full_env = {**os.environ, "NANOCHAT_FAST_HOME": str(home), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == "train"]


def last_model_state(run_dir: Path) -> dict:
    """The model weights of a run's newest complete checkpoint."""
    import torch

    from nanochat_fast import checkpoints

    return torch.load(checkpoints.complete_checkpoints(run_dir)[-1] / "model.pt", weights_only=True)
