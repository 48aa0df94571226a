"""
One checkpoint, and the one place that calls torch.save, torch.load and DCP. Every rank writes its
files into step_NNNNNN.partial, hashing them as they go to disk; rank 0 adds meta.json (every file's
digest) and COMPLETE last (meta.json's), then renames the folder to step_NNNNNN. Readers check the
digests and read plain tensors only (weights_only=True), either model layout, at any world size.
"""

import errno
import hashlib
import json
import os
import shutil
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from ..core.distributed import all_ranks_ok, gather_objects, get_dist_info, print0
from ..core.errors import UserError

FORMAT_VERSION = 1
COMPLETE, META_FILE, MODEL_FILE, MODEL_SHARDS = "COMPLETE", "meta.json", "model.pt", "model"
PARTIAL = ".partial"  # the suffix of a save in progress
OLD_MARKER = b"ok\n"  # COMPLETE's content before digests were recorded
OVERLAP_BYTES = 1 << 20  # writes from this size on are hashed on the side thread and sent to disk at once
IN_FLIGHT_BYTES = 256 << 20  # copies waiting for the hashing thread, at most: then the writer waits
_hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint_hash")  # hashes in write order
_verified = set()  # (checkpoint, COMPLETE's mtime) whose files this process has checked


class HashingFile:
    """File `f` being written, every byte hashed in order on the side thread as this one writes on. A lent
    buffer is copied before it is hashed (torch.save may free it next) unless it starts at one of `kept`,
    the saved tensors' storages: docs/measurements.md#distributed-teardown-collective-timeouts-and-checkpoint-digests"""

    def __init__(self, f, kept=frozenset()):
        self._f, self._kept, self._sha, self.size = f, kept, hashlib.sha256(), 0
        self._small = bytearray()  # small writes, hashed together
        self._pending, self._in_flight = [], 0  # [(future, bytes copied)], their sum

    def __getattr__(self, name):  # tell, flush, fileno...: the file's
        return getattr(self._f, name)

    def write(self, data):
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        if view.nbytes < OVERLAP_BYTES:
            self._small += view
            if len(self._small) >= OVERLAP_BYTES:
                self._queue_small()
            return self._f.write(view)
        self._queue_small()
        kept = np.frombuffer(view, dtype=np.uint8).ctypes.data in self._kept
        self._queue(view if kept else bytes(view), 0 if kept else view.nbytes)
        start, written = self._f.tell(), self._f.write(view)
        self._f.flush()
        if hasattr(os, "posix_fadvise") and written:  # Linux starts writing back the range
            os.posix_fadvise(self._f.fileno(), start, written, os.POSIX_FADV_DONTNEED)
        return written

    def _queue_small(self):
        if self._small:
            self._queue(self._small, len(self._small))
            self._small = bytearray()

    def _queue(self, data, copied: int):
        """Hash `data` on the side thread after what came before; at most IN_FLIGHT_BYTES of copies wait."""
        while self._pending and self._in_flight + copied > IN_FLIGHT_BYTES:
            done, n = self._pending.pop(0)
            done.result()
            self._in_flight -= n
        self._pending.append((_hasher.submit(self._sha.update, data), copied))
        self._in_flight += copied

    def digest(self) -> dict:
        self._queue_small()
        for done, _ in self._pending:
            done.result()
        return {"sha256": self._sha.hexdigest(), "bytes": self.size}


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, write, kept=frozenset()) -> dict:
    """write(file) into `path`, hashed: a temporary name fsynced and renamed over it. Its digest."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            hashing = HashingFile(f, kept)
            write(hashing)
            f.flush()
            os.fsync(f.fileno())  # while the hashing catches up
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return hashing.digest()


def write_tensors(path: Path, obj) -> dict:
    """torch.save(obj) to `path`, atomically and durably; its digest ({"sha256", "bytes"})."""
    tensors = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
    kept = {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cpu" and t.layout == torch.strided}
    return _write(path, lambda f: torch.save(obj, f), kept)


def read_tensors(path: Path, map_location="cpu"):
    """What torch.save wrote at `path`, plain tensors only; raises what torch.load raises (callers word it)."""
    return torch.load(path, map_location=map_location, weights_only=True)


def _record_check(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def write_meta(ckpt: Path, meta: dict):
    """meta.json, then COMPLETE: meta.json's digest and a check of that record (a damaged COMPLETE is
    named as such, not blamed on meta.json)."""
    record = {"meta.json": _write(ckpt / META_FILE, lambda f: f.write(json.dumps(meta, indent=2).encode()))}
    text = json.dumps({**record, "check": _record_check(record)}, indent=2) + "\n"
    _write(ckpt / COMPLETE, lambda f: f.write(text.encode()))


def write_shards(directory: Path, state: dict) -> dict:
    """Every rank writes its shards of `state` (DTensors; plain tensors once) with DCP, a collective;
    the digests of this rank's files by name. A failure, which DCP raises on every rank, is an OSError."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(directory))
    writer.fs = _HashingFileSystem(writer.fs)
    try:
        dcp.save(state, storage_writer=writer)
    except dcp.CheckpointException as e:
        raise OSError(errno.EIO, f"writing the model's shards failed: {e}") from e
    _fsync_dir(directory)
    return {Path(name).name: digest for name, digest in writer.fs.digests.items()}


class _HashingFileSystem:
    """DCP's file system with every stream opened for writing hashed as DCP writes it (its writer
    threads included); a file renamed into place (.metadata) keeps its digest under the new name."""

    def __init__(self, fs):
        self._fs, self.digests, self._lock = fs, {}, threading.Lock()

    def __getattr__(self, name):
        return getattr(self._fs, name)

    @contextmanager
    def create_stream(self, path, mode):
        with self._fs.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = HashingFile(stream)
            yield hashing
        with self._lock:
            self.digests[str(path)] = hashing.digest()

    def rename(self, path, new_path):
        self._fs.rename(path, new_path)
        with self._lock:
            if str(path) in self.digests:
                self.digests[str(new_path)] = self.digests.pop(str(path))


def all_finite(tensors) -> bool:
    """Every element this process holds is finite (a DTensor: its local shard)."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return all(bool(torch.isfinite(t).all()) for t in tensors if torch.is_floating_point(t))


def step_dir(run_dir, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def _attempt(write, *args) -> OSError | None:
    """write(*args); the OSError it raised (a full disk, permissions), else None."""
    try:
        write(*args)
    except OSError as e:
        return e
    return None


def _write_rank_files(tmp: Path, written: dict, model_state: dict, rank_state: dict):
    """This rank's files, their digests into `written`: DTensors go to DCP shards (every rank takes
    part, first: a failure reaches every rank), whole tensors to model.pt (rank 0, fp32); then its
    optim_rank<R>.pt. (open_run_dir removed the folders of saves that did not finish.)"""
    rank, sharded = get_dist_info()[1], any(hasattr(v, "to_local") for v in model_state.values())
    if sharded:
        shards = write_shards(tmp / MODEL_SHARDS, model_state)
        written.update({f"{MODEL_SHARDS}/{name}": digest for name, digest in shards.items()})
    tmp.mkdir(parents=True, exist_ok=True)
    if rank == 0 and not sharded:
        model = {k: v.detach().float().cpu() for k, v in model_state.items()}
        written[MODEL_FILE] = write_tensors(tmp / MODEL_FILE, model)
    written[f"optim_rank{rank}.pt"] = write_tensors(tmp / f"optim_rank{rank}.pt", rank_state)


def _complete(tmp: Path, path: Path, meta: dict):
    """meta.json and COMPLETE last, then the folder renamed to its step's name."""
    write_meta(tmp, meta)
    if path.exists():  # an older save of this step: a run resumed from before it, or one that did not finish
        shutil.rmtree(path)
    tmp.rename(path)
    _fsync_dir(path.parent)


def save_checkpoint(run_dir, step: int, *, model_state, rank_state, meta, device="cpu", keep_last=0, previous=None):
    """Checkpoint `step`, saved by every rank (whole tensors, or DTensors with FSDP); returns its
    path. Refuses non-finite weights. If any rank fails to write (a full disk), the partial folder
    goes, no rank is left waiting, and a UserError says which checkpoint is still intact."""
    path = step_dir(run_dir, step)
    tmp, rank = path.with_name(path.name + PARTIAL), get_dist_info()[1]
    if not all_ranks_ok(all_finite(model_state.values()), device):
        raise RuntimeError(f"refusing to save step {step}: the model has non-finite weights")
    written = {}
    error = _attempt(_write_rank_files, tmp, written, model_state, rank_state)
    if all_ranks_ok(error is None, device):  # every rank's digests, to rank 0 for meta.json
        files = {name: digest for part in gather_objects(written) for name, digest in part.items()}
        meta = {"format_version": FORMAT_VERSION, "step": step, **meta, "files": files}
        error = _attempt(_complete, tmp, path, meta) if rank == 0 else None
    if not all_ranks_ok(error is None, device):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        intact = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        if error is None:
            what = "another rank could not write its file"
        else:
            what = "disk full" if error.errno == errno.ENOSPC else f"{error.strerror or error}"
        raise UserError(
            f"could not save checkpoint step {step} in {path.parent} ({what}); {intact}. "
            "Free space or choose another --out-dir, then resume with --resume auto"
        ) from error
    if rank == 0 and keep_last:
        for old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def is_complete(ckpt) -> bool:
    """COMPLETE is in it, and it is not a save's folder before its rename."""
    return Path(ckpt).suffix != PARTIAL and (Path(ckpt) / COMPLETE).exists()


def complete_checkpoints(run_dir, complete: bool = True) -> list[Path]:
    """Complete checkpoints of a run, oldest first; complete=False: the folders of saves that did not
    finish (partial, or without COMPLETE as older versions left them)."""
    return [p for p in sorted((Path(run_dir) / "checkpoints").glob("step_*")) if is_complete(p) == complete]


def resolve_checkpoint(run_dir, step: int | None = None) -> Path:
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


def _damaged(path: Path, what: str) -> UserError:
    """A file of a checkpoint that is not what was written: missing, or another size or sha256."""
    return UserError(
        f"checkpoint file {path} {what}: it was damaged after it was saved; pick another checkpoint with "
        "--resume PATH or --step (--resume auto falls back to the newest intact one)"
    )


def _check_digest(path: Path, want: dict, got: dict):
    if want.get("bytes") != got["bytes"]:
        raise _damaged(path, f"has {got['bytes']:,} bytes, {want.get('bytes', 0):,} were recorded when it was saved")
    if got != want:
        raise _damaged(path, f"has sha256 {got['sha256'][:16]}..., not the {str(want.get('sha256'))[:16]}... recorded")


def _meta_digest(ckpt: Path) -> dict | None:
    """meta.json's digest as COMPLETE records it (None: no COMPLETE, or an old checkpoint's "ok")."""
    complete = ckpt / COMPLETE
    if not complete.exists():
        return None
    raw = complete.read_bytes()
    if raw.strip() in (OLD_MARKER.strip(), b""):  # "ok" before digests were kept; a hand-made empty marker
        return None
    try:
        record = json.loads(raw.decode())
        digest = record["meta.json"]
        intact = record["check"] == _record_check({"meta.json": digest})
    except (ValueError, KeyError, TypeError):
        intact = False
    if not intact:
        raise _damaged(complete, "does not hold the record it was written with")
    return digest


def load_meta(ckpt) -> dict:
    """meta.json of a checkpoint, checked against COMPLETE's record and for its format version."""
    ckpt = Path(ckpt)
    path = ckpt / META_FILE
    try:
        raw = path.read_bytes()
        want = _meta_digest(ckpt)
        if want is not None:
            _check_digest(path, want, {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)})
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


def verify_checkpoint(ckpt):
    """Every file meta.json lists against the digest recorded when it was saved (a UserError naming
    the first that differs), once per checkpoint and process; without digests, a notice."""
    ckpt = Path(ckpt)
    meta = load_meta(ckpt)
    key = (str(ckpt.resolve()), (ckpt / COMPLETE).stat().st_mtime_ns)
    if key in _verified:
        return
    listed = meta.get("files")
    if listed is None:
        print0(f"note: {ckpt} records no file digests (saved by an older version): loaded unverified", file=sys.stderr)
    for name, want in sorted((listed or {}).items()):
        path = ckpt / name
        if not path.is_file():
            raise _damaged(path, "is missing")
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
            got = {"sha256": sha.hexdigest(), "bytes": f.tell()}
        _check_digest(path, want, got)
    _verified.add(key)


def _read(path: Path, device):
    if not path.exists():
        raise UserError(
            f"checkpoint file {path} is missing; the checkpoint is incomplete, pick another "
            "with --resume PATH (or --step)"
        )
    try:
        return read_tensors(path, device)
    except Exception as e:
        raise UserError(
            f"checkpoint file {path} is truncated or corrupt ({type(e).__name__}); delete that "
            "checkpoint directory or pick another with --resume PATH (or --step)"
        ) from e


def _read_shards(directory: Path) -> dict:
    """The whole tensors of a DCP folder, read by this process alone, whatever number of processes wrote it."""
    import torch.distributed.checkpoint as dcp

    try:
        reader = dcp.FileSystemReader(str(directory))
        entries = reader.read_metadata().state_dict_metadata
        state = {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in entries.items()
            if isinstance(m, dcp.TensorStorageMetadata)
        }
        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        raise UserError(
            f"the model shards in {directory} are missing, truncated or corrupt ({type(e).__name__}); delete "
            "that checkpoint directory or pick another with --resume PATH (or --step)"
        ) from e
    return state


def load_model_state(ckpt, device="cpu") -> dict:
    """The whole model state_dict of a checkpoint, verified: model.pt, else the DCP shards of model/."""
    ckpt = Path(ckpt)
    verify_checkpoint(ckpt)
    if (ckpt / MODEL_FILE).exists() or not (ckpt / MODEL_SHARDS).is_dir():
        return _read(ckpt / MODEL_FILE, device)
    return {k: v.to(device) for k, v in _read_shards(ckpt / MODEL_SHARDS).items()}


def load_rank_states(ckpt, world_size_saved: int, device="cpu") -> list[dict]:
    """Every rank's saved state, verified (a run resuming with M ranks reads all N files saved with N)."""
    verify_checkpoint(ckpt)
    return [_read(Path(ckpt) / f"optim_rank{r}.pt", device) for r in range(world_size_saved)]


def export_model(ckpt, output=None) -> Path:
    """The checkpoint's weights as one file of whole fp32 tensors (default: model.pt in the
    checkpoint, recorded in its meta.json, which readers then prefer to the shards). Its path."""
    ckpt = Path(ckpt)
    output = Path(output) if output else ckpt / MODEL_FILE
    digest = write_tensors(output, {k: v.float() for k, v in load_model_state(ckpt).items()})
    if output.resolve() == (ckpt / MODEL_FILE).resolve():
        meta = load_meta(ckpt)
        if "files" in meta:
            meta["files"][MODEL_FILE] = digest
            write_meta(ckpt, meta)
    return output
