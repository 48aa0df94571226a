"""
newton_schulz: the Newton-Schulz orthogonalization at the heart of Muon.

Given G (m x n, or a stack K x m x n), returns an approximation of U V^T from G = U S V^T:
X = G / (||G||_F + 1e-7), then per step (a, b, c):  A = X X^T;  B = b A + c A A;  X = a X + B X.
Tall matrices are transposed once so X X^T is the small Gram matrix. Computes in bf16 on CUDA and
in fp32 on CPU/MPS, returns `out_dtype` (default: G's dtype).

Backends:
    triton     CUDA: symmetric X X^T and b A + c A A (only tiles on/above the diagonal), fused
               a X + B X, one launch per kernel for a whole stack (newton_schulz_triton.py)
    torch      CPU: fp32 with fewer flops, symmetric block products and, for wide matrices, the
               Gram form (see "the torch backend" below); 1.1-1.3x (square) to 1.7-2.0x (1:4)
               faster than the reference here (benchmarks/RESULTS.md)
    reference  the plain iteration, as nanochat writes it
"""
import torch

from . import registry
from .registry import always, register_backend, register_op, triton_why_not

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


@register_backend(OP, "triton", triton_why_not)
def triton_backend(G, coeffs):
    from .newton_schulz_triton import newton_schulz_triton  # imported late: TRITON_INTERPRET is read at import
    return newton_schulz_triton(G, coeffs)


# ---------------------------------------------------------------------------------------------
# the torch backend
#
# Two exact rewrites of the iteration, both with fewer flops than the plain one:
#
# 1. Symmetric products. X X^T and A A are symmetric: computing only the block rows' parts on and
#    right of the diagonal, [i0:i1, i0:], and mirroring costs (p+1)/(2p) of the full product for
#    p block rows. The blocks are strided views written in place by bmm/baddbmm (BLAS takes the
#    row stride), and b A + c A A and a X + B X are one baddbmm each, with no elementwise pass.
#
# 2. The Gram form, for wide matrices (n >= GRAM_MIN_ASPECT m). Every X_k is P_k X_0 with P_k a
#    polynomial in A_0 = X_0 X_0^T, and so is A_k: with Q = a I + b A + c A^2,
#        X_{k+1} = Q X_k,   P_{k+1} = Q P_k,   A_{k+1} = Q A_k Q = Q^2 A_k.
#    So the steps run on m x m symmetric matrices (all polynomials in A_0, so they commute and
#    every product is symmetric) and X is formed once: 2 X X^T + 2 P X + 14 m x m products for 5
#    steps, against 5 (X X^T + A A + B X) plainly: 2.1x fewer flops at 1:4. P grows like a^k
#    on the small singular directions (3.4445^5 ~ 490), and so does its rounding error: on
#    low-rank inputs the unrestarted form is off by up to 2e-2 (fp32 plain: 1e-5). Forming X and
#    restarting from X X^T after 2 steps and then every 3 (a few m^2 n flops) brings it back to the
#    plain iteration's level (tested against float64 on low-rank inputs). fp32 only: in bf16 the
#    same amplification is not recoverable, so bf16 always takes the direct form.

# Measured on the 2-core AVX-512 CPU (fp32, MKL): the Gram form ties the direct one at n/m = 1.5
# and is 5-15% faster at 2; block rows of 128..256 are within noise of each other, splitting pays
# from ~256 rows.
GRAM_MIN_ASPECT = 2.0
SYM_MIN_ROWS = 256
SYM_BLOCK_ROWS = 192


def restart_points(steps: int) -> list[int]:
    """Steps at which the Gram form re-forms X and restarts: after 2 steps, then every 3."""
    return list(range(2, steps, 3))


def _block_rows(m: int) -> list[tuple[int, int]]:
    if m < SYM_MIN_ROWS:
        return [(0, m)]
    p = max(2, round(m / SYM_BLOCK_ROWS))
    edges = [round(i * m / p) for i in range(p + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _symmetric_product(L, R, out, C=None, beta=0.0, alpha=1.0):
    """out = beta C + alpha L R^T for (K, m, k) stacks L, R whose product is known to be symmetric
    (X X^T, A A, products of commuting symmetric matrices). Returns out."""
    rows = _block_rows(out.size(-1))
    for i0, i1 in rows:
        block = out[:, i0:i1, i0:]
        base = block if C is None else C[:, i0:i1, i0:]
        torch.baddbmm(base, L[:, i0:i1], R[:, i0:].mT, beta=0.0 if C is None else beta, alpha=alpha, out=block)
    for i0, i1 in rows[:-1]:
        out[:, i1:, i0:i1].copy_(out[:, i0:i1, i1:].mT)
    return out


def _direct(S, coeffs, wide):
    """The plain iteration with symmetric products, on the normalised stack S (K, rows, cols)."""
    X = S if wide else S.mT  # (K, m, n), m <= n: a view, no copy
    m = X.size(-2)
    A, B = S.new_empty(S.size(0), m, m), S.new_empty(S.size(0), m, m)
    Y = torch.empty_like(S)
    for a, b, c in coeffs:
        _symmetric_product(X, X, A)
        _symmetric_product(A, A, B, C=A, beta=b, alpha=c)
        if wide:
            torch.baddbmm(S, B, S, beta=a, out=Y)   # a X + B X
        else:
            torch.baddbmm(S, S, B, beta=a, out=Y)   # (a X + B X)^T = a S + S B, B symmetric
        S, Y = Y, S
        X = S if wide else S.mT
    return S


def _gram(S, coeffs, wide):
    """The Gram form with restarts, on the normalised fp32 stack S (K, rows, cols)."""
    X = S if wide else S.mT
    m = X.size(-2)
    A, Q, P, T = (S.new_empty(S.size(0), m, m) for _ in range(4))
    bounds = [0] + restart_points(len(coeffs)) + [len(coeffs)]
    for start, end in zip(bounds[:-1], bounds[1:]):
        _symmetric_product(X, X, A)
        for k in range(start, end):
            a, b, c = coeffs[k]
            _symmetric_product(A, A, Q, C=A, beta=b, alpha=c)   # Q = a I + b A + c A^2
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
            if k == start:
                P, Q = Q, P                                      # P = Q
            else:
                _symmetric_product(Q, P, T)                      # P = Q P
                P, T = T, P
            if k < end - 1:
                step_q = P if k == start else Q
                _symmetric_product(step_q, A, T)                 # A = Q (Q A)
                _symmetric_product(step_q, T, A)
        S = torch.bmm(P, S) if wide else torch.bmm(S, P)         # X = P X, formed once per segment
        X = S if wide else S.mT
    return S


@register_backend(OP, "torch", always)
def newton_schulz_torch(G, coeffs):
    """fp32 on CPU (bf16 where the device computes in bf16, always in the direct form)."""
    dtype = compute_dtype(G.device)
    stack = G if G.dim() == 3 else G.unsqueeze(0)
    wide = stack.size(-2) <= stack.size(-1)
    norm = torch.linalg.vector_norm(stack, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    S = (stack / (norm + 1e-7)).to(dtype).contiguous()
    m, n = sorted(stack.shape[-2:])
    gram = dtype == torch.float32 and n >= GRAM_MIN_ASPECT * m
    S = _gram(S, coeffs, wide) if gram else _direct(S, coeffs, wide)
    return S if G.dim() == 3 else S[0]
