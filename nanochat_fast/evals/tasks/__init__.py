"""
Evaluation tasks over the prepared data (data/eval/, see evals/prepared_benchmarks.py), one module per family:

    chat tasks (chat_eval, and training data for chat_sft): ARC-Easy and ARC-Challenge (arc.py) and
        MMLU (mmlu.py), categorical; GSM8K (gsm8k.py) and SpellingBee (spellingbee.py), generative
        with the calculator; HumanEval (humaneval.py), generative, run in the sandbox
    synthetic (made, not prepared; chat_rl's proof of learning on a CPU; chat_eval --task takes it):
        last-digit (last_digit.py), generative, "#### N" like GSM8K
    base-model tasks (base_eval): the CORE subset (core_benchmark.py), few-shot likelihood of each choice

    task = tasks.get("arc-easy")               # nanochat's names, any case
    examples = task.load(max_examples=100)     # the evaluated split, shuffled with a fixed seed
    task.conversation(examples[0])             # {"messages": [...]}: SFT data and the eval prompt
    task.check(examples[0], "A")               # is this reply right?
    tasks.get("hellaswag_zeroshot").items()    # CORE items ({query, choices, gold} ...)
"""

from ...core.errors import UserError
from .arc import ARC
from .core_benchmark import CORE_SUBSET, SUBSET_NAME, CoreTask
from .gsm8k import GSM8K, extract_answer
from .humaneval import HumanEval
from .last_digit import LastDigit
from .mmlu import MMLU
from .spellingbee import SpellingBee
from .task_types import (
    CATEGORICAL,
    GENERATIVE,
    LIKELIHOOD,
    ChatTask,
    GenerativeTask,
    MultipleChoiceTask,
    Task,
    render_mc,
)

CHAT_TASKS = [ARC("ARC-Easy"), ARC("ARC-Challenge"), MMLU(), GSM8K(), HumanEval(), SpellingBee()]
CHAT_TASK_NAMES = [t.name for t in CHAT_TASKS]
CORE_TASK_NAMES = [t.name for t in CORE_SUBSET]
SYNTHETIC_TASKS = [LastDigit()]
# what chat_rl trains on: generative tasks whose reply ends in "#### N" (a reward of 0 or 1)
RL_TASK_NAMES = ["GSM8K", "SpellingBee", LastDigit.name]
_BY_NAME = {t.name.lower(): t for t in CHAT_TASKS + SYNTHETIC_TASKS + CORE_SUBSET}


def get(name: str) -> Task:
    """The task named `name`: nanochat's chat task names (ARC-Easy, ARC-Challenge, MMLU, GSM8K,
    HumanEval, SpellingBee), a synthetic task (last-digit) or a CORE label (hellaswag_zeroshot,
    arc_easy, ...), any case."""
    task = _BY_NAME.get(name.strip().lower())
    if task is None:
        raise UserError(
            f"unknown task {name!r}; chat tasks: {', '.join(CHAT_TASK_NAMES)}; synthetic: "
            f"{', '.join(t.name for t in SYNTHETIC_TASKS)}; CORE subset: {', '.join(CORE_TASK_NAMES)}"
        )
    return task


def parse_names(spec: str, default: list[str]) -> list[Task]:
    """The tasks of a --task value: comma-separated names, or "all" for `default`."""
    names = [n for n in (p.strip() for p in spec.split(",")) if n]
    if not names:
        raise UserError("--task is empty; give task names (comma-separated) or all")
    if [n.lower() for n in names] == ["all"]:
        names = default
    return [get(n) for n in names]


__all__ = [
    "ARC",
    "CATEGORICAL",
    "CHAT_TASKS",
    "CHAT_TASK_NAMES",
    "CORE_SUBSET",
    "CORE_TASK_NAMES",
    "ChatTask",
    "CoreTask",
    "GENERATIVE",
    "GSM8K",
    "GenerativeTask",
    "HumanEval",
    "LIKELIHOOD",
    "LastDigit",
    "MMLU",
    "MultipleChoiceTask",
    "RL_TASK_NAMES",
    "SUBSET_NAME",
    "SYNTHETIC_TASKS",
    "SpellingBee",
    "Task",
    "extract_answer",
    "get",
    "parse_names",
    "render_mc",
]
