"""`make gpu-check` where it can be tested without a GPU: the one-line refusal before anything is
installed, the staging of the tree, and the report written from fake step results and benchmarks."""
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def fake_tool(bin_dir: Path, name: str, script: str) -> Path:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return path


NO_DRIVER = ('echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9')


def test_make_gpu_check_without_a_gpu_is_one_line_and_installs_nothing(tmp_path):
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "nvidia-smi", NO_DRIVER)  # a driver-less machine, whatever this one has
    staged = ROOT / "build" / "gpu-check"
    existed = staged.exists()
    result = subprocess.run(["make", "--no-print-directory", "gpu-check", f"PYTHON={sys.executable}"], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    output = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode != 0
    assert len(output) == 1, output
    assert "make gpu-check needs an NVIDIA GPU: nvidia-smi -L finds no GPU (NVIDIA-SMI has failed" in output[0]
    assert staged.exists() == existed


def test_preflight_says_what_is_missing(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert gpu_check.preflight().startswith("make gpu-check needs an NVIDIA GPU: no nvidia-smi here")
    fake_tool(bin_dir, "nvidia-smi", 'echo "No devices were found"; exit 6')
    assert gpu_check.preflight() == "make gpu-check needs an NVIDIA GPU: nvidia-smi -L finds no GPU (No devices were found)"
    fake_tool(bin_dir, "nvidia-smi", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"')
    monkeypatch.setattr(gpu_check, "_nvcc", lambda: None)
    assert "needs nvcc (the CUDA toolkit)" in gpu_check.preflight()
    monkeypatch.setattr(gpu_check, "_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    assert gpu_check.preflight() == ""


def test_stage_mirrors_the_tree_and_keeps_its_own_install(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    for rel in ("Makefile", "nanochat_fast/a.py", "benchmarks/b.py", ".venv/bin/python", "nanochat_fast/_C.so",
                "build/x.o", "nanochat_fast/__pycache__/a.pyc"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    gpu_check.stage(dst, root=src)
    copied = {str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()}
    assert copied == {"Makefile", "nanochat_fast/a.py", "benchmarks/b.py"}  # not the CPU venv, builds, caches
    (dst / ".venv/bin").mkdir(parents=True)
    (dst / ".venv/bin/python").write_text("the staged venv")
    (dst / "nanochat_fast/_C.so").write_text("the CUDA extension")
    (src / "benchmarks/b.py").unlink()
    (src / "nanochat_fast/a.py").write_text("changed")
    gpu_check.stage(dst, root=src)
    assert not (dst / "benchmarks/b.py").exists()
    assert (dst / "nanochat_fast/a.py").read_text() == "changed"
    assert (dst / ".venv/bin/python").read_text() == "the staged venv"
    assert (dst / "nanochat_fast/_C.so").read_text() == "the CUDA extension"


def test_train_summary_skips_the_warmup_steps(tmp_path):
    rows = [{"kind": "eval", "step": 0, "val_bpb": 3.0}]
    rows += [{"kind": "train", "step": s, "loss": 10 - s / 10, "tok_per_sec": 1000.0 * s, "mfu": s / 2}
             for s in range(1, 51)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    timed = range(gpu_check.WARMUP_STEPS + 1, 51)
    expected_tok = statistics.median(1000.0 * s for s in timed)
    expected_mfu = statistics.median(s / 2 for s in timed)
    assert gpu_check.train_summary(metrics) == (f"50 steps, final loss 5.000; steps 11-50: median "
                                                f"{expected_tok:,.0f} tokens/s, MFU {expected_mfu:.1f}%")


def fake_benchmarks() -> dict:
    info = {"op": "AdamW step (cuda)", "shape_set": "depth-8 GPT", "baseline": "torch fused", "notes": "share: 80%",
            "variants": {"triton (ours)": {"median_s": 0.0005, "ratio_to_baseline": 0.8},
                         "torch fused": {"median_s": 0.000625, "ratio_to_baseline": 1.0}}}
    return {"datetime": "2026-01-01T00:00:00", "benchmarks": [{"extra_info": info}]}


def test_report_from_fake_results(tmp_path):
    facts = dict(gpu="NVIDIA H100 80GB HBM3", count=1, arch="sm_90", sms=132, memory_gib=79.1, driver="570.1",
                 torch="2.13.0+cu130", cuda="13.0", triton="3.9.0", python="3.11.7")
    steps = [gpu_check.Step("tests marked gpu", True, "7 passed, 0 failed, 0 errors, 0 skipped", 41.0),
             gpu_check.Step("bench_train_step.py", False, "missing: this benchmark is part of the check")]
    out = tmp_path / "RESULTS-cuda.md"
    gpu_check.write_report(out, facts, steps, fake_benchmarks(), "build/gpu-check/logs")
    text = out.read_text()
    assert text.startswith("# GPU check: NVIDIA H100 80GB HBM3\n")
    assert "1 x NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.1 GiB), driver 570.1" in text
    assert "Verdict: **FAILED**" in text
    assert "| tests marked gpu | ok | 7 passed, 0 failed, 0 errors, 0 skipped | 41 s |" in text
    assert "| bench_train_step.py | **FAILED** | missing: this benchmark is part of the check | 0 s |" in text
    assert "## AdamW step (cuda)" in text
    assert "| depth-8 GPT | triton (ours) | 0.500 | 0.800 |" in text
    assert "| depth-8 GPT | torch fused (baseline) | 0.625 | 1.000 |" in text
    assert "Machine:" not in text  # make_results' header (this machine's CPU) is left out
    assert not list(tmp_path.glob(".*.tmp"))


def test_run_on_a_cpu_build_of_torch_reports_why(tmp_path):
    """Past the preflight with a torch that cannot use a GPU: the report names it and run() fails."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    out = tmp_path / "RESULTS-cuda.md"
    assert gpu_check.run(out, tmp_path / "home", tmp_path / "logs") == 1
    text = out.read_text()
    assert "Verdict: **FAILED**" in text
    assert "| torch uses the GPU | **FAILED** |" in text
    assert "No benchmark results." in text


def test_steps_run_pytest_and_merge_the_benchmark_json(tmp_path, monkeypatch):
    """The test and benchmark steps on a stand-in tree: real pytest runs, their JUnit and
    pytest-benchmark output read back; a benchmark file that is missing fails its step."""
    (tmp_path / "python_tests").mkdir()
    (tmp_path / "python_tests" / "test_stand_in.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_runs():\n    pass\n\n"
        "@pytest.mark.gpu\ndef test_skips():\n    pytest.skip('no')\n\ndef test_not_gpu():\n    raise AssertionError\n")
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "harness.py", tmp_path / "benchmarks")
    (tmp_path / "benchmarks" / "bench_stand_in.py").write_text(
        "from harness import compare\n\ndef test_sum(benchmark):\n"
        "    compare(benchmark, op='sum', shape_set='1000', baseline='builtin', rounds=3, warmup_rounds=1,\n"
        "            variants={'builtin': lambda: sum(range(1000)), 'loop': lambda: [i for i in range(1000)]})\n")
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check, "CUDA_BENCHMARKS", ["bench_stand_in.py", "bench_missing.py"])
    logs = tmp_path / "logs"
    step = gpu_check.gpu_tests(logs)
    assert (step.ok, step.detail) == (True, "1 passed, 0 failed, 0 errors, 1 skipped")
    (ran, missing), merged = gpu_check.benchmarks(logs)
    assert (ran.ok, ran.detail) == (True, "1 benchmark(s)")
    assert not missing.ok and missing.detail.startswith("missing")
    [bench] = merged["benchmarks"]
    assert set(bench["extra_info"]["variants"]) == {"builtin", "loop"}
