"""
Continuous batching: many conversations decoded together, each at its own length. A request joins
between steps (add); at the next step its prompt runs into a free slot of the SlotCache (decode.py) and
its first token is sampled; then it is one row of every decode step, until it ends (a stop token,
max_tokens, cancel) and its slot is free at once. Each row samples with its own settings, generator and
calculator state, so what it gets does not depend on the batch (docs/measurements.md#continuous-batching).
"""

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..hardware.precision import autocast
from .calculator import calculate
from .decode import SlotBatch, SlotCache, SlotPrefill, usable

# The prompts a step admits run in its decode forward, a row per token, up to this many tokens in all;
# more run in a forward of their own, faster from about there (docs/measurements.md#continuous-batching).
PROMPT_AS_ROWS = 256
# the most likely tokens score() lists at each position, at most (OpenAI's chat API allows 20)
MAX_TOP_LOGPROBS = 20
# below this, temperature is greedy (softcapped logits / T overflow fp32): the reasoning is at web/app.py
MIN_TEMPERATURE = 1e-6


@dataclass
class Request:
    prompt: list[int]  # token ids, already within the context (generation.fit_context)
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 42  # copy c samples with a generator seeded seed + c
    use_tools: bool = True
    top_p: float | None = None  # nucleus sampling: the most likely tokens holding this much probability


class EngineFull(Exception):
    """Fewer free slots than the copies asked for."""


@dataclass(eq=False)
class DecodeRow:
    """One sequence of a request (one per copy): the caller's handle, filled in by the engine."""

    request: Request
    slot: int | None  # its cache slot (kept after it ends; None when max_tokens was 0)
    copy: int = 0  # 0..copies-1
    tokens: list[int] = field(default_factory=list)  # generated ids, forced tool tokens included
    done: bool = False
    reason: str | None = None  # once done: "stop" | "max_tokens" | "cancelled"
    length: int = field(default=0, repr=False)  # positions of the slot in use (0 until prefilled)
    forced: deque = field(default_factory=deque, repr=False)  # the tool's tokens to write next
    expr: list | None = field(default=None, repr=False)  # token ids since <|python_start|>, None outside a call
    rng: torch.Generator | None = field(default=None, repr=False)  # None at temperature 0


@dataclass
class Token:
    row: DecodeRow
    token: int
    forced: bool  # written by the calculator tool, not sampled
    last: bool  # the row ended with this token (its slot is free again)


def stop_tokens(tokenizer) -> frozenset:
    """The tokens that end a reply: <|assistant_end|>, and <|bos|> (a new document begins)."""
    return frozenset({tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()})


def sample_next(logits, temperature: float, top_k: int | None, rng, top_p: float | None = None) -> torch.Tensor:
    """(B, V) logits -> (B, 1) ids: greedy below MIN_TEMPERATURE, else sampled among the top_k (None: all),
    then among the fewest most likely tokens whose probability (at this temperature) reaches top_p."""
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], -float("inf"))
    if temperature < MIN_TEMPERATURE:
        return torch.argmax(logits, dim=-1, keepdim=True)
    probs = F.softmax(logits / temperature, dim=-1)
    if top_p is not None and top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        # a token stays while the ones above it hold less than top_p: the most likely one always does
        ordered = ordered.masked_fill(ordered.cumsum(dim=-1) - ordered >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
    return torch.multinomial(probs, num_samples=1, generator=rng)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_ints(**values):
    for name, value in values.items():
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class RequestLimits:
    """What an engine accepts, apart from it: a server checks requests before its engine's process does."""

    vocab_size: int
    max_len: int
    slots: int
    tools: bool  # the engine has a tokenizer, so requests may use the calculator tool

    def check(self, request: Request, copies: int = 1):
        prompt, vocab = request.prompt, self.vocab_size
        if not isinstance(prompt, list) or not prompt or not all(_is_int(t) for t in prompt):
            raise ValueError("prompt must be a non-empty list of token ids")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
        if not _is_int(request.max_tokens) or request.max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {request.max_tokens!r}")
        if len(prompt) + request.max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_tokens ({request.max_tokens}) exceeds the "
                f"engine's max_len ({self.max_len})"
            )
        t = request.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if request.top_k is not None and (not _is_int(request.top_k) or request.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {request.top_k!r}")
        p = request.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must be None or a number in (0, 1], got {p!r}")
        if not _is_int(request.seed):
            raise ValueError(f"seed must be an int, got {request.seed!r}")
        if request.use_tools and not self.tools:
            raise ValueError("use_tools needs the tokenizer's tool tokens; this engine has no tokenizer")
        if not _is_int(copies) or not 1 <= copies <= self.slots:
            raise ValueError(f"copies must be an int in [1, {self.slots}] (the engine's slots), got {copies!r}")

    def check_scoring(self, ids: list[int], top: int):
        self.check(Request(ids, 0, use_tools=False))
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top must be an int in [0, {MAX_TOP_LOGPROBS}], got {top!r}")


class BatchEngine:
    """Up to `slots` rows decoding together, each up to `max_len` positions (prompt + tokens). One thread
    drives it: add() and cancel() between steps, step() to advance every row by one token, under autocast
    to `dtype` unless fp32 (then the caller's). Without a tokenizer no token ends a row, no tool runs."""

    def __init__(self, model, tokenizer, slots: int, max_len: int | None = None, dtype=torch.float32):
        max_len = model.config.sequence_len if max_len is None else max_len
        check_positive_ints(slots=slots, max_len=max_len)
        rotary_len = getattr(model, "rotary_seq_len", None)
        if rotary_len is not None and max_len > rotary_len:
            raise ValueError(f"max_len ({max_len}) exceeds the model's {rotary_len} positions")
        self.model, self.tokenizer = model, tokenizer
        self.slots, self.max_len = slots, max_len
        self.device = model.get_device()
        self.autocast = autocast(self.device, dtype)  # the generation dtype's context, entered every step
        self.cache = SlotCache(model.config.n_layer, slots, max_len)
        self.stop = stop_tokens(tokenizer) if tokenizer is not None else frozenset()
        names = ("python_start", "python_end", "output_start", "output_end")
        self.tool_tokens = None if tokenizer is None else [tokenizer.encode_special(f"<|{n}|>") for n in names]
        self.limits = RequestLimits(model.config.vocab_size, max_len, slots, tools=tokenizer is not None)
        self._free = list(range(slots))  # a heap: the lowest free slot first keeps the rows packed
        self._rows: list[DecodeRow] = []  # rows holding a slot, in the order they joined
        self._waiting: list[list[DecodeRow]] = []  # the copies of each request added since the last step

    @staticmethod
    def kv_bytes(config, slots: int, max_len: int, dtype=torch.float32) -> int:
        return config.n_layer * 2 * slots * config.n_kv_head * max_len * config.head_dim * dtype.itemsize

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def active(self) -> list[DecodeRow]:
        return list(self._rows)

    def add(self, request: Request, copies: int = 1) -> list[DecodeRow]:
        """`copies` rows continuing request.prompt, run once at the next step; max_tokens 0: rows done."""
        self.limits.check(request, copies)
        if request.max_tokens == 0:
            return [DecodeRow(request, None, c, done=True, reason="max_tokens") for c in range(copies)]
        if copies > len(self._free):
            raise EngineFull(f"{copies} slots asked for, {len(self._free)} of {self.slots} free")
        rows = [DecodeRow(request, heapq.heappop(self._free), c) for c in range(copies)]
        if request.temperature > 0:
            for row in rows:
                row.rng = torch.Generator(device=self.device).manual_seed(request.seed + row.copy)
        self._rows += rows
        self._waiting.append(list(rows))
        return rows

    def cancel(self, row: DecodeRow):
        """End `row` now (reason "cancelled"), its slot free at once; a row already done is left as it is."""
        if row.done:
            return
        if row not in self._rows:
            raise ValueError("cancel: the row is not one of this engine's")
        for group in self._waiting:
            if row in group:
                group.remove(row)
        self._waiting = [group for group in self._waiting if group]
        self._end(row, "cancelled")

    def score(self, ids: list[int], top: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """How likely the model finds ids: for each of ids[1:], its log-probability given the ones before, and
        the `top` most likely tokens there with theirs. One forward as a prefill's (the engine's dtype, its
        slots untouched), the log-softmax in fp32. Called between steps, by the thread that drives the engine."""
        self.limits.check_scoring(ids, top)
        with torch.inference_mode(), self.autocast:
            logits = self.model(torch.tensor([ids], dtype=torch.long, device=self.device))[0, :-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(ids[1:], device=self.device).unsqueeze(1))[:, 0]
        best, best_ids = logprobs.topk(top, dim=-1)
        return chosen.tolist(), best_ids.tolist(), best.tolist()

    def _end(self, row: DecodeRow, reason: str):
        row.done, row.reason = True, reason
        self._rows.remove(row)
        heapq.heappush(self._free, row.slot)

    def step(self) -> list[Token]:
        """One token for every active row, in join order: new requests' prompts run and sample their first
        token, the others feed their last, in one forward (the prompts in one of their own when too many)."""
        with torch.inference_mode(), self.autocast:
            decoding = sorted((r for r in self._rows if r.length > 0), key=lambda r: r.slot)
            waiting, self._waiting = self._waiting, []
            if waiting and self._prompts_as_rows(waiting, len(decoding)):
                parts = self._decode(decoding, waiting)
            else:
                parts = self._decode(decoding) if decoding else []
                if waiting:
                    parts += zip(waiting, self._prefill(waiting))
            if not parts:
                return []
            rows = [row for group, _ in parts for row in group]
            logits = parts[0][1] if len(parts) == 1 else torch.cat([logits for _, logits in parts])
            tokens = self._sample(rows, logits)
            joined = {row: i for i, row in enumerate(self._rows)}
            out = sorted(zip(rows, tokens), key=lambda pair: joined[pair[0]])
            return [self._advance(row, token) for row, token in out]

    def _prompts_as_rows(self, groups: list[list[DecodeRow]], decoding: int) -> bool:
        """Few tokens in all, a model that takes them, a step through the packed CPU kernels (decode.usable)."""
        few = sum(len(group[0].request.prompt) for group in groups) <= PROMPT_AS_ROWS
        takes_them = getattr(self.model, "prompts_as_decode_rows", False)
        return few and takes_them and usable(self.model, decoding + len(groups))

    def _prefill(self, groups: list[list[DecodeRow]]) -> list[torch.Tensor]:
        """The prompts into their first copies' slots in one right-padded forward; per request, its logits."""
        prompts = [group[0].request.prompt for group in groups]
        width = max(map(len, prompts))
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], dtype=torch.long, device=self.device)
        lengths = [len(p) for p in prompts] if len(groups) > 1 else None
        view = SlotPrefill(self.cache, [group[0].slot for group in groups], lengths, last_logits=True)
        logits = self.model(ids, kv_cache=view)[:, -1]
        for group in groups:
            self._prefilled(group)
        return [logits[i : i + 1].expand(len(group), -1) for i, group in enumerate(groups)]

    def _decode(self, rows: list[DecodeRow], groups: list[list[DecodeRow]] = ()) -> list[tuple]:
        """Every row's last token (rows in slot order) and each group's prompt, a row per token from position
        0 in its first copy's slot, in one forward: (rows, their logits) and per group (group, its logits)."""
        entries, wanted = [(row.slot, row.length, row.tokens[-1]) for row in rows], None
        if groups:
            for group in groups:
                entries += [(group[0].slot, position, t) for position, t in enumerate(group[0].request.prompt)]
            entries.sort()
            index = {(slot, position): i for i, (slot, position, _) in enumerate(entries)}
            wanted = [index[row.slot, row.length] for row in rows]
            wanted += [index[group[0].slot, len(group[0].request.prompt) - 1] for group in groups]
            if self.cache.kv is None:  # a block's first keys are written inside its op: make the storage
                config, dtype = self.model.config, next(self.model.parameters()).dtype
                self.cache.allocate(config.n_kv_head, config.head_dim, dtype, self.device)
        slots, positions, ids = zip(*entries)
        batch = SlotBatch(self.cache, list(slots), list(positions), self.device, logits_of=wanted)
        ids = torch.tensor([[t] for t in ids], dtype=torch.long, device=self.device)
        logits = self.model(ids, kv_cache=batch)[:, -1, :]
        for row in rows:
            row.length += 1
        parts = [(rows, logits[: len(rows)] if groups else logits)] if rows else []
        for i, group in enumerate(groups, start=len(rows)):
            self._prefilled(group)
            parts.append((group, logits[i : i + 1].expand(len(group), -1)))
        return parts

    def _prefilled(self, group: list[DecodeRow]):
        """The request's prompt is in its first copy's slot: copy it into the others' slots."""
        prompt = group[0].request.prompt
        for row in group[1:]:
            self.cache.copy_slot(group[0].slot, row.slot, len(prompt))
        for row in group:
            row.length = len(prompt)

    def _sample(self, rows: list[DecodeRow], logits: torch.Tensor) -> list[int]:
        """Each row's token: greedy rows in one argmax, the others with their own settings and generator
        (even where the tool will force the token: a generator moves the same way in any batch)."""
        chosen = torch.argmax(logits, dim=-1)
        for i, row in enumerate(rows):
            r = row.request
            if r.temperature > 0:
                chosen[i] = sample_next(logits[i : i + 1], r.temperature, r.top_k, row.rng, r.top_p)[0, 0]
        return chosen.tolist()

    def _advance(self, row: DecodeRow, token: int) -> Token:
        """The row's next token (the tool's, when queued), its tool state, whether it ended."""
        forced = bool(row.forced)
        if forced:
            token = row.forced.popleft()
        row.tokens.append(token)
        if row.request.use_tools:
            self._use_tool(row, token)
        reason = "stop" if token in self.stop else "max_tokens" if len(row.tokens) >= row.request.max_tokens else None
        if reason is not None:
            self._end(row, reason)
        return Token(row, token, forced, last=reason is not None)

    def _use_tool(self, row: DecodeRow, token: int):
        """The calculator: `<|python_start|>expr<|python_end|>` queues `<|output_start|>result<|output_end|>`."""
        python_start, python_end, output_start, output_end = self.tool_tokens
        if token == python_start:
            row.expr = []
        elif token == python_end and row.expr is not None:
            result = calculate(self.tokenizer.decode(row.expr))
            if result is not None:
                row.forced.extend([output_start, *self.tokenizer.encode(result), output_end])
            row.expr = None
        elif row.expr is not None:
            row.expr.append(token)
