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


# --dtype auto against both forced dtypes, at the batch sizes the auto choice is judged at
AUTO_BATCHES = [1, 8]


def sweep_in(dtype: str) -> dict:
    args = [a for a in ARGS if not a.startswith("--batch-sizes=")]
    out = subprocess.run(
        [sys.executable, "-m", "nanochat_fast.scripts.infer_bench", *args, f"--dtype={dtype}", "--batch-sizes=1,8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_auto_dtype_against_forced(benchmark):
    """infer_bench in fp32, in bf16 and with --dtype auto, in interleaved rounds (the order rotated); per
    batch size and dtype the fastest round. auto is judged on the whole mix it times (its prefills and
    decode steps, seconds) and on decode tok/s, against the faster forced dtype."""
    dtypes = ["fp32", "bf16", "auto"]
    runs = {d: [] for d in dtypes}
    counter = [0]

    def one_round():
        r = counter[0]
        counter[0] += 1
        for d in dtypes[r % 3 :] + dtypes[: r % 3]:
            runs[d].append(sweep_in(d))

    benchmark.pedantic(one_round, rounds=SWEEPS, warmup_rounds=0, iterations=1)
    rows, targets = [], []
    for i, batch in enumerate(AUTO_BATCHES):
        best = {
            d: min((run["sweep"][i] for run in runs[d]), key=lambda row: row["prefill_s"] + row["decode_s"])
            for d in dtypes
        }
        tok = {d: max(run["sweep"][i]["decode_tok_per_s"] for run in runs[d]) for d in dtypes}
        mix = {d: best[d]["prefill_s"] + best[d]["decode_s"] for d in dtypes}
        chose = sorted({run["sweep"][i]["dtype"] for run in runs["auto"]})
        faster = min(("fp32", "bf16"), key=mix.get)
        ratio_mix = mix[faster] / mix["auto"]
        ratio_tok = tok["auto"] / max(tok["fp32"], tok["bf16"])
        rows.append(
            [str(batch)]
            + [f"{mix[d]:.3f}" for d in dtypes]
            + [f"{tok[d]:,.1f}" for d in dtypes]
            + ["/".join(chose), f"{ratio_mix:.3f}", f"{ratio_tok:.3f}"]
        )
        targets.append(
            [
                f"auto / faster forced, batch {batch} (whole mix)",
                f"{ratio_mix:.3f}",
                ">= 0.95",
                "yes" if ratio_mix >= 0.95 else "no",
            ]
        )
        targets.append(
            [
                f"auto / faster forced, batch {batch} (decode tok/s)",
                f"{ratio_tok:.3f}",
                ">= 0.95",
                "yes" if ratio_tok >= 0.95 else "no",
            ]
        )
    fixed = [a for a in ARGS if not a.startswith("--batch-sizes=")]
    benchmark.extra_info["table"] = {
        "title": "Generation: --dtype auto against forced fp32 and bf16 (infer_bench, cpu)",
        "columns": [
            "batch",
            "mix s fp32",
            "mix s bf16",
            "mix s auto",
            "decode tok/s fp32",
            "decode tok/s bf16",
            "decode tok/s auto",
            "auto chose",
            "auto vs faster (mix)",
            "auto vs faster (decode)",
        ],
        "rows": rows,
        "notes": f"`python -m nanochat_fast.scripts.infer_bench {' '.join(fixed)} --batch-sizes=1,8 --dtype=D`, "
        f"D in fp32, bf16, auto, in {len(runs['auto'])} interleaved rounds (order rotated), one process each; "
        "per batch size and dtype the fastest round: mix = prefill s + decode s of its requests (what auto "
        "times, model/generation_dtype.py), decode tok/s as in the sweep. auto decides per batch size on its "
        "own timing (cached after its first run unless the machine is busy). Ratios above 1: auto faster.",
        "targets": targets,
    }
    print(json.dumps(rows))
