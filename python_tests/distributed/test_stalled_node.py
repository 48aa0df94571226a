"""
A stalled node is named: on two torchrun agents of this machine, node 1's worker (rank 1) stops
itself (SIGSTOP, as a frozen machine) at the step-3 boundary. Within --collective-timeout + 15 s the
other node's rank prints one line naming the collective, the step, rank 1 and its node (hostname
and node rank), and exits non-zero.
"""

import time

import pytest
from support.dist_runs import process_state, wait_for
from support.tiny_pipeline import FP32, TINY_MODEL, TINY_STEPS
from support.two_nodes import Cluster

pytestmark = pytest.mark.slow

TIMEOUT_S = 10
ARGS = TINY_MODEL + FP32 + TINY_STEPS + ["--num-iterations=8", "--no-compile", f"--collective-timeout={TIMEOUT_S}"]


def test_a_stalled_node_is_named_on_the_other_node(home, tmp_path):
    target = ["--stop-at-step=3", "base_train", *ARGS, "--run=stalled"]
    with Cluster(tmp_path, home) as cluster:
        node0 = cluster.start(0, target)
        node1 = cluster.start(1, target)
        assert cluster.group_rank(node1, [node0, node1]) == 1  # faults.py stops rank 1: node 1's worker
        stopped = wait_for(lambda: [p for p in node1.workers() if process_state(p) == "T"], 240)
        assert stopped, "node 1's worker never stopped itself at step 3\n" + cluster.outputs()
        stopped_at = time.monotonic()
        ended = wait_for(lambda: node0.proc.poll() is not None, TIMEOUT_S + 60)
        waited = time.monotonic() - stopped_at
        out = node0.output()
    assert ended, "node 0 did not end after node 1 stalled\n" + out[-3000:]
    # a liveness bound, the behaviour under test (not a speed figure): the timeout plus 15 s of slack
    assert waited <= TIMEOUT_S + 15, f"node 0 ended {waited:.1f} s after node 1 stalled"
    named = [line for line in out.splitlines() if line.startswith("error: rank 0:")]
    assert len(named) == 1, out[-4000:]
    assert "the step boundary at step 3" in named[0] and f"timed out after {TIMEOUT_S} s" in named[0], named[0]
    assert "rank 1 (node 1 (" in named[0] and "did not arrive" in named[0], named[0]
    assert node0.proc.returncode != 0
