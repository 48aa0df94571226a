"""
GSM8K: grade-school word problems whose worked solutions end in "#### N". The assistant learns to
do its arithmetic with the calculator: the solutions' "<<48/2=24>>" notes become a python call and
its output. Evaluated on test (1,319); the eight worked examples of the few-shot pool (dev) may be
trained on. An answer is right when the number after its "####" equals the solution's.
"""

import re
from decimal import Decimal, InvalidOperation

from .task_types import GenerativeTask

ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
CALCULATOR_NOTE = re.compile(r"(<<[^<>]*>>)")


def extract_answer(text: str) -> str | None:
    """The number after the first "####", as a canonical string: digit-group commas dropped, a
    trailing ".0" or "." (end of sentence) gone, so "#### 1,234.00 apples" -> "1234" and
    "#### -7." -> "-7". None when there is no "#### N"."""
    found = ANSWER.search(text)
    if not found:
        return None
    try:
        value = Decimal(found.group(1).replace(",", ""))
    except InvalidOperation:
        return None
    return format(value.normalize(), "f") if value != value.to_integral_value() else str(int(value))


def solution_parts(solution: str) -> list[dict]:
    """The solution as assistant parts: text, and each "<<expr=result>>" note as a python call
    and its output."""
    parts = []
    for piece in CALCULATOR_NOTE.split(solution):
        if piece.startswith("<<") and piece.endswith(">>"):
            expr, _, result = piece[2:-2].rpartition("=")
            parts += [{"type": "python", "text": expr}, {"type": "python_output", "text": result}]
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


class GSM8K(GenerativeTask):
    name, folder = "GSM8K", "gsm8k"
    train_splits = ("dev",)

    def conversation(self, example: dict) -> dict:
        return {
            "messages": [
                {"role": "user", "content": example["question"]},
                {"role": "assistant", "content": solution_parts(example["answer"])},
            ]
        }

    def check(self, example: dict, completion: str) -> bool:
        predicted = extract_answer(completion)
        return predicted is not None and predicted == extract_answer(example["answer"])
