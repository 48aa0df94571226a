"""The CUDA sources cannot run on this machine, but they must compile: every csrc/cuda/*.cu with
plain nvcc for sm_80 (A100) and sm_90 (H100) (they include only CUDA headers), every kernel in them
within its target's limits by nvcc's `-Xptxas -v` report (registers <= 255, no spills, shared
memory <= the per-block maximum), and the torch bindings as C++ against torch's headers. GPU-only
tests that run them are marked `gpu` (make test-gpu)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension
from support.repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_targets  # noqa: E402  (the GPU targets' limits, benchmarks/gpu_targets.py)

CSRC = ROOT / "csrc"
CU_FILES = sorted((CSRC / "cuda").glob("*.cu"))
BINDINGS = sorted((CSRC / "cuda").glob("*.cpp"))


def nvcc():
    path = shutil.which("nvcc") or (cpp_extension.CUDA_HOME and str(Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"))
    if not path or not Path(path).exists():
        pytest.skip("nvcc not found")
    return path


def cuda_include():
    candidates = [
        os.environ.get("CUDA_HOME"),
        cpp_extension.CUDA_HOME,
        "/usr/local/cuda",
        str(Path(nvcc()).resolve().parents[1]),
    ]
    for home in filter(None, candidates):
        if (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return Path(home) / "include"
    pytest.skip("CUDA headers not found (set CUDA_HOME)")


def test_there_are_cuda_sources():
    assert CU_FILES and BINDINGS


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_within_limits(cu, arch, tmp_path):
    try:
        kernels = gpu_targets.nvcc_usage(nvcc(), cu, arch, CSRC, tmp_path)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"nvcc -arch={arch} {cu.name} failed:\n{e.stderr[-3000:]}")
    assert (tmp_path / f"{cu.stem}.{arch}.o").stat().st_size > 0
    assert kernels, f"{cu.name}: nvcc -Xptxas -v reported no kernel"
    assert all(k.registers > 0 for k in kernels)
    gpu = gpu_targets.TARGETS[arch]
    problems = [p for k in kernels for p in gpu_targets.check(k, gpu, k.function, shared=k.static_smem, threads=None)]
    assert not problems, "\n".join(problems)


def test_resource_check_reads_a_real_report():
    """The parser and the check on a report in ptxas -v's format (as nvcc -Xptxas -v prints it), one kernel spilling."""
    report = """ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'
ptxas info    : Function properties for _Z6kernelPf
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 64 registers, used 0 barriers, 4096 bytes smem, 360 bytes cmem[0]
ptxas info    : Compiling entry function '_Z5otherPf' for 'sm_90'
ptxas info    : Function properties for _Z5otherPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 360 bytes cmem[0]"""
    spilling, other = gpu_targets.parse_ptxas_v(report)
    assert spilling == gpu_targets.Usage("_Z6kernelPf", 64, 8, 12, 16, 4096)
    assert other == gpu_targets.Usage("_Z5otherPf", 255, 0, 0, 0, 0)
    h100 = gpu_targets.TARGETS["sm_90"]
    [problem] = gpu_targets.check(spilling, h100, "kernel", shared=4096, threads=None)
    assert "spills (8 B stored, 12 B loaded)" in problem and "sm_90" in problem
    assert gpu_targets.check(spilling, h100, "kernel", shared=4096, threads=None, spills_ok="measured") == []
    assert gpu_targets.check(other, h100, "other", shared=0, threads=256) == []
    [too_big] = gpu_targets.check(other, h100, "other", shared=0, threads=512)  # 255 x 512 > 64K registers
    assert "registers x 512 threads" in too_big
    [smem] = gpu_targets.check(other, gpu_targets.TARGETS["sm_80"], "other", shared=200 * 1024, threads=None)
    assert "shared memory 200.0 KiB > 163 KiB" in smem and "A100" in smem


@pytest.mark.parametrize("src", BINDINGS, ids=lambda p: p.name)
def test_cuda_binding_passes_syntax_check(src, tmp_path):
    """A CPU build of torch ships the c10/cuda headers but not the one CMake generates for them
    (cuda_cmake_macros.h); an empty stand-in for it is all the syntax check needs."""
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{tmp_path}", f"-I{cuda_include()}", f"-I{CSRC}"]
    result = subprocess.run(["c++", "-fsyntax-only", "-std=c++20", *includes, str(src)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
