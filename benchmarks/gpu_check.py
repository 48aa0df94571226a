"""
`make gpu-check`: the whole GPU verdict in one command on a CUDA machine (README, "GPU").

    python3 benchmarks/gpu_check.py preflight     # standard library only, before anything is installed:
                                                  # one line (and exit 2) without an NVIDIA GPU or nvcc
    python3 benchmarks/gpu_check.py stage DIR     # sync the source tree into DIR, which gets its own
                                                  # venv with a CUDA torch (the CPU .venv is left alone)
    DIR/.venv/bin/python benchmarks/gpu_check.py run --out RESULTS-cuda.md --home HOME --logs LOGS

`run` (inside DIR, with the CUDA build installed) records each step, ok or FAILED and why, and carries on:
  1. the GPU and the software: torch sees the GPU, the extension was built with CUDA
  2. the tests marked `gpu`
  3. the benchmarks on CUDA (CUDA_BENCHMARKS; each writes pytest-benchmark JSON)
  4. a 50-step base_train at depth 12 on the built-in corpus: tokens/s and MFU
then writes RESULTS-cuda.md (the GPU's name, the verdict table, the benchmark tables) and exits 1 if
any step failed.
"""
from __future__ import annotations  # preflight runs on the machine's python3, maybe older than the venv's

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_BENCHMARKS = ["bench_adamw_slice_cuda.py", "bench_newton_schulz.py", "bench_muon.py", "bench_softcap_cross_entropy.py",
                   "bench_train_step.py"]
TRAIN_FLAGS = ["--depth=12", "--num-iterations=50", "--eval-every=-1", "--sample-every=-1", "--run=gpu_check_d12",
               "--overwrite"]
WARMUP_STEPS = 10  # compilation and autotuning land in the first steps; medians skip them
# the staged copy's own install, kept between runs (the rest of DIR mirrors the source tree)
STAGE_KEEP = (".venv", "build", ".pytest_cache", "nanochat_fast/_C.so")
STAGE_SKIP = {".venv", "build", ".git", "__pycache__", ".pytest_cache", ".benchmarks"}


# ---------------------------------------------------------------------------------------------
# preflight and staging: standard library only (torch is not installed yet)


def _nvcc() -> str | None:
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found = [str(Path(h) / "bin" / "nvcc") for h in homes if h and (Path(h) / "bin" / "nvcc").exists()]
    return shutil.which("nvcc") or (found[0] if found else None)


def preflight() -> str:
    """Why this machine cannot run the check, in one line; empty when it can."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ("make gpu-check needs an NVIDIA GPU: no nvidia-smi here (no NVIDIA driver); run it on a "
                "machine with a CUDA GPU")
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True)
    if listed.returncode != 0 or not any(line.startswith("GPU ") for line in listed.stdout.splitlines()):
        why = (listed.stderr or listed.stdout).strip().splitlines()[:1] or ["it lists none"]
        return f"make gpu-check needs an NVIDIA GPU: nvidia-smi -L finds no GPU ({why[0]})"
    if _nvcc() is None:
        return ("make gpu-check builds the CUDA kernels and needs nvcc (the CUDA toolkit): install it, put it "
                "on PATH or set CUDA_HOME")
    return ""


def _source_files(root: Path) -> set[str]:
    """Paths (relative) of the source tree: git's tracked and untracked-but-not-ignored files when
    it is a git checkout, else every file outside the build and cache directories."""
    git = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard"],
                         capture_output=True, text=True)
    if git.returncode == 0:
        return {line for line in git.stdout.splitlines() if (root / line).is_file()}
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and not STAGE_SKIP & set(p.relative_to(root).parts) and p.suffix not in (".so", ".o")}


def stage(dst: Path, root: Path = ROOT):
    """Make dst a copy of the source tree. Unchanged files keep their time stamps (so the Makefile
    does not reinstall), files gone from the source are removed, the copy's own install stays."""
    files = _source_files(root)
    for rel in sorted(files):
        src, out = root / rel, dst / rel
        if not out.exists() or out.stat().st_size != src.stat().st_size or out.stat().st_mtime != src.stat().st_mtime:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)
    for path in sorted(dst.rglob("*"), reverse=True):
        rel = path.relative_to(dst)
        kept = any(rel.parts[:len(Path(k).parts)] == Path(k).parts for k in STAGE_KEEP)
        if path.is_file() and str(rel) not in files and not kept and "__pycache__" not in rel.parts \
                and not rel.parts[0].endswith(".egg-info"):
            path.unlink()


# ---------------------------------------------------------------------------------------------
# the steps (inside the staged copy, CUDA torch installed)


@dataclass
class Step:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


def _run(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run cmd in the tree's root with its output teed to `log` (and the terminal)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env={**os.environ, **(env or {})})
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode)


def _tail(log: Path) -> str:
    lines = [line.strip() for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    return lines[-1][:200] if lines else "no output"


def environment() -> tuple[dict, list[Step]]:
    """What runs where; a failed step when torch cannot use the GPU or the extension lacks CUDA."""
    import torch
    import triton
    from nanochat_fast.kernels import registry
    facts = dict(torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__,
                 python=sys.version.split()[0])
    if torch.version.cuda is None:
        return facts, [Step("torch uses the GPU", False, f"torch {torch.__version__} is a CPU build: set "
                            "GPU_TORCH_SPEC to a CUDA wheel, e.g. 'torch==2.13.0 --index-url "
                            "https://download.pytorch.org/whl/cu130'")]
    if not torch.cuda.is_available():
        return facts, [Step("torch uses the GPU", False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) "
                            "cannot use the GPU: is the driver older than that CUDA? (nvidia-smi)")]
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.split()
    facts.update(gpu=props.name, count=torch.cuda.device_count(), arch=f"sm_{props.major}{props.minor}",
                 sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2 ** 30, 1),
                 driver=smi[0] if smi else "?")
    with_cuda = registry._C is not None and bool(getattr(registry._C, "with_cuda", False))
    facts["extension_cuda"] = with_cuda
    why = "" if with_cuda else f": {registry.cpp_why_not('cuda', has_cuda_kernel=True)}"
    return facts, [Step("torch uses the GPU", True, f"{props.name}, torch {torch.__version__}"),
                   Step("extension built with CUDA", with_cuda, f"{'yes' if with_cuda else 'no'}{why}")]


def gpu_tests(logs: Path) -> Step:
    t0, xml = time.perf_counter(), logs / "gpu-tests.xml"
    result = _run([sys.executable, "-m", "pytest", "python_tests", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={xml}"], logs / "gpu-tests.log")
    counts = "no JUnit report"
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        counts = f"{total - failed - errors - skipped} passed, {failed} failed, {errors} errors, {skipped} skipped"
    return Step("tests marked gpu", result.returncode == 0, counts, time.perf_counter() - t0)


def benchmarks(logs: Path) -> tuple[list[Step], dict]:
    """Each CUDA benchmark file on its own (one failing does not lose the others); merged JSON."""
    steps, merged = [], {"benchmarks": []}
    for name in CUDA_BENCHMARKS:
        t0, path, out = time.perf_counter(), ROOT / "benchmarks" / name, logs / f"{Path(name).stem}.json"
        if not path.exists():
            steps.append(Step(name, False, "missing: this benchmark is part of the check"))
            continue
        result = _run([sys.executable, "-m", "pytest", str(path), "-o", "python_files=bench_*.py", "-p",
                       "no:cacheprovider", f"--benchmark-json={out}", "--benchmark-columns=median,rounds"],
                      logs / f"{Path(name).stem}.log")
        n = 0
        if out.exists():
            data = json.loads(out.read_text())
            merged.setdefault("datetime", data.get("datetime"))
            merged["benchmarks"] += data["benchmarks"]
            n = len(data["benchmarks"])
        ok = result.returncode == 0 and n > 0
        steps.append(Step(name, ok, f"{n} benchmark(s)" if ok else _tail(logs / f"{Path(name).stem}.log"),
                          time.perf_counter() - t0))
    return steps, merged


def train_summary(metrics: Path) -> str:
    """Median tokens/s and MFU of the steps after warmup, from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    timed = [r for r in train if r["step"] > WARMUP_STEPS] or train
    tok = statistics.median(r["tok_per_sec"] for r in timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    mfu = f"MFU {statistics.median(mfus):.1f}%" if mfus else "MFU n/a (no peak known for this GPU)"
    return (f"{len(train)} steps, final loss {train[-1]['loss']:.3f}; steps {timed[0]['step']}-{timed[-1]['step']}: "
            f"median {tok:,.0f} tokens/s, {mfu}")


def base_train(home: Path, logs: Path) -> Step:
    t0 = time.perf_counter()
    env = {"NANOCHAT_FAST_HOME": str(home)}
    py = [sys.executable, "-m"]
    for module, flags in (("nanochat_fast.scripts.prepare_data", ["--datasets=base"]),
                          ("nanochat_fast.scripts.tok_train", []),
                          ("nanochat_fast.scripts.base_train", TRAIN_FLAGS)):
        log = logs / f"{module.rsplit('.', 1)[1]}.log"
        if _run(py + [module, *flags], log, env).returncode != 0:
            return Step("base_train depth 12, 50 steps", False, f"{module}: {_tail(log)}", time.perf_counter() - t0)
    summary = train_summary(home / "runs" / "gpu_check_d12" / "metrics.jsonl")
    return Step("base_train depth 12, 50 steps", True, summary, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# the report


def benchmark_tables(bench: dict) -> list[str]:
    """The benchmark sections as make_results.py renders them (its header lines left out)."""
    if not bench.get("benchmarks"):
        return ["No benchmark results."]
    import tempfile
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_results
    with tempfile.TemporaryDirectory() as tmp:
        src, md = Path(tmp) / "results.json", Path(tmp) / "results.md"
        src.write_text(json.dumps(bench))
        make_results.main(str(src), str(md))
        text = md.read_text()
    start = text.find("\n## ")
    return text[start + 1:].splitlines() if start >= 0 else []


def write_report(out: Path, facts: dict, steps: list[Step], bench: dict, logs: str):
    ok = all(s.ok for s in steps)
    gpu = facts.get("gpu", "no usable GPU")
    where = (f"{facts.get('count', 1)} x {gpu} ({facts.get('arch', '?')}, {facts.get('sms', '?')} SMs, "
             f"{facts.get('memory_gib', '?')} GiB), driver {facts.get('driver', '?')}" if "gpu" in facts else gpu)
    lines = [f"# GPU check: {gpu}", "",
             f"Produced by `make gpu-check` on {time.strftime('%Y-%m-%d %H:%M')}: {where}; torch {facts.get('torch')} "
             f"(CUDA {facts.get('cuda')}), Triton {facts.get('triton')}, Python {facts.get('python')}.  ",
             f"Verdict: **{'all steps passed' if ok else 'FAILED'}**. Logs: `{logs}`.", "",
             "| step | result | detail | time |", "|---|---|---|---:|"]
    lines += [f"| {s.name} | {'ok' if s.ok else '**FAILED**'} | {s.detail} | {s.seconds:.0f} s |" for s in steps]
    lines += ["", *benchmark_tables(bench), ""]
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, out)


def run(out: Path, home: Path, logs: Path) -> int:
    logs.mkdir(parents=True, exist_ok=True)
    facts, steps = environment()
    bench = {}
    if "gpu" in facts:  # torch can use the GPU: everything else can run
        steps.append(gpu_tests(logs))
        bench_steps, bench = benchmarks(logs)
        steps += bench_steps
        steps.append(base_train(home, logs))
        (logs / "results-cuda.json").write_text(json.dumps(bench, indent=1))
    write_report(out, facts, steps, bench, str(logs))
    print(f"\n{'all steps passed' if all(s.ok for s in steps) else 'FAILED'}: "
          + "; ".join(f"{s.name}: {'ok' if s.ok else 'FAILED'}" for s in steps))
    print(f"wrote {out}")
    return 0 if all(s.ok for s in steps) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("preflight", help="one line and exit 2 when this machine cannot run the check")
    p = sub.add_parser("stage", help="sync the source tree into DIR")
    p.add_argument("dir", type=Path)
    p = sub.add_parser("run", help="run every step and write the report")
    p.add_argument("--out", type=Path, required=True, help="the report (RESULTS-cuda.md)")
    p.add_argument("--home", type=Path, required=True, help="NANOCHAT_FAST_HOME for the training run")
    p.add_argument("--logs", type=Path, required=True, help="where each step's log goes")
    args = parser.parse_args(argv)
    if args.command == "preflight":
        why = preflight()
        if why:
            print(why, file=sys.stderr)
        return 2 if why else 0
    if args.command == "stage":
        stage(args.dir.resolve())
        return 0
    return run(args.out.resolve(), args.home.resolve(), args.logs.resolve())


if __name__ == "__main__":
    sys.exit(main())
