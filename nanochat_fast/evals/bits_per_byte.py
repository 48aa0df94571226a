"""Validation bits per byte: the loss measure that compares models with different tokenizers
(nats per token depend on how much text a token holds; bits per UTF-8 byte do not). The training
loop evaluates it every --eval-every steps, base_eval once on a checkpoint."""

import math

import torch

from ..core.distributed import all_reduce_sum


@torch.no_grad()
def evaluate_bpb(model, batches, token_bytes: torch.Tensor, autocast_ctx) -> float:
    """Bits per byte over (x, y) batches: summed next-token loss in nats over the summed UTF-8
    bytes of the target tokens, special tokens (0 bytes) and masked targets (-1) excluded. All
    ranks' sums are added, so the figure is the same for any number of processes."""
    total_nats = torch.zeros((), dtype=torch.float64, device=token_bytes.device)
    total_bytes = torch.zeros((), dtype=torch.float64, device=token_bytes.device)
    for x, y in batches:
        with autocast_ctx:
            loss = model(x, y, loss_reduction="none").view(-1).double()
        y = y.view(-1)
        valid = y >= 0
        nbytes = torch.where(valid, token_bytes[y.clamp(min=0)], 0)
        counted = nbytes > 0
        total_nats += (loss * counted).sum()
        total_bytes += nbytes.sum()
    both = all_reduce_sum(torch.stack([total_nats, total_bytes]))
    return (both[0] / (math.log(2) * both[1])).item() if both[1] > 0 else float("nan")
