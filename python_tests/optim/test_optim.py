"""Single-process optimizers against independent references: AdamW against torch.optim.AdamW,
Muon against a float64 transcription of nanochat's Muon, Newton-Schulz against an SVD; global-norm
clipping, the NaN guard, and the world-size independent state format (resharded in-process)."""

import math

import pytest
import torch
from support.newton_schulz_reference import (  # the published coefficients, not the package's
    float64_newton_schulz,
    published,
)

from nanochat_fast import optim
from nanochat_fast.kernels import newton_schulz
from nanochat_fast.optim import AdamW, DistAdamW, DistMuon, Muon


def make_params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def set_grads(params, step, scale=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale


# ---------------------------------------------------------------------------------------------
# AdamW


def test_adamw_matches_torch_adamw():
    shapes = [(13, 7), (5,), (1,), (3, 4, 2)]
    ours, ref = make_params(shapes), make_params(shapes)
    ours[1].lr_mul, ours[1].wd_mul = 2.0, 0.0
    ours[2].wd_mul = 3.0
    opt = AdamW(
        [dict(params=ours[:2], lr=0.01), dict(params=ours[2:], lr=0.003)],
        betas=(0.8, 0.95),
        eps=1e-10,
        weight_decay=0.1,
    )
    # torch.optim.AdamW decays by lr*weight_decay: per-parameter groups carry the multipliers
    groups = [(0.01, 1.0, 1.0), (0.01, 2.0, 0.0), (0.003, 1.0, 3.0), (0.003, 1.0, 1.0)]
    ref_opt = torch.optim.AdamW(
        [dict(params=[p], lr=lr * lm, weight_decay=0.1 * wm) for p, (lr, lm, wm) in zip(ref, groups)],
        betas=(0.8, 0.95),
        eps=1e-10,
        foreach=False,
    )
    for step in range(1, 6):
        set_grads(ours, step)
        set_grads(ref, step)
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)
    state = ref_opt.state[ref[0]]
    torch.testing.assert_close(opt.state[ours[0]]["exp_avg"], state["exp_avg"].view(-1), rtol=1e-6, atol=1e-7)
    assert opt.num_updates == 5


def test_adamw_bad_hyperparameters():
    with pytest.raises(ValueError, match="lr"):
        AdamW(make_params([(2,)]), lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        AdamW(make_params([(2,)]), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="params is empty"):
        AdamW([])


def test_dist_optimizers_need_a_process_group():
    with pytest.raises(ValueError, match="torch.distributed"):
        DistAdamW(make_params([(2,)]))
    with pytest.raises(ValueError, match="torch.distributed"):
        DistMuon(make_params([(2, 2)]))


def test_missing_gradient_names_the_parameter():
    p = make_params([(2, 3), (4,)])
    opt = AdamW([("first", p[0]), ("second", p[1])])
    p[0].grad = torch.ones(2, 3)
    with pytest.raises(ValueError, match="'second' has no gradient"):
        opt.step()
    with pytest.raises(RuntimeError, match="new optimizer"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})


# ---------------------------------------------------------------------------------------------
# Newton-Schulz and Muon


def svd_factors(G):
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U, S, Vh


# measured bands: quintic [0.682, 1.135], Polar Express [0.858, 1.142] (quintic's known ~[0.68, 1.13])
@pytest.mark.parametrize(
    "coefficients,band,max_offdiag", [("quintic", (0.65, 1.16), 2e-5), ("polar_express", (0.84, 1.16), 2e-5)]
)
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (3, 48, 160)])
def test_newton_schulz_orthogonalizes(coefficients, band, max_offdiag, shape):
    """X = NS(G) ~ U diag(s') V^T with s' in the polynomial's band: U^T X V is diagonal (the SVD's
    singular vectors, in float64) and its diagonal lies in the band."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    X = newton_schulz(G, steps=5, coefficients=coefficients, dtype="fp32")
    assert X.shape == G.shape and X.dtype == G.dtype
    U, S, Vh = svd_factors(G)
    M = U.mT @ X.double() @ Vh.mT  # (.., k, k)
    diag = torch.diagonal(M, dim1=-2, dim2=-1)
    offdiag = M - torch.diag_embed(diag)
    assert offdiag.abs().max() < max_offdiag
    assert band[0] <= diag.min() and diag.max() <= band[1], (diag.min(), diag.max())
    if coefficients == "polar_express":  # converges much closer to U V^T than the quintic
        q = newton_schulz(G, steps=5, coefficients="quintic", dtype="fp32")
        polar = U @ Vh
        assert (X.double() - polar).norm() < 0.5 * (q.double() - polar).norm()


def reference_muon(params, grads_per_step, lr, momentum, nesterov, coeffs):
    """nanochat's Muon.step, one matrix at a time, in float64."""
    params = [p.detach().double().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for p, g, buf in zip(params, grads, bufs):
            g = g.double().clone()
            buf.lerp_(g, 1 - momentum)
            g = g.lerp_(buf, momentum) if nesterov else buf
            p.add_(float64_newton_schulz(g, coeffs), alpha=-lr * max(1, p.size(-2) / p.size(-1)) ** 0.5)
    return params


@pytest.mark.parametrize("nesterov,coefficients", [(True, "quintic"), (False, "polar_express")])
def test_muon_matches_float64_reference(nesterov, coefficients):
    shapes = [(24, 40)] * 3 + [(40, 24)] * 2 + [(16, 16)]
    params = make_params(shapes)
    start = [p.detach().clone() for p in params]
    opt = Muon(
        [(f"m{i}", p) for i, p in enumerate(params)],
        lr=0.02,
        momentum=0.9,
        nesterov=nesterov,
        ns_coefficients=coefficients,
        ns_dtype="fp32",
    )
    assert sorted(len(g["params"]) for g in opt.param_groups) == [1, 2, 3]  # grouped by shape
    grads_per_step = []
    for step in range(1, 5):
        set_grads(params, step)
        grads_per_step.append([p.grad.clone() for p in params])
        opt.step()
    expected = reference_muon(start, grads_per_step, 0.02, 0.9, nesterov, published(coefficients))
    for p, e, s in zip(params, expected, start):
        assert (e - s.double()).abs().max() > 0.02  # the parameters moved ~0.03
        assert (p.detach().double() - e).abs().max() < 5e-6  # fp32 vs float64: ~3e-7 measured


def test_muon_rejects_vectors_and_bad_coefficients():
    with pytest.raises(ValueError, match="2-D"):
        Muon(make_params([(4,)]))
    with pytest.raises(ValueError, match="coefficients"):
        Muon(make_params([(4, 4)]), ns_coefficients="cubic")


# ---------------------------------------------------------------------------------------------
# optim.step: global-norm clipping and the NaN guard


def build_pair(seed=0):
    """An AdamW (vectors and an odd tensor) and a Muon (matrices) over separate parameters."""
    adam_params = make_params([(7, 3), (5,)], seed)
    muon_params = make_params([(6, 10), (6, 10), (10, 6)], seed + 1)
    adamw = AdamW(
        [(f"a{i}", p) for i, p in enumerate(adam_params)], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0
    )
    muon = Muon([(f"m{i}", p) for i, p in enumerate(muon_params)], lr=0.02, momentum=0.95, ns_dtype="fp32")
    return adam_params + muon_params, [adamw, muon]


def test_step_returns_global_norm_and_clips():
    params, opts = build_pair()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref_adam = torch.optim.AdamW(ref_params[:2], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0, foreach=False)
    ref_muon_start = [p.detach().clone() for p in ref_params[2:]]
    muon_grads = []
    for step, scale in ((1, 0.01), (2, 10.0)):  # clipped at step 2 only; Adam's moments see the scale change
        set_grads(params, step, scale)
        set_grads(ref_params, step, scale)
        expected = math.sqrt(sum(p.grad.double().square().sum().item() for p in params))
        norm = optim.step(opts, grad_clip=1.0)
        assert norm.dtype == torch.float32 and norm.dim() == 0
        assert norm.item() == pytest.approx(expected, rel=1e-6)
        clip = min(1.0, 1.0 / (expected + 1e-6))
        # the reference clips by hand, exactly like torch.nn.utils.clip_grad_norm_
        for p in ref_params:
            p.grad.mul_(clip)
        ref_adam.step()
        muon_grads.append([p.grad.clone() for p in ref_params[2:]])
    for a, b in zip(params[:2], ref_params[:2]):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    expected_muon = reference_muon(ref_muon_start, muon_grads, 0.02, 0.95, True, published("quintic"))
    for p, e in zip(params[2:], expected_muon):
        torch.testing.assert_close(p.detach().double(), e, rtol=0, atol=1e-5)


def snapshot(params, opts):
    return ([p.detach().clone() for p in params], [{k: v for k, v in o.shard_state_dict().items()} for o in opts])


def assert_same_snapshot(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for sa, sb in zip(a[1], b[1]):
        assert sa["num_updates"] == sb["num_updates"]
        assert sa["state"].keys() == sb["state"].keys()
        for name in sa["state"]:
            for k, v in sa["state"][name].items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, sb["state"][name][k]), (name, k)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_changes_nothing(bad):
    params, opts = build_pair()
    set_grads(params, 1)
    optim.step(opts, grad_clip=1.0)
    before = snapshot(params, opts)
    set_grads(params, 2)
    params[3].grad[1, 2] = bad  # one element of one Muon matrix
    norm = optim.step(opts, grad_clip=1.0)
    assert not torch.isfinite(norm)
    assert_same_snapshot(before, snapshot(params, opts))
    # and the next good step works as if the bad one never happened
    set_grads(params, 3)
    assert torch.isfinite(optim.step(opts, grad_clip=1.0))
    assert all(o.num_updates == 2 for o in opts)


# ---------------------------------------------------------------------------------------------
# state: save, reload, reshard


def run_steps(params, opts, steps):
    for step in steps:
        set_grads(params, step)
        optim.step(opts, grad_clip=1.0)


def test_state_roundtrip_through_file_is_bitwise(tmp_path):
    params, opts = build_pair()
    run_steps(params, opts, range(1, 4))
    torch.save([o.state_dict() for o in opts], tmp_path / "optim_rank0.pt")
    saved_params = [p.detach().clone() for p in params]
    run_steps(params, opts, range(4, 7))

    params2, opts2 = build_pair(seed=5)
    with torch.no_grad():
        for p, s in zip(params2, saved_params):
            p.copy_(s)
    for o, sd in zip(opts2, torch.load(tmp_path / "optim_rank0.pt", weights_only=True)):
        o.load_state_dict(sd)
    assert [o.num_updates for o in opts2] == [3, 3]
    run_steps(params2, opts2, range(4, 7))
    for a, b in zip(params, params2):
        assert torch.equal(a, b)


def split_shard(shard, world_size):
    """What world_size ranks would have saved: AdamW state cut into flat slices, Muon matrices
    dealt round-robin."""
    shards = [dict(shard, rank=r, world_size=world_size, state={}) for r in range(world_size)]
    for i, (name, entry) in enumerate(shard["state"].items()):
        if shard["kind"] == "muon":
            shards[i % world_size]["state"][name] = entry
            continue
        n = entry["numel"]
        s = -(-n // world_size)
        for r in range(world_size):
            lo, hi = min(r * s, n), min((r + 1) * s, n)
            if hi > lo:
                shards[r]["state"][name] = dict(
                    shape=entry["shape"],
                    offset=lo,
                    numel=hi - lo,
                    exp_avg=entry["exp_avg"][lo:hi].clone(),
                    exp_avg_sq=entry["exp_avg_sq"][lo:hi].clone(),
                )
    return shards


def test_load_state_saved_by_several_ranks():
    params, opts = build_pair()
    run_steps(params, opts, range(1, 3))
    full = [o.shard_state_dict() for o in opts]
    params2, opts2 = build_pair()
    for o, shard in zip(opts2, full):
        pieces = split_shard(shard, 3)
        o.load_shard_state_dicts(pieces[::-1])  # any order
    assert_same_snapshot(([], full), ([], [o.shard_state_dict() for o in opts2]))
    # a missing shard is an error naming what is missing, not silently zero state
    params3, opts3 = build_pair()
    with pytest.raises(ValueError, match="misses .* elements"):
        opts3[0].load_shard_state_dicts(split_shard(full[0], 3)[:2])
    with pytest.raises(ValueError, match="misses"):
        opts3[1].load_shard_state_dicts(split_shard(full[1], 3)[1:])


def test_load_rejects_mismatched_shards():
    params, opts = build_pair()
    run_steps(params, opts, range(1, 3))
    adam, muon = (o.shard_state_dict() for o in opts)
    with pytest.raises(ValueError, match="'adamw'"):
        opts[1].load_shard_state_dicts([adam])
    later = dict(adam, num_updates=adam["num_updates"] + 1)
    with pytest.raises(ValueError, match="different steps"):
        opts[0].load_shard_state_dicts([adam, later])
    with pytest.raises(ValueError, match="format"):
        opts[0].load_shard_state_dicts([{"state": {}}])
    other = AdamW([("other", torch.nn.Parameter(torch.zeros(3)))])
    with pytest.raises(ValueError, match="different model"):
        other.load_shard_state_dicts([adam])


def test_hyperparameters_follow_the_checkpoint():
    params, opts = build_pair()
    opts[1].param_groups[0]["momentum"] = 0.9
    run_steps(params, opts, range(1, 2))
    saved = opts[1].shard_state_dict()
    params2, opts2 = build_pair()
    opts2[1].load_state_dict(saved)
    assert opts2[1].param_groups[0]["momentum"] == 0.9
    assert opts2[1].state_nbytes() == opts[1].state_nbytes() == 4 * (2 * 60 + 60)


def test_grad_clip_zero_or_none_means_no_clipping():
    results = []
    for grad_clip in (None, 0.0):
        params, opts = build_pair()
        for step in (1, 2):
            set_grads(params, step, scale=10.0 * step)  # norms far above 1
            optim.step(opts, grad_clip=grad_clip)
        results.append(params)
    params, opts = build_pair()
    for step in (1, 2):
        set_grads(params, step, scale=10.0 * step)
        optim.step(opts, grad_clip=1.0)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not all(torch.equal(a, b) for a, b in zip(results[0], params))  # 1.0 does clip here
    with pytest.raises(ValueError, match="grad_clip"):
        optim.step(opts, grad_clip=-1.0)
