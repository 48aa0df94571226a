"""
What a run on two nodes checks before any training, on two torchrun agents of this machine: a home
(runs folder) one node does not share is one line naming that node, on every node; nodes started
with different flags are one line naming the flag; a --rdzv-endpoint nobody answers ends the agent
within the rendezvous timeouts, its last line saying so. No traceback of ours, no hang.
"""

import time

import pytest
from support.tiny_pipeline import FP32, ROOT, TINY_MODEL, TINY_STEPS
from support.two_nodes import RDZV_CONF, Cluster, mount_namespace_refused

pytestmark = pytest.mark.slow

ARGS = ["base_train", *TINY_MODEL, *FP32, *TINY_STEPS, "--num-iterations=2", "--no-compile"]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def assert_stopped_before_training(cluster, codes) -> list[str]:
    """Every node ended non-zero before a training step, no traceback through the package (torchrun's
    agents print their own); the error lines, one per node that printed one, all the same."""
    assert all(c not in (0, None) for c in codes), cluster.outputs()
    out = cluster.outputs()
    assert "step 00001" not in out and f'File "{ROOT / "nanochat_fast"}' not in out, out
    lines = error_lines(out)
    assert all(len(error_lines(node.output())) <= 1 for node in cluster.nodes), out
    # the node whose agent ends first may stop the other's worker before it prints (torchrun closes
    # the rendezvous), so at least one line, all alike
    assert lines and len(set(lines)) == 1, out
    return lines[0]


def test_a_home_not_shared_is_named_before_training(home, tmp_path):
    refused = mount_namespace_refused()
    if refused:
        pytest.skip(refused)
    empty = tmp_path / "node1_home"
    empty.mkdir()
    with Cluster(tmp_path, home) as cluster:
        a = cluster.start(0, [*ARGS, "--run=unshared"])
        b = cluster.start(1, [*ARGS, "--run=unshared"], private=empty)
        codes = cluster.wait_all(180)
        line = assert_stopped_before_training(cluster, codes)
    assert f"error: node {cluster.group_rank(b, [a, b])} (" in line and "does not see the files" in line, line
    assert f"runs folder (NANOCHAT_FAST_HOME/runs) {home / 'runs'}" in line, line
    assert not list((home / "runs").glob(".shared_check_*"))  # markers removed
    assert not (home / "runs" / "unshared").exists()


def test_nodes_started_with_different_flags_name_the_flag(home, tmp_path):
    with Cluster(tmp_path, home) as cluster:
        cluster.start(0, [*ARGS, "--run=same"])
        cluster.start(1, [*ARGS, "--run=same", "--matrix-lr=0.03"])
        codes = cluster.wait_all(180)
        line = assert_stopped_before_training(cluster, codes)
    assert "different flags: --matrix-lr is 0.03 on rank" in line, line
    assert not (home / "runs" / "same").exists()


@pytest.mark.parametrize(
    "conf,last_line",
    [
        # a node whose endpoint does not answer (the node that hosts it never started)
        ("is_host=false,read_timeout=5", "RendezvousConnectionError: The connection to the C10d store has failed"),
        # the node that hosts it, waiting for nodes that never come
        ("join_timeout=5", "RendezvousTimeoutError"),
    ],
    ids=["no-host", "no-peer"],
)
def test_a_rendezvous_nobody_answers_ends_within_its_timeout(home, tmp_path, conf, last_line):
    with Cluster(tmp_path, home, rdzv_conf=f"{RDZV_CONF},{conf}") as cluster:
        started = time.monotonic()
        node = cluster.start(1, [*ARGS, "--run=alone"])
        (code,) = cluster.wait_all(90)
        waited = time.monotonic() - started
        lines = [line for line in node.output().splitlines() if line.strip()]
    assert code not in (0, None), node.output()[-3000:]
    assert waited < 5 + 40, waited  # the timeout plus the agent's start on a busy machine: not a hang
    assert last_line in lines[-1], lines[-3:]
