"""A home made by the package before its modules moved into folders
(support/fixtures/old_layout/home/, written by make_old_layout.py at commit 50e8375) still loads:
its built-in chat dataset is up to date without a download, its checkpoint evaluates, chats,
resumes and starts a mid-training on its conversations. Everything runs through the public entry
points, as processes, so this test reads the same before and after the modules move."""

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest
from support.repo_paths import FIXTURES
from support.tiny_pipeline import run_script, train_rows

FIXTURE = FIXTURES / "old_layout"
_spec = importlib.util.spec_from_file_location("make_old_layout", FIXTURE / "make_old_layout.py")
recipe = importlib.util.module_from_spec(_spec)  # the flags the home was made with
_spec.loader.exec_module(recipe)

OLD_RUN = Path("runs") / recipe.BASE_RUN
OLD_CKPT = OLD_RUN / "checkpoints" / f"step_{recipe.BASE_STEPS:06d}"
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}  # any pip download fails
FP32 = ["--dtype=fp32"]


@pytest.fixture
def old_home(tmp_path):
    home = tmp_path / "home"
    shutil.copytree(FIXTURE / "home", home)
    return home


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def run(name: str, args: list[str], home: Path):
    result = run_script(name, args, home, timeout=180, env=OFFLINE)
    assert result.returncode == 0, (
        f"{name} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    assert not (home / "downloads").exists(), f"{name} tried to download"
    return result


def test_prepared_chat_data_is_up_to_date(old_home):
    old = FIXTURE / "home"
    manifest = read_json(old / "data" / "chat" / "manifest.json")
    assert "nanochat_fast.sources.synthetic_conversations" in [s["spec"] for s in manifest["sources"]]
    train, val = manifest["docs"]["train"], manifest["docs"]["val"]
    out = run("prepare_data", recipe.CHAT_FLAGS, old_home).stdout
    assert f"data/chat is up to date ({train} train + {val} val documents)" in out, out
    for path in ["manifest.json", "train/shard_00000.parquet", "val/shard_00000.parquet"]:  # not rebuilt
        assert (old_home / "data" / "chat" / path).read_bytes() == (old / "data" / "chat" / path).read_bytes(), path
    # tokenized with the old tokenizer (again, where the checkout changed the shards' mtimes): the same tokens
    tokens = sum(read_json(p)["n_tokens"] for p in (old / "tokens" / "chat").glob("*/shard_*.json"))
    assert f"tokens/chat: {train + val:,} documents, {tokens:,} tokens" in out, out


def test_old_checkpoint_evaluates_and_chats(old_home):
    out = run(
        "base_eval",
        [f"--run={recipe.BASE_RUN}", "--eval-tokens=512", "--max-examples=0", "--samples=1", "--max-tokens=8"] + FP32,
        old_home,
    ).stdout
    assert f"checkpoint: {old_home / OLD_CKPT}" in out, out
    # the dataset comes from the checkpoint's meta (args.dataset): base_eval was given none
    found = re.search(r"val bpb \((\w+) val split, up to 512 tokens\): (\S+)", out)
    assert found and found.group(1) == recipe.PROSE, out
    assert math.isfinite(float(found.group(2))) and 0 < float(found.group(2)) < 20, out
    assert "'The king said' -> '" in out, out

    chat = run(
        "chat_cli",
        [f"--run={recipe.BASE_RUN}", "--prompt=what is 2 plus 3?", "--max-tokens=8", "--temperature=0"] + FP32,
        old_home,
    )
    assert chat.stdout.startswith("Assistant: ") and len(chat.stdout.strip()) > len("Assistant:"), chat.stdout
    assert f"{old_home / OLD_CKPT} is a base (not mid-trained) checkpoint" in chat.stderr, chat.stderr  # meta's phase


def test_old_run_resumes(old_home):
    steps = recipe.BASE_STEPS + 2
    args = [a for a in recipe.BASE_FLAGS if not a.startswith("--num-iterations=")]
    out = run("base_train", args + [f"--num-iterations={steps}", "--resume=auto"], old_home).stdout
    # step and world size come from the old meta.json, the optimizer state from optim_rank0.pt
    assert f"resumed from {old_home / OLD_CKPT} (step {recipe.BASE_STEPS}, saved with 1 process(es))" in out, out
    rows = train_rows(old_home / OLD_RUN)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and all(math.isfinite(r["loss"]) for r in rows)
    meta = read_json(old_home / OLD_RUN / "checkpoints" / f"step_{steps:06d}" / "meta.json")
    old_meta = read_json(FIXTURE / "home" / OLD_CKPT / "meta.json")
    assert meta["step"] == steps and meta["model_config"] == old_meta["model_config"]
    assert meta["loader_state"]["dataset"] == recipe.PROSE


def test_mid_training_starts_from_old_run_on_old_conversations(old_home):
    args = [
        "--dtype=fp32",
        "--ns-dtype=fp32",
        "--device-batch-size=4",
        "--total-batch-size=512",
        "--no-compile",
        f"--base-run={recipe.BASE_RUN}",
        f"--dataset={recipe.CONVS}",
        "--num-iterations=2",
        "--eval-every=-1",
        "--eval-tokens=512",
        "--run=new_mid",
    ]
    out = run("mid_train", args, old_home).stdout
    assert str(old_home / OLD_CKPT) in out, out  # "starting from: <the old checkpoint>"
    run_dir = old_home / "runs" / "new_mid"
    rows = train_rows(run_dir)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    meta = read_json(run_dir / "checkpoints" / "step_000002" / "meta.json")
    old_meta = read_json(FIXTURE / "home" / OLD_CKPT / "meta.json")
    assert meta["phase"] == "mid" and meta["base_checkpoint"] == str(old_home / OLD_CKPT)
    assert meta["model_config"] == old_meta["model_config"] and meta["tokenizer"] == old_meta["tokenizer"]
    assert meta["loader_state"]["dataset"] == recipe.CONVS
