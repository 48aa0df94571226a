"""
newton_schulz: the Newton-Schulz orthogonalization at the heart of Muon, and every choice it makes.
G (m x n, or a stack K x m x n) -> approximately U V^T of G = U S V^T: X = G / (||G||_F + 1e-7), then per
step (a, b, c) A = X X^T, B = b A + c A A, X = a X + B X (tall matrices transposed once, so A is the small
Gram matrix). A call resolves its coefficients, its compute dtype (the input is normalised in fp32, the
result cast to `out_dtype`), its path (PATH_TABLE) and its backend (plan).
"""

import functools

import torch

from ..hardware import precision
from ..hardware.machine import cpu_bf16_support
from . import newton_schulz_triton, registry  # noqa: F401  (newton_schulz_triton: registers its op)

OP = "newton_schulz"

# -- the coefficients -------------------------------------------------------------------------
QUINTIC = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel et al. 2025, arXiv:2505.16932), 5 steps, as used by modded-nanogpt.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# minimax4: 4 steps that keep the singular-value band of 5 quintic steps ([0.68, 1.20] for sigma / ||G||_F
# in [2.5e-3, 1] instead of [1.5e-3, 1]) for 4/5 of the products. Built as Polar Express builds its steps
# (each the minimax odd quintic on the interval the previous ones leave, fitted 2% past its top so a bf16
# rounding up does not blow up), the last scaled to the band's centre: docs/measurements.md#newton-schulz-in-4-steps.
MINIMAX4 = (
    (8.242664441512078, -23.426191774131343, 16.694413472196352),
    (4.004924779560354, -2.8663643231211355, 0.5193007965007853),
    (3.5691290841182965, -2.571840696790716, 0.4880117132458294),
    (2.4752094270454656, -1.7788068580866805, 0.3922456223072339),
)


# The named schedules and their steps: a flag naming one takes its steps with it.
SCHEDULES = {"quintic": 5, "polar_express": len(POLAR_EXPRESS), "minimax4": len(MINIMAX4)}


def resolve_coefficients(coefficients, steps: int) -> tuple[tuple[float, float, float], ...]:
    """'quintic' | 'polar_express' | 'minimax4' | a list of (a, b, c) per step -> one (a, b, c) per step."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if coefficients == "quintic":
        return (QUINTIC,) * steps
    if coefficients == "polar_express":
        if steps > len(POLAR_EXPRESS):
            raise ValueError(f"coefficients='polar_express' has {len(POLAR_EXPRESS)} steps, got steps={steps}")
        return POLAR_EXPRESS[:steps]
    if coefficients == "minimax4":
        if steps != len(MINIMAX4):  # its last step is scaled for the band: no prefix keeps it
            raise ValueError(f"coefficients='minimax4' has exactly {len(MINIMAX4)} steps, got steps={steps}")
        return MINIMAX4
    if isinstance(coefficients, str):
        raise ValueError(
            f"coefficients must be 'quintic', 'polar_express', 'minimax4' or a list of (a, b, c), got {coefficients!r}"
        )
    table = tuple(tuple(float(x) for x in abc) for abc in coefficients)
    if len(table) != steps or any(len(abc) != 3 for abc in table):
        raise ValueError(f"coefficients must hold {steps} (a, b, c) triples, one per step, got {coefficients!r}")
    return table


# -- the dtype --------------------------------------------------------------------------------
# None or "auto" (Muon's ns_dtype="auto", flag --ns-dtype) takes the precision policy's choice for the
# device (hardware/precision.py); "fp32" and "bf16" force one. Only the iteration runs in it.
@functools.lru_cache(maxsize=None)
def _auto_dtype(device_type: str, index: int | None) -> torch.dtype:
    return precision.choose(torch.device(device_type, index), "auto", what="--ns-dtype", warn=False).dtype


def compute_dtype(device, dtype=None) -> torch.dtype:
    """The dtype Newton-Schulz computes in on `device`: `dtype` if given (torch.float32,
    torch.bfloat16, or "fp32" / "bf16"), else ("auto", None) the precision policy's choice."""
    if dtype is None or dtype == "auto":
        device = torch.device(device)
        return _auto_dtype(device.type, device.index)
    if isinstance(dtype, str) and dtype in precision.DTYPES:
        return precision.DTYPES[dtype]
    if dtype in (torch.float32, torch.bfloat16):
        return dtype
    raise ValueError(f"dtype must be None, 'auto', 'fp32', 'bf16', torch.float32 or torch.bfloat16, got {dtype!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


# -- the path ---------------------------------------------------------------------------------
# For short side m and long side n, one of three exact rewrites of the same iteration runs:
#     plain       X X^T, A A and B X as full products (BLAS / cuBLAS), 4 m^2 n + 2 m^3 flops a step
#     symmetric   X X^T and A A only on and above the diagonal, mirrored: on CPU in block rows
#                 (cost (p+1)/(2p) of a full product for p blocks), on CUDA the Triton kernels
#     gram        all steps on m x m polynomials in A_0 = X_0 X_0^T, X formed once per restart
#                 segment (the torch backend below): ~2.1x fewer flops at n = 4m
# The first row whose device and dtype match and whose sizes hold (m >= min_m, n >= min_aspect * m) gives
# the path, else "plain". On CUDA `auto` runs the Triton kernels only for "symmetric"; a forced backend runs
# its own path. Where each row starts, and why: docs/measurements.md#newton-schulz-paths.
PATH_TABLE = (
    # device   dtype   path         m >=  n/m >=
    # "cpu-amx": bf16 on AMX tiles (table_device), where a product split in block rows or written into a
    # strided block loses: no symmetric row, and the Gram form unsplit
    ("cpu-amx", "bf16", "gram", 256, 2.0),
    ("cpu", "fp32", "gram", 256, 2.0),
    ("cpu", "fp32", "symmetric", 256, 1.0),
    ("cpu", "bf16", "gram", 256, 2.0),
    ("cpu", "bf16", "symmetric", 1024, 1.0),
    ("cuda", "fp32", "gram", 1, 2.0),
    ("cuda", "fp32", "symmetric", 2048, 1.0),
    ("cuda", "bf16", "symmetric", 2048, 1.0),
)


def table_device(device_type: str, dtype: torch.dtype) -> str:
    """PATH_TABLE's device for `device_type` computing in `dtype`: "cpu-amx" for bf16 on AMX tiles."""
    if device_type == "cpu" and dtype == torch.bfloat16 and cpu_bf16_support() == "AMX":
        return "cpu-amx"
    return device_type


def choose_path(device_type: str, dtype: torch.dtype, m: int, n: int) -> str:
    """The path for matrices with sides m and n (either order) on `device_type` in `dtype`."""
    m, n = min(m, n), max(m, n)
    for device, dtype_, path, min_m, min_aspect in PATH_TABLE:
        if device == device_type and dtype_ == dtype_name(dtype) and m >= min_m and n >= min_aspect * m:
            return path
    return "plain"


def symmetric_pays(device_type: str, dtype: torch.dtype, m: int) -> bool:
    """Whether m x m symmetric products are worth splitting in block rows (asked by the Gram form too)."""
    return choose_path(device_type, dtype, m, m) == "symmetric"


# -- the op -----------------------------------------------------------------------------------


def plan(shape, device, dtype=None, backend=None) -> tuple[registry.Backend, torch.dtype, str]:
    """(backend, compute dtype, path) that newton_schulz would use for a G of `shape` on `device`."""
    device = torch.device(device)
    dtype = compute_dtype(device, dtype)
    path = choose_path(table_device(device.type, dtype), dtype, shape[-2], shape[-1])
    impl = registry.select(OP, device.type, backend)
    if impl.name == "triton" and path != "symmetric" and (backend or registry.requested(OP)) == "auto":
        impl = registry.select(OP, device.type, "torch")  # below the table's sizes cuBLAS's full products win
    return impl, dtype, path


def newton_schulz(
    G: torch.Tensor, steps: int = 5, coefficients="quintic", out_dtype=None, dtype=None, *, backend=None,
    safety: float = 1.0, eps: float = 1e-7, out=None,
):  # fmt: skip
    """Orthogonalize G (2-D, or 3-D as a batch of same-shape matrices) with `steps` iterations,
    computing in `dtype` (None/"auto", "fp32", "bf16" or a torch dtype). Each matrix starts divided
    by safety * its Frobenius norm + eps (nanochat's Polar Express: 1.01 and 1e-6). `out`: a tensor
    of G's shape to write the result into (G itself may be it), instead of a new one in `out_dtype`."""
    if G.dim() not in (2, 3):
        raise ValueError(f"G must be 2-D or a 3-D stack of matrices, got shape {tuple(G.shape)}")
    if out is not None and out.shape != G.shape:
        raise ValueError(f"out must have G's shape {tuple(G.shape)}, got {tuple(out.shape)}")
    coeffs = resolve_coefficients(coefficients, steps)
    impl, dtype, path = plan(G.shape, G.device, dtype, backend)
    X = impl.fn(G, coeffs, dtype, path, safety, eps)
    return out.copy_(X) if out is not None else X.to(out_dtype or G.dtype)


@registry.register(OP, "reference", auto={"mps": ("reference",)})
def newton_schulz_reference(G, coeffs, dtype, path="plain", safety=1.0, eps=1e-7):
    """The plain PyTorch iteration, as in nanochat's zeropower_via_newtonschulz5."""
    X = G.to(dtype)
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    norm = X.norm(dim=(-2, -1), keepdim=True)
    X = X / (norm * safety + eps)
    for a, b, c in coeffs:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if transposed else X


@registry.register(OP, "triton")
def triton_backend(G, coeffs, dtype, path="symmetric", safety=1.0, eps=1e-7):
    """The symmetric path, whatever `path` says: the Triton kernels are that path."""
    flat = [float(x) for abc in coeffs for x in abc]
    return torch.ops.nanochat_fast.newton_schulz_triton(G, flat, dtype, safety, eps)


# -- the torch backend: the three paths with fused products (b A + c A A and a X + B X one baddbmm each),
# symmetric products in block rows on and right of the diagonal, mirrored ("plain": one block row); the
# Gram form restarts after 2 steps, then every 3. Derivation and error: docs/measurements.md#newton-schulz-rewrites.

SYM_BLOCK_ROWS = 192  # any height in 128..256 does as well: docs/measurements.md#newton-schulz-paths


def restart_points(steps: int) -> list[int]:
    """Steps at which the Gram form re-forms X and restarts: after 2 steps, then every 3."""
    return list(range(2, steps, 3))


def _block_rows(m: int, split: bool) -> list[tuple[int, int]]:
    if not split:
        return [(0, m)]
    p = max(2, round(m / SYM_BLOCK_ROWS))
    edges = [round(i * m / p) for i in range(p + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _symmetric_product(L, R, out, C=None, beta=0.0, alpha=1.0, split=True):
    """out = beta C + alpha L R^T for (K, m, k) stacks L, R whose product is known to be symmetric
    (X X^T, A A, products of commuting symmetric matrices); in block rows if `split`. Returns out."""
    rows = _block_rows(out.size(-1), split)
    for i0, i1 in rows:
        block = out[:, i0:i1, i0:]
        base = block if C is None else C[:, i0:i1, i0:]
        torch.baddbmm(base, L[:, i0:i1], R[:, i0:].mT, beta=0.0 if C is None else beta, alpha=alpha, out=block)
    for i0, i1 in rows[:-1]:
        out[:, i1:, i0:i1].copy_(out[:, i0:i1, i1:].mT)
    return out


def _direct(S, coeffs, wide, split):
    """The iteration with fused (and, if `split`, symmetric) products on the normalised stack S."""
    X = S if wide else S.mT  # (K, m, n), m <= n: a view, no copy
    m = X.size(-2)
    A, B = S.new_empty(S.size(0), m, m), S.new_empty(S.size(0), m, m)
    Y = torch.empty_like(S)
    for a, b, c in coeffs:
        _symmetric_product(X, X, A, split=split)
        _symmetric_product(A, A, B, C=A, beta=b, alpha=c, split=split)
        if wide:
            torch.baddbmm(S, B, S, beta=a, out=Y)  # a X + B X
        else:
            torch.baddbmm(S, S, B, beta=a, out=Y)  # (a X + B X)^T = a S + S B, B symmetric
        S, Y = Y, S
        X = S if wide else S.mT
    return S


def _gram(S, coeffs, wide, split):
    """The Gram form with restarts on the normalised stack S; its m x m products in block rows if `split`."""
    X = S if wide else S.mT
    m = X.size(-2)
    A, Q, P, T = (S.new_empty(S.size(0), m, m) for _ in range(4))
    bounds = [0] + restart_points(len(coeffs)) + [len(coeffs)]
    for start, end in zip(bounds[:-1], bounds[1:]):
        _symmetric_product(X, X, A, split=split)
        for k in range(start, end):
            a, b, c = coeffs[k]
            _symmetric_product(A, A, Q, C=A, beta=b, alpha=c, split=split)  # Q = a I + b A + c A^2
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
            if k == start:
                P, Q = Q, P  # P = Q
            else:
                _symmetric_product(Q, P, T, split=split)  # P = Q P
                P, T = T, P
            if k < end - 1:
                step_q = P if k == start else Q
                _symmetric_product(step_q, A, T, split=split)  # A = Q (Q A)
                _symmetric_product(step_q, T, A, split=split)
        S = torch.bmm(P, S) if wide else torch.bmm(S, P)  # X = P X, once per segment
        X = S if wide else S.mT
    return S


@registry.register(OP, "torch")
def newton_schulz_torch(G, coeffs, dtype, path, safety=1.0, eps=1e-7):
    """The table's `path` ("plain", "symmetric" or "gram") in `dtype`."""
    stack = G if G.dim() == 3 else G.unsqueeze(0)
    wide = stack.size(-2) <= stack.size(-1)
    norm = torch.linalg.vector_norm(stack, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    # divided in fp32 and rounded once into `dtype`, with no fp32 copy of the stack in between
    S = torch.empty(stack.shape, dtype=dtype, device=stack.device)
    if stack.device.type == "cpu":  # a matrix at a time, by a number: one broadcast division ran ~9x slower there
        for X, Y, divisor in zip(stack, S, (norm * safety + eps).flatten().tolist()):
            torch.div(X, divisor, out=Y)
    else:
        torch.div(stack, norm * safety + eps, out=S)
    if path == "gram":
        split = symmetric_pays(table_device(G.device.type, dtype), dtype, min(stack.shape[-2:]))
        S = _gram(S, coeffs, wide, split=split)
    else:
        S = _direct(S, coeffs, wide, split=path == "symmetric")
    return S if G.dim() == 3 else S[0]
