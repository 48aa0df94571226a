"""
A stuck rank is noticed: rank 1 of a 2-process run stops itself (SIGSTOP, as a frozen node) at the
step-3 boundary. Rank 0 waits --collective-timeout in that collective, prints one line naming the
collective, the step and rank 1, and exits non-zero; torchrun --max-restarts=1 then restarts both
ranks (the test SIGCONTs rank 1 so the launcher can stop it), which resume from the step-2
checkpoint with --resume=auto and end on the final weights of an uninterrupted run.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
from support.dist_runs import process_state, wait_for
from support.tiny_pipeline import FP32, ROOT, SUPPORT, TINY_MODEL, TINY_STEPS, run_script, train_rows

from nanochat_fast import checkpoints

TIMEOUT_S = 10
ARGS = TINY_MODEL + FP32 + TINY_STEPS + ["--num-iterations=8", "--save-every=2", "--no-compile"]


def first_attempt_pid(mark: str, rank: int) -> int | None:
    """The pid of this test's first-attempt process of `rank` (from /proc/<pid>/environ)."""
    for proc in Path("/proc").iterdir():
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
        except (OSError, ValueError):
            continue
        if {f"STUCK_RANK_TEST={mark}".encode(), f"RANK={rank}".encode(), b"TORCHELASTIC_RESTART_COUNT=0"} <= env:
            return int(proc.name)
    return None


def test_stopped_rank_is_named_and_the_restarted_run_ends_as_uninterrupted(home):
    mark = uuid.uuid4().hex
    env = {**os.environ, "NANOCHAT_FAST_HOME": str(home), "OMP_NUM_THREADS": "1", "STUCK_RANK_TEST": mark}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = launcher + ["--max-restarts=1", str(SUPPORT / "faults.py"), "--", "--stop-at-step=3", "base_train"]
    cmd += ARGS + [f"--collective-timeout={TIMEOUT_S}", "--resume=auto", "--run=stuck"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        rank0 = wait_for(lambda: first_attempt_pid(mark, 0), 120)
        rank1 = wait_for(lambda: first_attempt_pid(mark, 1), 120)
        assert rank0 and rank1, "the first attempt's ranks were not found"
        assert wait_for(lambda: process_state(rank1) == "T", 240), "rank 1 never stopped itself at step 3"
        stopped_at = time.monotonic()
        ended = wait_for(lambda: process_state(rank0) in (None, "Z", "X"), TIMEOUT_S + 60)
        waited = time.monotonic() - stopped_at
        os.kill(rank1, signal.SIGCONT)  # torchrun can now stop it and restart both ranks
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ended, "rank 0 did not end after rank 1 stopped"
    # a liveness bound, the behaviour under test (not a speed figure): the timeout plus 15 s of slack
    assert waited <= TIMEOUT_S + 15, f"rank 0 ended {waited:.1f} s after rank 1 stopped"
    named = [line for line in out.splitlines() if line.startswith("error: rank 0:")]
    assert len(named) == 1, out[-4000:]
    assert "the step boundary at step 3" in named[0] and f"timed out after {TIMEOUT_S} s" in named[0], named[0]
    assert "all_reduce" in named[0] and "rank 1 (node 0 (" in named[0] and "did not arrive" in named[0], named[0]
    assert proc.returncode == 0, out[-4000:]
    assert "resumed from" in out and "step_000002" in out
    assert [r["step"] for r in train_rows(home / "runs/stuck")] == list(range(1, 9))

    reference = run_script("base_train", ARGS + ["--run=whole"], home, nproc=2)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    ours, whole = (
        checkpoints.load_model_state(checkpoints.complete_checkpoints(home / "runs" / r)[-1])
        for r in ("stuck", "whole")
    )
    for k in whole:
        torch.testing.assert_close(ours[k], whole[k], rtol=1e-6, atol=1e-6)
