"""MuonRecipe and the polar-normuon recipe's parts of Muon: validation, the momentum and weight-decay
schedules (quintic: exactly the seeds' warmup; polar-normuon: nanochat's base_train rule), NorMuon,
cautious weight decay, MuonEq and Muon+ against a float64 reference written from their definitions,
exact resume, the tiny GPT training with muon_recipe="polar-normuon" (library level: the CLI flag is
wired by the run layer), and the presets' former names (seeds, current) as aliases. DistMuon with
these parts is tested on 2 and 3 processes in distributed/test_dist_parity.py."""

import math

import pytest
import torch
from support.newton_schulz_reference import (  # the published coefficients, not the package's
    float64_newton_schulz,
    published,
)
from support.tiny_gpt import counting_batches, counting_model, train_on

from nanochat_fast.optim import Muon, MuonRecipe
from nanochat_fast.optim import recipe as recipes
from nanochat_fast.train import training_loop


def test_presets():
    quintic, polar = MuonRecipe.preset("quintic"), MuonRecipe.preset("polar-normuon")
    assert quintic == MuonRecipe() and quintic.muon_kwargs()["normuon_beta"] is None
    assert (quintic.ns_coefficients, quintic.momentum_start, quintic.momentum, quintic.weight_decay) == (
        "quintic",
        0.85,
        0.95,
        0.0,
    )
    assert (polar.ns_coefficients, polar.normuon, polar.normuon_beta, polar.cautious_weight_decay) == (
        "polar_express",
        True,
        0.9,
        True,
    )
    assert polar.ns_dtype == quintic.ns_dtype == "auto"
    assert MuonRecipe.preset("polar-normuon", normuon=False).muon_kwargs()["normuon_beta"] is None
    assert "muon recipe polar-normuon: polar_express x5" in polar.describe()
    assert "NorMuon beta 0.9" in polar.describe() and "cautious wd 0.28" in polar.describe()
    assert MuonRecipe.of(polar) is polar and MuonRecipe.of("quintic") == quintic


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(ns_steps=0), "ns_steps"),
        (dict(ns_dtype="fp16"), "ns_dtype"),
        (dict(normuon_beta=1.0), "normuon_beta"),
        (dict(normuon=1), "normuon"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(momentum=1.2), "momentum"),
        (dict(ns_coefficients="cubic"), "ns_coefficients"),
        (dict(momentum_warmdown_ratio=1.5), "momentum_warmdown_ratio"),
        (dict(weight_decay_schedule="linear"), "weight_decay_schedule"),
        (dict(momentum_warmup_steps=-1), "momentum_warmup_steps"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        MuonRecipe.preset("quintic", **overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match="quintic, polar-normuon"):
        MuonRecipe.preset("modded")
    with pytest.raises(ValueError, match="name must be one of quintic, polar-normuon"):
        MuonRecipe(name="modded")


def test_quintic_momentum_is_the_seeds_warmup():
    recipe = MuonRecipe.preset("quintic")
    for step in list(range(0, 320)) + [1000, 10**6]:
        frac = min(step / 300, 1.0)
        assert recipe.momentum_at(step, 500) == (1 - frac) * 0.85 + frac * 0.95
        assert recipe.momentum_at(step, None) == recipe.momentum_at(step, 500)
    assert recipe.weight_decay_at(10, 100) == 0.0


def test_polar_normuon_momentum_and_weight_decay_schedules():
    """nanochat base_train: 0.85 -> 0.97 over 400 steps, then 0.97 -> 0.90 over the warmdown
    (round(ratio * N) last steps, the warmup winning where they overlap); wd cosine to 0."""
    r = MuonRecipe.preset("polar-normuon", momentum_warmdown_ratio=0.5)
    assert r.momentum_at(0, 2000) == pytest.approx(0.85)
    assert r.momentum_at(200, 2000) == pytest.approx(0.91)
    assert r.momentum_at(999, 2000) == pytest.approx(0.97)
    assert r.momentum_at(1000, 2000) == pytest.approx(0.97)  # warmdown starts at 2000 - 1000
    assert r.momentum_at(1500, 2000) == pytest.approx(0.935)
    assert r.momentum_at(1999, 2000) == pytest.approx(0.97 - 0.07 * 999 / 1000)
    assert r.momentum_at(300, 400) == pytest.approx(0.85 + 0.12 * 300 / 400)  # still warming up
    assert r.momentum_at(5000, None) == pytest.approx(0.97)  # no horizon: no warmdown
    assert r.weight_decay_at(0, 100) == pytest.approx(0.28)
    assert r.weight_decay_at(50, 100) == pytest.approx(0.14)
    assert r.weight_decay_at(100, 100) == pytest.approx(0.0, abs=1e-12)
    scaled = r.scaled_weight_decay(total_batch_size=2**17, tokens=4e8, reference_tokens=8e8)
    assert scaled.weight_decay == pytest.approx(0.28 * 0.5 * 2)


# ---------------------------------------------------------------------------------------------
# the update against float64


def reference_polar_normuon(params, grads_per_step, lr, momentum, beta, wd, coeffs, lr_muls, wd_muls):
    """Muon with MuonEq, Muon+, NorMuon and cautious weight decay, from the definitions, float64,
    one matrix at a time."""
    params = [p.detach().double().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    second = [None] * len(params)
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads)):
            rows, cols = p.shape
            g = g.double()
            bufs[i] = momentum * bufs[i] + (1 - momentum) * g
            x = (1 - momentum) * g + momentum * bufs[i]  # Nesterov
            x = x * (x.norm() / math.sqrt(rows)) / x.norm(dim=1, keepdim=True)  # MuonEq
            u = float64_newton_schulz(x, coeffs)
            u = u * math.sqrt(min(rows, cols)) / u.norm()  # Muon+
            stat = (u**2).mean(dim=1, keepdim=True) if rows >= cols else (u**2).mean(dim=0, keepdim=True)
            second[i] = (1 - beta) * stat if second[i] is None else beta * second[i] + (1 - beta) * stat
            w = u / second[i].sqrt()
            u = w * u.norm() / w.norm()  # NorMuon
            step_lr = lr * lr_muls[i] * max(1, rows / cols) ** 0.5
            agree = (u * p >= 0).double()  # cautious
            params[i] = p - step_lr * wd * wd_muls[i] * agree * p - step_lr * u
    return params


def nanochat_polar_express():
    """The published Polar Express steps on an input nanochat divides by 1.01 times its norm
    (X/1.01 through the first step: a/1.01, b/1.01^3, c/1.01^5)."""
    (a, b, c), *rest = published("polar_express")
    return [(a / 1.01, b / 1.01**3, c / 1.01**5), *rest]


def make_params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def polar_normuon_muon(params, **overrides):
    kwargs = dict(MuonRecipe.preset("polar-normuon", ns_dtype="fp32", weight_decay=0.3).muon_kwargs(), lr=0.05)
    return Muon([(f"m{i}", p) for i, p in enumerate(params)], **{**kwargs, **overrides})


def test_polar_normuon_update_matches_float64_reference():
    shapes = [(24, 40), (24, 40), (40, 24), (16, 16)]  # wide (per-column v), tall (per-row), square
    params = make_params(shapes)
    params[1].lr_mul, params[2].wd_mul = 2.0, 0.5
    start = [p.detach().clone() for p in params]
    opt = polar_normuon_muon(params, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    grads_per_step = []
    for _ in range(2):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        grads_per_step.append(grads)
        opt.step()
    expected = reference_polar_normuon(
        start,
        grads_per_step,
        0.05,
        0.9,
        0.9,
        0.3,
        nanochat_polar_express(),
        [1.0, 2.0, 1.0, 1.0],
        [1.0, 1.0, 0.5, 1.0],
    )
    for p, e, s in zip(params, expected, start):
        assert (e - s.double()).abs().max() > 0.05  # moved, decay included (~0.05 * 0.3 * |p|)
        assert (p.detach().double() - e).abs().max() < 1e-5
    # without the cautious mask the result is measurably different: the mask is being applied
    plain = reference_polar_normuon(
        start, grads_per_step, 0.05, 0.9, 0.9, 0.0, nanochat_polar_express(), [1.0] * 4, [1.0] * 4
    )
    assert max((a - b).abs().max() for a, b in zip(expected, plain)) > 1e-3
    second = opt.state[params[0]]["normuon_second_moment"]
    assert second.shape == (1, 40) and opt.state[params[2]]["normuon_second_moment"].shape == (40, 1)


def test_cautious_decay_only_where_signs_agree():
    """With a zero gradient the update is 0 (NS of 0), so u * p >= 0 everywhere: full decay; the
    same weight decay without the cautious mask agrees there, and quintic's Muon has none."""
    p = make_params([(8, 12)])[0]
    start = p.detach().clone()
    opt = polar_normuon_muon([p], normuon_beta=None, equilibrate_rows=False, renormalize=False)
    p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(p.detach(), start * (1 - 0.05 * 0.3), rtol=1e-6, atol=0)


def test_resume_is_exact(tmp_path):
    shapes = [(24, 40), (40, 24), (40, 24)]
    runs = []
    for resume in (False, True):
        params = make_params(shapes)
        opt = polar_normuon_muon(params)
        gen = torch.Generator().manual_seed(3)
        for step in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if resume and step == 2:  # save after 2 steps, rebuild everything, load, go on
                torch.save(opt.state_dict(), tmp_path / "optim.pt")
                old = params
                params = make_params(shapes, seed=9)
                with torch.no_grad():
                    for p, q in zip(params, old):
                        p.copy_(q)
                        p.grad = q.grad
                opt = polar_normuon_muon(
                    params, normuon_beta=None, weight_decay=0.0
                )  # hyperparameters come from the file
                opt.load_state_dict(torch.load(tmp_path / "optim.pt", weights_only=True))
                assert opt.param_groups[0]["normuon_beta"] == 0.9 and opt.param_groups[0]["weight_decay"] == 0.3
            opt.step()
        runs.append(([p.detach() for p in params], opt.state_dict()))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    for name, entry in runs[0][1]["state"].items():
        for key in ("momentum_buffer", "normuon_second_moment"):
            assert torch.equal(entry[key], runs[1][1]["state"][name][key])


# ---------------------------------------------------------------------------------------------
# the tiny GPT and the training loop's schedule


def test_polar_normuon_recipe_trains_the_tiny_gpt():
    """30 steps with muon_recipe="polar-normuon" (NS in fp32, as auto gives here and to keep the test
    exact on bf16 CPUs): the loss falls, and the optimizer says which recipe ran."""
    model = counting_model()
    opts = model.setup_optimizers(muon_recipe=MuonRecipe.preset("polar-normuon", ns_dtype="fp32"))
    muon = opts[1]
    assert muon.recipe.name == "polar-normuon" and muon.recipe.describe().startswith("muon recipe polar-normuon")
    assert muon.param_groups[0]["normuon_beta"] == 0.9 and muon.param_groups[0]["cautious_weight_decay"]

    def the_loops_schedule(step):
        momentum = training_loop.muon_momentum(opts, step, 30)
        assert momentum == muon.recipe.momentum_at(step, 30) == muon.param_groups[0]["momentum"]
        assert muon.param_groups[0]["weight_decay"] == pytest.approx(muon.recipe.weight_decay_at(step, 30))

    final, losses = train_on(model, opts, counting_batches(30), before_step=the_loops_schedule)
    assert len(losses) == 30
    assert final < losses[0] - 1.0, (losses[0], final)
    assert all(math.isfinite(x) for x in losses)


def test_setup_optimizers_keeps_its_arguments():
    model = counting_model()
    adamw, muon = model.setup_optimizers(matrix_lr=0.01, weight_decay=0.1, ns_coefficients="polar_express")
    assert muon.recipe.name == "quintic" and muon.recipe.ns_coefficients == "polar_express"
    assert muon.param_groups[0]["lr"] == 0.01 and muon.param_groups[0]["weight_decay"] == 0.0
    assert adamw.param_groups[0]["weight_decay"] == 0.1
    assert training_loop.muon_momentum([adamw, muon], 150, None) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="muon recipe"):
        model.setup_optimizers(muon_recipe="nanochat")


# ---------------------------------------------------------------------------------------------
# the presets' former names, accepted for one release


@pytest.fixture
def fresh_process(monkeypatch):
    """As in a new process: no former name has printed its notice yet."""
    monkeypatch.setattr(recipes, "_noticed", set())


def settings_of(opt):
    """Everything that makes an optimizer what it is, but its parameters' values."""
    return (
        type(opt),
        opt.recipe,
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        [[[opt.names[p] for p, _, _ in slots] for slots in b.slots] for b in opt.buckets],  # who owns what
    )


@pytest.mark.parametrize("old,new", [("seeds", "quintic"), ("current", "polar-normuon")])
def test_a_former_name_prints_one_notice_and_builds_the_same_optimizer(old, new, fresh_process, capsys):
    model = counting_model()
    _, muon_old = model.setup_optimizers(muon_recipe=old)
    for _ in range(2):  # used again in the same process: no second notice
        assert MuonRecipe.preset(old) == MuonRecipe.preset(new) and MuonRecipe.of(old).name == new
        assert MuonRecipe(name=old) == MuonRecipe(name=new)
    assert capsys.readouterr().err.splitlines() == [
        f"note: the muon recipe '{old}' is now called '{new}' (--muon-recipe={new}); '{old}' will stop working "
        "in the next release"
    ]
    _, muon_new = model.setup_optimizers(muon_recipe=new)
    assert capsys.readouterr().err == ""
    assert muon_old.recipe.name == new and settings_of(muon_old) == settings_of(muon_new)
