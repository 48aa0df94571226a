"""
Checkpoints of --sharding=fsdp runs: the model saved as DCP shards by every rank, resumed on another
world size and sharding (2 fsdp -> 3 zero2, 2 fsdp -> 1), single-file checkpoints resumed under
fsdp, the one-command export, and a half-written checkpoint skipped by --resume auto.

The reference is the uninterrupted 2-process fsdp run: a resumed run's next losses must equal its
losses at the same steps (fp32; the data order does not depend on the world size).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.tiny_pipeline import DEFAULT_LOOP, FP32, TINY_MODEL, home_env, run_script, train_rows

from nanochat_fast import checkpoints
from nanochat_fast.core.errors import UserError
from nanochat_fast.scripts import base_train, export_checkpoint

ARGS = TINY_MODEL + DEFAULT_LOOP + FP32 + ["--total-batch-size=768", "--num-iterations=10", "--eval-every=-1"]


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in train_rows(run_dir)}


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def home(tiny_home, tmp_path_factory):
    home = tmp_path_factory.mktemp("fsdp_ckpt") / "home"
    shutil.copytree(tiny_home, home)
    runs = home / "runs"
    # the uninterrupted run: 2 processes, fsdp, DCP checkpoints at steps 5 and 10
    ok(
        run_script(
            "base_train",
            ARGS + ["--device-batch-size=6", "--sharding=fsdp", "--save-every=5", "--run=f"],
            home,
            nproc=2,
        )
    )
    step5 = runs / "f/checkpoints/step_000005"
    # 3 processes, zero2 (4 rows each), from the fsdp run's step 5
    ok(run_script("base_train", ARGS + ["--device-batch-size=4", f"--resume={step5}", "--run=r3"], home, nproc=3))
    # 1 process (3 micro-steps of 4 rows) from step 5; a single-file checkpoint at step 7
    ok(
        run_script(
            "base_train", ARGS + ["--device-batch-size=4", f"--resume={step5}", "--save-every=7", "--run=r1"], home
        )
    )
    # and back to 2 processes, fsdp, from that single-file checkpoint
    ok(
        run_script(
            "base_train",
            ARGS
            + [
                "--device-batch-size=6",
                "--sharding=fsdp",
                f"--resume={runs / 'r1/checkpoints/step_000007'}",
                "--run=o2",
            ],
            home,
            nproc=2,
        )
    )
    return home


def test_fsdp_checkpoint_is_sharded_by_every_rank(home):
    step5 = home / "runs/f/checkpoints/step_000005"
    assert sorted(p.name for p in (step5 / "model").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (step5 / "model.pt").exists() and (step5 / "COMPLETE").exists()
    assert (home / "runs/r1/checkpoints/step_000007/model.pt").exists()  # zero2 keeps the single file


@pytest.mark.parametrize("run, first", [("r3", 6), ("r1", 6), ("o2", 8)])
def test_resume_on_another_world_size_and_sharding(home, run, first):
    ref, resumed = losses(home / "runs/f"), losses(home / f"runs/{run}")
    steps = list(range(first, 11))
    assert sorted(resumed) == steps
    diffs = [abs(resumed[s] - ref[s]) for s in steps]
    print(f"{run}: losses of steps {steps} differ from the uninterrupted run's by at most {max(diffs):.1e}")
    assert max(diffs) < 1e-5
    assert ref[steps[-1]] < ref[1] - 1  # and the run learned: the comparison is not of constants


def test_export_writes_the_whole_model(home, capsys):
    ckpt = home / "runs/f/checkpoints/step_000010"
    with home_env(home):
        assert export_checkpoint.main(["--run=f", f"--output={home / 'f10.pt'}"]) == 0
        assert export_checkpoint.main(["--run=f"]) == 0
    exported = torch.load(home / "f10.pt", weights_only=True)
    assert torch.load(ckpt / "model.pt", weights_only=True).keys() == exported.keys()
    # the shards of both ranks assembled: equal to the 3-process zero2 run's step 10 to rounding
    other = torch.load(home / "runs/r3/checkpoints/step_000010/model.pt", weights_only=True)
    for k, v in exported.items():
        assert v.shape == other[k].shape and v.dtype == torch.float32
        torch.testing.assert_close(v, other[k], rtol=1e-4, atol=1e-5)


def test_half_written_checkpoint_is_ignored_with_a_notice(home, capsys):
    run = home / "runs/f"
    half = run / "checkpoints/step_000011"
    shutil.copytree(run / "checkpoints/step_000010", half)
    (half / "COMPLETE").unlink()
    with home_env(home):
        assert base_train.main(ARGS + ["--device-batch-size=12", "--run=f", "--resume=auto"]) == 0
    out = capsys.readouterr().out
    assert f"ignoring {half}, a save that did not finish" in out
    assert "using " + str(run / "checkpoints/step_000010") in out
    assert not half.exists() and checkpoints.complete_checkpoints(run)[-1].name == "step_000010"


def test_truncated_shard_is_a_user_error(home, tmp_path):
    broken = tmp_path / "step_000005"
    shutil.copytree(home / "runs/f/checkpoints/step_000005", broken)
    shard = broken / "model/__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UserError, match=r"checkpoint file .*__1_0\.distcp has 100 bytes, [0-9,]+ were recorded"):
        checkpoints.load_model_state(broken)  # the digests recorded by the rank that wrote it
    meta = json.loads((broken / "meta.json").read_text())
    assert {"model/__0_0.distcp", "model/__1_0.distcp", "model/.metadata"} <= set(meta.pop("files"))
    (broken / "meta.json").write_text(json.dumps(meta))
    (broken / "COMPLETE").write_bytes(b"ok\n")  # as saved before digests were recorded: DCP's own check
    with pytest.raises(UserError, match="model shards in .* are missing, truncated or corrupt"):
        checkpoints.load_model_state(broken)
