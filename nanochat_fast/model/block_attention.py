"""
Causal (optionally sliding-window) attention on a CPU as matmuls over blocks of queries, for a sequence
attending to its own keys: faster there than torch's flash kernel (docs/measurements.md#attention-by-query-blocks).
Each block's product with the keys it can see, a masked fp32 softmax rounded to the inputs' dtype, the values;
the backward is flash attention's, from those probabilities. The price is memory: every block's probabilities
are kept (B x H x ~T^2/2 a layer, where flash keeps O(T)), so the blocks run while a layer's stay under SCORES_BYTES.
"""

import torch

# a layer's kept probabilities above this go to SDPA (flash: no T x T kept): 8 rows x 4 heads at T = 512 keep
# ~12 MiB a layer in bf16; nanochat's depth 20 at T = 2048 would keep ~0.5 GiB a layer
SCORES_BYTES = 128 << 20


def window_mask(positions_q: torch.Tensor, positions_k: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean (Tq, Tk): key j is seen by query i when j <= i and i - j <= window."""
    diff = positions_q[:, None] - positions_k[None, :]
    return (diff >= 0) & (diff <= window)


def block_size(T: int, window: int) -> int:
    """Queries per block: the window for a short layer (each block sees its own keys and the window
    before); half the sequence for a full causal layer (skips the keys past the block, 1/4 of T x T)."""
    return window if window < T - 1 else -(-T // 2)


def in_one_batch(T: int, window: int) -> bool:
    """Whether a short layer's blocks can run as one batch: the window divides T. Every block then sees
    2 x window keys (block 0 masks the window before the sequence), so one product and one softmax serve all."""
    return window < T - 1 and T % window == 0


def blocks(T: int, window: int) -> list[tuple[int, int, int]]:
    """(first query, end of the queries, first key) of each block; a block's keys end where its queries do."""
    size = block_size(T, window)
    return [(start, min(start + size, T), max(0, start - window)) for start in range(0, T, size)]


def scores_bytes(q: torch.Tensor, window: int) -> int:
    """The probabilities the blocks keep for the backward, over all blocks of a (B, H, T, D) q (as one batch
    where in_one_batch: the larger count)."""
    B, H, T, _ = q.shape
    if in_one_batch(T, window):
        return q.element_size() * B * H * T * 2 * window
    return q.element_size() * B * H * sum((end - start) * (end - first) for start, end, first in blocks(T, window))


def use_blocks(q: torch.Tensor, k: torch.Tensor, window: int) -> bool:
    """Whether attention of q over k runs by query blocks: on a CPU, the sequence's own keys, scores
    under SCORES_BYTES."""
    return q.device.type == "cpu" and q.size(2) == k.size(2) and scores_bytes(q, window) <= SCORES_BYTES


def block_attention(q, k, v, window: int, one_batch: bool | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for q (B, H, T, D) over k, v (B, Hkv, T, D) (H a multiple of Hkv: grouped
    queries), query i seeing keys j <= i with i - j <= window (window >= T - 1: all of them). one_batch: a
    short layer's blocks as one batch where in_one_batch allows; None: under torch.compile only, where the
    shorter graph compiles faster (eager, the loop is faster: docs/measurements.md#attention-by-query-blocks)."""
    if one_batch is None:
        one_batch = torch.compiler.is_compiling()
    return BlockAttention.apply(q, k, v, window, one_batch and in_one_batch(q.size(2), window))


def _grouped(q, k, v):
    """Grouped queries: q as (B, Hkv, groups, T, D) against k, v as (B, Hkv, 1, T, D), broadcast without a copy."""
    B, H, T, D = q.shape
    return q.view(B, k.size(1), H // k.size(1), T, D), k.unsqueeze(2), v.unsqueeze(2)


def _windows(t, window: int):
    """(..., T, D) -> (..., T / window, 2 x window, D): each block's keys, the window before it (zeros before
    the sequence) then its own."""
    own = t.unflatten(-2, (-1, window))
    before = torch.cat([torch.zeros_like(own[..., :1, :, :]), own[..., :-1, :, :]], dim=-3)
    return torch.cat([before, own], dim=-2)


def _from_windows(x, window: int):
    """The adjoint of _windows: (..., n, 2 x window, D) -> (..., n x window, D), each key's own block's
    rows plus the next block's."""
    own, before = x[..., window:, :], x[..., 1:, :window, :]
    return torch.cat([own[..., :-1, :, :] + before, own[..., -1:, :, :]], dim=-3).flatten(-3, -2)


def _masked_probs(scores, visible, D: int, dtype):
    """A block's probabilities: scores scaled by 1/sqrt(D), keys out of sight at -inf, the softmax rounded to dtype."""
    return torch.softmax((scores * D**-0.5).masked_fill(~visible, float("-inf")), dim=-1).to(dtype)


def _dscores(p, dp, D: int):
    """Softmax's backward from the kept probabilities: dS = P (dP - rowsum(dP P)), with the forward's 1/sqrt(D)."""
    pf = p.to(dp.dtype)
    return (pf * (dp - (dp * pf).sum(-1, keepdim=True)) * D**-0.5).to(p.dtype)


class BlockAttention(torch.autograd.Function):
    # the same autocast in the backward as in the forward (the blocks run only on a CPU)
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, q, k, v, window, one_batch):
        q5, k5, v5 = _grouped(q, k, v)
        T, D = q.size(2), q.size(3)
        positions = torch.arange(T, device=q.device)
        softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 scores: softmax in fp32
        if one_batch:
            keys = positions[: 2 * window]  # a block's queries sit at the last window of its keys
            visible = window_mask(keys[window:], keys, window)
            visible = torch.stack([visible & (keys >= window), *[visible] * (T // window - 1)])
            scores = (q5.unflatten(-2, (-1, window)) @ _windows(k5, window).mT).to(softmax_dtype)
            probs = [_masked_probs(scores, visible, D, v.dtype)]
            out = (probs[0] @ _windows(v5, window)).flatten(-3, -2)
        else:
            out, probs = [], []
            for start, end, first in blocks(T, window):
                scores = (q5[..., start:end, :] @ k5[..., first:end, :].mT).to(softmax_dtype)
                p = _masked_probs(scores, window_mask(positions[start:end], positions[first:end], window), D, v.dtype)
                probs.append(p)
                out.append(p @ v5[..., first:end, :])
            out = torch.cat(out, dim=-2)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.window, ctx.one_batch = window, one_batch
        return out.view(q.shape).to(q.dtype)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad_out):
        q, k, v, *probs = ctx.saved_tensors
        q5, k5, v5 = _grouped(q, k, v)
        g5 = grad_out.reshape(q5.shape)  # the gradient may come transposed
        T, D, window = q.size(2), q.size(3), ctx.window
        acc = torch.promote_types(q.dtype, torch.float32)
        if ctx.one_batch:
            (p,) = probs
            qb, gb = q5.unflatten(-2, (-1, window)), g5.unflatten(-2, (-1, window))
            keys, values = _windows(k5, window), _windows(v5, window)
            ds = _dscores(p, (gb @ values.mT).to(acc), D)
            dq = (ds @ keys).flatten(-3, -2)
            dk = _from_windows((ds.mT @ qb).to(acc), window)
            dv = _from_windows((p.mT @ gb).to(acc), window)
        else:
            dq, dk, dv = [], *(torch.zeros(q5.shape, dtype=acc, device=q.device) for _ in "kv")
            for (start, end, first), p in zip(blocks(T, window), probs):
                ds = _dscores(p, (g5[..., start:end, :] @ v5[..., first:end, :].mT).to(acc), D)
                dq.append(ds @ k5[..., first:end, :])
                dk[..., first:end, :] += ds.mT @ q5[..., start:end, :]
                dv[..., first:end, :] += p.mT @ g5[..., start:end, :]
            dq = torch.cat(dq, dim=-2)
        return dq.view(q.shape).to(q.dtype), dk.sum(2).to(k.dtype), dv.sum(2).to(v.dtype), None, None
