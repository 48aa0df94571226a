"""The report card from hand-made stage reports (checkpoint meta.json and evals.json, no training):
which runs it picks, its summary table, costs and scores computed by hand."""

import json
import os

import pytest

from nanochat_fast import checkpoints
from nanochat_fast.core.errors import UserError
from nanochat_fast.evals import task_runner
from nanochat_fast.scripts import report

MODEL = {"sequence_len": 64, "vocab_size": 320, "n_layer": 2, "n_head": 2, "n_kv_head": 2, "n_embd": 64}


def fake_run(
    home, name, phase, step, source=None, train_time=3600.0, tokens=1000, device=None, bpb=(3.0, 2.0), mtime=0
):
    """A run directory holding one complete checkpoint's meta.json (no weights: the card reads none)."""
    ckpt = home / "runs" / name / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    meta = {
        "format_version": checkpoints.FORMAT_VERSION,
        "step": step,
        "phase": phase,
        "model_config": MODEL,
        "args": {"dataset": "chat" if phase != "base" else "base"},
        "world_size": 2,
        "device": device or {"type": "cpu", "processes": 2, "threads_per_process": 2, "hardware": "a test CPU"},
        "loop_state": {
            "step": step,
            "train_time": train_time,
            "tokens_seen": tokens,
            "first_val_bpb": bpb[0],
            "last_val_bpb": bpb[1],
            "last_evals": {},
        },
    }
    if source is not None:
        meta["base_checkpoint"] = str(home / "runs" / source / "checkpoints" / "step_000010")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / checkpoints.COMPLETE).write_text("")
    os.utime(ckpt / checkpoints.COMPLETE, (1e9 + mtime, 1e9 + mtime))  # newest_run goes by this time
    return home / "runs" / name


def chat_result(name, correct, total, chance):
    return task_runner.TaskResult(name, "x", "test", correct, total, chance, 1.5).as_dict()


@pytest.fixture
def pipeline(nanochat_home):
    home = nanochat_home
    fake_run(home, "b", "base", 10, train_time=3600.0, tokens=123456)
    fake_run(home, "b_other", "base", 10, mtime=50)  # newer, but not in the sft run's lineage
    fake_run(home, "m", "mid", 10, source="b", train_time=1800.0)
    fake_run(home, "m_other", "mid", 10, source="b_other", mtime=60)
    fake_run(home, "s_old", "sft", 10, source="m_other", mtime=5)
    gpu = {"type": "cuda", "processes": 8, "threads_per_process": 1, "hardware": "8 x H100"}
    fake_run(home, "s", "sft", 20, source="m", train_time=900.0, device=gpu, mtime=70)
    core = {
        "name": "CORE subset (2/22 tasks)",
        "results": {"copa": 0.6, "piqa": 0.5},
        "centered": {"copa": 0.2, "piqa": 0.0},
        "core_subset": 0.1,
        "chance": {"copa": 0.5, "piqa": 0.5},
        "counts": {
            "copa": {"correct": 6, "total": 10, "shots": 0, "split": "validation", "seconds": 1.0},
            "piqa": {"correct": 5, "total": 10, "shots": 10, "split": "validation", "seconds": 1.0},
        },
        "max_examples": 10,
    }
    task_runner.record(
        home / "runs" / "b",
        10,
        "base_eval",
        {"val_bpb": {"value": 1.9, "dataset": "base", "eval_tokens": 512}, "core_subset": core},
    )
    chances = {
        "ARC-Easy": 0.25,
        "ARC-Challenge": 0.25,
        "MMLU": 0.25,
        "GSM8K": 0.0,
        "HumanEval": 0.0,
        "SpellingBee": 0.0,
    }
    sft = {name: chat_result(name, 30 if chance else 0, 100, chance) for name, chance in chances.items()}
    task_runner.record(home / "runs" / "s", 20, "chat_eval", sft)
    task_runner.record(home / "runs" / "m", 10, "chat_eval", {"ARC-Easy": chat_result("ARC-Easy", 25, 100, 0.25)})
    return home


def summary_table(text):
    block = text.split("## Summary")[1].split("\n\n")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()]
    return rows[0], {r[0]: r[1:] for r in rows[2:]}


def test_card_follows_the_newest_sft_runs_lineage(pipeline, capsys):
    assert report.main([]) == 0
    text = (pipeline / "report.md").read_text()
    assert text in capsys.readouterr().out
    assert "Runs: base `b` (step 10), mid `m` (step 10), sft `s` (step 20)." in text
    header, rows = summary_table(text)
    assert header == ["metric", "BASE", "MID", "SFT"]
    assert rows["val bpb (end of training, the stage's own val split)"] == ["2.0000"] * 3
    assert rows["CORE subset (2/22 tasks)"] == ["0.1000", "-", "-"]
    # 30/100: Wilson 95% interval [21.9%, 39.6%]; 25/100: [17.5%, 34.3%]
    assert rows["ARC-Easy (chance 25.0%)"] == ["-", "25.0% [17.5%, 34.3%] (n=100)", "30.0% [21.9%, 39.6%] (n=100)"]
    assert rows["GSM8K (chance 0.0%)"] == ["-", "-", "0.0% [0.0%, 3.7%] (n=100)"]
    # ChatCORE: three tasks at (0.30 - 0.25) / 0.75 and three at 0, over six
    assert rows["ChatCORE (six tasks, centred by chance)"] == ["-", "-", f"{3 * (0.05 / 0.75) / 6:.4f}"]
    assert rows["tokens seen"][0] == "123,456"
    # 1 h x 2 processes x 2 threads; 0.5 h x 4 cores; 0.25 h x 8 GPUs
    assert rows["cost"] == [
        "4.000 core-hours (2 x 2 threads)",
        "2.000 core-hours (2 x 2 threads)",
        "2.000 GPU-hours (8 x cuda)",
    ]
    assert "Total training time: 105.0 min." in text
    assert "| copa | 0 | 60.0% | 6 / 10 | 50.0% | +0.2000 |" in text
    assert "| MMLU | 30.0% | 30 / 100 test | 25.0% | 21.9% - 39.6% | 1.5 s |" in text


def test_flags_pick_other_runs_or_leave_a_stage_out(pipeline, tmp_path, capsys):
    out = tmp_path / "card" / "r.md"
    assert report.main(["--sft-run=s_old", "--mid-run=none", f"--output={out}"]) == 0
    text = out.read_text()
    assert "Runs: base `b_other` (step 10), sft `s_old` (step 10)." in text  # base: the lineage of s_old's mid run
    assert summary_table(text)[0] == ["metric", "BASE", "SFT"]
    assert report.main(["--sft-run=none", f"--output={out}"]) == 0
    assert "Runs: base `b_other` (step 10), mid `m_other` (step 10)." in out.read_text()  # the newest mid run


def test_no_runs_at_all_is_one_line(nanochat_home):
    with pytest.raises(UserError, match="no runs to report on"):
        report.main([])
