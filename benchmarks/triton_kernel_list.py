"""
The list of the package's Triton kernels, for their ahead-of-time compile and resource check
(triton_aot.py): per kernel its runtime signature, the constexprs and options its launcher passes
for a config and dtype, an example launch through that launcher, and the cost of one
representative call for the roofline in benchmarks/RESULTS.md.

Adding a kernel: give its module a GPU_CONFIGS table (every config a GPU may launch) and add one
Entry to KERNELS. A @triton.jit kernel under nanochat_fast/kernels/ without an entry fails the
tests (triton_aot.coverage).
"""

import unittest.mock
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class Call:
    """One representative call of a kernel, for the roofline: compulsory HBM bytes and flops."""

    shape: str
    bytes: float
    flops: float
    math: str  # "bf16" (tensor cores) or "fp32" (CUDA cores)


@dataclass(frozen=True)
class Entry:
    """One Triton kernel. `signature` maps each runtime (non-constexpr) argument to its Triton type
    in the notation of Triton's own AOT tool (triton/tools/compile.py): `*bf16` a pointer, `i32` an
    int, `fp32` a float; `:16` marks a value the runtime sees divisible by 16 (so it specialises
    on it, e.g. vectorising loads): pointers from torch allocations, and matrix sizes, all
    multiples of 128 in the model. `{dtype}` stands for the variant's dtype."""

    module: str
    kernel: str
    signature: dict
    dtypes: tuple
    launch: Callable  # (module, config, dtype) -> constexprs and options, as the launcher passes them
    work: Callable  # (module, config, dtype) -> Call, for the roofline table
    example: Callable  # (module, config, dtype, device) -> launches it through its launcher (gpu test)
    configs: str | dict = "GPU_CONFIGS"  # the module's table of GPU configs (a dict: test-only configs)
    spills_ok: dict = field(default_factory=dict)  # "config/dtype/target" pattern (fnmatch) -> why spills are
    # accepted there; any other spill is a failure


# Representative calls for the roofline: a depth-12 GPT (n_embd 768) at nanochat's 65,536-token
# vocabulary. AdamW updates the embedding and lm_head (2 x 65,536 x 768 values); Muon stacks the
# 12 MLP input matrices (3072 x 768, transposed to 768 x 3072) into one Newton-Schulz call.
ADAMW_CALL_PARAMS = 2 * 65536 * 768
NS_CALL = (12, 768, 3072)
# per element: m += (1-b1)(g-m): 3; v = b2 v + (1-b2) g g: 4; sqrt(v) c + eps: 3; p d - s (m/denom): 4
ADAMW_FLOPS_PER_PARAM = 14


def adamw_bytes_per_param(dtype: torch.dtype) -> int:
    """HBM bytes per parameter per step: read param, grad, exp_avg, exp_avg_sq; write param and
    both moments (state is fp32): 28 B for fp32 params, 22 B for bf16."""
    return 3 * dtype.itemsize + 4 * 4


def _adamw_launch(mod, cfg, dtype):
    return dict(IS_BF16=dtype == torch.bfloat16, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])


def adamw_call(dtype: torch.dtype, n: int = ADAMW_CALL_PARAMS) -> Call:
    """One AdamW step over n parameters of `dtype` (any backend: the traffic is the op's)."""
    return Call(f"{n / 1e6:.1f}M params", n * adamw_bytes_per_param(dtype), n * ADAMW_FLOPS_PER_PARAM, "fp32")


def _adamw_example(mod, cfg, dtype, device):
    # 3 tensors in 6 blocks: neither count is 1 or a multiple of 16, as the signature says
    params = [torch.randn(n, device=device).to(dtype) for n in (5000, 3000, 100)]
    grads = [torch.randn_like(p) for p in params]
    moments = [torch.zeros(p.shape, device=device) for p in params for _ in range(2)]
    hparams = torch.tensor([1e-3, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.05**0.5], dtype=torch.float64, device=device)
    with unittest.mock.patch.dict(mod.CONFIGS, {device.type: cfg}):  # the launcher picks its config by device
        mod.adamw_slice_update_triton(params, grads, moments[0::2], moments[1::2], hparams, [1.0] * 3, [1.0] * 3)


def flop_counts(m: int, n: int, block: int, batch: int = 1) -> dict:
    """Flops one call of each kernel computes on a (batch, m, n) stack, m <= n, with `block` tiles,
    next to what the full (non-symmetric) products would compute. Padding of partial tiles counts:
    it is work the tensor cores do."""
    nb = -(-m // block)
    mp = nb * block  # rows padded to whole tiles
    pairs = nb * (nb + 1) // 2
    xxt = batch * pairs * 2 * block * block * n
    poly = batch * pairs * 2 * block * block * mp
    update = batch * 2 * mp * mp * (-(-n // block) * block)
    return {
        "symmetric_xxt": xxt,
        "symmetric_poly": poly,
        "fused_update": update,
        "step": xxt + poly + update,
        "full_xxt": batch * 2 * m * m * n,
        "full_poly": batch * 2 * m**3,
        "full_update": batch * 2 * m * m * n,
        "full_step": batch * (4 * m * m * n + 2 * m**3),
    }


def _ns_work(key):
    def work(mod, cfg, dtype):
        K, m, n = NS_CALL
        block = cfg["BLOCK"]
        elements = {
            "symmetric_xxt": m * n + m * m,  # read X, write A
            "symmetric_poly": m * (m + block) // 2 + m * m,  # read A's upper tiles, write B
            "fused_update": m * m + 2 * m * n,
        }[key]  # read B and X, write X'
        return Call(
            f"{K} x {m}x{n}",
            K * elements * dtype.itemsize,
            flop_counts(m, n, block, K)[key],
            "bf16" if dtype == torch.bfloat16 else "fp32",
        )

    return work


def _ns_example(mod, cfg, dtype, device):
    # sizes divisible by 16, as the signature says (the model's are multiples of 128)
    X = torch.randn(3, 256, 512, device=device).to(dtype)
    A, _ = mod.symmetric_xxt(X, config=cfg)
    B, _ = mod.symmetric_poly(A, -4.7750, 2.0315, config=cfg)
    mod.fused_update(B, X, 3.4445, config=cfg)


_NS = "nanochat_fast.kernels.newton_schulz_triton"
_NS_DTYPES = (torch.bfloat16, torch.float32)
_NS_LAUNCH = lambda mod, cfg, dtype: mod._launch_args(cfg, dtype)  # noqa: E731  the launchers' own function
_NS_SPILLS = {
    # fp32 is opt-in on a GPU (bf16 is the default): input_precision="ieee" makes tl.dot fp32 FMAs on the
    # CUDA cores, which hold BLOCK_K-long slices of both operands per thread in registers; at the bf16
    # configs' BLOCK_K=64 they do not fit. ptxas -v reports no spills with BLOCK=64, BLOCK_K=16, 4 warps
    # on sm_80 and sm_90 for all three kernels, a config for the fp32 path to adopt.
    "*/fp32/*": "fp32 FMA dot with BLOCK_K=64 (the bf16 tiles) exceeds the register file; fp32 is opt-in on GPUs",
}

# softcap_cross_entropy's row pass over one chunk of 4096 rows at nanochat's 65,536-token vocabulary:
# reads the logits, and with gradients reads them again and writes dz over them (per element ~10
# flops for the loss, ~15 more for dz).
SCE_CALL = (4096, 65536)


def _sce_work(mod, cfg, dtype):
    rows, vocab = SCE_CALL
    passes, flops = (3, 25) if cfg["COMPUTE_GRAD"] else (1, 10)
    return Call(f"{rows} x {vocab} logits", rows * vocab * passes * dtype.itemsize, rows * vocab * flops, "fp32")


def _sce_example(mod, cfg, dtype, device):
    z = torch.randn(16, 8192, device=device).to(dtype)  # a vocabulary of at least one block
    targets = torch.randint(0, 8192, (16,), device=device)
    losses = torch.empty(16, device=device)
    scale = torch.ones((), device=device).expand(16) if cfg["COMPUTE_GRAD"] else None  # sum: one weight for all rows
    with unittest.mock.patch.dict(mod.CONFIGS, {device.type: cfg}):
        mod.triton_row_pass(z, targets, scale, losses, 15.0, -1)


KERNELS = [
    Entry(
        "nanochat_fast.kernels.adamw_slice",
        "_adamw_multi_tensor_kernel",
        dict(
            table_ptr="*i64:16",
            muls_ptr="*fp32:16",
            blocks_ptr="*i64:16",
            hparams_ptr="*fp64:16",
            n_tensors="i32",
            n_blocks="i32",
        ),
        (torch.float32, torch.bfloat16),
        _adamw_launch,
        lambda mod, cfg, dtype: adamw_call(dtype),
        _adamw_example,
    ),
    Entry(
        _NS,
        "_symmetric_xxt_kernel",
        dict(x_ptr="*{dtype}:16", a_ptr="*{dtype}:16", pairs_ptr="*i32:16", M="i32:16", N="i32:16"),
        _NS_DTYPES,
        _NS_LAUNCH,
        _ns_work("symmetric_xxt"),
        _ns_example,
        spills_ok=_NS_SPILLS,
    ),
    Entry(
        _NS,
        "_symmetric_poly_kernel",
        dict(a_ptr="*{dtype}:16", b_ptr="*{dtype}:16", pairs_ptr="*i32:16", M="i32:16", coef_b="fp32", coef_c="fp32"),
        _NS_DTYPES,
        _NS_LAUNCH,
        _ns_work("symmetric_poly"),
        _ns_example,
        spills_ok={
            **_NS_SPILLS,
            "large/bf16/sm_80": (
                "sm_80 has no wgmma: the 128x128 fp32 accumulator (64 registers per thread) and the mma.sync "
                "fragments of both operands overflow 255 registers, by 48 B per thread (local memory, cached in L1)"
            ),
        },
    ),
    Entry(
        _NS,
        "_fused_update_kernel",
        dict(b_ptr="*{dtype}:16", x_ptr="*{dtype}:16", out_ptr="*{dtype}:16", M="i32:16", N="i32:16", coef_a="fp32"),
        _NS_DTYPES,
        _NS_LAUNCH,
        _ns_work("fused_update"),
        _ns_example,
        spills_ok=_NS_SPILLS,
    ),
    Entry(
        "nanochat_fast.kernels.softcap_cross_entropy",
        "_softcap_ce_rows_kernel",
        dict(
            z_ptr="*{dtype}:16",
            z_stride="i32:16",
            targets_ptr="*i64:16",
            scale_ptr="*fp32:16",
            losses_ptr="*fp32:16",
            n_cols="i32:16",
            softcap="fp32",
            ignore_index="i32",
        ),
        (torch.float32, torch.bfloat16),
        lambda mod, cfg, dtype: dict(
            COMPUTE_GRAD=cfg["COMPUTE_GRAD"],
            BLOCK=cfg["BLOCK"],
            num_warps=cfg["num_warps"],
        ),
        _sce_work,
        _sce_example,
    ),
]
