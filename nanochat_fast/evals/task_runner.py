"""
The tasks evaluated with any number of processes, the file of results the report card reads
(runs/<run>/evals.json), and validation bits per byte: every evaluation (chat_eval, base_eval, the
training loop's) goes through here. Each rank scores every world_size-th example (scoring.shard) or its
own batches, and the sums are added over ranks, so N processes count exactly what one process counts.
"""

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core import paths
from ..core.distributed import all_reduce_sum
from ..core.progress import progress_bar
from . import scoring
from .tasks import CATEGORICAL

RESULTS_FILE = "evals.json"
FORMAT_VERSION = 1


@dataclass
class TaskResult:
    """A task's counts over every rank, and what they mean."""

    task: str
    kind: str
    split: str
    correct: int
    total: int
    chance: float
    seconds: float
    settings: dict = field(default_factory=dict)  # max_examples, num_samples, ... as run
    truncated: int = 0  # prompts longer than the context, cut to their end

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")

    @property
    def interval(self) -> tuple[float, float]:
        return scoring.wilson_interval(self.correct, self.total)

    def as_dict(self) -> dict:
        return {**asdict(self), "accuracy": self.accuracy, "interval_95": list(self.interval)}

    def line(self) -> str:
        lo, hi = self.interval
        return (
            f"{self.task}: {100 * self.accuracy:.2f}% ({self.correct}/{self.total} {self.split}) | chance "
            f"{100 * self.chance:.0f}% | 95% interval {100 * lo:.1f}%-{100 * hi:.1f}% | {self.seconds:.1f} s"
            + (f" | {truncated_note(self.truncated, self.total)}" if self.truncated else "")
        )


def truncated_note(truncated: int, total: int) -> str:
    return f"{truncated:,} of {total:,} prompts longer than the context were truncated (their end kept)"


def examples_bar(total: int, desc: str, enabled: bool):
    """A task's progress in examples, shown only when enabled and stderr is a terminal."""
    return progress_bar(
        total=total, desc=desc, unit="example", leave=False, disable=not (enabled and sys.stderr.isatty())
    )


def summed(counts: scoring.Counts, device) -> tuple[int, int, int]:
    """[correct, total, truncated] over every rank."""
    both = torch.tensor([counts.correct, counts.total, counts.truncated], dtype=torch.long, device=device)
    return tuple(int(x) for x in all_reduce_sum(both))


def chat_task(
    model, tokenizer, task, examples, rank=0, world_size=1, batch_size=8, progress=False, settings=None, **sampling
) -> TaskResult:
    """`task` on `examples` (the same list on every rank): categorical tasks in batches of batch_size
    prompts, generative ones by sampling (`sampling`: generative_counts' num_samples, max_new_tokens, ...)."""
    mine = [examples[i] for i in scoring.shard(len(examples), rank, world_size)]
    start, counts = time.time(), scoring.Counts()
    with examples_bar(len(mine), task.name, progress and rank == 0) as bar:
        if task.kind == CATEGORICAL:  # the whole shard at once: batches of similar lengths
            counts = scoring.categorical_counts(model, tokenizer, task, mine, batch_size, on_batch=bar.update)
        else:
            for ex in mine:
                counts += scoring.generative_counts(model, tokenizer, task, [ex], **sampling)
                bar.update(1)
    correct, total, truncated = summed(counts, model.get_device())
    seconds = time.time() - start
    return TaskResult(
        task.name, task.kind, task.eval_split, correct, total, task.chance, seconds, settings or {}, truncated
    )


def evaluate_pass_at_k(
    model,
    tokenizer,
    task,
    examples: list[dict],
    rank: int = 0,
    world_size: int = 1,
    num_samples: int = 1,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 42,
) -> dict:
    """{"pass@k": value} for k = 1..num_samples: each question's unbiased pass@k, averaged over every rank's."""
    mine = [examples[i] for i in scoring.shard(len(examples), rank, world_size)]
    counts = scoring.generative_counts(
        model, tokenizer, task, mine, num_samples, max_new_tokens, temperature, top_k, seed
    )
    ks = range(1, num_samples + 1)
    sums = torch.zeros(num_samples + 1, dtype=torch.float64)  # pass@1..n summed, then the questions
    for record in counts.records:
        right = record["samples_right"]
        sums += torch.tensor([scoring.pass_at_k(num_samples, right, k) for k in ks] + [1.0], dtype=torch.float64)
    sums = all_reduce_sum(sums.to(model.get_device())).tolist()
    return {f"pass@{k}": sums[k - 1] / sums[-1] for k in ks}


def core_subset(
    model, tokenizer, core_tasks, max_examples=None, rank=0, world_size=1, batch_size=16, progress=False, on_task=None
) -> dict:
    """Each CORE task's accuracy (every rank loads the items and scores its shard), then
    scoring.core_summary. on_task(label, counts) is called as each task finishes; counts holds
    correct, total, split, shots, seconds, truncated, accuracy and centred."""
    accuracies, chances, counts = {}, {}, {}
    for task in core_tasks:
        start = time.time()
        items = task.items(max_examples)
        mine = scoring.shard(len(items), rank, world_size)
        with examples_bar(len(mine), task.name, progress and rank == 0) as bar:
            local = scoring.core_counts(
                model, tokenizer, task, items, indices=mine, batch_size=batch_size, on_batch=bar.update
            )
        correct, total, truncated = summed(local, model.get_device())
        accuracies[task.name], chances[task.name] = correct / total, task.chance
        counts[task.name] = {
            "correct": correct,
            "total": total,
            "split": task.eval_split,
            "shots": task.num_fewshot,
            "seconds": time.time() - start,
            "truncated": truncated,
        }
        if on_task is not None:
            centred = scoring.centered(accuracies[task.name], task.chance)
            on_task(task.name, dict(counts[task.name], accuracy=accuracies[task.name], centred=centred))
    return {**scoring.core_summary(accuracies, chances), "chance": chances, "counts": counts}


def read_records(run_dir) -> dict:
    """The evaluations recorded for a run: {"format", "steps": {"<step>": {script: {...}}}}."""
    data = paths.read_json_or_none(Path(run_dir) / RESULTS_FILE)
    if isinstance(data, dict) and data.get("format") == FORMAT_VERSION:
        return data
    return {"format": FORMAT_VERSION, "steps": {}}


def record(run_dir, step: int, script: str, results: dict) -> Path:
    """Merge `results` ({name: value}) into the run's evals.json under this step and script, atomically."""
    data = read_records(run_dir)
    data["steps"].setdefault(str(step), {}).setdefault(script, {}).update(results)
    path = Path(run_dir) / RESULTS_FILE
    paths.write_durably(path, lambda f: f.write((json.dumps(data, indent=2) + "\n").encode()))
    return path


def evaluate_bpb(model, batches, token_bytes: torch.Tensor, autocast_ctx) -> float:
    """Bits per byte over (x, y) batches: summed next-token loss in nats over the target tokens' UTF-8 bytes
    (special tokens: 0; targets -1 excluded), over all ranks; unlike nats per token, it compares tokenizers."""
    return evaluate_bpb_each(model, batches, [token_bytes], autocast_ctx)[0]


@torch.no_grad()
def evaluate_bpb_each(model, batches, tables: list[torch.Tensor], autocast_ctx) -> list[float]:
    """evaluate_bpb for several byte-length tables in one pass over the batches (an imported run
    whose nanochat token_bytes.pt was computed the old way reports both figures)."""
    sums = torch.zeros(len(tables), 2, dtype=torch.float64, device=tables[0].device)  # (nats, bytes) per table
    for x, y in batches:
        with autocast_ctx:
            loss = model(x, y, loss_reduction="none").view(-1).double()
        y = y.view(-1)
        valid = y >= 0
        for k, token_bytes in enumerate(tables):
            nbytes = torch.where(valid, token_bytes[y.clamp(min=0)], 0)
            sums[k, 0] += (loss * (nbytes > 0)).sum()
            sums[k, 1] += nbytes.sum()
    sums = all_reduce_sum(sums)
    return [(n / (math.log(2) * b)).item() if b > 0 else float("nan") for n, b in sums]
