"""The chat serving benchmark's per-client rate (benchmarks/bench_chat_web.py): pieces per second
after the first, and None where no time between pieces was seen (one piece, or every piece in one
chunk), never a division by zero that would stop `make bench` midway."""

import sys

import pytest
from support.repo_paths import ROOT

pytest.importorskip("fastapi", reason="chat_web needs the web extra: pip install -e '.[web]'")
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_chat_web as web  # noqa: E402


def test_rate_is_pieces_per_second_after_the_first_or_none_without_time_between():
    assert web.rate([1.0, 1.5, 2.0]) == 2.0
    assert web.rate([1.0, 1.0, 1.5]) == 4.0  # two pieces in the first chunk
    assert web.rate([]) is None and web.rate([1.0]) is None
    assert web.rate([3.0, 3.0, 3.0]) is None  # the whole reply in one chunk
