"""`make gpu-bundle` and `make gpu-check` where they can be tested without a GPU: the one-line preflight,
the plan's caps, a step stopped at its cap, the report, the bundle's limits, and the rehearsal of the
whole check on this CPU, offline (benchmarks/gpu_check.py rehearse), with its dependency resolution for
the node."""

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from support.repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_bundle  # noqa: E402
import gpu_check  # noqa: E402
import gpu_report  # noqa: E402


def fake_tool(bin_dir: Path, name: str, script: str) -> Path:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return path


def fake_bundle(folder: Path, python: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"python": python}))
    return folder


HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
NO_DRIVER = 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9'


def test_make_gpu_check_without_a_gpu_is_one_line_and_does_no_work(tmp_path):
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "nvidia-smi", NO_DRIVER)  # a driver-less machine, whatever this one has
    existed = gpu_check.WORK.exists()
    result = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "gpu-check",
            f"PYTHON={sys.executable}",
            f"BUNDLE={fake_bundle(tmp_path / 'bundle', HERE)}",
            f"OUT={tmp_path / 'out'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    output = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode != 0
    assert len(output) == 1, output
    assert "gpu-check cannot run here: no GPU (nvidia-smi -L: NVIDIA-SMI has failed because it couldn't " in output[0]
    assert ("no nvcc" in output[0]) == (gpu_check.nvcc() is None)  # the GPU alone is missing where nvcc is here
    assert gpu_check.WORK.exists() == existed and not (tmp_path / "out").exists()


@pytest.fixture
def node_like(tmp_path, monkeypatch):
    """A machine that lacks nothing: a GPU listed, nvcc found, a supported torch."""
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "nvidia-smi", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(gpu_check, "nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(gpu_check.metadata, "version", lambda name: "2.11.0+cu130")
    return fake_bundle(tmp_path / "bundle", HERE), tmp_path / "out"


def test_preflight_names_each_missing_thing_in_one_line(node_like, tmp_path, monkeypatch):
    bundle, out = node_like
    assert gpu_check.preflight(bundle, out) == {}
    cases = {
        "gpu": lambda: fake_tool(tmp_path / "bin", "nvidia-smi", 'echo "No devices were found"; exit 6'),
        "nvcc": lambda: monkeypatch.setattr(gpu_check, "nvcc", lambda: None),
        "torch": lambda: monkeypatch.setattr(gpu_check.metadata, "version", lambda name: "1.13.1"),
        "bundle": lambda: (bundle / "manifest.json").write_text(json.dumps({"python": "3.9"})),
    }
    expected = {
        "gpu": "no GPU (nvidia-smi -L: No devices were found)",
        "nvcc": "no nvcc (the CUDA toolkit): put it on PATH or set CUDA_HOME",
        "torch": "torch 1.13.1 is older than the oldest torch nanochat_fast supports",
        "bundle": f"the bundle at {bundle} is for Python 3.9, this is Python {HERE}",
    }
    for key, make_it_so in cases.items():
        make_it_so()
        problems = gpu_check.preflight(bundle, out)
        assert list(problems) == list(cases)[: list(cases).index(key) + 1]  # each adds its own, none hides another
        assert problems[key].startswith(expected[key])
    line = gpu_check.preflight_line(gpu_check.preflight(bundle, None))
    assert (
        "\n" not in line
        and line.startswith("gpu-check cannot run here: no GPU")
        and line.endswith("no OUT: name a folder for the report, e.g. make gpu-check OUT=gpu-report")
    )


def test_preflight_without_torch_or_bundle(node_like, tmp_path, monkeypatch):
    def no_torch(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gpu_check.metadata, "version", no_torch)
    problems = gpu_check.preflight(tmp_path / "nowhere", tmp_path / "out")
    assert problems["torch"].startswith("no torch in ")
    assert problems["bundle"].startswith(f"no bundle at {tmp_path / 'nowhere'}: make one with `make gpu-bundle`")


def test_check_refuses_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "WORK", tmp_path / "work")
    monkeypatch.setattr(gpu_check, "gpu_problem", lambda: "no GPU (nvidia-smi -L: none)")
    assert gpu_check.check(fake_bundle(tmp_path / "bundle", HERE), tmp_path / "out") == 2
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_the_plan_fits_the_budget_and_names_real_commands(monkeypatch):
    assert gpu_check.check_plan() == ""
    assert sum(s.cap_s for s in gpu_check.PLAN) <= gpu_check.BUDGET_S == 480
    over = gpu_check.PLAN + [gpu_check.Step("extra", "one more", 100, ["benchmarks/gpu_measure.py"])]
    assert gpu_check.check_plan(over).startswith("the plan's caps add up to")
    missing = [gpu_check.Step("gone", "a module that is not there", 1, ["-m", "nanochat_fast.scripts.nothing"])]
    assert gpu_check.check_plan(missing) == "step gone: nanochat_fast/scripts/nothing.py is not in the tree"
    assert "python_tests/benchmarks/test_gpu_compile.py" in gpu_check.gpu_test_files()
    assert (
        "python_tests/benchmarks/test_gpu_check.py" not in gpu_check.gpu_test_files()
    )  # collecting it needs packaging


def test_a_step_at_its_cap_is_recorded_with_what_it_measured(tmp_path, monkeypatch):
    """The loop of check(): each step under its cap, the report rewritten after each; a step killed at
    its cap keeps the figures it wrote, and the next step still runs."""
    work, out = tmp_path / "work", tmp_path / "out"
    bundle = fake_bundle(tmp_path / "bundle", HERE)
    for part in ("tokenizer", "tokens"):
        (bundle / "home" / part).mkdir(parents=True)
    slow = (
        "import json, sys, time; open(sys.argv[1], 'w').write(json.dumps({'results': {'newton_schulz/1024': "
        "{'ok': True}}})); print('measured one', flush=True); time.sleep(60)"
    )
    monkeypatch.setattr(gpu_check, "WORK", work)
    monkeypatch.setattr(gpu_check, "preflight", lambda *a, **k: {})
    monkeypatch.setattr(gpu_check, "install", lambda *a: ("ok", "stand-in"))
    monkeypatch.setattr(gpu_check, "venv_python", lambda venv: Path(sys.executable))
    monkeypatch.setattr(
        gpu_check,
        "PLAN",
        [
            gpu_check.Step("install", "stand-in", 1, []),
            gpu_check.Step("newton_schulz", "slow", 3, ["-c", slow, "{work}/newton_schulz.json"]),
            gpu_check.Step("muon", "quick", 30, ["-c", "raise SystemExit(3)"]),
        ],
    )
    monkeypatch.setattr(gpu_check, "GPU_TESTS", gpu_check.Step("gpu_tests", "none left", 0, ["-c", "pass"]))
    monkeypatch.setattr(gpu_check, "BUDGET_S", 5)
    assert gpu_check.check(bundle, out) == 1
    data = json.loads((out / "results-cuda.json").read_text())
    steps = {s["key"]: s for s in data["steps"]}
    assert steps["newton_schulz"]["status"] == "hit its cap"
    assert 3 <= steps["newton_schulz"]["seconds"] < 20
    assert steps["newton_schulz"]["figures"] == {"results": {"newton_schulz/1024": {"ok": True}}}
    assert steps["muon"]["status"] == "failed"
    assert steps["gpu_tests"]["status"] == "skipped"  # the budget is spent
    assert data["finished"] and data["verdict"] == (
        "1 of 4 steps passed; not: newton_schulz (hit its cap), muon (failed), gpu_tests (skipped)"
    )
    text = (out / "RESULTS-cuda.md").read_text()
    assert "| newton_schulz: slow | **hit its cap** | " in text
    assert sorted(p.name for p in out.iterdir()) == sorted(gpu_check.OUTPUTS)


def test_train_figures_skip_the_warmup_and_count_passes(tmp_path):
    rows = [{"kind": "eval", "step": 0}]
    rows += [
        {
            "kind": "train",
            "step": s,
            "loss": 10 - s / 10,
            "tok_per_sec": 1000.0 * s,
            "mfu": s / 2,
            "tokens_seen": 1000 * s,
            "peak_memory_bytes": 2**30 * (1 + (s == 3)),
        }
        for s in range(1, 51)
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    f = gpu_report.train_figures(metrics, train_tokens=20_000)
    assert f["steps"] == 50 and f["timed_steps"] == "10-50"
    assert f["tok_per_sec"] == 30_000.0 and f["mfu"] == 15.0  # medians of steps 10..50
    assert f["peak_memory_gib"] == 2.0 and f["passes_over_data"] == 2.5 and f["final_loss"] == 5.0


def test_report_names_a_config_that_failed(tmp_path):
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "kernels.json").write_text(
        json.dumps(
            {
                "results": {
                    "newton_schulz_triton/large/bf16": {
                        "ok": True,
                        "max_error": 4e-3,
                        "tolerance": 2e-2,
                        "stock_bf16_error": 5e-3,
                    },
                    "newton_schulz_triton/small/fp32": {"ok": False, "error": "CompilationError: out of resources"},
                }
            }
        )
    )
    report = gpu_report.Report(tmp_path, work, tmp_path, rehearse=False)
    report.add(gpu_check.PLAN[2], "failed", "1 measured; failed: newton_schulz_triton/small/fp32", 12.0, 40)
    text = (tmp_path / "RESULTS-cuda.md").read_text()
    assert "| newton_schulz_triton/large/bf16 | 4.00e-03 | 2.0e-02 | ok: stock bf16 5.00e-03 |" in text
    assert "| newton_schulz_triton/small/fp32 | n/a | n/a | **FAILED**: CompilationError: out of resources |" in text
    assert "Verdict: **0 of 1 steps passed; not: kernels (failed)** (so far" in text


def test_node_list_names_the_node_and_the_bundle_carries_the_rest():
    node = gpu_bundle.read_node()
    assert node.python == "3.12" and node.packages["torch"] == "2.11.0" and node.packages["triton"] == "3.6.0"
    missing = [r for r in gpu_bundle.runtime_requirements() if gpu_bundle.Requirement(r).name not in node.packages]
    assert missing == ["rustbpe"]  # what the bundle carries today


def test_an_oversized_bundle_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    gpu_check.small_corpus(tmp_path / "corpus")
    monkeypatch.setattr(gpu_bundle, "MAX_BYTES", 10_000)
    with pytest.raises(gpu_bundle.BundleError, match=r"the bundle takes .* MiB, over its 0 MiB"):
        gpu_bundle.build(tmp_path / "bundle", HERE, tmp_path / "corpus", vocab_size=300, requirements=[])
    assert list(tmp_path.iterdir()) == [tmp_path / "corpus"]


def test_rehearsal(tmp_path):
    """Everything the node's check does that needs no GPU, here and offline: its exit code is the
    verdict. Then the failure it exists for: a dependency added without a wheel in the bundle."""
    keep = tmp_path / "rehearsal"
    keep.mkdir()
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "rehearse", "--keep", str(keep)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rehearsal: 11 steps ran; check exit 1; all as expected" in result.stdout
    node = gpu_bundle.read_node()
    wheels = keep / f"wheels-{node.python}"
    assert [p.name.split("-")[0] for p in wheels.glob("*.whl")] == ["rustbpe"]
    why = gpu_bundle.resolve_for_node(gpu_bundle.runtime_requirements() + ["fastapi"], wheels, node)
    assert (
        why.startswith("the package does not install on the node (Python 3.12) from the bundle: ") and "fastapi" in why
    )
    report = json.loads((keep / "out" / "results-cuda.json").read_text())
    assert report["rehearsal"] and [s["key"] for s in report["steps"]] == [s.key for s in gpu_check.PLAN] + [
        "gpu_tests"
    ]
