"""
What this machine gives a training process, decided or measured once:

threads   How many intra-op threads each process runs (configure_threads). A process uses the
          cores it is given: those in its CPU affinity, capped by a cgroup CPU quota (containers).
          Under torchrun the local ranks share them: 2 processes on 2 cores run 1 thread each,
          not 2 each (oversubscribed threads wait on each other at every parallel region).
          An OMP_NUM_THREADS the user set wins.
peak      The matmul rate MFU is quoted against (peak_flops): the datasheet dense bf16 rate of a
          known CUDA GPU, otherwise this machine's own rate, measured by a short matmul probe
          (well under a second, even where bf16 is emulated) and cached under
          NANOCHAT_FAST_HOME/hardware/, keyed by device, thread count and torch version.

    python -m nanochat_fast.hardware            the thread choice and the peaks (measured once)

Telling the user's OMP_NUM_THREADS from torchrun's: torchrun sets OMP_NUM_THREADS=1 in its own
environment when the user did not set it and it starts more than one process per node, and its
workers inherit that. So a worker cannot tell the two apart from its own environment; it reads
the environment its launcher was started with instead (/proc/<parent pid>/environ on Linux: the
environment at exec time, which torchrun's later os.environ change does not touch). The parent is
taken as the launcher when the worker runs under torchrun (TORCHELASTIC_RUN_ID is set) and the
parent itself does not (a worker's own subprocesses are not launchers). Where the launcher's
environment cannot be read (not Linux), OMP_NUM_THREADS=1 under torchrun with several local ranks
is taken to be torchrun's default, since that is the value torchrun sets.
"""
import argparse
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import paths
from .precision import cpu_bf16_support

# ---------------------------------------------------------------------------------------------
# threads


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str

    def describe(self) -> str:
        return f"{self.threads} thread(s) per process ({self.reason})"


class _Unknown:
    """The launcher's environment could not be read."""


UNKNOWN = _Unknown()


def decide_threads(env, cores: int, launcher_env=UNKNOWN, bound_per_rank: bool = False) -> ThreadChoice:
    """The pure rule. env: this process's environment; cores: how many cores it may use;
    launcher_env: the environment torchrun was started with (a mapping, None when this process was
    not started by torchrun, or UNKNOWN); bound_per_rank: the launcher pinned this rank to a subset
    of its own cores (then those are all this rank's)."""
    omp = env.get("OMP_NUM_THREADS")
    under_torchrun = "TORCHELASTIC_RUN_ID" in env
    local_ranks = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    if omp is not None:
        if launcher_env is UNKNOWN:
            from_torchrun = under_torchrun and omp.strip() == "1" and local_ranks > 1
        else:
            from_torchrun = under_torchrun and launcher_env is not None and "OMP_NUM_THREADS" not in launcher_env
        if not from_torchrun:
            return ThreadChoice(_omp_threads(omp), f"OMP_NUM_THREADS={omp} set by the user")
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
        raise UserError(f"OMP_NUM_THREADS={value!r} is not a positive number of threads: set it to e.g. "
                        f"OMP_NUM_THREADS={usable_cores()} or unset it")
    return int(first)


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (docker --cpus, Kubernetes limits), or None.
    cgroup v2 (cpu.max: "quota period" or "max period") or v1 (cpu.cfs_quota_us, -1 = none)."""
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
    """(launcher_env, bound_per_rank) for decide_threads, read from the parent process."""
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
    """Set torch's intra-op thread count by decide_threads for this process; returns the choice
    (also kept for thread_choice(), for the run's log and report)."""
    global _chosen
    launcher_env, bound = _launcher_facts()
    _chosen = decide_threads(os.environ, usable_cores(), launcher_env, bound)
    torch.set_num_threads(_chosen.threads)
    return _chosen


def thread_choice() -> ThreadChoice:
    """What configure_threads chose, or torch's own setting if it was not called."""
    return _chosen or ThreadChoice(torch.get_num_threads(), "torch's default; configure_threads() was not called")


# ---------------------------------------------------------------------------------------------
# peak matmul rate and MFU

# Dense bf16 tensor-core FLOP/s per GPU, from the vendors' datasheets (SXM parts where there are
# several). The first name contained in torch.cuda.get_device_name() wins: longer names first.
DATASHEET_BF16 = {
    "GH200": 989e12, "H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12,
    "L40S": 362e12, "A10G": 125e12, "A10": 125e12, "L4": 121e12, "4090": 165e12, "3090": 71e12,
}
PROBE_SECONDS = 0.4  # per dtype
CACHE_VERSION = 1


@dataclass(frozen=True)
class Peak:
    flops: float   # FLOP/s of one process
    dtype: str     # "fp32" | "bf16"
    source: str    # "measured" | "datasheet"
    device: str    # the device's name

    def describe(self) -> str:
        where = "measured" if self.source == "measured" else f"{self.device} datasheet"
        return f"the {where} {self.dtype} peak, {format_flops(self.flops)}"


def format_flops(rate: float) -> str:
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if rate >= scale:
            return f"{rate / scale:.3g} {unit}"
    return f"{rate / 1e6:.3g} MFLOP/s"


def _synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure_matmul_rate(device, dtype: torch.dtype, seconds: float = PROBE_SECONDS, max_size: int | None = None) -> float:
    """The best FLOP/s of square matmuls of growing size (64, 128, ...) within about `seconds`.
    Small matmuls underuse a fast unit and large ones take long where it is slow (emulated bf16
    runs ~1 GFLOP/s), so past 256 the size grows only while the next one, 8x the work, still fits
    4 times (warm-up + 3) in the time left, judged by the fastest run of the current size."""
    device = torch.device(device)
    max_size = max_size or (8192 if device.type == "cuda" else 4096)
    deadline = time.perf_counter() + seconds
    best, n = 0.0, 64
    while True:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        out = torch.empty(n, n, device=device, dtype=dtype)
        torch.mm(a, b, out=out)  # the first call picks kernels and touches the memory
        _synchronize(device)
        fastest = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            _synchronize(device)
            fastest = min(fastest, time.perf_counter() - t0)
            best = max(best, 2 * n ** 3 / max(fastest, 1e-9))
            if time.perf_counter() > deadline and n >= min(256, max_size):
                return best
        if n * 2 > max_size or (n >= 256 and time.perf_counter() + 32 * fastest > deadline):
            return best
        n *= 2


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    return cpu_model()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(device) -> str:
    """What a measured peak depends on: the device, its ISA (a CPU model name can be vague, e.g.
    "AMD EPYC"), the threads in use, torch's version and its fp32 matmul precision setting."""
    device = torch.device(device)
    parts = [device.type, device_name(device)]
    if device.type == "cpu":
        parts += [torch.backends.cpu.get_cpu_capability(), f"bf16={cpu_bf16_support() or 'emulated'}",
                  f"threads={torch.get_num_threads()}"]
    return " | ".join(parts + [f"torch={torch.__version__}", f"fp32 matmul={torch.get_float32_matmul_precision()}"])


def cache_path() -> Path:
    return paths.home() / "hardware" / "peak_flops.json"


def _read_cache(path: Path) -> dict:
    """The cache's entries; a missing, corrupt or foreign file reads as empty (and is rewritten)."""
    try:
        data = json.loads(path.read_text())
        entries = data["entries"] if data.get("version") == CACHE_VERSION else {}
        return {k: v for k, v in entries.items()
                if all(isinstance(v.get(d), (int, float)) and math.isfinite(v[d]) and v[d] > 0 for d in ("fp32", "bf16"))}
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return {}


def machine_busy() -> bool:
    """More runnable tasks than CPUs over the last minute: a probe now would measure the
    neighbours as much as the machine, so it is used for this run but not cached."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1) + 0.5
    except (AttributeError, OSError):
        return False


def _probe(device: torch.device) -> dict:
    """Both dtypes' rates. On a CPU running several threads, the rate of one thread is a floor:
    busy neighbours stall a multi-threaded matmul at every OpenMP barrier (measured here: 1 GFLOP/s
    with 2 threads on a loaded 2-core machine, 80 with 1), and N threads never peak below one."""
    dtypes = (("fp32", torch.float32), ("bf16", torch.bfloat16))
    rates = {name: measure_matmul_rate(device, dtype) for name, dtype in dtypes}
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads > 1:
        torch.set_num_threads(1)
        try:
            rates = {name: max(rates[name], measure_matmul_rate(device, dtype, PROBE_SECONDS / 2)) for name, dtype in dtypes}
        finally:
            torch.set_num_threads(threads)
    return rates


_probed: dict[str, dict] = {}  # this process's own probes (also those a busy machine kept out of the cache)


def measured_peaks(device, remeasure: bool = False) -> dict:
    """{"fp32": FLOP/s, "bf16": FLOP/s, ...} of this device at the current thread count: from the
    cache, else measured (both dtypes, under a second) and cached unless the machine is busy (see
    machine_busy). A cache that cannot be written only costs a probe per run."""
    key, path = cache_key(device), cache_path()
    if key in _probed and not remeasure:
        return _probed[key]
    entries = _read_cache(path)
    if key in entries and not remeasure:
        return entries[key]
    t0 = time.perf_counter()
    entry = _probe(torch.device(device))
    entry.update(probe_seconds=round(time.perf_counter() - t0, 3), measured=time.strftime("%Y-%m-%d %H:%M:%S"))
    _probed[key] = entry
    if machine_busy():
        return entry
    entries = {**_read_cache(path), key: entry}  # re-read: another process may have added its own
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        paths.replace_atomically(path, lambda tmp: tmp.write_text(
            json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1)))
    except OSError:
        pass
    return entry


def datasheet_peak(name: str) -> float | None:
    return next((v for k, v in DATASHEET_BF16.items() if k in name), None)


def peak_flops(device, dtype: str = "fp32") -> Peak:
    """The peak MFU is quoted against, for one process computing in `dtype` ("fp32"/"bf16"):
    a known GPU's datasheet bf16 rate, otherwise the measured rate (cached)."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    device = torch.device(device)
    name = device_name(device)
    if device.type == "cuda" and dtype == "bf16" and datasheet_peak(name):
        return Peak(datasheet_peak(name), dtype, "datasheet", name)
    return Peak(measured_peaks(device)[dtype], dtype, "measured", name)


def mfu(flops_per_token: float, tokens_per_second: float, peak, world_size: int = 1) -> float:
    """Model FLOPs utilisation in percent: achieved FLOP/s over the peak of all processes.
    tokens_per_second counts every process's tokens; peak is one process's (a Peak or FLOP/s)."""
    rate = peak.flops if isinstance(peak, Peak) else float(peak)
    return 100.0 * flops_per_token * tokens_per_second / (rate * world_size)


def mfu_text(flops_per_token: float, tokens_per_second: float, peak: Peak | None, world_size: int = 1) -> str:
    """'mfu 23.4% (of the measured fp32 peak, 150 GFLOP/s)' for the step log."""
    if peak is None:
        return "mfu n/a"
    return f"mfu {mfu(flops_per_token, tokens_per_second, peak, world_size):.1f}% (of {peak.describe()})"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m nanochat_fast.hardware", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--remeasure", action="store_true", help="probe again even if a cached peak exists")
    args = p.parse_args(argv)
    from .precision import choose
    print(f"threads: {configure_threads().describe()}")
    print(f"device: {device_name(args.device)}; compute dtype: {choose(args.device, warn=False).describe()}")
    peaks = measured_peaks(args.device, remeasure=args.remeasure)
    for dtype in ("fp32", "bf16"):
        print(f"{dtype}: {peak_flops(args.device, dtype).describe()}")
    print(f"(probe {peaks['probe_seconds']} s on {peaks['measured']}; cache {cache_path()})")


if __name__ == "__main__":
    main()
