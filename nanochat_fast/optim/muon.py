"""
Muon (MomentUm Orthogonalized by Newton-Schulz) for the 2-D matrices of the transformer blocks, in one
process (Muon) or with each matrix owned by one rank (DistMuon, the same code): momentum, then the
recipe's MuonEq, Newton-Schulz in ns_dtype, Muon+, NorMuon and (cautious) weight decay (_direction,
apply_updates). Gradients, momentum and NorMuon's state are fp32 whatever ns_dtype is. Matrices of
one shape are stacked: one batched newton_schulz call per shape.
"""

import torch

from ..hardware import precision
from ..kernels.newton_schulz import newton_schulz, resolve_coefficients
from .recipe import MuonRecipe
from .zero import Bucket, ZeroOptimizer, check_choice, check_hparam, normalize_param_groups


def assign_owners(shapes: list, sizes: list[int], world_size: int, cost=lambda m, n: m * n, even=True) -> list:
    """For each group (sizes[g] matrices of shapes[g]), the rank that owns each matrix (its gradient,
    momentum and update): largest cost first, each to the least loaded rank; even: at most ceil(K/W) of
    a group of K per rank (a bucket pads every rank to the most). The same table on every rank."""
    load = [0] * world_size
    owners = [[0] * k for k in sizes]
    for g in sorted(range(len(shapes)), key=lambda g: -cost(*shapes[g])):
        capacity = -(-sizes[g] // world_size) if even else sizes[g]
        taken = [0] * world_size
        for i in range(sizes[g]):
            r = min((r for r in range(world_size) if taken[r] < capacity), key=lambda r: (load[r], r))
            owners[g][i] = r
            taken[r] += 1
            load[r] += cost(*shapes[g])
    return owners


def normuon_(U: torch.Tensor, second_moment: torch.Tensor, beta: float, frobenius: float | None = None) -> torch.Tensor:
    """NorMuon on a (k, rows, cols) stack U, in place: second_moment ((k, rows, 1), or (k, 1, cols)
    for wide matrices) <- lerp(., mean of U^2 over the short side, 1 - beta); U <- U / sqrt of it,
    rescaled so each matrix keeps its Frobenius norm (so the EMA needs no bias correction).
    frobenius: Muon+ first (each matrix scaled to this Frobenius norm), as if U had been scaled."""
    short_side = -1 if U.size(-2) >= U.size(-1) else -2
    # U is read twice, once for its squares summed over the short side and once to scale it: every norm
    # below is a sum of those sums (a pass over a stack of tens of MB costs what the small math does not)
    sums = torch.linalg.vector_norm(U, dim=short_side, keepdim=True).square_()
    total = sums.sum(dim=(-2, -1), keepdim=True)  # ||U||_F^2
    pre = 1.0 if frobenius is None else frobenius**2 / total.clamp_min(1e-12)  # Muon+: U scaled by pre^0.5
    second_moment.lerp_(sums * (pre / U.size(short_side)), 1 - beta)
    inv_rms = second_moment.clamp_min(1e-10).rsqrt()
    scaled = (sums * inv_rms.square()).sum(dim=(-2, -1), keepdim=True)  # ||U / rms||_F^2
    return U.mul_(inv_rms * (total / scaled.clamp_min(1e-20)).sqrt() * pre**0.5)


def second_moment_shape(shape) -> tuple[int, int]:
    rows, cols = shape
    return (rows, 1) if rows >= cols else (1, cols)


def newton_schulz_work(shapes, steps: int, coefficients, device, run_steps: int | None = None) -> precision.Work:
    """Newton-Schulz on stacks of (k, rows, cols) matrices: what precision.choose times for --ns-dtype."""
    device = torch.device(device)

    def make():
        gen = torch.Generator().manual_seed(0)
        stacks = [torch.randn(*shape, generator=gen).to(device) for shape in shapes]

        def call(dtype):
            return lambda: [newton_schulz(G, steps, coefficients, out_dtype=torch.float32, dtype=dtype) for G in stacks]

        return {name: call(dtype) for name, dtype in precision.DTYPES.items()}

    sides = [(k, min(r, c), max(r, c)) for k, r, c in shapes]
    return precision.Work(
        "newton_schulz",
        dict(shapes=[list(s) for s in shapes], steps=steps, coefficients=coefficients),
        what=f"Newton-Schulz on Muon's matrices ({', '.join('x'.join(map(str, s)) for s in shapes)})",
        flops=sum(k * steps * (4 * m * m * n + 2 * m**3) for k, m, n in sides),  # the plain path's count
        make=make,
        matmuls=sorted({(m, n, m) for _, m, n in sides}, key=lambda s: -s[0] * s[1])[:2],
        run_calls=run_steps,
    )


precision.register("newton_schulz", lambda spec, device: newton_schulz_work(**spec, device=device))


def apply_updates(group: dict, params: list, tensors: list, updates):
    """tensors[i] (params[i]'s data, or the part of it this rank holds) -= lr' * updates[i] after the
    group's (cautious) weight decay; lr' = lr * lr_mul * max(1, rows/cols)^0.5. Elementwise, so a
    shard of a matrix is updated exactly as the same rows of the whole matrix would be."""
    rows, cols = group["params"][0].shape
    lr, wd = group["lr"] * max(1.0, rows / cols) ** 0.5, group["weight_decay"]
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
    """Muon in one process on 2-D tensors (or (name, tensor) pairs), regrouped by shape (normuon_beta
    None: NorMuon off). `recipe` (a MuonRecipe, set by GPT.setup_optimizers) drives `schedule`."""

    kind = "muon"
    state_keys = ("momentum_buffer",)
    owner_rule = staticmethod(assign_owners)  # which rank owns each matrix

    def __init__(
        self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_coefficients="quintic", ns_dtype="auto",
        weight_decay=0.0, cautious_weight_decay=False, normuon_beta=None, equilibrate_rows=False, renormalize=False,
        ns_safety=1.0, ns_eps=1e-7,
    ):  # fmt: skip
        check_hparam("lr", lr)
        check_hparam("ns_safety", ns_safety, 1.0)
        check_hparam("ns_eps", ns_eps)
        check_hparam("momentum", momentum, 0.0, 1.0)
        check_hparam("weight_decay", weight_decay)
        if normuon_beta is not None:
            check_hparam("normuon_beta", normuon_beta, 0.0, 1.0)
        check_choice("ns_dtype", ns_dtype, precision.CHOICES)
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
        owners = self.owner_rule(shapes, [len(g["params"]) for g in self.param_groups], self.world_size)
        # one bucket per shape: rank r's chunk holds the whole matrices it owns, zero-padded to as
        # many as the rank owning most
        for group, group_owners in zip(self.param_groups, owners):
            ps, n = group["params"], group["params"][0].numel()
            slots = [[(p, 0, n) for p, o in zip(ps, group_owners) if o == r] for r in range(self.world_size)]
            self.buckets.append(Bucket(max(map(len, slots)) * n, slots))
        self._stacks = {}  # (group, state key) -> the fp32 stack over the owned matrices
        # the dtype Newton-Schulz computes in: an explicit one now (with its one warning line where
        # bf16 is emulated); "auto" at the first step, or when the run calls resolve_ns_precision
        self.ns_precision = None if ns_dtype == "auto" else self.resolve_ns_precision()

    def resolve_ns_precision(self, run_steps: int | None = None, warn: bool = True) -> precision.Precision:
        """ns_dtype from precision.choose, timing Newton-Schulz on this optimizer's own stacks (within
        a share of the run's run_steps optimizer steps). Distributed, every rank calls this together."""
        groups = self.param_groups
        shapes = [(b.chunk // b.first.numel(), *b.first.shape) for b in self.buckets]
        device = self.params[0].device
        work = newton_schulz_work(shapes, groups[0]["ns_steps"], groups[0]["ns_coefficients"], device, run_steps)
        self.ns_precision = precision.choose(device, self.defaults["ns_dtype"], what="--ns-dtype", warn=warn, work=work)
        return self.ns_precision

    def schedule(self, step: int, num_iterations: int | None) -> float:
        """Set every group's momentum (and, with a recipe, its weight decay) for `step` from the
        recipe (the quintic recipe's momentum warmup without one); returns the momentum."""
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

    def update(self, chunks, scale):
        if self.ns_precision is None:  # resolved on every rank together, before any rank's update
            self.resolve_ns_precision()
        for g, (group, b, chunk) in enumerate(zip(self.param_groups, self.buckets, chunks)):
            owned = self.owned(b)
            if owned:
                G = chunk[: len(owned) * b.first.numel()].view(len(owned), *b.first.shape)
                if scale != 1.0:
                    G.mul_(scale)
                U = self._direction(g, group, G.float())  # fp32 momentum whatever the params' dtype
                apply_updates(group, owned, [p.data for p in owned], U.unbind(0))
            self.gather(b)
        self.num_updates += 1

    def _direction(self, g, group, G):
        """The orthogonalised fp32 updates of group g's owned matrices G (k, rows, cols), with their
        momentum (and NorMuon's second moment) advanced."""
        buf = self._state_stack(g, "momentum_buffer", G.shape, G.device)
        momentum = group["momentum"]
        buf.lerp_(G, 1 - momentum)
        G = G.lerp_(buf, momentum) if group["nesterov"] else buf
        if group["equilibrate_rows"]:  # MuonEq: each row rescaled to its matrix's mean row norm
            row_norms = torch.linalg.vector_norm(G, dim=-1, keepdim=True)
            target = row_norms.square().mean(dim=-2, keepdim=True).sqrt()  # ||G||_F / rows^0.5
            scale = target / row_norms.clamp_min(1e-6)
            G = G * scale if G is buf else G.mul_(scale)  # the momentum stays as it is
        dtype = self.ns_precision.dtype if group["ns_dtype"] == "auto" else precision.DTYPES[group["ns_dtype"]]
        steps, coefficients, safety, eps = (group[k] for k in ("ns_steps", "ns_coefficients", "ns_safety", "ns_eps"))
        # into G when G is this step's own fp32 stack (not the momentum): no new one each step
        out = G if G is not buf else None
        U = newton_schulz(G, steps, coefficients, dtype=dtype, out_dtype=torch.float32, safety=safety, eps=eps, out=out)
        # Muon+: each matrix scaled to Frobenius norm sqrt(min(rows, cols)); with NorMuon, inside its pass
        frobenius = min(U.shape[-2:]) ** 0.5 if group["renormalize"] else None
        if group["normuon_beta"] is not None:
            shape = (len(U), *second_moment_shape(U.shape[-2:]))
            state = self._state_stack(g, "normuon_second_moment", shape, U.device)
            normuon_(U, state, group["normuon_beta"], frobenius)
        elif frobenius is not None:
            U.mul_(frobenius / torch.linalg.vector_norm(U, dim=(-2, -1), keepdim=True).clamp_min(1e-6))
        return U

    def _state_stack(self, g, key, shape, device):
        """Group g's fp32 stack of state `key` over its owned matrices: the loaded ones, else zeros;
        state[p][key] holds views of it."""
        if (g, key) not in self._stacks:
            stack = torch.zeros(shape, dtype=torch.float32, device=device)
            for p, view in zip(self.owned(self.buckets[g]), stack):
                if key in self.state[p]:
                    view.copy_(self.state[p][key])
                self.state[p][key] = view
            self._stacks[g, key] = stack
        return self._stacks[g, key]

    def load_shard_state_dicts(self, shards):
        self._stacks = {}  # rebuilt from the loaded state at the next update
        super().load_shard_state_dicts(shards)

    def _load_state(self, pieces, saved_ranks):
        super()._load_state(pieces, saved_ranks)
        for p, state in self.state.items():
            state["momentum_buffer"] = state["momentum_buffer"].view(p.shape)
            # a matrix's second moment is saved whole, by the rank that owned it
            saved = [e["normuon_second_moment"] for e in pieces.get(self.names[p], []) if "normuon_second_moment" in e]
            if saved:
                state["normuon_second_moment"] = saved[0].reshape(second_moment_shape(p.shape)).to(p.device)


class DistMuon(Muon):
    """Muon with each matrix owned by one rank of the default torch.distributed process group."""

    distributed = True
