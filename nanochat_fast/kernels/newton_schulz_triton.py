"""
Triton Newton-Schulz for a stack (K, m, n) of same-shape matrices, m <= n, one launch per kernel and step:
symmetric_xxt (A = X X^T), symmetric_poly (B = b A + c A A) and fused_update (X' = a X + B X, aX in the
epilogue). A and A A are symmetric: the first two compute only the tiles on and above the diagonal and write
each tile and its mirror. Storage is the compute dtype (bf16 rounded to nearest even, or fp32), accumulation
fp32 (docs/measurements.md#newton-schulz-triton-kernels); the whole iteration is a torch.library op.
"""

import torch
from torch._subclasses.fake_tensor import is_fake

from .triton_utils import store, tl, triton

# Tile configs: 128x128 output tiles with 64-deep K slices keep an sm90's tensor cores busy; a call with
# fewer 128-tiles than SMs takes 64x64 tiles, 4x the programs (docs/measurements.md#gpu-kernel-configs).
GPU_LARGE = dict(BLOCK=128, BLOCK_K=64, num_warps=8, num_stages=3, DOT_FP32=False)
GPU_SMALL = dict(BLOCK=64, BLOCK_K=64, num_warps=4, num_stages=4, DOT_FP32=False)
GPU_CONFIGS = {"large": GPU_LARGE, "small": GPU_SMALL}  # every config a GPU may launch (benchmarks/triton_aot.py)
# The interpreter runs one program at a time in numpy: big tiles, few (slow) Python iterations; its bf16
# dot is not a GPU's, so the operands go to fp32 (DOT_FP32), as every other bf16 value does before arithmetic.
INTERPRETER = dict(BLOCK=128, BLOCK_K=128, num_warps=1, num_stages=1, DOT_FP32=True)


def pick_config(device: torch.device, tiles_at_128: int) -> dict:
    """The tile config for a launch that would have `tiles_at_128` programs with 128x128 tiles."""
    if device.type != "cuda":
        return INTERPRETER
    return GPU_LARGE if tiles_at_128 >= torch.cuda.get_device_properties(device).multi_processor_count else GPU_SMALL


def _n_pairs(nb: int) -> int:
    return nb * (nb + 1) // 2


def launch(kernel, x: torch.Tensor):
    """`kernel`, ready for kernel[grid](...) in the op's body: wrapped (torch.library.wrap_triton) while
    torch traces the op on fake tensors, so the launch lands in the graph; as it is on real tensors."""
    return torch.library.wrap_triton(kernel) if is_fake(x) else kernel


_PAIRS: dict = {}


def upper_tile_pairs(nb: int, like: torch.Tensor) -> torch.Tensor:
    """int32[2 * nb(nb+1)/2]: (row-block, col-block) of every tile on or above the diagonal, on `like`'s
    device. Cached (a copy to the GPU per launch would wait for the GPU), but made afresh while traced."""
    traced, key = is_fake(like), (int(nb), like.device)
    if traced or key not in _PAIRS:
        pairs = torch.tensor([(i, j) for i in range(key[0]) for j in range(i, key[0])], dtype=torch.int32)
        if traced:
            return pairs.flatten().to(like.device)
        _PAIRS[key] = pairs.flatten().to(like.device)
    return _PAIRS[key]


# -- device helpers ---------------------------------------------------------------------------------


@triton.jit
def _dot_operand(x, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return x.to(tl.float32)
    return x


@triton.jit
def _store_symmetric(out, ri, rj, acc, M):
    """Tile (ri, rj) of a symmetric M x M result, row-block <= col-block: the entries on/above the
    diagonal go to (ri, rj), the transpose fills (rj, ri). A diagonal tile thus takes its lower
    half from its upper half, so the result is exactly symmetric."""
    upper = (ri[:, None] < M) & (rj[None, :] < M) & (ri[:, None] <= rj[None, :])
    store(out + ri[:, None] * M + rj[None, :], acc, upper)
    lower = (rj[:, None] < M) & (ri[None, :] < M) & (rj[:, None] > ri[None, :])
    store(out + rj[:, None] * M + ri[None, :], tl.trans(acc), lower)


# -- kernels: grid (tiles, K), program_id(1) picks the matrix of the stack -----------------------------


@triton.jit
def _symmetric_xxt_kernel(
    x_ptr, a_ptr, pairs_ptr, M, N,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    ti = tl.load(pairs_ptr + 2 * pid)
    tj = tl.load(pairs_ptr + 2 * pid + 1)
    x = x_ptr + batch * M * N
    a = a_ptr + batch * M * M
    ri = ti * BLOCK + tl.arange(0, BLOCK)
    rj = tj * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        k = k0 + ks
        xi = tl.load(x + ri[:, None] * N + k[None, :], mask=(ri[:, None] < M) & (k[None, :] < N), other=0.0)
        xj = tl.load(x + rj[:, None] * N + k[None, :], mask=(rj[:, None] < M) & (k[None, :] < N), other=0.0)
        acc = tl.dot(_dot_operand(xi, DOT_FP32), tl.trans(_dot_operand(xj, DOT_FP32)), acc, input_precision=PRECISION)
    _store_symmetric(a, ri, rj, acc, M)


@triton.jit
def _symmetric_poly_kernel(
    a_ptr, b_ptr, pairs_ptr, M, coef_b, coef_c,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """B = coef_b * A + coef_c * A A for symmetric A, reading only A's tiles on/above the diagonal:
    A[i, k] with k-block < i-block is read as A[k, i]^T, A[k, j] with k-block > j-block as A[j, k]^T.
    The K loop is split at the tile boundaries so no iteration branches (BLOCK_K divides BLOCK)."""
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    ti = tl.load(pairs_ptr + 2 * pid)
    tj = tl.load(pairs_ptr + 2 * pid + 1)
    a = a_ptr + batch * M * M
    ri = ti * BLOCK + tl.arange(0, BLOCK)
    rj = tj * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    mi = ri < M
    mj = rj < M
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    # k-blocks left of the diagonal tile of row i: A[ri, k] is below the diagonal, read A[k, ri]
    for k0 in range(0, ti * BLOCK, BLOCK_K):
        k = k0 + ks
        left = tl.load(a + k[None, :] * M + ri[:, None], mask=mi[:, None], other=0.0)
        right = tl.load(a + k[:, None] * M + rj[None, :], mask=mj[None, :], other=0.0)
        acc = tl.dot(_dot_operand(left, DOT_FP32), _dot_operand(right, DOT_FP32), acc, input_precision=PRECISION)
    # k-blocks from i to j: both operands on/above the diagonal
    for k0 in range(ti * BLOCK, tl.minimum((tj + 1) * BLOCK, M), BLOCK_K):
        k = k0 + ks
        mk = k < M
        left = tl.load(a + ri[:, None] * M + k[None, :], mask=mi[:, None] & mk[None, :], other=0.0)
        right = tl.load(a + k[:, None] * M + rj[None, :], mask=mk[:, None] & mj[None, :], other=0.0)
        acc = tl.dot(_dot_operand(left, DOT_FP32), _dot_operand(right, DOT_FP32), acc, input_precision=PRECISION)
    # k-blocks right of column-block j: A[k, rj] is below the diagonal, read A[rj, k]
    for k0 in range((tj + 1) * BLOCK, M, BLOCK_K):
        k = k0 + ks
        mk = k < M
        left = tl.load(a + ri[:, None] * M + k[None, :], mask=mi[:, None] & mk[None, :], other=0.0)
        right = tl.load(a + rj[None, :] * M + k[:, None], mask=mk[:, None] & mj[None, :], other=0.0)
        acc = tl.dot(_dot_operand(left, DOT_FP32), _dot_operand(right, DOT_FP32), acc, input_precision=PRECISION)
    a_ij = tl.load(a + ri[:, None] * M + rj[None, :], mask=mi[:, None] & mj[None, :], other=0.0)
    acc = coef_c * acc + coef_b * a_ij.to(tl.float32)
    _store_symmetric(b_ptr + batch * M * M, ri, rj, acc, M)


@triton.jit
def _fused_update_kernel(
    b_ptr, x_ptr, out_ptr, M, N, coef_a,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out = coef_a * X + B X. Programs walk down a column of tiles first, so neighbours share
    the X column slab they read (B, m x m, is small and stays in L2)."""
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tiles_m = tl.cdiv(M, BLOCK)
    rm = (pid % tiles_m) * BLOCK + tl.arange(0, BLOCK)
    rn = (pid // tiles_m) * BLOCK + tl.arange(0, BLOCK)
    b = b_ptr + batch * M * M
    x = x_ptr + batch * M * N
    mm = rm < M
    mn = rn < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        k = k0 + ks
        mk = k < M
        left = tl.load(b + rm[:, None] * M + k[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        right = tl.load(x + k[:, None] * N + rn[None, :], mask=mk[:, None] & mn[None, :], other=0.0)
        acc = tl.dot(_dot_operand(left, DOT_FP32), _dot_operand(right, DOT_FP32), acc, input_precision=PRECISION)
    tile = mm[:, None] & mn[None, :]
    x_tile = tl.load(x + rm[:, None] * N + rn[None, :], mask=tile, other=0.0)
    acc += coef_a * x_tile.to(tl.float32)
    store(out_ptr + batch * M * N + rm[:, None] * N + rn[None, :], acc, tile)


# -- launchers: contiguous (K, m, n) / (K, m, m) stacks of one dtype; each returns (out, programs) ------


def _launch_args(cfg, dtype):
    # fp32 storage means fp32 products on a GPU too (tl.dot would otherwise round them to tf32)
    return dict(cfg, PRECISION="ieee" if dtype == torch.float32 else None)


def _check(cfg, *tensors):
    assert cfg["BLOCK"] % cfg["BLOCK_K"] == 0, "BLOCK_K must divide BLOCK"
    for t in tensors:
        assert t.dim() == 3 and t.is_contiguous(), "launchers take contiguous (K, rows, cols) stacks"
        assert t.dtype == tensors[0].dtype and t.device == tensors[0].device


def symmetric_xxt(X: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None):
    """A = X X^T for a (K, m, n) stack, computing only tiles with row-block <= col-block."""
    K, M, N = X.shape
    out = torch.empty((K, M, M), dtype=X.dtype, device=X.device) if out is None else out
    return _launch_symmetric(_symmetric_xxt_kernel, X, out, (M, N), config)


def symmetric_poly(A: torch.Tensor, b: float, c: float, out: torch.Tensor | None = None, config: dict | None = None):
    """B = b A + c A A for a (K, m, m) stack of symmetric matrices, computing only upper tiles and
    reading only A's tiles on/above the diagonal."""
    out = torch.empty_like(A) if out is None else out
    return _launch_symmetric(_symmetric_poly_kernel, A, out, (A.size(1), float(b), float(c)), config)


def _launch_symmetric(kernel, x, out, scalars, config):
    K, M, _ = out.shape
    cfg = config or pick_config(x.device, K * _n_pairs(triton.cdiv(M, 128)))
    _check(cfg, x, out)
    nb = triton.cdiv(M, cfg["BLOCK"])
    grid = (_n_pairs(nb), K)
    launch(kernel, x)[grid](x, out, upper_tile_pairs(nb, x), *scalars, **_launch_args(cfg, x.dtype))
    return out, grid[0] * grid[1]


def fused_update(
    B: torch.Tensor, X: torch.Tensor, a: float, out: torch.Tensor | None = None, config: dict | None = None
):
    """out = a X + B X for stacks B (K, m, m) and X (K, m, n); `out` must not alias X."""
    K, M, N = X.shape
    out = torch.empty_like(X) if out is None else out
    cfg = config or pick_config(X.device, K * triton.cdiv(M, 128) * triton.cdiv(N, 128))
    _check(cfg, B, X, out)
    assert out is not X, "out must not alias X (other tiles still read it)"
    grid = (triton.cdiv(M, cfg["BLOCK"]) * triton.cdiv(N, cfg["BLOCK"]), K)
    launch(_fused_update_kernel, X)[grid](B, X, out, M, N, float(a), **_launch_args(cfg, X.dtype))
    return out, grid[0] * grid[1]


def newton_schulz_triton(
    G: torch.Tensor, coeffs, dtype=torch.bfloat16, config: dict | None = None, safety=1.0, eps=1e-7
):
    """The whole iteration on a 2-D matrix or a (K, rows, cols) stack, computed and returned in `dtype`;
    `config` overrides the tile configs."""
    stack = G if G.dim() == 3 else G.unsqueeze(0)
    transposed = stack.size(-2) > stack.size(-1)
    if transposed:
        stack = stack.mT  # once: every step then works on the short side's Gram matrix
    K, M, N = stack.shape
    norm = torch.linalg.vector_norm(stack, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    X = torch.empty((K, M, N), dtype=dtype, device=G.device)
    X.copy_(stack / (norm * safety + eps))  # normalise, cast and lay out contiguously in one pass
    A = torch.empty((K, M, M), dtype=dtype, device=G.device)
    B = torch.empty_like(A)
    Y = torch.empty_like(X)
    for a, b, c in coeffs:
        symmetric_xxt(X, out=A, config=config)
        symmetric_poly(A, b, c, out=B, config=config)
        fused_update(B, X, a, out=Y, config=config)
        X, Y = Y, X
    if transposed:
        X = X.mT
    return X if G.dim() == 3 else X[0]


@torch.library.triton_op("nanochat_fast::newton_schulz_triton", mutates_args=())
def newton_schulz_op(
    G: torch.Tensor, coeffs: list[float], dtype: torch.dtype, safety: float = 1.0, eps: float = 1e-7
) -> torch.Tensor:
    """newton_schulz_triton as an op torch.compile traces into; coeffs: the steps' (a, b, c), flattened."""
    return newton_schulz_triton(G, [coeffs[i : i + 3] for i in range(0, len(coeffs), 3)], dtype, None, safety, eps)


@newton_schulz_op.register_fake
def _(G, coeffs, dtype, safety=1.0, eps=1e-7):
    if G.size(-2) <= G.size(-1):
        return G.new_empty(G.shape, dtype=dtype)
    return G.new_empty(*G.shape[:-2], G.size(-1), G.size(-2), dtype=dtype).mT  # computed transposed
