"""The distributed soak, short (5 runs; `make soak` runs 50): every two-process run beside a busy
neighbour, its model sharded by FSDP2 (sharded saves, its own collectives), exits 0 and no rank
aborts at exit ("terminate called"). The soak's own figures, before and
after the teardown meeting: benchmarks/RESULTS.md, "Distributed soak"."""

import sys

from support.repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import soak_distributed  # noqa: E402


def test_five_runs_beside_a_busy_neighbour_end_cleanly(tmp_path):
    figures = soak_distributed.soak(5, tmp_path, log=lambda *args, **kwargs: None, sharding="fsdp")
    tails = "\n".join(f["tail"] for f in figures["failures"])
    assert figures["exit_codes"] == {"0": 5} and figures["sharding"] == "fsdp", tails
    assert figures["abort_lines"] == 0 and not figures["seed_failures"], tails
