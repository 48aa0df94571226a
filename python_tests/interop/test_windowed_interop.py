"""The windowed family end to end: base_train --arch=windowed records the family in meta.json and
every reader builds that model from it; nanochat's own checkpoint of the family (the fixture's
weights and its MuonAdamW state, as nanochat saved them) imports with its optimizer state; an
export loads in nanochat's load_model_from_dir with the same logits, when a nanochat checkout is
at hand (NANOCHAT_SRC, else /work/nanochat-src)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.nanochat_files import NANO_SPECIALS, write_tokenizer
from support.tiny_pipeline import TINY_LOOP, TINY_MODEL

from nanochat_fast.core import cli
from nanochat_fast.data.tokenizer import get_tokenizer
from nanochat_fast.model import loading
from nanochat_fast.model.windowed_gpt import WindowedGPT
from nanochat_fast.scripts import base_eval, base_train, chat_cli, export_nanochat, import_nanochat, mid_train
from nanochat_fast.train.training_config import ARCHES

FIXTURE = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "nanochat_windowed.pt"
NANOCHAT = Path(os.environ.get("NANOCHAT_SRC", "/work/nanochat-src"))
STEP = ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1", "--no-compile"]


def run_main(module, argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.run(module.main, argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_the_flag_names_every_family():
    assert tuple(loading.FAMILIES) == ARCHES


def test_train_evaluate_chat_and_mid_train_the_windowed_family(home, capsys):
    argv = TINY_MODEL + TINY_LOOP + STEP + ["--arch=windowed", "--window-pattern=SL", "--run=w", "--num-iterations=2"]
    code, out, err = run_main(base_train, argv, capsys)
    assert code == 0, err
    meta = json.loads(next((home / "runs" / "w" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["arch"] == "windowed" and meta["model_config"]["window_pattern"] == "SL"
    assert meta["args"]["muon_recipe"] == "polar-normuon" and meta["args"]["warmup_steps"] == 40  # the preset
    model, _, _ = loading.load_model(home / "runs" / "w", None, torch.device("cpu"), get_tokenizer())
    assert isinstance(model, WindowedGPT)
    evals = ["--max-examples=0", "--eval-tokens=512", "--samples=1", "--max-tokens=4", "--dtype=fp32"]
    code, out, err = run_main(base_eval, ["--run=w", *evals], capsys)
    assert code == 0 and "val bpb" in out, err
    code, out, err = run_main(chat_cli, ["--run=w", "--prompt=hello", "--max-tokens=4", "--dtype=fp32"], capsys)
    assert code == 0 and out.startswith("Assistant: "), err
    code, out, err = run_main(
        mid_train, TINY_LOOP + STEP + ["--base-run=w", "--num-iterations=1", "--run=mid_w", "--arch=windowed"], capsys
    )
    assert code == 0, err
    mid_meta = json.loads(next((home / "runs" / "mid_w" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert mid_meta["arch"] == "windowed"


def nanochat_checkpoint(folder: Path, fix: dict, step: int = 1):
    """The fixture as nanochat's checkpoint_manager saves it: model, meta and rank 0's optimizer file."""
    folder.mkdir(parents=True)
    torch.save(fix["stepped"], folder / f"model_{step:06d}.pt")
    optim = fix["optim_state"]
    for entry in optim["state"].values():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                entry[key] = value.float()
    torch.save(optim, folder / f"optim_{step:06d}_rank0.pt")
    meta = {"step": step, "val_bpb": 2.5, "model_config": fix["config"], "user_config": {}, "loop_state": {}}
    (folder / f"meta_{step:06d}.json").write_text(json.dumps(meta))


def test_nanochats_windowed_checkpoint_imports_with_its_combined_optimizer_state(nanochat_home, tmp_path, capsys):
    fix = torch.load(FIXTURE, weights_only=False)
    V = fix["config"]["vocab_size"]
    tok = get_tokenizer_of_size(V, tmp_path)
    folder = tmp_path / "nano" / "base_checkpoints" / "d4"
    nanochat_checkpoint(folder, fix)
    code, out, err = run_main(import_nanochat, [f"--from={folder}", f"--tokenizer={tok}", "--run=nw"], capsys)
    assert code == 0, err
    assert "AdamW after 1 updates" in out, out
    run_dir = nanochat_home / "runs" / "nw"
    model, _, meta = loading.load_model(run_dir, None, torch.device("cpu"), get_tokenizer())
    assert meta["arch"] == "windowed" and isinstance(model, WindowedGPT)
    for name, t in model.state_dict().items():
        assert torch.equal(t, fix["stepped"][name][:V] if t.size(0) == V and t.dim() == 2 else fix["stepped"][name])
    shards = torch.load(run_dir / "checkpoints/step_000001/optim_rank0.pt", weights_only=True)["optimizers"]
    adamw, muon = shards
    assert [len(g["param_names"]) for g in adamw["param_groups"]] == [1, 1, 2, 1, 1, 3]
    state = fix["optim_state"]["state"]
    lm_head = state[0]  # nanochat's first AdamW group: lm_head, its rows padded to 320
    assert torch.equal(adamw["state"]["lm_head.weight"]["exp_avg"], lm_head["exp_avg"][:V].float().reshape(-1))
    # Muon: each shape's stack, under the group's first parameter, row i is the group's i-th matrix
    muon_groups = [g for g in fix["groups"] if g["kind"] == "muon"]
    first_index = sum(1 for g in fix["groups"] if g["kind"] == "adamw")
    index = sum(len(g["param_names"]) for g in adamw["param_groups"])
    for g in muon["param_groups"]:
        stack = state[index]["momentum_buffer"].float()
        for i, name in enumerate(g["param_names"]):
            assert torch.equal(muon["state"][name]["momentum_buffer"], stack[i])
        index += len(g["param_names"])
    assert len(muon_groups) == len(muon["param_groups"]) and first_index == 6


def get_tokenizer_of_size(vocab_size: int, tmp_path: Path) -> Path:
    """A nanochat tokenizer folder of `vocab_size` tokens (specials included), trained here."""
    from nanochat_fast.data.tokenizer import Tokenizer

    words = ["tokenizer", "window", "value", "embedding", "smear", "backout", "residual", "lambda", "layer"]
    text = [" ".join(words[i % 9] + words[(i * 7) % 9][: i % 5] for i in range(3000))]
    tok = Tokenizer.train(text, vocab_size=vocab_size)
    tok = Tokenizer.train(text, vocab_size=2 * vocab_size - len(tok.enc._mergeable_ranks) - len(NANO_SPECIALS))
    assert len(tok.enc._mergeable_ranks) + len(NANO_SPECIALS) == vocab_size
    write_tokenizer(tmp_path / "tok", dict(tok.enc._mergeable_ranks), tok.pattern)
    return tmp_path / "tok"


@pytest.mark.skipif(not (NANOCHAT / "nanochat" / "gpt.py").is_file(), reason="no nanochat checkout (NANOCHAT_SRC)")
def test_our_export_loads_in_nanochats_loader_with_the_same_logits(nanochat_home, tmp_path, capsys):
    fix = torch.load(FIXTURE, weights_only=False)
    tok = get_tokenizer_of_size(fix["config"]["vocab_size"], tmp_path)
    nanochat_checkpoint(tmp_path / "nano" / "base_checkpoints" / "d4", fix)
    folder = tmp_path / "nano" / "base_checkpoints" / "d4"
    code, out, err = run_main(import_nanochat, [f"--from={folder}", f"--tokenizer={tok}", "--run=nw"], capsys)
    assert code == 0, err
    out_dir = tmp_path / "exported"
    code, out, err = run_main(export_nanochat, ["--run=nw", f"--out={out_dir}"], capsys)
    assert code == 0, err
    ids = fix["tokens"][:, :-1]
    model, _, _ = loading.load_model(nanochat_home / "runs" / "nw", None, torch.device("cpu"), get_tokenizer())
    with torch.no_grad():
        ours = model(ids)
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); "
        "from nanochat.checkpoint_manager import load_model_from_dir; "
        "m, _, _ = load_model_from_dir(sys.argv[2], torch.device('cpu'), 'eval'); "
        "torch.save(m(torch.load(sys.argv[3])).detach(), sys.argv[4])"
    )
    env = dict(os.environ, NANOCHAT_DTYPE="float32", TORCHDYNAMO_DISABLE="1", NANOCHAT_BASE_DIR=str(out_dir))
    subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(NANOCHAT),
            str(out_dir / "base_checkpoints"),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "theirs.pt"),
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    theirs = torch.load(tmp_path / "theirs.pt")
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-5
