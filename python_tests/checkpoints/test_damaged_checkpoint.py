"""
A checkpoint file damaged after saving (one flipped byte, in any file of the newest checkpoint) is
never loaded: --resume auto names the file and resumes from the previous checkpoint, --resume PATH,
base_eval, chat_cli and export_nanochat refuse it with one line and exit code 2. The recorded
digests are checked against hashlib over the files as they lie on disk (DCP shards included), and a
checkpoint saved before digests were recorded still loads, with a notice.
"""

import hashlib
import json
import shutil

import pytest
import torch
from support.tiny_pipeline import TINY_LOOP, TINY_MODEL, home_env, private_home, train_rows

from nanochat_fast import checkpoints
from nanochat_fast.checkpoints import checkpoint
from nanochat_fast.core import cli
from nanochat_fast.scripts import base_eval, base_train, chat_cli, export_nanochat

ARGS = TINY_MODEL + TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=256", "--eval-every=-1"]
ARGS += ["--num-iterations=4", "--save-every=2", "--no-compile", "--run=r"]
FILES = ["model.pt", "optim_rank0.pt", "meta.json", "COMPLETE"]


@pytest.fixture(scope="module")
def trained(tiny_home, tmp_path_factory):
    """A home with run r: complete checkpoints at steps 2 and 4."""
    home = tmp_path_factory.mktemp("damaged") / "home"
    shutil.copytree(tiny_home, home)
    with home_env(home):
        assert base_train.main(ARGS) == 0
    return home


@pytest.fixture
def home(trained, tmp_path, monkeypatch):
    return private_home(trained, tmp_path / "home", monkeypatch)


def flip_byte(path):
    """One byte of `path`, in its middle, inverted: the file keeps its size."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def exit_and_stderr(main, argv, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.run(main, argv)
    captured = capsys.readouterr()
    return stop.value.code, [line for line in captured.err.splitlines() if line.strip()]


def test_digests_are_those_of_the_files_on_disk(trained):
    ckpt = trained / "runs/r/checkpoints/step_000004"
    meta_bytes = (ckpt / "meta.json").read_bytes()
    listed = json.loads(meta_bytes)["files"]
    assert sorted(listed) == ["model.pt", "optim_rank0.pt"]
    for name, digest in listed.items():
        data = (ckpt / name).read_bytes()
        assert digest == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    complete = json.loads((ckpt / "COMPLETE").read_text())
    assert complete["meta.json"] == {"sha256": hashlib.sha256(meta_bytes).hexdigest(), "bytes": len(meta_bytes)}


def test_dcp_shards_are_hashed_as_written(tmp_path):
    state = {"w": torch.randn(64, 32), "b": torch.randn(7)}
    digests = checkpoint.write_shards(tmp_path / "model", state)
    on_disk = sorted(p.name for p in (tmp_path / "model").iterdir())
    assert sorted(digests) == on_disk and ".metadata" in on_disk
    for name, digest in digests.items():
        data = (tmp_path / "model" / name).read_bytes()
        assert digest == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


@pytest.mark.parametrize("name", FILES)
def test_resume_auto_skips_a_damaged_newest_checkpoint(name, home, capsys):
    newest = home / "runs/r/checkpoints/step_000004"
    flip_byte(newest / name)
    assert base_train.main(ARGS + ["--resume=auto"]) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("--resume auto: skipping step_000004")]
    assert len(skipped) == 1 and str(newest / name) in skipped[0], out
    assert "resumed from" in out and "step_000002 (step 2" in out
    assert [r["step"] for r in train_rows(home / "runs/r")] == [1, 2, 3, 4]


@pytest.mark.parametrize("name", FILES)
def test_every_reader_refuses_a_damaged_file_with_one_line(name, home, tmp_path, capsys):
    ckpt = home / "runs/r/checkpoints/step_000004"
    flip_byte(ckpt / name)
    commands = [
        (base_train.main, ARGS + [f"--resume={ckpt}"]),
        (base_eval.main, ["--run=r", "--max-examples=0", "--samples=0", "--eval-tokens=512"]),
        (chat_cli.main, ["--run=r", "--prompt=hi", "--max-tokens=2"]),
        (export_nanochat.main, ["--run=r", f"--out={tmp_path / 'nanochat'}"]),
    ]
    for main, argv in commands:
        code, err = exit_and_stderr(main, argv, capsys)
        assert code == 2 and len(err) == 1, (main.__module__, err)
        assert f"checkpoint file {ckpt / name}" in err[0], err[0]
    assert not (tmp_path / "nanochat").exists()


def test_an_intact_checkpoint_resumes_to_the_same_weights(home, capsys):
    """The check passes what it should: the step-2 checkpoint resumed ends on the uninterrupted run's weights."""
    final = checkpoints.load_model_state(home / "runs/r/checkpoints/step_000004")
    shutil.rmtree(home / "runs/r/checkpoints/step_000004")
    assert base_train.main(ARGS + ["--resume=auto"]) == 0
    again = checkpoints.load_model_state(home / "runs/r/checkpoints/step_000004")
    assert all(torch.equal(final[k], again[k]) for k in final)


def test_a_checkpoint_without_digests_loads_with_a_notice(home, capsys):
    ckpt = home / "runs/r/checkpoints/step_000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["files"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / "COMPLETE").write_bytes(b"ok\n")  # as written before digests were recorded
    state = checkpoints.load_model_state(ckpt)
    assert "records no file digests" in capsys.readouterr().err
    assert torch.equal(state["lm_head.weight"], torch.load(ckpt / "model.pt")["lm_head.weight"])


def test_large_writes_hashed_behind_the_disk_give_the_files_digest(tmp_path, monkeypatch):
    """Writes of 1 MiB and more are hashed on another thread after they are handed to the file: a
    saved tensor's storage in place, anything else (a large pickle, DCP's buffers) from a copy, with
    few copies in flight; every way gives the sha256 of the bytes on disk."""
    monkeypatch.setattr(checkpoint, "IN_FLIGHT_BYTES", 3 << 20)  # the writer waits for the hashing often
    big = torch.randn(1024, 1024)
    obj = {"big": big, "view": torch.randn(2048, 512)[100:], "bf16": big.bfloat16(), "pickled": list(range(400_000))}
    digest = checkpoint.write_tensors(tmp_path / "t.pt", obj)
    data = (tmp_path / "t.pt").read_bytes()
    assert digest == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)} and len(data) > 10 << 20
    assert torch.equal(checkpoint.read_tensors(tmp_path / "t.pt")["view"], obj["view"])
    shards = checkpoint.write_shards(tmp_path / "model", {"w": torch.randn(1024, 768), "b": torch.randn(7)})
    for name, digest in shards.items():
        data = (tmp_path / "model" / name).read_bytes()
        assert digest == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
