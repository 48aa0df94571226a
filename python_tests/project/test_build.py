"""The package installs and runs without its compiled extension: NANOCHAT_FAST_NO_EXT=1 skips it,
a broken compiler only warns, and the backend choice falls back to pure PyTorch."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from support.repo_paths import ROOT


def build_wheel(tmp_path, **env):
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".venv", "build", ".git", "*.so", "__pycache__", "*.egg-info", "benchmarks", "python_tests"
        ),
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    wheels = list((tmp_path / "dist").glob("*.whl"))
    return result, wheels


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NANOCHAT_FAST_NO_EXT": "1"}, "NANOCHAT_FAST_NO_EXT=1: skipping"),
        ({"CXX": "/bin/false", "CC": "/bin/false"}, "building the C++ extension failed"),
    ],
    ids=["no-ext", "broken-compiler"],
)
def test_installs_without_the_extension(tmp_path, env, message):
    result, wheels = build_wheel(tmp_path, **env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert message in result.stderr + result.stdout
    assert len(wheels) == 1
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "nanochat_fast/kernels/adamw_slice.py" in names
    assert not any(n.startswith("nanochat_fast/_C") for n in names)


def test_runs_on_fallbacks_without_the_extension():
    code = (
        "import sys; sys.modules['nanochat_fast._C'] = None\n"  # make `from nanochat_fast import _C` fail
        "import torch\n"
        "from nanochat_fast.kernels import adamw_slice_update, registry\n"
        "p, g, m, v = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4)\n"
        "adamw_slice_update([p], [g], [m], [v], 1, 0.1, 0.9, 0.95, 1e-8, 0.0)\n"
        "print(registry.select('adamw_slice_update', 'cpu').name, round(p[0].item(), 4))\n"
        "print(registry.backends('adamw_slice_update')['cpp'].why_not('cpu'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == "reference 0.9"  # one Adam step moves each weight by lr (sign of the grad)
    assert "pip install -e . --no-build-isolation" in second
    assert "running on PyTorch fallbacks" in out.stderr  # the user is told once, at import


def test_forced_cuda_build_fails_loudly(tmp_path):
    """NANOCHAT_FAST_FORCE_CUDA=1 asks for the CUDA kernels, so a build that cannot make them fails with
    one line and a non-zero exit instead of installing without them. With a CPU torch it stops before
    compiling; with a CUDA torch (make test-torch-floor) the compiler fails (CXX=/bin/false), after
    setup.py chose the GPU targets itself where no GPU is visible and no TORCH_CUDA_ARCH_LIST is given."""
    import torch

    result, wheels = build_wheel(
        tmp_path, NANOCHAT_FAST_FORCE_CUDA="1", TORCH_CUDA_ARCH_LIST="", MAX_JOBS="1", CXX="/bin/false", CC="/bin/false"
    )
    out = result.stderr + result.stdout
    assert result.returncode != 0 and not wheels, out[-2000:]
    if torch.version.cuda is None:
        assert f"nanochat_fast: NANOCHAT_FAST_FORCE_CUDA=1: torch {torch.__version__} is a build without CUDA" in out
    else:
        assert "nanochat_fast: NANOCHAT_FAST_FORCE_CUDA=1: building the CUDA extension failed" in out
        if not torch.cuda.is_available():
            assert "TORCH_CUDA_ARCH_LIST=8.0;9.0;10.0" in out
    assert "installed without it" not in out  # not the warning of an unforced build
