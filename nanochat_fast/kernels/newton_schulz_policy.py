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

Where each row comes from:
  - CPU, fp32: measured (benchmarks/RESULTS.md, bench_newton_schulz.py). On a 2-core AVX-512
    Zen 4 (MKL): the Gram form ties the direct one at n/m = 1.5 and is 5-15% faster from 2;
    splitting X X^T and A A into block rows pays from ~256 rows. Re-measured on a 2-core AVX2
    Zen 3 (one thread, interleaved, time relative to plain): symmetric 3.1 at m = 128, 1.00 at
    256, 0.82-0.92 from 384 to 768; Gram at n = 2m 1.02 (m = 128), 0.86 (256), 0.79 (512), at
    n = 4m 1.06, 0.65, 0.58, 0.51 (m = 128, 256, 512, 768): so the Gram form from m = 256.
  - CPU, bf16: measured on a 2-core Zen 4 (AVX512-BF16, no AMX), 2 threads, against
    torch.optim.Muon's per-matrix bf16 iteration (time relative to it, lower is faster): plain
    0.87 (4x512x512), 0.95 (2x512x2048), 0.76 (2x2048x512), 0.97 (4x1280x1280), 0.99
    (1280x5120); symmetric 0.88, 1.12, 0.81, 0.89, 1.14; Gram 1.09, 0.76, 0.54, 1.04, 0.71. At
    m = 512 the block rows cost more than they save in bf16 (the sliced products are copied to
    contiguous ones; 32x512x512: plain 325 ms, symmetric 346 ms; the Gram form's m x m products
    unsplit 158 ms, split 180 ms at 8x512x2048). So the Gram form from n = 2m and m = 256, and
    the symmetric form for squarer matrices from m = 1024. The Gram
    form rounds more in bf16 (its polynomial P_k amplifies its own rounding on small singular
    directions): max abs error vs float64 on the normalised output, Gaussian inputs, 5 steps,
    quintic / Polar Express, plain -> Gram: 256x1024 3.3e-3 -> 4.5e-3 / 2.1e-3 -> 6.1e-3,
    2x512x2048 2.5e-3 -> 5.7e-3 / 1.7e-3 -> 3.3e-3, 1280x5120 1.3e-3 -> 1.5e-3 / 1.1e-3 ->
    2.3e-3: within the 2e-2 bound from m = 256, but not below it (64x256 and 4x64x128 with Polar
    Express: 2.3e-2 and 2.8e-2), which is why the row starts at m = 256. The symmetric form in
    bf16 is as accurate as plain (one rounding per fused product).
  - CUDA: a paper estimate from flop counts, not measured on a GPU yet. The Triton symmetric
    kernels save 1.3-1.5x of the flops (newton_schulz_triton.flop_counts), but published
    symmetric GEMM (SYRK-style) kernels lose to cuBLAS's plain GEMM below m ~ 2048 and win
    above, so the symmetric path starts at m = 2048. fp32 on CUDA (forced, or before sm80) has
    no tensor cores either way, so the Gram form's flop saving is taken as for the CPU.
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
