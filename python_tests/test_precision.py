"""The precision policy: one rule from the device and its bf16 support to the compute dtype."""
import pytest
import torch

from nanochat_fast import precision
from nanochat_fast.precision import decide

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("device,requested,facts,dtype,native", [
    # auto follows the hardware
    ("cuda", "auto", dict(cuda_capability=(9, 0)), BF16, True),
    ("cuda", "auto", dict(cuda_capability=(8, 0)), BF16, True),
    ("cuda", "auto", dict(cuda_capability=(7, 5)), F32, True),
    ("cpu", "auto", dict(cpu_bf16="AVX512-BF16"), BF16, True),
    ("cpu", "auto", dict(cpu_bf16="AMX"), BF16, True),
    ("cpu", "auto", dict(cpu_bf16=None), F32, True),
    ("mps", "auto", dict(), F32, True),
    # an explicit choice wins; bf16 where it is emulated is allowed but not native
    ("cpu", "fp32", dict(cpu_bf16="AMX"), F32, True),
    ("cuda", "fp32", dict(cuda_capability=(9, 0)), F32, True),
    ("cpu", "bf16", dict(cpu_bf16=None), BF16, False),
    ("cpu", "bf16", dict(cpu_bf16="AVX512-BF16"), BF16, True),
    ("cuda", "bf16", dict(cuda_capability=(7, 0)), BF16, False),
    ("mps", "bf16", dict(), BF16, False),
])
def test_policy_table(device, requested, facts, dtype, native):
    choice = decide(device, requested, **facts)
    assert (choice.dtype, choice.native) == (dtype, native)
    assert choice.name == {F32: "fp32", BF16: "bf16"}[dtype]
    assert choice.reason


def test_bad_choice_names_the_flag():
    with pytest.raises(ValueError, match="--ns-dtype must be one of auto, fp32, bf16"):
        decide("cpu", "fp16", what="--ns-dtype")


@pytest.mark.parametrize("flags,expected", [
    ("fpu sse avx2 fma", None),
    ("fpu avx512f avx512_bf16 avx512_vnni", "AVX512-BF16"),
    ("fpu avx512f amx_bf16 amx_tile", "AMX"),
])
def test_cpuinfo_flags(tmp_path, flags, expected):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert precision._cpuinfo_bf16(info) == expected


def test_arm_features_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert precision._cpuinfo_bf16(info) == "BF16"


def test_this_machine_and_the_warning(capsys):
    """choose() applies the rule to this machine; bf16 where it is emulated warns in one line."""
    auto = precision.choose(torch.device("cpu"))
    assert auto.dtype == (BF16 if precision.cpu_bf16_support() else F32)
    capsys.readouterr()
    forced = precision.choose(torch.device("cpu"), "bf16")
    err = capsys.readouterr().err
    if precision.cpu_bf16_support():
        assert err == ""
    else:
        assert forced.dtype == BF16 and err.count("\n") == 1 and err.startswith("warning: --dtype bf16 on cpu")


def test_autocast_context():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    with precision.autocast(torch.device("cpu"), decide("cpu", "bf16")):
        assert (x @ w).dtype == BF16
    with precision.autocast(torch.device("cpu"), decide("cpu", "fp32")):
        assert (x @ w).dtype == F32
