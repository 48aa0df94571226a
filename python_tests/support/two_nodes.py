"""
Two "nodes" on this machine for the multi-node tests: one torchrun agent each, a c10d rendezvous on
127.0.0.1, gloo between the workers, exactly the command a user runs on every node of a cluster. A
node may see a folder of its own over a shared path (a mount namespace: `unshare -m`, then `mount
--bind PRIVATE PATH`), as a node whose home is not on the shared filesystem.

    with Cluster(tmp_path, home) as cluster:
        a, b = cluster.start(0, ["base_train", *ARGS]), cluster.start(1, ["base_train", *ARGS])
        assert cluster.wait_all(300) == [0, 0]

Every process started is killed when the block ends (the agents' process groups, and the workers,
which torchrun starts in sessions of their own, found by the mark in their environment).
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from support.dist_runs import free_port
from support.repo_paths import ROOT, SUPPORT
from support.tiny_pipeline import train_rows

MARK = "TWO_NODES_TEST"  # NODE's mark, in every process a node starts: "<cluster id>-<node>"
# `PRIVATE_VIEW PRIVATE PATH cmd...`: cmd run seeing folder PRIVATE at PATH (exec: the pid stays the test's)
PRIVATE_VIEW = ["unshare", "-m", "--propagation=private", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"']
# the rendezvous closes 10 s after the fewest nodes (--nnodes=MIN:MAX) are there, when not all have
# come (torchrun's default: 30 s); keep-alives as torchrun's (a node silent for 15 s is gone: shorter
# ones dropped a live but busy agent on a loaded machine, and its waiting node started a job alone)
RDZV_CONF = "last_call_timeout=10"
# torch 2.13's agent keeps the workers' store address of its first round: a node that joins a later
# round waits for MASTER_ADDR, which nobody writes in that round, and the job cannot grow (the
# rendezvous times out after 60 s). Without the shared store, rank 0's agent writes it every round.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# what rank 0 prints when a run resumes: the checkpoint, its step, and how many processes saved it
RESUMED = re.compile(r"resumed from (\S+) \(step (\d+), saved with (\d+) process")


def mount_namespace_refused() -> str | None:
    """Why a private view of a folder cannot be made here (None: it can)."""
    try:
        probe = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "mount", "--bind", "/tmp", "/tmp"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare/mount cannot run here ({e})"
    if probe.returncode != 0:
        return f"mount namespaces are not allowed here: {probe.stderr.strip()[:200]}"
    return None


def processes_marked(mark: str) -> list[int]:
    """Pids of the processes whose environment holds MARK=<mark> (or starts with <mark>-)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        wanted = f"{MARK}={mark}".encode()
        if any(v == wanted or v.startswith(wanted + b"-") for v in env):
            pids.append(int(proc.name))
    return pids


def env_of(pid: int) -> dict:
    try:
        pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def logged_steps(run_dir) -> list[int]:
    """The steps a run has logged so far (none while its log is missing or half-written)."""
    try:
        return [r["step"] for r in train_rows(run_dir)]
    except (OSError, ValueError, KeyError):
        return []


@dataclass
class Node:
    """One torchrun agent and the workers it starts."""

    number: int  # the test's name for it (its --node-rank): the rendezvous gives the ranks
    proc: subprocess.Popen
    log: Path
    mark: str

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def workers(self, attempt: int | None = None) -> list[int]:
        """This node's training processes (of torchrun's attempt `attempt`, if given)."""
        pids = [p for p in processes_marked(self.mark) if p != self.proc.pid and "LOCAL_RANK" in env_of(p)]
        if attempt is None:
            return pids
        return [p for p in pids if env_of(p).get("TORCHELASTIC_RESTART_COUNT") == str(attempt)]

    def kill(self):
        """The whole node gone at once (kill -9 of the agent and of its workers), as a machine lost."""
        pids = [self.proc.pid, *self.workers()]
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill(pids)
        self.proc.wait(timeout=30)


@dataclass
class Cluster:
    """Nodes sharing one rendezvous (--rdzv-id, a free port) and, unless given a private one, one home."""

    tmp: Path
    home: Path
    nnodes: str = "2"  # torchrun's --nnodes: "2", or "1:2" for a job that may shrink to one node
    nproc: int = 1
    max_restarts: int = 0
    rdzv_conf: str = RDZV_CONF
    port: int = field(default_factory=free_port)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    nodes: list = field(default_factory=list)

    def command(self, node_rank: int, target: list[str], launcher: list[str] = ()) -> list[str]:
        """The README's multi-node command, on 127.0.0.1: target is a script of nanochat_fast.scripts and
        its flags (["base_train", "--depth=2", ...]), or faults.py's options before them."""
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}"]
        cmd += [f"--nproc_per_node={self.nproc}", f"--node-rank={node_rank}", f"--max-restarts={self.max_restarts}"]
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.id}"]
        cmd += [f"--rdzv-conf={self.rdzv_conf}", *launcher]
        i = next(i for i, a in enumerate(target) if not a.startswith("--"))
        if i:  # faults.py's options come first: it runs the script
            return cmd + [str(SUPPORT / "faults.py"), "--", *target]
        return cmd + ["-m", f"nanochat_fast.scripts.{target[0]}", "--", *target[1:]]

    def start(self, node_rank: int, target: list[str], private: Path | None = None, env=None, launcher=()) -> Node:
        """Node `node_rank` running target; private: the folder this node sees as the home."""
        mark = f"{self.id}-{node_rank}-{len(self.nodes)}"
        full_env = {**os.environ, "NANOCHAT_FAST_HOME": str(self.home), "OMP_NUM_THREADS": "1", MARK: mark}
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        if ":" in self.nnodes:  # an elastic job: see ELASTIC_ENV
            full_env.update(ELASTIC_ENV)
        full_env.update(env or {})
        cmd = self.command(node_rank, target, list(launcher))
        if private is not None:
            cmd = [*PRIVATE_VIEW, "sh", str(private), str(self.home), *cmd]
        log = self.tmp / f"node{node_rank}.{len(self.nodes)}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, env=full_env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        node = Node(node_rank, proc, log, mark)
        self.nodes.append(node)
        if len(self.nodes) == 1:  # the first node hosts the rendezvous, as the endpoint's node does
            self.wait_for_endpoint(node)
        return node

    def wait_for_endpoint(self, node: Node, seconds: float = 60):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and node.proc.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)

    def group_rank(self, node: Node, of: list[Node]) -> int:
        """The node rank the c10d rendezvous gives `node` among `of` (same host: by the agents' pids)."""
        return sorted(n.proc.pid for n in of).index(node.proc.pid)

    def wait_all(self, timeout: float) -> list[int | None]:
        """Every node's exit code (None: still running after `timeout` seconds in all)."""
        deadline = time.monotonic() + timeout
        codes = []
        for node in self.nodes:
            try:
                codes.append(node.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def outputs(self) -> str:
        return "\n".join(f"--- node {n.number} ---\n{n.output()[-4000:]}" for n in self.nodes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for node in self.nodes:
            if node.proc.poll() is None:
                try:
                    os.killpg(node.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _kill(processes_marked(self.id))
        for node in self.nodes:
            node.proc.wait(timeout=30)
        for _ in range(50):  # SIGKILL is delivered asynchronously: wait for the marked processes to be gone
            if not processes_marked(self.id):
                break
            time.sleep(0.1)
