"""What the Newton-Schulz and Muon tests check against: the published coefficients written out, the
iteration in float64 written from the math, their inputs, and a torch-backend path forced."""

import importlib

import torch

ns = importlib.import_module("nanochat_fast.kernels.newton_schulz")

# The published coefficients, written out here rather than imported, so that the references of
# the Newton-Schulz and Muon tests do not inherit a wrong constant from the package:
# Keller Jordan's quintic (a, b, c) for every step, and the 5-step Polar Express table (Amsel et
# al. 2025, arXiv:2505.16932) as modded-nanogpt's train_gpt.py and nanochat use it.
QUINTIC = (3.4445, -4.7750, 2.0315)
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def published(coefficients, steps=5):
    """The (a, b, c) of each step: "quintic", "polar_express" (its first `steps` rows) or a list."""
    if coefficients == "quintic":
        return (QUINTIC,) * steps
    if coefficients == "polar_express":
        return POLAR_EXPRESS[:steps]
    return tuple(coefficients)


def float64_newton_schulz(G, coeffs):
    """The iteration written from the math, in float64: normalise, orient m <= n, step."""
    X = G.double()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in coeffs:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def make_input(shape, kind="gaussian", seed=0):
    gen = torch.Generator().manual_seed(seed)
    G = torch.randn(shape, generator=gen)
    if kind == "low_rank":  # rank 4 plus tiny noise: many small singular values, as in real gradients
        left = torch.randn((*shape[:-1], 4), generator=gen)
        right = torch.randn((*shape[:-2], 4, shape[-1]), generator=gen)
        G = left @ right + 1e-5 * G
    return G


def force_path(monkeypatch, path, split_gram=True):
    """The torch backend made to take `path` ("plain", "symmetric" or "gram") for every shape, and
    symmetric_pays to answer split_gram."""
    monkeypatch.setattr(ns, "choose_path", lambda *args: path)
    monkeypatch.setattr(ns, "symmetric_pays", lambda *args: split_gram)
