"""
Checkpoints that survive kills, full disks and changes of world size.

    runs/<run>/checkpoints/step_NNNNNN/
        model.pt            the uncompiled model's state_dict, fp32 tensors        (rank 0)
     or model/              the same, sharded: torch.distributed.checkpoint (DCP)  (every rank its shard)
        optim_rank<R>.pt    rank R's optimizer shards + RNG state                  (every rank)
        meta.json           format version, step, model config, loader and loop state, args
        COMPLETE            written last, by rank 0, after a barrier

A model sharded over the ranks (--sharding=fsdp) is saved with DCP: every rank writes its own
rows in parallel and no rank ever holds the whole model. Reading either layout gives the whole
state_dict (load_model_state); a run on any number of processes and either sharding loads it and
shards it its own way. export_model writes a DCP checkpoint's weights as one model.pt, which is
then what readers use.

Every file is written to a temporary name, fsynced and renamed into place, so a reader never
sees half a file; a checkpoint counts only once COMPLETE exists, so a kill at any moment leaves
the previous complete checkpoint as the newest one. Everything is plain tensors and JSON:
`torch.load(weights_only=True, map_location=...)` reads it on CPU, CUDA or MPS.
"""
import errno
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch

from . import paths
from .errors import UserError

FORMAT_VERSION = 1
COMPLETE = "COMPLETE"


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def _slow_writes_for_tests():
    """NANOCHAT_FAST_TEST_SLOW_SAVE=<seconds> pauses between files (lets a test kill a save midway)."""
    delay = float(os.environ.get("NANOCHAT_FAST_TEST_SLOW_SAVE", "0") or 0)
    if delay:
        time.sleep(delay)


def save_torch(path: Path, obj):
    paths.write_durably(path, lambda f: torch.save(obj, f))
    _slow_writes_for_tests()


def save_json(path: Path, obj):
    paths.write_durably(path, lambda f: f.write(json.dumps(obj, indent=2).encode()))


MODEL_FILE = "model.pt"
MODEL_SHARDS = "model"


def all_finite(tensors) -> bool:
    """Every element this process holds is finite (a DTensor: its local shard)."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return all(bool(torch.isfinite(t).all()) for t in tensors if torch.is_floating_point(t))


def _save_model_shards(path: Path, model_state: dict):
    """Every rank writes its shards of `model_state` (DTensors; plain tensors are written once)."""
    import torch.distributed.checkpoint as dcp
    try:
        dcp.save(model_state, checkpoint_id=path / MODEL_SHARDS)
    except dcp.CheckpointException as e:  # one rank's failure, raised on every rank
        raise OSError(errno.EIO, f"writing the model's shards failed: {e}") from e
    _slow_writes_for_tests()


def save_checkpoint(run_dir, step: int, *, model_state: dict, rank_state: dict, meta: dict,
                    rank: int, all_ranks_ok=lambda ok: ok, keep_last: int | None = None,
                    previous: Path | None = None, sharded: bool = False) -> Path:
    """Write checkpoint `step`. Every rank calls this; `all_ranks_ok(ok)` must return True on every
    rank iff `ok` is True on every rank (an all-reduce; it doubles as the barrier). model_state:
    whole tensors on rank 0 (model.pt), or with `sharded` every rank's DTensors (model/, DCP).

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

    def write_rank0_files():
        if not sharded:
            save_torch(path / MODEL_FILE, {k: v.detach().float().cpu() for k, v in model_state.items()})
        save_json(path / "meta.json", {"format_version": FORMAT_VERSION, "step": step, **meta})

    ok = attempt(make_dir if rank == 0 else lambda: None)
    if sharded and ok:  # collective: every rank takes part, and learns if any failed
        try:
            _save_model_shards(path, model_state)
        except OSError as e:
            error = e
        ok = all_ranks_ok(error is None)
    ok = ok and attempt(lambda: save_torch(path / f"optim_rank{rank}.pt", rank_state))
    ok = ok and attempt(write_rank0_files if rank == 0 else lambda: None)
    ok = ok and attempt((lambda: paths.write_durably(path / COMPLETE, lambda f: f.write(b"ok\n"))) if rank == 0 else lambda: None)
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
        raise UserError(f"could not save checkpoint step {step} in {path.parent} ({what}); {intact}. "
                        "Free space or choose another --out-dir, then resume with --resume auto") from error
    if rank == 0 and keep_last:
        for old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def complete_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / COMPLETE).exists())


def incomplete_checkpoints(run_dir) -> list[Path]:
    """Step directories of saves that did not finish (no COMPLETE marker), oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if not (p / COMPLETE).exists()) if root.is_dir() else []


def remove_incomplete(run_dir):
    """Delete the leftovers of saves that were interrupted (no COMPLETE marker)."""
    for p in incomplete_checkpoints(run_dir):
        shutil.rmtree(p, ignore_errors=True)


def _load(path: Path, map_location):
    if not path.exists():
        raise UserError(f"checkpoint file {path} is missing; the checkpoint is incomplete, pick another "
                        "with --resume PATH (or --step)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise UserError(f"checkpoint file {path} is truncated or corrupt ({type(e).__name__}); delete that "
                        "checkpoint directory or pick another with --resume PATH (or --step)") from e


def load_meta(ckpt: Path) -> dict:
    path = Path(ckpt) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{ckpt} is not a checkpoint (no meta.json); checkpoints live in "
                        "runs/<run>/checkpoints/step_NNNNNN") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"checkpoint file {path} is corrupt ({e}); pick another checkpoint") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path} has checkpoint format {meta.get('format_version')!r}, this version of "
                        f"nanochat_fast reads format {FORMAT_VERSION}")
    return meta


def load_model_state(ckpt: Path, device="cpu") -> dict:
    """The whole model state_dict of a checkpoint: model.pt, or else the DCP shards of model/
    (each process reads them all, without collectives)."""
    ckpt = Path(ckpt)
    if (ckpt / MODEL_FILE).exists() or not (ckpt / MODEL_SHARDS).is_dir():
        return _load(ckpt / MODEL_FILE, device)
    import torch.distributed.checkpoint as dcp
    try:
        reader = dcp.FileSystemReader(str(ckpt / MODEL_SHARDS))
        entries = reader.read_metadata().state_dict_metadata
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in entries.items()
                 if isinstance(m, dcp.TensorStorageMetadata)}
        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        raise UserError(f"the model shards in {ckpt / MODEL_SHARDS} are missing, truncated or corrupt "
                        f"({type(e).__name__}); delete that checkpoint directory or pick another with --resume PATH "
                        "(or --step)") from e
    return {k: v.to(device) for k, v in state.items()}


def export_model(ckpt: Path, output: Path | None = None) -> Path:
    """The checkpoint's weights as one file of whole fp32 tensors (default: model.pt beside the
    shards, which readers then prefer), written atomically. Returns its path."""
    ckpt = Path(ckpt)
    output = Path(output) if output else ckpt / MODEL_FILE
    state = load_model_state(ckpt)
    paths.write_durably(output, lambda f: torch.save({k: v.float() for k, v in state.items()}, f))
    return output


def load_rank_states(ckpt: Path, world_size_saved: int, device="cpu") -> list[dict]:
    """Every rank's saved state (a run resuming with M ranks reads all N files saved with N)."""
    return [_load(Path(ckpt) / f"optim_rank{r}.pt", device) for r in range(world_size_saved)]


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
