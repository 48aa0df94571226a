"""
The optimizer step of nanochat_fast: `step(optimizers, grad_clip)` updates several optimizers as one
(reduce, global norm, clip, update, gather), ZeRO-2 sharding over the ranks of torch.distributed, and
the state format that does not depend on the number of processes (FORMAT). Gloo's limits hold (NCCL
is happy with them): waits use work.wait() (no get_future), sums are scaled afterwards (no
PREMUL_SUM/AVG), a collective's input is exactly world_size x its output (padded where needed).
"""

import math
import numbers
from typing import NamedTuple

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


@torch.no_grad()
def step(optimizers, grad_clip: float | None = None) -> torch.Tensor:
    """Update with every optimizer in `optimizers` (e.g. [adamw, muon]), clipped together by the norm
    of their gradient averaged over ranks; returns that norm before clipping (0-D fp32). grad_clip
    None or 0: no clipping. A non-finite norm applies nothing: the caller decides (the NaN guard)."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip >= 0):
        raise ValueError(f"grad_clip must be a number >= 0 (0 or None: no clipping), got {grad_clip!r}")
    # 1. reduce: every reduction in flight at once; then each rank holds, summed over ranks, the parts
    #    of the gradient it owns (each element of every gradient is owned by exactly one rank)
    waits = [opt.reduce_grads() for opt in optimizers]
    grads = [wait() for wait in waits]
    # 2. the global norm, with no extra pass over full gradients: each rank's sum of squares of its
    #    parts, gathered and added in rank order, so every rank gets the same bits
    local = torch.stack([opt.grad_sq(g) for opt, g in zip(optimizers, grads)]).sum()
    world_size = max(opt.world_size for opt in optimizers)
    if world_size > 1:
        gathered = torch.empty(world_size, dtype=local.dtype, device=local.device)
        all_gather_single(gathered, local.reshape(1), async_op=True).wait()
        local = gathered.sum()
    norm = local.sqrt()
    value = norm.item()  # the host waits for the reductions here, once per step
    if not math.isfinite(value):
        return norm  # no parameter, state or step count changed
    # 3. clip, as torch.nn.utils.clip_grad_norm_ does
    clip = min(1.0, grad_clip / (value + 1e-6)) if grad_clip else 1.0
    # 4. update the owned parts; each bucket's all-gather starts once it is updated, so the gathers
    #    of one bucket overlap the updates of the next
    for opt, g in zip(optimizers, grads):
        opt.update(g, clip / opt.grad_divisor)
    # 5. gather: every rank holds the same parameters again
    for opt in optimizers:
        opt.finish_gathers()
        opt.mark_updated()
    return norm


def sum_of_squares(tensors, device) -> torch.Tensor:
    """Sum of squares of all elements as a 0-D fp32 tensor. On a CPU, rows of 256 summed by bmm: torch.norm
    loses precision with size, which would make the norm depend on how the gradient is split over ranks
    (docs/measurements.md#cpu-norm-precision)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors)).float().square().sum()
    total = []
    for t in tensors:
        flat = t.reshape(-1).float()
        m = flat.numel() // 256 * 256
        rows, tail = flat[:m].view(-1, 1, 256), flat[m:]
        total.append(torch.bmm(rows, rows.mT).sum() + tail.dot(tail))
    return torch.stack(total).sum()


def check_hparam(name, value, low=0.0, high=None, high_inclusive=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if value < low or (high is not None and (value > high if high_inclusive else value >= high)):
        bound = "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}{bound}, got {value!r}")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def normalize_param_groups(params) -> list[dict]:
    """params (tensors, (name, tensor) pairs, or group dicts of either) -> group dicts with the tensors
    in "params" and their names in "param_names" (state is keyed by name; unnamed: param<i>)."""
    params = list(params)
    if not params:
        raise ValueError("params is empty: the optimizer needs at least one parameter")
    out, index = [], 0
    for group in params if isinstance(params[0], dict) else [{"params": params}]:
        group = dict(group)
        items = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        given = group.get("param_names")
        group["params"], group["param_names"] = [], []
        for i, item in enumerate(items):
            name, p = item if isinstance(item, tuple) else ((given[i] if given is not None else f"param{index}"), item)
            group["params"].append(p)
            group["param_names"].append(str(name))
            index += 1
        out.append(group)
    return out


def jsonable_hparams(group: dict) -> dict:
    """The group's hyperparameters as plain Python values (tensors become floats, tuples lists)."""
    plain = {key: value.item() if torch.is_tensor(value) else value for key, value in group.items() if key != "params"}
    return {key: list(value) if isinstance(value, tuple) else value for key, value in plain.items()}


class Bucket(NamedTuple):
    """Parameters reduced and gathered as one flat buffer of world_size chunks of `chunk` elements:
    rank r's chunk holds slots[r], the (param, lo, hi) flat ranges r owns, zero-padded. `whole`: a
    parameter that splits exactly into the chunks, reduced and gathered in place."""

    chunk: int
    slots: list
    whole: torch.Tensor | None = None

    def pieces(self, r: int, tensor_of) -> list:
        """Rank r's chunk of tensor_of(param), as pieces to concatenate."""
        out = [tensor_of(p).reshape(-1)[lo:hi] for p, lo, hi in self.slots[r]]
        pad = self.chunk - sum(hi - lo for _, lo, hi in self.slots[r])
        if pad:
            out.append(torch.zeros(pad, dtype=self.first.dtype, device=self.first.device))
        return out

    @property
    def first(self) -> torch.Tensor:
        return next(p for slots in self.slots for p, _, _ in slots)


class ZeroOptimizer(torch.optim.Optimizer):
    """Base of AdamW and Muon (and their Dist*, Fsdp* forms): parameter names, ranks, the ZeRO-2
    collectives of `step` over the subclass's `buckets`, and the state format. A subclass builds
    `buckets` and implements `update(chunks, scale)`: the math on the parts this rank owns."""

    kind = ""
    state_keys = ()  # the state tensors saved flat by offset (stitched from any ranks' ranges)
    distributed = False  # the Dist*/Fsdp* forms: rank and world size from the default process group
    grads_are_sums = True  # ZeRO-2 receives each gradient summed over ranks; FSDP's backward averages them

    def __init__(self, params, defaults):
        super().__init__(normalize_param_groups(params), defaults)
        if self.distributed and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"{type(self).__name__} needs torch.distributed to be initialized "
                f"(launch with torchrun and call compute_init); in a single process use "
                f"{type(self).__name__.removeprefix('Dist')}"
            )
        self.world_size, self.rank = (dist.get_world_size(), dist.get_rank()) if self.distributed else (1, 0)
        self.names = {p: name for g in self.param_groups for p, name in zip(g["params"], g["param_names"])}
        for p, name in self.names.items():
            if not p.is_contiguous():
                raise ValueError(f"parameter {name!r} is not contiguous; the optimizer updates flat views of it")
        if len(set(self.names.values())) != len(self.names):
            raise ValueError("parameter names must be unique")
        self.params = list(self.names)
        self.buckets: list[Bucket] = []
        self.num_updates = 0  # completed steps (AdamW's bias correction counts them)
        self._gathers = []
        self._flat_grads = {}  # bucket index -> its flat gradient in one process, kept from step to step
        self._initialized = True

    @property
    def grad_divisor(self) -> int:
        """What this rank's gradients are divided by to be the average over ranks."""
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

    def owned(self, b: Bucket) -> list:
        """The params of bucket b this rank owns (some of their elements, or all)."""
        return [p for p, _, _ in b.slots[self.rank]]

    @torch.no_grad()
    def step(self, closure=None):
        """This optimizer alone, without clipping (the module's step clips several together)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.update(self.reduce_grads()(), 1.0 / self.grad_divisor)
        self.finish_gathers()
        self.mark_updated()
        return loss

    def reduce_grads(self):
        """Start reduce-scattering every bucket's gradient; returns the wait, which gives this rank's
        chunk of each bucket, summed over ranks."""
        chunks, works = [], []
        for i, b in enumerate(self.buckets):
            if b.whole is not None:
                send = self._grad(b.whole).reshape(-1)
            else:
                pieces = [x for r in range(self.world_size) for x in b.pieces(r, self._grad)]
                send = torch.cat(pieces, out=self._flat_grad(i, pieces)) if self.world_size == 1 else torch.cat(pieces)
            chunks.append(send if self.world_size == 1 else send.new_empty(b.chunk))
            if self.world_size > 1:
                works.append(reduce_scatter_single(chunks[-1], send, op=dist.ReduceOp.SUM, async_op=True))

        def wait():
            for work in works:
                work.wait()
            return chunks

        return wait

    def _flat_grad(self, i: int, pieces: list) -> torch.Tensor:
        """Bucket i's flat gradient buffer in one process, made once: a fresh one each step would be tens of
        MB of new pages from the OS every step, each page faulted in (docs/measurements.md#muon-step-buffers)."""
        flat = self._flat_grads.get(i)
        if flat is None or flat.dtype != pieces[0].dtype or flat.device != pieces[0].device:
            flat = self._flat_grads[i] = pieces[0].new_empty(sum(x.numel() for x in pieces))
        return flat

    def grad_sq(self, chunks) -> torch.Tensor:
        """The sum of squares of this rank's part of the gradient averaged over ranks."""
        return sum_of_squares(chunks, self.params[0].device) / self.grad_divisor**2

    def update(self, chunks: list, scale: float):
        """Scale this rank's chunks by `scale` (clip / grad_divisor), update the parameters and state
        it owns, count the step and start each bucket's gather."""
        raise NotImplementedError

    def gather(self, b: Bucket):
        """Start all-gathering bucket b's parameters, once this rank has updated its part of them."""
        if self.world_size == 1:
            return
        if b.whole is not None:
            flat = b.whole.data.view(-1)
            own = flat[self.rank * b.chunk : (self.rank + 1) * b.chunk]
            self._gathers.append((all_gather_single(flat, own, async_op=True), None, b))
            return
        out = torch.empty(self.world_size * b.chunk, dtype=b.first.dtype, device=b.first.device)
        own = torch.cat(b.pieces(self.rank, lambda p: p.data))
        self._gathers.append((all_gather_single(out, own, async_op=True), out, b))

    def finish_gathers(self):
        """Wait for the gathers and copy the other ranks' parts into the parameters."""
        for work, out, b in self._gathers:
            work.wait()
            if out is None:
                continue  # gathered in place
            params, sources = [], []
            for r, slots in enumerate(b.slots):
                offset = r * b.chunk
                for p, lo, hi in slots:
                    if r != self.rank:
                        params.append(p.data.view(-1)[lo:hi])
                        sources.append(out[offset : offset + hi - lo])
                    offset += hi - lo
            if params:
                torch._foreach_copy_(params, sources)
        self._gathers = []

    def mark_updated(self):
        """Move the parameters' version counters, as an in-place update would (the updates write through
        p.data and the kernels): what caches a function of the weights reads it (model/decode.py's packs)."""
        for p in self.params:
            torch.autograd.graph.increment_version(p)

    def state_nbytes(self) -> int:
        """Bytes of optimizer state held by this rank."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values() if torch.is_tensor(t))

    def shard_state_dict(self) -> dict:
        """This rank's optimizer state in the world-size independent format (FORMAT)."""
        state = {}
        for b in self.buckets:
            for p, lo, hi in b.slots[self.rank]:
                if self.state.get(p):
                    tensors = {k: v.detach().clone() for k, v in self.state[p].items()}
                    state[self.names[p]] = dict(shape=list(p.shape), offset=lo, numel=hi - lo, **tensors)
        return {
            "format": FORMAT,
            "kind": self.kind,
            "world_size": self.world_size,
            "rank": self.rank,
            "num_updates": self.num_updates,
            "param_groups": [jsonable_hparams(g) for g in self.param_groups],
            "state": state,
        }

    def load_shard_state_dicts(self, shards):
        """Load the state saved by every rank of a run (any number, any order) under this sharding."""
        shards = [shards] if isinstance(shards, dict) else list(shards)
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
        # hyperparameters (lr, momentum, ...) follow the saved groups, matched by parameter name
        saved_groups = {name: g for g in shards[0]["param_groups"] for name in g["param_names"]}
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
        self.num_updates = counts.pop()
        self.state.clear()
        if self.num_updates > 0:
            self._load_state(pieces, sorted(s["rank"] for s in shards))

    def _load_state(self, pieces: dict, saved_ranks: list):
        """Each owned range's state_keys, stitched from the saved pieces (saved_ranks: for errors)."""
        for b in self.buckets:
            for p, lo, hi in b.slots[self.rank]:
                name, entries = self.names[p], pieces.get(self.names[p], [])
                for key in self.state_keys:
                    self.state[p][key] = torch.zeros(hi - lo, dtype=torch.float32, device=p.device)
                    copy_flat_pieces(self.state[p][key], lo, entries, key, name, p.shape, saved_ranks)

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
        raise ValueError(
            f"optimizer state {key!r} of {name!r} misses {int((~covered).sum())} of elements [{lo}, {hi}) in the "
            f"shards given (ranks {saved_ranks}): load every optim_rank*.pt file of the checkpoint"
        )
