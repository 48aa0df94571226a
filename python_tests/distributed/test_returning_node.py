"""
A node that comes back grows the job again, on two torchrun agents of this machine (`--nnodes=1:2
--max-restarts=3`, `--resume=auto --save-every=5`): node 1 is killed with SIGKILL mid-run, node 0
goes on alone; node 1 is started again with the same command, node 0's agent stops its worker (which
saves a checkpoint) and starts it again with node 1's, and the job ends at world size 2, resumed from
the checkpoint node 0 saved alone, with every step logged once.
"""

import json

import pytest
from support.dist_runs import wait_for
from support.tiny_pipeline import FP32, TINY_MODEL, TINY_STEPS, train_rows
from support.two_nodes import RESUMED, Cluster, logged_steps

from nanochat_fast.checkpoints.checkpoint import complete_checkpoints

pytestmark = pytest.mark.slow

STEPS = 30  # node 0 alone must still be training when node 1 is back
ARGS = TINY_MODEL + FP32 + TINY_STEPS + [f"--num-iterations={STEPS}", "--no-compile", "--save-every=5"]


def saved_with(ckpt) -> int:
    return json.loads((ckpt / "meta.json").read_text())["world_size"]


def test_a_node_that_comes_back_grows_the_job_at_the_next_restart(home, tmp_path):
    run_dir = home / "runs" / "grow"
    target = ["--step-seconds=0.4", "base_train", *ARGS, "--resume=auto", "--run=grow"]
    with Cluster(tmp_path, home, nnodes="1:2", max_restarts=3) as cluster:
        node0 = cluster.start(0, target)
        node1 = cluster.start(1, target)
        wait_for(lambda: max(logged_steps(run_dir), default=0) >= 7, 180, "step 7 on two nodes")
        node1.kill()
        wait_for(lambda: RESUMED.search(node0.output()), 180, "node 0 resuming alone")
        back = cluster.start(1, target)
        codes = cluster.wait_all(240)
        assert codes[0] == 0 and codes[2] == 0, cluster.outputs()
    resumed = RESUMED.findall(node0.output() + back.output())
    assert [r[2] for r in resumed] == ["2", "1"], cluster.outputs()  # 2 -> 1 process, then 1 -> 2
    # from the newest checkpoint node 0 saved alone (at the latest when its agent stopped it for node 1)
    of_one = [c for c in complete_checkpoints(run_dir) if saved_with(c) == 1]
    assert resumed[1][0] == str(of_one[-1]) and int(resumed[1][1]) > int(resumed[0][1]), cluster.outputs()
    final = complete_checkpoints(run_dir)[-1]
    assert final.name == f"step_{STEPS:06d}" and saved_with(final) == 2, cluster.outputs()
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, STEPS + 1)), cluster.outputs()
    assert not list((run_dir / "checkpoints").glob("*.partial"))
