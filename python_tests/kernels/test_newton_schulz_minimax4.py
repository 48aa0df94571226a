"""The minimax4 schedule (4 Newton-Schulz steps) against float64: it keeps the singular-value band of 5 quintic
steps, its bf16 run stays within the policy's 2e-2 of its float64 run, and the minimax4 recipe runs it."""

import pytest
import torch
from support.newton_schulz_reference import QUINTIC, float64_newton_schulz, make_input

from nanochat_fast.kernels import newton_schulz
from nanochat_fast.kernels.newton_schulz import MINIMAX4, resolve_coefficients
from nanochat_fast.optim import Muon, MuonRecipe

BAND = (0.68, 1.20)  # where 5 quintic steps put sigma / ||G||_F in [1.5e-3, 1]
MINIMAX4_FROM = 2.5e-3  # where minimax4 keeps the same band from


def test_minimax4_keeps_the_band_of_five_quintic_steps_in_float64():
    # sigmas relative to ||G||_F: one at 1 would leave no room for others, so a vector of them whose norm is 1
    grid = torch.logspace(-4, 0, 4001, dtype=torch.float64)
    quintic = grid.clone()
    minimax = grid.clone()
    for a, b, c in (QUINTIC,) * 5:
        quintic = a * quintic + b * quintic**3 + c * quintic**5
    for a, b, c in MINIMAX4:
        minimax = a * minimax + b * minimax**3 + c * minimax**5
    lo, hi = BAND
    q = quintic[grid >= 1.5e-3]
    assert lo - 1e-3 <= q.min() and q.max() <= hi + 3e-3  # the band itself, measured on 5 quintic steps
    m = minimax[grid >= MINIMAX4_FROM]
    assert lo - 1e-6 <= m.min() and m.max() <= hi + 1e-6
    assert minimax[grid < 2.2e-3].min() < lo  # and no more: below 2.5e-3 it is short of the band


def test_minimax4_through_the_iteration_matches_its_polynomial():
    """The same map on singular values when run as the matrix iteration (float64), on a matrix whose
    singular values span 1e-2 .. 1 of the largest."""
    sigmas = torch.logspace(-2, 0, 64, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(256, 64, generator=gen, dtype=torch.float64))
    G = U @ torch.diag(sigmas) @ V.T
    out = float64_newton_schulz(G, MINIMAX4)
    got = torch.linalg.svdvals(out)
    x = sigmas / sigmas.norm()
    for a, b, c in MINIMAX4:
        x = a * x + b * x**3 + c * x**5
    assert torch.allclose(got.sort().values, x.sort().values, atol=1e-9)
    assert got.min() >= BAND[0] - 1e-6 and got.max() <= BAND[1] + 1e-6  # all of them >= 2.5e-3 of ||G||_F


@pytest.mark.parametrize("kind", ["gaussian", "low_rank"])
@pytest.mark.parametrize("shape", [(96, 192), (3, 40, 100), (130, 64), (256, 1024)])
def test_minimax4_in_bf16_within_the_policy_bound_of_float64(kind, shape):
    """The policy's bound, 2e-2 max abs of bf16 from float64 on Gaussian inputs (measured 4e-3 .. 9e-3);
    on low-rank ones, where 5 quintic steps in bf16 are off by up to 9e-2 themselves, no worse than
    2e-2 or than they are."""

    def bf16_error(coefficients, steps, coeffs):
        out = newton_schulz(G, steps=steps, coefficients=coefficients, dtype=torch.bfloat16)
        return (out.double() - float64_newton_schulz(G, coeffs)).abs().max().item()

    G = make_input(shape, kind)
    error = bf16_error("minimax4", 4, MINIMAX4)
    bound = 2e-2 if kind == "gaussian" else max(2e-2, bf16_error("quintic", 5, (QUINTIC,) * 5))
    assert error <= bound, (error, bound)


def test_minimax4_fp32_matches_float64():
    G = make_input((64, 160))
    out = newton_schulz(G, steps=4, coefficients="minimax4", dtype=torch.float32)
    assert (out.double() - float64_newton_schulz(G, MINIMAX4)).abs().max() <= 1e-4


def test_minimax4_has_exactly_four_steps():
    assert resolve_coefficients("minimax4", 4) == MINIMAX4
    for steps in (3, 5):
        with pytest.raises(ValueError, match="exactly 4 steps"):
            resolve_coefficients("minimax4", steps)


def test_the_minimax4_recipe_is_quintics_muon_with_four_tuned_steps():
    quintic, fast = MuonRecipe.preset("quintic"), MuonRecipe.preset("minimax4")
    assert (fast.ns_coefficients, fast.ns_steps) == ("minimax4", 4)
    differs = {f for f in quintic.__dataclass_fields__ if getattr(quintic, f) != getattr(fast, f)}
    assert differs == {"name", "ns_coefficients", "ns_steps"}
    assert MuonRecipe().name == "quintic"  # the default is unchanged
    # one Muon step with the recipe's kwargs: the update is lr * minimax4(g) (from zero momentum, Nesterov's
    # blend is a multiple of g, which the iteration's normalisation removes), against the float64 iteration
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(48, 96, generator=gen))
    p.grad = torch.randn(48, 96, generator=gen)
    start = p.detach().clone()
    kwargs = {**fast.muon_kwargs(), "ns_dtype": "fp32"}
    Muon([p], lr=0.02, **kwargs).step()
    expected = start.double() - 0.02 * float64_newton_schulz(p.grad, MINIMAX4)
    assert (p.detach().double() - expected).abs().max() <= 0.02 * 1e-4
