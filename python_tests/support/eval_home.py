"""A tiny evaluation-data home written by hand in the normalised JSONL format of
evals/prepared_benchmarks.py (data/eval/<task>/<split>.jsonl + manifest.json), so the stage tests need no download:
a few examples per chat task and per CORE task, answers known."""

import json
from pathlib import Path

COLOURS = ["red", "green", "blue", "gold"]


def mc(task: str, n: int, offset: int = 0) -> list[dict]:
    """n four-choice questions whose answer cycles through the letters."""
    return [
        {
            "id": f"{task}-{offset + i}",
            "question": f"which colour is number {offset + i}?",
            "choices": list(COLOURS),
            "answer": (offset + i) % 4,
        }
        for i in range(n)
    ]


def gsm8k(n: int, offset: int = 0) -> list[dict]:
    out = []
    for i in range(offset, offset + n):
        a, b = i + 2, 3 * i + 1
        out.append(
            {
                "id": f"gsm8k-{i}",
                "question": f"Tom has {a} apples and buys {b} more. How many now?",
                "answer": f"He has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
            }
        )
    return out


def humaneval(n: int) -> list[dict]:
    return [
        {
            "id": f"HumanEval/{i}",
            "question": f'def add{i}(x):\n    """x plus {i}."""\n',
            "answer": f"    return x + {i}\n",
            "entry_point": f"add{i}",
            "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n",
        }
        for i in range(n)
    ]


def spelling(words: list[str], prefix: str) -> list[dict]:
    return [
        {"id": f"{prefix}-{w}", "question": f"How many r are in {w}?", "answer": w.count("r"), "word": w, "letter": "r"}
        for w in words
    ]


def write_task(home: Path, task: str, splits: dict[str, list[dict]]):
    root = Path(home) / "data" / "eval" / task
    root.mkdir(parents=True, exist_ok=True)
    for split, examples in splits.items():
        (root / f"{split}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    manifest = {
        "task": task,
        "format": 1,
        "splits": {s: len(e) for s, e in splits.items()},
        "package": {"name": "by-hand", "spec": "by-hand==0", "version": "0", "licence": "test"},
        "data": {"origin": "written by the tests", "licence": "test"},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))


def write_eval_home(home: Path, n: int = 6):
    """Every chat task (n test examples each, a few train examples) and four CORE tasks."""
    write_task(home, "arc-easy", {"validation": mc("arc-easy-val", 5), "test": mc("arc-easy", n)})
    write_task(home, "arc-challenge", {"validation": mc("arc-ch-val", 3), "test": mc("arc-ch", n)})
    write_task(
        home,
        "mmlu",
        {
            "dev": mc("mmlu-dev", 2),
            "validation": mc("mmlu-val", 4),
            "test": [dict(e, subject="colours") for e in mc("mmlu", n)],
        },
    )
    write_task(home, "gsm8k", {"test": gsm8k(n), "dev": gsm8k(2, offset=100)})
    write_task(home, "humaneval", {"test": humaneval(min(n, 3))})
    write_task(
        home,
        "spellingbee",
        {
            "train": spelling(["carrot", "river", "mirror", "bread"], "train"),
            "test": spelling(["strawberry", "error", "car", "tree", "rare", "hero", "purr", "word"][:n], "test"),
        },
    )
    write_task(
        home,
        "copa",
        {
            "validation": [
                {
                    "id": f"copa-{i}",
                    "question": f"The cat number {i} was hungry.",
                    "relation": "effect" if i % 2 else "cause",
                    "choices": ["It ate the food.", "It sang a song."],
                    "answer": i % 2,
                }
                for i in range(n)
            ]
        },
    )
    write_task(
        home, "piqa", {"validation": [dict(e, choices=e["choices"][:2], answer=e["answer"] % 2) for e in mc("piqa", n)]}
    )
    write_task(
        home,
        "boolq",
        {
            "validation": [
                {
                    "id": f"boolq-{i}",
                    "question": f"is {i} even",
                    "passage": f"The number {i}.",
                    "choices": ["no", "yes"],
                    "answer": int(i % 2 == 0),
                }
                for i in range(n)
            ]
        },
    )
    write_task(
        home,
        "winogrande",
        {
            "validation": [
                {
                    "id": f"wg-{i}",
                    "question": f"The dog chased the cat {i} because _ was fast.",
                    "choices": ["the dog", "the cat"],
                    "answer": i % 2,
                }
                for i in range(n)
            ]
        },
    )
