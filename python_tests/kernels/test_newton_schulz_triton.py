"""The Triton Newton-Schulz kernels against float64, run by the Triton interpreter on CPU tensors
(the kernels a GPU compiles, with fp32 dot operands) and, marked `gpu`, compiled on CUDA.

Symmetry: the X X^T and b A + c A A kernels launch one program per tile on/above the diagonal and
their outputs are exactly symmetric; b A + c A A must not read A's tiles below the diagonal (they
are poisoned with NaN here)."""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # must be set before the kernels are defined (the module is imported below, after this line)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support.newton_schulz_reference import float64_newton_schulz, make_input, published  # noqa: E402

from nanochat_fast.kernels import newton_schulz  # noqa: E402
from nanochat_fast.kernels import newton_schulz_triton as nst  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COMPUTE_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
# small tiles, so the small test matrices span several tiles (partial ones included)
SMALL_TILES = dict(nst.INTERPRETER if DEVICE == "cpu" else nst.GPU_SMALL, BLOCK=32, BLOCK_K=32)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def stack(shape, dtype, seed=0):
    G = make_input(shape, seed=seed)
    return (G if G.dim() == 3 else G[None]).to(dtype).to(DEVICE).contiguous()


def n_upper_tiles(m, block):
    nb = -(-m // block)
    return nb * (nb + 1) // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,m,n", [(1, 100, 300), (5, 40, 70)])
def test_symmetric_xxt(dtype, K, m, n):
    X = stack((K, m, n), dtype)
    A, programs = nst.symmetric_xxt(X, config=SMALL_TILES)
    assert programs == K * n_upper_tiles(m, SMALL_TILES["BLOCK"])  # 10 of 16 tiles for m=100
    assert torch.equal(A, A.mT)  # mirrored tiles: exactly symmetric
    expected = X.double() @ X.double().mT
    assert (A.double() - expected).abs().max() <= TOL[dtype] * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,m", [(1, 100), (5, 40)])
def test_symmetric_poly_reads_only_upper_tiles(dtype, K, m):
    X = stack((K, m, 2 * m), dtype, seed=1)
    A = (X.double() @ X.double().mT / (2 * m)).to(dtype)  # symmetric, entries O(1)
    block = SMALL_TILES["BLOCK"]
    poisoned = A.clone()
    tile = torch.arange(m, device=DEVICE) // block
    poisoned[:, tile[:, None] > tile[None, :]] = float("nan")  # every tile below the diagonal
    B, programs = nst.symmetric_poly(poisoned, b=-4.775, c=2.0315, config=SMALL_TILES)
    assert programs == K * n_upper_tiles(m, block)
    assert torch.isfinite(B).all()
    assert torch.equal(B, B.mT)
    A64 = A.double()
    expected = -4.775 * A64 + 2.0315 * A64 @ A64
    assert (B.double() - expected).abs().max() <= TOL[dtype] * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_update(dtype):
    X = stack((5, 40, 70), dtype)
    Bm = stack((5, 40, 40), dtype, seed=1)
    Y, programs = nst.fused_update(Bm, X, 3.4445, config=SMALL_TILES)
    assert programs == 5 * 2 * 3
    expected = 3.4445 * X.double() + Bm.double() @ X.double()
    assert (Y.double() - expected).abs().max() <= TOL[dtype] * expected.abs().max()


F32, BF16 = torch.float32, torch.bfloat16


# one tile (100 rows) and a partial second tile (129) at the interpreter's 128-tiles, wide and tall
# (transposed once), stacks of 1 and 5
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((100, 300), F32),
        ((100, 300), BF16),
        ((257, 129), F32),
        ((257, 129), BF16),
        ((1, 64, 96), F32),
        ((5, 40, 70), BF16),
        ((5, 70, 40), F32),
    ],
)
def test_newton_schulz_triton_matches_float64(shape, dtype):
    G = make_input(shape).to(DEVICE)
    coeffs = published("quintic")
    out = nst.newton_schulz_triton(G, coeffs, dtype=dtype)
    assert out.shape == G.shape and out.dtype == dtype
    error = (out.double() - float64_newton_schulz(G, coeffs)).abs().max().item()
    assert error <= TOL[dtype], error  # measured: fp32 ~1e-6, bf16 4e-3 .. 1e-2


def test_small_tiles_and_polar_express():
    """The whole iteration with several tiles per matrix, through the public API."""
    G = make_input((3, 70, 40)).to(DEVICE)
    coeffs = published("polar_express")
    out = nst.newton_schulz_triton(G, coeffs, dtype=COMPUTE_DTYPE, config=SMALL_TILES)
    assert out.dtype == COMPUTE_DTYPE
    assert (out.double() - float64_newton_schulz(G, coeffs)).abs().max() <= TOL[COMPUTE_DTYPE]
    api = newton_schulz(G, coefficients="polar_express", backend="triton", dtype=COMPUTE_DTYPE)  # the package's table
    assert api.dtype == G.dtype
    assert (api.double() - float64_newton_schulz(G, coeffs)).abs().max() <= TOL[COMPUTE_DTYPE]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(768, 768), (768, 3072), (3072, 768), (1024, 4096), (8, 768, 768)])
def test_compiled_kernels_match_float64(shape):
    """On a GPU: the benchmark shapes with the config table's tiles, in bf16 like the reference."""
    G = torch.randn(shape, device="cuda")
    coeffs = published("quintic")
    out = nst.newton_schulz_triton(G, coeffs)
    assert out.dtype == torch.bfloat16
    assert (out.double() - float64_newton_schulz(G, coeffs)).abs().max() <= 2e-2
    X = out.reshape(-1, *out.shape[-2:])
    X = (X.mT if X.size(-2) > X.size(-1) else X).contiguous()
    A, programs = nst.symmetric_xxt(X)
    assert torch.equal(A, A.mT)
    expected = X.double() @ X.double().mT
    assert (A.double() - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize("shape", [(2, 40, 70), (70, 40)])
def test_op_passes_opcheck(shape):
    """The op's schema and fake kernel (a tall input comes back transposed, as the kernels compute it).
    The interpreter cannot run on fake tensors, so on a CPU the traced decomposition is checked apart
    (test_compile_traces_the_kernels)."""
    G = make_input(shape).to(DEVICE)
    args = (G, [3.4445, -4.7750, 2.0315] * 2, COMPUTE_DTYPE, 1.0, 1e-7)
    op = torch.ops.nanochat_fast.newton_schulz_triton.default
    on_cpu = dict(test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    torch.library.opcheck(op, args, **on_cpu if DEVICE == "cpu" else {})


COMPILE_SCRIPT = """
import torch
from torch._functorch.aot_autograd import aot_module_simplified
import nanochat_fast.kernels  # registers nanochat_fast::newton_schulz_triton

launches = []

def record(gm, example_inputs):  # what AOTAutograd hands the compiler; the graph is never run
    def forward(gm, inputs):
        launches.append(sum(n.target.__name__ == "triton_kernel_wrapper_functional" for n in gm.graph.nodes
                            if n.op == "call_function"))
        return lambda *args: [torch.zeros(3, 40, 70, dtype=torch.bfloat16)]
    return aot_module_simplified(gm, example_inputs, fw_compiler=forward)

@torch.compile(backend=record, fullgraph=True, dynamic=False)
def step(G):
    return torch.ops.nanochat_fast.newton_schulz_triton(G, [3.4445, -4.7750, 2.0315] * 5, torch.bfloat16, 1.0, 1e-7)

step(torch.randn(3, 40, 70))
print(launches)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU compiles and runs it: test_compiled_kernels_match_float64")
def test_compile_traces_the_kernels():
    """torch.compile traces into the op: its graph holds the three kernels of each of the 5 steps
    (compiled Triton, not the interpreter: a process without TRITON_INTERPRET, nothing launched)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "[15]", done.stdout
