"""
A checkpoint trained by nanochat's own code, brought across: nanochat@92d63d4's base_train trains the
windowed model on our data, reports its val bpb and saves (weights and its combined optimizer
state); import_nanochat brings it into a run of ours; our base_eval measures val bpb on the same
val shard. The two figures should agree within 3% (the loaders pack the val documents differently).

    python benchmarks/import_nanochat_trained.py --nanochat=/path/to/nanochat --home=HOME \
        [--steps=150] [--eval-tokens=32768] [--pythonpath=DIR]

HOME and nanochat's base directory are made as in bench_vs_nanochat.py (our tokenizer as its
tokenizer.pkl, our base shards as its parquet files, our val shard as its last one). The model:
depth 4, T=512, 8 rows, 4,096 tokens per step, window pattern SL, fp32 (NANOCHAT_DTYPE=float32).
"""

import os
import re
import sys

from bench_vs_nanochat import CONFIG, ROOT, nanochat_base_dir, nanochat_env, nanochat_parser, run_checked

TAG = "windowed_trained"
RUN = "nanochat_windowed_trained"


def run(cmd, cwd, env, what) -> str:
    """run_checked, said first; its whole output."""
    print("$", " ".join(map(str, cmd)), flush=True)
    proc = run_checked(cmd, cwd, env, what)
    return proc.stdout + proc.stderr


def main():
    p = nanochat_parser(__doc__)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-tokens", type=int, default=32768)
    a = p.parse_args()
    base = nanochat_base_dir(a.home, ROOT / "build" / "nanochat_base")
    env = nanochat_env(a.nanochat, base, "float32", a.pythonpath)
    cmd = [sys.executable, "-m", "scripts.base_train", *CONFIG, f"--num-iterations={a.steps}"]
    cmd += [f"--eval-every={a.steps}", f"--eval-tokens={a.eval_tokens}", "--core-metric-every=-1"]
    cmd += ["--sample-every=-1", "--device-type=cpu", "--run=dummy", f"--model-tag={TAG}"]
    log = run(cmd, a.nanochat, env, "nanochat's base_train")
    theirs = float(re.findall(rf"Step {a.steps:05d} \| Validation bpb: ([\d.]+)", log)[-1])

    ours_env = dict(os.environ, NANOCHAT_FAST_HOME=str(a.home))
    script = [sys.executable, "-m"]
    imported = run(
        [*script, "nanochat_fast.scripts.import_nanochat", f"--from={base / 'base_checkpoints' / TAG}"]
        + [f"--tokenizer={base / 'tokenizer'}", f"--run={RUN}", "--overwrite"],
        ROOT,
        ours_env,
        "import_nanochat",
    )
    evaluated = run(
        [*script, "nanochat_fast.scripts.base_eval", f"--run={RUN}", f"--eval-tokens={a.eval_tokens}"]
        + ["--max-examples=0", "--samples=0", "--dtype=fp32"],
        ROOT,
        ours_env,
        "base_eval",
    )
    ours = float(re.search(r"val bpb \(.*?\): ([\d.]+)", evaluated).group(1))
    kept = ("nanochat checkpoint", "optimizer state")
    print("\n".join(line for line in imported.splitlines() if line.startswith(kept)))
    print(f"\nnanochat's val bpb at step {a.steps} (its own evaluation, {a.eval_tokens:,} tokens): {theirs:.4f}")
    print(f"ours on the imported checkpoint (base_eval, up to {a.eval_tokens:,} tokens): {ours:.4f}")
    print(f"difference: {100 * (ours - theirs) / theirs:+.2f}%")


if __name__ == "__main__":
    main()
