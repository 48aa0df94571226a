"""
The memory bandwidth MBU (model bandwidth utilisation) is quoted against: a decode step reads every
weight and the KV cache once, so MBU = bytes read per step * steps/s over what the memory delivers.
That is the datasheet HBM/GDDR bandwidth of a known CUDA GPU, otherwise this machine's own read
bandwidth, measured by a short probe and cached under NANOCHAT_FAST_HOME/hardware/
memory_bandwidth.json (keyed by machine.machine_key: on a CPU, the threads per process are in it).

The probe: `x.sum()` over a float32 buffer several times the last-level cache, with the process's
own threads, best of PROBE_ROUNDS rounds, cached by the peak probe's rules (cache.ProbeCache). How
it reads, why one thread is timed too, and what MBU means on a shared CPU:
docs/measurements.md#memory-bandwidth-probe.
"""

import math
import time
from dataclasses import dataclass

import torch

from .cache import ProbeCache
from .machine import device_name, last_level_cache_bytes, machine_key, synchronize
from .peak import format_rate, utilisation

# Memory bandwidth in bytes/s from the vendors' datasheets (decimal units, as they are quoted), by
# the exact name torch.cuda.get_device_name() reports: the rows of peak.DATASHEET_BF16.
DATASHEET_BANDWIDTH = {
    "NVIDIA B200": 8.0e12,  # HBM3e, 8 TB/s
    "NVIDIA H200": 4.8e12,  # SXM, HBM3e 141 GB, 4.8 TB/s
    "NVIDIA H200 NVL": 4.8e12,  # PCIe, HBM3e 141 GB, 4.8 TB/s
    "NVIDIA GH200 480GB": 4.0e12,  # the 96 GB HBM3 superchip, 4 TB/s (144 GB HBM3e: 4.9)
    "NVIDIA H100 80GB HBM3": 3.35e12,  # SXM5, HBM3, 3.35 TB/s
    "NVIDIA H100 NVL": 3.9e12,  # HBM3 94 GB, 3.9 TB/s
    "NVIDIA H100 PCIe": 2.0e12,  # HBM2e 80 GB, 2 TB/s
    "NVIDIA A100-SXM4-80GB": 2.039e12,  # HBM2e, 2,039 GB/s
    "NVIDIA A100-SXM4-40GB": 1.555e12,  # HBM2, 1,555 GB/s
    "NVIDIA A100 80GB PCIe": 1.935e12,  # HBM2e, 1,935 GB/s
    "NVIDIA A100-PCIE-40GB": 1.555e12,  # HBM2, 1,555 GB/s
    "NVIDIA L40S": 864e9,  # GDDR6 48 GB, 864 GB/s
    "NVIDIA L40": 864e9,  # GDDR6 48 GB, 864 GB/s
    "NVIDIA L4": 300e9,  # GDDR6 24 GB, 300 GB/s
    "NVIDIA A10": 600e9,  # GDDR6 24 GB, 600 GB/s
    "NVIDIA GeForce RTX 4090": 1.008e12,  # GDDR6X 24 GB, 1,008 GB/s
    "NVIDIA GeForce RTX 3090": 936e9,  # GDDR6X 24 GB, 936 GB/s
}
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
        text = f"memory bandwidth {format_bandwidth(self.bytes_per_s)}"
        return f"{text} ({self.device} datasheet)" if self.source == "datasheet" else f"{text}, measured here"


def format_bandwidth(rate: float) -> str:
    return format_rate(rate, "B/s")


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
