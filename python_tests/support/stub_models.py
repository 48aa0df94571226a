"""Small stand-ins for the evaluation tests: a byte-level tokenizer (no training needed), a model
that follows a script, a model whose every position favours one token, and a fixture (import it
into a test module to use it) that runs tiny models on one thread."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nanochat_fast.data.tokenizer import Tokenizer

HIGH = 20.0


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads; on shared cores two threads only wait for each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def byte_tokenizer() -> Tokenizer:
    """Every byte is a token (ids 0-255), the special tokens follow."""
    return Tokenizer({bytes([i]): i for i in range(256)})


class StubModel(torch.nn.Module):
    """The interface generation and scoring use: config (n_layer, sequence_len, vocab_size),
    get_device(), forward(idx, targets=None, kv_cache=None, loss_reduction="mean"). The logits at
    absolute position p come from next_token(p); positions go into the KV cache like a real model's
    (a prompt's prefill starts at the cache's position; a batched decode step has one per row)."""

    def __init__(self, vocab_size: int, sequence_len: int = 4096):
        super().__init__()
        self.config = SimpleNamespace(n_layer=1, sequence_len=sequence_len, vocab_size=vocab_size)
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def get_device(self):
        return self.anchor.device

    def next_token(self, idx, p):
        raise NotImplementedError

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        B, T = idx.shape
        starts = [0] * B
        if kv_cache is not None:
            pos = kv_cache.get_pos()  # an int, or (B,) positions in a batched decode step
            starts = [pos] * B if isinstance(pos, int) else pos.tolist()
            if isinstance(pos, int):  # a prefill moves the cache's position by writing its keys
                dummy = torch.zeros(B, 1, T, 1)
                kv_cache.insert_kv(0, dummy, dummy)
        logits = torch.zeros(B, T, self.config.vocab_size)
        for t in range(T):
            for b in range(B):
                logits[b, t, self.next_token(idx[b], starts[b] + t)] = HIGH
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(-1), ignore_index=-1, reduction=loss_reduction)
        return loss.view(B, T) if loss_reduction == "none" else loss


class FavouriteTokenModel(StubModel):
    """Every position predicts the same token."""

    def __init__(self, vocab_size: int, favourite: int):
        super().__init__(vocab_size)
        self.favourite = favourite

    def next_token(self, idx, p):
        return self.favourite


class ScriptedModel(StubModel):
    """After the prompt's last <|assistant_start|> it says script[0], script[1], ... by position
    (whatever was fed at each position, so forced tool tokens do not derail it)."""

    def __init__(self, tokenizer: Tokenizer, script: list[int]):
        super().__init__(tokenizer.get_vocab_size())
        self.script = script
        self.assistant_start = tokenizer.encode_special("<|assistant_start|>")
        self.start = None

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        if kv_cache is None or (isinstance(kv_cache.get_pos(), int) and kv_cache.get_pos() == 0):
            # the prompt: find where the reply begins
            where = (idx[0] == self.assistant_start).nonzero()
            self.start = int(where[-1]) if len(where) else idx.size(1) - 1
        return super().forward(idx, targets, kv_cache, loss_reduction)

    def next_token(self, idx, p):
        k = p - self.start
        return self.script[min(max(k, 0), len(self.script) - 1)]
