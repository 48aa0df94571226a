"""
One checkpoint: a step directory of a run, saved by every rank, listed, and read back.

A checkpoint counts only once COMPLETE exists, written last, by rank 0, after every rank has
written its files; so a kill at any moment leaves the previous complete checkpoint the newest one.
Reading either model layout (model.pt, or DCP shards in model/) gives the whole state_dict, so a
run on any number of processes and either sharding loads it and shards it its own way.

meta.json's "files" holds the sha256 and size of every other file, hashed by the ranks that wrote
them as they wrote them (files.py), and COMPLETE holds meta.json's: a reader checks them
(verification.py), so a file damaged after saving is refused, never loaded as wrong weights.
"""

import errno
import json
import shutil
from pathlib import Path

import torch

from ..core.errors import UserError
from . import files, verification

FORMAT_VERSION = 1
COMPLETE = "COMPLETE"
MODEL_FILE = "model.pt"
MODEL_SHARDS = "model"
META_FILE = "meta.json"


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def optim_file(ckpt: Path, rank: int) -> Path:
    return Path(ckpt) / f"optim_rank{rank}.pt"


def all_finite(tensors) -> bool:
    """Every element this process holds is finite (a DTensor: its local shard)."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return all(bool(torch.isfinite(t).all()) for t in tensors if torch.is_floating_point(t))


def save_checkpoint(
    run_dir,
    step: int,
    *,
    model_state: dict,
    rank_state: dict,
    meta: dict,
    rank: int,
    all_ranks_ok=lambda ok: ok,
    gather=lambda obj: [obj],
    keep_last: int | None = None,
    previous: Path | None = None,
    sharded: bool = False,
) -> Path:
    """Write checkpoint `step`. Every rank calls this; `all_ranks_ok(ok)` must return True on every
    rank iff `ok` is True on every rank (an all-reduce; it doubles as the barrier); `gather(obj)`
    the list of every rank's obj (all_gather_object): the digests of the files each rank wrote, for
    meta.json. model_state: whole tensors on rank 0 (model.pt), or with `sharded` every rank's
    DTensors (model/, DCP).

    Refuses to write non-finite weights. If any rank fails to write (disk full, permissions) the
    partial step directory is removed on every rank and a UserError says which complete
    checkpoint is still intact; no rank is left waiting at a barrier."""
    path = step_dir(run_dir, step)
    if not all_ranks_ok(all_finite(model_state.values())):
        raise RuntimeError(f"refusing to save step {step}: the model has non-finite weights")
    error = None

    def attempt(fn):
        nonlocal error
        if error is None:
            try:
                fn()
            except OSError as e:
                error = e
        return all_ranks_ok(error is None)

    def make_dir():
        if path.exists():  # a stale, incomplete attempt at the same step
            shutil.rmtree(path)
        path.mkdir(parents=True)

    written = {}  # this rank's files: name in the checkpoint -> digest

    def write_rank0_files():
        listed = dict(written)
        if not sharded:
            model = {k: v.detach().float().cpu() for k, v in model_state.items()}
            listed[MODEL_FILE] = files.write_tensors(path / MODEL_FILE, model)
        meta_digest = files.write_json(
            path / META_FILE, {"format_version": FORMAT_VERSION, "step": step, **meta, "files": listed}
        )
        files.write_marker(path / COMPLETE, verification.complete_record(meta_digest))

    ok = attempt(make_dir if rank == 0 else lambda: None)
    if sharded and ok:  # collective: every rank takes part, and learns if any failed
        try:
            shards = files.write_shards(path / MODEL_SHARDS, model_state)
            written.update({f"{MODEL_SHARDS}/{name}": digest for name, digest in shards.items()})
        except OSError as e:
            error = e
        ok = all_ranks_ok(error is None)
    rank_file = optim_file(path, rank)
    ok = ok and attempt(lambda: written.update({rank_file.name: files.write_tensors(rank_file, rank_state)}))
    if ok:  # every rank's digests, to rank 0 for meta.json
        written = {name: digest for part in gather(written) for name, digest in part.items()}
    ok = ok and attempt(write_rank0_files if rank == 0 else lambda: None)
    if not ok:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        intact = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        if error is None:
            what = "another rank could not write its file"
        elif error.errno == errno.ENOSPC:
            what = "disk full"
        else:
            what = f"{error.strerror or error}"
        raise UserError(
            f"could not save checkpoint step {step} in {path.parent} ({what}); {intact}. "
            "Free space or choose another --out-dir, then resume with --resume auto"
        ) from error
    if rank == 0 and keep_last:
        for old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def is_complete(ckpt: Path) -> bool:
    return (Path(ckpt) / COMPLETE).exists()


def complete_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if is_complete(p))


def incomplete_checkpoints(run_dir) -> list[Path]:
    """Step directories of saves that did not finish (no COMPLETE marker), oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if not is_complete(p)) if root.is_dir() else []


def remove_incomplete(run_dir):
    """Delete the leftovers of saves that were interrupted (no COMPLETE marker)."""
    for p in incomplete_checkpoints(run_dir):
        shutil.rmtree(p, ignore_errors=True)


def completed_at(ckpt: Path) -> float:
    """When the checkpoint was completed (its COMPLETE marker's mtime): which run is newest."""
    return (Path(ckpt) / COMPLETE).stat().st_mtime


def resolve_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The checkpoint `step` of a run, or its newest complete one."""
    found = complete_checkpoints(run_dir)
    if step is not None:
        path = step_dir(run_dir, step)
        if path not in found:
            have = ", ".join(str(int(p.name[5:])) for p in found) or "none"
            raise UserError(f"run {run_dir} has no complete checkpoint at step {step} (complete steps: {have})")
        return path
    if not found:
        raise UserError(f"run {run_dir} has no complete checkpoint yet")
    return found[-1]


def _read(path: Path, map_location):
    if not path.exists():
        raise UserError(
            f"checkpoint file {path} is missing; the checkpoint is incomplete, pick another "
            "with --resume PATH (or --step)"
        )
    try:
        return files.read_tensors(path, map_location)
    except Exception as e:
        raise UserError(
            f"checkpoint file {path} is truncated or corrupt ({type(e).__name__}); delete that "
            "checkpoint directory or pick another with --resume PATH (or --step)"
        ) from e


def load_meta(ckpt: Path) -> dict:
    """meta.json of a checkpoint, checked to be of the format this version reads."""
    path = Path(ckpt) / META_FILE
    try:
        raw = path.read_bytes()
        verification.check_meta(Path(ckpt) / COMPLETE, path, raw)
        meta = json.loads(raw.decode())
    except FileNotFoundError:
        raise UserError(
            f"{ckpt} is not a checkpoint (no meta.json); checkpoints live in runs/<run>/checkpoints/step_NNNNNN"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"checkpoint file {path} is corrupt ({e}); pick another checkpoint") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{path} has checkpoint format {meta.get('format_version')!r}, this version of "
            f"nanochat_fast reads format {FORMAT_VERSION}"
        )
    return meta


def verify_checkpoint(ckpt: Path):
    """Every file of the checkpoint against the digests recorded when it was saved (DamagedCheckpoint,
    a UserError naming the file); an old checkpoint without digests passes with a notice."""
    ckpt = Path(ckpt)
    verification.verify(ckpt, load_meta(ckpt), ckpt / COMPLETE)


def load_model_state(ckpt: Path, device="cpu") -> dict:
    """The whole model state_dict of a checkpoint: model.pt, or else the DCP shards of model/
    (each process reads them all, without collectives)."""
    ckpt = Path(ckpt)
    verify_checkpoint(ckpt)
    if (ckpt / MODEL_FILE).exists() or not (ckpt / MODEL_SHARDS).is_dir():
        return _read(ckpt / MODEL_FILE, device)
    try:
        state = files.read_shards(ckpt / MODEL_SHARDS)
    except files.UnreadableShards as e:
        raise UserError(
            f"the model shards in {ckpt / MODEL_SHARDS} are missing, truncated or corrupt "
            f"({e.cause}); delete that checkpoint directory or pick another with --resume PATH "
            "(or --step)"
        ) from e.__cause__
    return {k: v.to(device) for k, v in state.items()}


def load_rank_states(ckpt: Path, world_size_saved: int, device="cpu") -> list[dict]:
    """Every rank's saved state (a run resuming with M ranks reads all N files saved with N)."""
    verify_checkpoint(ckpt)
    return [_read(optim_file(ckpt, r), device) for r in range(world_size_saved)]


def export_model(ckpt: Path, output: Path | None = None) -> Path:
    """The checkpoint's weights as one file of whole fp32 tensors (default: model.pt beside the
    shards, which readers then prefer), written atomically. Returns its path."""
    ckpt = Path(ckpt)
    output = Path(output) if output else ckpt / MODEL_FILE
    state = load_model_state(ckpt)
    digest = files.write_tensors(output, {k: v.float() for k, v in state.items()})
    if output.resolve() == (ckpt / MODEL_FILE).resolve():  # now part of the checkpoint: recorded like the rest
        meta = load_meta(ckpt)
        if "files" in meta:
            meta["files"][MODEL_FILE] = digest
            files.write_marker(ckpt / COMPLETE, verification.complete_record(files.write_json(ckpt / META_FILE, meta)))
    return output
