"""
softcap_cross_entropy: from the final hidden states and the lm_head weight to the loss, in chunks of rows,
never holding all N x V logits: cross_entropy(softcap * tanh(hidden @ weight.T / softcap), targets).
Math fp32 whatever the inputs' dtype (fp32 or bf16, both alike); gradients in the inputs' dtypes. Backends:
triton (CUDA: the row pass below, matmuls cuBLAS), cpp (CPU), torch (the same loop in PyTorch ops),
reference (full logits). Gradients computed in the forward pass: docs/measurements.md#fused-cross-entropy.
"""

import numbers
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from . import registry
from .triton_utils import store, tl, triton

OP = "softcap_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")
# Rows per chunk: the smallest at which the matmuls run at full speed (a bigger chunk only holds more
# logits): docs/measurements.md#cross-entropy-chunk-rows (benchmarks/bench_softcap_cross_entropy.py).
CHUNK_ROWS = {"cpu": 1024, "cuda": 4096, "mps": 1024}


def _check(hidden, weight, targets, softcap, ignore_index, reduction, chunk_rows):
    """ValueError naming the argument; only metadata is read (no host sync on a GPU)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, d], got shape {tuple(hidden.shape)}; flatten the batch first")
    if weight.dim() != 2 or weight.size(1) != hidden.size(1):
        raise ValueError(
            f"weight must be [V, d] with d = hidden.size(1) = {hidden.size(1)}, got shape {tuple(weight.shape)}"
        )
    if targets.dim() != 1 or targets.size(0) != hidden.size(0) or targets.dtype != torch.int64:
        raise ValueError(
            f"targets must be int64 [N] with N = hidden.size(0) = {hidden.size(0)}, "
            f"got {targets.dtype} of shape {tuple(targets.shape)}"
        )
    for name, t in (("weight", weight), ("targets", targets)):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be None (automatic) or an int >= 1, got {chunk_rows!r}")


def softcap_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float, ignore_index: int = -1,
    reduction: str = "mean", *, backend=None, chunk_rows=None,
):  # fmt: skip
    """cross_entropy(softcap * tanh(hidden @ weight.T / softcap), targets), differentiable w.r.t.
    hidden and weight. `backend` forces one by name (default: NANOCHAT_FAST_KERNELS, else auto);
    `chunk_rows` overrides the rows per chunk of the chunked backends."""
    _check(hidden, weight, targets, softcap, ignore_index, reduction, chunk_rows)
    device_type = hidden.device.type
    impl = registry.select(OP, device_type, backend)
    no_autocast = nullcontext()
    if torch.is_autocast_enabled(device_type):
        # what nn.Linear does under autocast: the matmul inputs in the autocast dtype (the cast is
        # differentiable, so fp32 master weights get fp32 gradients); inside, every tensor keeps its dtype
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        no_autocast = torch.autocast(device_type, enabled=False)
    if hidden.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != hidden.dtype:
        raise ValueError(
            f"hidden and weight must both be float32 or both bfloat16 (outside autocast), "
            f"got hidden {hidden.dtype} and weight {weight.dtype}"
        )
    with no_autocast:
        return impl.fn(hidden, weight, targets, float(softcap), ignore_index, reduction, chunk_rows)


# -- backends: each takes (hidden, weight, targets, softcap, ignore_index, reduction, chunk_rows) -------


@registry.register(OP, "reference")
def reference_backend(hidden, weight, targets, softcap, ignore_index, reduction, chunk_rows):
    """The stock computation: all N x V logits in fp32, then F.cross_entropy."""
    logits = softcap * torch.tanh(F.linear(hidden, weight).float() / softcap)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


# -- the chunk loop of the torch and triton ops (the cpp op runs the same loop in C++) ----------------


def chunked(hidden, weight, targets, softcap, ignore_index, grad_scale, chunk_rows, row_pass):
    """row_pass(z, targets, scale, losses, softcap, ignore_index) turns a chunk of logits z (in
    place) into dz when scale (per-row weights) is not None, and writes the rows' losses."""
    N, V = hidden.size(0), weight.size(0)
    losses = hidden.new_empty(N, dtype=torch.float32)
    buf = hidden.new_empty(min(chunk_rows, N), V)
    if grad_scale is None:
        dhidden, dweight, scale = hidden.new_empty(0), weight.new_empty(0), None
    else:
        dhidden = torch.empty_like(hidden)
        dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        scale = grad_scale.float().expand(N)
    for r0 in range(0, N, chunk_rows):
        r1 = min(r0 + chunk_rows, N)
        h, z = hidden[r0:r1], buf[: r1 - r0]
        torch.mm(h, weight.T, out=z)
        row_pass(z, targets[r0:r1], None if scale is None else scale[r0:r1], losses[r0:r1], softcap, ignore_index)
        if scale is not None:
            torch.mm(z, weight, out=dhidden[r0:r1])
            if z.dtype == torch.float32:
                dweight.addmm_(z.T, h)
            else:  # bf16 matmul (fp32 accumulation inside), summed over chunks in fp32
                dweight += z.T @ h
    if scale is None:
        return losses, losses.sum(), dhidden, dweight
    return losses, (losses * scale).sum(), dhidden, dweight.to(weight.dtype)


def torch_row_pass(z, targets, scale, losses, softcap, ignore_index):
    """The row pass in plain PyTorch ops (several passes over the chunk, fp32 temporaries)."""
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    t = torch.tanh(z.float() / softcap)
    logp = torch.log_softmax(t * softcap, dim=1)
    losses.copy_(torch.where(valid, -logp.gather(1, safe[:, None]).squeeze(1), 0.0))
    if scale is None:
        return
    p = logp.exp_()  # softmax
    p.scatter_add_(1, safe[:, None], -torch.ones_like(p[:, :1]))
    p.mul_(t.square_().neg_().add_(1.0))  # d softcap(z) / dz = 1 - tanh^2
    p.mul_(torch.where(valid, scale, 0.0)[:, None])
    z.copy_(p)


# -- the row pass as one Triton kernel: one program per row of a chunk of logits z [rows, V]: the loss by
# an online logsumexp (z read once; NaN for a target outside [0, V): a kernel cannot raise), then with
# gradients dz = g * (softmax(y) - onehot(target)) * (1 - tanh^2) over z. Loads go to fp32 before any
# arithmetic, bf16 stores round to nearest even: the interpreter computes a GPU's bits. BLOCK: vocabulary
# entries per step (docs/measurements.md#gpu-kernel-configs); the interpreter's small, so tests span blocks.
CONFIGS = {"cuda": dict(BLOCK=4096, num_warps=8), "cpu": dict(BLOCK=256, num_warps=1)}
# every variant a GPU may compile (benchmarks/triton_aot.py): training's pass and evaluation's loss-only one
GPU_CONFIGS = {"grad": dict(CONFIGS["cuda"], COMPUTE_GRAD=True), "loss": dict(CONFIGS["cuda"], COMPUTE_GRAD=False)}


@triton.jit
def _tanh(x):
    """tanh from one exp, stable for any x: (1 - e) / (1 + e) with e = exp(-2|x|), signed; absolute
    error ~1e-7, what a logit compared on an absolute scale needs."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _softcap_ce_rows_kernel(
    z_ptr,
    z_stride,  # logits chunk [rows, V] (fp32 or bf16); dz is written over it
    targets_ptr,  # int64 [rows]
    scale_ptr,  # fp32 [rows]: per-row gradient weights (read when COMPUTE_GRAD)
    losses_ptr,  # fp32 [rows]
    n_cols,
    softcap,
    ignore_index,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * z_stride
    target = tl.load(targets_ptr + row)
    inv_cap = 1.0 / softcap
    cols = tl.arange(0, BLOCK)

    # pass 1: online logsumexp of the softcapped logits (the sum rescaled when the max grows)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        z = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.where(mask, softcap * _tanh(z * inv_cap), float("-inf"))
        m_new = tl.maximum(m, tl.max(y, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(y - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)

    valid = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    z_target = tl.load(row_ptr + target, mask=valid & in_range, other=0.0).to(tl.float32)
    # log(s) - (y_target - m): exactly log(s) when the target is the row's maximum, so a confident
    # prediction's small loss keeps its precision
    loss = tl.log(s) - (softcap * _tanh(z_target * inv_cap) - m)
    loss = tl.where(in_range, loss, float("nan"))
    tl.store(losses_ptr + row, tl.where(valid, loss, 0.0))

    if COMPUTE_GRAD:
        g = tl.load(scale_ptr + row)
        g = tl.where(valid, g, 0.0)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            z = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            t = _tanh(z * inv_cap)
            p = tl.exp(softcap * t - lse)
            p = tl.where(start + cols == target, p - 1.0, p)
            dz = g * p * (1.0 - t * t)
            store(row_ptr + start + cols, dz, mask)


def triton_row_pass(z, targets, scale, losses, softcap, ignore_index, config=None):
    """The row pass of `chunked`: losses[r] for every row of z, and dz over z when `scale` (fp32 per-row
    weights) is given."""
    rows, n_cols = z.shape
    if rows == 0:
        return
    cfg = config or CONFIGS["cuda" if z.is_cuda else "cpu"]
    compute_grad = scale is not None
    # one weight per row, contiguous (a shared weight comes as a stride-0 view): one variant per dtype and pass
    scale = scale.contiguous() if compute_grad else losses  # losses: not read
    _softcap_ce_rows_kernel[(rows,)](
        z, z.stride(0), targets, scale, losses, n_cols, softcap, ignore_index,
        COMPUTE_GRAD=compute_grad, BLOCK=min(cfg["BLOCK"], triton.next_power_of_2(n_cols)), num_warps=cfg["num_warps"],
    )  # fmt: skip


# -- the ops: fake kernels and the autograd formula shared by all three (the cpp op's schema: csrc/ops.cpp) --


def _fake(hidden, weight, targets, softcap, ignore_index, grad_scale, chunk_rows):
    losses = hidden.new_empty(hidden.size(0), dtype=torch.float32)
    total = hidden.new_empty((), dtype=torch.float32)
    if grad_scale is None:
        return losses, total, hidden.new_empty(0), weight.new_empty(0)
    return losses, total, torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, softcap, ignore_index, grad_scale, chunk_rows = inputs
    _, _, dhidden, dweight = output
    ctx.mark_non_differentiable(dhidden, dweight)
    ctx.set_materialize_grads(False)  # None for an unused output: tells "only total" from "losses too"
    ctx.args = (softcap, ignore_index, chunk_rows)
    ctx.save_for_backward(hidden, weight, targets, grad_scale, dhidden, dweight)


def _backward_of(op_name):
    def backward(ctx, g_losses, g_total, _g_dhidden, _g_dweight):
        hidden, weight, targets, grad_scale, dhidden, dweight = ctx.saved_tensors
        if g_losses is None and g_total is None:
            return (None,) * 7
        if g_losses is None and grad_scale is not None:
            dhidden, dweight = dhidden * g_total, dweight * g_total  # computed in the forward pass
        else:  # recompute, chunk by chunk, with per-row weights d(output)/d(losses_i)
            rows = 0.0 if g_losses is None else g_losses
            if g_total is not None:
                rows = rows + (g_total if grad_scale is None else g_total * grad_scale)
            rows = torch.as_tensor(rows, dtype=torch.float32, device=hidden.device)
            op = getattr(torch.ops.nanochat_fast, op_name)
            _, _, dhidden, dweight = op(hidden, weight, targets, *ctx.args[:2], rows, ctx.args[2])
        grads = (dhidden if ctx.needs_input_grad[0] else None, dweight if ctx.needs_input_grad[1] else None)
        return (*grads, None, None, None, None, None)

    return backward


def _register(backend, name, row_pass=None):
    """Backend `backend` through nanochat_fast::<name> (the gradients in the forward pass for sum and mean,
    when they will be needed), with the op's fake kernel and autograd formula: a Python op running
    `chunked` with `row_pass`, or (None) the C++ op."""

    @registry.register(OP, backend)
    def run(hidden, weight, targets, softcap, ignore_index, reduction, chunk_rows):
        need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        count = (targets != ignore_index).sum() if reduction == "mean" else None
        grad_scale = None
        if need_grad and reduction != "none":
            grad_scale = 1.0 / count if reduction == "mean" else torch.ones((), device=hidden.device)
        rows = chunk_rows or max(1, min(hidden.size(0), CHUNK_ROWS.get(hidden.device.type, 1024)))
        op = getattr(torch.ops.nanochat_fast, name)
        losses, total, _, _ = op(
            hidden.contiguous(), weight.contiguous(), targets.contiguous(), softcap, ignore_index, grad_scale, rows
        )
        if reduction == "none":
            return losses
        return total / count if reduction == "mean" and grad_scale is None else total

    if row_pass is not None:

        @torch.library.custom_op(f"nanochat_fast::{name}", mutates_args=())
        def op(
            hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float, ignore_index: int,
            grad_scale: torch.Tensor | None, chunk_rows: int,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
            return chunked(hidden, weight, targets, softcap, ignore_index, grad_scale, chunk_rows, row_pass)

    elif registry.extension() is None:
        return  # no C++ op to register for
    torch.library.register_fake(f"nanochat_fast::{name}")(_fake)
    torch.library.register_autograd(f"nanochat_fast::{name}", _backward_of(name), setup_context=_setup_context)


_register("torch", "softcap_cross_entropy_torch", torch_row_pass)
_register("triton", "softcap_cross_entropy_triton", triton_row_pass)
_register("cpp", "softcap_cross_entropy")
