"""
What every task has: a name (nanochat's), the folder of its prepared data (data/eval/<folder>/),
how it is scored and the accuracy of guessing, and its examples.

Kinds of evaluation:
    categorical  the chat model's logits for the answer letters after <|assistant_start|> are
                 compared; the largest is its answer (ARC, MMLU)
    generative   the chat model writes an answer, which is checked (GSM8K: the number after ####;
                 HumanEval: the program is run against the tests; SpellingBee: the count)
    likelihood   the base model's few-shot log-likelihood of each choice as a continuation; the
                 most likely (lowest mean loss per token) is its answer (the CORE subset)
"""

import random

from ..prepared_benchmarks import load_split

CATEGORICAL, GENERATIVE, LIKELIHOOD = "categorical", "generative", "likelihood"
ANSWER_LETTERS = "ABCDEFGHIJ"  # the letters of multiple-choice answers, in choice order


class Task:
    name = ""  # nanochat's name, e.g. "ARC-Easy"
    folder = ""  # data/eval/<folder>/
    kind = ""  # CATEGORICAL, GENERATIVE or LIKELIHOOD
    chance = 0.0  # accuracy of guessing
    eval_split = "test"
    train_splits = ()  # splits that may be trained on (never the one evaluated)
    shuffle_seed = 42  # examples are shuffled so that --max-examples takes a random subset

    def load(self, split: str | None = None, max_examples: int | None = None, shuffle: bool = True) -> list[dict]:
        """Examples of `split` (default: the evaluated one), in a fixed shuffled order unless
        shuffle=False (file order), at most max_examples of them."""
        examples = load_split(self.folder, split or self.eval_split)
        if shuffle:
            random.Random(self.shuffle_seed).shuffle(examples)
        return examples[:max_examples] if max_examples is not None else examples

    def __repr__(self):
        return f"<{type(self).__name__} {self.name} ({self.kind}, chance {self.chance:.0%})>"

    def __str__(self):
        return self.name  # as a flag's value (chat_rl --task) in meta.json and the report


class ChatTask(Task):
    """A task for the chat model: each example renders as a conversation (user question, the
    assistant's ideal answer) for supervised fine-tuning and for prompting at evaluation."""

    def conversation(self, example: dict) -> dict:
        raise NotImplementedError

    def check(self, example: dict, completion: str) -> bool:
        """Is `completion` (the assistant's reply as text) a right answer?"""
        raise NotImplementedError


class GenerativeTask(ChatTask):
    """The model writes its answer; nothing to pick from, so guessing scores 0."""

    kind = GENERATIVE
    chance = 0.0


def letters_for(example: dict) -> str:
    return ANSWER_LETTERS[: len(example["choices"])]


def render_mc(question: str, letters: str, choices: list[str]) -> str:
    """The multiple-choice prompt of the chat tasks. Each choice is followed by its letter with
    no space ("- Paris=A"): the answer is the bare letter, and " A" and "A" are different tokens,
    so the letter the model writes is exactly the token it saw next to the choice (a detail small
    models are sensitive to, as nanochat found)."""
    lines = [f"Multiple Choice question: {question}"] + [f"- {c}={letter}" for letter, c in zip(letters, choices)]
    return "\n".join(lines) + "\n\nRespond only with the letter of the correct answer."


class MultipleChoiceTask(ChatTask):
    """Questions with lettered choices, answered by a letter (scored from the letters' logits)."""

    kind = CATEGORICAL

    def letters(self, example: dict) -> str:
        return letters_for(example)

    def conversation(self, example: dict) -> dict:
        letters = self.letters(example)
        return {
            "messages": [
                {"role": "user", "content": render_mc(example["question"], letters, example["choices"])},
                {"role": "assistant", "content": letters[example["answer"]]},
            ]
        }

    def check(self, example: dict, completion: str) -> bool:
        return completion.strip()[:1] == self.letters(example)[example["answer"]]
