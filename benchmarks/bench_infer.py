"""Inference sweep: `python -m nanochat_fast.scripts.infer_bench` on a demo-sized model, decode batch
1 to 32.

The model is the demo's shape (depth 4: n_embd 256, 2 heads; 512 positions; vocab 8192) with
nanochat's random init: decode speed does not depend on what the weights say, and the rows never
stop early (the script clears the stop tokens). Each batch size runs 128-token prompts and 128
greedy tokens per row through one BatchEngine, in the compute dtype the script picks here (--dtype
auto). The script runs SWEEPS times as a real process (its last stdout line is the JSON it
promises); per batch size RESULTS.md shows the sweep with the fastest decode (on shared cores a
neighbour only ever adds time, the rule of the hardware probes), so every figure in a row comes
from the same run. make_results.py writes the table (inference_sweep_section).

    .venv/bin/python -m pytest benchmarks/bench_infer.py -o python_files='bench_*.py' --benchmark-json=/tmp/infer.json
"""

import json
import subprocess
import sys
from pathlib import Path

from harness import MIN_ROUNDS

ROOT = Path(__file__).resolve().parents[1]
BATCH_SIZES = [1, 2, 4, 8, 16, 32]
ARGS = [
    "--depth=4",
    "--max-seq-len=512",
    "--vocab-size=8192",
    "--prompt-tokens=128",
    "--decode-tokens=128",
    "--batch-sizes=" + ",".join(map(str, BATCH_SIZES)),
    "--device-type=cpu",
]
SWEEPS = MIN_ROUNDS  # each about 10 s on 2 quiet cores, 20 s on busy ones


def sweep() -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "nanochat_fast.scripts.infer_bench", *ARGS], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def fastest_rows(runs: list[dict]) -> list[dict]:
    """Per batch size, the row of the sweep with the fastest decode."""
    return [
        max((run["sweep"][i] for run in runs), key=lambda row: row["decode_tok_per_s"]) for i in range(len(BATCH_SIZES))
    ]


def test_inference_sweep(benchmark):
    runs = []
    benchmark.pedantic(lambda: runs.append(sweep()), rounds=SWEEPS, warmup_rounds=0, iterations=1)
    result = {k: v for k, v in runs[0].items() if k != "sweep"}
    result.update(
        sweep=fastest_rows(runs),
        sweeps=len(runs),
        command="python -m nanochat_fast.scripts.infer_bench " + " ".join(ARGS),
    )
    benchmark.extra_info["inference_sweep"] = result
    print(json.dumps(result["sweep"], indent=1))
