"""
Where files live, all under NANOCHAT_FAST_HOME (default ~/.cache/nanochat_fast): data/<dataset>/
(prepared parquet), tokens/<dataset>/ (token shards), tokenizer/, runs/<run>/ (checkpoints/step_N/,
metrics.jsonl, loss.png, report.md); and files written atomically.
"""

import json
import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("NANOCHAT_FAST_HOME") or Path.home() / ".cache" / "nanochat_fast").expanduser()


def data_dir(dataset: str) -> Path:
    return home() / "data" / dataset


def tokens_dir(dataset: str) -> Path:
    return home() / "tokens" / dataset


def tokenizer_dir() -> Path:
    return home() / "tokenizer"


def runs_dir() -> Path:
    return home() / "runs"


def replace_atomically(path: Path, write):
    """write(tmp_path) then rename onto path: readers see the old file, the new one, or none; a
    failed write leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def write_durably(path: Path, write):
    """write(file object) to a temporary name, fsync it, rename it over `path`, fsync the folder:
    after a crash the file is the old one or the complete new one."""

    def write_synced(tmp: Path):
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())

    path = Path(path)
    replace_atomically(path, write_synced)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj):
    """`obj` as indented JSON (and a final newline), replaced atomically: manifests, shard metadata."""
    replace_atomically(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"))


def read_json_or_none(path: Path):
    """What the JSON file `path` holds, or None when it is missing, unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
