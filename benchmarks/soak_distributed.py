"""
Soak of the distributed teardown: N two-process gloo runs of a tiny base_train beside a busy process
that loads both cores, counting exit codes and "terminate called" lines (a rank aborted at exit).

Each run resumes (--resume=auto) a copy of one seed run from its step-3 checkpoint, trains to step 6,
evaluates and saves there, and ends: a resume, an eval, a save and a teardown per run. The busy
neighbour is what exposed teardown races (a rank destroying its process group while another is
still in a collective); without it they are rare. --sharding=fsdp soaks FSDP2's collectives too.

    python benchmarks/soak_distributed.py --runs=50 --sharding=fsdp --record=after
    make soak                     # 50 runs with --sharding=fsdp, recorded as "latest"

Exit code 0 when every run exited 0 without an abort line, else 1. --record=NAME keeps the figures
under NAME in benchmarks/soak.json, which RESULTS.md's "Distributed soak" section shows
(make_results.py); python_tests/benchmarks/test_soak_distributed.py runs 5 of them in CI.
"""

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_tests"))  # the support package

from support.tiny_pipeline import FP32, TINY_MODEL, build_tiny_home  # noqa: E402

from nanochat_fast.hardware import cpu_model  # noqa: E402

ABORT = "terminate called"
ARGS = (
    TINY_MODEL
    + FP32
    + [
        "--eval-tokens=512",
        "--sample-every=-1",
        "--eval-every=3",
        "--device-batch-size=4",
        "--total-batch-size=512",
        "--num-iterations=6",
        "--save-every=3",
        "--no-compile",
    ]
)


def busy(stop):
    """Two threads of matmuls until `stop` is set: both cores loaded, as by a neighbour's job."""
    import torch

    torch.set_num_threads(2)
    a = torch.randn(384, 384)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def script(args: list[str], home: Path, nproc: int, timeout: float) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = (launcher if nproc > 1 else [sys.executable]) + ["-m", "nanochat_fast.scripts.base_train", "--", *args]
    if nproc == 1:
        cmd.remove("--")
    env = {
        **os.environ,
        "NANOCHAT_FAST_HOME": str(home),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    try:
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a hang: counted as a failure with its own code
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(cmd, "timeout", out, err)


def seed_run(home: Path, flags: list[str], tries: int = 3) -> tuple[Path, list]:
    """One run to step 6 saving at 3 and 6, its step-6 checkpoint removed: every soak run resumes
    from step 3. A single process, or two where the soak shards the model (FSDP needs them). Two
    processes can hit the very race the soak counts, so a failed seed run is retried (up to `tries`)
    and its exit codes returned with the run."""
    failed = []
    for _ in range(tries):
        run_dir = home / "runs" / "seed"
        shutil.rmtree(run_dir, ignore_errors=True)
        proc = script(ARGS + ["--run=seed", *flags], home, nproc=2 if flags else 1, timeout=600)
        if proc.returncode == 0:
            shutil.rmtree(run_dir / "checkpoints" / "step_000006")
            return run_dir, failed
        failed.append(proc.returncode)
    sys.exit(f"the seed run failed {tries} times:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def soak(runs: int, workdir: Path, timeout: float = 300, log=print, sharding: str = "") -> dict:
    """`runs` soak runs in `workdir`; the figures: exit codes counted, abort lines, seconds.
    sharding: base_train's --sharding for the two-process runs ("": its default, ZeRO-2)."""
    home = build_tiny_home(workdir)
    flags = [f"--sharding={sharding}"] if sharding else []
    seed, seed_failures = seed_run(home, flags)
    stop = multiprocessing.Event()
    neighbour = multiprocessing.Process(target=busy, args=(stop,), daemon=True)
    neighbour.start()
    codes, aborts, failures, t0 = {}, 0, [], time.monotonic()
    try:
        for i in range(runs):
            name = f"soak{i}"
            shutil.copytree(seed, home / "runs" / name)
            proc = script(ARGS + [f"--run={name}", "--resume=auto", *flags], home, nproc=2, timeout=timeout)
            output = proc.stdout + proc.stderr
            n_abort = output.count(ABORT)
            codes[str(proc.returncode)] = codes.get(str(proc.returncode), 0) + 1
            aborts += n_abort
            if proc.returncode != 0 or n_abort:
                failures.append({"run": i, "exit": proc.returncode, "tail": output[-1500:]})
            log(
                f"run {i + 1}/{runs}: exit {proc.returncode}" + (f", {n_abort} abort line(s)" if n_abort else ""),
                flush=True,
            )
            shutil.rmtree(home / "runs" / name, ignore_errors=True)
    finally:
        stop.set()
        neighbour.join(timeout=10)
    return {
        "runs": runs,
        "exit_codes": codes,
        "abort_lines": aborts,
        "failed_runs": len(failures),
        "seconds": round(time.monotonic() - t0, 1),
        "failures": failures[:5],
        "seed_failures": seed_failures,
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, shared",
        "sharding": sharding or "zero2",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50, help="two-process runs (default 50)")
    p.add_argument("--record", default="", help="keep the figures under this name in benchmarks/soak.json")
    p.add_argument("--json", default="", help="also write the figures alone to this file")
    p.add_argument("--label", default="", help="what was soaked (e.g. a commit), kept with the figures")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a run counts as hung")
    p.add_argument("--sharding", default="", help="base_train's --sharding for the runs (default: its own, zero2)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        figures = soak(args.runs, Path(tmp), args.timeout, sharding=args.sharding)
    figures["label"] = args.label
    summary = (
        f"{figures['runs']} runs: exit codes {figures['exit_codes']}, {figures['abort_lines']} abort line(s), "
        f"{figures['failed_runs']} failed, {figures['seconds']:.0f} s"
        + (f"; the seed run failed first with exit {figures['seed_failures']}" if figures["seed_failures"] else "")
    )
    print(summary)
    for f in figures["failures"]:
        print(f"--- run {f['run']} (exit {f['exit']}):\n{f['tail']}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    if args.record:
        record = Path(__file__).with_name("soak.json")
        kept = json.loads(record.read_text()) if record.exists() else {}
        kept[args.record] = {k: v for k, v in figures.items() if k != "failures"}
        record.write_text(json.dumps(kept, indent=2) + "\n")
    return 0 if figures["failed_runs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
