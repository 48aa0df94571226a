"""
A subset of CORE, the base-model benchmark of the DCLM paper (Li et al. 2024, arXiv:2406.11794)
that nanochat reports: the 10 of its 22 tasks whose data we have offline, each with DCLM's number
of few-shot examples, continuation delimiter, task type and random baseline (CORE_SUBSET, one row
per task). Its average is therefore "CORE subset (10/22 tasks)", not CORE, and is not comparable to
published CORE scores. A multiple-choice item is one prompt per choice, a schema item (Winogrande)
one prompt per way of filling the blank; scoring.core_counts picks the one whose scored part has
the lowest mean loss. The tasks left out, and the prompts and scoring in full:
docs/measurements.md#core-subset.
"""

import random

from .task_types import LIKELIHOOD, Task

MULTIPLE_CHOICE, SCHEMA = "multiple_choice", "schema"


def _arc_item(ex):
    return {"query": f"Question: {ex['question']}", "choices": ex["choices"], "gold": ex["answer"]}


def _plain_item(ex):
    return {"query": ex["question"], "choices": ex["choices"], "gold": ex["answer"]}


def _copa_item(ex):
    # "The man turned on the faucet, therefore" + " water flowed from the spout."
    connective = "because" if ex["relation"] == "cause" else "therefore"
    choices = [c[:1].lower() + c[1:] for c in ex["choices"]]
    return {"query": f"{ex['question'].rstrip('.')}, {connective}", "choices": choices, "gold": ex["answer"]}


def _boolq_item(ex):
    return {
        "query": f"Passage: {ex['passage']}\nQuestion: {ex['question']}?",
        "choices": ex["choices"],
        "gold": ex["answer"],
    }


def _winogrande_item(ex):
    # "Sarah was a much better surgeon than Maria so _ always got the easier cases."
    # -> contexts "... so Sarah" / "... so Maria", continuation "always got the easier cases."
    blank = ex["question"].index("_")
    before, after = ex["question"][:blank], ex["question"][blank + 1 :]
    return {
        "context_options": [before + option for option in ex["choices"]],
        "continuation": after.strip(),
        "gold": ex["answer"],
    }


class CoreTask(Task):
    kind = LIKELIHOOD
    shuffle_seed = 1337  # as nanochat's CORE evaluation, so --max-examples picks the same kind of subset

    def __init__(self, label, folder, split, num_fewshot, delimiter, task_type, chance, to_item):
        self.name, self.folder, self.eval_split = label, folder, split
        self.num_fewshot, self.delimiter, self.task_type, self.chance = num_fewshot, delimiter, task_type, chance
        self.to_item = to_item

    def items(self, max_examples: int | None = None) -> list[dict]:
        """The CORE items ({query, choices, gold} or {context_options, continuation, gold}) of the
        evaluated split, shuffled, at most max_examples."""
        return [self.to_item(ex) for ex in self.load(max_examples=max_examples)]

    def fewshot(self, items: list[dict], index: int) -> list[dict]:
        """num_fewshot other items for item `index`, drawn with a seed per index (so every process
        of a distributed run draws the same ones)."""
        if self.num_fewshot == 0:
            return []
        others = [i for i in range(len(items)) if i != index]
        chosen = random.Random(1234 + index).sample(others, min(self.num_fewshot, len(others)))
        return [items[i] for i in chosen]

    def prompts(self, item: dict, fewshot: list[dict]) -> list[str]:
        """One full prompt per choice, few-shot examples first (each with its right answer),
        separated by blank lines."""
        d = self.delimiter
        if self.task_type == SCHEMA:
            shots = "".join(f"{s['context_options'][s['gold']]}{d}{s['continuation']}\n\n" for s in fewshot)
            return [f"{shots}{context}{d}{item['continuation']}" for context in item["context_options"]]
        shots = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}\n\n" for s in fewshot)
        return [f"{shots}{item['query']}{d}{choice}" for choice in item["choices"]]


CORE_SUBSET = [
    CoreTask("hellaswag_zeroshot", "hellaswag", "validation", 0, " ", MULTIPLE_CHOICE, 0.25, _plain_item),
    CoreTask("arc_easy", "arc-easy", "test", 10, "\nAnswer: ", MULTIPLE_CHOICE, 0.25, _arc_item),
    CoreTask("arc_challenge", "arc-challenge", "test", 10, "\nAnswer: ", MULTIPLE_CHOICE, 0.25, _arc_item),
    CoreTask("copa", "copa", "validation", 0, " ", MULTIPLE_CHOICE, 0.50, _copa_item),
    CoreTask("commonsense_qa", "commonsenseqa", "validation", 10, " ", MULTIPLE_CHOICE, 0.20, _plain_item),
    CoreTask("piqa", "piqa", "validation", 10, "\nAnswer: ", MULTIPLE_CHOICE, 0.50, _arc_item),
    CoreTask("openbook_qa", "openbookqa", "validation", 0, " ", MULTIPLE_CHOICE, 0.25, _plain_item),
    CoreTask("hellaswag", "hellaswag", "validation", 10, " ", MULTIPLE_CHOICE, 0.25, _plain_item),
    CoreTask("winogrande", "winogrande", "validation", 0, " ", SCHEMA, 0.50, _winogrande_item),
    CoreTask("boolq", "boolq", "validation", 10, "\nAnswer: ", MULTIPLE_CHOICE, 0.62, _boolq_item),
]
CORE_TOTAL_TASKS = 22  # in DCLM's CORE
SUBSET_NAME = f"CORE subset ({len(CORE_SUBSET)}/{CORE_TOTAL_TASKS} tasks)"
