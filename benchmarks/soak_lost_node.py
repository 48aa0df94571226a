"""
Soak of a lost node: N runs of a tiny base_train on two torchrun agents of this machine (one process
each, `--nnodes=1:2 --max-restarts=3`, c10d rendezvous on 127.0.0.1, `--resume=auto --save-every=5`),
node 1 killed with SIGKILL (agent and worker) once step 7 is logged. A run passes when node 0 exits 0
with every step logged once, after resuming from a two-process checkpoint, with the losses of one
process resumed from that checkpoint (the curve continues), and no half-written checkpoint is left.

    python benchmarks/soak_lost_node.py --runs=5 --record=NAME

Exit code 0 when every run passed, else 1. --record=NAME keeps the figures under NAME in
benchmarks/soak_lost_node.json, which RESULTS.md's "Distributed soak" section shows (make_results.py).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_tests"))  # the support package

from support.tiny_pipeline import FP32, TINY_MODEL, TINY_STEPS, build_tiny_home, home_env, train_rows  # noqa: E402
from support.two_nodes import Cluster  # noqa: E402

from nanochat_fast.hardware import cpu_model  # noqa: E402

STEPS = 40
ARGS = TINY_MODEL + FP32 + TINY_STEPS + [f"--num-iterations={STEPS}", "--no-compile", "--save-every=5"]
SLOW = ["--step-seconds=0.2"]  # python_tests/support/faults.py: steps long enough to kill a node between them


def one_run(home: Path, work: Path, name: str, timeout: float) -> dict:
    """One lost-node run; what went wrong (empty: nothing) and its seconds."""
    from nanochat_fast.scripts import base_train

    run_dir, problems, t0 = home / "runs" / name, [], time.monotonic()
    target = [*SLOW, "base_train", *ARGS, "--resume=auto", f"--run={name}"]
    with Cluster(work, home, nnodes="1:2", max_restarts=3) as cluster:
        node0 = cluster.start(0, target)
        node1 = cluster.start(1, target)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and node0.proc.poll() is None:
            steps = [r["step"] for r in train_rows(run_dir)] if (run_dir / "metrics.jsonl").exists() else []
            if max(steps, default=0) >= 7:
                break
            time.sleep(0.05)
        node1.kill()
        (code, _) = cluster.wait_all(timeout)
        out = node0.output()
    resumed = [line for line in out.splitlines() if line.startswith("resumed from ")]
    if code != 0:
        problems.append(f"node 0 exit {code}")
    if len(resumed) != 1 or "saved with 2 process" not in resumed[0]:
        problems.append(f"resumed lines: {resumed}")
    rows = train_rows(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    if [r["step"] for r in rows] != list(range(1, STEPS + 1)):
        problems.append(f"logged steps {[r['step'] for r in rows]}")
    half = list((run_dir / "checkpoints").glob("*.partial")) + list(run_dir.rglob(".*.tmp*"))
    if half:
        problems.append(f"half-written files left: {half}")
    if not problems:  # the losses after the resume: those of one process resumed from the same checkpoint
        ckpt = resumed[0].split()[2]
        step = int(Path(ckpt).name.removeprefix("step_"))
        with home_env(home):
            base_train.main(ARGS + [f"--run={name}-one", f"--resume={ckpt}"])
        one = {r["step"]: r["loss"] for r in train_rows(home / "runs" / f"{name}-one")}
        if [r["loss"] for r in rows[step:]] != [one.get(s) for s in range(step + 1, STEPS + 1)]:
            problems.append(f"the losses after step {step} are not one process's resumed from {ckpt}")
    return {"problems": problems, "seconds": time.monotonic() - t0, "tail": out[-1500:] if problems else ""}


def soak(runs: int, workdir: Path, timeout: float = 240, log=print) -> dict:
    home = build_tiny_home(workdir)
    results = []
    for i in range(runs):
        work = workdir / f"run{i}"
        work.mkdir()
        r = one_run(home, work, f"lost{i}", timeout)
        results.append(r)
        log(f"run {i + 1}/{runs}: {'; '.join(r['problems']) or 'ok'} ({r['seconds']:.0f} s)", flush=True)
        shutil.rmtree(home / "runs" / f"lost{i}", ignore_errors=True)
        shutil.rmtree(home / "runs" / f"lost{i}-one", ignore_errors=True)
    failed = [{"run": i, **r} for i, r in enumerate(results) if r["problems"]]
    seconds = sorted(r["seconds"] for r in results)
    return {
        "runs": runs,
        "passed": runs - len(failed),
        "median_seconds": round(seconds[len(seconds) // 2], 1),
        "max_seconds": round(seconds[-1], 1),
        "failures": failed[:5],
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, shared",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="lost-node runs (default 5)")
    p.add_argument("--record", default="", help="keep the figures under this name in benchmarks/soak_lost_node.json")
    p.add_argument("--label", default="", help="what was soaked (e.g. a commit), kept with the figures")
    p.add_argument("--timeout", type=float, default=240, help="seconds before a run counts as hung")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak_lost_node_") as tmp:
        figures = soak(args.runs, Path(tmp), args.timeout)
    figures["label"] = args.label
    print(
        f"{figures['runs']} runs: {figures['passed']} passed, median {figures['median_seconds']:.0f} s, "
        f"longest {figures['max_seconds']:.0f} s"
    )
    for f in figures["failures"]:
        print(f"--- run {f['run']}: {'; '.join(f['problems'])}\n{f['tail']}")
    if args.record:
        record = Path(__file__).with_name("soak_lost_node.json")
        kept = json.loads(record.read_text()) if record.exists() else {}
        kept[args.record] = {k: v for k, v in figures.items() if k != "failures"}
        record.write_text(json.dumps(kept, indent=2) + "\n")
    return 0 if figures["passed"] == figures["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
