"""The sandbox that runs generated code: a right solution passes and a wrong one fails, an endless
loop and a memory bomb are stopped within their limits, and the program cannot write outside its
folder or reach the network."""

import os
import time

import pytest

from nanochat_fast.evals.sandbox import isolation, run_program
from nanochat_fast.evals.tasks import check_program, extract_program

# a HumanEval-style problem (prompt, canonical solution, tests), written here
PROBLEM = {
    "question": "from typing import List\n\n\ndef running_max(xs: List[int]) -> List[int]:\n"
    '    """The largest value seen so far, at each position."""\n',
    "answer": "    out, best = [], None\n    for x in xs:\n        best = x if best is None else max(best, x)\n"
    "        out.append(best)\n    return out\n",
    "entry_point": "running_max",
    "test": (
        "def check(candidate):\n    assert candidate([]) == []\n"
        "    assert candidate([1, 3, 2, 5, 4]) == [1, 3, 3, 5, 5]\n"
        "    assert candidate([-2, -5]) == [-2, -2]\n"
    ),
}


def test_canonical_solution_passes_and_a_wrong_one_fails():
    ok = run_program(check_program(PROBLEM, PROBLEM["question"] + PROBLEM["answer"]))
    assert ok.status == "passed", ok
    wrong = PROBLEM["question"] + "    return list(xs)\n"
    bad = run_program(check_program(PROBLEM, wrong))
    assert bad.status == "failed" and "AssertionError" in bad.detail
    broken = run_program(check_program(PROBLEM, "def running_max(xs:\n"))
    assert broken.status == "error" and "SyntaxError" in broken.detail


def test_a_reply_in_a_code_block_is_extracted():
    reply = f"Here you go:\n```python\n{PROBLEM['question']}{PROBLEM['answer']}```\nHope it helps."
    assert run_program(check_program(PROBLEM, extract_program(reply))).passed
    # without the prompt's import, the prompt's imports are added back
    assert "from typing import List" in check_program(PROBLEM, "def running_max(xs): return xs")


def test_infinite_loop_is_killed_at_its_time_limit():
    start = time.monotonic()
    result = run_program("while True:\n    pass\n", timeout=1.0)
    elapsed = time.monotonic() - start
    assert result.status == "timeout"
    assert 1.0 <= elapsed < 10.0, elapsed  # killed at the limit (plus start-up and a loaded machine)


def test_memory_bomb_is_stopped_by_the_memory_limit():
    start = time.monotonic()
    result = run_program(
        "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))\n", timeout=20.0, memory_mb=256
    )
    assert result.status == "error" and "MemoryError" in result.detail
    assert time.monotonic() - start < 20.0, "stopped by the memory limit, not by the clock"


def test_no_write_outside_the_sandbox_folder(tmp_path):
    targets = [tmp_path / "escape.txt", f"/tmp/nanochat_fast_sandbox_escape_{os.getpid()}.txt"]
    for target in targets:
        for code in (
            f"open({str(target)!r}, 'w').write('x')",
            f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
        ):
            result = run_program(code)
            assert result.status == "error" and "PermissionError" in result.detail, result
            assert not os.path.exists(target)
    # writing inside its own folder works
    assert run_program("open('notes.txt', 'w').write('x')\nassert open('notes.txt').read() == 'x'\n").passed


@pytest.mark.skipif(isolation() != "namespace", reason="needs root with unshare and setpriv")
def test_kernel_isolation_holds_when_the_guards_are_bypassed(tmp_path):
    """_io.FileIO is not guarded in-process; the unprivileged user still cannot write to our
    folders, and the network namespace has no route anywhere."""
    target = tmp_path / "escape.txt"
    result = run_program(f"import _io\n_io.FileIO({str(target)!r}, 'w')\n")
    assert result.status == "error" and "PermissionError" in result.detail
    assert not target.exists()
    assert run_program("import os\nassert os.getuid() == 65534 and os.getgid() == 65534\n").passed
    probe = run_program("import _socket\nprint(open('/proc/net/dev').read())\n")
    interfaces = [line.split(":")[0].strip() for line in probe.stdout.splitlines()[2:] if line.strip()]
    assert interfaces == ["lo"], probe.stdout


def test_network_and_processes_are_refused():
    assert "PermissionError" in run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))").detail
    assert "PermissionError" in run_program("import subprocess\nsubprocess.run(['true'])").detail
    assert "PermissionError" in run_program("import os\nos.system('true')").detail
