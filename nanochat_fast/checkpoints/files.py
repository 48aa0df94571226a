"""
How the package's tensor files are written and read: the one place that calls torch.save,
torch.load and torch.distributed.checkpoint (DCP), so every such file is written atomically and
durably, and read as plain tensors only (weights_only=True: loading never runs code).

Checkpoints (step_dirs.py) and nanochat's files (interop/) both go through here.
"""

import errno
import json
import warnings
from pathlib import Path

import torch

from ..core import paths


def write_tensors(path: Path, obj):
    """torch.save(obj) to `path`: a temporary name, fsynced and renamed into place, so a reader
    sees the old file or the whole new one, never half of it."""
    paths.write_durably(path, lambda f: torch.save(obj, f))


def read_tensors(path: Path, map_location="cpu"):
    """What torch.save wrote at `path`, as plain tensors and containers; raises what torch.load
    raises (a missing, truncated or non-tensor file): callers turn that into their own message."""
    return torch.load(path, map_location=map_location, weights_only=True)


def write_json(path: Path, obj):
    """`obj` as indented JSON, written like write_tensors (meta.json: a kill never leaves half)."""
    paths.write_durably(path, lambda f: f.write(json.dumps(obj, indent=2).encode()))


def write_marker(path: Path):
    """A small marker file (a checkpoint's COMPLETE), written like the others: durably."""
    paths.write_durably(path, lambda f: f.write(b"ok\n"))


def write_shards(directory: Path, state: dict):
    """Every rank writes its shards of `state` (DTensors; plain tensors are written once) into
    `directory` with DCP. A collective: every rank calls it. One rank's failure, which DCP raises
    on every rank, becomes an OSError like any other failed write."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(state, checkpoint_id=directory)
    except dcp.CheckpointException as e:
        raise OSError(errno.EIO, f"writing the model's shards failed: {e}") from e


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
