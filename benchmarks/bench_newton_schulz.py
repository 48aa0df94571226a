"""Newton-Schulz (5 quintic steps), per shape and per dtype: every backend that runs here vs the
plain-PyTorch reference in the same dtype.

Shapes: the matrices of GPT-2-small-sized layers (768x768, 768x3072 and its transpose), a
1024x4096 one, and a stack of 8 768x768 matrices (what Muon orthogonalizes per call for a group of
same-shape matrices), in fp32 and in bf16. Where bf16 is emulated (a CPU without AVX512-BF16/AMX:
~1 GFLOP/s) the bf16 rows use quarter-size matrices (256x256, 256x1024, 4x256x256) so they fit the
time budget; each case's rounds are cut to its budget (at least 3; the table says how many ran).
The notes give the path the shape table picks (newton_schulz.PATH_TABLE) and the flops each
variant computes: the torch backend's path (plain, symmetric block products, Gram form) and, on
a GPU, the Triton kernels' tiles on/above the diagonal.
"""

import importlib

import pytest
import torch
from harness import compare, matmul_gflops, plan_modes
from triton_kernel_list import flop_counts

from nanochat_fast.hardware import precision
from nanochat_fast.kernels import newton_schulz, registry

ns = importlib.import_module("nanochat_fast.kernels.newton_schulz")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(768, 768), (768, 3072), (3072, 768), (1024, 4096), (8, 768, 768)]
BF16_NATIVE = precision.choose(torch.device(DEVICE), "bf16", what="--ns-dtype", warn=False).native
CASES = [(s, "fp32") for s in SHAPES] + [
    (s, "bf16") for s in (SHAPES if BF16_NATIVE else [(256, 256), (256, 1024), (4, 256, 256)])
]
BUDGET_S = {"fp32": 8.0, "bf16": 8.0}
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}


def plain_flops(shape, steps=5):
    k = shape[0] if len(shape) == 3 else 1
    m, n = sorted(shape[-2:])
    return k * steps * (4 * m * m * n + 2 * m**3)


def torch_backend_flops(shape, dtype, steps=5):
    """What the torch backend computes on the table's path: symmetric products cost (p+1)/(2p)
    of full ones for p block rows."""
    k = shape[0] if len(shape) == 3 else 1
    m, n = sorted(shape[-2:])
    path = ns.plan(shape, DEVICE, dtype)[2]
    split = path == "symmetric" or (path == "gram" and ns.symmetric_pays(ns.table_device(DEVICE, dtype), dtype, m))
    p = len(ns._block_rows(m, split))
    sym = (p + 1) / (2 * p)
    if path == "gram":  # segments: X X^T once and P X once each; m x m products
        segments = len(ns.restart_points(steps)) + 1
        mm_products = 4 * steps - 3 * segments  # A^2 and Q P and Q(QA) twice, minus per-segment savings
        return k * (segments * (sym * 2 * m * m * n + 2 * m * m * n) + mm_products * sym * 2 * m**3)
    return k * steps * (sym * 2 * m * m * n + sym * 2 * m**3 + 2 * m * m * n)


def notes(shape, dtype):
    plain = plain_flops(shape)
    impl, _, path = ns.plan(shape, DEVICE, dtype)
    parts = [f"auto: {impl.name} backend, {path} path", f"plain {plain / 1e9:.1f} GFLOP"]
    ours = torch_backend_flops(shape, dtype)
    parts.append(f"torch backend {ours / 1e9:.1f} GFLOP = 1/{plain / ours:.2f}")
    if DEVICE == "cuda":
        from nanochat_fast.kernels import newton_schulz_triton as nst

        k = shape[0] if len(shape) == 3 else 1
        m, n = sorted(shape[-2:])
        f = step_flops(nst, torch.device(DEVICE), k, m, n)
        parts.append(f"triton {5 * f['step'] / 1e9:.1f} GFLOP = 1/{plain / (5 * f['step']):.2f}")
    return "; ".join(parts)


def step_flops(nst, device: torch.device, K: int, m: int, n: int) -> dict:
    """flop_counts of one step with the tiles each kernel would use on `device`."""
    sym = flop_counts(m, n, nst.pick_config(device, K * nst._n_pairs(-(-m // 128)))["BLOCK"], K)
    update = flop_counts(m, n, nst.pick_config(device, K * -(-m // 128) * -(-n // 128))["BLOCK"], K)
    out = dict(sym, fused_update=update["fused_update"])
    out["step"] = out["symmetric_xxt"] + out["symmetric_poly"] + out["fused_update"]
    return out


def backends_here():
    return [name for name, impl in registry.backends(ns.OP).items() if impl.why_not(DEVICE) is None]


@pytest.mark.parametrize("shape,dtype_name", CASES, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else c)
def test_newton_schulz(benchmark, shape, dtype_name):
    dtype = precision.DTYPES[dtype_name]
    G = torch.randn(shape, device=DEVICE)
    expected = newton_schulz(G, backend="reference", dtype=torch.float32).double()
    seconds = plain_flops(shape) / (matmul_gflops(dtype, DEVICE) * 1e9)
    modes, skipped = plan_modes({name: {"call": seconds} for name in backends_here()}, 4 * BUDGET_S[dtype_name])
    variants = {}
    for name in modes:
        out = newton_schulz(G, backend=name, dtype=dtype)
        assert (out.double() - expected).abs().max() <= TOLERANCE[dtype_name], name  # same result, or no comparison
        variants[name] = lambda name=name: newton_schulz(G, backend=name, dtype=dtype)
    if "reference" not in variants:
        pytest.skip(f"{dtype_name} {shape}: {skipped.get('reference')}")
    compare(
        benchmark,
        op=f"Newton-Schulz, 5 quintic steps ({DEVICE}, {dtype_name})",
        shape_set="x".join(map(str, shape)),
        variants=variants,
        baseline="reference",
        rounds=11,
        warmup_rounds=1,
        budget_s=BUDGET_S[dtype_name],
        skipped=skipped,
        notes=notes(shape, dtype),
    )
