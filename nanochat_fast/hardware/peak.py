"""
The rates utilisation is quoted against, for one process: MFU against the peak matmul rate, MBU (bytes a
decode step reads * steps/s) against the memory bandwidth. A known CUDA GPU's datasheet gives both; else
probes measure them (the best matmul rate over the dtypes; `x.sum()` over a buffer several times the
last-level cache), cached under NANOCHAT_FAST_HOME/hardware/ by cache.ProbeCache's rules. A probe under load
reads low: it keeps the best of interleaved rounds, and the peak is redone when a run beats it (revise_peak).
"""

import math
import time
from dataclasses import dataclass, replace

import torch

from .cache import ProbeCache
from .machine import device_name, last_level_cache_bytes, machine_key, synchronize

# Datasheet (dense bf16 tensor-core FLOP/s, memory bytes/s) by the exact name torch.cuda.get_device_name()
# reports (the same family's PCIe and SXM parts differ).
DATASHEET = {
    "NVIDIA B200": (2250e12, 8.0e12),
    "NVIDIA H200": (989e12, 4.8e12),
    "NVIDIA H200 NVL": (835e12, 4.8e12),
    "NVIDIA GH200 480GB": (989e12, 4.0e12),
    "NVIDIA H100 80GB HBM3": (989e12, 3.35e12),  # SXM5
    "NVIDIA H100 NVL": (835e12, 3.9e12),
    "NVIDIA H100 PCIe": (756e12, 2.0e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 2.039e12),
    "NVIDIA A100-SXM4-40GB": (312e12, 1.555e12),
    "NVIDIA A100 80GB PCIe": (312e12, 1.935e12),
    "NVIDIA A100-PCIE-40GB": (312e12, 1.555e12),
    "NVIDIA L40S": (362e12, 864e9),
    "NVIDIA L40": (181e12, 864e9),
    "NVIDIA L4": (121e12, 300e9),
    "NVIDIA A10": (125e12, 600e9),
    "NVIDIA GeForce RTX 4090": (165e12, 1.008e12),
    "NVIDIA GeForce RTX 3090": (71e12, 936e9),
}
DATASHEET_BF16 = {name: flops for name, (flops, _) in DATASHEET.items()}
DATASHEET_BANDWIDTH = {name: rate for name, (_, rate) in DATASHEET.items()}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROBE_ROUNDS = 3
PROBE_SECONDS = 0.15  # per dtype and round
CACHE = ProbeCache(
    "peak_flops.json",
    version=2,
    valid=lambda e: all(isinstance(e.get(d), (int, float)) and math.isfinite(e[d]) and e[d] > 0 for d in DTYPES),
    probe=lambda device: _probe_peaks(device),
)
# the bandwidth probe (docs/measurements.md#memory-bandwidth-probe)
BANDWIDTH_ROUNDS = 5
MIN_BUFFER = 256 << 20  # bytes the probe reads per pass, at least ...
LLC_MULTIPLE = 4  # ... and this many times the last-level cache (a streaming pass then misses it)
MAX_BUFFER = 1 << 30
GPU_BUFFER = 1 << 30  # an unknown GPU's buffer: a pass of a few ms dwarfs the launch and sync
BANDWIDTH_CACHE = ProbeCache(
    "memory_bandwidth.json",
    version=1,
    valid=lambda e: (
        isinstance(e.get("bytes_per_s"), (int, float)) and math.isfinite(e["bytes_per_s"]) and e["bytes_per_s"] > 0
    ),
    probe=lambda device: _probe_bandwidth(device),
)


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s of one process, in its fastest dtype
    dtype: str  # that dtype: "fp32" | "bf16"
    source: str  # "measured" | "datasheet"
    device: str  # the device's name
    others: tuple = ()  # ((dtype, FLOP/s), ...) of the other dtypes measured, for the text

    def describe(self) -> str:
        """'fp32 peak 374 GFLOP/s (bf16 183), measured here' / 'bf16 peak 989 TFLOP/s (... datasheet)'."""
        text = f"{self.dtype} peak {format_rate(self.flops)}"
        if self.source == "datasheet":
            return f"{text} ({self.device} datasheet)"
        _, scale = _unit(self.flops, "FLOP/s")
        others = ", ".join(f"{d} {rate / scale:.3g}" for d, rate in self.others)
        return f"{text}{f' ({others})' if others else ''}, measured here"


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float  # what one process can read per second
    source: str  # "measured" | "datasheet"
    device: str  # the device's name

    def describe(self) -> str:
        """'memory bandwidth 31.2 GB/s, measured here' / 'memory bandwidth 3.35 TB/s (... datasheet)'."""
        text = f"memory bandwidth {format_rate(self.bytes_per_s, 'B/s')}"
        return f"{text} ({self.device} datasheet)" if self.source == "datasheet" else f"{text}, measured here"


def _unit(rate: float, unit: str) -> tuple[str, float]:
    """The decimal prefix `rate` reads best in: (1.5e11, "FLOP/s") -> ("GFLOP/s", 1e9)."""
    return next(((p + unit, s) for p, s in (("P", 1e15), ("T", 1e12), ("G", 1e9)) if rate >= s), ("M" + unit, 1e6))


def format_rate(rate: float, unit: str = "FLOP/s") -> str:
    """'150 GFLOP/s', '31.2 GB/s': three significant digits, decimal prefixes (as datasheets)."""
    name, scale = _unit(rate, unit)
    return f"{rate / scale:.3g} {name}"


# -- the peak matmul rate (MFU) ---------------------------------------------------------------------


def measure_matmul_rate(
    device, dtype: torch.dtype, seconds: float = PROBE_SECONDS, max_size: int | None = None
) -> float:
    """The best FLOP/s of square matmuls of growing size (64, 128, ...) within about `seconds`. Past
    256 the size grows only while the next one (8x the work) still fits 4 times in the time left:
    where a dtype is slow (emulated bf16) large sizes would take long."""
    device = torch.device(device)
    max_size = max_size or (8192 if device.type == "cuda" else 4096)
    deadline = time.perf_counter() + seconds
    best, n = 0.0, 64
    gen = torch.Generator(device).manual_seed(0)  # its own: the run's random stream is not moved
    while True:
        a, b = (torch.randn(n, n, device=device, generator=gen).to(dtype) for _ in range(2))
        out = torch.empty(n, n, device=device, dtype=dtype)
        torch.mm(a, b, out=out)  # the first call picks kernels and touches the memory
        synchronize(device)
        fastest = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            synchronize(device)
            fastest = min(fastest, time.perf_counter() - t0)
            best = max(best, 2 * n**3 / max(fastest, 1e-9))
            if time.perf_counter() > deadline and n >= min(256, max_size):
                return best
        if n * 2 > max_size or (n >= 256 and time.perf_counter() + 32 * fastest > deadline):
            return best
        n *= 2


def _probe_peaks(device: torch.device) -> dict:
    """Both dtypes' best rates over PROBE_ROUNDS interleaved rounds; on a CPU running several
    threads, one thread's rate too, as a floor (busy neighbours stall every OpenMP barrier)."""
    rates = dict.fromkeys(DTYPES, 0.0)
    for _ in range(PROBE_ROUNDS):
        for name, dtype in DTYPES.items():
            rates[name] = max(rates[name], measure_matmul_rate(device, dtype))
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads > 1:
        torch.set_num_threads(1)
        try:
            rates = {name: max(rates[name], measure_matmul_rate(device, dtype)) for name, dtype in DTYPES.items()}
        finally:
            torch.set_num_threads(threads)
    return rates


def measured_peaks(device, remeasure: bool = False, store: bool = True) -> dict:
    """{"fp32": FLOP/s, "bf16": FLOP/s, ...} at the current thread count: cached, else probed (a second)."""
    return CACHE.measured(machine_key(device), torch.device(device), remeasure, store)


def datasheet_peak(name: str) -> float | None:
    return DATASHEET_BF16.get(name.strip())


def peak_flops(device) -> Peak:
    """The peak MFU is quoted against: a known GPU's datasheet bf16 rate, otherwise the best measured
    rate over the dtypes (a run in the slower one leaves the machine underused)."""
    device = torch.device(device)
    name = device_name(device)
    if device.type == "cuda" and datasheet_peak(name):
        return Peak(datasheet_peak(name), "bf16", "datasheet", name)
    return _measured_peak(measured_peaks(device), name)


def _measured_peak(rates: dict, name: str) -> Peak:
    best = max(DTYPES, key=lambda d: rates[d])
    return Peak(rates[best], best, "measured", name, tuple((d, rates[d]) for d in DTYPES if d != best))


def revise_peak(peak: Peak, achieved_flops: float, device) -> Peak:
    """`peak`, or, when one process just ran faster than its measured peak (a probe taken under load
    reads low), the peak probed again and cached in its place, never below what was achieved."""
    if peak is None or peak.source != "measured" or achieved_flops <= peak.flops:
        return peak
    fresh = _measured_peak(measured_peaks(device, remeasure=True), peak.device)
    return fresh if fresh.flops >= achieved_flops else replace(fresh, flops=achieved_flops)


# -- the memory bandwidth (MBU) ---------------------------------------------------------------------


def buffer_bytes(device) -> int:
    """The probe's buffer: on a CPU (or MPS) MIN_BUFFER, or LLC_MULTIPLE times the last-level cache
    up to MAX_BUFFER; on a GPU GPU_BUFFER (8x its L2 if more), within a quarter of its free memory."""
    device = torch.device(device)
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(min(max(GPU_BUFFER, 8 * l2), torch.cuda.mem_get_info(device)[0] // 4))
    llc = last_level_cache_bytes() if device.type == "cpu" else None
    return max(MIN_BUFFER, min(MAX_BUFFER, LLC_MULTIPLE * (llc or 0)))


def measure_read_bandwidth(device, nbytes: int | None = None, rounds: int = BANDWIDTH_ROUNDS) -> float:
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
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                x.sum()
                synchronize(device)
                best = max(best, x.nbytes / max(time.perf_counter() - t0, 1e-9))
    finally:
        torch.set_num_threads(threads)
    return best


def _probe_bandwidth(device: torch.device) -> dict:
    nbytes = buffer_bytes(device)
    return {"bytes_per_s": measure_read_bandwidth(device, nbytes), "buffer_bytes": nbytes}


def measured_bandwidth(device, remeasure: bool = False) -> dict:
    """{"bytes_per_s", "buffer_bytes", "probe_seconds", "measured"} at the current thread count."""
    return BANDWIDTH_CACHE.measured(machine_key(device), torch.device(device), remeasure, True)


def datasheet_bandwidth(name: str) -> float | None:
    return DATASHEET_BANDWIDTH.get(name.strip())


def memory_bandwidth(device, remeasure: bool = False) -> Bandwidth:
    """The bandwidth MBU is quoted against: a known GPU's datasheet figure, else the probe's here."""
    device = torch.device(device)
    name = device_name(device)
    if device.type == "cuda" and datasheet_bandwidth(name):
        return Bandwidth(datasheet_bandwidth(name), "datasheet", name)
    return Bandwidth(measured_bandwidth(device, remeasure)["bytes_per_s"], "measured", name)


def mfu(flops_per_token: float, tokens_per_second: float, peak, world_size: int = 1) -> float:
    """Model FLOPs utilisation in percent: achieved FLOP/s over the peak of all processes.
    tokens_per_second counts every process's tokens; peak is one process's (a Peak or FLOP/s)."""
    rate = peak.flops if isinstance(peak, Peak) else peak
    return 100.0 * flops_per_token * tokens_per_second / (float(rate) * world_size)


def mbu(bytes_per_step: float, steps_per_second: float, bandwidth, world_size: int = 1) -> float:
    """Model bandwidth utilisation in percent: bytes read/s over all processes' bandwidth. steps_per_second
    counts every process's decode steps (a batch's step reads the weights once); bandwidth is one process's."""
    rate = bandwidth.bytes_per_s if isinstance(bandwidth, Bandwidth) else bandwidth
    return 100.0 * bytes_per_step * steps_per_second / (float(rate) * world_size)


def mfu_text(
    flops_per_token: float, tokens_per_second: float, peak: Peak | None, world_size: int = 1, against: bool = True
) -> str:
    """'mfu 23.4% (of the fp32 peak 150 GFLOP/s (bf16 75), measured here)'; against=False: 'mfu 23.4%'
    (the training loop's step line: the run's summary names the peak once)."""
    if peak is None:
        return "mfu n/a"
    text = f"mfu {mfu(flops_per_token, tokens_per_second, peak, world_size):.1f}%"
    return f"{text} (of the {peak.describe()})" if against else text
