"""
How many intra-op threads each process runs (configure_threads): the cores it may use (its CPU
affinity, capped by a cgroup quota), split among torchrun's local ranks; an OMP_NUM_THREADS the user
set wins, told apart from torchrun's own default through the launcher's environment
(docs/measurements.md#threads-per-process).
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str
    by_user: bool = False  # OMP_NUM_THREADS said so: callers keep it as it is

    def describe(self) -> str:
        return f"{self.threads} thread(s) per process ({self.reason})"


UNKNOWN = object()  # the launcher's environment could not be read


def decide_threads(env, cores: int, launcher_env=UNKNOWN, bound_per_rank: bool = False) -> ThreadChoice:
    """The rule. launcher_env: the environment torchrun was started with (None: not under torchrun;
    UNKNOWN: unreadable); bound_per_rank: the launcher pinned this rank to a subset of its cores."""
    omp = env.get("OMP_NUM_THREADS")
    under_torchrun = "TORCHELASTIC_RUN_ID" in env
    local_ranks = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    if omp is not None:
        if launcher_env is UNKNOWN:
            from_torchrun = under_torchrun and omp.strip() == "1" and local_ranks > 1
        else:
            from_torchrun = under_torchrun and launcher_env is not None and "OMP_NUM_THREADS" not in launcher_env
        if not from_torchrun:
            return ThreadChoice(_omp_threads(omp), f"OMP_NUM_THREADS={omp} set by the user", by_user=True)
    if under_torchrun and local_ranks > 1 and not bound_per_rank:
        threads = max(1, cores // local_ranks)
        ignored = "; torchrun's OMP_NUM_THREADS=1 default replaced" if omp is not None else ""
        return ThreadChoice(threads, f"{cores} core(s) split among {local_ranks} local ranks{ignored}")
    if under_torchrun and bound_per_rank:
        return ThreadChoice(cores, f"the {cores} core(s) this rank is bound to")
    return ThreadChoice(cores, f"the {cores} core(s) this process may use")


def _omp_threads(value: str) -> int:
    from .errors import UserError

    first = value.split(",")[0].strip()  # OMP_NUM_THREADS=4,2 sets nested levels: the first is ours
    if not first.isdigit() or int(first) < 1:
        raise UserError(
            f"OMP_NUM_THREADS={value!r} is not a positive number of threads: set it to e.g. "
            f"OMP_NUM_THREADS={usable_cores()} or unset it"
        )
    return int(first)


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (docker --cpus, Kubernetes limits), or None:
    cgroup v2's cpu.max ("quota period" or "max period"), else v1's cpu.cfs_quota_us (-1: none)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for d in (root / "cpu", root / "cpu,cpuacct"):
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 else quota / period
        except (OSError, ValueError):
            continue
    return None


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return max(1, min(cores, math.ceil(limit))) if limit else cores


def _launcher_facts() -> tuple[object, bool]:
    """(launcher_env, bound_per_rank) for decide_threads, read from the parent process (torchrun's
    later change of its os.environ does not touch /proc/<pid>/environ)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None, False
    ppid = os.getppid()
    try:
        raw = Path(f"/proc/{ppid}/environ").read_bytes()
    except OSError:
        return UNKNOWN, False
    parent_env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    if "TORCHELASTIC_RUN_ID" in parent_env:  # the parent is a worker itself, not torchrun
        return None, False
    try:
        bound = os.sched_getaffinity(0) < os.sched_getaffinity(ppid)
    except (AttributeError, OSError):
        bound = False
    return parent_env, bound


_chosen: ThreadChoice | None = None


def configure_threads() -> ThreadChoice:
    """Set torch's intra-op threads by decide_threads; the choice (kept for thread_choice())."""
    global _chosen
    launcher_env, bound = _launcher_facts()
    _chosen = decide_threads(os.environ, usable_cores(), launcher_env, bound)
    torch.set_num_threads(_chosen.threads)
    return _chosen


def thread_choice() -> ThreadChoice:
    """What configure_threads chose, or torch's own setting if it was not called."""
    return _chosen or ThreadChoice(torch.get_num_threads(), "torch's default; configure_threads() was not called")
