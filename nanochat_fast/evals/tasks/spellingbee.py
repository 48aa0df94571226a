"""
SpellingBee: "How many r are in strawberry?". Hard for a model that sees tokens, not letters. The
ideal answer spells the word out, counts by hand, checks with the calculator
('strawberry'.count('r')) and ends in "#### N"; a reply is right when its number after "####" is
the count. Words come from the web2 list; the 1,000 test words never appear in train.
"""

from .gsm8k import extract_answer
from .task_types import GenerativeTask


def worked_answer(word: str, letter: str, count: int) -> list[dict]:
    """The assistant's answer as parts: spelling with a running count, a calculator check, the
    result after ####."""
    lines, seen = [], 0
    for i, ch in enumerate(word, 1):
        if ch == letter:
            seen += 1
            lines.append(f"{i}:{ch} hit, count={seen}")
        else:
            lines.append(f"{i}:{ch}")
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


class SpellingBee(GenerativeTask):
    name, folder = "SpellingBee", "spellingbee"
    train_splits = ("train",)

    def conversation(self, example: dict) -> dict:
        return {
            "messages": [
                {"role": "user", "content": example["question"]},
                {"role": "assistant", "content": worked_answer(example["word"], example["letter"], example["answer"])},
            ]
        }

    def check(self, example: dict, completion: str) -> bool:
        return extract_answer(completion) == str(example["answer"])
