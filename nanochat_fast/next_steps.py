"""
The command to run next, printed at the end of each step of the pipeline.

Every printed command works exactly as printed (python_tests/test_newcomer.py runs them): it names
the dataset or run just made, and a training command is sized for this machine (on a machine
without a GPU: a depth-4 model for about one pass over the data, as `make demo` trains; with a GPU:
nanochat's defaults).

    prepare_data   -> tok_train --dataset=NAME       (no tokenizer yet)
                   -> base_train / mid_train ...     (a tokenizer exists: the data is tokenized too)
    tok_train      -> base_train --dataset=NAME ...
    base_train     -> base_eval --run=RUN
    mid_train      -> chat_cli --run=RUN
"""
import math
import shlex
from pathlib import Path

import torch

from . import paths

# a model and batch a 2-core CPU trains in minutes (make demo's): depth 4, 256-token rows, 8K-token steps
CPU_RUN = ["--depth=4", "--max-seq-len=256", "--device-batch-size=16", "--total-batch-size=8192",
           "--eval-tokens=32768"]
CPU_BATCH_TOKENS, CPU_MAX_STEPS = 8192, 200


def command(script: str, *flags: str) -> str:
    return " ".join(["python -m", f"nanochat_fast.scripts.{script}", *map(shlex.quote, flags)])


def show(cmd: str):
    """One line, `next: ` and the command: copy everything after the colon."""
    print(f"next: {cmd}", flush=True)


def dataset_flag(name: str) -> list[str]:
    return [] if name in ("base", "chat") else [f"--dataset={name}"]


def run_flag(run_dir: Path) -> str:
    """--run=NAME for a run under NANOCHAT_FAST_HOME/runs, --run=PATH for one elsewhere."""
    run_dir = Path(run_dir)
    inside = run_dir.resolve().parent == paths.runs_dir().resolve()
    return f"--run={run_dir.name if inside else run_dir}"


def train_tokenizer(name: str) -> str:
    return command("tok_train", *dataset_flag(name))


def pretrain(name: str, n_tokens: int) -> str:
    """base_train on dataset `name` of about n_tokens tokens, sized for this machine."""
    if torch.cuda.is_available():
        return command("base_train", *dataset_flag(name))
    steps = min(CPU_MAX_STEPS, max(1, math.ceil(n_tokens / CPU_BATCH_TOKENS)))
    return command("base_train", *dataset_flag(name), *CPU_RUN, f"--num-iterations={steps}")


def midtrain(name: str) -> str:
    sizing = [] if torch.cuda.is_available() else ["--device-batch-size=16", "--total-batch-size=8192"]
    return command("mid_train", *dataset_flag(name), *sizing)


def after_tokens(name: str, kind: str, n_tokens: int):
    """What to do with a dataset once it is tokenized."""
    from .dataset import TEXT
    show(pretrain(name, n_tokens) if kind == TEXT else midtrain(name))
