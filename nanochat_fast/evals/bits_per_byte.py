"""Validation bits per byte: the loss measure that compares models with different tokenizers
(nats per token depend on how much text a token holds; bits per UTF-8 byte do not). The training
loop evaluates it every --eval-every steps, base_eval once on a checkpoint."""

import math

import torch

from ..core.distributed import all_reduce_sum


def evaluate_bpb(model, batches, token_bytes: torch.Tensor, autocast_ctx) -> float:
    """Bits per byte over (x, y) batches: summed next-token loss in nats over the summed UTF-8
    bytes of the target tokens, special tokens (0 bytes) and masked targets (-1) excluded. All
    ranks' sums are added, so the figure is the same for any number of processes."""
    return evaluate_bpb_each(model, batches, [token_bytes], autocast_ctx)[0]


@torch.no_grad()
def evaluate_bpb_each(model, batches, tables: list[torch.Tensor], autocast_ctx) -> list[float]:
    """evaluate_bpb for several byte-length tables in one pass over the batches (an imported run
    whose nanochat token_bytes.pt was computed the old way reports both figures)."""
    sums = torch.zeros(len(tables), 2, dtype=torch.float64, device=tables[0].device)  # (nats, bytes) per table
    for x, y in batches:
        with autocast_ctx:
            loss = model(x, y, loss_reduction="none").view(-1).double()
        y = y.view(-1)
        valid = y >= 0
        for k, token_bytes in enumerate(tables):
            nbytes = torch.where(valid, token_bytes[y.clamp(min=0)], 0)
            sums[k, 0] += (loss * (nbytes > 0)).sum()
            sums[k, 1] += nbytes.sum()
    sums = all_reduce_sum(sums)
    return [(n / (math.log(2) * b)).item() if b > 0 else float("nan") for n, b in sums]
