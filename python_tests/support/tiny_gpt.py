"""Tiny GPTs for the model, kernel, generation and evaluation tests: random weights in every
parameter, and GPT.generate's tokens recomputed the slow way."""
import torch

from nanochat_fast.model.gpt import GPT, GPTConfig
from nanochat_fast.model.sampling import sample_next

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
    return ids[0, len(tokens):].tolist()
