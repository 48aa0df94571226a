"""
The two model families side by side: base_train --arch=gpt and --arch=windowed (each with its own
recipe's defaults) at depth 4 and 8 on the same data, tokens and steps; val bpb at the end (equal
tokens) and the median tok/s of the steps after the first 5. Runs one after another, pairs
interleaved by depth.

    python benchmarks/compare_families.py --home=HOME [--steps=80] [--depths=4,8]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--max-seq-len=256", "--device-batch-size=8", "--total-batch-size=2048", "--eval-tokens=16384"]


def run(home: Path, arch: str, depth: int, steps: int) -> dict:
    name = f"family_{arch}_d{depth}"
    env = dict(os.environ, NANOCHAT_FAST_HOME=str(home), TORCHINDUCTOR_CACHE_DIR=str(ROOT / "build" / "inductor"))
    cmd = [sys.executable, "-m", "nanochat_fast.scripts.base_train", f"--arch={arch}", f"--depth={depth}", *COMMON]
    cmd += [f"--num-iterations={steps}", f"--eval-every={steps}", "--sample-every=-1", f"--run={name}", "--overwrite"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (home / "runs" / name / "metrics.jsonl").read_text().splitlines() if line]
    evals = [r for r in rows if r["kind"] == "eval"]
    train = [r for r in rows if r["kind"] == "train"]
    tok_s = statistics.median(r["tok_per_sec"] for r in train[5:])
    compile_line = next((line for line in proc.stdout.splitlines() if line.startswith("compile:")), "")
    precision_line = next((line for line in proc.stdout.splitlines() if line.startswith("precision:")), "")
    return dict(
        arch=arch,
        depth=depth,
        steps=steps,
        tokens=steps * 2048,
        val_bpb=evals[-1]["val_bpb"],
        tok_s=tok_s,
        compile=compile_line,
        precision=precision_line,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", type=Path, required=True)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--depths", default="4,8")
    a = p.parse_args()
    results = []
    for depth in map(int, a.depths.split(",")):
        for arch in ("gpt", "windowed"):
            results.append(run(a.home, arch, depth, a.steps))
            print(json.dumps(results[-1]), flush=True)
    print("\n| depth | family | tokens | val bpb | tok/s | precision | compile |\n|---:|---|---:|---:|---:|---|---|")
    for r in results:
        print(
            f"| {r['depth']} | {r['arch']} | {r['tokens']:,} | {r['val_bpb']:.4f} | {r['tok_s']:,.0f} | "
            f"{r['precision'].removeprefix('precision: ')[:40]} | {r['compile'].removeprefix('compile: ')[:40]} |"
        )


if __name__ == "__main__":
    main()
