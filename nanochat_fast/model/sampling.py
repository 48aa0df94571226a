"""
A row's next token: sampled from the model's logits (sample_next), or forced by the calculator tool
(ToolUse, with one RowState per row). Shared by the batch engine (batch_engine.py) and, through it,
every generation path (generation.py).

Tool use: when the assistant writes `<|python_start|>expr<|python_end|>`, expr goes to the
calculator (calculator.py) and `<|output_start|>result<|output_end|>` is forced into the sequence
(fed to the model like any token, marked as not sampled), then generation goes on.
"""

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .calculator import calculate


def stop_tokens(tokenizer) -> frozenset:
    """The tokens that end a reply: <|assistant_end|>, and <|bos|> (a new document begins)."""
    return frozenset({tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()})


@dataclass
class RowState:
    """One sequence's tool state: the expression being written and the tokens to force next."""

    forced: deque = field(default_factory=deque)
    expr: list | None = None  # token ids since <|python_start|>, None outside a call


class ToolUse:
    """The per-row state machine: watches each new token, and after <|python_end|> queues the
    calculator's answer as <|output_start|> result <|output_end|>. A refused expression gets no
    output (the model carries on without one)."""

    def __init__(self, tokenizer, calculator=calculate):
        special = tokenizer.encode_special
        self.tokenizer, self.calculator = tokenizer, calculator
        self.python_start, self.python_end = special("<|python_start|>"), special("<|python_end|>")
        self.output_start, self.output_end = special("<|output_start|>"), special("<|output_end|>")

    def observe(self, state: RowState, token: int):
        if token == self.python_start:
            state.expr = []
        elif token == self.python_end and state.expr is not None:
            result = self.calculator(self.tokenizer.decode(state.expr))
            if result is not None:
                state.forced.extend([self.output_start, *self.tokenizer.encode(result), self.output_end])
            state.expr = None
        elif state.expr is not None:
            state.expr.append(token)


# below this, temperature is greedy: logits / T overflows fp32 for T < 15 / 3.4e38 (logits are
# softcapped to +-15) and softmax turns inf into nan; the reasoning is at web/schema.MIN_TEMPERATURE
MIN_TEMPERATURE = 1e-6


def sample_next(logits, temperature: float, top_k: int | None, rng) -> torch.Tensor:
    """(B, V) logits -> (B, 1) token ids: greedy at temperature 0 (or below MIN_TEMPERATURE), else
    softmax sampling among the top_k most likely (all when None)."""
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], -float("inf"))
    if temperature >= MIN_TEMPERATURE:
        return torch.multinomial(F.softmax(logits / temperature, dim=-1), num_samples=1, generator=rng)
    return torch.argmax(logits, dim=-1, keepdim=True)
