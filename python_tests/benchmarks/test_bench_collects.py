"""`make bench` collects every benchmark: they import their neighbours (harness.py, ...) as
top-level modules, which the test suite's own import mode does not allow; a benchmark that no
longer imports would leave RESULTS.md without its figures."""

import subprocess
import sys

from support.repo_paths import ROOT


def test_every_benchmark_module_is_collected():
    proc = subprocess.run(
        ["make", "-s", "bench-collect", f"PY={sys.executable}"], cwd=ROOT, capture_output=True, text=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and " error" not in out.lower(), out[-3000:]
    collected = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    with_tests = {  # (bench_vs_nanochat.py is a script: it needs a nanochat checkout)
        f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("bench_*.py") if "\ndef test_" in p.read_text()
    }
    assert with_tests - {"benchmarks/bench_adamw_slice_cuda.py"} <= collected, out[-3000:]  # (skipped: no GPU)
