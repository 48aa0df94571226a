"""
A checkpoint checked against what was recorded when it was saved, so a file damaged later (a bad
disk, a partial copy, an interrupted `rsync --inplace`) that still unpickles is refused instead of
loading wrong weights.

    COMPLETE     {"meta.json": {"sha256", "bytes"}, "check": sha256 of that record}
    meta.json    "files": {name: {"sha256", "bytes"}} for every other file (DCP shards included)

A mismatch is DamagedCheckpoint (a UserError: one line naming the file, exit 2); --resume auto
catches it and falls back to the newest intact checkpoint (run_dirs.py). A checkpoint saved before
digests were recorded (COMPLETE holds "ok") loads with a notice.
"""

import hashlib
import json
import sys
from pathlib import Path

from ..core.distributed import print0
from ..core.errors import UserError
from . import files

OLD_MARKER = b"ok\n"
_verified = set()  # (checkpoint, COMPLETE's mtime) already checked by this process


class DamagedCheckpoint(UserError):
    """A file of a checkpoint is not what was written: missing, or another size or sha256."""


def _record_check(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def complete_record(meta_digest: dict) -> bytes:
    """COMPLETE's content: meta.json's digest, and a check of that record itself (a damaged COMPLETE
    is then named as such, not blamed on meta.json)."""
    record = {"meta.json": meta_digest}
    return (json.dumps({**record, "check": _record_check(record)}, indent=2) + "\n").encode()


def _advice() -> str:
    return (
        "it was damaged after it was saved; pick another checkpoint with --resume PATH or --step "
        "(--resume auto falls back to the newest intact one)"
    )


def damaged(path: Path, what: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"checkpoint file {path} {what}: {_advice()}")


def _mismatch(path: Path, want: dict, got: dict) -> DamagedCheckpoint:
    if want.get("bytes") != got["bytes"]:
        return damaged(path, f"has {got['bytes']:,} bytes, {want.get('bytes', 0):,} were recorded when it was saved")
    return damaged(path, f"has sha256 {got['sha256'][:16]}..., not the {str(want.get('sha256'))[:16]}... recorded")


def meta_digest_of(complete: Path) -> dict | None:
    """meta.json's recorded digest, from COMPLETE; None for an old checkpoint's plain marker."""
    if not complete.exists():  # not a complete checkpoint: nothing recorded to check against
        return None
    raw = complete.read_bytes()
    if raw.strip() in (OLD_MARKER.strip(), b""):  # "ok" before digests were kept; a hand-made empty marker
        return None
    try:
        record = json.loads(raw.decode())
        digest = record["meta.json"]
        intact = record["check"] == _record_check({"meta.json": digest})
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        intact = False
    if not intact:
        raise damaged(complete, "does not hold the record it was written with")
    return digest


def check_meta(complete: Path, meta_path: Path, raw: bytes):
    """meta.json's bytes as read against COMPLETE's record of them."""
    want = meta_digest_of(complete)
    if want is None:
        return
    got = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    if got != want:
        raise _mismatch(meta_path, want, got)


def verify(ckpt: Path, meta: dict, complete: Path):
    """Every file meta.json lists, read and hashed: DamagedCheckpoint naming the first that differs.
    Once per checkpoint and process (a resume reads the model, then the optimizer states)."""
    key = (str(Path(ckpt).resolve()), complete.stat().st_mtime_ns)
    if key in _verified:
        return
    listed = meta.get("files")
    if listed is None:
        print0(f"note: {ckpt} records no file digests (saved by an older version): loaded unverified", file=sys.stderr)
    for name, want in sorted((listed or {}).items()):
        path = Path(ckpt) / name
        if not path.is_file():
            raise damaged(path, "is missing")
        got = files.file_digest(path)
        if got != want:
            raise _mismatch(path, want, got)
    _verified.add(key)
