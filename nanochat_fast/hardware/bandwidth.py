"""
The memory bandwidth MBU (model bandwidth utilisation: bytes a decode step reads * steps/s over what
the memory delivers) is quoted against: a known CUDA GPU's datasheet bandwidth, otherwise this
machine's read bandwidth, from a probe (`x.sum()` over a buffer several times the last-level cache)
cached under NANOCHAT_FAST_HOME/hardware/memory_bandwidth.json by the peak probe's rules
(cache.ProbeCache). How it reads: docs/measurements.md#memory-bandwidth-probe.
"""

import math
import time
from dataclasses import dataclass

import torch

from .cache import ProbeCache
from .machine import device_name, last_level_cache_bytes, machine_key, synchronize
from .peak import DATASHEET, format_rate, utilisation

# the datasheet's memory bandwidth of the GPUs peak.py knows, bytes/s (decimal units, as quoted)
DATASHEET_BANDWIDTH = {name: rate for name, (_, rate) in DATASHEET.items()}
PROBE_ROUNDS = 5
MIN_BUFFER = 256 << 20  # bytes the probe reads per pass, at least ...
LLC_MULTIPLE = 4  # ... and this many times the last-level cache (a streaming pass then misses it)
MAX_BUFFER = 1 << 30
GPU_BUFFER = 1 << 30  # an unknown GPU's buffer: a pass of a few ms dwarfs the launch and sync
CACHE = ProbeCache(
    "memory_bandwidth.json",
    version=1,
    valid=lambda e: (
        isinstance(e.get("bytes_per_s"), (int, float)) and math.isfinite(e["bytes_per_s"]) and e["bytes_per_s"] > 0
    ),
    probe=lambda device: _probe(device),
)


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float  # what one process can read per second
    source: str  # "measured" | "datasheet"
    device: str  # the device's name

    def describe(self) -> str:
        """'memory bandwidth 31.2 GB/s, measured here' / 'memory bandwidth 3.35 TB/s (... datasheet)'."""
        text = f"memory bandwidth {format_rate(self.bytes_per_s, 'B/s')}"
        return f"{text} ({self.device} datasheet)" if self.source == "datasheet" else f"{text}, measured here"


def buffer_bytes(device) -> int:
    """The probe's buffer: on a CPU (or MPS) MIN_BUFFER, or LLC_MULTIPLE times the last-level cache
    up to MAX_BUFFER; on a GPU GPU_BUFFER (8x its L2 if more), within a quarter of its free memory."""
    device = torch.device(device)
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(min(max(GPU_BUFFER, 8 * l2), torch.cuda.mem_get_info(device)[0] // 4))
    llc = last_level_cache_bytes() if device.type == "cpu" else None
    return max(MIN_BUFFER, min(MAX_BUFFER, LLC_MULTIPLE * (llc or 0)))


def measure_read_bandwidth(device, nbytes: int | None = None, rounds: int = PROBE_ROUNDS) -> float:
    """The best read rate, bytes/s, of `rounds` passes of x.sum() over a float32 buffer of `nbytes`
    (buffer_bytes(device) by default) after one untimed pass (kernels chosen, pages touched); on a
    CPU with several threads, each round also one pass with one thread (the module's floor)."""
    device = torch.device(device)
    x = torch.ones(max(1, (nbytes or buffer_bytes(device)) // 4), device=device)
    x.sum()
    synchronize(device)
    threads = torch.get_num_threads()
    counts = [threads, 1] if device.type == "cpu" and threads > 1 else [threads]
    best = 0.0
    try:
        for _ in range(rounds):
            for n in counts:
                if len(counts) > 1:
                    torch.set_num_threads(n)
                t0 = time.perf_counter()
                x.sum()
                synchronize(device)
                best = max(best, x.nbytes / max(time.perf_counter() - t0, 1e-9))
    finally:
        torch.set_num_threads(threads)
    return best


def _probe(device: torch.device) -> dict:
    nbytes = buffer_bytes(device)
    return {"bytes_per_s": measure_read_bandwidth(device, nbytes), "buffer_bytes": nbytes}


def measured_bandwidth(device, remeasure: bool = False) -> dict:
    """{"bytes_per_s": ..., "buffer_bytes": ..., "probe_seconds": ..., "measured": ...} of this
    device at the current thread count: cached unless stale, else probed (a fraction of a second
    on a CPU) and cached unless the machine is busy."""
    return CACHE.measured(machine_key(device), torch.device(device), remeasure, True)


def datasheet_bandwidth(name: str) -> float | None:
    return DATASHEET_BANDWIDTH.get(name.strip())


def memory_bandwidth(device, remeasure: bool = False) -> Bandwidth:
    """The bandwidth MBU is quoted against, for one process: a known GPU's datasheet figure,
    otherwise the read bandwidth measured here (cached; remeasure: probed again)."""
    device = torch.device(device)
    name = device_name(device)
    if device.type == "cuda" and datasheet_bandwidth(name):
        return Bandwidth(datasheet_bandwidth(name), "datasheet", name)
    return Bandwidth(measured_bandwidth(device, remeasure)["bytes_per_s"], "measured", name)


def mbu(bytes_per_step: float, steps_per_second: float, bandwidth, world_size: int = 1) -> float:
    """Model bandwidth utilisation in percent: bytes read per second over the bandwidth of all
    processes. steps_per_second counts every process's steps (a decode step of a batch is one
    step: its weights are read once); bandwidth is one process's (a Bandwidth or bytes/s)."""
    rate = bandwidth.bytes_per_s if isinstance(bandwidth, Bandwidth) else bandwidth
    return utilisation(bytes_per_step, steps_per_second, rate, world_size)


def mbu_text(
    bytes_per_step: float,
    steps_per_second: float,
    bandwidth: Bandwidth | None,
    world_size: int = 1,
    against: bool = True,
) -> str:
    """'mbu 41.7% (of the memory bandwidth 31.2 GB/s, measured here)'; against=False: 'mbu 41.7%'."""
    if bandwidth is None:
        return "mbu n/a"
    text = f"mbu {mbu(bytes_per_step, steps_per_second, bandwidth, world_size):.1f}%"
    return f"{text} (of the {bandwidth.describe()})" if against else text
