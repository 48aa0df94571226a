"""chat_rl end to end on the tiny pipeline: RL alone raises a tiny SFT'd model's held-out reward on
the synthetic last-digit task; 2 gloo processes take the same steps as 1; a stopped run resumes
exactly; the report card gets an RL column."""

import json

import pytest
from support.faults import preempted_and_resumed
from support.tiny_pipeline import FP32, TINY_LOOP, TINY_MODEL, home_env, run_script

from nanochat_fast.evals import tasks
from nanochat_fast.scripts import base_train, chat_rl, chat_sft, report

# the quintic recipe pinned in every stage: the rewards and rates below were measured with it (the
# default minimax4 takes another path, whose held-out reward after SFT is already ~0.3 here)
QUINTIC = ["--muon-recipe=quintic"]
BASE = TINY_MODEL + TINY_LOOP + QUINTIC + ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1"]
# SFT at the pretraining learning rates: a 140k-parameter model learns the task's format in a few
# dozen steps; after SFT_STEPS it writes "#### d" but mostly not the right d (held-out reward ~0.2)
FULL_LR = ["--matrix-lr=0.02", "--embedding-lr=0.2", "--unembedding-lr=0.004"]
SFT_STEPS = 60
# RL at a constant rate, half the pretraining one for Muon's matrices and 5% for the embedding: with
# AdamW's step size the embedding at 0.2 turns the noise of 64 samples into damage (val bpb
# 0.35 -> 0.80 in 10 steps, reward down), at 0.01 RL lifts the held-out reward 0.19 -> 0.77 in 30
RL_LR = ["--matrix-lr=0.01", "--embedding-lr=0.01", "--unembedding-lr=0.002", "--warmdown-ratio=0"]
RL = [
    "--source-run=s",
    "--task=last-digit",
    "--examples-per-step=8",
    "--num-samples=8",
    "--max-new-tokens=8",
    "--eval-examples=40",
    "--eval-tokens=512",
    *RL_LR,
    *FP32,
    *QUINTIC,
]
RL_STEPS = 30


def rows_of(run_dir, kind):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == kind]


@pytest.fixture(scope="module")
def rl_home(tiny_home, tmp_path_factory):
    """tiny_home + a 4-step base run `b` + `s`: SFT_STEPS steps of chat_sft with the synthetic
    task's train conversations mixed in."""
    import shutil

    home = tmp_path_factory.mktemp("rl") / "home"
    shutil.copytree(tiny_home, home)
    task = tasks.get("last-digit")
    conversations = home.parent / "last_digit.jsonl"
    conversations.write_text("".join(json.dumps(task.conversation(ex)) + "\n" for ex in task.load("train")))
    with home_env(home):
        assert base_train.main(BASE + ["--num-iterations=4", "--run=b"]) == 0
        assert (
            chat_sft.main(
                [
                    "--source-run=b",
                    f"--extra-conversations={conversations}",
                    "--device-batch-size=16",
                    "--target-examples-per-step=16",
                    f"--num-iterations={SFT_STEPS}",
                    "--eval-every=-1",
                    "--chat-eval-examples=0",
                    "--warmdown-ratio=0.5",
                    "--run=s",
                    *FULL_LR,
                    *FP32,
                    *QUINTIC,
                ]
            )
            == 0
        )
    return home


def test_rl_alone_raises_the_held_out_reward(rl_home, monkeypatch, capsys):
    """pass@1 (the mean reward of 8 samples at temperature 1) on 40 held-out questions, before and
    after RL_STEPS steps: up by at least 0.3. Then the report card shows the RL stage."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(rl_home))
    assert chat_rl.main(RL + [f"--num-iterations={RL_STEPS}", f"--eval-every={RL_STEPS}", "--run=learn"]) == 0
    out = capsys.readouterr().out
    start, end = rows_of(rl_home / "runs" / "learn", "eval")
    assert (start["step"], end["step"]) == (0, RL_STEPS)
    assert start["pass@1"] < 0.3, start
    assert end["pass@1"] - start["pass@1"] >= 0.3, (start, end)
    assert end["pass@8"] >= end["pass@1"]
    trained = rows_of(rl_home / "runs" / "learn", "train")
    assert len(trained) == RL_STEPS and all(0 <= r["reward"] <= 1 and r["seq_len"] > 0 for r in trained)
    line = next(line for line in out.splitlines() if line.startswith(f"step 00001/{RL_STEPS}"))
    assert "| reward " in line and "| pass@1 " in line and "| seq len " in line and "| dt " in line
    assert out.strip().splitlines()[-1] == (
        "next: python -m nanochat_fast.scripts.chat_eval --run=learn --task=last-digit --max-examples=100"
    )

    assert report.main([]) == 0
    card = capsys.readouterr().out
    assert "| metric | BASE | SFT | RL |" in card
    assert (
        f"| pass@1 on held-out last-digit questions (chat_rl's eval, sampled) | - | - | {end['pass@1']:.4f} |" in card
    )


def test_two_processes_take_the_same_steps(rl_home, tmp_path):
    """8 questions per step: 1 process samples all 8, or 2 processes 4 each; the same rewards,
    pass@1, lengths, losses and held-out pass@k (fp32, 1e-5)."""
    args = RL + ["--num-iterations=3", "--eval-every=3", "--eval-examples=6", "--device-batch-size=16"]
    with home_env(rl_home):
        assert chat_rl.main(args + ["--run=one"]) == 0
    two = run_script("chat_rl", args + ["--run=two"], rl_home, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    one_rows, two_rows = (rows_of(rl_home / "runs" / r, "train") for r in ("one", "two"))
    assert len(one_rows) == len(two_rows) == 3
    for a, b in zip(one_rows, two_rows):
        for key in ("loss", "reward", "pass@1", "pass@8", "seq_len"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (key, a, b)
    assert any(r["reward"] not in (0.0, 1.0) for r in one_rows)  # the steps had something to learn from
    for a, b in zip(*(rows_of(rl_home / "runs" / r, "eval") for r in ("one", "two"))):
        assert {k: v for k, v in a.items() if k.startswith("pass@") or k == "val_bpb"} == pytest.approx(
            {k: v for k, v in b.items() if k.startswith("pass@") or k == "val_bpb"}, abs=1e-5
        )


def test_stop_and_resume_is_exact(rl_home, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(rl_home))
    args = RL + ["--num-iterations=4", "--eval-every=-1", "--deterministic"]
    a, b = preempted_and_resumed(chat_rl.main, args, rl_home / "runs", 2, capsys)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [(r["loss"], r["reward"]) for r in a] == [(r["loss"], r["reward"]) for r in b]
