"""
A node lost, on two torchrun agents of this machine (`--nnodes=1:2 --max-restarts=3`, `--resume=auto
--save-every=5`): node 1 (its agent and its worker) is killed with SIGKILL mid-run; node 0
re-rendezvouses alone, goes on from the newest complete checkpoint at world size 1 (2 -> 1) with the
losses of one process resumed from that checkpoint, and finishes with every step logged once.
"""

import pytest
from support.dist_runs import wait_for
from support.tiny_pipeline import FP32, TINY_MODEL, TINY_STEPS, home_env, train_rows
from support.two_nodes import RESUMED, Cluster, logged_steps

from nanochat_fast.scripts import base_train

pytestmark = pytest.mark.slow

STEPS = 20
ARGS = TINY_MODEL + FP32 + TINY_STEPS + [f"--num-iterations={STEPS}", "--no-compile", "--save-every=5"]
SLOW = ["--step-seconds=0.3", "--slow-world-size=2"]  # faults.py: two-node steps long enough to kill one between


def test_a_lost_node_leaves_the_job_to_the_other_which_resumes_and_finishes(home, tmp_path):
    run_dir = home / "runs" / "elastic"
    target = [*SLOW, "base_train", *ARGS, "--resume=auto", "--run=elastic"]
    with Cluster(tmp_path, home, nnodes="1:2", max_restarts=3) as cluster:
        node0 = cluster.start(0, target)
        node1 = cluster.start(1, target)
        wait_for(lambda: max(logged_steps(run_dir), default=0) >= 7, 180, "step 7 on two nodes")
        assert max(logged_steps(run_dir)) < 20, "the two nodes trained too fast to lose one mid-run"
        node1.kill()
        codes = cluster.wait_all(240)
        assert codes[0] == 0, cluster.outputs()
    resumed = RESUMED.findall(node0.output())
    assert len(resumed) == 1 and resumed[0][2] == "2", cluster.outputs()  # a two-node checkpoint, one process
    assert "rank 1 (node 1 (" in node0.output()  # the lost node named in node 0's line
    ckpt, step, _ = resumed[0]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), cluster.outputs()
    assert not list((run_dir / "checkpoints").glob("*.partial"))

    # the steps node 0 trained alone are those of one process resumed from the same checkpoint
    with home_env(home):
        assert base_train.main(ARGS + ["--run=one", f"--resume={ckpt}"]) == 0
    one = {r["step"]: r["loss"] for r in train_rows(home / "runs" / "one")}
    alone = range(int(step) + 1, STEPS + 1)
    assert [rows[s - 1]["loss"] for s in alone] == [one[s] for s in alone]
