"""
Run directories: where a run writes, whether it resumes, and finding the runs a later stage or an
evaluation starts from.

    NANOCHAT_FAST_HOME/runs/<run>/checkpoints/step_NNNNNN/   (core/checkpoint.py)
    NANOCHAT_FAST_HOME/runs/<run>/{metrics.jsonl, loss.png, report.md}

A run name is a plain name (core/cli.run_name): one folder under runs/. --out-dir puts a run anywhere.
A run directory that exists is continued only with --resume and replaced only with --overwrite.
"""
import os
import shlex
import shutil
import sys
from pathlib import Path

from ..core import checkpoint, paths
from ..core.distributed import all_ranks_ok, print0
from ..core.errors import UserError


def _check_writable(run_dir: Path):
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to run directory {run_dir} ({e.strerror or e}); "
                        "choose a writable --out-dir or set NANOCHAT_FAST_HOME") from None


def open_run_dir(run, run_name: str, rank: int, phase: str, device):
    """Decide the run directory and the checkpoint to resume from: (run_dir, ckpt or None, meta or None).
    `run` is the RunConfig (run, out_dir, resume, overwrite).
    Every rank reads the directory before rank 0 changes it (clears it for --overwrite, removes
    incomplete checkpoints), so all ranks take the same decision."""
    resume = run.resume
    if resume not in ("", "auto") and not (run.run or run.out_dir):
        run_dir = Path(resume).resolve().parent.parent  # runs/<run>/checkpoints/step_N -> runs/<run>
    else:
        run_dir = Path(run.out_dir).expanduser() if run.out_dir else paths.runs_dir() / run_name
    ckpt = None
    if resume == "auto":
        found = checkpoint.complete_checkpoints(run_dir)
        ckpt = found[-1] if found else None
        for half in checkpoint.incomplete_checkpoints(run_dir):
            if ckpt is None or half.name > ckpt.name:
                print0(f"--resume auto: ignoring {half}, a save that did not finish (it is deleted); "
                       f"{'using ' + str(ckpt) if ckpt else 'no complete checkpoint before it'}")
        if ckpt is None:
            print0(f"--resume auto: {run_dir} has no complete checkpoint, starting from scratch")
    elif resume:
        ckpt = Path(resume).expanduser()
        if not (ckpt / checkpoint.COMPLETE).exists():
            raise UserError(f"--resume {resume}: not a complete checkpoint directory (expected "
                            "runs/<run>/checkpoints/step_NNNNNN containing COMPLETE)")
    start_over = ckpt is None and resume != "auto" and run_dir.exists() and any(run_dir.iterdir())
    if start_over and not run.overwrite:
        raise UserError(f"run directory {run_dir} already exists: pass --resume auto to continue it, "
                        "--overwrite to start over, or pick another --run")
    all_ranks_ok(True, device)  # a barrier: every rank has read run_dir
    error = None
    if rank == 0:
        try:
            if start_over:
                shutil.rmtree(run_dir)
            _check_writable(run_dir)
            checkpoint.remove_incomplete(run_dir)
        except UserError as e:
            error = e
    if not all_ranks_ok(error is None, device):  # and no rank goes on before rank 0 is done
        raise error or UserError(f"rank 0 could not prepare the run directory {run_dir} (its message says why)")
    meta = checkpoint.load_meta(ckpt) if ckpt else None
    if meta is not None and meta.get("phase") != phase:
        raise UserError(f"{ckpt} is a {meta.get('phase')} checkpoint; this script continues {phase} runs")
    return run_dir, ckpt, meta


def resume_command(argv, run_dir: Path) -> str:
    """The command line that, with --resume auto appended, resumes this run: this one's flags
    without --resume/--overwrite, plus --out-dir when only a --resume PATH named the run."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        name = a.split("=")[0].replace("_", "-")
        if name in ("--resume", "--overwrite"):
            skip = name == "--resume" and "=" not in a
            continue
        kept.append(a)
    if not any(a.split("=")[0].replace("_", "-") in ("--run", "--out-dir") for a in kept):
        kept.append(f"--out-dir={run_dir}")
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    module = main_spec.name if main_spec else f"nanochat_fast.scripts.{Path(sys.argv[0]).stem}"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # `--` keeps torchrun from reading --run as an abbreviation of its --run-path
        return " ".join([f"torchrun --nproc_per_node={world} -m", module, "--", *map(shlex.quote, kept)])
    return " ".join(["python -m", module, *map(shlex.quote, kept)])


def newest_run(phases) -> Path:
    """The run directory, of the first of `phases` ("base", "mid", ...) that has one, whose newest
    complete checkpoint is newest: newest_run(("mid", "base")) is the newest mid run, else base."""
    phases = (phases,) if isinstance(phases, str) else tuple(phases)
    candidates = {phase: [] for phase in phases}
    for run_dir in paths.runs_dir().glob("*") if paths.runs_dir().is_dir() else []:
        found = checkpoint.complete_checkpoints(run_dir)
        if found:
            try:
                phase = checkpoint.load_meta(found[-1]).get("phase")
                if phase in candidates:
                    candidates[phase].append(((found[-1] / checkpoint.COMPLETE).stat().st_mtime, run_dir))
            except UserError:
                continue
    for phase in phases:
        if candidates[phase]:
            return max(candidates[phase])[1]
    command = {"base": "base_train", "mid": "mid_train"}.get(phases[-1], f"{phases[-1]}_train")
    raise UserError(f"no {' or '.join(phases)} run with a complete checkpoint in {paths.runs_dir()}; train one with "
                    f"`python -m nanochat_fast.scripts.{command}` (or pass --run)")


def run_dir_of(name: str, phases) -> Path:
    """The run called `name` (a run name, or a run directory anywhere); '' = newest_run(phases)."""
    if not name:
        return newest_run(phases)
    path = Path(name).expanduser()
    run_dir = path if path.is_dir() and (path / "checkpoints").is_dir() else paths.runs_dir() / name
    if not (run_dir / "checkpoints").is_dir():
        raise UserError(f"no run named {name!r} (looked for {run_dir}/checkpoints)")
    return run_dir
