"""
The measurement files under NANOCHAT_FAST_HOME/hardware/: entries by key and a format version,
written atomically and re-read before each write (another process may have added its own). A file
this version did not write reads as empty, says so in one line, and is replaced: a cache can cost a
measurement, never a run. ProbeCache adds a probe's rules: once per process and key, stale after
STALE_AFTER_DAYS, not written while the machine is busy (a probe under load reads low).
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from ..core import paths

STALE_AFTER_DAYS = 30


class MeasurementCache:
    def __init__(self, filename: str, version: int, valid):
        """valid(entry) -> bool: a file holding an entry that fails it is not this version's."""
        self.filename, self.version, self.valid = filename, version, valid
        self._warned: set[Path] = set()

    @property
    def path(self) -> Path:
        return paths.home() / "hardware" / self.filename

    def entries(self) -> dict:
        path = self.path
        try:
            text = path.read_text()
        except OSError:
            return {}
        try:
            data = json.loads(text)
            if data.get("version") != self.version or not isinstance(data.get("entries"), dict):
                raise ValueError("not this version's format")
            entries = {k: v for k, v in data["entries"].items() if isinstance(v, dict) and self.valid(v)}
            if len(entries) < len(data["entries"]):
                raise ValueError("an entry this version would not write")
            return entries
        except (ValueError, TypeError, AttributeError):
            if path not in self._warned:
                self._warned.add(path)
                print(
                    f"note: {path} is not a cache this version wrote (corrupt or foreign): measuring again",
                    file=sys.stderr,
                    flush=True,
                )
            return {}

    def get(self, key: str) -> dict | None:
        """The entry under `key`, unless older than STALE_AFTER_DAYS (then it is measured again)."""
        entry = self.entries().get(key)
        return entry if entry and age_days(entry) <= STALE_AFTER_DAYS else None

    def put(self, key: str, entry: dict) -> dict:
        """Store `entry`, stamped with its time (a file that cannot be written only costs a measurement)."""
        entry = {**entry, "measured": entry.get("measured") or time.strftime("%Y-%m-%d %H:%M:%S")}
        entries = {**self.entries(), key: entry}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            paths.replace_atomically(
                self.path,
                lambda tmp: tmp.write_text(json.dumps({"version": self.version, "entries": entries}, indent=1)),
            )
        except OSError:
            pass
        return entry


def age_days(entry: dict) -> float:
    """Days since the entry was measured (infinite when the stamp is missing or unreadable)."""
    try:
        return (time.time() - time.mktime(time.strptime(entry["measured"], "%Y-%m-%d %H:%M:%S"))) / 86400
    except (KeyError, TypeError, ValueError, OverflowError):
        return float("inf")


def machine_busy() -> bool:
    """More runnable tasks than CPUs over the last minute: a probe now, reading low, is not cached."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1) + 0.5
    except (AttributeError, OSError):
        return False


class ProbeCache(MeasurementCache):
    def __init__(self, filename: str, version: int, valid, probe: Callable[[object], dict]):
        """probe(device) -> the entry's measurements (a dict of JSON values)."""
        super().__init__(filename, version, valid)
        self.probe = probe
        self.probed: dict[str, dict] = {}  # this process's probes (also those a busy machine kept out of the file)

    def measured(self, key: str, device, remeasure: bool = False, store: bool = True) -> dict:
        """The entry under `key` (machine_key(device)): this process's own probe, else the file's
        unless stale, else probed now and written unless the machine is busy or not `store`."""
        if key in self.probed and not remeasure:
            return self.probed[key]
        cached = None if remeasure else self.get(key)
        if cached:
            return cached
        t0 = time.perf_counter()
        entry = self.probe(device)
        entry.update(probe_seconds=round(time.perf_counter() - t0, 3), measured=time.strftime("%Y-%m-%d %H:%M:%S"))
        self.probed[key] = entry
        return self.store(key, entry) if store else entry

    def store(self, key: str, entry: dict) -> dict:
        return entry if machine_busy() else self.put(key, entry)
