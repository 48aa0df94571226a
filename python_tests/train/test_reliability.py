"""Reliability of training runs: atomic checkpoints under kill -9, exact resume (bitwise on one
process, 1e-6 on two), resume on another world size, SIGTERM under torchrun, the NaN guard."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.faults import nan_loss_at_step, preempted_and_resumed
from support.repo_paths import SUPPORT
from support.tiny_pipeline import (
    ROOT,
    TINY_LOOP,
    TINY_MODEL,
    disk_full_at,
    last_model_state,
    run_script,
    torchrun,
    train_rows,
)

from nanochat_fast import checkpoints
from nanochat_fast.core.cli import UserError
from nanochat_fast.scripts import base_train
from nanochat_fast.train import next_steps

TINY = TINY_MODEL + TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1"]


def popen(name, args, home, nproc=1, env=None, slow_writes=0.0):
    """The script as a process; with `slow_writes`, each checkpoint tensor file takes that many
    seconds longer (python_tests/support/slow_checkpoint_writes.py)."""
    cmd = [sys.executable, "-m", f"nanochat_fast.scripts.{name}", *args]
    if slow_writes:
        cmd = [
            sys.executable,
            str(SUPPORT / "slow_checkpoint_writes.py"),
            str(slow_writes),
            f"nanochat_fast.scripts.{name}",
            *args,
        ]
    if nproc > 1:
        cmd = [*torchrun(nproc), "-m", f"nanochat_fast.scripts.{name}", "--", *args]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "NANOCHAT_FAST_HOME": str(home), "OMP_NUM_THREADS": "1", **(env or {})},
    )


def wait_until(predicate, proc, timeout=120):
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"process ended early (rc {proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    """Direct child processes of `pid`, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_kill_during_checkpoint_write_keeps_the_previous_one(home):
    run_dir = home / "runs" / "k"
    proc = popen(
        "base_train", TINY + ["--num-iterations=30", "--save-every=5", "--run=k"], home, slow_writes=1.5
    )  # each checkpoint file takes >= 1.5 s
    wait_until(lambda: (run_dir / "checkpoints" / "step_000010.partial").exists(), proc)
    proc.send_signal(signal.SIGKILL)  # in the middle of writing step 10
    proc.wait()
    assert [p.name for p in checkpoints.complete_checkpoints(run_dir)] == ["step_000005"]
    assert not (run_dir / "checkpoints" / "step_000010" / checkpoints.COMPLETE).exists()
    assert not (run_dir / "checkpoints" / "step_000010.partial" / checkpoints.COMPLETE).exists()
    checkpoints.load_model_state(run_dir / "checkpoints" / "step_000005")  # intact

    resumed = run_script(
        "base_train", TINY + ["--num-iterations=12", "--save-every=5", "--run=k", "--resume=auto"], home
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "step_000005" in resumed.stdout
    assert "ignoring " + str(run_dir / "checkpoints" / "step_000010.partial") in resumed.stdout
    assert [p.name for p in checkpoints.complete_checkpoints(run_dir)] == ["step_000005", "step_000010", "step_000012"]


def test_stop_and_resume_is_bitwise_on_one_process(home, capsys):
    args = TINY + ["--num-iterations=14", "--deterministic", "--save-every=100"]

    def saved_at_the_stop():
        assert [p.name for p in checkpoints.complete_checkpoints(home / "runs" / "part")] == ["step_000006"]

    a, b = preempted_and_resumed(base_train.main, args, home / "runs", 6, capsys, while_stopped=saved_at_the_stop)
    assert [r["step"] for r in b] == list(range(1, 15))  # the metrics log holds one history
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_two_process_resume_and_world_size_changes(home):
    args = TINY + ["--num-iterations=12", "--save-every=100"]
    full = run_script("base_train", args + ["--run=full2"], home, nproc=2)
    assert full.returncode == 0, full.stderr[-3000:]
    part = run_script("base_train", args + ["--run=part2"], home, nproc=2, faults=["--preempt-at-step=5"])
    assert part.returncode == 0 and "stopped by" in part.stdout, part.stderr[-3000:]
    shutil.copytree(home / "runs" / "part2", home / "runs" / "to_one")  # the same step-5 checkpoint, twice
    resumed = run_script("base_train", args + ["--run=part2", "--resume=auto"], home, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = last_model_state(home / "runs" / "full2"), last_model_state(home / "runs" / "part2")
    assert max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a) < 1e-6

    # 2 -> 1: the step-5 checkpoint of the 2-process run continues on one process
    one = run_script("base_train", args + ["--run=to_one", "--resume=auto"], home)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "saved with 2 process(es)" in one.stdout
    rows = train_rows(home / "runs" / "to_one")
    assert [r["step"] for r in rows] == list(range(1, 13)) and all(r["loss"] < rows[0]["loss"] for r in rows[6:])

    # 1 -> 2: a single-process checkpoint continues under torchrun
    single = run_script("base_train", args + ["--run=from_one"], home, faults=["--preempt-at-step=4"])
    assert single.returncode == 0, single.stderr[-3000:]
    two = run_script("base_train", args + ["--run=from_one", "--resume=auto"], home, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "saved with 1 process(es)" in two.stdout
    assert [r["step"] for r in train_rows(home / "runs" / "from_one")] == list(range(1, 13))


def test_sigterm_under_torchrun_saves_and_resumes(home):
    run_dir = home / "runs" / "t"
    args = TINY + ["--num-iterations=2000", "--run=t"]
    proc = popen("base_train", args, home, nproc=2)
    metrics = run_dir / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and metrics.read_text().count('"train"') >= 3, proc)
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGTERM)  # one rank only: all ranks must agree to stop
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "received SIGTERM" in out and "stopped by" in out
    (resume_line,) = [line for line in out.splitlines() if "Resume with:" in line]
    assert "Resume with: torchrun --nproc_per_node=2 -m nanochat_fast.scripts.base_train -- " in resume_line
    assert resume_line.endswith(" --run=t --resume auto"), resume_line
    (ckpt,) = checkpoints.complete_checkpoints(run_dir)
    step = checkpoints.load_meta(ckpt)["step"]
    assert 3 <= step < 2000

    resumed = run_script(
        "base_train", args + ["--resume=auto"], home, nproc=2, faults=[f"--preempt-at-step={step + 2}"]
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {step}," in resumed.stdout
    assert checkpoints.complete_checkpoints(run_dir)[-1].name == f"step_{step + 2:06d}"


def test_resume_command_keeps_the_run_a_resume_path_named():
    ckpt = "/data/runs/r/checkpoints/step_000004"
    line = next_steps.resume_command(["--depth=2", "--resume", ckpt, "--overwrite"], Path("/data/runs/r"))
    assert line.endswith(" --depth=2 --out-dir=/data/runs/r"), line
    assert next_steps.resume_command(["--run=r", f"--resume={ckpt}"], Path("/data/runs/r")).endswith(" --run=r")


def test_nan_guard_stops_before_the_update_and_saves_nothing_bad(home, capsys):
    with nan_loss_at_step(5):
        code = base_train.main(TINY + ["--num-iterations=20", "--save-every=3", "--run=n"])
    assert code == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "non-finite loss at step 5" in err[0] and "step_000003" in err[0]
    saved = checkpoints.complete_checkpoints(home / "runs" / "n")
    assert [p.name for p in saved] == ["step_000003"]
    assert checkpoints.all_finite(checkpoints.load_model_state(saved[0]).values())

    with nan_loss_at_step(5):
        assert base_train.main(TINY + ["--num-iterations=8", "--run=s", "--skip-nonfinite=1"]) == 0
    assert "step skipped (1/1 allowed" in capsys.readouterr().out
    assert [r["step"] for r in train_rows(home / "runs" / "s")] == list(range(1, 9))


def test_keep_last_prunes_only_after_a_newer_checkpoint_is_complete(home):
    args = TINY + ["--num-iterations=9", "--save-every=2", "--keep-last=2", "--run=p"]

    def complete():
        return [p.name for p in checkpoints.complete_checkpoints(home / "runs" / "p")]

    with disk_full_at("step_000008"), pytest.raises(UserError, match="disk full"):  # it never completes
        base_train.main(args)
    assert complete() == ["step_000004", "step_000006"]  # nothing pruned for a save that failed
    assert base_train.main(args + ["--resume=auto"]) == 0
    assert complete() == ["step_000008", "step_000009"]
