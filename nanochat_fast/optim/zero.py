"""
What AdamW and Muon share: ZeRO-2 sharding over the ranks of torch.distributed, the step protocol
(ZeroOptimizer: the phases step.py drives so several optimizers clip by one global norm), and a
state format that does not depend on the number of processes (FORMAT, shard_state_dict).

Gloo constraints this code respects (and NCCL is happy with): no Work.get_future() (waits use
work.wait()), no PREMUL_SUM/AVG (the sum is scaled afterwards), collective inputs sized exactly
world_size x output (padded where a tensor does not split evenly).
"""

import math
import numbers

import torch
import torch.distributed as dist

from ..core.distributed import all_gather_single, reduce_scatter_single

# The one world-size independent state format, saved per rank by shard_state_dict() and loaded from
# all the shards of any run by load_shard_state_dicts():
#     {"format": FORMAT, "kind": "adamw" | "muon", "world_size": N, "rank": r, "num_updates": int,
#      "param_groups": [{hyperparameters..., "param_names": [...]}],
#      "state": {param name: {"shape": [...], "offset": o, "numel": n, <state tensors>}}}
# A state tensor holds the flattened elements [offset, offset + numel) of the parameter's state
# (AdamW: the rank's slice; Muon: the whole matrix). Plain tensors, ints, floats, strings and lists
# only: loadable with torch.load(weights_only=True).
FORMAT = "nanochat_fast.optim/1"


def reduce_scatter_sum(output, input):
    """Async: output <- this rank's chunk of the sum of `input` over ranks. Returns the Work."""
    return reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, async_op=True)


def all_gather(output, input):
    """Async: output <- concatenation of every rank's `input`. Returns the Work."""
    return all_gather_single(output, input, async_op=True)


def sum_of_squares(tensors) -> torch.Tensor:
    """Sum of squares of all elements of `tensors` as a 0-D fp32 tensor, accurate to ~1e-7
    (None when they hold no elements).

    On CUDA torch's norm reductions are trees and accurate. On CPU torch.norm / _foreach_norm lose
    precision with size (how much: docs/measurements.md#cpu-norm-precision), which would make
    the clipping norm depend on how the gradient is split over ranks. There, each tensor is cut
    into rows of 256 whose dot products (bmm) are summed by torch's cascaded sum."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return None
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors)).float().square().sum()
    total = []
    for t in tensors:
        flat = t.reshape(-1).float()
        m = flat.numel() // 256 * 256
        rows = flat[:m].view(-1, 1, 256)
        tail = flat[m:]
        total.append(torch.bmm(rows, rows.mT).sum() + tail.dot(tail))
    return torch.stack(total).sum()


def check_hparam(name, value, low=0.0, high=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if value < low or (high is not None and value >= high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}), got {value!r}")


def normalize_param_groups(params) -> list[dict]:
    """params (tensors, (name, tensor) pairs, or group dicts of either) -> group dicts whose
    "params" are tensors and "param_names" their names. Unnamed parameters are called param<i>
    (their position over all groups): state is keyed by these names."""
    params = list(params)
    if not params:
        raise ValueError("params is empty: the optimizer needs at least one parameter")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out, index = [], 0
    for group in groups:
        group = dict(group)
        items = group["params"]
        items = [items] if isinstance(items, torch.Tensor) else list(items)
        tensors, names = [], []
        given = group.get("param_names")
        for i, item in enumerate(items):
            if isinstance(item, tuple):
                name, p = item
            else:
                name, p = (given[i] if given is not None else f"param{index}"), item
            tensors.append(p)
            names.append(str(name))
            index += 1
        group["params"], group["param_names"] = tensors, names
        out.append(group)
    return out


def jsonable_hparams(group: dict) -> dict:
    """The group's hyperparameters as plain Python values (tensors become floats)."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


class ZeroOptimizer(torch.optim.Optimizer):
    """Base of AdamW and Muon (and their Dist*, Fsdp* forms): world size, rank, parameter names,
    the state format, and the step protocol: a step in phases, so that optim.step (step.py) can
    run several optimizers as one, clipped by the norm of all their gradients together.

        launch_reduce()        start the async gradient reductions; each rank will receive the
                               SUM over ranks of the gradient parts it owns (each element of every
                               gradient is owned by exactly one rank)
        owned_grad_sq()        wait for them; the sum of squares (0-D fp32) of the owned part of
                               the gradient *averaged* over ranks
        apply_update(clip)     scale the owned gradients by clip (None: 1) and average them,
                               update the owned parameters and optimizer state, count the step,
                               start the all-gathers of the updated parameters
        gather_params()        wait for the all-gathers: every rank holds identical parameters
        mark_updated()         move the parameters' version counters, as an in-place update would
        discard()              instead of apply_update/gather_params/mark_updated: drop the step
                               (the NaN guard), change nothing

    Every rank calls the same phases in the same order (they hold collectives). step() runs them
    for this optimizer alone, without clipping. Subclasses implement launch_reduce, _owned_grads,
    apply_update, gather_params, _state_entries and _load_entries."""

    kind = ""
    # the Dist*/Fsdp* forms set it: rank and world size come from the default process group
    distributed = False
    # ZeRO-2 receives each gradient summed over ranks (divided by the world size at the update);
    # under FSDP (optim/fsdp.py) the gradients arrive averaged already
    grads_are_sums = True

    def __init__(self, params, defaults):
        super().__init__(normalize_param_groups(params), defaults)
        if self.distributed:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    f"{type(self).__name__} needs torch.distributed to be initialized "
                    f"(launch with torchrun and call compute_init); in a single process use "
                    f"{type(self).__name__.removeprefix('Dist')}"
                )
            self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        else:
            self.world_size, self.rank = 1, 0
        for g in self.param_groups:
            for p, name in zip(g["params"], g["param_names"]):
                if not p.is_contiguous():
                    raise ValueError(f"parameter {name!r} is not contiguous; the optimizer updates flat views of it")
        self.names = {p: name for g in self.param_groups for p, name in zip(g["params"], g["param_names"])}
        if len(set(self.names.values())) != len(self.names):
            raise ValueError("parameter names must be unique")
        self.num_updates = 0  # completed steps (AdamW's bias correction counts them)
        self._pending = None
        self._initialized = True

    @property
    def grad_divisor(self) -> int:
        """What the gradients this rank receives are divided by to be the average over ranks."""
        return self.world_size if self.grads_are_sums else 1

    def add_param_group(self, param_group):
        if getattr(self, "_initialized", False):
            raise RuntimeError(
                f"{type(self).__name__} shards its parameters at construction: "
                "create a new optimizer instead of adding a param group"
            )
        super().add_param_group(param_group)

    def _grad(self, p):
        if p.grad is None:
            raise ValueError(
                f"parameter {self.names[p]!r} has no gradient: call backward() before step(); "
                "every parameter given to the optimizer must receive a gradient"
            )
        return p.grad

    def _device(self):
        return self.param_groups[0]["params"][0].device

    # -- one optimizer on its own: no clipping ------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.launch_reduce()
        self.apply_update(None)
        self.gather_params()
        self.mark_updated()
        return loss

    # -- the step protocol (the class docstring) -------------------------------------------------

    def launch_reduce(self):
        raise NotImplementedError

    def _owned_grads(self) -> list[torch.Tensor]:
        """Wait for the reductions; this rank's owned gradients, summed over ranks."""
        raise NotImplementedError

    def owned_grad_sq(self) -> torch.Tensor:
        total = sum_of_squares(self._owned_grads())
        if total is None:
            return torch.zeros((), dtype=torch.float32, device=self._device())
        return total / (self.grad_divisor**2)  # of the average over ranks

    def apply_update(self, clip_coef: float | None):
        raise NotImplementedError

    def gather_params(self):
        raise NotImplementedError

    def mark_updated(self):
        """After gather_params: tell autograd the parameters changed in place. The updates write
        through p.data and the kernels, which leave a parameter's version counter where it was
        (torch.optim's in-place updates move it); what caches a function of the weights reads that
        counter (model/packed_linears.py)."""
        for group in self.param_groups:
            for p in group["params"]:
                torch.autograd.graph.increment_version(p)

    def discard(self):
        """Drop a step whose gradient was not finite: wait for the collectives in flight (every
        rank must take part in them), change nothing."""
        if self._pending is not None:
            for work in self._pending.get("works", []):
                work.wait()
        self._pending = None

    # -- state -----------------------------------------------------------------------------------

    def state_nbytes(self) -> int:
        """Bytes of optimizer state held by this rank."""
        return sum(
            t.numel() * t.element_size() for s in self.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        )

    def _state_entries(self) -> dict:
        """{name: {"shape", "offset", "numel", <tensors>}} for the state this rank owns."""
        raise NotImplementedError

    def _load_entries(self, pieces: dict, saved_ranks: list):
        """pieces: {name: [entries from every shard]}; fill the state this rank owns (saved_ranks
        only goes into error messages)."""
        raise NotImplementedError

    def shard_state_dict(self) -> dict:
        """This rank's optimizer state in the world-size independent format (FORMAT)."""
        return {
            "format": FORMAT,
            "kind": self.kind,
            "world_size": self.world_size,
            "rank": self.rank,
            "num_updates": self.num_updates,
            "param_groups": [jsonable_hparams(g) for g in self.param_groups],
            "state": {
                name: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
                for name, entry in self._state_entries().items()
            },
        }

    def load_shard_state_dicts(self, shards):
        """Load the state saved by every rank of a run (any number of ranks, in any order): each
        rank keeps what it owns under its own sharding."""
        if isinstance(shards, dict):
            shards = [shards]
        shards = list(shards)
        if not shards:
            raise ValueError("shards is empty: pass the state dicts saved by every rank")
        for s in shards:
            if not isinstance(s, dict) or s.get("format") != FORMAT:
                raise ValueError(
                    f"not an optimizer shard of format {FORMAT!r} (got {type(s).__name__} "
                    f"with format {s.get('format') if isinstance(s, dict) else None!r})"
                )
            if s["kind"] != self.kind:
                raise ValueError(f"optimizer shard is for {s['kind']!r}, this optimizer is {self.kind!r}")
        counts = {s["num_updates"] for s in shards}
        if len(counts) != 1:
            raise ValueError(
                f"optimizer shards come from different steps (num_updates {sorted(counts)}): "
                "load the files of one checkpoint"
            )
        saved_ranks = sorted(s["rank"] for s in shards)
        num_updates = counts.pop()
        # hyperparameters (lr, momentum, ...) follow the saved groups, matched by parameter name
        saved_groups = {}
        for g in shards[0]["param_groups"]:
            for name in g["param_names"]:
                saved_groups[name] = g
        for group in self.param_groups:
            saved = saved_groups.get(group["param_names"][0])
            if saved is None:
                raise ValueError(
                    f"optimizer shards have no parameter named {group['param_names'][0]!r}: "
                    "they were saved for a different model"
                )
            for key, value in saved.items():
                if key not in ("param_names", "params") and key in group:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
        pieces = {}
        for s in shards:
            for name, entry in s["state"].items():
                pieces.setdefault(name, []).append(entry)
        unknown = set(pieces) - set(self.names.values())
        if unknown:
            raise ValueError(
                f"optimizer shards hold state for parameters this optimizer does not have: {sorted(unknown)[:3]}"
            )
        if num_updates > 0:
            self._load_entries(pieces, saved_ranks)
        else:
            self.state.clear()
            self._reset_state()
        self.num_updates = num_updates

    def _reset_state(self):
        pass

    # torch.optim.Optimizer's names: this rank's shard, and loading one shard or a list of them
    def state_dict(self):
        return self.shard_state_dict()

    def load_state_dict(self, state_dict):
        self.load_shard_state_dicts(state_dict)


def copy_flat_pieces(dst: torch.Tensor, lo: int, entries: list, key: str, name: str, shape, saved_ranks):
    """Fill dst (the flat elements [lo, lo + dst.numel()) of the state `key` of parameter `name` of
    `shape`) from saved pieces covering any ranges; every element must be covered."""
    for entry in entries:
        if list(entry["shape"]) != list(shape):
            raise ValueError(f"optimizer state of {name!r} has shape {entry['shape']}, the parameter {list(shape)}")
    hi = lo + dst.numel()
    covered = torch.zeros(dst.numel(), dtype=torch.bool)
    for entry in entries:
        a, n = entry["offset"], entry["numel"]
        s, e = max(a, lo), min(a + n, hi)
        if s < e:
            dst[s - lo : e - lo].copy_(entry[key].reshape(-1)[s - a : e - a])
            covered[s - lo : e - lo] = True
    if not bool(covered.all()):
        missing = int((~covered).sum())
        raise ValueError(
            f"optimizer state {key!r} of {name!r} misses {missing} of elements [{lo}, {hi}) in the "
            f"shards given (ranks {saved_ranks}): load every optim_rank*.pt file of the checkpoint"
        )
