"""A newcomer's first day, end to end, in a fresh home: each command a script prints as the next
step is run exactly as printed (a shell runs the line, with `python` being this interpreter).

1. Their own prose: prepare_data --input=DIR -> the printed tok_train -> the printed base_train
   -> the printed base_eval.
2. Their own conversations, without the built-in chat dataset: the --extra-conversations example
   of `mid_train --help`, as printed -> the printed chat_sft (on the same conversations) -> the
   printed chat_cli.
"""

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest
from support.tiny_pipeline import ROOT, home_env, write_corpus

from nanochat_fast import checkpoints
from nanochat_fast.scripts import mid_train, prepare_data


def next_command(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("next: ")]
    assert lines, stdout[-2000:]
    return lines[-1].removeprefix("next: ")


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """run(line): the line through a shell in the newcomer's folder, with a fresh NANOCHAT_FAST_HOME
    and `python` on PATH being this interpreter."""
    root = tmp_path_factory.mktemp("newcomer")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"  # a wrapper, not a symlink: a venv's python finds its packages by its own path
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "NANOCHAT_FAST_HOME": str(root / "home"),
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }

    def run(line: str) -> subprocess.CompletedProcess:
        out = subprocess.run(
            line, shell=True, cwd=root, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
        )
        assert out.returncode == 0, f"{line}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out

    run.root, run.home = root, root / "home"
    return run


@pytest.fixture(scope="module")
def own_prose(shell):
    """Path 1, up to a trained base model: the outputs of each printed command. (prepare_data, whose
    output is read, not run, is called in-process: one interpreter start less.)"""
    write_corpus(shell.root / "src", n_docs=100)  # ~5K tokens: the printed base_train is one step
    (shell.root / "src" / "prose").rename(shell.root / "mytext")
    out = io.StringIO()
    with home_env(shell.home), contextlib.redirect_stdout(out):
        assert prepare_data.main([f"--input={shell.root / 'mytext'}"]) == 0
    tok_line = next_command(out.getvalue())
    tokenized = shell(tok_line)
    train_line = next_command(tokenized.stdout)
    trained = shell(train_line)
    return dict(tok_line=tok_line, train_line=train_line, trained=trained)


def test_prepare_data_input_prints_commands_that_work_as_printed(own_prose, shell):
    assert own_prose["tok_line"] == "python -m nanochat_fast.scripts.tok_train --dataset=mytext"
    assert own_prose["train_line"].startswith("python -m nanochat_fast.scripts.base_train --dataset=mytext ")
    run_dir = shell.home / "runs" / "base_d4"
    meta = checkpoints.load_meta(checkpoints.complete_checkpoints(run_dir)[-1])
    assert meta["phase"] == "base" and meta["args"]["dataset"] == "mytext"
    evaluated = shell(next_command(own_prose["trained"].stdout))  # base_eval --run=base_d4
    assert re.search(r"val bpb \(mytext val split", evaluated.stdout), evaluated.stdout


def test_mid_train_on_own_conversations_alone_as_documented(own_prose, shell):
    """No chat dataset is prepared in this home: the example of `mid_train --help` trains on the
    conversations of the file alone, and its printed next command chats with the result."""
    assert not (shell.home / "tokens" / "chat").exists()
    example = next(line.strip() for line in mid_train.__doc__.splitlines() if "--extra-conversations=" in line)
    file = re.search(r"--extra-conversations=(\S+)", example).group(1)
    write_corpus(shell.root / "convs_src", n_docs=120, seed=1)
    (shell.root / "convs_src" / "chat" / "convs.jsonl").rename(shell.root / file)
    trained = shell(example)
    assert "conversations of my_chats.jsonl alone" in trained.stdout, trained.stdout[-2000:]
    evals = [float(v) for v in re.findall(r"val bpb (\d+\.\d+)", trained.stdout)]
    assert len(evals) >= 2 and evals[-1] < evals[0], trained.stdout[-2000:]  # it learned from the file
    sft_line = next_command(trained.stdout)
    assert sft_line == f"python -m nanochat_fast.scripts.chat_sft --source-run=mid_base_d4 --extra-conversations={file}"
    tuned = shell(sft_line)
    assert f"conversations, one per row ({file} 117)" in tuned.stdout, tuned.stdout[-2000:]
    chat_line = next_command(tuned.stdout)
    assert chat_line == "python -m nanochat_fast.scripts.chat_cli --run=sft_mid_base_d4"
    chatted = shell(chat_line)  # interactive; stdin is empty, so it opens the chat and leaves
    assert "chatting with" in chatted.stdout and "sft_mid_base_d4" in chatted.stdout
