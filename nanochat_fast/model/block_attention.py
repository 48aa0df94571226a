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


def block_size(T: int, window: int) -> int:
    """Queries per block: the window for a short layer (each block sees its own keys and the window
    before); half the sequence for a full causal layer (skips the keys past the block, 1/4 of T x T)."""
    return window if window < T - 1 else -(-T // 2)


def blocks(T: int, window: int) -> list[tuple[int, int, int]]:
    """(first query, end of the queries, first key) of each block; a block's keys end where its queries do."""
    size = block_size(T, window)
    return [(start, min(start + size, T), max(0, start - window)) for start in range(0, T, size)]


def scores_bytes(q: torch.Tensor, window: int) -> int:
    """The probabilities the blocks keep for the backward, over all blocks of a (B, H, T, D) q."""
    B, H, T, _ = q.shape
    return q.element_size() * B * H * sum((end - start) * (end - first) for start, end, first in blocks(T, window))


def use_blocks(q: torch.Tensor, k: torch.Tensor, window: int) -> bool:
    """Whether attention of q over k runs by query blocks: on a CPU, the sequence's own keys, scores
    under SCORES_BYTES."""
    return q.device.type == "cpu" and q.size(2) == k.size(2) and scores_bytes(q, window) <= SCORES_BYTES


def block_attention(q, k, v, window: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for q (B, H, T, D) over k, v (B, Hkv, T, D) (H a multiple of Hkv: grouped
    queries), query i seeing keys j <= i with i - j <= window (window >= T - 1: all of them)."""
    return BlockAttention.apply(q, k, v, window)


def _grouped(q, k, v):
    """Grouped queries: q as (B, Hkv, groups, T, D) against k, v as (B, Hkv, 1, T, D), broadcast without a copy."""
    B, H, T, D = q.shape
    return q.view(B, k.size(1), H // k.size(1), T, D), k.unsqueeze(2), v.unsqueeze(2)


class BlockAttention(torch.autograd.Function):
    # the same autocast in the backward as in the forward (the blocks run only on a CPU)
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, q, k, v, window):
        q5, k5, v5 = _grouped(q, k, v)
        T, D = q.size(2), q.size(3)
        positions = torch.arange(T, device=q.device)
        softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 scores: softmax in fp32
        out, probs = [], []
        for start, end, first in blocks(T, window):
            scores = (q5[..., start:end, :] @ k5[..., first:end, :].mT).to(softmax_dtype) * D**-0.5
            offset = positions[start:end, None] - positions[None, first:end]
            scores = scores.masked_fill((offset < 0) | (offset > window), float("-inf"))
            p = torch.softmax(scores, dim=-1).to(v.dtype)
            probs.append(p)
            out.append(p @ v5[..., first:end, :])
        ctx.save_for_backward(q, k, v, *probs)
        ctx.window = window
        return torch.cat(out, dim=-2).view(q.shape).to(q.dtype)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad_out):
        q, k, v, *probs = ctx.saved_tensors
        q5, k5, v5 = _grouped(q, k, v)
        g5 = grad_out.reshape(q5.shape)  # the gradient may come transposed
        T, D = q.size(2), q.size(3)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq, dk, dv = [], *(torch.zeros(q5.shape, dtype=acc, device=q.device) for _ in "kv")
        for (start, end, first), p in zip(blocks(T, window=ctx.window), probs):
            dp = (g5[..., start:end, :] @ v5[..., first:end, :].mT).to(acc)
            pf = p.to(acc)
            # softmax's backward: dS = P (dP - rowsum(dP P)), with the 1/sqrt(D) of the forward
            ds = (pf * (dp - (dp * pf).sum(-1, keepdim=True)) * D**-0.5).to(p.dtype)
            dq.append(ds @ k5[..., first:end, :])
            dk[..., first:end, :] += ds.mT @ q5[..., start:end, :]
            dv[..., first:end, :] += p.mT @ g5[..., start:end, :]
        dq = torch.cat(dq, dim=-2).view(q.shape)
        return dq.to(q.dtype), dk.sum(2).to(k.dtype), dv.sum(2).to(v.dtype), None
