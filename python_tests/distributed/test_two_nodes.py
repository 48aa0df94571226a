"""
The README's two-node command, run for real: two torchrun agents on this machine, one process each,
a c10d rendezvous on 127.0.0.1 and one shared home. base_train and mid_train give the losses of
`--standalone --nproc_per_node=2`, loss for loss.
"""

import shutil

import pytest
from support.tiny_pipeline import FP32, TINY_MID, TINY_MODEL, TINY_STEPS, home_env, run_script, train_rows
from support.two_nodes import Cluster

pytestmark = pytest.mark.slow

BASE = TINY_MODEL + FP32 + TINY_STEPS + ["--num-iterations=4", "--no-compile"]


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in train_rows(run_dir)]


@pytest.fixture(scope="module")
def shared_home(tiny_home, tmp_path_factory):
    """tiny_home with base run `b` (one process, in-process) for mid_train to start from."""
    from nanochat_fast.scripts import base_train

    home = tmp_path_factory.mktemp("two_nodes") / "home"
    shutil.copytree(tiny_home, home)
    with home_env(home):
        assert base_train.main(BASE + ["--run=b"]) == 0
    return home


@pytest.mark.parametrize(
    "script,args",
    [("base_train", BASE), ("mid_train", [a for a in TINY_MID if a != "--run=m"] + ["--no-compile"])],
    ids=["base", "mid"],
)
def test_two_nodes_train_as_one_node_of_two_processes(shared_home, tmp_path, script, args):
    with Cluster(tmp_path, shared_home) as cluster:
        for n in (0, 1):
            cluster.start(n, [script, *args, f"--run=nodes-{script}"])
        assert cluster.wait_all(240) == [0, 0], cluster.outputs()
    one = run_script(script, [*args, f"--run=standalone-{script}"], shared_home, nproc=2)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    two_nodes = losses(shared_home / f"runs/nodes-{script}")
    standalone = losses(shared_home / f"runs/standalone-{script}")
    assert len(two_nodes) == int(next(a for a in args if a.startswith("--num-iterations")).split("=")[1])
    assert two_nodes == standalone
