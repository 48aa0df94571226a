"""
Which dtype the model's matmuls and Muon's Newton-Schulz compute in, decided in one place.

Master weights, gradients and optimizer state are fp32 everywhere. What changes with the hardware
is the dtype the heavy arithmetic runs in:

    CUDA, compute capability >= 8.0   bf16 (tensor cores; A100, H100, ...)
    CPU with native bf16              bf16 (AVX512-BF16 or AMX on x86, the BF16 extension on Arm:
                                      bf16 matmuls at ~2x the fp32 rate)
    CPU without it (AVX2 only)        fp32 (bf16 is emulated there: a 1024^2 matmul measured
                                      ~160x slower than fp32 on a 2-core AVX2 EPYC)
    MPS, older GPUs                   fp32

`--dtype` (the model) and `--ns-dtype` (Newton-Schulz) take auto|fp32|bf16. Asking for bf16 where
it is emulated is allowed (it is correct, only slow) and says so in one warning line.
"""
import functools
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

CHOICES = ("auto", "fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# /proc/cpuinfo flags of CPUs that execute bf16 arithmetic natively
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype
    name: str       # "fp32" | "bf16"
    reason: str     # why, in words, for the log and the run report
    native: bool    # the device computes this dtype at full speed

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


@functools.lru_cache(maxsize=None)
def cpu_bf16_support() -> str | None:
    """The CPU feature that makes bf16 native here ("AVX512-BF16", "AMX", "BF16"), or None."""
    probe = getattr(torch, "cpu", None)
    try:
        if probe is not None and probe._is_amx_tile_supported():
            return "AMX"
        if probe is not None and probe._is_avx512_bf16_supported():
            return "AVX512-BF16"
    except AttributeError:  # older torch: fall back to the kernel's flags
        pass
    return _cpuinfo_bf16(Path("/proc/cpuinfo"))


def _cpuinfo_bf16(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 / Arm
            flags.update(value.split())
    names = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX", "bf16": "BF16"}
    return next((names[f] for f in NATIVE_BF16_FLAGS if f in flags), None)


def decide(device_type: str, requested: str = "auto", *, cpu_bf16: str | None = None,
           cuda_capability: tuple[int, int] | None = None, what: str = "--dtype") -> Precision:
    """The pure rule: device type + the facts about it -> Precision. `cpu_bf16` is the CPU's
    native-bf16 feature (or None), `cuda_capability` the GPU's (major, minor); `what` names the
    flag in the reason."""
    if requested not in CHOICES:
        raise ValueError(f"{what} must be one of {', '.join(CHOICES)}, got {requested!r}")
    if device_type == "cuda":
        native = cuda_capability is not None and cuda_capability >= (8, 0)
        where = f"CUDA sm{cuda_capability[0]}{cuda_capability[1]}" if cuda_capability else "CUDA"
        bf16_why = f"{where} has bf16 tensor cores" if native else f"{where} has no bf16 tensor cores (before sm80)"
    elif device_type == "cpu":
        native = cpu_bf16 is not None
        bf16_why = f"this CPU has {cpu_bf16}" if native else "this CPU has no native bf16 (no AVX512-BF16/AMX): emulated"
    elif device_type == "mps":
        native = False
        bf16_why = "MPS: not measured faster than fp32"
    else:
        raise ValueError(f"unknown device type {device_type!r}")
    if requested == "fp32":
        return Precision(torch.float32, "fp32", f"{what} fp32 asked for", True)
    if requested == "bf16":
        return Precision(torch.bfloat16, "bf16", f"asked for; {bf16_why}", native)
    if native:
        return Precision(torch.bfloat16, "bf16", f"auto: {bf16_why}", True)
    return Precision(torch.float32, "fp32", f"auto: {bf16_why}", True)


def choose(device: torch.device, requested: str = "auto", what: str = "--dtype", warn: bool = True) -> Precision:
    """decide() with the facts of this machine. bf16 where it is not native is allowed (slow, not
    wrong): one warning line on stderr says so."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    choice = decide(device.type, requested, cpu_bf16=cpu_bf16_support() if device.type == "cpu" else None,
                    cuda_capability=capability, what=what)
    if warn and not choice.native:
        print(f"warning: {what} bf16 on {device.type}: {choice.reason.split('; ', 1)[-1]}; this will be slow "
              f"(use {what} auto)", file=sys.stderr, flush=True)
    return choice


def autocast(device: torch.device, precision: Precision):
    """The autocast context for the forward pass: bf16 matmuls where chosen, a no-op for fp32."""
    if precision.dtype == torch.float32:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=precision.dtype)
