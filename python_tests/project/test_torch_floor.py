"""The oldest supported torch is written once, pyproject.toml's `torch>=X`; nanochat_fast/core/torch_floor.py
reads it without torch, and `make test-torch-floor` installs exactly torch==X to run this suite on."""

import subprocess
import sys

import tomllib
import torch
from support.repo_paths import ROOT

from nanochat_fast.core import torch_floor


def test_floor_is_pyprojects_requirement():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = torch_floor.torch_floor()
    assert f"torch>={floor}" in dependencies


def test_the_floor_target_installs_the_floor():
    """The Makefile's torch for make test-torch-floor (and cuda-build-check) is the floor, read from pyproject."""
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "--eval", "print-%: ; @echo $($*)", "print-FLOOR_TORCH_SPEC"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"torch=={torch_floor.torch_floor()}"


def test_this_torch_is_supported():
    assert torch_floor.why_not(torch.__version__) == ""


def test_older_torch_is_refused_in_one_line():
    why = torch_floor.why_not("1.13.1+cu117")
    assert (
        why.startswith("torch 1.13.1+cu117 is older than the oldest torch nanochat_fast supports") and "\n" not in why
    )
    assert torch_floor.why_not(torch_floor.torch_floor() + "+cu130") == ""
    assert torch_floor.version_tuple("2.11.0a0+git1234") == (2, 11, 0)


def test_readable_without_torch():
    """A preflight reads the floor before torch is installed: the module imports nothing outside the
    standard library, and runs as a plain script."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1])\n"
        "from nanochat_fast.core.torch_floor import torch_floor; print(torch_floor())"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    script = subprocess.run(
        [sys.executable, str(ROOT / "nanochat_fast" / "core" / "torch_floor.py")], capture_output=True, text=True
    )
    assert out.stdout.strip() == script.stdout.strip() == torch_floor.torch_floor()
