"""
HumanEval: 164 Python functions to complete from their signature and docstring. The assistant is
asked with the prompt (the start of the program) and answers with the whole function; the answer
passes when the program, run in the sandbox (sandbox.py: a subprocess with time and memory limits
and no network), passes the problem's tests.
"""

import re

from ..sandbox import run_program
from .task_types import GenerativeTask

CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def extract_program(completion: str) -> str:
    """The code of a reply: the first fenced block when there is one, else the whole reply."""
    found = CODE_BLOCK.search(completion)
    return (found.group(1) if found else completion).strip("\n")


def leading_imports(prompt: str) -> str:
    """The import lines at the top of a prompt (a reply that rewrites the function often drops
    them)."""
    imports = []
    for line in prompt.splitlines():
        stripped = line.strip()
        if stripped.startswith(("import ", "from ")):
            imports.append(stripped)
        elif stripped and not stripped.startswith("#"):
            break
    return "\n".join(imports)


def check_program(example: dict, code: str) -> str:
    """The program that checks `code` against the example's tests."""
    return f"{leading_imports(example['question'])}\n\n{code}\n\n{example['test']}\n\ncheck({example['entry_point']})\n"


class HumanEval(GenerativeTask):
    name, folder = "HumanEval", "humaneval"
    train_splits = ()
    timeout = 5.0  # seconds per program
    memory_mb = 512

    def conversation(self, example: dict) -> dict:
        return {
            "messages": [
                {"role": "user", "content": example["question"]},
                {"role": "assistant", "content": example["question"] + example["answer"]},
            ]
        }

    def execute(self, example: dict, completion: str):
        """The sandbox's result for the reply `completion` (status passed/failed/timeout/error)."""
        return run_program(check_program(example, extract_program(completion)), self.timeout, self.memory_mb)

    def check(self, example: dict, completion: str) -> bool:
        return self.execute(example, completion).passed
