"""
newton_schulz: the Newton-Schulz orthogonalization at the heart of Muon.

Given G (m x n, or a stack K x m x n), returns an approximation of U V^T from G = U S V^T:
X = G / (||G||_F + 1e-7), then per step (a, b, c):  A = X X^T;  B = b A + c A A;  X = a X + B X.
Tall matrices are transposed once so X X^T is the small Gram matrix. Computes in bf16 on CUDA and
in fp32 on CPU/MPS (this CPU has no native bf16), returns `out_dtype` (default: G's dtype).
"""
import torch

from . import registry
from .registry import always, register_backend, register_op

OP = "newton_schulz"
register_op(OP, auto_order={
    "cuda": ("triton", "reference"),
    "cpu": ("torch", "reference"),
    "mps": ("reference",),
})

QUINTIC = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel et al. 2025, arXiv:2505.16932), 5 steps, as used by modded-nanogpt.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def resolve_coefficients(coefficients, steps: int) -> tuple[tuple[float, float, float], ...]:
    """'quintic' | 'polar_express' | a list of (a, b, c) per step -> one (a, b, c) per step."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if coefficients == "quintic":
        return (QUINTIC,) * steps
    if coefficients == "polar_express":
        if steps > len(POLAR_EXPRESS):
            raise ValueError(f"coefficients='polar_express' has {len(POLAR_EXPRESS)} steps, got steps={steps}")
        return POLAR_EXPRESS[:steps]
    if isinstance(coefficients, str):
        raise ValueError(f"coefficients must be 'quintic', 'polar_express' or a list of (a, b, c), got {coefficients!r}")
    table = tuple(tuple(float(x) for x in abc) for abc in coefficients)
    if len(table) != steps or any(len(abc) != 3 for abc in table):
        raise ValueError(f"coefficients must hold {steps} (a, b, c) triples, one per step, got {coefficients!r}")
    return table


def compute_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients="quintic", out_dtype=None, *, backend=None):
    """Orthogonalize G (2-D, or 3-D as a batch of same-shape matrices) with `steps` iterations."""
    if G.dim() not in (2, 3):
        raise ValueError(f"G must be 2-D or a 3-D stack of matrices, got shape {tuple(G.shape)}")
    coeffs = resolve_coefficients(coefficients, steps)
    impl = registry.select(OP, G.device.type, backend)
    return impl.fn(G, coeffs).to(out_dtype or G.dtype)


@register_backend(OP, "reference", always)
def newton_schulz_reference(G, coeffs):
    """The plain PyTorch iteration, as in nanochat's zeropower_via_newtonschulz5."""
    X = G.to(compute_dtype(G.device))
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in coeffs:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if transposed else X
