"""Tiny GPTs for the tests: random weights in every parameter, GPT.generate's tokens recomputed the
slow way, and a 2-layer GPT trained a few optimizer steps on counting sequences (Muon's tests)."""

import torch

from nanochat_fast import optim
from nanochat_fast.model.batch_engine import sample_next
from nanochat_fast.model.gpt import GPT, GPTConfig

TINY = GPTConfig(sequence_len=16, vocab_size=101, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def random_model(config=TINY, seed=0):
    """nanochat's init, then random values in the zero-initialised projections: with the real init
    every logit starts at 0 and argmax/masking tests would pass trivially."""
    torch.manual_seed(seed)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().max() == 0:
                p.normal_(0, 0.3)
    return model


def generate_without_cache(model, tokens, max_tokens, temperature=1.0, top_k=None, seed=42):
    """GPT.generate's tokens the slow way, for checking it: the whole sequence run again for every
    token (no cache), the same sampling rule and a generator seeded the same."""
    rng = torch.Generator(device=model.get_device())
    rng.manual_seed(seed)
    ids = torch.tensor([tokens], dtype=torch.long, device=model.get_device())
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids = torch.cat((ids, sample_next(model(ids)[:, -1, :], temperature, top_k, rng)), dim=1)
    return ids[0, len(tokens) :].tolist()


COUNTING = GPTConfig(sequence_len=32, vocab_size=128, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)


def counting_model(device="cpu"):
    """The GPT of COUNTING with nanochat's init (seed 0), for counting_batches."""
    torch.manual_seed(0)
    model = GPT(COUNTING).to(device)
    model.init_weights()
    return model


def counting_batches(steps: int, noise: float = 0.0, device="cpu"):
    """steps + 1 batches of 4 rows of 33 tokens counting up (mod 128) from random starts, with a
    fraction `noise` of the tokens replaced by random ones; the last batch is for evaluation."""
    gen = torch.Generator().manual_seed(1)
    data = (torch.randint(0, 128, (steps + 1, 4, 1), generator=gen) + torch.arange(33)) % 128
    if noise:
        replaced = torch.rand(data.shape, generator=gen) < noise
        data = torch.where(replaced, torch.randint(0, 128, data.shape, generator=gen), data)
    return data.to(device)


def train_on(model, optimizers, batches, before_step=None):
    """One optim.step (gradients clipped at 1.0) per batch but the last, before_step(step) first;
    returns the loss on the last batch, which training never saw, and the training losses."""
    losses = []
    for step in range(len(batches) - 1):
        if before_step is not None:
            before_step(step)
        loss = model(batches[step, :, :-1], batches[step, :, 1:])
        loss.backward()
        optim.step(optimizers, grad_clip=1.0)
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        final = model(batches[-1, :, :-1], batches[-1, :, 1:]).item()
    return final, losses
