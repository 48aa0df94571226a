"""
The objective of chat_rl: nanochat's "GRPO", which ends up much simpler, close to REINFORCE:

    no KL term and no reference model
    on-policy: each batch of samples from the weights being trained is used for one optimizer
               step, so no PPO ratio and no clipping
    advantage  A_i = r_i - mean(r) over the samples of the same question (no division by the std)
    token-level (DAPO) normalisation over every sampled token t of every sample i of the step (all
               questions, all ranks): loss = -sum_i sum_t A_i * log p(t) / (sampled tokens in the step)

Only sampled tokens carry loss: the prompt, the calculator's output that the engine forced into a
sample (batch_engine.Token.forced) and the padding get target -1. A micro-batch is (inputs,
targets, advantages), one row per sample; training_loop.train_step divides its summed loss
(weighted_loss_sum: sum of A * cross-entropy) by the global count of targets, as for every masked
loss, so each sampled token weighs the same, however long its sample, on 1 and N processes.
"""

import torch


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(..., num_samples) rewards of each question's samples -> reward minus its question's mean."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


def rollout_batch(
    prompt: list[int], samples: list[tuple[list[int], list[bool]]], advantage: torch.Tensor, pad_id: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One question's samples as a micro-batch (inputs, targets, advantages): row i is prompt +
    sample i's tokens (ids, forced flags), padded with pad_id on the right; a target is the next
    token where that token was sampled, -1 where it is the prompt's, forced or padding."""
    rows = [(prompt + ids, [False] * len(prompt) + [not f for f in forced]) for ids, forced in samples]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    sampled = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        sampled[i, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    targets = ids[:, 1:].masked_fill(~sampled[:, 1:], -1)
    return ids[:, :-1].to(device), targets.to(device), advantage.to(device=device, dtype=torch.float32)


def weighted_loss_sum(token_losses: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """sum over rows and tokens of weight_row * loss_token: with the cross-entropies of the sampled
    tokens (0 where the target is -1) and the advantages, -sum A * log p."""
    return (token_losses.float() * row_weights.unsqueeze(1)).sum()
