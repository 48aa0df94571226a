"""
A run that loses a rank goes on: torchrun --max-restarts=1 with --resume=auto --save-every=5. Rank 1
is killed with SIGKILL once step 7 is logged; torchrun restarts both ranks, which resume from the
newest complete checkpoint, and the run ends with the final weights of an uninterrupted run.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
from support.tiny_pipeline import FP32, ROOT, TINY_MODEL, TINY_STEPS, run_script, train_rows

from nanochat_fast import checkpoints

ARGS = TINY_MODEL + FP32 + TINY_STEPS + ["--num-iterations=40", "--sharding=fsdp"]


def workers_marked(mark: str, rank: int) -> list[int]:
    """Pids of this test's first-generation training processes of `rank` (from /proc/<pid>/environ)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
        except (OSError, ValueError):
            continue
        if {f"LOST_RANK_TEST={mark}".encode(), f"RANK={rank}".encode(), b"TORCHELASTIC_RESTART_COUNT=0"} <= env:
            pids.append(int(proc.name))
    return pids


def final_weights(run_dir: Path) -> dict:
    return checkpoints.load_model_state(checkpoints.complete_checkpoints(run_dir)[-1])


def test_killed_rank_is_restarted_and_the_run_ends_as_uninterrupted(home):
    mark = uuid.uuid4().hex
    env = {**os.environ, "NANOCHAT_FAST_HOME": str(home), "OMP_NUM_THREADS": "1", "LOST_RANK_TEST": mark}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "-m",
        "nanochat_fast.scripts.base_train",
        "--",
        *ARGS,
        "--resume=auto",
        "--save-every=5",
        "--run=lost",
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = home / "runs/lost/metrics.jsonl"
    killed, deadline = None, time.monotonic() + 120
    try:
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and any(r["step"] >= 7 for r in train_rows(metrics.parent)):
                pids = workers_marked(mark, 1)
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed = pids[0]
            time.sleep(0.01)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "rank 1 was not found running after step 7"
    assert proc.returncode == 0, out[-4000:]
    assert "resumed from" in out  # the restarted ranks continued from a checkpoint, not from scratch
    steps = [r["step"] for r in train_rows(home / "runs/lost")]
    assert steps == list(range(1, 41))  # the log holds each step once, the resumed ones included

    reference = run_script("base_train", ARGS + ["--run=whole"], home, nproc=2)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    ours, whole = final_weights(home / "runs/lost"), final_weights(home / "runs/whole")
    for k in whole:
        torch.testing.assert_close(ours[k], whole[k], rtol=1e-6, atol=1e-6)
