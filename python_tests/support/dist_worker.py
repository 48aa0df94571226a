"""
Multi-process worker for distributed/test_dist_parity.py: run under
    python -m torch.distributed.run --standalone --nproc_per_node=N python_tests/support/dist_worker.py --out DIR ...
or through torch.multiprocessing.spawn (dist_runs.spawn(run, N, PARSER.parse_args(ARGV))). The training
routine is shared with the single-process reference run in the test (world_size 1, no process group).

What one launch does (results under DIR, read and asserted by the test):
  1. compute_init on gloo; all_reduce_sum on known values                            -> rank<r>.json
  2. a tiny GPT (vocab 4099, odd shapes) trained 5 steps with DistAdamW + DistMuon, every rank on
     its own rows of one global batch, global-norm clipping; checkpoint after step 3 -> final.pt
  3. resume from DIR/step3 (same world size: must be bitwise) and from --resume-from (a checkpoint
     written by another world size), continue to step 5                             -> resumed_*.pt
  4. DistAdamW / DistMuon on odd shapes (numel not divisible by N, numel < N, group sizes not
     multiples of N) against references fed the rank-averaged gradients, DistMuon with the quintic
     recipe and with polar-normuon (NorMuon, cautious weight decay, MuonEq, Muon+) ("muon_current"); its
     state saved by N ranks and loaded by N ranks and by one process               -> rank<r>.json
Newton-Schulz runs in fp32 here (ns_dtype="fp32"): the comparisons are at fp32 rounding level, and
on a CPU with native bf16 "auto" would pick bf16.
"""

from pathlib import Path

import torch

from nanochat_fast import optim
from nanochat_fast.core.distributed import all_reduce_sum, compute_init, get_dist_info
from nanochat_fast.model.gpt import GPT, GPTConfig
from nanochat_fast.optim import MuonRecipe
from support.dist_runs import finish, worker_parser

CONFIG = GPTConfig(sequence_len=16, vocab_size=4099, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
GLOBAL_ROWS = 6  # divisible by 1, 2 and 3: every world size sees the same global batch
STEPS = 5
RESUME_STEP = 3
GRAD_CLIP = 0.5  # below the norms this model sees, so clipping is active
RECIPE = MuonRecipe.preset("quintic", ns_dtype="fp32")
# the polar-normuon recipe's Muon with a weight decay large enough to show in 4 steps
CURRENT_MUON = dict(MuonRecipe.preset("polar-normuon", ns_dtype="fp32", weight_decay=0.5).muon_kwargs(), lr=0.02)


def make_model(seed=1234):
    """The tiny GPT with nanochat's init, then the zero-initialised projections given small random
    values so every parameter gets a gradient from the first step."""
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    model.init_weights()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if p.abs().max() == 0:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def global_batch(step):
    """Inputs and targets (GLOBAL_ROWS, T) of one step; about 1 target in 8 is -1 (ignored)."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, CONFIG.vocab_size, (GLOBAL_ROWS, CONFIG.sequence_len), generator=gen)
    y = torch.randint(0, CONFIG.vocab_size, (GLOBAL_ROWS, CONFIG.sequence_len), generator=gen)
    y[torch.rand(y.shape, generator=gen) < 0.125] = -1
    return x, y


def train(model, optimizers, first_step, last_step, rank=0, world_size=1, on_step=None):
    """Steps first_step..last_step (1-based). Rank r takes rows [r*B, (r+1)*B) of the global batch.
    The loss is normalised by the global count of supervised tokens; the optimizers average the
    gradients over ranks, hence the factor world_size."""
    norms = []
    for step in range(first_step, last_step + 1):
        x, y = global_batch(step)
        rows = GLOBAL_ROWS // world_size
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        n_supervised = all_reduce_sum((y != -1).sum())
        loss = model(x, y, loss_reduction="sum") / n_supervised * world_size
        loss.backward()
        norms.append(optim.step(optimizers, GRAD_CLIP).item())
        model.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step)
    return norms


def save_checkpoint(model, optimizers, directory, rank):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(model.state_dict(), directory / "model.pt")
    torch.save([opt.shard_state_dict() for opt in optimizers], directory / f"optim_rank{rank}.pt")


def load_checkpoint(model, optimizers, directory):
    """Model weights plus the optimizer shards of every rank that saved them."""
    directory = Path(directory)
    model.load_state_dict(torch.load(directory / "model.pt", weights_only=True))
    files = sorted(directory.glob("optim_rank*.pt"))
    per_file = [torch.load(f, weights_only=True) for f in files]
    for i, opt in enumerate(optimizers):
        opt.load_shard_state_dicts([shards[i] for shards in per_file])


def params_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def odd_shape_checks(rank, world_size):
    """DistAdamW against torch.optim.AdamW and DistMuon against Muon, both fed the mean of every
    rank's gradient, on shapes that do not split evenly. Returns max relative errors.

    Gradients are multiples of 1/64 below 8 in size, so their sums over ranks are exact in any
    order: the distributed and the single-process optimizers see the same bits, and the cautious
    weight decay's sign test cannot flip on a rounding difference."""
    from nanochat_fast.optim import DistAdamW, DistMuon, Muon

    def grads_of_rank(r, shapes, step):
        gen = torch.Generator().manual_seed(1000 * step + r)
        return [torch.randn(s, generator=gen).clamp(-7, 7).mul(64).round().div(64) for s in shapes]

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    def set_grads(ours, ref, shapes, step):
        for p, g in zip(ours, grads_of_rank(rank, shapes, step)):
            p.grad = g
        all_grads = [grads_of_rank(r, shapes, step) for r in range(world_size)]
        for i, p in enumerate(ref):
            p.grad = torch.stack([g[i] for g in all_grads]).mean(0)

    results = {}
    adam_shapes = [(7, 5), (3,), (1,), (2, 2), (11, 3, 2)]
    muon_shapes = [(5, 3)] + [(3, 5)] * 3 + [(4, 4)] * 5
    for kind, shapes in (("adamw", adam_shapes), ("muon", muon_shapes), ("muon_current", muon_shapes)):
        gen = torch.Generator().manual_seed(7)
        init = [torch.randn(s, generator=gen) for s in shapes]
        ours = [torch.nn.Parameter(t.clone()) for t in init]
        ref = [torch.nn.Parameter(t.clone()) for t in init]
        for i, p in enumerate(ours):
            p.lr_mul = 1.0 + 0.5 * (i % 2)  # per-parameter multipliers take part too
            p.wd_mul = 0.5 * (i % 3)
        for i, p in enumerate(ref):
            p.lr_mul, p.wd_mul = ours[i].lr_mul, ours[i].wd_mul
        if kind == "adamw":
            opt = DistAdamW(ours, lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
            # torch.optim.AdamW with the multipliers: one param group per parameter
            ref_opt = torch.optim.AdamW(
                [dict(params=[p], lr=0.01 * p.lr_mul, weight_decay=0.1 * p.wd_mul) for p in ref],
                betas=(0.8, 0.95),
                eps=1e-10,
                foreach=False,
            )
        else:
            hp = CURRENT_MUON if kind == "muon_current" else dict(lr=0.02, momentum=0.9, ns_dtype="fp32")
            opt = DistMuon(ours, **hp)
            ref_opt = Muon(ref, **hp)
        for step in range(1, 4):
            set_grads(ours, ref, shapes, step)
            opt.step()
            ref_opt.step()
        results[kind] = max(rel(a.detach(), b.detach()) for a, b in zip(ours, ref))
        results[kind + "_state_bytes"] = opt.state_nbytes()
        if kind == "muon_current":
            results["muon_current_resume"] = resume_checks(opt, ours, ref_opt, ref, set_grads, shapes, rel)
    return results


def resume_checks(opt, ours, ref_opt, ref, set_grads, shapes, rel):
    """The state of `opt` (DistMuon, N ranks) saved and loaded by a new DistMuon on N ranks (must
    continue bitwise) and by a single-process Muon (must continue like the reference)."""
    from nanochat_fast.optim import DistMuon, Muon

    shards = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shards, opt.shard_state_dict())
    copies = {}
    for label, cls, like in (("same_world_size", DistMuon, ours), ("one_process", Muon, ref)):
        params = [torch.nn.Parameter(p.detach().clone()) for p in like]
        for p, q in zip(params, like):
            p.lr_mul, p.wd_mul = q.lr_mul, q.wd_mul
        resumed = cls(params, **CURRENT_MUON)
        resumed.load_shard_state_dicts(shards)
        copies[label] = (params, resumed)
    set_grads(ours, ref, shapes, 4)
    for label, (params, resumed) in copies.items():
        for p, q in zip(params, ours if label == "same_world_size" else ref):
            p.grad = q.grad.clone()
    for o in [opt, ref_opt] + [resumed for _, resumed in copies.values()]:
        o.step()
    same = all(torch.equal(a, b) for a, b in zip(copies["same_world_size"][0], ours))
    return dict(
        same_world_size_bitwise=same,
        one_process=max(rel(a.detach(), b.detach()) for a, b in zip(copies["one_process"][0], ref)),
    )


def run(args):
    ddp, rank, local_rank, world_size, device = compute_init("cpu", deterministic=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = dict(
        ddp=ddp,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        device=str(device),
        backend=torch.distributed.get_backend(),
        dist_info=list(get_dist_info()),
    )
    info["sum_of_rank_plus_1"] = all_reduce_sum(torch.tensor(rank + 1)).item()
    info["float_sums"] = all_reduce_sum(torch.tensor([rank + 1.0, 2.0 * rank])).tolist()

    # 2. uninterrupted run, checkpoint after RESUME_STEP
    model = make_model()
    optimizers = model.setup_optimizers(muon_recipe=RECIPE)
    info["optimizer_types"] = [type(o).__name__ for o in optimizers]

    def maybe_save(step):
        if step == RESUME_STEP:
            save_checkpoint(model, optimizers, out / "step3", rank)

    info["norms"] = train(model, optimizers, 1, STEPS, rank, world_size, maybe_save)
    info["state_bytes"] = {type(o).__name__: o.state_nbytes() for o in optimizers}
    if rank == 0:
        torch.save(params_of(model), out / "final.pt")
    torch.distributed.barrier()  # every shard of step3 is on disk before anyone reads them

    # 3. resumes: own checkpoint (bitwise), and one written by another world size
    sources = {"self": out / "step3"}
    if args.resume_from:
        sources["other"] = Path(args.resume_from)
    for label, src in sources.items():
        model = make_model(seed=999)  # different weights: everything must come from the checkpoint
        optimizers = model.setup_optimizers(muon_recipe=RECIPE)
        load_checkpoint(model, optimizers, src)
        train(model, optimizers, RESUME_STEP + 1, STEPS, rank, world_size)
        if rank == 0:
            torch.save(params_of(model), out / f"resumed_{label}.pt")

    # 4. odd shapes
    info["odd_shapes"] = odd_shape_checks(rank, world_size)
    finish(out, rank, info)


PARSER = worker_parser()
PARSER.add_argument("--resume-from", default="")

if __name__ == "__main__":
    run(PARSER.parse_args())
