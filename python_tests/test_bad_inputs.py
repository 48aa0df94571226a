"""Every user mistake is one line on stderr naming the flag or file, exit code 2, no traceback.

The table calls each script's main(argv) in-process through cli.run (what `python -m` runs);
one case also runs as a real subprocess."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from nanochat_fast import checkpoint, cli
from nanochat_fast.scripts import base_eval, base_train, chat_cli, mid_train, prepare_data, tok_train
from tiny_pipeline import ROOT, TINY_LOOP, TINY_MODEL, disk_full_at, home_with_base_run

TINY = TINY_MODEL + TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1"]
SCRIPTS = {"base_train": base_train, "mid_train": mid_train, "base_eval": base_eval, "chat_cli": chat_cli,
           "prepare_data": prepare_data, "tok_train": tok_train}


@pytest.fixture(scope="module")
def trained_home(tiny_home, tmp_path_factory):
    """tiny_home plus a 4-step base run `b` (checkpoints at steps 2 and 4)."""
    return home_with_base_run(tiny_home, tmp_path_factory.mktemp("bad") / "home",
                              TINY + ["--num-iterations=4", "--save-every=2", "--run=b"])


def truncate(path, keep=100):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def first(pattern, home):
    return sorted(home.glob(pattern))[0]


def retrain_tokenizer(home):
    assert tok_train.main(["--vocab-size=300", "--no-tokenize"]) == 0


CASES = [
    # (id, script, argv, setup(home), expected text in the one line)
    ("unknown-flag", "base_train", ["--bogus=1"], None, "unrecognized arguments: --bogus=1"),
    ("zero-depth", "base_train", ["--depth=0"], None, "argument --depth: must be a positive integer, got 0"),
    ("negative-batch", "base_train", ["--device-batch-size=-4"], None, "--device-batch-size: must be a positive integer"),
    ("bad-fraction", "base_train", ["--warmdown-ratio=1.5"], None, "--warmdown-ratio: must be in [0, 1]"),
    ("batch-not-divisible", "base_train", TINY + ["--total-batch-size=1000"], None,
     "nearest valid values: 768 or 1024"),
    ("no-horizon", "base_train", TINY + ["--target-param-data-ratio=-1"], None, "no training horizon"),
    ("seq-len-above-checkpoint", "mid_train", ["--base-run=b", "--max-seq-len=128"], None,
     "above the base model's sequence_len 64"),
    ("data-missing", "base_train", TINY + ["--run=x"], lambda h: shutil.rmtree(h / "tokens" / "base"),
     "prepare_data"),
    ("data-empty", "base_train", TINY + ["--run=x"],
     lambda h: [p.unlink() for p in (h / "tokens" / "base" / "train").iterdir()], "no token shards in"),
    ("token-shard-truncated", "base_train", TINY + ["--run=x"],
     lambda h: truncate(first("tokens/base/train/*.tokens.npy", h)), "token shard"),
    ("parquet-corrupt", "prepare_data", ["--stage=tokens", "--overwrite"],
     lambda h: truncate(first("data/base/train/*.parquet", h)), ".parquet"),
    ("tokenizer-missing", "base_train", TINY + ["--run=x"], lambda h: shutil.rmtree(h / "tokenizer"), "tok_train"),
    ("tokenizer-not-the-checkpoints", "base_eval", ["--run=b"], retrain_tokenizer,
     "is not the one checkpoint"),
    ("shards-of-another-tokenizer", "base_train", TINY + ["--run=x"], retrain_tokenizer, "another tokenizer"),
    ("checkpoint-of-another-config", "base_train", TINY[:1] + ["--depth=3"] + TINY[1:] + ["--run=b", "--resume=auto"],
     None, "another model config: n_layer=2 (this run: 3)"),
    ("checkpoint-truncated", "base_eval", ["--run=b"],
     lambda h: truncate(h / "runs/b/checkpoints/step_000004/model.pt"), "truncated or corrupt"),
    ("checkpoint-meta-corrupt", "base_eval", ["--run=b"],
     lambda h: (h / "runs/b/checkpoints/step_000004/meta.json").write_text("{"), "meta.json is corrupt"),
    ("resume-path-not-a-checkpoint", "base_train", TINY + ["--resume=/nonexistent/step_000001"], None,
     "not a complete checkpoint directory"),
    ("run-dir-exists", "base_train", TINY + ["--run=b"], None, "already exists: pass --resume auto"),
    ("out-dir-not-writable", "base_train", TINY + ["--out-dir=/dev/null/run"], None, "cannot write to run directory"),
    ("no-such-run", "base_eval", ["--run=nope"], None, "no run named 'nope'"),
    ("no-mid-run-to-chat-with", "chat_cli", ["--prompt=hi"], None, "no mid run with a complete checkpoint"),
    ("no-such-step", "base_eval", ["--run=b", "--step=3"], None, "no complete checkpoint at step 3 (complete steps: 2, 4)"),
    ("cuda-without-gpu", "base_train", ["--device-type=cuda"], None, "no CUDA GPU is available"),
    ("extra-conversations-malformed", "mid_train", ["--base-run=b", "--extra-conversations={tmp}/bad.jsonl"],
     lambda h: (h.parent / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n'),
     "bad.jsonl line 2: expected"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, trained_home, tmp_path, monkeypatch, capsys):
    name, script, argv, setup, expected = case
    if name == "cuda-without-gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    home = tmp_path / "home"
    shutil.copytree(trained_home, home)
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    if setup:
        setup(home)
        capsys.readouterr()
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        cli.run(SCRIPTS[script].main, argv)
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip() and "%|" not in l]  # not the progress bars
    assert exit_info.value.code == 2, err
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err


def test_mps_with_several_processes(trained_home, monkeypatch, capsys):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exit_info:
        cli.run(base_train.main, ["--device-type=mps"])
    assert exit_info.value.code == 2
    assert "MPS runs a single process but 2 were launched" in capsys.readouterr().err


def test_disk_full_while_saving_keeps_the_previous_checkpoint(trained_home, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    shutil.copytree(trained_home, home)
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    with disk_full_at("step_000004"), pytest.raises(SystemExit) as exit_info:
        cli.run(base_train.main, TINY + ["--num-iterations=6", "--save-every=2", "--run=full"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "disk full" in err and "step_000002 is intact" in err
    run_dir = home / "runs" / "full"
    assert [p.name for p in checkpoint.complete_checkpoints(run_dir)] == ["step_000002"]
    assert not (run_dir / "checkpoints" / "step_000004").exists()
    checkpoint.load_model_state(run_dir / "checkpoints" / "step_000002")


def test_a_real_process_exits_2_with_one_line(trained_home):
    out = subprocess.run([sys.executable, "-m", "nanochat_fast.scripts.base_train", "--total-batch-size=0"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "python -m nanochat_fast.scripts.base_train: error: argument --total-batch-size: "
        "must be a positive integer, got 0 (see --help)"]
