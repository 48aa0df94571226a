"""chat_eval and base_eval's CORE subset: each example's scores and answer on 2 gloo processes equal
to 1 (a model whose letters score apart) and the counts too, the results file the report card
reads, the vocabulary projection at the answer position alone, the CORE subset against a hand
count and against scoring.core_counts item by item."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from support.eval_home import write_eval_home, write_task
from support.recording_chat_eval import recording
from support.repo_paths import SUPPORT
from support.stub_models import FavouriteTokenModel, byte_tokenizer
from support.tiny_gpt import random_model
from support.tiny_pipeline import ROOT, TINY_LOOP, TINY_MID, TINY_MODEL, home_env, home_with_base_run

from nanochat_fast import checkpoints
from nanochat_fast.data.tokenizer import get_tokenizer
from nanochat_fast.evals import scoring, task_runner, tasks
from nanochat_fast.evals.tasks import MULTIPLE_CHOICE, CoreTask
from nanochat_fast.model import loading
from nanochat_fast.model.gpt import GPTConfig
from nanochat_fast.scripts import base_eval, chat_eval, mid_train

# a context of 128: the multiple-choice prompts (up to ~90 tokens here) fit whole; a longer one would be
# cut to its end and lose its question (scoring.py)
BASE = (
    [a if not a.startswith("--max-seq-len") else "--max-seq-len=128" for a in TINY_MODEL]
    + TINY_LOOP
    + ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1"]
)
# fp32 pinned: 1 and 2 processes batch the prompts differently, and their scores are compared
EVAL = ["--run=spread", "--task=all", "--max-new-tokens=12", "--batch-size=3", "--dtype=fp32"]


@pytest.fixture(scope="module")
def eval_home(tiny_home, tmp_path_factory):
    """tiny_home + hand-written evaluation data + a base run `b`, a mid run `m`, and `spread`: m
    with random weights."""
    home = home_with_base_run(
        tiny_home, tmp_path_factory.mktemp("evals") / "home", BASE + ["--num-iterations=3", "--run=b"]
    )
    write_eval_home(home, n=7)
    with home_env(home):
        assert mid_train.main(TINY_MID) == 0
    spread_run(home)
    return home


def spread_run(home):
    """runs/spread: a copy of m whose checkpoint holds random weights (every projection, lm_head
    included). m's lm_head starts at zero and the answer letters are never its targets, so after 2
    steps their rows are still equal and their logits tie exactly: the first letter always wins,
    and any two ways of scoring agree. Random rows give each letter its own score."""
    shutil.copytree(home / "runs" / "m", home / "runs" / "spread")
    ckpt = checkpoints.complete_checkpoints(home / "runs" / "spread")[-1]
    trained = torch.load(ckpt / "model.pt", weights_only=True)
    # seed 5: the answers are not all one letter (with seeds 1-8 but 5 they are), the closest two
    # letters 1.5e-3 apart
    weights = random_model(GPTConfig(**checkpoints.load_meta(ckpt)["model_config"]), seed=5).state_dict()
    assert weights.keys() == trained.keys()
    # written as the checkpoint home writes a file, and recorded in meta.json and COMPLETE as export_model does
    meta = checkpoints.load_meta(ckpt)
    meta["files"]["model.pt"] = checkpoints.write_tensors(ckpt / "model.pt", weights)
    checkpoints.write_meta(ckpt, meta)


def recorded(home, run, script):
    records = json.loads((home / "runs" / run / "evals.json").read_text())
    ((step, entry),) = records["steps"].items()
    return int(step), entry[script]


def chat_eval_on_two_processes(home, records_dir):
    """chat_eval EVAL under torchrun (2 gloo processes), each rank's categorical records written to
    records_dir (recording_chat_eval.py); returns the records by (task, example id)."""
    env = {
        **os.environ,
        "NANOCHAT_FAST_HOME": str(home),
        "OMP_NUM_THREADS": "1",
        "RECORDS_DIR": str(records_dir),
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(SUPPORT / "recording_chat_eval.py"),
        "--",
        *EVAL,
    ]  # `--`: torchrun would take --run
    two = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert two.returncode == 0, two.stderr[-3000:]
    ranks = [[json.loads(line) for line in (records_dir / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    for task in ("ARC-Easy", "ARC-Challenge", "MMLU"):  # 7 examples: rank 0 scores 4, rank 1 scores 3
        assert [sum(rec["task"] == task for rec in rank) for rank in ranks] == [4, 3]
    return {(rec["task"], rec["id"]): rec for rank in ranks for rec in rank}


def test_two_processes_score_what_one_scores(eval_home, monkeypatch, capsys, tmp_path):
    """Every task, 7 examples each (HumanEval 3): rank 0 scores 4, rank 1 scores 3. Each
    categorical example gets the same letter logits and answer from 2 processes (batched
    differently) as from one, and the summed counts are one process's; the printout gives accuracy,
    chance and the 95% interval. The letters' scores are apart by >= 1e-3 in every example (fp32
    rounding moves them by ~1e-6) and the answers are not all one letter, so a mixed-up example or
    position changes answers, not only scores."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(eval_home))
    one_records = []
    monkeypatch.setattr(scoring, "categorical_counts", recording(scoring.categorical_counts, one_records.append))
    assert chat_eval.main(EVAL) == 0
    out = capsys.readouterr().out
    step, one = recorded(eval_home, "spread", "chat_eval")
    assert step == 2 and list(one) == tasks.CHAT_TASK_NAMES
    for name, r in one.items():
        assert r["total"] == (3 if name == "HumanEval" else 7)
        lo, hi = scoring.wilson_interval(r["correct"], r["total"])
        assert (
            f"{name}: {100 * r['correct'] / r['total']:.2f}% ({r['correct']}/{r['total']} test) | chance "
            f"{100 * r['chance']:.0f}% | 95% interval {100 * lo:.1f}%-{100 * hi:.1f}%" in out
        )
    assert "ChatCORE" in out and out.strip().endswith("next: python -m nanochat_fast.scripts.report")
    assert len(one_records) == 21
    margins = [sorted(rec["letter_logits"])[-1] - sorted(rec["letter_logits"])[-2] for rec in one_records]
    assert min(margins) >= 1e-3 and len({rec["prediction"] for rec in one_records}) > 1, (margins, one_records)

    two_records = chat_eval_on_two_processes(eval_home, tmp_path)
    assert two_records.keys() == {(rec["task"], rec["id"]) for rec in one_records}
    for rec in one_records:
        other = two_records[(rec["task"], rec["id"])]
        assert (other["prediction"], other["correct"]) == (rec["prediction"], rec["correct"]), (rec, other)
        # logits recorded to 4 decimals: one rounding step apart at most
        assert max(abs(a - b) for a, b in zip(rec["letter_logits"], other["letter_logits"])) <= 1.5e-4, (rec, other)
    _, both = recorded(eval_home, "spread", "chat_eval")
    assert {n: (r["correct"], r["total"]) for n, r in both.items()} == {
        n: (r["correct"], r["total"]) for n, r in one.items()
    }
    assert both["ARC-Easy"]["settings"]["world_size"] == 2


def test_categorical_scoring_projects_only_the_answer_position():
    """With the lm_head hook the logits are (B, 1, V) and equal the full forward's at each row's last
    position; the hook is gone afterwards."""
    tok = byte_tokenizer()
    model = random_model(
        GPTConfig(sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=64), seed=1
    ).eval()
    idx = torch.randint(0, 256, (3, 20))
    last = torch.tensor([4, 19, 11])
    with torch.no_grad():
        full = model(idx)
        with scoring.logits_only_at(model, last) as ran:
            few = model(idx)
    assert ran and few.shape == (3, 1, tok.get_vocab_size())
    torch.testing.assert_close(few[:, 0], full[torch.arange(3), last], rtol=1e-5, atol=1e-5)
    assert model(idx).shape == full.shape


def hand_tasks(home):
    """Two CORE-style tasks whose right answers a model that always predicts 'a' picks out: it
    chooses the all-'a' continuation, right 3 of 5 times (chance 1/2) and 1 of 4 times (chance 1/4)."""
    two = [
        {"id": str(i), "question": f"pick {i}", "choices": ["aaaa", "bbbb"], "answer": g}
        for i, g in enumerate([0, 1, 0, 0, 1])
    ]
    four = [
        {"id": str(i), "question": f"four {i}", "choices": ["bbbb", "cccc", "aaaa", "dddd"], "answer": g}
        for i, g in enumerate([2, 0, 1, 3])
    ]
    write_task(home, "hand-two", {"validation": two})
    write_task(home, "hand-four", {"validation": four})

    def item(ex):
        return {"query": ex["question"], "choices": ex["choices"], "gold": ex["answer"]}

    return [
        CoreTask("two", "hand-two", "validation", 2, " ", MULTIPLE_CHOICE, 0.5, item),
        CoreTask("four", "hand-four", "validation", 0, " ", MULTIPLE_CHOICE, 0.25, item),
    ]


def test_core_subset_against_a_hand_count(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(tmp_path))
    tok = byte_tokenizer()
    model = FavouriteTokenModel(tok.get_vocab_size(), favourite=tok.encode("a")[0])
    core = hand_tasks(tmp_path)
    summary = task_runner.core_subset(model, tok, core, batch_size=3)
    assert [(summary["counts"][t]["correct"], summary["counts"][t]["total"]) for t in ("two", "four")] == [
        (3, 5),
        (1, 4),
    ]
    assert summary["results"] == {"two": 0.6, "four": 0.25}
    assert summary["centered"] == pytest.approx({"two": (0.6 - 0.5) / 0.5, "four": 0.0})
    assert summary["core_subset"] == pytest.approx(0.1) and summary["name"] == "CORE subset (2/22 tasks)"
    # each rank's shard (every 2nd item) adds up to the whole
    shards = [task_runner.core_subset(model, tok, core, rank=r, world_size=2, batch_size=3)["counts"] for r in (0, 1)]
    assert [shards[0][t]["total"] + shards[1][t]["total"] for t in ("two", "four")] == [5, 4]
    assert [shards[0][t]["correct"] + shards[1][t]["correct"] for t in ("two", "four")] == [3, 1]


def test_base_eval_scores_the_prepared_core_tasks(eval_home, monkeypatch, capsys):
    """base_eval finds the CORE tasks whose data is prepared (6 of the 10 here) and records, per task,
    what scoring.core_counts gives for the same model and items in one process: the same counts,
    and item by item the same choices' losses and answer."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(eval_home))
    core_counts, scored = scoring.core_counts, {}

    def recording_core_counts(model, tokenizer, task, items, **kwargs):
        counts = core_counts(model, tokenizer, task, items, **kwargs)
        scored.setdefault(task.name, []).extend(counts.records)
        return counts

    monkeypatch.setattr(scoring, "core_counts", recording_core_counts)
    # fp32 on both sides: core_counts below runs the model without autocast, and `auto` would pick
    # bf16 for base_eval on CPUs with native bf16, whose rounding can change which choice wins
    assert base_eval.main(["--run=b", "--eval-tokens=512", "--samples=0", "--max-examples=5", "--dtype=fp32"]) == 0
    out = capsys.readouterr().out
    assert "CORE subset (6/22 tasks): " in out and "not comparable with full CORE" in out
    _, entry = recorded(eval_home, "b", "base_eval")
    core = entry["core_subset"]
    assert set(core["results"]) == set(scored) == {"arc_easy", "arc_challenge", "copa", "piqa", "winogrande", "boolq"}
    tok = get_tokenizer()
    model, _, _ = loading.load_model(checkpoints.run_dir_of("b", ("base",)), None, "cpu", tok)
    for label, acc in core["results"].items():
        task = tasks.get(label)
        direct = core_counts(model, tok, task, task.items(5))
        assert (core["counts"][label]["correct"], core["counts"][label]["total"]) == (direct.correct, 5)
        assert acc == direct.accuracy
        for ours, theirs in zip(sorted(scored[label], key=lambda r: r["id"]), direct.records, strict=True):
            assert (ours["id"], ours["prediction"]) == (theirs["id"], theirs["prediction"])
            # losses recorded to 4 decimals: one rounding step apart at most
            assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])) <= 1.5e-4, (ours, theirs)
    assert core["core_subset"] == pytest.approx(sum(core["centered"].values()) / 6)
    assert entry["val_bpb"]["value"] > 0


def test_base_eval_without_evaluation_data_skips_core(tiny_home, tmp_path, monkeypatch, capsys):
    home = home_with_base_run(tiny_home, tmp_path / "home", BASE + ["--num-iterations=1", "--run=b"])
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    assert base_eval.main(["--eval-tokens=512", "--samples=0"]) == 0
    assert (
        "CORE subset (10/22 tasks): skipped, no evaluation data (run `python -m nanochat_fast.scripts"
        ".prepare_data --datasets=eval`)" in capsys.readouterr().out
    )
    _, entry = recorded(home, "b", "base_eval")
    assert "core_subset" not in entry
