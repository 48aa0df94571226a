"""The precision policy: one rule from the device and the measurements to the compute dtype."""

import pytest
import torch

from nanochat_fast.hardware import machine, precision
from nanochat_fast.hardware.precision import Timing, decide

F32, BF16 = torch.float32, torch.bfloat16


def timed(fp32: float, bf16: float) -> Timing:
    return Timing({"fp32": fp32, "bf16": bf16}, "the work", 5)


@pytest.mark.parametrize(
    "device,requested,facts,dtype,native",
    [
        # auto on CUDA and MPS follows the device
        ("cuda", "auto", dict(cuda_capability=(9, 0)), BF16, True),
        ("cuda", "auto", dict(cuda_capability=(8, 0)), BF16, True),
        ("cuda", "auto", dict(cuda_capability=(7, 5)), F32, True),
        ("mps", "auto", dict(), F32, True),
        # auto on a CPU follows the timing, whatever the flags say
        ("cpu", "auto", dict(cpu_bf16="AVX512-BF16", timing=timed(1.0, 2.04)), F32, True),  # the Xeon of issue 20
        ("cpu", "auto", dict(cpu_bf16="AVX512-BF16", timing=timed(1.0, 0.45)), BF16, True),  # a Zen 4
        ("cpu", "auto", dict(cpu_bf16="AMX", timing=timed(1.0, 0.25)), BF16, True),
        ("cpu", "auto", dict(cpu_bf16=None, timing=timed(1.0, 80.0)), F32, True),  # AVX2: emulated
        ("cpu", "auto", dict(cpu_bf16="AMX", timing=timed(1.0, 0.95)), F32, True),  # 1.05x: not clearly faster
        # an explicit choice wins over any timing; bf16 where it is emulated is allowed but not native
        ("cpu", "fp32", dict(cpu_bf16="AMX", timing=timed(1.0, 0.25)), F32, True),
        ("cuda", "fp32", dict(cuda_capability=(9, 0)), F32, True),
        ("cpu", "bf16", dict(cpu_bf16=None, timing=timed(1.0, 80.0)), BF16, False),
        ("cpu", "bf16", dict(cpu_bf16="AVX512-BF16"), BF16, True),
        ("cuda", "bf16", dict(cuda_capability=(7, 0)), BF16, False),
        ("mps", "bf16", dict(), BF16, False),
    ],
)
def test_policy_table(device, requested, facts, dtype, native):
    choice = decide(device, requested, **facts)
    assert (choice.dtype, choice.native) == (dtype, native)
    assert choice.name == {F32: "fp32", BF16: "bf16"}[dtype]
    assert choice.reason


def test_a_cpu_auto_says_what_was_measured():
    choice = decide("cpu", "auto", cpu_bf16="AVX512-BF16", timing=timed(0.52, 1.0))
    assert choice.describe() == "fp32 (measured here: bf16 0.52x fp32 at the work)"


def test_a_cpu_auto_needs_a_measurement():
    with pytest.raises(ValueError, match="timing"):
        decide("cpu", "auto", cpu_bf16="AMX")


def test_bad_choice_names_the_flag():
    with pytest.raises(ValueError, match="--ns-dtype must be one of auto, fp32, bf16"):
        decide("cpu", "fp16", what="--ns-dtype")


@pytest.mark.parametrize(
    "flags,expected",
    [
        ("fpu sse avx2 fma", None),
        ("fpu avx512f avx512_bf16 avx512_vnni", "AVX512-BF16"),
        ("fpu avx512f amx_bf16 amx_tile", "AMX"),
    ],
)
def test_cpuinfo_flags(tmp_path, flags, expected):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert machine.cpuinfo_bf16(info) == expected


def test_arm_features_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert machine.cpuinfo_bf16(info) == "BF16"


def test_this_machine_measures_and_warns_only_where_bf16_is_emulated(capsys, nanochat_home):
    """choose() on this CPU: auto from this machine's probe (whichever dtype it finds faster);
    forced bf16 warns in one line exactly where the CPU has no bf16 instructions."""
    auto = precision.choose(torch.device("cpu"))
    assert auto.reason.startswith("measured here: bf16 ") and "this machine's probe" in auto.reason
    capsys.readouterr()
    forced = precision.choose(torch.device("cpu"), "bf16")
    err = capsys.readouterr().err
    assert forced.dtype == BF16
    if machine.cpu_bf16_support():
        assert err == ""
    else:
        assert err.count("\n") == 1 and err.startswith("warning: --dtype bf16 on cpu")


def test_autocast_context():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    with precision.autocast(torch.device("cpu"), decide("cpu", "bf16")):
        assert (x @ w).dtype == BF16
    with precision.autocast(torch.device("cpu"), torch.float32):
        assert (x @ w).dtype == F32
