"""
Multi-process training on gloo matches one process.

A tiny GPT whose vocab (4099) and matrix groups do not split evenly is trained 5 steps with
DistAdamW + DistMuon on 2 processes (launched by torchrun) and 3 processes (torch.multiprocessing
.spawn), each rank fed its own rows of the global batch, and compared with a single process
(AdamW + Muon) fed the whole batch. Also: optimizer state per rank is ~1/N of the total, and
optimizer checkpoints reload across world sizes (1 -> 2 -> 3 -> 1, and N -> N bitwise).
"""

import json
from pathlib import Path

import pytest
import torch
from support import dist_worker as W
from support.dist_runs import PARITY_RTOL, rel_err, spawn, torchrun


def max_elementwise_err(a: dict, b: dict) -> float:
    """Largest over tensors of max|a - b| / max|b| (reported, not asserted)."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


def single_process_run(out: Path, resume_from: Path | None = None):
    """The reference: one process, the whole global batch, AdamW + Muon. Same routine as the workers."""
    model = W.make_model()
    optimizers = model.setup_optimizers(muon_recipe=W.RECIPE)
    norms = W.train(
        model,
        optimizers,
        1,
        W.STEPS,
        on_step=lambda s: s == W.RESUME_STEP and W.save_checkpoint(model, optimizers, out / "step3", 0),
    )
    result = dict(
        params=W.params_of(model),
        norms=norms,
        optimizers=[type(o).__name__ for o in optimizers],
        state_bytes={type(o).__name__: o.state_nbytes() for o in optimizers},
    )
    if resume_from is not None:
        model = W.make_model(seed=999)
        optimizers = model.setup_optimizers(muon_recipe=W.RECIPE)
        W.load_checkpoint(model, optimizers, resume_from)
        W.train(model, optimizers, W.RESUME_STEP + 1, W.STEPS)
        result["resumed"] = W.params_of(model)
    return result


def read_run(out: Path, world_size: int):
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    return dict(
        ranks=ranks,
        final=torch.load(out / "final.pt", weights_only=True),
        resumed_self=torch.load(out / "resumed_self.pt", weights_only=True),
        resumed_other=torch.load(out / "resumed_other.pt", weights_only=True),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 process -> torchrun 2 (resuming the 1-process checkpoint) -> spawn 3 (resuming the
    2-process one) -> 1 process resuming the 3-process one."""
    root = tmp_path_factory.mktemp("dist")
    torch.manual_seed(0)
    ref = single_process_run(root / "w1")

    torchrun("dist_worker.py", 2, ["--out", str(root / "w2"), "--resume-from", str(root / "w1" / "step3")])
    w2 = read_run(root / "w2", 2)

    spawn(W.run, 3, W.PARSER.parse_args(["--out", str(root / "w3"), "--resume-from", str(root / "w2" / "step3")]))
    w3 = read_run(root / "w3", 3)

    ref["resumed_from_3"] = single_process_run(root / "w1_again", resume_from=root / "w3" / "step3")["resumed"]
    return {1: ref, 2: w2, 3: w3}


@pytest.mark.parametrize("world_size", [2, 3])
def test_runtime_on_gloo(runs, world_size):
    for r, info in enumerate(runs[world_size]["ranks"]):
        assert (info["ddp"], info["rank"], info["local_rank"], info["world_size"], info["device"]) == (
            True,
            r,
            r,
            world_size,
            "cpu",
        )
        assert info["backend"] == "gloo"
        assert info["dist_info"] == [True, r, r, world_size]
        assert info["optimizer_types"] == ["DistAdamW", "DistMuon"]
        # sums over ranks, identical on every rank
        assert info["sum_of_rank_plus_1"] == world_size * (world_size + 1) // 2
        assert info["float_sums"] == [world_size * (world_size + 1) / 2, world_size * (world_size - 1.0)]
    assert runs[1]["optimizers"] == ["AdamW", "Muon"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_match_single_process(runs, world_size):
    err = rel_err(runs[world_size]["final"], runs[1]["params"])
    print(
        f"parity N={world_size}: relative parameter error {err:.2e} (largest element: "
        f"{max_elementwise_err(runs[world_size]['final'], runs[1]['params']):.2e} of the tensor's largest)"
    )
    assert err < PARITY_RTOL
    # and training moved them: the comparison is not between two copies of the initial weights
    assert rel_err(W.params_of(W.make_model()), runs[1]["params"]) > 1e-2


@pytest.mark.parametrize("world_size", [2, 3])
def test_global_grad_norm_matches(runs, world_size):
    ranks = runs[world_size]["ranks"]
    for info in ranks[1:]:
        assert info["norms"] == ranks[0]["norms"]  # the same bits on every rank
    ours, single = torch.tensor(ranks[0]["norms"]), torch.tensor(runs[1]["norms"])
    print(
        f"grad norm N={world_size}: largest relative difference to 1 process "
        f"{((ours - single).abs() / single).max():.1e}"
    )
    torch.testing.assert_close(ours, single, rtol=1e-5, atol=0)
    assert min(runs[1]["norms"]) > W.GRAD_CLIP  # clipping was active at every step


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_optimizer_state_is_sharded(runs, world_size):
    total = sum(runs[1]["state_bytes"].values())
    per_rank = [sum(info["state_bytes"].values()) for info in runs[world_size]["ranks"]] if world_size > 1 else [total]
    print(
        f"optimizer state N={world_size}: per rank {per_rank} bytes, total {total}; by optimizer: "
        f"{[info['state_bytes'] for info in runs[world_size]['ranks']] if world_size > 1 else runs[1]['state_bytes']}"
    )
    assert sum(per_rank) == total  # each element of state lives on exactly one rank
    assert max(per_rank) <= 1.05 * total / world_size
    for name in ("AdamW", "Muon"):
        if world_size > 1:
            assert (
                sum(info["state_bytes"]["Dist" + name] for info in runs[world_size]["ranks"])
                == runs[1]["state_bytes"][name]
            )


@pytest.mark.parametrize("world_size", [2, 3])
def test_odd_shapes_match_references(runs, world_size):
    for info in runs[world_size]["ranks"]:
        assert info["odd_shapes"]["adamw"] < 1e-6
        assert info["odd_shapes"]["muon"] < 1e-6
        assert info["odd_shapes"]["muon_current"] < 1e-6  # NorMuon, cautious wd, MuonEq, Muon+
    # every element of state on exactly one rank, even for a 1-element tensor
    assert sum(info["odd_shapes"]["adamw_state_bytes"] for info in runs[world_size]["ranks"]) == 2 * 4 * (
        35 + 3 + 1 + 4 + 66
    )
    assert sum(info["odd_shapes"]["muon_state_bytes"] for info in runs[world_size]["ranks"]) == 4 * (
        15 + 3 * 15 + 5 * 16
    )
    # plus NorMuon's second moment: one value per row of the 5x3, per column of the 3x5, per row of the 4x4
    assert sum(info["odd_shapes"]["muon_current_state_bytes"] for info in runs[world_size]["ranks"]) == 4 * (
        15 + 3 * 15 + 5 * 16
    ) + 4 * (5 + 3 * 5 + 5 * 4)


@pytest.mark.parametrize("world_size", [2, 3])
def test_current_recipe_state_resumes(runs, world_size):
    """DistMuon's NorMuon state saved by N ranks: N ranks continue bitwise, one process continues
    like the single-process reference."""
    for info in runs[world_size]["ranks"]:
        resume = info["odd_shapes"]["muon_current_resume"]
        assert resume["same_world_size_bitwise"]
        assert resume["one_process"] < 1e-6


@pytest.mark.parametrize("world_size", [2, 3])
def test_resume_same_world_size_is_bitwise(runs, world_size):
    run = runs[world_size]
    for k in run["final"]:
        assert torch.equal(run["resumed_self"][k], run["final"][k]), k


@pytest.mark.parametrize("saved,loaded", [(1, 2), (2, 3), (3, 1)])
def test_resume_on_another_world_size(runs, saved, loaded):
    resumed = runs[1]["resumed_from_3"] if loaded == 1 else runs[loaded]["resumed_other"]
    err = rel_err(resumed, runs[1]["params"])
    print(
        f"resume {saved} -> {loaded} processes: relative parameter error {err:.2e} (largest element: "
        f"{max_elementwise_err(resumed, runs[1]['params']):.2e})"
    )
    assert err < PARITY_RTOL
