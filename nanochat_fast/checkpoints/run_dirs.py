"""
A run's directory, NANOCHAT_FAST_HOME/runs/<run>/ (or --out-dir): continued only with --resume,
replaced only with --overwrite; the checkpoint a resume starts from, and the runs a later stage or an
evaluation starts from.
"""

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from ..core import paths
from ..core.distributed import all_ranks_ok, print0
from ..core.errors import UserError
from .checkpoint import COMPLETE, complete_checkpoints, is_complete, load_meta, verify_checkpoint


def open_run_dir(run, run_dir: Path, rank: int, phase: str, device):
    """(run_dir, checkpoint to resume or None, its meta or None) for the RunConfig `run` and the run's
    folder (that of --resume PATH when no run is named). Every rank reads the directory before rank 0
    changes it (cleared for --overwrite, the leftovers of saves that did not finish removed), so all
    ranks take the same decision."""
    resume = run.resume
    if resume not in ("", "auto") and not (run.run or run.out_dir):
        run_dir = Path(resume).resolve().parent.parent  # runs/<run>/checkpoints/step_N -> runs/<run>
    ckpt = None
    if resume == "auto":
        ckpt = newest_intact(complete_checkpoints(run_dir))
        for half in complete_checkpoints(run_dir, complete=False):
            if ckpt is None or half.name > ckpt.name:
                print0(
                    f"--resume auto: ignoring {half}, a save that did not finish (it is deleted); "
                    f"{'using ' + str(ckpt) if ckpt else 'no complete checkpoint before it'}"
                )
        if ckpt is None:
            print0(f"--resume auto: {run_dir} has no complete checkpoint, starting from scratch")
    elif resume:
        ckpt = Path(resume).expanduser()
        if not is_complete(ckpt):
            raise UserError(
                f"--resume {resume}: not a complete checkpoint directory (expected "
                "runs/<run>/checkpoints/step_NNNNNN containing COMPLETE)"
            )
        verify_checkpoint(ckpt)  # a damaged file: one line naming it, exit 2
    start_over = ckpt is None and resume != "auto" and run_dir.exists() and any(run_dir.iterdir())
    if start_over and not run.overwrite:
        raise UserError(
            f"run directory {run_dir} already exists: pass --resume auto to continue it, "
            "--overwrite to start over, or pick another --run"
        )
    all_ranks_ok(True, device)  # a barrier: every rank has read run_dir
    error = None
    if rank == 0:
        if start_over:
            shutil.rmtree(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / f".write_test{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            error = UserError(
                f"cannot write to run directory {run_dir} ({e.strerror or e}); "
                "choose a writable --out-dir or set NANOCHAT_FAST_HOME"
            )
        for half in complete_checkpoints(run_dir, complete=False):
            shutil.rmtree(half, ignore_errors=True)
    if not all_ranks_ok(error is None, device):  # and no rank goes on before rank 0 is done
        raise error or UserError(f"rank 0 could not prepare the run directory {run_dir} (its message says why)")
    meta = load_meta(ckpt) if ckpt else None
    if meta is not None and meta.get("phase") != phase:
        raise UserError(f"{ckpt} is a {meta.get('phase')} checkpoint; this script continues {phase} runs")
    return run_dir, ckpt, meta


def newest_intact(found: list[Path]) -> Path | None:
    """The newest of `found` whose files match their digests; each damaged one newer is named and skipped."""
    skipped = []
    for ckpt in reversed(found):
        try:
            verify_checkpoint(ckpt)
        except UserError as e:
            print0(f"--resume auto: skipping {ckpt.name}: {e}")
            skipped.append(ckpt.name)
            continue
        if skipped:
            print0(f"--resume auto: resuming from {ckpt}, the newest intact checkpoint (not {', '.join(skipped)})")
        return ckpt
    return None


def newest_run(phases) -> Path:
    """The run directory, of the first of `phases` ("base", "mid", ...) that has one, whose newest
    complete checkpoint is newest: newest_run(("mid", "base")) is the newest mid run, else base."""
    runs = []  # (-which of phases, when its newest checkpoint was completed, run_dir)
    for run_dir in paths.runs_dir().glob("*"):
        found = complete_checkpoints(run_dir)
        try:
            phase = load_meta(found[-1]).get("phase") if found else None
        except UserError:
            continue
        if phase in phases:
            runs.append((-phases.index(phase), (found[-1] / COMPLETE).stat().st_mtime, run_dir))
    if runs:
        return max(runs)[2]
    raise UserError(
        f"no {' or '.join(phases)} run with a complete checkpoint in {paths.runs_dir()}; train one with "
        f"`python -m nanochat_fast.scripts.{phases[-1]}_train` (or pass --run)"
    )


def run_dir_of(name: str, phases) -> Path:
    """The run called `name` (a run name, or a run directory anywhere); '' = newest_run(phases)."""
    if not name:
        return newest_run(phases)
    path = Path(name).expanduser()
    run_dir = path if path.is_dir() and (path / "checkpoints").is_dir() else paths.runs_dir() / name
    if not (run_dir / "checkpoints").is_dir():
        raise UserError(f"no run named {name!r} (looked for {run_dir}/checkpoints)")
    return run_dir


@contextmanager
def new_run_dir(run_dir: Path):
    """A folder beside `run_dir` to build a run in, which replaces `run_dir` if the block ends without error."""
    tmp = run_dir.with_name(f".{run_dir.name}.new{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        if run_dir.exists():
            shutil.rmtree(run_dir)
        tmp.rename(run_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
