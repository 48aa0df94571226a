"""
Training speed against nanochat itself: its own base_train (a checkout given by --nanochat) and ours
on the same model, config, data and machine, in interleaved rounds (the machine may be shared).

    python benchmarks/bench_vs_nanochat.py --nanochat=/path/to/nanochat --home=HOME [--rounds=2] [--pythonpath=DIR]

HOME is a NANOCHAT_FAST_HOME with prepared base data and a tokenizer (prepare_data, tok_train).
nanochat gets a base directory made from it (build/nanochat_base): our tokenizer written as its
tokenizer.pkl and token_bytes.pt, our base train shards as its pretraining parquet files and our val
shard as its last one. Both train the windowed model at depth 4, T=512, 8 rows, 4,096 tokens per
step, window pattern SL; evaluation, sampling and CORE off. tok/s is the median of the steps after
the first WARMUP (compile and first steps excluded), per run; each variant's figure is the median
over its rounds. nanochat runs with its own switch NANOCHAT_DTYPE=float32 (also its CPU default)
and compiles as it always does (its Newton-Schulz then runs in fp32 too); ours runs compiled with
--dtype=fp32 (Newton-Schulz in the dtype it measures faster), with --dtype=fp32 --ns-dtype=fp32
(everything in fp32, as nanochat), and with its defaults.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ["--depth=4", "--max-seq-len=512", "--device-batch-size=8", "--total-batch-size=4096", "--window-pattern=SL"]
WARMUP = 5


def nanochat_base_dir(home: Path, out: Path) -> Path:
    """nanochat's base directory holding our tokenizer and base data, made once."""
    env = dict(os.environ, NANOCHAT_FAST_HOME=str(home))
    data = out / "base_data_climbmix"
    if not data.is_dir():
        data.mkdir(parents=True)
        train = sorted((home / "data" / "base" / "train").glob("shard_*.parquet"))
        val = sorted((home / "data" / "base" / "val").glob("shard_*.parquet"))
        for i, path in enumerate([*train, val[0]]):  # nanochat's val split is its last file
            shutil.copy(path, data / f"shard_{i:05d}.parquet")
        script = (
            "import sys; from pathlib import Path; from nanochat_fast.data.tokenizer import get_tokenizer; "
            "from nanochat_fast.interop.nanochat_tokenizer import write_tokenizer_files; "
            "write_tokenizer_files(get_tokenizer(), Path(sys.argv[1]))"
        )
        subprocess.run([sys.executable, "-c", script, str(out / "tokenizer")], env=env, check=True)
    return out


def tok_per_s(log: str, pattern: str) -> float:
    values = [float(v.replace(",", "")) for v in re.findall(pattern, log)]
    if len(values) <= WARMUP:
        raise SystemExit(f"too few step lines ({len(values)}) in:\n{log[-3000:]}")
    return statistics.median(values[WARMUP:])


def nanochat_parser(doc: str) -> argparse.ArgumentParser:
    """The flags of a script that runs nanochat's own code beside ours."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanochat", type=Path, required=True, help="a nanochat checkout (92d63d4)")
    p.add_argument("--home", type=Path, required=True, help="a NANOCHAT_FAST_HOME with base data and a tokenizer")
    p.add_argument("--pythonpath", default="", help="where nanochat's own dependencies are (rustbpe, psutil)")
    return p


def nanochat_env(nanochat: Path, base: Path, dtype: str | None, extra_path: str = "") -> dict:
    """The environment nanochat's scripts run in: its base directory, its checkout on the path."""
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(nanochat), extra_path]))
    if dtype:
        env["NANOCHAT_DTYPE"] = dtype
    env.pop("NANOCHAT_FAST_HOME", None)
    return env


def run_checked(cmd: list, cwd, env: dict, what: str) -> subprocess.CompletedProcess:
    """cmd run to its end, its output captured; the script stops with that output if it failed."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_nanochat(nanochat: Path, base: Path, steps: int, dtype: str | None, extra_path: str = "") -> float:
    env = nanochat_env(nanochat, base, dtype, extra_path)
    cmd = [sys.executable, "-m", "scripts.base_train", *CONFIG, f"--num-iterations={steps}", "--eval-every=-1"]
    cmd += ["--core-metric-every=-1", "--sample-every=-1", "--device-type=cpu", "--run=dummy"]
    proc = run_checked(cmd, nanochat, env, "nanochat")
    return tok_per_s(proc.stdout + proc.stderr, r"tok/sec: ([\d,]+)")


def run_ours(home: Path, steps: int, flags: list[str], name: str) -> float:
    env = dict(os.environ, NANOCHAT_FAST_HOME=str(home), TORCHINDUCTOR_CACHE_DIR=str(ROOT / "build" / "inductor"))
    cmd = [sys.executable, "-m", "nanochat_fast.scripts.base_train", "--arch=windowed", *CONFIG, *flags]
    cmd += [f"--num-iterations={steps}", "--eval-every=-1", "--sample-every=-1", f"--run={name}", "--overwrite"]
    proc = run_checked(cmd, ROOT, env, "ours")
    return tok_per_s(proc.stdout, r"tok/s ([\d,]+)")


def main():
    p = nanochat_parser(__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=25)
    a = p.parse_args()
    base = nanochat_base_dir(a.home, ROOT / "build" / "nanochat_base")
    variants = {
        "nanochat@92d63d4, NANOCHAT_DTYPE=float32 (its CPU default too), compiled": lambda: run_nanochat(
            a.nanochat, base, a.steps, "float32", a.pythonpath
        ),
        "ours --arch=windowed --dtype=fp32 --compile": lambda: run_ours(
            a.home, a.steps, ["--dtype=fp32", "--compile"], "speed_fp32"
        ),
        "ours --arch=windowed --dtype=fp32 --ns-dtype=fp32 --compile": lambda: run_ours(
            a.home, a.steps, ["--dtype=fp32", "--ns-dtype=fp32", "--compile"], "speed_fp32_ns"
        ),
        "ours --arch=windowed, defaults (--dtype=auto)": lambda: run_ours(a.home, a.steps, [], "speed_auto"),
    }
    results = {name: [] for name in variants}
    for r in range(a.rounds):  # interleaved: every variant once per round
        for name, fn in variants.items():
            results[name].append(fn())
            print(f"round {r + 1}: {name}: {results[name][-1]:,.0f} tok/s", flush=True)
    base_name = next(iter(variants))
    ref = statistics.median(results[base_name])
    print("\n| variant | tok/s (median of rounds) | rounds | vs nanochat fp32 |\n|---|---:|---:|---:|")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"| {name} | {med:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | {med / ref:.2f}x |")


if __name__ == "__main__":
    main()
