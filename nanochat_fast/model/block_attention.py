"""
Causal (optionally sliding-window) attention on a CPU as matmuls over blocks of queries, for a sequence
attending to its own keys: faster there than torch's flash kernel (docs/measurements.md#attention-by-query-blocks).
Each block's product with the keys it can see, a masked fp32 softmax, then the values. The price is memory:
every block's softmax is kept for the backward (B x H x ~T^2/2 fp32 scores a layer, where flash keeps O(T)),
so the blocks run only while a layer's scores stay under SCORES_BYTES.
"""

import torch

# a layer's fp32 scores above this go to SDPA (flash: no T x T scores kept): 8 rows x 4 heads at T = 512
# keep ~25 MiB a layer; nanochat's depth 20 at T = 2048 would keep ~1 GiB a layer
SCORES_BYTES = 128 << 20


def block_size(T: int, window: int) -> int:
    """Queries per block: the window for a short layer (each block sees its own keys and the window
    before); half the sequence for a full causal layer (skips the keys past the block, 1/4 of T x T)."""
    return window if window < T - 1 else -(-T // 2)


def scores_bytes(q: torch.Tensor, window: int) -> int:
    """The fp32 scores the blocks keep for the backward, over all blocks of a (B, H, T, D) q."""
    B, H, T, _ = q.shape
    block = block_size(T, window)
    ends = [(start, min(start + block, T)) for start in range(0, T, block)]
    return 4 * B * H * sum((end - start) * (end - max(0, start - window)) for start, end in ends)


def use_blocks(q: torch.Tensor, k: torch.Tensor, window: int) -> bool:
    """Whether attention of q over k runs by query blocks: on a CPU, the sequence's own keys, scores
    under SCORES_BYTES."""
    return q.device.type == "cpu" and q.size(2) == k.size(2) and scores_bytes(q, window) <= SCORES_BYTES


def block_attention(q, k, v, window: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for q (B, H, T, D) over k, v (B, Hkv, T, D) (H a multiple of Hkv: grouped
    queries), query i seeing keys j <= i with i - j <= window (window >= T - 1: all of them)."""
    B, H, T, D = q.shape
    groups = H // k.size(1)
    # grouped queries: (B, Hkv, groups, T, D) against keys (B, Hkv, 1, T, D), broadcast without a copy
    q5, k5, v5 = q.view(B, k.size(1), groups, T, D), k.unsqueeze(2), v.unsqueeze(2)
    positions = torch.arange(T, device=q.device)
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 scores: softmax in fp32
    block, out = block_size(T, window), []
    for start in range(0, T, block):
        end, first_key = min(start + block, T), max(0, start - window)
        scores = (q5[..., start:end, :] @ k5[..., first_key:end, :].mT).to(softmax_dtype) * D**-0.5
        offset = positions[start:end, None] - positions[None, first_key:end]
        scores = scores.masked_fill((offset < 0) | (offset > window), float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(v.dtype)
        out.append(weights @ v5[..., first_key:end, :])
    return torch.cat(out, dim=-2).view(B, H, T, D)
