"""
A copy of the source tree in another folder, with an install of its own that survives re-staging:

    python benchmarks/stage_tree.py DIR

For targets that need the package built against another torch (make test-torch-floor, make
cuda-build-check) or installed from scratch (gpu_check.py rehearse): the extension builds in place, so a
second venv in this tree would overwrite the CPU .venv's _C.so. The copy takes git's tracked and
untracked-but-not-ignored files (every file outside build and cache folders where there is no git).
Unchanged files keep their time stamps, so make does not reinstall; files gone from the source are
removed; the copy's own venv, build folder and extension stay.
"""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEEP = (".venv", "build", ".pytest_cache", "nanochat_fast/_C.so")  # the copy's own install
SKIP = {".venv", "build", ".git", "__pycache__", ".pytest_cache", ".benchmarks"}


def source_files(root: Path) -> set[str]:
    git = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True
    )
    if git.returncode == 0:
        return {line for line in git.stdout.splitlines() if (root / line).is_file()}
    return {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not SKIP & set(p.relative_to(root).parts) and p.suffix not in (".so", ".o")
    }


def stage(dst: Path, root: Path = ROOT):
    """Make dst a copy of root's source tree, keeping dst's own install (KEEP)."""
    files = source_files(root)
    for rel in sorted(files):
        src, out = root / rel, dst / rel
        if not out.exists() or out.stat().st_size != src.stat().st_size or out.stat().st_mtime != src.stat().st_mtime:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)
    for path in sorted(dst.rglob("*"), reverse=True):
        rel = path.relative_to(dst)
        kept = any(rel.parts[: len(Path(k).parts)] == Path(k).parts for k in KEEP)
        if (
            path.is_file()
            and str(rel) not in files
            and not kept
            and "__pycache__" not in rel.parts
            and not rel.parts[0].endswith(".egg-info")
        ):
            path.unlink()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/stage_tree.py DIR")
    stage(Path(sys.argv[1]).resolve())
