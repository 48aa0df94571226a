"""
The oldest torch this package supports: the `torch>=X` requirement of pyproject.toml (or of the
installed metadata), which `make test-torch-floor` tests. Standard library only, so it can be read
before torch is installed: `python3 nanochat_fast/core/torch_floor.py` prints it; why_not(version)
says in one line why a torch is too old ("" when it is not).
"""

import re
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
REQUIREMENT = re.compile(r"torch\s*>=\s*(\d+(?:\.\d+)*)")


def _requirements() -> list[str]:
    if PYPROJECT.is_file():  # a source tree or an editable install
        text = PYPROJECT.read_text()
        try:
            import tomllib
        except ImportError:  # Python 3.10: the quoted strings of the file, among them the dependencies
            return re.findall(r'"([^"]*)"', text)
        return tomllib.loads(text)["project"]["dependencies"]
    from importlib.metadata import requires

    return requires("nanochat_fast") or []


def torch_floor() -> str:
    """'2.11.0': X of the package's `torch>=X` requirement."""
    for requirement in _requirements():
        found = REQUIREMENT.fullmatch(requirement.strip())
        if found:
            return found.group(1)
    raise LookupError(f"no torch>=X requirement in {PYPROJECT if PYPROJECT.is_file() else 'the installed metadata'}")


def version_tuple(version: str) -> tuple[int, ...]:
    """(2, 11, 0) for '2.11.0', '2.11.0+cu130' or '2.11.0a0+git1234' (a local build counts as its release)."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return tuple(int(part) for part in found.group().split("."))


def why_not(torch_version: str) -> str:
    """One line saying why this package does not support `torch_version`; empty when it does."""
    floor = torch_floor()
    have, need = version_tuple(torch_version), version_tuple(floor)
    width = max(len(have), len(need))
    if have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need)):
        return ""
    return (
        f"torch {torch_version} is older than the oldest torch nanochat_fast supports, {floor} "
        f"(pyproject.toml: torch>={floor}); install torch>={floor}"
    )


if __name__ == "__main__":
    print(torch_floor())
