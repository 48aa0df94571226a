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
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..core import paths

_hasher = None  # one thread hashing what the writing thread has already handed to the file
OVERLAP_BYTES = 1 << 20  # writes from this size on go to disk at once (HashingFile.write_large)
IN_FLIGHT_BYTES = 256 << 20  # copies waiting for the hashing thread, at most: then the writer waits


def _hash_later(sha, data: bytes):
    global _hasher
    if _hasher is None:
        from concurrent.futures import ThreadPoolExecutor

        _hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint_hash")
    return _hasher.submit(sha.update, data)


class HashingFile(io.RawIOBase):
    """A file opened for writing, hashing every byte written through it (sequential writes only).
    Each write is hashed in order on another thread while this one goes on writing, and on through
    the final fsync (digest() waits for it), so the hashing hides behind the disk. A buffer is
    only lent for its write (torch.save may free it next), so it is copied first, unless it starts
    at one of `kept`: addresses of memory that outlives the file (the saved tensors' storages)."""

    def __init__(self, f, kept=frozenset()):
        super().__init__()
        self._f, self._sha, self.size, self._kept = f, hashlib.sha256(), 0, kept
        self._small = bytearray()  # small writes gathered into one hashing task
        self._pending, self._in_flight = [], 0  # [(future, bytes)], their sum

    def writable(self):
        return True

    def write(self, data):
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        if view.nbytes < OVERLAP_BYTES:
            self._small += view
            if len(self._small) >= OVERLAP_BYTES:
                self._hash_small()
            return self._f.write(view)
        self._hash_small()
        if _address(view) in self._kept:
            self._pending.append((_hash_later(self._sha, view), 0))
        else:
            self._hash_copy(bytes(view))
        return self.write_large(view)

    def _hash_small(self):
        if self._small:
            self._hash_copy(bytes(self._small))
            self._small.clear()

    def _hash_copy(self, data: bytes):
        while self._pending and self._in_flight + len(data) > IN_FLIGHT_BYTES:
            done, n = self._pending.pop(0)
            done.result()
            self._in_flight -= n
        self._pending.append((_hash_later(self._sha, data), len(data)))
        self._in_flight += len(data)

    def write_large(self, view) -> int:
        """Write a large chunk and start its way to disk at once. Left alone, the kernel holds a
        checkpoint's pages in memory until the final fsync, which then writes all of it while the
        CPU idles; started here, the disk writes while the next chunks are copied and hashed
        (benchmarks/checkpoint_save_hashing.py)."""
        start = self._f.tell()
        written = self._f.write(view)
        self._f.flush()
        start_writeback(self._f.fileno(), start, written)
        return written

    def tell(self):
        return self._f.tell()

    def flush(self):
        self._f.flush()

    def fileno(self):
        return self._f.fileno()

    def digest(self) -> dict:
        self._hash_small()
        for done, _ in self._pending:
            done.result()
        self._pending, self._in_flight = [], 0
        return {"sha256": self._sha.hexdigest(), "bytes": self.size}


def start_writeback(fd: int, offset: int, length: int):
    """Ask the kernel to start writing a file range to disk without waiting for it (Linux starts
    the writeback of dirty pages on POSIX_FADV_DONTNEED; pages still dirty stay cached). Where
    posix_fadvise does not exist, the final fsync does it all."""
    if hasattr(os, "posix_fadvise") and length > 0:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _address(view) -> int:
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]


def _storage_addresses(obj) -> frozenset:
    """Where the storages of the CPU tensors in `obj` (dicts, lists, tuples of them) start."""
    found, todo = set(), [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo += x.values()
        elif isinstance(x, (list, tuple)):
            todo += x
        elif isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.layout == torch.strided:
            found.add(x.untyped_storage().data_ptr())
    return frozenset(found)


def _write_hashed(path: Path, write, kept=frozenset()) -> dict:
    """write(file) into `path` durably (core/paths.write_durably); the digest of what it wrote."""
    opened = []

    def hashed(f):
        opened.append(HashingFile(f, kept))
        write(opened[0])

    paths.write_durably(path, hashed)  # its fsync runs while the hashing catches up
    return opened[0].digest()


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
    return _write_hashed(path, lambda f: torch.save(obj, f), _storage_addresses(obj))


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
