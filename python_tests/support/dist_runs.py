"""The multi-process workers of the distributed tests (dist_worker.py, fsdp_worker.py) started under
torchrun or by torch.multiprocessing.spawn, and their weights compared with one process's."""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanochat_fast.core.distributed import compute_cleanup
from support.repo_paths import ROOT, SUPPORT

PARITY_RTOL = 1e-5


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_state(pid: int) -> str | None:
    """The process's state letter in /proc (R, S, T: stopped, Z: zombie, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def wait_for(predicate, seconds: float, what: str | None = None):
    """predicate()'s first true value, polled every 50 ms; after `seconds`, None, or an AssertionError
    naming `what` when it is given."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    if what is not None:
        raise AssertionError(f"timed out after {seconds:g} s waiting for {what}")
    return None


def rel_err(a: dict, b: dict) -> float:
    """Largest over parameter tensors of ||a - b|| / ||b||.

    Per tensor, not per element: Adam divides each gradient element by its own running magnitude,
    so an element whose gradients so far are all close to zero turns rounding-level differences
    (a different batch split changes the summation order) into visible ones. The matrices Muon
    updates agree per element to ~1e-6 (distributed/test_dist_parity.py's max_elementwise_err)."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)


def worker_parser() -> argparse.ArgumentParser:
    """A worker's command line: --out DIR, where its results go; each worker adds its own flags."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    return parser


def finish(out: Path, rank: int, info: dict):
    """A worker's end: this rank's results to OUT/rank<r>.json, then its process group torn down once
    every rank is done. Under load a rank that destroyed its group while another was still in a
    collective aborted the other at exit ("terminate called without an active exception"; 15 of
    125 runs beside a busy process, 0 of 25 with the barrier)."""
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    dist.barrier()
    compute_cleanup()


def torchrun(worker: str, nproc: int, argv: list[str], timeout: int = 300):
    """`python -m torch.distributed.run --standalone --nproc_per_node=NPROC support/WORKER ARGV`, one
    thread per process; the test fails with the tail of its output when it does."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(SUPPORT / worker),
        *argv,
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def as_if_torchrun(rank, world_size, port):
    """The environment torchrun would set for `rank`, one thread each (a spawned process's start)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)


def spawn_entry(rank, world_size, port, run, args):
    """torch.multiprocessing.spawn's target: the environment torchrun would set, then run(args)."""
    as_if_torchrun(rank, world_size, port)
    run(args)


def spawn(run, nprocs: int, args: argparse.Namespace):
    """A worker's run(args) on nprocs processes started by torch.multiprocessing.spawn."""
    mp.spawn(spawn_entry, args=(nprocs, free_port(), run, args), nprocs=nprocs, join=True)
