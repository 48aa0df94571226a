"""
Triton AdamW over many tensors in one launch (the multi-tensor-apply pattern).

The host builds a table of raw pointers (param, grad, exp_avg, exp_avg_sq per tensor) and a table
of blocks (which tensor, which offset); program i updates block i. One launch covers every tensor
of a dtype, so ~50 small parameter slices cost one kernel launch instead of ~50 x 5 elementwise ops.
Loads are cast to fp32 before any arithmetic and rounded back to nearest even on store: bf16
params get fp32 math, and the Triton interpreter (whose bf16 arithmetic and casts are inexact)
gives the same bits as a GPU.
"""

import functools

import torch
import triton
import triton.language as tl

from .adamw_slice_hparams import SLOT
from .triton_utils import to_bf16_rtne

# the hyperparameter slots, by name (adamw_slice_hparams.py); Triton reads globals only as constexpr
LR = tl.constexpr(SLOT["lr"])
BETA1 = tl.constexpr(SLOT["beta1"])
BETA2 = tl.constexpr(SLOT["beta2"])
EPS = tl.constexpr(SLOT["eps"])
WEIGHT_DECAY = tl.constexpr(SLOT["weight_decay"])
BIAS_CORRECTION1 = tl.constexpr(SLOT["bias_correction1"])
BIAS_CORRECTION2_SQRT = tl.constexpr(SLOT["bias_correction2_sqrt"])

# Block configs by device. On an H100 the kernel is bandwidth bound: 2048 elements x 28 B per
# element per program with 8 warps keeps enough bytes in flight. The interpreter runs a program
# at a time in numpy, so bigger blocks mean fewer (slow) program iterations.
CONFIGS = {
    "cuda": dict(BLOCK=2048, num_warps=8),
    "cpu": dict(BLOCK=4096, num_warps=1),
}
# every config a GPU may launch: compiled and resource-checked ahead of time (benchmarks/triton_aot.py)
GPU_CONFIGS = {"default": CONFIGS["cuda"]}


@triton.jit
def _adamw_multi_tensor_kernel(
    table_ptr,  # int64[5, n_tensors]: param, grad, exp_avg, exp_avg_sq pointers; numel
    muls_ptr,  # float32[2, n_tensors]: lr_mul, wd_mul
    blocks_ptr,  # int64[2, n_blocks]: tensor index, element offset
    hparams_ptr,  # float64[7], slots named in adamw_slice_hparams.py
    n_tensors,
    n_blocks,
    IS_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(blocks_ptr + pid)
    start = tl.load(blocks_ptr + n_blocks + pid)
    param_dtype = tl.bfloat16 if IS_BF16 else tl.float32
    p_ptr = tl.load(table_ptr + t).to(tl.pointer_type(param_dtype))
    g_ptr = tl.load(table_ptr + n_tensors + t).to(tl.pointer_type(param_dtype))
    m_ptr = tl.load(table_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(table_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
    numel = tl.load(table_ptr + 4 * n_tensors + t)

    lr = tl.load(hparams_ptr + LR) * tl.load(muls_ptr + t)
    beta1 = tl.load(hparams_ptr + BETA1).to(tl.float32)
    beta2 = tl.load(hparams_ptr + BETA2).to(tl.float32)
    eps = tl.load(hparams_ptr + EPS).to(tl.float32)
    wd = tl.load(hparams_ptr + WEIGHT_DECAY) * tl.load(muls_ptr + n_tensors + t)
    decay = (1.0 - lr * wd).to(tl.float32)
    step_size = (lr / tl.load(hparams_ptr + BIAS_CORRECTION1)).to(tl.float32)
    inv_bc2_sqrt = (1.0 / tl.load(hparams_ptr + BIAS_CORRECTION2_SQRT)).to(tl.float32)

    offs = start + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) * inv_bc2_sqrt + eps
    p = p * decay - step_size * (m / denom)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if IS_BF16:
        tl.store(p_ptr + offs, to_bf16_rtne(p), mask=mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)


@functools.lru_cache(maxsize=32)
def _block_table(numels: tuple, block: int, device: torch.device) -> torch.Tensor:
    """(2, n_blocks) int64 on `device`: the tensor index and start offset of every block. It depends
    only on the sizes, so it is built (and copied to the GPU) once per parameter layout, not per step:
    a 60M-parameter model has ~30K blocks."""
    block_tensor, block_start = [], []
    for i, numel in enumerate(numels):
        starts = range(0, numel, block)
        block_tensor += [i] * len(starts)
        block_start += starts
    return torch.tensor([block_tensor, block_start], dtype=torch.int64, device=device)


def _launch(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls):
    device = params[0].device
    cfg = CONFIGS["cuda" if device.type == "cuda" else "cpu"]
    n = len(params)
    numels = [p.numel() for p in params]
    blocks = _block_table(tuple(numels), cfg["BLOCK"], device)
    n_blocks = blocks.size(1)
    if n_blocks == 0:
        return
    table = torch.tensor(
        [
            [t.data_ptr() for t in params],
            [t.data_ptr() for t in grads],
            [t.data_ptr() for t in exp_avgs],
            [t.data_ptr() for t in exp_avg_sqs],
            numels,
        ],
        dtype=torch.int64,
    )
    muls = torch.tensor([lr_muls, wd_muls], dtype=torch.float32)
    if device.type != "cpu":  # tiny tables: one pinned host->device copy each, no sync
        table, muls = (x.pin_memory().to(device, non_blocking=True) for x in (table, muls))
    _adamw_multi_tensor_kernel[(n_blocks,)](
        table,
        muls,
        blocks,
        hparams,
        n,
        n_blocks,
        IS_BF16=params[0].dtype == torch.bfloat16,
        BLOCK=cfg["BLOCK"],
        num_warps=cfg["num_warps"],
    )


def adamw_slice_update_triton(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls):
    """One launch per param dtype present (normally one)."""
    by_dtype = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    for idx in by_dtype.values():

        def pick(seq):
            return [seq[i] for i in idx]

        _launch(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), hparams, pick(lr_muls), pick(wd_muls))
