"""chat_sft: one conversation per row with only the assistant's tokens supervised (padding never),
the default mixture, 1 vs 2 gloo processes, exact resume, and the printed next commands."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from support.eval_home import gsm8k, mc, write_eval_home, write_task
from support.faults import preempted_and_resumed
from support.tiny_gpt import random_model
from support.tiny_pipeline import FP32, TINY_LOOP, TINY_MID, TINY_MODEL, home_env, home_with_base_run, run_script

from nanochat_fast import checkpoints
from nanochat_fast.data.dataloader import ConversationMixture, PaddedConversationLoader
from nanochat_fast.data.tokenizer import get_tokenizer
from nanochat_fast.evals import tasks
from nanochat_fast.scripts import chat_eval, chat_sft, mid_train
from nanochat_fast.train.stage_data import ConversationShards

BASE = TINY_MODEL + TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1"]
# fp32 pinned (FP32: model and Newton-Schulz), as in BASE: the runs are compared to 1e-4..1e-5 and
# bitwise; with `auto` a CPU with native bf16 would train in bf16, whose rounding differs between
# 1 and 2 processes (2.8e-4 in val bpb measured on an AVX512-BF16 Xeon)
SFT = [
    "--device-batch-size=4",
    "--target-examples-per-step=8",
    "--eval-tokens=512",
    "--chat-eval-examples=4",
    "--source-run=m",
] + FP32


@pytest.fixture(scope="module")
def sft_home(tiny_home, tmp_path_factory):
    """tiny_home + hand-written evaluation data + a 4-step base run `b` and a 2-step mid run `m`."""
    home = home_with_base_run(
        tiny_home, tmp_path_factory.mktemp("sft") / "home", BASE + ["--num-iterations=4", "--run=b"]
    )
    write_eval_home(home)
    with home_env(home):
        assert mid_train.main(TINY_MID) == 0
    return home


def supervised_by_special_tokens(ids: list[int], tok) -> list[bool]:
    """Which tokens the assistant says, from the special tokens alone: after <|assistant_start|> up
    to and including <|assistant_end|>, except a tool's output (<|output_start|> ... <|output_end|>)."""
    sp = {
        name: tok.encode_special(name)
        for name in ("<|assistant_start|>", "<|assistant_end|>", "<|output_start|>", "<|output_end|>")
    }
    out, speaking, tool = [], False, False
    for t in ids:
        if t == sp["<|assistant_start|>"]:
            out.append(False)
            speaking = True
            continue
        tool = tool or t == sp["<|output_start|>"]
        out.append(speaking and not tool)
        tool = tool and t != sp["<|output_end|>"]
        speaking = speaking and t != sp["<|assistant_end|>"]
    return out


def test_rows_hold_one_conversation_with_only_the_assistant_supervised(sft_home, monkeypatch):
    """Each row is one conversation from its <|bos|>, targets the next token where the assistant
    speaks (tool outputs excluded) and -1 elsewhere, padding <|assistant_end|> with targets -1; the
    loss of the padded batch is the sum of each conversation's loss computed alone, unpadded."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(sft_home))
    tok = get_tokenizer()
    convs = [
        {
            "messages": [
                {"role": "user", "content": "what is 2 plus 2?"},
                {"role": "assistant", "content": "2 plus 2 is 4."},
            ]
        }
    ]
    convs += [
        {
            "messages": [
                {"role": "user", "content": ex["question"]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "so "},
                        {"type": "python", "text": "3+4"},
                        {"type": "python_output", "text": "7"},
                        {"type": "text", "text": " #### 7"},
                    ],
                },
            ]
        }
        for ex in gsm8k(2)
    ]
    convs.append(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "bye now"},
            ]
        }
    )
    mixture = ConversationMixture([("hand", ConversationShards(convs, tok, "hand"))], shuffle=False)
    pad = tok.encode_special("<|assistant_end|>")
    loader = PaddedConversationLoader(mixture, device_batch_size=4, seq_len=200, pad_id=pad)
    x, y = next(loader)
    rendered = [tok.render_conversation(c)[0] for c in convs]
    assert x.shape == (4, max(map(len, rendered)) - 1)
    for row, ids in enumerate(rendered):
        n = len(ids) - 1
        assert x[row, :n].tolist() == ids[:-1] and (x[row, n:] == pad).all()
        supervised = supervised_by_special_tokens(ids, tok)[1:]
        assert y[row, :n].tolist() == [t if s else -1 for t, s in zip(ids[1:], supervised)]
        assert (y[row, n:] == -1).all()  # padding is never a target
        assert 0 < sum(supervised) < n
    assert x[:, 0].eq(tok.get_bos_token_id()).all() and (x[:, 1:] == tok.get_bos_token_id()).sum() == 0

    model = random_model(mid_config(sft_home), seed=3)
    with torch.no_grad():
        batch_loss = model(x, y, loss_reduction="sum").item()
        alone = sum(
            F.cross_entropy(
                model(x[r : r + 1, : len(ids) - 1])[0], y[r, : len(ids) - 1], ignore_index=-1, reduction="sum"
            ).item()
            for r, ids in enumerate(rendered)
        )
    assert batch_loss == pytest.approx(alone, rel=1e-5)

    loader = PaddedConversationLoader(mixture, device_batch_size=2, seq_len=8, pad_id=pad)
    x, y = next(loader)  # too long for the rows: cut to seq_len, the end dropped
    assert x.shape == (2, 8) and x[0].tolist() == rendered[0][:8]


def mid_config(home):
    from nanochat_fast.model.gpt import GPTConfig

    return GPTConfig(**checkpoints.load_meta(checkpoints.complete_checkpoints(home / "runs" / "m")[-1])["model_config"])


def test_default_mixture_and_its_report(sft_home, monkeypatch, capsys):
    """The mixture holds the chat dataset and the prepared tasks' train splits (never an evaluated
    split); the run is an sft checkpoint from the mid run, its evaluations are in its report."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(sft_home))
    assert chat_sft.main(SFT + ["--num-iterations=2", "--eval-every=2", "--run=mix"]) == 0
    out = capsys.readouterr().out
    data = next(line for line in out.splitlines() if line.startswith("data: "))
    for part in (
        "chat 360",
        "ARC-Easy validation 5",
        "ARC-Challenge validation 3",
        "MMLU dev 2",
        "MMLU validation 4",
        "GSM8K dev 2",
        "SpellingBee train 4",
    ):
        assert part in data, data
    assert "test" not in data and "HumanEval" not in data
    run_dir = sft_home / "runs" / "mix"
    meta = checkpoints.load_meta(checkpoints.complete_checkpoints(run_dir)[-1])
    assert meta["phase"] == "sft" and meta["base_checkpoint"].endswith("m/checkpoints/step_000002")
    assert meta["device"]["type"] == "cpu" and meta["device"]["processes"] == 1
    assert "| arc_easy_acc (last eval) |" in (run_dir / "report.md").read_text()
    assert (
        out.strip().splitlines()[-1] == "next: python -m nanochat_fast.scripts.chat_eval --run=mix --max-examples=100"
    )


def test_without_a_conversation_dataset_every_50th_is_held_out(sft_home, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    shutil.copytree(sft_home, home)
    shutil.rmtree(home / "tokens" / "chat")
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    assert chat_sft.main(SFT + ["--num-iterations=1", "--eval-every=-1", "--run=alone"]) == 0
    data = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data: "))
    assert "ARC-Easy validation 4 + " in data and "val ARC-Easy validation 1 + " in data, data
    assert "every 50th conversation is held out" in data


def evals_and_losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


def test_two_processes_train_as_one(sft_home, tmp_path):
    """8 conversations per step: 1 process x 4 rows x 2 micro-steps, or 2 processes x 4 rows x 1;
    the same conversations, losses, val bpb and in-training accuracies."""
    args = SFT + ["--num-iterations=4", "--eval-every=2"]
    with home_env(sft_home):
        assert chat_sft.main(args + ["--run=one"]) == 0
    two = run_script("chat_sft", args + ["--run=two"], sft_home, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    (loss1, evals1), (loss2, evals2) = (evals_and_losses(sft_home / "runs" / r) for r in ("one", "two"))
    assert len(loss1) == len(loss2) == 4
    assert max(abs(a - b) for a, b in zip(loss1, loss2)) < 1e-4, (loss1, loss2)
    assert [e["step"] for e in evals1] == [e["step"] for e in evals2] == [0, 2, 4]
    for a, b in zip(evals1, evals2):
        assert abs(a["val_bpb"] - b["val_bpb"]) < 1e-5
        assert (a["arc_easy_acc"], a["mmlu_acc"]) == (b["arc_easy_acc"], b["mmlu_acc"])


def test_stop_and_resume_is_exact(sft_home, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(sft_home))
    args = SFT + ["--num-iterations=6", "--eval-every=-1", "--deterministic"]
    a, b = preempted_and_resumed(chat_sft.main, args, sft_home / "runs", 3, capsys)
    assert [r["step"] for r in b] == list(range(1, 7)) and [r["loss"] for r in a] == [r["loss"] for r in b]


def test_batch_must_divide_into_examples(sft_home, monkeypatch):
    from nanochat_fast.core.errors import UserError

    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(sft_home))
    with pytest.raises(UserError, match="nearest valid values: 8 or 12"):
        chat_sft.main(SFT[1:] + ["--device-batch-size=4", "--target-examples-per-step=10", "--run=x"])


def test_prompts_longer_than_the_context_stop_neither_training_nor_evaluation(sft_home, tmp_path, monkeypatch, capsys):
    """Two MMLU questions of ~1,000 tokens, past the rotary table of the 64-position model (640):
    chat_sft with the default mixture, its in-training MMLU evaluation included, finishes; chat_eval
    --task=MMLU scores every question and says how many prompts it cut to their end."""
    home = tmp_path / "home"
    shutil.copytree(sft_home, home)
    long = [
        dict(e, question=e["question"] + " Think of the colour of the evening sky." * 25) for e in mc("mmlu-long", 2)
    ]
    write_task(
        home,
        "mmlu",
        {
            "dev": mc("mmlu-dev", 2),
            "validation": mc("mmlu-val", 4) + long,
            "test": [dict(e, subject="colours") for e in mc("mmlu", 6) + long],
        },
    )
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    assert chat_sft.main(SFT + ["--num-iterations=2", "--eval-every=1", "--run=long"]) == 0
    assert "mmlu acc" in capsys.readouterr().out
    assert chat_eval.main(["--run=long", "--task=MMLU", "--dtype=fp32"]) == 0
    out = capsys.readouterr().out
    tok, mmlu = get_tokenizer(), tasks.get("MMLU")
    lengths = [len(tok.render_for_completion(mmlu.conversation(ex))) for ex in mmlu.load()]
    assert len(lengths) == 8 and max(lengths) > 10 * 64
    assert (
        f"| {sum(n > 64 for n in lengths)} of 8 prompts longer than the context were truncated (their end kept)" in out
    ), out
