"""The training pipeline end to end on a tiny model: base_train, torchrun parity, mid_train,
base_eval and chat_cli."""

import json
import math
import shutil

import pytest
import torch
from support.tiny_pipeline import FP32, TINY_LOOP, TINY_MODEL, home_env, home_with_base_run, run_script, train_rows

from nanochat_fast import checkpoints
from nanochat_fast.scripts import base_eval, base_train, chat_cli, mid_train

BASE = TINY_MODEL + TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=512"]


@pytest.fixture(scope="module")
def base_run(tiny_home, tmp_path_factory):
    """One 30-step base run (in-process), shared by the tests that need a trained checkpoint."""
    return home_with_base_run(
        tiny_home, tmp_path_factory.mktemp("e2e") / "home", BASE + ["--num-iterations=30", "--eval-every=15", "--run=b"]
    )


def test_base_train_learns_and_writes_outputs(base_run):
    run_dir = base_run / "runs" / "b"
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert math.log(320) - 0.5 < first  # starts near uniform over the vocabulary
    assert last < 0.6 * first, (first, last)  # the grammar is learnable: the loss falls clearly
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert [e["step"] for e in evals] == [0, 15, 30] and evals[-1]["val_bpb"] < evals[0]["val_bpb"]
    ckpt = checkpoints.complete_checkpoints(run_dir)[-1]
    assert ckpt.name == "step_000030"
    meta = checkpoints.load_meta(ckpt)
    assert meta["step"] == 30 and meta["phase"] == "base" and meta["model_config"]["n_embd"] == 64
    state = torch.load(ckpt / "model.pt", weights_only=True, map_location="cpu")
    assert not any(k.startswith("_orig_mod") for k in state) and "lm_head.weight" in state
    report = (run_dir / "report.md").read_text()
    assert "val bpb at end" in report and "adamw_slice_update" in report
    assert (run_dir / "loss.png").stat().st_size > 1000


def test_torchrun_two_processes_match_one(tiny_home, tmp_path):
    """Same total batch: 1 process x 8 rows vs 2 processes x 4 rows see the same rows (the global
    row stream), so the loss curves agree to fp32 rounding: 1e-4 (5e-7 measured). fp32 is pinned
    (TINY_LOOP) for the model and Newton-Schulz: where `auto` picks bf16, bf16 rounding differs
    between the row splits (7e-4 measured on a Zen 4 with AVX512-BF16)."""
    args = TINY_MODEL + TINY_LOOP + ["--total-batch-size=512", "--num-iterations=8", "--eval-every=-1"]
    one = run_script(
        "base_train", args + ["--device-batch-size=8", "--run=one"], tiny_home_copy(tiny_home, tmp_path, "h1")
    )
    two = run_script(
        "base_train", args + ["--device-batch-size=4", "--run=two"], tiny_home_copy(tiny_home, tmp_path, "h2"), nproc=2
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a = [r["loss"] for r in train_rows(tmp_path / "h1" / "runs" / "one")]
    b = [r["loss"] for r in train_rows(tmp_path / "h2" / "runs" / "two")]
    assert len(a) == len(b) == 8
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    assert "cpu x 1 process(es)" in one.stdout and "cpu x 2 process(es)" in two.stdout
    assert "precision: fp32" in one.stdout and "precision: fp32" in two.stdout


def tiny_home_copy(tiny_home, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(tiny_home, dst)
    return dst


def test_mid_train_base_eval_and_chat(base_run, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(base_run))
    assert (
        mid_train.main(
            [
                "--device-batch-size=4",
                "--total-batch-size=512",
                "--num-iterations=6",
                "--eval-every=3",
                "--eval-tokens=512",
                "--base-run=b",
                "--run=m",
            ]
        )
        == 0
    )
    rows = train_rows(base_run / "runs" / "m")
    assert len(rows) == 6 and all(math.isfinite(r["loss"]) for r in rows)
    meta = checkpoints.load_meta(checkpoints.complete_checkpoints(base_run / "runs" / "m")[-1])
    assert meta["phase"] == "mid" and meta["base_checkpoint"].endswith("step_000030")
    capsys.readouterr()

    assert base_eval.main(["--run=b", "--eval-tokens=512", "--samples=1"]) == 0
    out = capsys.readouterr().out
    bpb = float(out.split("val bpb")[1].split(":")[1].split()[0])
    assert 0 < bpb < 8

    assert chat_cli.main(["--run=m", "--prompt=what is 2 plus 3?", "--max-tokens=12", "--temperature=0"]) == 0
    reply = capsys.readouterr().out
    assert reply.startswith("Assistant: ") and len(reply.strip()) > len("Assistant:")


def assistant_targets(x: torch.Tensor, y: torch.Tensor, start_id: int, end_id: int) -> torch.Tensor:
    """Which targets are the assistant's, found from the special tokens alone: after
    <|assistant_start|> up to and including <|assistant_end|> (rows start at a document's BOS)."""
    out = torch.zeros_like(y, dtype=torch.bool)
    for r in range(x.size(0)):
        inside = False
        for t in range(x.size(1)):
            tok = int(x[r, t])
            inside = True if tok == start_id else False if tok == end_id else inside
            out[r, t] = inside
    return out


def test_mid_train_loss_is_only_on_assistant_tokens(home):
    """The conversation loader masks every non-assistant target, and the training step's loss is
    the cross-entropy over the assistant's tokens alone, averaged over all of them in the step."""
    from contextlib import nullcontext

    import torch.nn.functional as F

    from nanochat_fast.data.dataloader import ConversationRowLoader
    from nanochat_fast.data.tokenizer import get_tokenizer
    from nanochat_fast.model.gpt import GPT, config_from_depth
    from nanochat_fast.optim import MuonRecipe
    from nanochat_fast.train.training_loop import train_step

    tok = get_tokenizer()
    start, end = tok.encode_special("<|assistant_start|>"), tok.encode_special("<|assistant_end|>")
    with ConversationRowLoader(device_batch_size=4, seq_len=64, prefetch=False) as loader:
        batches = [next(loader) for _ in range(2)]
    for x, y in batches:
        expected = assistant_targets(x, y, start, end)
        assert torch.equal(y != -1, expected)
        assert 0.1 < expected.float().mean() < 0.9  # both kinds of token are present

    torch.manual_seed(0)
    model = GPT(config_from_depth(2, tok.get_vocab_size(), 64, aspect_ratio=32, head_dim=32))
    model.init_weights()
    with torch.no_grad():
        logits = torch.cat([model(x) for x, _ in batches]).view(-1, tok.get_vocab_size())
        targets = torch.cat([y for _, y in batches]).view(-1)
        keep = targets != -1
        reference = F.cross_entropy(logits[keep], targets[keep]).item()  # assistant tokens only
    # fp32 throughout, stated: no autocast, Newton-Schulz in fp32 (the loss compared is the forward's)
    adamw, muon = model.setup_optimizers(muon_recipe=MuonRecipe.preset("quintic", ns_dtype="fp32"))
    result = train_step(model, [adamw, muon], batches, grad_clip=1.0, autocast_ctx=nullcontext())
    assert result.n_supervised == int(keep.sum())
    assert abs(result.loss - reference) < 1e-5


def test_val_bpb_is_the_same_on_one_and_two_processes(tiny_home, tmp_path):
    """The same initial weights and the same --device-batch-size give the same val bpb at step 0 on 1
    process and on 2 (gloo): validation reads the rows a single process reads, batch i on rank
    i mod 2 (5 batches here, so the ranks get 3 and 2), and all ranks' sums are added. In fp32
    (FP32): the 1e-6 bound is fp32 rounding of the sums, and `auto` would pick bf16 on CPUs that
    have it natively."""
    args = (
        TINY_MODEL
        + FP32
        + [
            "--device-batch-size=4",
            "--total-batch-size=512",
            "--num-iterations=1",
            "--eval-every=1",
            "--eval-tokens=1280",
            "--sample-every=-1",
        ]
    )
    home = tiny_home_copy(tiny_home, tmp_path, "h")
    with home_env(home):
        assert base_train.main(args + ["--run=one"]) == 0
    two = run_script("base_train", args + ["--run=two"], home, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]

    def val_bpb_at_step_0(run):
        rows = [json.loads(line) for line in (home / "runs" / run / "metrics.jsonl").read_text().splitlines()]
        return next(r["val_bpb"] for r in rows if r["kind"] == "eval" and r["step"] == 0)

    one_bpb, two_bpb = val_bpb_at_step_0("one"), val_bpb_at_step_0("two")
    assert abs(one_bpb - two_bpb) < 1e-6, (one_bpb, two_bpb)
