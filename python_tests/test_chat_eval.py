"""chat_eval and base_eval's CORE subset: counts on 2 gloo processes equal to 1, the results file the
report card reads, the vocabulary projection at the answer position alone, the CORE subset
against a hand count."""
import json

import pytest
import torch

from nanochat_fast import evaluation, models, runs, scoring, tasks
from nanochat_fast.gpt import GPTConfig
from nanochat_fast.scripts import base_eval, chat_eval, mid_train
from nanochat_fast.tasks.core import MULTIPLE_CHOICE, CoreTask
from nanochat_fast.tokenizer import get_tokenizer
from eval_home import write_eval_home, write_task
from stub_models import FavouriteTokenModel, byte_tokenizer
from test_gpt import random_model
from tiny_pipeline import TINY_LOOP, TINY_MODEL, home_env, home_with_base_run, run_script

BASE = TINY_MODEL + TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1"]
EVAL = ["--run=m", "--task=all", "--max-new-tokens=12", "--batch-size=3"]


@pytest.fixture(scope="module")
def eval_home(tiny_home, tmp_path_factory):
    """tiny_home + hand-written evaluation data + a base run `b` and a mid run `m`."""
    home = home_with_base_run(tiny_home, tmp_path_factory.mktemp("evals") / "home", BASE + ["--num-iterations=3", "--run=b"])
    write_eval_home(home, n=7)
    with home_env(home):
        assert mid_train.main(["--device-batch-size=4", "--total-batch-size=512", "--num-iterations=2",
                               "--eval-every=-1", "--base-run=b", "--run=m"]) == 0
    return home


def recorded(home, run, script):
    records = json.loads((home / "runs" / run / "evals.json").read_text())
    (step, entry), = records["steps"].items()
    return int(step), entry[script]


def test_two_processes_count_what_one_counts(eval_home, monkeypatch, capsys):
    """Every task, 7 examples each (HumanEval 3): rank 0 scores 4, rank 1 scores 3, and the summed
    counts are those of one process; the printout gives accuracy, chance and the 95% interval."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(eval_home))
    assert chat_eval.main(EVAL) == 0
    out = capsys.readouterr().out
    step, one = recorded(eval_home, "m", "chat_eval")
    assert step == 2 and list(one) == tasks.CHAT_TASK_NAMES
    for name, r in one.items():
        assert r["total"] == (3 if name == "HumanEval" else 7)
        lo, hi = scoring.wilson_interval(r["correct"], r["total"])
        assert f"{name}: {100 * r['correct'] / r['total']:.2f}% ({r['correct']}/{r['total']} test) | chance " \
               f"{100 * r['chance']:.0f}% | 95% interval {100 * lo:.1f}%-{100 * hi:.1f}%" in out
    assert "ChatCORE" in out and out.strip().endswith("next: python -m nanochat_fast.scripts.report")

    two = run_script("chat_eval", EVAL, eval_home, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    _, both = recorded(eval_home, "m", "chat_eval")
    assert {n: (r["correct"], r["total"]) for n, r in both.items()} == \
           {n: (r["correct"], r["total"]) for n, r in one.items()}
    assert both["ARC-Easy"]["settings"]["world_size"] == 2


def test_categorical_scoring_projects_only_the_answer_position():
    """With the lm_head hook the logits are (B, 1, V) and equal the full forward's at each row's last
    position; the hook is gone afterwards."""
    tok = byte_tokenizer()
    model = random_model(GPTConfig(sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=2,
                                   n_kv_head=2, n_embd=64), seed=1).eval()
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
    two = [{"id": str(i), "question": f"pick {i}", "choices": ["aaaa", "bbbb"], "answer": g}
           for i, g in enumerate([0, 1, 0, 0, 1])]
    four = [{"id": str(i), "question": f"four {i}", "choices": ["bbbb", "cccc", "aaaa", "dddd"], "answer": g}
            for i, g in enumerate([2, 0, 1, 3])]
    write_task(home, "hand-two", {"validation": two})
    write_task(home, "hand-four", {"validation": four})

    def item(ex):
        return {"query": ex["question"], "choices": ex["choices"], "gold": ex["answer"]}
    return [CoreTask("two", "hand-two", "validation", 2, " ", MULTIPLE_CHOICE, 0.5, item),
            CoreTask("four", "hand-four", "validation", 0, " ", MULTIPLE_CHOICE, 0.25, item)]


def test_core_subset_against_a_hand_count(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(tmp_path))
    tok = byte_tokenizer()
    model = FavouriteTokenModel(tok.get_vocab_size(), favourite=tok.encode("a")[0])
    core = hand_tasks(tmp_path)
    summary = evaluation.core_subset(model, tok, core, batch_size=3)
    assert [(summary["counts"][t]["correct"], summary["counts"][t]["total"]) for t in ("two", "four")] == [(3, 5), (1, 4)]
    assert summary["results"] == {"two": 0.6, "four": 0.25}
    assert summary["centered"] == pytest.approx({"two": (0.6 - 0.5) / 0.5, "four": 0.0})
    assert summary["core_subset"] == pytest.approx(0.1) and summary["name"] == "CORE subset (2/22 tasks)"
    # each rank's shard (every 2nd item) adds up to the whole
    shards = [evaluation.core_subset(model, tok, core, rank=r, world_size=2, batch_size=3)["counts"] for r in (0, 1)]
    assert [shards[0][t]["total"] + shards[1][t]["total"] for t in ("two", "four")] == [5, 4]
    assert [shards[0][t]["correct"] + shards[1][t]["correct"] for t in ("two", "four")] == [3, 1]


def test_base_eval_scores_the_prepared_core_tasks(eval_home, monkeypatch, capsys):
    """base_eval finds the CORE tasks whose data is prepared (6 of the 10 here) and records, per task,
    what scoring.core_counts gives for the same model and items in one process."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(eval_home))
    assert base_eval.main(["--run=b", "--eval-tokens=512", "--samples=0", "--max-examples=5"]) == 0
    out = capsys.readouterr().out
    assert "CORE subset (6/22 tasks): " in out and "not comparable with full CORE" in out
    _, entry = recorded(eval_home, "b", "base_eval")
    core = entry["core_subset"]
    assert set(core["results"]) == {"arc_easy", "arc_challenge", "copa", "piqa", "winogrande", "boolq"}
    tok = get_tokenizer()
    model, _, _ = models.load_model(runs.run_dir_of("b", ("base",)), None, "cpu", tok)
    for label, acc in core["results"].items():
        task = tasks.get(label)
        direct = scoring.core_counts(model, tok, task, task.items(5))
        assert (core["counts"][label]["correct"], core["counts"][label]["total"]) == (direct.correct, 5)
        assert acc == direct.accuracy
    assert core["core_subset"] == pytest.approx(sum(core["centered"].values()) / 6)
    assert entry["val_bpb"]["value"] > 0


def test_base_eval_without_evaluation_data_skips_core(tiny_home, tmp_path, monkeypatch, capsys):
    home = home_with_base_run(tiny_home, tmp_path / "home", BASE + ["--num-iterations=1", "--run=b"])
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    assert base_eval.main(["--eval-tokens=512", "--samples=0"]) == 0
    assert "CORE subset (10/22 tasks): skipped, no evaluation data (run `python -m nanochat_fast.scripts" \
           ".prepare_data --datasets=eval`)" in capsys.readouterr().out
    _, entry = recorded(home, "b", "base_eval")
    assert "core_subset" not in entry
