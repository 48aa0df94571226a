"""
The startup checks of a run on several nodes, before any work, each failure one line naming the node
(hostname and node rank: rank_watch.here): a folder every rank must share (each writes a marker and
reads the others'), a step every rank must pass (one rank's mistake named on every rank, not a peer's
broken connection) and the flags every node must be started with (a hash compared, the flag named).
"""

import hashlib
import json
import shutil
import time
import uuid
from pathlib import Path

from .distributed import gather_objects, get_dist_info, is_distributed, rank0_decides
from .errors import UserError
from .rank_watch import describe_node as describe
from .rank_watch import here

# how long a rank looks for the others' markers. Each looks only once all have written theirs (the
# gather before it): on NFS a name never looked up has no cached "missing" entry, so the first look asks
# the server; the wait is for filesystems slower to show a new file
SHARED_WAIT_S = 5.0


def each_rank_ok(step, what: str):
    """step() on every rank; a UserError on some rank (e.g. a file missing on one node) is raised on
    every rank as one line naming the first such rank's node, so none waits for it in a collective."""
    if not is_distributed():
        return step()
    error = None
    try:
        result = step()
    except UserError as e:
        error, result = str(e), None
    failed = [(r, where, msg) for r, (where, msg) in enumerate(gather_objects((here(), error))) if msg is not None]
    if failed:
        rank, where, msg = failed[0]
        others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        raise UserError(f"{what} on rank {rank}, {describe(where)}{others}: {msg}")
    return result


def check_shared(folder: Path, what: str, fix: str):
    """Every rank writes a marker into `folder` and looks for every other rank's: a folder that is
    not the same one on every node stops every rank with one line naming the node that cannot see
    another's (`what` says what the folder holds, `fix` what to do). Nothing is left behind."""
    if not is_distributed():
        return
    token = rank0_decides(lambda: uuid.uuid4().hex[:12])
    place = Path(folder) / f".shared_check_{token}"
    me, ranks = here(), gather_objects(here())
    mine = place / f"rank{get_dist_info()[1]}"

    def write():
        try:
            place.mkdir(parents=True, exist_ok=True)
            mine.write_text(json.dumps(me))
        except OSError as e:
            raise UserError(f"cannot write to {folder} ({e.strerror or e}); {fix}") from None

    each_rank_ok(write, f"{what} {folder} cannot be written")
    deadline, missing = time.monotonic() + SHARED_WAIT_S, list(range(len(ranks)))
    while True:
        missing = [r for r in missing if not (place / f"rank{r}").exists()]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    unseen = gather_objects(missing)
    mine.unlink(missing_ok=True)
    gather_objects(None)  # a barrier: every rank has looked before the folder goes
    shutil.rmtree(place, ignore_errors=True)
    blind = [(r, u) for r, u in enumerate(unseen) if u]
    if blind:
        r, u = next(((r, u) for r, u in blind if r != 0), blind[0])  # rank 0's view is the reference
        raise UserError(
            f"{describe(ranks[r])} does not see the files {describe(ranks[u[0]])} writes in {what} {folder} "
            f"(looked for {SHARED_WAIT_S:g} s): every node must see one shared {what}; {fix}"
        )


def config_hash(flags: dict) -> str:
    return hashlib.sha256(json.dumps(flags, sort_keys=True, default=str).encode()).hexdigest()


def check_same_flags(flags: dict):
    """Every rank started with the same flags (`flags`: name -> value, with what else must agree):
    their hash compared across ranks; a difference is one line naming the flag and the two nodes."""
    if not is_distributed():
        return
    mine = config_hash(flags)
    hashes = gather_objects((here(), mine))
    if all(h == hashes[0][1] for _, h in hashes):
        return
    everyone = gather_objects(flags)
    r = next(r for r, (_, h) in enumerate(hashes) if h != hashes[0][1])
    ref, other = everyone[0], everyone[r]
    name = next(k for k in sorted(set(ref) | set(other)) if ref.get(k) != other.get(k))
    raise UserError(
        f"the nodes were started with different flags: {name} is {other.get(name)!r} on rank {r}, "
        f"{describe(hashes[r][0])}, and {ref.get(name)!r} on rank 0, {describe(hashes[0][0])}; "
        "start every node with the same command (only --node-rank differs)"
    )
