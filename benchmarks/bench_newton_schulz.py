"""Newton-Schulz (5 quintic steps): every backend that runs here vs the plain-PyTorch reference.

Shapes: the matrices of GPT-2-small-sized layers (768x768, 768x3072 and its transpose), a
1024x4096 one, and a stack of 8 768x768 matrices (what Muon orthogonalizes per call for a group of
same-shape matrices). On CPU everything is fp32 (the reference and the `torch` backend); on a GPU
bf16 (the reference and the `triton` kernels). The notes give the flops each variant computes:
the torch backend's form (symmetric products, or the Gram form for aspect >= 2) and the Triton
kernels' tiles on/above the diagonal.
"""
import importlib

import pytest
import torch

from harness import compare
from nanochat_fast.kernels import newton_schulz, registry

ns = importlib.import_module("nanochat_fast.kernels.newton_schulz")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(768, 768), (768, 3072), (3072, 768), (1024, 4096), (8, 768, 768)]


def plain_flops(shape, steps=5):
    k = shape[0] if len(shape) == 3 else 1
    m, n = sorted(shape[-2:])
    return k * steps * (4 * m * m * n + 2 * m ** 3)


def torch_backend_flops(shape, steps=5):
    """What the torch backend computes: symmetric products cost (p+1)/(2p) of full ones."""
    k = shape[0] if len(shape) == 3 else 1
    m, n = sorted(shape[-2:])
    p = len(ns._block_rows(m))
    sym = (p + 1) / (2 * p)
    if n >= ns.GRAM_MIN_ASPECT * m:  # segments: X X^T once and P X once each; m x m products
        segments = len(ns.restart_points(steps)) + 1
        mm_products = 4 * steps - 3 * segments  # A^2 and Q P and Q(QA) twice, minus per-segment savings
        return k * (segments * (sym * 2 * m * m * n + 2 * m * m * n) + mm_products * sym * 2 * m ** 3)
    return k * steps * (sym * 2 * m * m * n + sym * 2 * m ** 3 + 2 * m * m * n)


def notes(shape):
    plain = plain_flops(shape)
    parts = [f"plain {plain / 1e9:.1f} GFLOP"]
    if DEVICE == "cpu":
        m, n = sorted(shape[-2:])
        form = "Gram form" if n >= ns.GRAM_MIN_ASPECT * m else "symmetric products"
        ours = torch_backend_flops(shape)
        parts.append(f"torch backend ({form}) {ours / 1e9:.1f} GFLOP = 1/{plain / ours:.2f}")
    else:
        from nanochat_fast.kernels import newton_schulz_triton as nst
        k = shape[0] if len(shape) == 3 else 1
        m, n = sorted(shape[-2:])
        f = nst.step_flops(torch.device(DEVICE), k, m, n)
        parts.append(f"triton {5 * f['step'] / 1e9:.1f} GFLOP = 1/{plain / (5 * f['step']):.2f}")
    return "; ".join(parts)


def backends_here():
    return [name for name, impl in registry.backends(ns.OP).items() if impl.why_not(DEVICE) is None]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_newton_schulz(benchmark, shape):
    G = torch.randn(shape, device=DEVICE)
    expected = newton_schulz(G, backend="reference").double()
    variants = {}
    for name in backends_here():
        out = newton_schulz(G, backend=name)
        tol = 2e-2 if ns.compute_dtype(G.device) == torch.bfloat16 else 1e-4
        assert (out.double() - expected).abs().max() <= tol, name  # same result, or no comparison
        variants[name] = (lambda name=name: newton_schulz(G, backend=name))
    compare(benchmark, op=f"Newton-Schulz, 5 quintic steps ({DEVICE})", shape_set="x".join(map(str, shape)),
            variants=variants, baseline="reference", rounds=11, notes=notes(shape))
