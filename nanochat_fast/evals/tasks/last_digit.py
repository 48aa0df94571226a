"""
LastDigit: a synthetic task with GSM8K's interface (a question, a reply ending in "#### N", the same
answer extraction), small enough for a tiny model on a CPU. "Digits: 4 7 2. Which comes last?" is
answered "#### 2". GSM8K is far beyond a model of a few million parameters; this task is what shows
that chat_rl learns on a machine without a GPU (python_tests/test_chat_rl.py): after a few steps of
SFT a tiny model writes "#### d" with a mostly wrong d, and on-policy RL alone teaches it which d.

Its examples are made, not prepared: every list of DIGITS digits, in a fixed shuffled order; the
first TEST_SIZE are the test split (held out: never trained on), the rest the train split.
"""

import itertools
import random

from .gsm8k import extract_answer
from .task_types import GenerativeTask

DIGITS = 3
TEST_SIZE = 200


class LastDigit(GenerativeTask):
    name, folder = "last-digit", ""
    train_splits = ("train",)
    chance = 0.1  # a digit guessed at random

    def load(self, split: str | None = None, max_examples: int | None = None, shuffle: bool = True) -> list[dict]:
        """The examples of `split` (test: the held-out lists; train: the others), in their fixed
        order (shuffle is accepted for the interface: the order is shuffled already)."""
        split = split or self.eval_split
        if split not in ("train", "test"):
            raise ValueError(f"{self.name} has the splits train and test, not {split!r}")
        lists = list(itertools.product(range(10), repeat=DIGITS))
        random.Random(self.shuffle_seed).shuffle(lists)
        chosen = lists[:TEST_SIZE] if split == "test" else lists[TEST_SIZE:]
        examples = [
            {
                "id": f"{self.name}-{split}-{i}",
                "question": f"Digits: {' '.join(map(str, d))}. Which comes last?",
                "answer": d[-1],
            }
            for i, d in enumerate(chosen)
        ]
        return examples[:max_examples] if max_examples is not None else examples

    def conversation(self, example: dict) -> dict:
        return {
            "messages": [
                {"role": "user", "content": example["question"]},
                {"role": "assistant", "content": f"#### {example['answer']}"},
            ]
        }

    def check(self, example: dict, completion: str) -> bool:
        return extract_answer(completion) == str(example["answer"])
