"""
Text generation, all of it through the batch engine (batch_engine.py): a base model's continuation, the
assistant's next message (streamed piece by piece for chat_cli and chat_web's requests), batches of
samples for evaluation, and GPT.generate's tokens.
"""

from dataclasses import dataclass

import torch

from .batch_engine import BatchEngine, Request, stop_tokens

# How tool tokens read in text: a call and its output as GSM8K writes them, "<<12/60=0.2>>".
TOOL_TEXT = {"<|python_start|>": "<<", "<|python_end|>": "=", "<|output_start|>": "", "<|output_end|>": ">>"}


def complete(model, tokenizer, prompt: str, max_tokens: int) -> str:
    """The greedy continuation of `prompt` (after <|bos|>), up to a new document's <|bos|>."""
    ids = tokenizer.encode(prompt, prepend=tokenizer.get_bos_token_id())
    [sample] = generate_batch(model, tokenizer, ids, 1, max_tokens, temperature=0.0, use_tools=False)
    return tokenizer.decode(sample.ids)


def decode_reply(tokenizer, ids) -> str:
    """Text of generated ids, the tool tokens written as <<expr=result>>, other special tokens as their names."""
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
    """Token ids in, text pieces out, each released once it no longer ends in a partial UTF-8 character
    (BPE splits them); only the ids since the last piece are decoded at each push. `stop` tokens add no text."""

    def __init__(self, tokenizer, stop=frozenset()):
        self.tokenizer, self.stop, self.released, self.pending = tokenizer, stop, "", []

    def push(self, token_id: int) -> str:
        if token_id in self.stop:
            return ""
        self.pending.append(token_id)
        piece = decode_reply(self.tokenizer, self.pending)
        if piece.endswith("\ufffd"):
            return ""
        self.released, self.pending = self.released + piece, []
        return piece

    def text(self) -> str:
        return self.released + decode_reply(self.tokenizer, self.pending)


def fit_context(ids: list[int], max_tokens: int, sequence_len: int, bos_id: int):
    """(ids, max_tokens) within the context: the reply gets at most half; a long prompt keeps <|bos|> and its end."""
    max_tokens = min(max_tokens, sequence_len // 2)
    room = sequence_len - max_tokens
    if len(ids) > room:
        ids = [bos_id] + ids[-(room - 1) :]
    return ids, max_tokens


def reply_prompt(model, tokenizer, messages: list[dict], max_tokens: int):
    """(ids, max_tokens, truncated): the assistant's next message's prompt, fit to the model's context."""
    ids = tokenizer.render_for_completion({"messages": messages})
    fitted, max_tokens = fit_context(ids, max_tokens, model.config.sequence_len, tokenizer.get_bos_token_id())
    return fitted, max_tokens, len(fitted) < len(ids)


def reply_request(model, tokenizer, job):
    """(engine request, text decoder, truncated, stop tokens, prompt) of a chat server's job: the assistant's reply
    to job.messages exactly as assistant_reply makes it, or, when job.prompt holds token ids, a base model's
    continuation of them as they are (the server checked that they fit), without the calculator."""
    stop = stop_tokens(tokenizer)
    if job.prompt is not None:
        ids, max_tokens, truncated, use_tools = job.prompt, job.max_tokens, False, False
    else:
        ids, max_tokens, truncated = reply_prompt(model, tokenizer, job.messages, job.max_tokens)
        use_tools = True
    request = Request(ids, max_tokens, job.temperature, job.top_k, job.seed, use_tools, job.top_p)
    return request, TextStream(tokenizer, stop).push, truncated, stop, ids


@torch.inference_mode()
def generate_steps(model, tokenizer, request: Request, num_samples: int = 1, should_stop=None):
    """Yield, once per step, {row: (token, forced)} for the rows still going, each to its stop token (yielded)
    or max_tokens, until should_stop() (asked before each step). Row r samples with a generator seeded seed + r."""
    prompt, max_tokens = request.prompt, request.max_tokens
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a non-empty list of token ids")
    if num_samples < 1 or max_tokens < 0:
        raise ValueError(f"num_samples must be >= 1 and max_tokens >= 0, got {num_samples} and {max_tokens}")
    engine = BatchEngine(model, tokenizer, slots=num_samples, max_len=len(prompt) + max_tokens)
    engine.add(request, copies=num_samples)
    while engine.active:
        if should_stop is not None and should_stop():
            return
        yield {t.row.copy: (t.token, t.forced) for t in engine.step()}


@dataclass
class Sample:
    ids: list  # generated ids, without the prompt and without the final stop token
    forced: list  # per id: True where the tool wrote it
    text: str  # decode_reply(ids)
    finished: bool  # ended by <|assistant_end|>/<|bos|> rather than by max_tokens


def generate_batch(
    model, tokenizer, prompt, num_samples=1, max_tokens=256, temperature=0.0, top_k=None, seed=42, use_tools=True
) -> list[Sample]:
    """num_samples completions of `prompt` (e.g. render_for_completion of a conversation)."""
    ids, forced = [[] for _ in range(num_samples)], [[] for _ in range(num_samples)]
    finished, stop = [False] * num_samples, stop_tokens(tokenizer)
    request = Request(prompt, max_tokens, temperature, top_k, seed, use_tools)
    for column in generate_steps(model, tokenizer, request, num_samples):
        for r, (token, was_forced) in column.items():
            if token in stop:
                finished[r] = True
            else:
                ids[r].append(token)
                forced[r].append(was_forced)
    return [Sample(i, f, decode_reply(tokenizer, i), d) for i, f, d in zip(ids, forced, finished)]


def assistant_reply(
    model, tokenizer, messages, max_tokens, temperature=0.0, top_k=None, seed=42, on_text=None, should_stop=None
) -> str:
    """The assistant's next message after `messages`, the calculator available. on_text(piece) sees its text
    as it comes; should_stop(), asked before every new token, ends it early (a stop button, a client gone)."""
    ids, max_tokens, _ = reply_prompt(model, tokenizer, messages, max_tokens)
    stream = TextStream(tokenizer, stop_tokens(tokenizer))
    for column in generate_steps(model, tokenizer, Request(ids, max_tokens, temperature, top_k, seed), 1, should_stop):
        piece = stream.push(column[0][0])  # the stop token that ends the reply (and the steps) adds none
        if piece and on_text is not None:
            on_text(piece)
    return stream.text()
