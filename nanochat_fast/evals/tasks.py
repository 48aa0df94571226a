"""
The evaluation tasks over the prepared data (data/eval/): the chat tasks (ARC, MMLU: categorical;
GSM8K, SpellingBee, HumanEval: generative), the synthetic last-digit (chat_rl's proof of learning on
a CPU) and the base model's CORE subset (few-shot likelihood of each choice). `get(name)` finds one
by nanochat's name, any case; `task.load()` gives its evaluated split, `task.conversation(ex)` the
SFT data and the eval prompt, `task.check(ex, reply)` the verdict.
"""

import itertools
import random
import re
from decimal import Decimal, InvalidOperation

from ..core.errors import UserError
from .prepared_benchmarks import load_split
from .sandbox import run_program

# categorical: the answer letters' logits after <|assistant_start|>, the largest is the answer;
# generative: the reply is checked; likelihood: the choice with the lowest mean few-shot loss
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
        """Examples of `split` (default: the evaluated one) in a fixed shuffled order (shuffle=False: file order)."""
        examples = load_split(self.folder, split or self.eval_split)
        if shuffle:
            random.Random(self.shuffle_seed).shuffle(examples)
        return examples[:max_examples]

    def __repr__(self):
        return f"<{type(self).__name__} {self.name} ({self.kind}, chance {self.chance:.0%})>"

    def __str__(self):
        return self.name  # as a flag's value (chat_rl --task) in meta.json and the report


class ChatTask(Task):
    """A task for the chat model: an example renders as a conversation (prompt(example), then the ideal
    answer(example), a string or a list of parts) for SFT and evaluation; check(example, reply): is it right."""

    def prompt(self, example: dict) -> str:
        return example["question"]

    def conversation(self, example: dict) -> dict:
        user, assistant = self.prompt(example), self.answer(example)
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


class MultipleChoiceTask(ChatTask):
    """Questions with lettered choices, answered by a letter (scored from the letters' logits)."""

    kind = CATEGORICAL
    chance = 0.25  # ARC: almost all questions have four choices; MMLU: all do

    def letters(self, example: dict) -> str:
        return ANSWER_LETTERS[: len(example["choices"])]

    def prompt(self, example: dict) -> str:
        # each choice is followed by its letter with no space ("- Paris=A"): " A" and "A" are different
        # tokens, and the model should write the very token it saw next to the choice (as nanochat found)
        choices = [f"- {c}={letter}" for letter, c in zip(self.letters(example), example["choices"])]
        lines = [f"Multiple Choice question: {example['question']}"] + choices
        return "\n".join(lines) + "\n\nRespond only with the letter of the correct answer."

    def answer(self, example: dict) -> str:
        return self.letters(example)[example["answer"]]

    def check(self, example: dict, completion: str) -> bool:
        return completion.strip()[:1] == self.answer(example)


class ARC(MultipleChoiceTask):
    """Grade-school science questions, Easy and Challenge sets; validation may be trained on."""

    train_splits = ("validation",)

    def __init__(self, subset: str):  # ARC-Easy or ARC-Challenge
        self.name, self.folder = subset, subset.lower()


class MMLU(MultipleChoiceTask):
    """57 subjects; dev (the few-shot pool) and validation may be trained on."""

    name, folder = "MMLU", "mmlu"
    train_splits = ("dev", "validation")


ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
CALCULATOR_NOTE = re.compile(r"(<<[^<>]*>>)")


def extract_answer(text: str) -> str | None:
    """The number after the first "####" in canonical form ("#### 1,234.00 apples" -> "1234",
    "#### -7." -> "-7"); None when there is none."""
    found = ANSWER.search(text)
    if not found:
        return None
    try:
        value = Decimal(found.group(1).replace(",", ""))
    except InvalidOperation:
        return None
    return format(value.normalize(), "f") if value != value.to_integral_value() else str(int(value))


class GenerativeTask(ChatTask):
    """The model writes its answer (guessing scores 0); right when its number after "####" is the answer."""

    kind = GENERATIVE
    chance = 0.0

    def check(self, example: dict, completion: str) -> bool:
        return extract_answer(completion) == str(example["answer"])


class GSM8K(GenerativeTask):
    """Word problems; the solutions' "<<48/2=24>>" notes become calculator calls, so the assistant
    learns to use the tool. The eight few-shot examples (dev) may be trained on."""

    name, folder = "GSM8K", "gsm8k"
    train_splits = ("dev",)

    def answer(self, example: dict) -> list[dict]:
        parts = []
        for piece in CALCULATOR_NOTE.split(example["answer"]):
            if piece.startswith("<<") and piece.endswith(">>"):
                expr, _, result = piece[2:-2].rpartition("=")
                parts += [{"type": "python", "text": expr}, {"type": "python_output", "text": result}]
            elif piece:
                parts.append({"type": "text", "text": piece})
        return parts

    def check(self, example: dict, completion: str) -> bool:
        predicted = extract_answer(completion)
        return predicted is not None and predicted == extract_answer(example["answer"])


class SpellingBee(GenerativeTask):
    """How many r are in strawberry? Hard for a model that sees tokens, not letters. The ideal
    answer spells the word with a running count, checks with the calculator, ends in "#### N"."""

    name, folder = "SpellingBee", "spellingbee"
    train_splits = ("train",)

    def answer(self, example: dict) -> list[dict]:
        word, letter, count = example["word"], example["letter"], example["answer"]
        lines, seen = [], 0
        for i, ch in enumerate(word, 1):
            seen += ch == letter
            lines.append(f"{i}:{ch} hit, count={seen}" if ch == letter else f"{i}:{ch}")
        by_hand = (
            f"We want the number of '{letter}' in '{word}'. Spelling it out:\n"
            + "\n".join(lines)
            + f"\n\nThat gives {seen}. Checking with Python:\n\n"
        )
        return [
            {"type": "text", "text": by_hand},
            {"type": "python", "text": f"'{word}'.count('{letter}')"},
            {"type": "python_output", "text": str(count)},
            {"type": "text", "text": f"\n\nPython also gives {count}.\n\n#### {count}"},
        ]


class LastDigit(GenerativeTask):
    """Digits: 4 7 2. Which comes last? "#### 2": GSM8K's interface, small enough for a tiny model on a CPU
    (chat_rl's test); every list of DIGITS digits in a fixed shuffled order, the first TEST_SIZE the test split."""

    name, folder = "last-digit", ""
    train_splits = ("train",)
    chance = 0.1  # a digit guessed at random
    DIGITS, TEST_SIZE = 3, 200

    def load(self, split: str | None = None, max_examples: int | None = None, shuffle: bool = True) -> list[dict]:
        """(shuffle is accepted for the interface: the order is shuffled already)"""
        split = split or self.eval_split
        if split not in ("train", "test"):
            raise ValueError(f"{self.name} has the splits train and test, not {split!r}")
        lists = list(itertools.product(range(10), repeat=self.DIGITS))
        random.Random(self.shuffle_seed).shuffle(lists)
        chosen = lists[: self.TEST_SIZE] if split == "test" else lists[self.TEST_SIZE :]
        question = "Digits: {}. Which comes last?"
        examples = [
            {"id": f"{self.name}-{split}-{i}", "question": question.format(" ".join(map(str, d))), "answer": d[-1]}
            for i, d in enumerate(chosen)
        ]
        return examples[:max_examples]

    def answer(self, example: dict) -> str:
        return f"#### {example['answer']}"


CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def extract_program(completion: str) -> str:
    """The code of a reply: the first fenced block when there is one, else the whole reply."""
    found = CODE_BLOCK.search(completion)
    return (found.group(1) if found else completion).strip("\n")


def check_program(example: dict, code: str) -> str:
    """The program that checks `code` against the example's tests, with the prompt's leading
    imports (a reply that rewrites the function often drops them)."""
    imports = []
    for line in example["question"].splitlines():
        stripped = line.strip()
        if stripped.startswith(("import ", "from ")):
            imports.append(stripped)
        elif stripped and not stripped.startswith("#"):
            break
    header = "\n".join(imports)
    return f"{header}\n\n{code}\n\n{example['test']}\n\ncheck({example['entry_point']})\n"


class HumanEval(GenerativeTask):
    """Python functions completed from their signature and docstring; a reply passes when its
    program passes the problem's tests in the sandbox (sandbox.py)."""

    name, folder = "HumanEval", "humaneval"
    timeout = 5.0  # seconds per program
    memory_mb = 512

    def answer(self, example: dict) -> str:
        return example["question"] + example["answer"]

    def check(self, example: dict, completion: str) -> bool:
        program = check_program(example, extract_program(completion))
        return run_program(program, self.timeout, self.memory_mb).passed


# the CORE subset: DCLM's base-model benchmark (Li et al. 2024, arXiv:2406.11794), the 10 of its 22
# tasks whose data we have offline, each with DCLM's few-shot count, delimiter, task type and random
# baseline. Its mean is "CORE subset (10/22 tasks)", not comparable to published CORE scores. A
# multiple-choice item is one prompt per choice, a schema item (Winogrande) one per way of filling
# the blank; scoring.core_counts picks the lowest mean loss. docs/measurements.md#core-subset.

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
    query = f"Passage: {ex['passage']}\nQuestion: {ex['question']}?"
    return {"query": query, "choices": ex["choices"], "gold": ex["answer"]}


def _winogrande_item(ex):
    # "Sarah was a much better surgeon than Maria so _ always got the easier cases."
    # -> contexts "... so Sarah" / "... so Maria", continuation "always got the easier cases."
    blank = ex["question"].index("_")
    options = [ex["question"][:blank] + option for option in ex["choices"]]
    return {"context_options": options, "continuation": ex["question"][blank + 1 :].strip(), "gold": ex["answer"]}


class CoreTask(Task):
    kind = LIKELIHOOD
    shuffle_seed = 1337  # as nanochat's CORE evaluation, so --max-examples picks the same kind of subset

    def __init__(self, label, folder, split, num_fewshot, delimiter, task_type, chance, to_item):
        self.name, self.folder, self.eval_split = label, folder, split
        self.num_fewshot, self.delimiter, self.task_type, self.chance = num_fewshot, delimiter, task_type, chance
        self.to_item = to_item

    def items(self, max_examples: int | None = None) -> list[dict]:
        """The evaluated split's items: {query, choices, gold} or {context_options, continuation, gold}."""
        return [self.to_item(ex) for ex in self.load(max_examples=max_examples)]

    def fewshot(self, items: list[dict], index: int) -> list[dict]:
        """num_fewshot other items for item `index`, seeded by index (every process draws the same ones)."""
        if self.num_fewshot == 0:
            return []
        others = [i for i in range(len(items)) if i != index]
        chosen = random.Random(1234 + index).sample(others, min(self.num_fewshot, len(others)))
        return [items[i] for i in chosen]

    def prompts(self, item: dict, fewshot: list[dict]) -> list[str]:
        """One prompt per choice, after the few-shot examples (each with its right answer) and a blank line."""
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

CHAT_TASKS = [ARC("ARC-Easy"), ARC("ARC-Challenge"), MMLU(), GSM8K(), HumanEval(), SpellingBee()]
CHAT_TASK_NAMES = [t.name for t in CHAT_TASKS]
SYNTHETIC_TASKS = [LastDigit()]
# what chat_rl trains on: generative tasks whose reply ends in "#### N" (a reward of 0 or 1)
RL_TASK_NAMES = ["GSM8K", "SpellingBee", LastDigit.name]
_BY_NAME = {t.name.lower(): t for t in CHAT_TASKS + SYNTHETIC_TASKS + CORE_SUBSET}


def get(name: str) -> Task:
    """A chat task, the synthetic one or a CORE label by name, any case."""
    task = _BY_NAME.get(name.strip().lower())
    if task is None:
        raise UserError(
            f"unknown task {name!r}; chat tasks: {', '.join(CHAT_TASK_NAMES)}; synthetic: "
            f"{', '.join(t.name for t in SYNTHETIC_TASKS)}; CORE subset: {', '.join(t.name for t in CORE_SUBSET)}"
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
