"""
Which dtype the model's matmuls and Muon's Newton-Schulz compute in, decided in one place.

Master weights, gradients and optimizer state are fp32 everywhere. What changes with the hardware
is the dtype the heavy arithmetic runs in:

    CUDA, compute capability >= 8.0   bf16 (tensor cores; A100, H100, ...)
    CPU                               the faster of fp32 and bf16, measured on this machine at the
                                      shapes that will run (hardware/tuning.py); bf16 only when it
                                      is at least 1.1x faster
    MPS, older GPUs                   fp32

A CPU flag does not decide: CPUs with AVX512-BF16 have run bf16 both at half and above their fp32
rate, and AVX2 CPUs emulate it (docs/measurements.md#bf16-on-cpus). `--dtype` (the model) and
`--ns-dtype` (Newton-Schulz) take auto|fp32|bf16, and an explicit value is never overridden; bf16
asked for on a CPU that emulates it is allowed (correct, only slow) and says so in one warning line.
"""

import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .machine import cpu_bf16_support
from .peak import DTYPES
from .tuning import Timing, probe_timing

CHOICES = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype
    name: str  # "fp32" | "bf16"
    reason: str  # why, in words, for the log and the run report
    native: bool  # the device executes this dtype in hardware (False: emulated, slow)

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def _precision(name: str, reason: str, native: bool = True) -> Precision:
    return Precision(DTYPES[name], name, reason, native)


def decide(
    device_type: str,
    requested: str = "auto",
    *,
    timing: Timing | None = None,
    cpu_bf16: str | None = None,
    cuda_capability: tuple[int, int] | None = None,
    what: str = "--dtype",
) -> Precision:
    """The pure rule: device type + the facts about it -> Precision. On a CPU, `timing` (fp32 and
    bf16 timed at the shapes that will run) decides auto and `cpu_bf16` (the bf16 feature the CPU
    reports, or None) only words the warning for an explicit bf16; `cuda_capability` is the GPU's
    (major, minor); `what` names the flag in the reason."""
    if requested not in CHOICES:
        raise ValueError(f"{what} must be one of {', '.join(CHOICES)}, got {requested!r}")
    if device_type == "cuda":
        native = cuda_capability is not None and cuda_capability >= (8, 0)
        where = f"CUDA sm{cuda_capability[0]}{cuda_capability[1]}" if cuda_capability else "CUDA"
        bf16_why = f"{where} has bf16 tensor cores" if native else f"{where} has no bf16 tensor cores (before sm80)"
    elif device_type == "cpu":
        native = cpu_bf16 is not None
        bf16_why = (
            f"this CPU has {cpu_bf16}" if native else "this CPU has no bf16 instructions (no AVX512-BF16/AMX): emulated"
        )
    elif device_type == "mps":
        native = False
        bf16_why = "MPS: not measured faster than fp32"
    else:
        raise ValueError(f"unknown device type {device_type!r}")
    if requested == "fp32":
        return _precision("fp32", f"{what} fp32 asked for")
    if requested == "bf16":
        return _precision("bf16", f"asked for; {bf16_why}", native)
    if device_type == "cpu":
        if timing is None:
            raise ValueError("a CPU's auto dtype is decided by a timing: pass timing=")
        return _precision(timing.winner, f"measured here: {timing.describe()}")
    return _precision("bf16" if native else "fp32", f"auto: {bf16_why}")


def choose(
    device, requested: str = "auto", what: str = "--dtype", warn: bool = True, timing: Timing | None = None
) -> Precision:
    """decide() with the facts of this machine. A CPU's auto takes `timing` (the caller's
    measurement at its own shapes) or else this machine's matmul probe. bf16 where it is emulated
    is allowed (slow, not wrong): one warning line on stderr says so."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if device.type == "cpu" and requested == "auto" and timing is None:
        timing = probe_timing(device)
    choice = decide(
        device.type,
        requested,
        timing=timing,
        cuda_capability=capability,
        what=what,
        cpu_bf16=cpu_bf16_support() if device.type == "cpu" else None,
    )
    if warn and not choice.native:
        print(
            f"warning: {what} bf16 on {device.type}: {choice.reason.split('; ', 1)[-1]}; this will be slow "
            f"(use {what} auto)",
            file=sys.stderr,
            flush=True,
        )
    return choice


def autocast(device, precision: Precision | torch.dtype):
    """The autocast context for the forward pass: bf16 matmuls where chosen, a no-op for fp32."""
    dtype = precision if isinstance(precision, torch.dtype) else precision.dtype
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)
