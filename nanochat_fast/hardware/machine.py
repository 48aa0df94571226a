"""
What this machine is, in the words the caches and the logs use: a device's name, a CPU's instruction
set and bf16 feature, its last-level cache (the bandwidth probe's buffer). None of this decides a
dtype (a CPU's flags do not say whether its bf16 is fast: precision.py times it); it keys the
caches, so a measurement is never reused on another kind of machine, and words a warning.
"""

import functools
import platform
from pathlib import Path

import torch

# /proc/cpuinfo flags of CPUs that execute bf16 arithmetic in hardware (not necessarily faster than fp32)
BF16_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16", "bf16": "BF16"}


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    return cpu_model()


def cpuinfo(path: Path = Path("/proc/cpuinfo")) -> dict:
    """The first processor's fields of /proc/cpuinfo ("model name", "flags" or Arm's "Features", ...)."""
    try:
        block = path.read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines()) if k.strip()}


def cpu_model() -> str:
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def cpu_bf16_support() -> str | None:
    """The CPU feature that executes bf16 here ("AMX", "AVX512-BF16", "BF16"), or None (emulated)."""
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512-BF16"
    return cpuinfo_bf16(Path("/proc/cpuinfo"))  # else the kernel's flags (Arm's bf16 is only there)


def cpuinfo_bf16(path: Path) -> str | None:
    info = cpuinfo(path)
    flags = set((info.get("flags") or info.get("Features") or "").split())  # x86 / Arm
    return next((name for flag, name in BF16_FLAGS.items() if flag in flags), None)


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """The CPU's last-level cache, every instance counted once (a many-chiplet CPU has one L3 per
    chiplet, and threads on different chiplets fill them all), from sysfs; None where unreadable."""
    instances = {}
    for index in root.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
            instances[(level, shared)] = int(size.rstrip("KkMmGg")) * scale
        except (OSError, ValueError):
            continue
    if not instances:
        return None
    top = max(level for level, _ in instances)
    return sum(size for (level, _), size in instances.items() if level == top)


def machine_key(device) -> str:
    """What a measurement on `device` depends on: the device, its ISA (a CPU model name can be vague,
    e.g. "AMD EPYC"), its bf16 feature, the threads, torch's version and fp32 matmul precision."""
    device = torch.device(device)
    parts = [device.type, device_name(device)]
    if device.type == "cpu":
        parts += [
            torch.backends.cpu.get_cpu_capability(),
            f"bf16={cpu_bf16_support() or 'emulated'}",
            f"threads={torch.get_num_threads()}",
        ]
    elif device.type == "cuda":
        parts.append("sm{}{}".format(*torch.cuda.get_device_capability(device)))
    return " | ".join(parts + [f"torch={torch.__version__}", f"fp32 matmul={torch.get_float32_matmul_precision()}"])


def rng_untouched(device):
    """A context whose random draws leave the global generators as they were: else a run's initial
    weights, and every figure it reports, would depend on whether its timings came from the cache."""
    device = torch.device(device)
    if device.type in ("cuda", "mps"):
        return torch.random.fork_rng(devices=[device.index or 0], device_type=device.type)
    return torch.random.fork_rng(devices=[])


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
