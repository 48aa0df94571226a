"""
How the package's tensor files are written and read: the one place that calls torch.save,
torch.load and torch.distributed.checkpoint (DCP), so every such file is written atomically and
durably, and read as plain tensors only (weights_only=True: loading never runs code).

Checkpoints (step_dirs.py) and nanochat's files (interop/) both go through here. Every write returns
the file's digest ({"sha256", "bytes"}), hashed as the bytes go to disk (HashingFile), not by
reading the file back: a checkpoint records them and its readers check them (step_dirs.verify).
"""

import errno
import hashlib
import io
import json
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from ..core import paths

_hasher = None  # one thread hashing a large write while the writing thread copies it to the file
OVERLAP_BYTES = 1 << 20  # writes from this size on are hashed beside the write (hashlib and file
# writes both release the GIL); smaller ones inline


def _hash_beside(sha, view):
    global _hasher
    if _hasher is None:
        from concurrent.futures import ThreadPoolExecutor

        _hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint_hash")
    return _hasher.submit(sha.update, view)


class HashingFile(io.RawIOBase):
    """A file opened for writing, hashing every byte written through it (sequential writes only).
    A large write is hashed on another thread while this one writes it, and waited for before
    write returns: the caller's buffer (torch.save lends a view of its own memory) stays valid."""

    def __init__(self, f):
        super().__init__()
        self._f, self._sha, self.size = f, hashlib.sha256(), 0

    def writable(self):
        return True

    def write(self, data):
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        if view.nbytes < OVERLAP_BYTES:
            self._sha.update(view)
            return self._f.write(view)
        hashing = _hash_beside(self._sha, view)
        try:
            return self._f.write(view)
        finally:
            hashing.result()

    def tell(self):
        return self._f.tell()

    def flush(self):
        self._f.flush()

    def fileno(self):
        return self._f.fileno()

    def digest(self) -> dict:
        return {"sha256": self._sha.hexdigest(), "bytes": self.size}


def _write_hashed(path: Path, write) -> dict:
    """write(file) into `path` durably (core/paths.write_durably); the digest of what it wrote."""
    digest = {}

    def hashed(f):
        h = HashingFile(f)
        write(h)
        digest.update(h.digest())

    paths.write_durably(path, hashed)
    return digest


def file_digest(path: Path) -> dict:
    """{"sha256", "bytes"} of a file on disk (what a reader checks against the recorded digest)."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            size += len(chunk)
    return {"sha256": sha.hexdigest(), "bytes": size}


def write_tensors(path: Path, obj) -> dict:
    """torch.save(obj) to `path`: a temporary name, fsynced and renamed into place, so a reader
    sees the old file or the whole new one, never half of it. Returns its digest."""
    return _write_hashed(path, lambda f: torch.save(obj, f))


def read_tensors(path: Path, map_location="cpu"):
    """What torch.save wrote at `path`, as plain tensors and containers; raises what torch.load
    raises (a missing, truncated or non-tensor file): callers turn that into their own message."""
    return torch.load(path, map_location=map_location, weights_only=True)


def write_json(path: Path, obj) -> dict:
    """`obj` as indented JSON, written like write_tensors (meta.json: a kill never leaves half)."""
    return _write_hashed(path, lambda f: f.write(json.dumps(obj, indent=2).encode()))


def write_marker(path: Path, content: bytes = b"ok\n") -> dict:
    """A small marker file (a checkpoint's COMPLETE), written like the others: durably."""
    return _write_hashed(path, lambda f: f.write(content))


def write_shards(directory: Path, state: dict) -> dict:
    """Every rank writes its shards of `state` (DTensors; plain tensors are written once) into
    `directory` with DCP. A collective: every rank calls it. One rank's failure, which DCP raises
    on every rank, becomes an OSError like any other failed write. Returns the digests of the files
    this rank wrote, by name inside `directory`."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(directory))
    writer.fs = _HashingFileSystem(writer.fs)
    try:
        dcp.save(state, storage_writer=writer)
    except dcp.CheckpointException as e:
        raise OSError(errno.EIO, f"writing the model's shards failed: {e}") from e
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


class UnreadableShards(Exception):
    """read_shards failed; `cause` is the type name of what DCP raised, for the caller's message."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


def read_shards(directory: Path) -> dict:
    """The whole tensors of a DCP folder, read by this process alone (no collectives, any number
    of processes wrote it). UnreadableShards when it is missing, truncated or corrupt."""
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
        raise UnreadableShards(type(e).__name__) from e
    return state
