"""
What newton_schulz computes and how: the coefficient tables, the dtype it computes in, and which
path runs for each shape. Shared by newton_schulz.py (the op, its torch and reference backends)
and newton_schulz_triton.py (the CUDA kernels); neither imports the other's module at load time.

Compute dtype
-------------
`newton_schulz(..., dtype=None)` and Muon's `ns_dtype="auto"` take the precision policy's choice
for the tensor's device (nanochat_fast.hardware.precision, flag name `--ns-dtype`): bf16 on CUDA (sm80+);
on a CPU the faster of fp32 and bf16 as measured here: Muon times its own matrix stacks
(Muon.resolve_ns_precision, hardware/tuning.py), a direct call with dtype=None takes the
machine's matmul probe. "fp32" and "bf16" force one. Only the iteration runs in that dtype: the
input is normalised in fp32 and the result is cast to `out_dtype` (Muon: the parameter's dtype;
its momentum stays fp32).

Paths
-----
For a matrix (or a stack of same-shape matrices) with short side m and long side n (m <= n; a
tall matrix is transposed), one of three exact rewrites of the same iteration runs:

    plain       X X^T, A A and B X as full products (BLAS / cuBLAS), 4 m^2 n + 2 m^3 flops a step
    symmetric   X X^T and A A computed only on and above the diagonal and mirrored: on CPU in
                block rows (cost (p+1)/(2p) of a full product for p blocks), on CUDA by the
                Triton kernels (only tiles on/above the diagonal); B X stays a full product
    gram        all steps on m x m polynomials in A_0 = X_0 X_0^T, X formed once per restart
                segment (newton_schulz.py, "the Gram form"): ~2.1x fewer flops at n = 4m

PATH_TABLE below is the one place that picks among them, keyed by (device kind, dtype, m, n):
the first row whose device and dtype match and whose size conditions hold (m >= min_m and
n >= min_aspect * m) gives the path; with no matching row the path is "plain". `choose_path`
reads it, newton_schulz() passes the path to the backend, and on CUDA `auto` runs the Triton
kernels only for the "symmetric" path (the torch backend's cuBLAS products otherwise). A forced
backend runs its own path: triton always the symmetric kernels, reference always plain.

Where each row comes from (the measurements: docs/measurements.md#newton-schulz-paths):
  - CPU, fp32: measured (bench_newton_schulz.py). The Gram form turns most of the steps' m x n
    products into m x m ones, fewer flops once n >= 2m, and measured faster from m = 256 (not at
    128); splitting X X^T and A A into block rows saves flops too and pays from about 256 rows.
  - CPU, bf16: measured against torch.optim.Muon's per-matrix bf16 iteration. The Gram form from
    n = 2m and m = 256, as in fp32; block rows only from m = 1024 (below that the sliced bf16
    products, copied to contiguous ones, cost more than the split saves). The Gram form rounds
    more in bf16 (its polynomial P_k amplifies its own rounding on small singular directions): its
    error stays within the 2e-2 bound from m = 256 but not below, which is why the row starts at
    m = 256. The symmetric form in bf16 is as accurate as plain (one rounding per fused product).
  - CUDA: a paper estimate, from flop counts and published kernels. The Triton symmetric kernels
    save 1.3-1.5x of the flops (newton_schulz_triton.flop_counts), but published symmetric GEMM
    (SYRK-style) kernels lose to cuBLAS's plain GEMM below m ~ 2048 and win above, so the
    symmetric path starts at m = 2048. fp32 on CUDA (forced, or before sm80) has no tensor cores
    either way, so the Gram form's flop saving is taken as for the CPU.
  - MPS and any other device: plain.
"""
import functools
from typing import NamedTuple

import torch

from ..hardware import precision

QUINTIC = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel et al. 2025, arXiv:2505.16932), 5 steps, as used by modded-nanogpt.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
PATHS = ("plain", "symmetric", "gram")


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


class Row(NamedTuple):
    device: str
    dtype: str
    path: str
    min_m: int
    min_aspect: float
    source: str


PATH_TABLE = (
    # device  dtype   path         m >=  n/m >=  where the row comes from (module docstring)
    Row("cpu",  "fp32", "gram",      256,  2.0,  "measured"),
    Row("cpu",  "fp32", "symmetric", 256,  1.0,  "measured"),
    Row("cpu",  "bf16", "gram",      256,  2.0,  "measured"),
    Row("cpu",  "bf16", "symmetric", 1024, 1.0,  "measured"),
    Row("cuda", "fp32", "gram",      1,    2.0,  "paper (flop count)"),
    Row("cuda", "fp32", "symmetric", 2048, 1.0,  "paper (published SYRK vs GEMM)"),
    Row("cuda", "bf16", "symmetric", 2048, 1.0,  "paper (published SYRK vs GEMM)"),
)


def choose_path(device_type: str, dtype: torch.dtype, m: int, n: int) -> str:
    """The path for matrices with sides m and n (either order) on `device_type` in `dtype`."""
    m, n = min(m, n), max(m, n)
    name = dtype_name(dtype)
    for row in PATH_TABLE:
        if row.device == device_type and row.dtype == name and m >= row.min_m and n >= row.min_aspect * m:
            return row.path
    return "plain"


def symmetric_pays(device_type: str, dtype: torch.dtype, m: int) -> bool:
    """Whether m x m symmetric products are worth splitting (the symmetric row's min_m); the Gram
    form asks this for its own m x m products."""
    return choose_path(device_type, dtype, m, m) == "symmetric"
