"""
Text generation on top of the model's KV-cached forward: a plain continuation for base models,
the assistant's next message for chat models (streamed piece by piece for chat_cli and the web
chat), and batches of samples for evaluation.

Tool use: when the assistant writes `<|python_start|>expr<|python_end|>`, expr goes to the
calculator (calculator.py) and `<|output_start|>result<|output_end|>` is forced into the sequence
(fed to the model like any token, marked as not sampled), then generation goes on. In text, the
tool tokens read the way GSM8K writes its calculator notes: `<<expr=result>>`.

Batched samples (generate_batch): the prompt is run once, its KV cache copied into num_samples
rows, and every row decodes one token per step with its own tool state; a row leaves the batch
when it ends (<|assistant_end|> or <|bos|>).
"""
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .calculator import calculate
from .gpt import KVCache

# How tool tokens read in text: a call and its output look like GSM8K's "<<12/60=0.2>>".
TOOL_TEXT = {"<|python_start|>": "<<", "<|python_end|>": "=", "<|output_start|>": "", "<|output_end|>": ">>"}


@torch.no_grad()
def complete(model, tokenizer, prompt: str, max_tokens: int) -> str:
    """The greedy continuation of `prompt` (after <|bos|>), as text."""
    ids = tokenizer.encode(prompt, prepend=tokenizer.get_bos_token_id())
    return tokenizer.decode(list(model.generate(ids, max_tokens=max_tokens, temperature=0.0)))


def decode_reply(tokenizer, ids) -> str:
    """Text of generated ids with the tool tokens written as <<expr=result>> (other special tokens
    as their names)."""
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    parts, run = [], []
    for i in ids:
        if i in names:
            parts += [tokenizer.decode(run), TOOL_TEXT.get(names[i], names[i])]
            run = []
        else:
            run.append(i)
    return "".join(parts) + tokenizer.decode(run)


class TextStream:
    """Token ids in, text pieces out. A character can span several tokens (UTF-8 bytes split by
    BPE); a piece is released only once the text decoded so far no longer ends in a partial
    character, so a streamed reply never shows a replacement character that the final text lacks."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already released

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.text()
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece

    def text(self) -> str:
        return decode_reply(self.tokenizer, self.ids)


# ---------------------------------------------------------------------------------------------
# tool use


@dataclass
class RowState:
    """One sequence's tool state: the expression being written and the tokens to force next."""
    forced: deque = field(default_factory=deque)
    expr: list | None = None  # token ids since <|python_start|>, None outside a call
    done: bool = False


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


# ---------------------------------------------------------------------------------------------
# sampling


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


def fit_context(ids: list[int], max_tokens: int, sequence_len: int, bos_id: int):
    """(ids, max_tokens) within the context the model was trained on: the reply gets at most half
    of it; a longer prompt keeps <|bos|> and its end."""
    max_tokens = min(max_tokens, sequence_len // 2)
    room = sequence_len - max_tokens
    if len(ids) > room:
        ids = [bos_id] + ids[-(room - 1):]
    return ids, max_tokens


@torch.inference_mode()
def generate_steps(model, tokenizer, prompt: list[int], num_samples: int = 1, max_tokens: int = 256,
                   temperature: float = 0.0, top_k: int | None = None, seed: int = 42, use_tools: bool = True,
                   should_stop=None):
    """Yield, once per step, {row: (token, forced)} for the rows still going (forced: the token
    came from the tool, not from sampling). A row ends after <|assistant_end|> or <|bos|> (which it
    yields); all end after max_tokens steps, or when should_stop() (asked before each step) says so."""
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a non-empty list of token ids")
    if num_samples < 1 or max_tokens < 0:
        raise ValueError(f"num_samples must be >= 1 and max_tokens >= 0, got {num_samples} and {max_tokens}")
    device = model.get_device()
    rng = torch.Generator(device=device)
    rng.manual_seed(seed)
    stop = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
    tools = ToolUse(tokenizer) if use_tools else None
    cache = KVCache(model.config.n_layer, len(prompt) + max_tokens)
    logits = model.forward(torch.tensor([prompt], dtype=torch.long, device=device), kv_cache=cache)[:, -1, :]
    if num_samples > 1:  # the prompt was run once; every sample starts from its cache
        cache.select_rows(torch.zeros(num_samples, dtype=torch.long))
        logits = logits.expand(num_samples, -1)
    rows = list(range(num_samples))  # the rows in the batch, in batch order
    states = [RowState() for _ in rows]
    for step in range(max_tokens):
        if should_stop is not None and should_stop():
            return
        sampled = sample_next(logits, temperature, top_k, rng)[:, 0].tolist()
        column = {}
        for r, token in zip(rows, sampled):
            state = states[r]
            forced = bool(state.forced)
            if forced:
                token = state.forced.popleft()
            column[r] = (token, forced)
            if tools is not None:
                tools.observe(state, token)
            state.done = token in stop
        yield column
        going = [i for i, r in enumerate(rows) if not states[r].done]
        if not going or step == max_tokens - 1:
            return
        if len(going) < len(rows):
            cache.select_rows(torch.tensor(going, dtype=torch.long))
            rows = [rows[i] for i in going]
        ids = torch.tensor([[column[r][0]] for r in rows], dtype=torch.long, device=device)
        logits = model.forward(ids, kv_cache=cache)[:, -1, :]


@dataclass
class Sample:
    ids: list          # generated ids, without the prompt and without the final stop token
    forced: list       # per id: True where the tool wrote it
    text: str          # decode_reply(ids)
    finished: bool     # ended by <|assistant_end|>/<|bos|> rather than by max_tokens


def generate_batch(model, tokenizer, prompt: list[int], num_samples: int = 1, max_tokens: int = 256,
                   temperature: float = 0.0, top_k: int | None = None, seed: int = 42,
                   use_tools: bool = True) -> list[Sample]:
    """num_samples completions of `prompt` (e.g. render_for_completion of a conversation)."""
    ids = [[] for _ in range(num_samples)]
    forced = [[] for _ in range(num_samples)]
    finished = [False] * num_samples
    stop = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
    for column in generate_steps(model, tokenizer, prompt, num_samples, max_tokens, temperature, top_k, seed,
                                 use_tools):
        for r, (token, was_forced) in column.items():
            if token in stop:
                finished[r] = True
            else:
                ids[r].append(token)
                forced[r].append(was_forced)
    return [Sample(i, f, decode_reply(tokenizer, i), d) for i, f, d in zip(ids, forced, finished)]


def assistant_reply(model, tokenizer, messages: list[dict], max_tokens: int, temperature=0.0, top_k=None,
                    seed=42, on_text=None, should_stop=None) -> str:
    """The assistant's next message after `messages`, up to <|assistant_end|>, with the calculator
    tool available (its calls read <<expr=result>> in the text).

    on_text(piece) sees the reply's text as it comes (for streaming); should_stop() is asked before
    every new token and ends the reply early when it returns True (a stop button, a client gone).
    Prompt + reply stay within the context the model was trained on: the reply gets at most half
    of it, a long conversation keeps its end."""
    ids = tokenizer.render_for_completion({"messages": messages})
    ids, max_tokens = fit_context(ids, max_tokens, model.config.sequence_len, tokenizer.get_bos_token_id())
    stop = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
    stream = TextStream(tokenizer)
    for column in generate_steps(model, tokenizer, ids, 1, max_tokens, temperature, top_k, seed,
                                 should_stop=should_stop):
        token, _ = column[0]
        if token in stop:
            break
        piece = stream.push(token)
        if piece and on_text is not None:
            on_text(piece)
    return stream.text()
