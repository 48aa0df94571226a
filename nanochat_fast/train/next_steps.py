"""
The command to run next, printed at the end of each step of the pipeline (prepare_data -> tok_train
-> base_train -> base_eval; mid_train -> chat_sft -> chat_eval or chat_cli; chat_rl -> chat_eval ->
report), and resume_command, which continues a stopped run. Each works as printed, naming the dataset
or run just made, sized for this machine (without a GPU: a depth-4 model, about one pass, as `make demo`).
"""

import math
import os
import shlex
import sys
from pathlib import Path

import torch

from ..core import paths

# a model and batch a 2-core CPU trains in minutes (make demo's): depth 4, 256-token rows, 8K-token steps
CPU_RUN = ["--depth=4", "--max-seq-len=256", "--device-batch-size=16", "--total-batch-size=8192", "--eval-tokens=32768"]
CPU_BATCH_TOKENS, CPU_MAX_STEPS = 8192, 200
CPU_EVAL_EXAMPLES = 100  # per task, for chat_eval on a machine without a GPU


def command(script: str, *flags: str) -> str:
    return " ".join(["python -m", f"nanochat_fast.scripts.{script}", *map(shlex.quote, flags)])


def show(cmd: str):
    """One line, `next: ` and the command: copy everything after the colon."""
    print(f"next: {cmd}", flush=True)


def dataset_flag(name: str) -> list[str]:
    return [] if name in ("base", "chat") else [f"--dataset={name}"]


def run_flag(run_dir: Path, flag: str = "--run") -> str:
    """--run=NAME for a run under NANOCHAT_FAST_HOME/runs, --run=PATH for one elsewhere."""
    run_dir = Path(run_dir)
    inside = run_dir.resolve().parent == paths.runs_dir().resolve()
    return f"{flag}={run_dir.name if inside else run_dir}"


def resume_command(argv, run_dir: Path) -> str:
    """The command that, with --resume auto appended, resumes this run: this one's flags without
    --resume/--overwrite, plus --out-dir when only a --resume PATH named the run."""
    args, kept = iter(sys.argv[1:] if argv is None else argv), []
    for a in args:
        name = a.split("=")[0].replace("_", "-")
        if name == "--resume" and "=" not in a:
            next(args, None)  # its value
        elif name not in ("--resume", "--overwrite"):
            kept.append(a)
    if not any(a.split("=")[0].replace("_", "-") in ("--run", "--out-dir") for a in kept):
        kept.append(f"--out-dir={run_dir}")
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    module = main_spec.name if main_spec else f"nanochat_fast.scripts.{Path(sys.argv[0]).stem}"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # `--` keeps torchrun from reading --run as an abbreviation of its --run-path
        return " ".join([f"torchrun --nproc_per_node={world} -m", module, "--", *map(shlex.quote, kept)])
    return " ".join(["python -m", module, *map(shlex.quote, kept)])


def train_tokenizer(name: str) -> str:
    return command("tok_train", *dataset_flag(name))


def after_tokens(name: str, kind: str, n_tokens: int):
    """What follows prepared tokens: pretraining on prose, mid-training on conversations."""
    from ..data.documents import TEXT

    gpu = torch.cuda.is_available()
    if kind != TEXT:
        sizing = [] if gpu else ["--device-batch-size=16", "--total-batch-size=8192"]
        show(command("mid_train", *dataset_flag(name), *sizing))
    elif gpu:
        show(command("base_train", *dataset_flag(name)))
    else:
        steps = min(CPU_MAX_STEPS, max(1, math.ceil(n_tokens / CPU_BATCH_TOKENS)))
        show(command("base_train", *dataset_flag(name), *CPU_RUN, f"--num-iterations={steps}"))


def after_midtraining(run_dir: Path) -> str:
    """chat_sft from this mid run, its --extra-conversations mixed in again (without a conversation
    dataset they are what it trains on)."""
    from ..checkpoints import complete_checkpoints, load_meta

    found = complete_checkpoints(run_dir)
    extra = load_meta(found[-1])["args"].get("extra_conversations") if found else None
    return command(
        "chat_sft", run_flag(run_dir, "--source-run"), *([f"--extra-conversations={extra}"] if extra else [])
    )


def chat_eval(run_dir: Path, *flags: str) -> str:
    """chat_eval of this run (a sample per task without a GPU)."""
    sizing = [] if torch.cuda.is_available() else [f"--max-examples={CPU_EVAL_EXAMPLES}"]
    return command("chat_eval", run_flag(run_dir), *flags, *sizing)


def after_sft(run_dir: Path) -> str:
    """chat_eval of this run where evaluation data is prepared, else a chat with it."""
    from ..evals.prepared_benchmarks import read_task_manifest
    from ..evals.tasks import CHAT_TASKS

    if not any(read_task_manifest(task.folder) for task in CHAT_TASKS):
        return command("chat_cli", run_flag(run_dir))
    return chat_eval(run_dir)


def after_rl(run_dir: Path, task: str) -> str:
    return chat_eval(run_dir, f"--task={task}")


def after_chat_eval() -> str:
    return command("report")
