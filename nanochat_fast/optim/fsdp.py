"""
AdamW and Muon on parameters sharded by FSDP2 (torch.distributed.fsdp.fully_shard): DTensors split
by rows over the ranks, each rank holding rows [r*c, min((r+1)*c, rows)) of every parameter, c =
ceil(rows / W) (torch.chunk's split: the last ranks may hold fewer rows, or none). FSDP's backward
leaves each rank the same rows of the gradient, already averaged over ranks.

    FsdpAdamW   AdamW is elementwise: each rank updates its own rows with the fused slice kernel.
                No collective at all.
    FsdpMuon    Newton-Schulz needs the whole matrix: every matrix has an owner rank (balanced by
                Newton-Schulz's cost); one all-to-all sends each owner its gradients' rows, the owner
                runs muon.py's Muon on them, one all-to-all sends every rank its rows of the updates.

Both keep the state format and the step protocol of zero.py, so a checkpoint loads with any
sharding and world size, and optim.step (step.py) clips them unchanged. The step in full:
docs/measurements.md#fsdp-optimizers.
"""

import math

import torch
import torch.distributed as dist

from .adamw import AdamW
from .muon import Muon, apply_updates
from .zero import sum_of_squares


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """(lo, hi): the rows of a `rows`-row parameter FSDP2 gives `rank` (torch.chunk's split)."""
    c = -(-rows // world_size)
    lo = min(rank * c, rows)
    return lo, min(lo + c, rows)


def assign_owners_by_cost(shapes: list[tuple[int, int]], sizes: list[int], world_size: int) -> list[list[int]]:
    """For each group (sizes[g] matrices of shape shapes[g]), the owner rank of each matrix:
    largest Newton-Schulz cost (m*n*min(m, n)) first, each to the least loaded rank so far.
    Deterministic, so every rank computes the same table."""
    cost = [m * n * min(m, n) for m, n in shapes]
    items = sorted(((g, i) for g, k in enumerate(sizes) for i in range(k)), key=lambda gi: (-cost[gi[0]], gi))
    load = [0] * world_size
    owners = [[0] * k for k in sizes]
    for g, i in items:
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[g][i] = r
        load[r] += cost[g]
    return owners


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The rows of a DTensor this rank holds (a plain tensor as it is)."""
    return p.to_local() if hasattr(p, "to_local") else p


def check_row_sharded(optimizer, world_size: int, rank: int):
    """Every parameter must be split by rows as shard_rows says (what fully_shard does)."""
    for p, name in optimizer.names.items():
        placements = tuple(getattr(p, "placements", ()))
        lo, hi = shard_rows(p.shape[0], world_size, rank)
        if len(placements) != 1 or getattr(placements[0], "dim", None) != 0 or local_tensor(p).shape[0] != hi - lo:
            raise ValueError(
                f"{type(optimizer).__name__} needs parameters sharded by rows by fully_shard on a "
                f"1-D mesh; {name!r} is {type(p).__name__} with placements {placements}"
            )


def exchange(send_pieces: list[list[torch.Tensor]], recv_sizes: list[int], dtype, device):
    """Async all-to-all: send_pieces[d] (flattened, concatenated) to rank d; receives recv_sizes[s]
    elements from each rank s. Returns (work, the receive buffer)."""
    flat = [t.reshape(-1) for pieces in send_pieces for t in pieces]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    in_splits = [sum(t.numel() for t in pieces) for pieces in send_pieces]
    return dist.all_to_all_single(recv, send.to(dtype), recv_sizes, in_splits, async_op=True), recv


class RowSharded:
    """What both optimizers below add to theirs: distributed, gradients already averaged by FSDP's
    backward, and parameters checked to be split by rows as shard_rows says."""

    distributed = True
    grads_are_sums = False

    def __init__(self, params, **hyperparameters):
        super().__init__(params, **hyperparameters)
        check_row_sharded(self, self.world_size, self.rank)


class FsdpAdamW(RowSharded, AdamW):
    """AdamW on FSDP2's row shards: the owned range of a parameter is the rows this rank holds.
    AdamW's arguments."""

    def _owned_range(self, p):
        row = math.prod(p.shape[1:])  # from the shape: indexing a DTensor would be a collective
        lo, hi = shard_rows(p.shape[0], self.world_size, self.rank)
        return lo * row, hi * row

    def _owned_param(self, p):
        return local_tensor(p.data).view(-1)

    def launch_reduce(self):
        # FSDP's backward has reduce-scattered (and averaged) the gradient already
        self._pending = dict(
            slots={p: dict(grad=local_tensor(self._grad(p)).reshape(-1), work=None) for p in self._params()},
            works=[],
            gathers=[],
        )

    def gather_params(self):
        self._pending = None


class FsdpMuon(RowSharded, Muon):
    """Muon on FSDP2's row shards, each matrix orthogonalised once, by its owner (docs/measurements.md#fsdp-optimizers).
    Muon's arguments."""

    def __init__(self, params, **hyperparameters):
        super().__init__(params, **hyperparameters)
        W = self.world_size
        # the matrices each rank owns, in the one order both all-to-alls use: (group, index in group)
        self._owned_by = [
            [(g, i) for g, layout in enumerate(self._layout) for i in layout["slots"][r]] for r in range(W)
        ]

    def _assign_owners(self, shapes, sizes):
        return assign_owners_by_cost(shapes, sizes, self.world_size)

    def _rows_of(self, g, rank):
        return shard_rows(self.param_groups[g]["params"][0].shape[0], self.world_size, rank)

    def _piece_size(self, g, rank):
        """Elements of a matrix of group g that `rank` holds."""
        lo, hi = self._rows_of(g, rank)
        return (hi - lo) * self.param_groups[g]["params"][0].shape[1]

    # -- the step protocol (zero.py) -------------------------------------------------------------

    def launch_reduce(self):
        """Step 1: send each owner this rank's rows of its matrices' gradients."""
        W, me = self.world_size, self.rank
        local = [[local_tensor(self._grad(p)) for p in group["params"]] for group in self.param_groups]
        send = [[local[g][i] for g, i in self._owned_by[d]] for d in range(W)]
        recv_sizes = [sum(self._piece_size(g, s) for g, _ in self._owned_by[me]) for s in range(W)]
        first = local[0][0]
        work, recv = exchange(send, recv_sizes, first.dtype, first.device)
        self._pending = dict(works=[work], local=local, recv=recv, waited=False)

    def owned_grad_sq(self):
        total = sum_of_squares([t for grads in self._pending["local"] for t in grads])
        return torch.zeros((), dtype=torch.float32, device=self._device()) if total is None else total

    def _owned_grads(self):
        """Per group, the (k, rows, cols) fp32 stack of the whole gradients of the owned matrices."""
        W, me = self.world_size, self.rank
        if not self._pending["waited"]:
            self._pending["works"][0].wait()
            self._pending["waited"] = True
        stacks = []
        for g, group in enumerate(self.param_groups):
            k = len(self._owned(g))
            stacks.append(torch.empty((k, *group["params"][0].shape), dtype=torch.float32, device=self._device()))
        index = {(g, i): j for g in range(len(self.param_groups)) for j, i in enumerate(self._owned(g))}
        offset = 0
        for s in range(W):
            for g, i in self._owned_by[me]:
                lo, hi = self._rows_of(g, s)
                n = self._piece_size(g, s)
                rows = stacks[g][index[(g, i)], lo:hi]
                rows.copy_(self._pending["recv"][offset : offset + n].view(rows.shape))
                offset += n
        return stacks

    def apply_update(self, clip_coef):
        """Step 2 on the owned matrices, then step 3's all-to-all is started."""
        self.ns_precision  # noqa: B018  (resolved on every rank together, before any rank's update)
        W, me = self.world_size, self.rank
        updates = {}
        for g, (group, G) in enumerate(zip(self.param_groups, self._owned_grads())):
            if not len(G):
                continue
            if clip_coef is not None:
                G.mul_(clip_coef)
            U, _ = self._direction(g, group, G)
            for j, i in enumerate(self._owned(g)):
                updates[(g, i)] = U[j]
        send = [[updates[(g, i)][slice(*self._rows_of(g, d))] for g, i in self._owned_by[me]] for d in range(W)]
        recv_sizes = [sum(self._piece_size(g, me) for g, _ in self._owned_by[s]) for s in range(W)]
        work, recv = exchange(send, recv_sizes, torch.float32, self._device())
        self._pending = dict(works=[work], recv=recv)
        self.num_updates += 1

    def gather_params(self):
        """Step 3: apply this rank's rows of every update, each matrix with its group's lr."""
        W, me = self.world_size, self.rank
        self._pending["works"][0].wait()
        recv, offset = self._pending["recv"], 0
        lrs = self._lr_of_groups()
        for s in range(W):
            for g, i in self._owned_by[s]:
                group, p = self.param_groups[g], self.param_groups[g]["params"][i]
                n = self._piece_size(g, me)
                u = recv[offset : offset + n]
                offset += n
                if n:
                    local = local_tensor(p.data)
                    apply_updates(group, [p], [local], [u.view(local.shape)], lrs[g])
        self._pending = None

    def _lr_of_groups(self):
        """Every group's lr for its matrices' shape, as _direction computes it on the owner."""
        out = []
        for group in self.param_groups:
            rows, cols = group["params"][0].shape
            out.append(group["lr"] * max(1.0, rows / cols) ** 0.5)
        return out
