"""
Muon (MomentUm Orthogonalized by Newton-Schulz) for the 2-D matrices of the transformer blocks, in
one process (Muon) or sharded over the ranks (DistMuon, the same code).

Per matrix: buf = lerp(buf, g, 1 - momentum); g = lerp(g, buf, momentum) (Nesterov) or buf;
update = NewtonSchulz(g) * max(1, rows/cols)^0.5; p -= lr * lr_mul * update.

Matrices are grouped by shape and each group is stacked, so one batched newton_schulz call
orthogonalizes every matrix of a shape a rank owns. Distributed, each matrix is owned by one rank,
which keeps its momentum (1/W of the state) and computes its update:
    reduce-scatter: the group's gradients, stacked as (W, c, rows, cols) with rank r's c slots
                    holding the matrices it owns (zero padding where it owns fewer), so each rank
                    receives the summed gradients of exactly its own matrices
    update:         momentum + Newton-Schulz on the owned stack (c, rows, cols)
    all-gather:     the updated owned matrices, copied back into every rank's parameters
Ownership is balanced by bytes over all groups (largest matrices first, the least loaded rank
takes the next matrix, at most c = ceil(K/W) of a K-matrix group per rank), so any group size and
any world size work and no rank holds much more state than 1/W of the total.
"""
import torch

from ..kernels import newton_schulz
from ..kernels.newton_schulz import resolve_coefficients
from .zero import (ZeroOptimizer, all_gather, check_hparam, copy_flat_pieces, normalize_param_groups,
                   reduce_scatter_sum)


def assign_owners(group_shapes: list[tuple[int, int]], group_sizes: list[int], world_size: int) -> list[list[int]]:
    """For each group (K matrices of one shape), the rank that owns each matrix. Deterministic, so
    every rank computes the same table."""
    load = [0] * world_size
    owners = [[0] * k for k in group_sizes]
    order = sorted(range(len(group_shapes)), key=lambda g: -group_shapes[g][0] * group_shapes[g][1])
    for g in order:
        k, numel = group_sizes[g], group_shapes[g][0] * group_shapes[g][1]
        capacity = -(-k // world_size)
        taken = [0] * world_size
        for i in range(k):
            r = min((r for r in range(world_size) if taken[r] < capacity), key=lambda r: (load[r], r))
            owners[g][i] = r
            taken[r] += 1
            load[r] += numel
    return owners


class Muon(ZeroOptimizer):
    """Muon in one process. Params: 2-D tensors (or (name, tensor) pairs); they are regrouped by
    shape, each group keeping the hyperparameters lr, momentum, nesterov, ns_steps, ns_coefficients."""

    kind = "muon"

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_coefficients="quintic",
                 *, _distributed=False):
        check_hparam("lr", lr)
        check_hparam("momentum", momentum, 0.0, 1.0)
        resolve_coefficients(ns_coefficients, ns_steps)  # ValueError on a bad choice
        if not isinstance(ns_coefficients, str):
            ns_coefficients = [list(map(float, abc)) for abc in ns_coefficients]
        defaults = dict(lr=lr, momentum=momentum, nesterov=bool(nesterov), ns_steps=ns_steps,
                        ns_coefficients=ns_coefficients)
        super().__init__(self._group_by_shape(params), defaults, distributed=_distributed)
        shapes = [tuple(g["params"][0].shape) for g in self.param_groups]
        sizes = [len(g["params"]) for g in self.param_groups]
        owners = assign_owners(shapes, sizes, self.world_size)
        # per group: capacity c, and for every rank the indices (into the group) of the matrices it owns
        self._layout = []
        for g, group_owners in enumerate(owners):
            slots = [[i for i, o in enumerate(group_owners) if o == r] for r in range(self.world_size)]
            self._layout.append(dict(capacity=max(len(s) for s in slots), slots=slots))
        self._reset_state()

    @staticmethod
    def _group_by_shape(params):
        groups = []
        for group in normalize_param_groups(params):
            by_shape = {}
            for p, name in zip(group["params"], group["param_names"]):
                if p.dim() != 2:
                    raise ValueError(f"Muon optimizes 2-D matrices; {name!r} has shape {tuple(p.shape)} "
                                     "(give vectors and embeddings to AdamW)")
                by_shape.setdefault(tuple(p.shape), []).append((name, p))
            for items in by_shape.values():
                groups.append({**group, "params": [p for _, p in items], "param_names": [n for n, _ in items]})
        return groups

    def _reset_state(self):
        # momentum of the owned matrices, one (k, rows, cols) stack per group; state[p] holds views
        self._momentum = [None] * len(self.param_groups)
        self.state.clear()

    def _owned(self, g):
        return self._layout[g]["slots"][self.rank]

    # -- phases ----------------------------------------------------------------------------------

    def _launch_reduce(self):
        W = self.world_size
        stacks, works = [], []
        for g, group in enumerate(self.param_groups):
            grads = [self._grad(p) for p in group["params"]]
            if W == 1:
                stacks.append(torch.stack(grads))
                continue
            layout = self._layout[g]
            c = layout["capacity"]
            zero = torch.zeros_like(grads[0])
            rs_in = torch.stack([grads[rank_slots[j]] if j < len(rank_slots) else zero
                                 for rank_slots in layout["slots"] for j in range(c)])
            out = torch.empty((c, *grads[0].shape), dtype=grads[0].dtype, device=grads[0].device)
            works.append(reduce_scatter_sum(out, rs_in))
            stacks.append(out)
        self._pending = dict(stacks=stacks, works=works, waited=W == 1, gathers=[])

    def _owned_grads(self):
        """Per group, the (k, rows, cols) stack of owned gradients summed over ranks."""
        if not self._pending["waited"]:
            for work in self._pending["works"]:
                work.wait()
            self._pending["waited"] = True
        return [stack[:len(self._owned(g))] for g, stack in enumerate(self._pending["stacks"])]

    def _apply(self, clip_coef):
        W = self.world_size
        scale = (1.0 if clip_coef is None else clip_coef) / W
        for g, (group, G) in enumerate(zip(self.param_groups, self._owned_grads())):
            owned = [group["params"][i] for i in self._owned(g)]
            if owned:
                if scale != 1.0:
                    G.mul_(scale)
                G = G.float()  # no-op for fp32 master weights; the momentum is fp32 in any case
                buf = self._momentum_stack(g, G)
                momentum = group["momentum"]
                buf.lerp_(G, 1 - momentum)
                G = G.lerp_(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(G, steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                                       out_dtype=owned[0].dtype)
                rows, cols = G.shape[-2:]
                step = -group["lr"] * max(1.0, rows / cols) ** 0.5
                lr_muls = [getattr(p, "lr_mul", 1.0) for p in owned]
                if all(m == 1.0 for m in lr_muls):
                    torch._foreach_add_([p.data for p in owned], list(update.unbind(0)), alpha=step)
                else:
                    for p, u, m in zip(owned, update.unbind(0), lr_muls):
                        p.data.add_(u, alpha=step * m)
            if W > 1:
                self._start_gather(g, group, owned)
        self.num_updates += 1

    def _momentum_stack(self, g, G):
        if self._momentum[g] is None:
            self._momentum[g] = torch.zeros(G.shape, dtype=torch.float32, device=G.device)
            for j, i in enumerate(self._owned(g)):
                self.state[self.param_groups[g]["params"][i]]["momentum_buffer"] = self._momentum[g][j]
        return self._momentum[g]

    def _start_gather(self, g, group, owned):
        c = self._layout[g]["capacity"]
        first = group["params"][0]
        inp = torch.zeros((c, *first.shape), dtype=first.dtype, device=first.device)
        if owned:
            torch._foreach_copy_(list(inp[:len(owned)].unbind(0)), [p.data for p in owned])
        out = torch.empty((self.world_size * c, *first.shape), dtype=first.dtype, device=first.device)
        self._pending["gathers"].append((g, all_gather(out, inp), out))

    def _gather(self):
        if self.world_size > 1:
            for g, work, out in self._pending["gathers"]:
                work.wait()
                params, sources = [], []
                c = self._layout[g]["capacity"]
                for r, rank_slots in enumerate(self._layout[g]["slots"]):
                    if r == self.rank:
                        continue
                    for j, i in enumerate(rank_slots):
                        params.append(self.param_groups[g]["params"][i].data)
                        sources.append(out[r * c + j])
                if params:
                    torch._foreach_copy_(params, sources)
        self._pending = None

    # -- state -----------------------------------------------------------------------------------

    def _state_entries(self):
        entries = {}
        for g, group in enumerate(self.param_groups):
            if self._momentum[g] is None:
                continue
            for j, i in enumerate(self._owned(g)):
                p = group["params"][i]
                entries[self.names[p]] = dict(shape=list(p.shape), offset=0, numel=p.numel(),
                                              momentum_buffer=self._momentum[g][j])
        return entries

    def _load_entries(self, pieces, saved_ranks):
        self._reset_state()
        for g, group in enumerate(self.param_groups):
            owned = self._owned(g)
            if not owned:
                continue
            first = group["params"][0]
            self._momentum_stack(g, torch.empty((len(owned), *first.shape), device=first.device))
            for j, i in enumerate(owned):
                p = group["params"][i]
                name = self.names[p]
                copy_flat_pieces(self._momentum[g][j].view(-1), 0, pieces.get(name, []), "momentum_buffer", name,
                                 p.shape, saved_ranks)


class DistMuon(Muon):
    """Muon with each matrix owned by one rank of the default torch.distributed process group."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_coefficients="quintic"):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                         ns_coefficients=ns_coefficients, _distributed=True)
