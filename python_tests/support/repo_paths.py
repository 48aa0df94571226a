"""Where things are: the repository's root, this support folder and its fixtures (data files)."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
FIXTURES = SUPPORT / "fixtures"
