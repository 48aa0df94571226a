"""
--sharding=fsdp on gloo: FSDP2 with FsdpAdamW + FsdpMuon trains like zero2 (DistAdamW + DistMuon)
at the same world size, holds about 1/N of the parameters, gradients and optimizer state per rank,
and shares zero2's optimizer state format.

The tiny GPT of dist_worker.py (vocab 4099: rows that do not split evenly; GQA) is trained 5 steps
in fp32 by fsdp_worker.py at 2 processes (torchrun) and 3 (spawn); 4 processes (spawn) only
measure the memory. Single-process runs in this process are the reference for the tolerance.
"""

import json
from pathlib import Path

import pytest
import torch
from support import dist_worker as W
from support import fsdp_worker as F
from support.dist_runs import PARITY_RTOL, rel_err, spawn, torchrun


def read(out: Path, world_size: int) -> dict:
    run = dict(ranks=[json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)])
    for f in out.glob("*.pt"):
        run[f.stem] = torch.load(f, weights_only=True)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    torchrun("fsdp_worker.py", 2, ["--out", str(root / "w2")])
    spawn(F.run, 3, F.PARSER.parse_args(["--out", str(root / "w3")]))
    spawn(F.run, 4, F.PARSER.parse_args(["--out", str(root / "w4"), "--memory-only"]))
    return {2: read(root / "w2", 2), 3: read(root / "w3", 3), 4: read(root / "w4", 4)}


@pytest.fixture(scope="module")
def single():
    """One process, the whole batch: final weights per recipe, and the bytes of parameters +
    gradients + optimizer state (all of it on the one rank)."""
    out = {}
    for recipe in F.RECIPES:
        model, optimizers = F.build("zero2", recipe)
        W.train(model, optimizers, 1, W.STEPS)
        out[recipe] = W.params_of(model)
        out[recipe + " rounded otherwise"] = trained_rounded_otherwise(recipe)
        if recipe == "quintic":
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            out["total_bytes"] = 2 * nbytes + sum(o.state_nbytes() for o in optimizers)
            out["largest_matrix_bytes"] = max(p.numel() * p.element_size() for p in model.transformer.h.parameters())
    return out


def trained_rounded_otherwise(recipe: str) -> dict:
    """One process's final weights with every gradient off by about one fp32 rounding: how far
    rounding alone (another order of the ranks' sums) moves this recipe's weights."""
    model, optimizers = F.build("zero2", recipe)
    gen = torch.Generator().manual_seed(0)

    def round_otherwise(p):
        p.grad.mul_(1 + 2.0**-23 * torch.randn(p.grad.shape, generator=gen))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(round_otherwise)
    W.train(model, optimizers, 1, W.STEPS)
    return W.params_of(model)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_matches_zero2(runs, single, world_size):
    run = runs[world_size]
    for info in run["ranks"]:
        assert info["fsdp_quintic_types"] == ["FsdpAdamW", "FsdpMuon"]
        assert info["zero2_quintic_types"] == ["DistAdamW", "DistMuon"]
    fsdp, zero2 = run["fsdp_quintic"], run["zero2_quintic"]
    err = rel_err(fsdp["params"], zero2["params"])
    print(
        f"fsdp vs zero2, N={world_size}: relative parameter error {err:.2e} (zero2 vs 1 process: "
        f"{rel_err(zero2['params'], single['quintic']):.2e})"
    )
    assert err < PARITY_RTOL
    torch.testing.assert_close(torch.tensor(fsdp["norms"]), torch.tensor(zero2["norms"]), rtol=1e-5, atol=0)
    assert min(fsdp["norms"]) > W.GRAD_CLIP  # clipping by the global norm was active at every step
    assert rel_err(W.params_of(W.make_model()), zero2["params"]) > 1e-2  # training moved the weights


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_polar_normuon_recipe_matches_zero2(runs, single, world_size):
    """NorMuon, cautious weight decay, MuonEq and Muon+ on the owner ranks. The matrices agree as far
    as fp32 rounding lets this recipe's runs agree: Polar Express in fp32 (a CPU without fast bf16)
    multiplies a perturbation of a small singular value by ~1e3 over its 5 steps, so the gradients'
    rounding in another order of sums moves the weights by up to ~1e-4, measured here by one process
    with its gradients off by one rounding. The embedding, whose Adam divides by each element's own
    small second moment, differs between zero2 and one process already (~1e-5), as much between fsdp
    and either."""
    fsdp, zero2, one = (
        runs[world_size]["fsdp_polar-normuon"]["params"],
        runs[world_size]["zero2_polar-normuon"]["params"],
        single["polar-normuon"],
    )
    matrices = [k for k in one if k.startswith("transformer.h.")]
    bound = max(PARITY_RTOL, 3 * rounding_spread(single, "polar-normuon", matrices))
    assert rel_err({k: fsdp[k] for k in matrices}, {k: zero2[k] for k in matrices}) < bound
    assert rel_err(fsdp, zero2) < 5 * max(rel_err(zero2, one), PARITY_RTOL, rounding_spread(single, "polar-normuon"))


def rounding_spread(single, recipe, keys=None) -> float:
    """How far one rounding of every gradient moves `recipe`'s weights (the `single` fixture's two runs)."""
    one, other = single[recipe], single[recipe + " rounded otherwise"]
    keys = list(one) if keys is None else keys
    return rel_err({k: one[k] for k in keys}, {k: other[k] for k in keys})


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_state_continues_under_zero2(runs, single, world_size):
    """fsdp's optimizer state after step 3, loaded by zero2 optimizers: steps 4-5 as uninterrupted
    (fsdp's own run; zero2's, as far as rounding lets the two agree: test_fsdp_polar_normuon_recipe_matches_zero2)."""
    run = runs[world_size]
    assert rel_err(run["fsdp_to_zero2"], run["fsdp_polar-normuon"]["params"]) < 5 * PARITY_RTOL
    bound = 5 * max(PARITY_RTOL, rounding_spread(single, "polar-normuon"))
    assert rel_err(run["fsdp_to_zero2"], run["zero2_polar-normuon"]["params"]) < bound


@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_per_rank(runs, single, world_size):
    """Parameters + gradients + optimizer state each rank holds <= 1.1 x total / N + the largest
    matrix (Muon's momentum is kept whole by its owner)."""
    total, largest = single["total_bytes"], single["largest_matrix_bytes"]
    bound = 1.1 * total / world_size + largest
    held = [sum(info["fsdp_bytes"].values()) for info in runs[world_size]["ranks"]]
    print(f"fsdp N={world_size}: per rank {held} bytes, bound {bound:.0f}, total {total}")
    assert max(held) <= bound
    assert sum(info["fsdp_bytes"]["state"] for info in runs[world_size]["ranks"]) == total - 2 * sum(
        p.numel() * 4 for p in W.make_model().parameters()
    )  # each state element on one rank
    if world_size == 2:  # zero2 holds the whole model and gradient: above the bound
        assert min(sum(info["zero2_bytes"].values()) for info in runs[2]["ranks"]) > bound


@pytest.mark.parametrize("world_size", [2, 3])
def test_odd_shapes_match_one_process(runs, world_size):
    """Fewer rows than ranks (empty shards), numel not divisible by N, groups not multiples of N."""
    for info in runs[world_size]["ranks"]:
        odd = info["odd_shapes"]
        assert odd["adamw"] < 1e-6 and odd["muon"] < 1e-6 and odd["muon_current"] < 1e-6
        assert odd["moved"] > 1e-3
    adam_numel = 35 + 3 + 1 + 4 + 66
    muon_numel = 15 + 3 * 15 + 5 * 16 + 14
    assert sum(i["odd_shapes"]["adamw_state_bytes"] for i in runs[world_size]["ranks"]) == 2 * 4 * adam_numel
    assert sum(i["odd_shapes"]["muon_state_bytes"] for i in runs[world_size]["ranks"]) == 4 * muon_numel
