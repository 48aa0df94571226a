"""What the tests of hardware/'s measurement files share (peak.py's two, precision.py's: each a
cache.MeasurementCache): a file another version left, an entry measured long ago, a new process."""

import json
from pathlib import Path


def write_foreign_file(measurement_cache, text: str) -> Path:
    """The cache's file holding `text`, as another version (or a crash) could leave it, and no
    notice printed about it yet in this process; returns its path."""
    path = measurement_cache.path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    measurement_cache._warned.clear()
    return path


def backdate(measurement_cache, key: str | None = None):
    """The file's entry `key` (None: its only entry) stamped as measured in 2020: stale."""
    data = json.loads(measurement_cache.path.read_text())
    if key is None:
        (key,) = data["entries"]
    data["entries"][key]["measured"] = "2020-01-01 00:00:00"
    measurement_cache.path.write_text(json.dumps(data))


def new_process(monkeypatch, probe_cache):
    """This process's probes forgotten, as in a new process: only the file remembers."""
    monkeypatch.setattr(probe_cache, "probed", {})
