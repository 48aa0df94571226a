"""
AdamW and Muon on parameters sharded by FSDP2's fully_shard: DTensors split by rows, rank r holding
rows [r*c, min((r+1)*c, rows)), c = ceil(rows / W) (torch.chunk's split: the last ranks may hold
fewer, or none), and gradients that FSDP's backward leaves averaged over ranks. FsdpAdamW updates
each rank's own rows (no collective); FsdpMuon orthogonalises every matrix whole on an owner rank
between two all-to-alls. Same state format and step as zero.py (docs/measurements.md#fsdp-optimizers).
"""

import math
from functools import partial

import torch
import torch.distributed as dist

from .adamw import AdamW
from .muon import Muon, apply_updates, assign_owners
from .zero import Bucket, sum_of_squares


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """(lo, hi): the rows of a `rows`-row parameter FSDP2 gives `rank` (torch.chunk's split)."""
    c = -(-rows // world_size)
    lo = min(rank * c, rows)
    return lo, min(lo + c, rows)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The rows of a DTensor this rank holds (a plain tensor as it is)."""
    return p.to_local() if hasattr(p, "to_local") else p


def exchange(send_pieces: list[list[torch.Tensor]], recv_sizes: list[int], dtype, device):
    """Async all-to-all: send_pieces[d] (flattened, concatenated) to rank d; receives recv_sizes[s]
    elements from each rank s. Returns (work, the receive buffer)."""
    flat = [t.reshape(-1) for pieces in send_pieces for t in pieces]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    in_splits = [sum(t.numel() for t in pieces) for pieces in send_pieces]
    return dist.all_to_all_single(recv, send.to(dtype), recv_sizes, in_splits, async_op=True), recv


class RowSharded:
    """What both optimizers add: distributed, gradients already averaged by FSDP's backward, and
    parameters checked to be split by rows as shard_rows says (what fully_shard does)."""

    distributed = True
    grads_are_sums = False

    def __init__(self, params, **hyperparameters):
        super().__init__(params, **hyperparameters)
        for p, name in self.names.items():
            placements = tuple(getattr(p, "placements", ()))
            lo, hi = shard_rows(p.shape[0], self.world_size, self.rank)
            if len(placements) != 1 or getattr(placements[0], "dim", None) != 0 or local_tensor(p).shape[0] != hi - lo:
                raise ValueError(
                    f"{type(self).__name__} needs parameters sharded by rows by fully_shard on a "
                    f"1-D mesh; {name!r} is {type(p).__name__} with placements {placements}"
                )


class FsdpAdamW(RowSharded, AdamW):
    """AdamW on FSDP2's row shards: a rank owns the rows it holds."""

    def _bucket(self, p):
        row = math.prod(p.shape[1:])  # from the shape: indexing a DTensor would be a collective
        ranges = [shard_rows(p.shape[0], self.world_size, r) for r in range(self.world_size)]
        return Bucket(0, [[(p, lo * row, hi * row)] if hi > lo else [] for lo, hi in ranges])

    def _owned_param(self, p, lo, hi):
        return local_tensor(p.data).view(-1)

    def reduce_grads(self):
        chunks = [local_tensor(self._grad(p)).reshape(-1) for p in self.params]
        return lambda: chunks

    def gather(self, b):
        pass  # each rank keeps its rows


class FsdpMuon(RowSharded, Muon):
    """Muon on FSDP2's row shards, each matrix orthogonalised once, by its owner: one all-to-all
    sends each owner its gradients' rows, one sends every rank its rows of the updates."""

    # no padding to bound here (no bucket is all-gathered): balance the Newton-Schulz cost alone
    owner_rule = staticmethod(partial(assign_owners, cost=lambda m, n: m * n * min(m, n), even=False))

    def _matrices(self, rank: int) -> list:
        """(group, matrix) of each matrix `rank` owns, in the one order both all-to-alls use."""
        return [(g, p) for g, b in enumerate(self.buckets) for p, _, _ in b.slots[rank]]

    def _rows(self, p, rank: int) -> slice:
        return slice(*shard_rows(p.shape[0], self.world_size, rank))

    def _piece(self, p, rank: int) -> int:
        """Elements of matrix p that `rank` holds."""
        rows = self._rows(p, rank)
        return (rows.stop - rows.start) * p.shape[1]

    def reduce_grads(self):
        W, me = self.world_size, self.rank
        grads = {p: local_tensor(self._grad(p)) for p in self.params}
        send = [[grads[p] for _, p in self._matrices(d)] for d in range(W)]
        recv_sizes = [sum(self._piece(p, s) for _, p in self._matrices(me)) for s in range(W)]
        work, recv = exchange(send, recv_sizes, grads[self.params[0]].dtype, self.params[0].device)

        def wait():
            """Per group, the (k, rows, cols) fp32 stack of the whole gradients of the owned matrices."""
            work.wait()
            stacks = [torch.empty((len(b.slots[me]), *b.first.shape), device=recv.device) for b in self.buckets]
            index = {p: j for b in self.buckets for j, p in enumerate(self.owned(b))}
            offset = 0
            for s in range(W):
                for g, p in self._matrices(me):
                    rows = stacks[g][index[p], self._rows(p, s)]
                    rows.copy_(recv[offset : offset + rows.numel()].view(rows.shape))
                    offset += rows.numel()
            return stacks

        return wait

    def grad_sq(self, stacks):
        """Of the rows this rank holds (each row is held by one rank), as FSDP left them."""
        return sum_of_squares([local_tensor(self._grad(p)) for p in self.params], self.params[0].device)

    def update(self, stacks, scale):
        if self.ns_precision is None:  # resolved on every rank together, before any rank's update
            self.resolve_ns_precision()
        W, me = self.world_size, self.rank
        updates = {}
        for g, (group, G) in enumerate(zip(self.param_groups, stacks)):
            if len(G):
                if scale != 1.0:
                    G.mul_(scale)
                updates.update(zip(self.owned(self.buckets[g]), self._direction(g, group, G)))
        send = [[updates[p][self._rows(p, d)] for _, p in self._matrices(me)] for d in range(W)]
        recv_sizes = [sum(self._piece(p, me) for _, p in self._matrices(s)) for s in range(W)]
        self._gathers = exchange(send, recv_sizes, torch.float32, self.params[0].device)
        self.num_updates += 1

    def finish_gathers(self):
        """Apply this rank's rows of every update, each matrix with its group's lr."""
        work, recv = self._gathers
        work.wait()
        offset = 0
        for s in range(self.world_size):
            for g, p in self._matrices(s):
                n = self._piece(p, self.rank)
                if n:
                    local = local_tensor(p.data)
                    apply_updates(self.param_groups[g], [p], [local], [recv[offset : offset + n].view(local.shape)])
                offset += n
        self._gathers = []
