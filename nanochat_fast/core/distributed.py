"""
A process set up (device, rank, seeds, the process group) and torn down, and the few collectives
the run layer needs beyond the optimizers' own. Under torchrun every process trains its share of
the data: CUDA through NCCL (cuda:LOCAL_RANK), a CPU through gloo (really data-parallel), MPS
alone (it has no collective backend). `nanochat_fast.common` re-exports the public names.
"""

import os
import sys
import threading
from contextlib import contextmanager, suppress

import torch
import torch.distributed as dist

from . import rank_watch
from .errors import UserError
from .threads import configure_threads

DEVICE_TYPES = ("cuda", "mps", "cpu")

# the tensor collectives; torch >= 2.8 names them *_single and deprecates the *_tensor names
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def get_dist_info():
    """(ddp, rank, local_rank, world_size): from the process group, else torchrun's environment."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        return True, rank, int(os.environ.get("LOCAL_RANK", rank)), dist.get_world_size()
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return False, 0, 0, 1


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def print0(*args, **kwargs):
    if get_dist_info()[1] == 0:
        print(*args, **kwargs)


def autodetect_device_type() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _check_device_type(device_type: str, world_size: int, local_rank: int):
    if device_type not in DEVICE_TYPES:
        raise UserError(f"unknown device type {device_type!r}: use cuda, mps, cpu or leave it empty to autodetect")
    available = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available, "cpu": lambda: True}
    if not available[device_type]():
        missing = "no CUDA GPU is available" if device_type == "cuda" else "MPS is not available"
        raise UserError(
            f"device type {device_type} was asked for but {missing}: "
            "use --device-type=cpu (or leave it empty to autodetect)"
        )
    if device_type == "mps" and world_size > 1:
        raise UserError(
            f"MPS runs a single process but {world_size} were launched: run the script with "
            "plain `python -m ...` instead of torchrun"
        )
    if device_type == "cuda" and local_rank >= torch.cuda.device_count():
        raise UserError(
            f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} are visible on this "
            "node, use --nproc_per_node <= the GPU count"
        )


def set_deterministic(enabled: bool, warn_only: bool = False):
    """Bitwise reproducible runs (same device, process and thread counts). warn_only: ops without a
    deterministic implementation warn instead of failing (some GPU attention backward kernels)."""
    if enabled:  # before cuBLAS starts; harmless on CPU
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False


def compute_init(device_type: str = "", seed: int = 42, deterministic: bool = False, collective_timeout=None):
    """(ddp, rank, local_rank, world_size, device) of this process, set up: every rank seeded the
    same (models start identical), the process group started under torchrun with rank_watch's
    first timeout (collective_timeout applies once rank_watch.settle() is called)."""
    device_type = device_type or autodetect_device_type()
    ddp, rank, local_rank, world_size = get_dist_info()
    _check_device_type(device_type, world_size, local_rank)
    # the cores this process may use, split among torchrun's local ranks (OMP_NUM_THREADS wins)
    configure_threads()

    torch.manual_seed(seed)
    set_deterministic(deterministic, warn_only=device_type != "cpu")
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
        # TF32 for fp32 matmuls outside autocast, unless the run must be reproducible
        torch.set_float32_matmul_precision("highest" if deterministic else "high")

    timeout = rank_watch.init_timeout(collective_timeout)
    device = torch.device("cuda", local_rank) if ddp and device_type == "cuda" else torch.device(device_type)
    if ddp:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():  # NCCL on GPUs; gloo on a CPU (and for a lone MPS process)
            backend = dict(backend="nccl", device_id=device) if device.type == "cuda" else dict(backend="gloo")
            dist.init_process_group(**backend, timeout=timeout, **_attempt_store())
        with rank_watch.phase("process setup"):
            dist.barrier()
        rank_watch.start_heartbeat()
        if rank == 0 and _node_cannot_rejoin():
            print(
                "note: a node that leaves this job cannot rejoin it: start every node's torchrun with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/guide.md#many-nodes)",
                file=sys.stderr,
            )
    return ddp, rank, local_rank, world_size, device


def _node_cannot_rejoin() -> bool:
    """Several nodes under torchrun --max-restarts with the agent's store shared (torch's default):
    torch's agent then never gives a node that comes back the workers' address (docs/guide.md#many-nodes)."""
    env = os.environ
    several_nodes = env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE")) != env.get("WORLD_SIZE")
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    return several_nodes and restarts and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _attempt_store() -> dict:
    """Under torchrun --max-restarts, where the ranks share the agent's store (torch's default), a
    store of this attempt's own: otherwise the restarted ranks read the attempt before's keys (the
    dead ranks' addresses) as theirs. Not shared (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), rank 0
    hosts a new store every round: nothing stale, and no restart count in the keys (a node that
    comes back counts from 0, the node that stayed does not)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(rendezvous("env://"))
    return dict(store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank, world_size=world_size)


TEARDOWN_BARRIER_S = 300.0  # how long a finished rank waits for the others (rank 0 writes the report)
TEARDOWN_ABANDON_S = 10.0  # after a failure, how long destroying the group may take


def compute_cleanup(ok: bool = True):
    """Tear down the process group, if any. ok (this rank succeeded): the ranks first meet through
    the store (rank_watch.meet_at_end), so none closes its connections while another is still in a
    collective (which aborts it: "terminate called without an active exception"). Not ok: no wait
    for a rank that may be dead; the group is destroyed on a side thread, then left behind."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if ok and dist.get_world_size() > 1:
        seconds = max(TEARDOWN_BARRIER_S, rank_watch.timeout_s())
        late = rank_watch.meet_at_end(seconds)
        if late:
            print(
                f"warning: rank {', '.join(map(str, late))} did not reach the end within {seconds:g} s; "
                "leaving without it",
                file=sys.stderr,
                flush=True,
            )
            ok = False
    rank_watch.stop_heartbeat()
    if ok:
        dist.destroy_process_group()
        return
    destroyer = threading.Thread(target=_destroy_quietly, name="destroy_process_group", daemon=True)
    destroyer.start()
    destroyer.join(TEARDOWN_ABANDON_S)


def _destroy_quietly():
    with suppress(Exception):  # a group whose peers are gone: nothing left to release cleanly
        dist.destroy_process_group()


@contextmanager
def torn_down():
    """compute_cleanup() when the block ends, ok unless it raised (SystemExit(0) aside): a failed
    rank never waits for the others at the teardown barrier."""
    try:
        yield
    except SystemExit as e:
        compute_cleanup(ok=not e.code)
        raise
    except BaseException:
        compute_cleanup(ok=False)
        raise
    compute_cleanup(ok=True)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks of a small tensor, added in rank order: the same bits on every rank and
    from run to run (an all-reduce may sum in another order on each rank)."""
    if not is_distributed():
        return t.detach().clone()
    t = t.detach()
    world_size = dist.get_world_size()
    flat = t.reshape(-1).contiguous()
    gathered = torch.empty(world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather_single(gathered, flat)
    return gathered.view(world_size, *t.shape).sum(dim=0, dtype=t.dtype if t.is_floating_point() else None)


def any_rank(flag: bool, device) -> bool:
    """True on every rank if `flag` is on any rank (one all-reduce): the ranks decide together."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor(int(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_ranks_ok(ok: bool, device) -> bool:
    """True on every rank iff `ok` is True on every rank; doubles as a barrier."""
    return not any_rank(not ok, device)


def gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rank0_decides(decide):
    """decide() on rank 0 alone, its result on every rank (ranks measuring for themselves could disagree)."""
    if not is_distributed():
        return decide()
    box = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
