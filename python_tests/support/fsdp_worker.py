"""
Multi-process worker for distributed/test_fsdp.py: run under
    python -m torch.distributed.run --standalone --nproc_per_node=N python_tests/support/fsdp_worker.py --out DIR
(or torch.multiprocessing.spawn: dist_runs.spawn(run, N, PARSER.parse_args(ARGV))). Results under DIR, asserted
by the test:

  1. the tiny GPT of dist_worker.py (vocab 4099, GQA) trained 5 steps in fp32 with zero2 (DistAdamW +
     DistMuon) and with fsdp (fully_shard + FsdpAdamW + FsdpMuon), each with the quintic recipe and
     with polar-normuon (NorMuon, cautious weight decay, MuonEq, Muon+): final whole weights and
     grad norms of each                                                              -> <mode>_<recipe>.pt
  2. the bytes each rank holds under fsdp after a backward: its parameter and gradient shards and
     its optimizer state; and the single-process totals                              -> rank<r>.json
  3. fsdp's optimizer state saved after step 3 (the format of optim/zero.py) and loaded by zero2
     optimizers at the same world size, which continue to step 5                      -> fsdp_to_zero2.pt
  4. FsdpAdamW and FsdpMuon on odd shapes (fewer rows than ranks: empty shards) under fully_shard,
     against AdamW / Muon in one process fed the rank-averaged gradients              -> rank<r>.json
"""

from pathlib import Path

import torch
import torch.distributed as dist

from nanochat_fast.core.distributed import compute_init
from nanochat_fast.model import sharding
from nanochat_fast.optim import AdamW, Muon, MuonRecipe
from support import dist_worker as W
from support.dist_runs import finish, worker_parser

RECIPES = {"quintic": W.RECIPE, "polar-normuon": MuonRecipe.preset("polar-normuon", ns_dtype="fp32", weight_decay=0.5)}


def build(mode, recipe, seed=1234):
    model = W.make_model(seed)
    if mode == "fsdp":
        sharding.shard(model, torch.float32)
    return model, model.setup_optimizers(muon_recipe=RECIPES[recipe])


def shard_states(optimizers):
    """Every rank's optimizer shards (the world-size independent format), on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, [opt.shard_state_dict() for opt in optimizers])
    return out


def held_bytes(model, optimizers) -> dict:
    """What this rank holds: its parameter and gradient shards (whole tensors under zero2) and its
    optimizer state."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters())
    return dict(params=params, grads=grads, state=sum(o.state_nbytes() for o in optimizers))


def training_runs(rank, world_size, out, info):
    for recipe in RECIPES:
        for mode in ("zero2", "fsdp"):
            model, optimizers = build(mode, recipe)
            saved = {}

            def at_step(step):
                if step == W.RESUME_STEP and mode == "fsdp" and recipe == "polar-normuon":
                    saved.update(weights=sharding.model_state_dict(model, full=True), shards=shard_states(optimizers))

            norms = W.train(model, optimizers, 1, W.STEPS, rank, world_size, at_step)
            state = sharding.model_state_dict(model, full=True)
            if rank == 0:
                torch.save(
                    dict(params={k: v.clone() for k, v in state.items()}, norms=norms), out / f"{mode}_{recipe}.pt"
                )
            info[f"{mode}_{recipe}_types"] = [type(o).__name__ for o in optimizers]
            if recipe == "quintic":  # after one more backward: parameters, gradients and state held
                x, y = W.global_batch(99)
                rows = W.GLOBAL_ROWS // world_size
                model(x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]).backward()
                info[f"{mode}_bytes"] = held_bytes(model, optimizers)
    # 3. fsdp's state at step 3 continued by zero2 optimizers
    weights = [saved["weights"]]
    dist.broadcast_object_list(weights, src=0)
    model, optimizers = build("zero2", "polar-normuon", seed=999)
    model.load_state_dict(weights[0])
    for i, opt in enumerate(optimizers):
        opt.load_shard_state_dicts([s[i] for s in saved["shards"]])
    W.train(model, optimizers, W.RESUME_STEP + 1, W.STEPS, rank, world_size)
    if rank == 0:
        torch.save(W.params_of(model), out / "fsdp_to_zero2.pt")


class Toy(torch.nn.Module):
    """Parameters of odd shapes; loss = sum of <p, weight of this rank>, so the gradient of p on
    rank r is that rank's weight and FSDP's averaged gradient is the mean over ranks."""

    def __init__(self, shapes, gen):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes])

    def forward(self, weights):
        return sum((p * w).sum() for p, w in zip(self.ps, weights))


def odd_shape_checks(rank, world_size) -> dict:
    from torch.distributed.fsdp import fully_shard

    def weights_of(r, shapes, step):
        gen = torch.Generator().manual_seed(1000 * step + r)
        return [torch.randn(s, generator=gen) for s in shapes]

    results = {}
    adam_shapes = [(7, 5), (3,), (1,), (2, 2), (11, 3, 2)]
    muon_shapes = [(5, 3)] + [(3, 5)] * 3 + [(4, 4)] * 5 + [(2, 7)]
    cases = (
        ("adamw", adam_shapes, dict(lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)),
        ("muon", muon_shapes, dict(lr=0.02, momentum=0.9, ns_dtype="fp32")),
        ("muon_current", muon_shapes, dict(RECIPES["polar-normuon"].muon_kwargs(), lr=0.02)),
    )
    for kind, shapes, hp in cases:
        toy = Toy(shapes, torch.Generator().manual_seed(7))
        ref = [torch.nn.Parameter(p.detach().clone()) for p in toy.ps]
        init = [p.detach().clone() for p in toy.ps]
        fully_shard(toy)
        named = [(f"p{i}", p) for i, p in enumerate(toy.ps)]
        if kind == "adamw":
            from nanochat_fast.optim import FsdpAdamW

            opt, ref_opt = FsdpAdamW(named, **hp), AdamW(ref, **hp)
        else:
            from nanochat_fast.optim import FsdpMuon

            opt, ref_opt = FsdpMuon(named, **hp), Muon(ref, **hp)
        for step in range(1, 4):
            toy(weights_of(rank, shapes, step)).backward()
            all_w = [weights_of(r, shapes, step) for r in range(world_size)]
            for i, p in enumerate(ref):
                p.grad = torch.stack([w[i] for w in all_w]).mean(0)
            opt.step()
            ref_opt.step()
            toy.zero_grad(set_to_none=True)
        ours = [p.full_tensor() for p in toy.ps]
        results[kind] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, ref))
        results[kind + "_state_bytes"] = opt.state_nbytes()
        results["moved"] = min(
            results.get("moved", 1.0), min(((a - b).norm() / b.norm()).item() for a, b in zip(ours, init))
        )
    return results


def run(args):
    _, rank, _, world_size, _ = compute_init("cpu", deterministic=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = dict(rank=rank, world_size=world_size)
    if not args.memory_only:
        training_runs(rank, world_size, out, info)
        info["odd_shapes"] = odd_shape_checks(rank, world_size)
    else:
        model, optimizers = build("fsdp", "quintic")
        W.train(model, optimizers, 1, 2, rank, world_size)
        x, y = W.global_batch(99)
        model(x[rank : rank + 1], y[rank : rank + 1]).backward()
        info["fsdp_bytes"] = held_bytes(model, optimizers)
        info["fsdp_quintic_types"] = [type(o).__name__ for o in optimizers]
    finish(out, rank, info)


PARSER = worker_parser()
PARSER.add_argument("--memory-only", action="store_true")

if __name__ == "__main__":
    run(PARSER.parse_args())
