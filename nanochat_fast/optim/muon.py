"""
Muon (MomentUm Orthogonalized by Newton-Schulz) for the 2-D matrices of the transformer blocks, in
one process (Muon) or with each matrix owned by one rank (DistMuon, the same code).

Per matrix (each step optional unless marked; MuonRecipe in recipe.py names the sets):
    buf = lerp(buf, g, 1 - momentum); g = lerp(g, buf, momentum) (Nesterov) or buf
    g = g * (||g||_F / sqrt(rows)) / ||row of g||                    (equilibrate_rows: MuonEq)
    u = NewtonSchulz(g), computed in ns_dtype                         (always)
    u = u * sqrt(min(rows, cols)) / ||u||_F                          (renormalize: Muon+)
    v = lerp(v, mean(u^2 over the short side), 1 - normuon_beta)      (NorMuon: one v per row, per
    u = u / sqrt(v), rescaled to keep ||u||_F                          column for wide matrices)
    lr' = lr * lr_mul * max(1, rows/cols)^0.5
    p -= lr' * weight_decay * wd_mul * p   (only where u * p >= 0 with cautious_weight_decay)
    p -= lr' * u
The gradient and the momentum (and v) are fp32 whatever ns_dtype is; u is applied in the
parameter's dtype. Matrices of one shape are stacked: one batched newton_schulz call per shape.
"""

import torch

from ..hardware import tuning
from ..hardware.precision import CHOICES, DTYPES, Precision, choose
from ..kernels.newton_schulz import newton_schulz, resolve_coefficients
from .recipe import MuonRecipe
from .zero import ZeroOptimizer, all_gather, check_hparam, copy_flat_pieces, normalize_param_groups, reduce_scatter_sum


def assign_owners(group_shapes: list[tuple[int, int]], group_sizes: list[int], world_size: int) -> list[list[int]]:
    """For each group (K matrices of one shape), the rank that owns each matrix: it receives their
    summed gradients, keeps their momentum (1/W of the state) and computes their updates.
    Balanced by bytes over all groups (largest matrices first, the least loaded rank takes the
    next matrix, at most c = ceil(K/W) of a group per rank), so any group size and any world size
    work. Deterministic, so every rank computes the same table."""
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


def equilibrate_rows(G: torch.Tensor) -> torch.Tensor:
    """MuonEq: each row of each (rows, cols) matrix of the stack rescaled to the matrix's mean row
    norm ||G||_F / sqrt(rows). A new tensor."""
    target = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True) / G.size(-2) ** 0.5
    return G * (target / torch.linalg.vector_norm(G, dim=-1, keepdim=True).clamp_min(1e-6))


def renormalize_(U: torch.Tensor) -> torch.Tensor:
    """Muon+: each matrix of the stack scaled in place to Frobenius norm sqrt(min(rows, cols))."""
    norm = torch.linalg.vector_norm(U, dim=(-2, -1), keepdim=True).clamp_min(1e-6)
    return U.mul_(min(U.shape[-2:]) ** 0.5 / norm)


def normuon_(U: torch.Tensor, second_moment: torch.Tensor, beta: float) -> torch.Tensor:
    """NorMuon on a (k, rows, cols) stack U, in place: second_moment ((k, rows, 1), or (k, 1, cols)
    for wide matrices) <- lerp(., mean of U^2 over the short side, 1 - beta); U <- U / sqrt of it,
    rescaled so each matrix keeps its Frobenius norm (so the EMA needs no bias correction)."""
    short_side = -1 if U.size(-2) >= U.size(-1) else -2
    second_moment.lerp_(U.square().mean(dim=short_side, keepdim=True), 1 - beta)
    norm = torch.linalg.vector_norm(U, dim=(-2, -1), keepdim=True)
    U.mul_(second_moment.clamp_min(1e-10).rsqrt())
    return U.mul_(norm / torch.linalg.vector_norm(U, dim=(-2, -1), keepdim=True).clamp_min(1e-10))


def second_moment_shape(shape) -> tuple[int, int]:
    rows, cols = shape
    return (rows, 1) if rows >= cols else (1, cols)


def newton_schulz_work(shapes, steps: int, coefficients, device, run_steps: int | None = None) -> tuning.Work:
    """Newton-Schulz on stacks of (k, rows, cols) matrices in fp32 and in bf16, through the path
    each takes, for hardware/tuning.py to time."""
    device = torch.device(device)

    def make():
        gen = torch.Generator().manual_seed(0)
        stacks = [torch.randn(*shape, generator=gen).to(device) for shape in shapes]

        def call(dtype):
            return lambda: [newton_schulz(G, steps, coefficients, out_dtype=torch.float32, dtype=dtype) for G in stacks]

        return {name: call(dtype) for name, dtype in DTYPES.items()}

    sides = [(k, min(r, c), max(r, c)) for k, r, c in shapes]
    return tuning.Work(
        "newton_schulz",
        dict(shapes=[list(s) for s in shapes], steps=steps, coefficients=coefficients),
        what=f"Newton-Schulz on Muon's matrices ({', '.join('x'.join(map(str, s)) for s in shapes)})",
        flops=sum(k * steps * (4 * m * m * n + 2 * m**3) for k, m, n in sides),  # the plain path's count
        make=make,
        matmuls=sorted({(m, n, m) for _, m, n in sides}, key=lambda s: -s[0] * s[1])[:2],
        run_calls=run_steps,
    )


tuning.register(
    "newton_schulz",
    lambda spec, device: newton_schulz_work(
        [tuple(s) for s in spec["shapes"]], spec["steps"], spec["coefficients"], device
    ),
)


def apply_updates(group: dict, params: list, tensors: list, updates, lr: float):
    """tensors[i] (params[i]'s data, or the part of it this rank holds) -= lr' * updates[i], after
    the group's (cautious) weight decay; lr' = lr times the parameter's lr_mul. Elementwise, so a
    shard of a matrix is updated exactly as the same rows of the whole matrix would be."""
    wd = group["weight_decay"]
    lr_muls = [getattr(p, "lr_mul", 1.0) for p in params]
    if not tensors:
        return
    if wd == 0 and all(m == 1.0 for m in lr_muls):
        torch._foreach_add_(list(tensors), [u.to(t.dtype) for t, u in zip(tensors, updates)], alpha=-lr)
        return
    for param, p, u, lr_mul in zip(params, tensors, updates, lr_muls):
        u = u.to(p.dtype)
        decay = lr * lr_mul * wd * getattr(param, "wd_mul", 1.0)
        if decay and group["cautious_weight_decay"]:
            p.sub_(p * ((u * p) >= 0), alpha=decay)  # only where the step moves p towards 0
        elif decay:
            p.mul_(1 - decay)
        p.add_(u, alpha=-lr * lr_mul)


class Muon(ZeroOptimizer):
    """Muon in one process. Params: 2-D tensors (or (name, tensor) pairs); they are regrouped by
    shape, each group keeping the hyperparameters (lr, momentum, nesterov, ns_steps, ns_coefficients,
    ns_dtype, weight_decay, cautious_weight_decay, normuon_beta (None: off), equilibrate_rows,
    renormalize). `recipe` (a MuonRecipe, set by GPT.setup_optimizers) drives `schedule`."""

    kind = "muon"

    def __init__(
        self,
        params,
        lr=0.02,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        ns_coefficients="quintic",
        ns_dtype="auto",
        weight_decay=0.0,
        cautious_weight_decay=False,
        normuon_beta=None,
        equilibrate_rows=False,
        renormalize=False,
        ns_safety=1.0,
        ns_eps=1e-7,
    ):
        check_hparam("lr", lr)
        check_hparam("ns_safety", ns_safety, 1.0)
        check_hparam("ns_eps", ns_eps)
        check_hparam("momentum", momentum, 0.0, 1.0)
        check_hparam("weight_decay", weight_decay)
        if normuon_beta is not None:
            check_hparam("normuon_beta", normuon_beta, 0.0, 1.0)
        if ns_dtype not in CHOICES:
            raise ValueError(f"ns_dtype must be one of {', '.join(CHOICES)}, got {ns_dtype!r}")
        resolve_coefficients(ns_coefficients, ns_steps)  # ValueError on a bad choice
        if not isinstance(ns_coefficients, str):
            ns_coefficients = [list(map(float, abc)) for abc in ns_coefficients]
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=bool(nesterov),
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_dtype=ns_dtype,
            weight_decay=weight_decay,
            cautious_weight_decay=bool(cautious_weight_decay),
            normuon_beta=normuon_beta,
            equilibrate_rows=bool(equilibrate_rows),
            renormalize=bool(renormalize),
            ns_safety=float(ns_safety),
            ns_eps=float(ns_eps),
        )
        super().__init__(self._group_by_shape(params), defaults)
        self.recipe = None
        shapes = [tuple(g["params"][0].shape) for g in self.param_groups]
        sizes = [len(g["params"]) for g in self.param_groups]
        owners = self._assign_owners(shapes, sizes)
        # per group: capacity c, and for every rank the indices (into the group) of the matrices it owns
        self._layout = []
        for g, group_owners in enumerate(owners):
            slots = [[i for i, o in enumerate(group_owners) if o == r] for r in range(self.world_size)]
            self._layout.append(dict(capacity=max(len(s) for s in slots), slots=slots))
        self._reset_state()
        # the dtype Newton-Schulz computes in: an explicit one now (with its one warning line where
        # bf16 is emulated); "auto" at the first step, or when the run calls resolve_ns_precision
        self._ns_precision = None if ns_dtype == "auto" else self.resolve_ns_precision()

    def _assign_owners(self, shapes, sizes) -> list[list[int]]:
        return assign_owners(shapes, sizes, self.world_size)

    @property
    def ns_precision(self) -> Precision:
        if self._ns_precision is None:
            self.resolve_ns_precision()
        return self._ns_precision

    def resolve_ns_precision(self, run_steps: int | None = None, warn: bool = True) -> Precision:
        """Decide ns_dtype "auto" for this optimizer (hardware/precision.py): on a CPU by timing
        Newton-Schulz on its own matrix stacks in fp32 and bf16 (hardware/tuning.py; run_steps, the
        optimizer steps the run will take, bounds the time spent); the same decision on every rank.
        Distributed, every rank calls this together."""
        device, requested = self._device(), self.defaults["ns_dtype"]
        timing = None
        if device.type == "cpu" and requested == "auto":
            groups = self.param_groups
            shapes = [(self._layout[g]["capacity"], *group["params"][0].shape) for g, group in enumerate(groups)]
            work = newton_schulz_work(shapes, groups[0]["ns_steps"], groups[0]["ns_coefficients"], device, run_steps)
            timing = tuning.measure_everywhere(work, device)
        self._ns_precision = choose(device, requested, what="--ns-dtype", warn=warn, timing=timing)
        return self._ns_precision

    def schedule(self, step: int, num_iterations: int | None) -> float:
        """Set every group's momentum (and, with a recipe, its weight decay) for `step` from the
        recipe (the seeds' momentum warmup without one); returns the momentum."""
        recipe = self.recipe or MuonRecipe()
        momentum = recipe.momentum_at(step, num_iterations)
        for group in self.param_groups:
            group["momentum"] = momentum
            if self.recipe is not None:
                group["weight_decay"] = recipe.weight_decay_at(step, num_iterations)
        return momentum

    @staticmethod
    def _group_by_shape(params):
        groups = []
        for group in normalize_param_groups(params):
            by_shape = {}
            for p, name in zip(group["params"], group["param_names"]):
                if p.dim() != 2:
                    raise ValueError(
                        f"Muon optimizes 2-D matrices; {name!r} has shape {tuple(p.shape)} "
                        "(give vectors and embeddings to AdamW)"
                    )
                by_shape.setdefault(tuple(p.shape), []).append((name, p))
            for items in by_shape.values():
                groups.append({**group, "params": [p for _, p in items], "param_names": [n for n, _ in items]})
        return groups

    def _reset_state(self):
        # momentum (and NorMuon's second moment) of the owned matrices, one stack per group;
        # state[p] holds views
        self._momentum = [None] * len(self.param_groups)
        self._second_moment = [None] * len(self.param_groups)
        self.state.clear()

    def _owned(self, g):
        return self._layout[g]["slots"][self.rank]

    # -- the step protocol (zero.py) -------------------------------------------------------------

    def launch_reduce(self):
        """Per group, reduce-scatter the gradients stacked as (W, c, rows, cols), rank r's c slots
        holding the matrices it owns (zero padding where it owns fewer): each rank receives the
        summed gradients of exactly its own matrices."""
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
            rs_in = torch.stack(
                [
                    grads[rank_slots[j]] if j < len(rank_slots) else zero
                    for rank_slots in layout["slots"]
                    for j in range(c)
                ]
            )
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
        return [stack[: len(self._owned(g))] for g, stack in enumerate(self._pending["stacks"])]

    def apply_update(self, clip_coef):
        self.ns_precision  # noqa: B018  (resolved on every rank together, before any rank's update)
        W = self.world_size
        scale = (1.0 if clip_coef is None else clip_coef) / self.grad_divisor
        for g, (group, G) in enumerate(zip(self.param_groups, self._owned_grads())):
            owned = [group["params"][i] for i in self._owned(g)]
            if owned:
                if scale != 1.0:
                    G.mul_(scale)
                self._update(g, group, owned, G.float())  # fp32 momentum whatever the params' dtype
            if W > 1:
                self._start_gather(g, group, owned)
        self.num_updates += 1

    def _update(self, g, group, owned, G):
        U, lr = self._direction(g, group, G)
        apply_updates(group, owned, [p.data for p in owned], U.unbind(0), lr)

    def _direction(self, g, group, G):
        """(U, lr): the orthogonalised fp32 updates of group g's owned matrices G (k, rows, cols),
        momentum and NorMuon state advanced, and the learning rate their shape gets."""
        buf = self._momentum_stack(g, G)
        momentum = group["momentum"]
        buf.lerp_(G, 1 - momentum)
        G = G.lerp_(buf, momentum) if group["nesterov"] else buf
        if group["equilibrate_rows"]:
            G = equilibrate_rows(G)
        dtype = self.ns_precision.dtype if group["ns_dtype"] == "auto" else DTYPES[group["ns_dtype"]]
        U = newton_schulz(
            G,
            steps=group["ns_steps"],
            coefficients=group["ns_coefficients"],
            dtype=dtype,
            out_dtype=torch.float32,
            safety=group.get("ns_safety", 1.0),
            eps=group.get("ns_eps", 1e-7),
        )
        if group["renormalize"]:
            renormalize_(U)
        if group["normuon_beta"] is not None:
            normuon_(U, self._second_moment_stack(g, U.shape, U.device), group["normuon_beta"])
        rows, cols = G.shape[-2:]
        return U, group["lr"] * max(1.0, rows / cols) ** 0.5

    def _momentum_stack(self, g, G):
        return self._state_stack(g, self._momentum, "momentum_buffer", G.shape, G.device)

    def _second_moment_stack(self, g, stack_shape, device):
        shape = (stack_shape[0], *second_moment_shape(stack_shape[-2:]))
        return self._state_stack(g, self._second_moment, "normuon_second_moment", shape, device)

    def _state_stack(self, g, stacks, key, shape, device):
        """Group g's (k, ...) fp32 stack of state `key` for the k owned matrices, created as zeros;
        state[p][key] holds views of it."""
        if stacks[g] is None:
            stacks[g] = torch.zeros(shape, dtype=torch.float32, device=device)
            for j, i in enumerate(self._owned(g)):
                self.state[self.param_groups[g]["params"][i]][key] = stacks[g][j]
        return stacks[g]

    def _start_gather(self, g, group, owned):
        c = self._layout[g]["capacity"]
        first = group["params"][0]
        inp = torch.zeros((c, *first.shape), dtype=first.dtype, device=first.device)
        if owned:
            torch._foreach_copy_(list(inp[: len(owned)].unbind(0)), [p.data for p in owned])
        out = torch.empty((self.world_size * c, *first.shape), dtype=first.dtype, device=first.device)
        self._pending["gathers"].append((g, all_gather(out, inp), out))

    def gather_params(self):
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
                entry = dict(shape=list(p.shape), offset=0, numel=p.numel(), momentum_buffer=self._momentum[g][j])
                if self._second_moment[g] is not None:
                    entry["normuon_second_moment"] = self._second_moment[g][j]
                entries[self.names[p]] = entry
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
                entries = pieces.get(name, [])
                copy_flat_pieces(
                    self._momentum[g][j].view(-1), 0, entries, "momentum_buffer", name, p.shape, saved_ranks
                )
                # a matrix's state is saved whole by the rank that owned it: no pieces to stitch
                saved = [e["normuon_second_moment"] for e in entries if "normuon_second_moment" in e]
                if saved:
                    stack = self._second_moment_stack(g, (len(owned), *first.shape), first.device)
                    stack[j].copy_(saved[0].reshape(second_moment_shape(p.shape)))


class DistMuon(Muon):
    """Muon with each matrix owned by one rank of the default torch.distributed process group
    (Muon's arguments)."""

    distributed = True
