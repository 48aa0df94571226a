"""
Scoring a model on the tasks: each function takes the model, the tokenizer, a task and examples,
and returns Counts (correct, total, a record per example) that ranks add up. Categorical tasks are
read from the answer letters' logits, generative ones from sampled replies (pass@k when several),
CORE tasks from each choice's few-shot mean loss. A prompt longer than the context keeps its end
(where the answer is) and is counted in Counts.truncated: an evaluation never fails on its input.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..model.generation import fit_context, generate_batch
from .tasks import CORE_TOTAL_TASKS, SCHEMA

Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


@dataclass
class Counts:
    correct: int = 0
    total: int = 0
    records: list = field(default_factory=list)  # one dict per example: id, prediction, correct, ...
    truncated: int = 0  # prompts longer than the context, cut to their end

    def add(self, correct: bool, **record):
        self.correct += int(correct)
        self.total += 1
        self.records.append(dict(record, correct=bool(correct)))

    def __add__(self, other: "Counts") -> "Counts":
        records = self.records + other.records
        return Counts(self.correct + other.correct, self.total + other.total, records, self.truncated + other.truncated)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")


def shard(n: int, rank: int, world_size: int) -> range:
    """The example indices of `rank`: every world_size-th, starting at rank."""
    return range(rank, n, world_size)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of n samples, c of them right (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson_interval(correct: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval: unlike the normal approximation, inside [0, 1] and sound at 0%, 100%, small n."""
    if total <= 0:
        return float("nan"), float("nan")
    p = correct / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def centered(accuracy: float, chance: float) -> float:
    """DCLM's centring: 0 at the random baseline, 1 at perfect (negative below chance)."""
    return (accuracy - chance) / (1.0 - chance)


def core_summary(accuracies: dict[str, float], chances: dict[str, float]) -> dict:
    """DCLM's CORE metric (the mean centred accuracy) over the tasks given, with its name, e.g.
    "CORE subset (10/22 tasks)": it is not CORE."""
    centred = {label: centered(acc, chances[label]) for label, acc in accuracies.items()}
    mean = sum(centred.values()) / len(centred) if centred else float("nan")
    name = f"CORE subset ({len(centred)}/{CORE_TOTAL_TASKS} tasks)"
    return {"name": name, "results": dict(accuracies), "centered": centred, "core_subset": mean}


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    """Rows padded on the right (the model is causal: a row's real positions never see the padding)."""
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def _letter_ids(tokenizer, letters: str) -> list[int]:
    ids = [tokenizer.encode(letter) for letter in letters]
    for letter, encoded in zip(letters, ids):
        if len(encoded) != 1:
            raise ValueError(f"answer letter {letter!r} is {len(encoded)} tokens; categorical scoring needs one")
    return [encoded[0] for encoded in ids]


@contextmanager
def logits_only_at(model, positions: torch.Tensor):
    """While active, the forward projects only row b's hidden state at positions[b] (logits (B, 1, V): that
    projection is most of a small model's work). Yields a list holding True once it ran (no lm_head: all)."""
    ran = []

    def select(module, args):
        ran.append(True)
        hidden = args[0]
        return (hidden[torch.arange(hidden.size(0), device=hidden.device), positions].unsqueeze(1),)

    head = getattr(model, "lm_head", None)
    handle = head.register_forward_pre_hook(select) if isinstance(head, torch.nn.Module) else None
    try:
        yield ran
    finally:
        if handle is not None:
            handle.remove()


@torch.no_grad()
def categorical_counts(model, tokenizer, task, examples: list[dict], batch_size: int = 8, on_batch=None) -> Counts:
    """The letter with the largest logit after each prompt (up to <|assistant_start|>); prompts go shortest
    first (little padding), records keep the order of `examples`; on_batch(n) follows each batch of n."""
    device, bos = model.get_device(), tokenizer.get_bos_token_id()
    whole = [tokenizer.render_for_completion(task.conversation(ex)) for ex in examples]
    # the whole context is the prompt's: nothing is generated after it (fit_context with no reply)
    prompts = [fit_context(ids, 0, model.config.sequence_len, bos)[0] for ids in whole]
    order = sorted(range(len(examples)), key=lambda i: len(prompts[i]))
    outcomes = [None] * len(examples)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        last = torch.tensor([len(prompts[i]) - 1 for i in batch], device=device)
        with logits_only_at(model, last) as projected_last:
            logits = model(_padded([prompts[i] for i in batch], bos, device))
        for row, i in enumerate(batch):
            ex, letters = examples[i], task.letters(examples[i])
            at = 0 if projected_last else int(last[row])
            letter_logits = logits[row, at, _letter_ids(tokenizer, letters)]
            predicted = letters[int(letter_logits.argmax())]
            rounded = [round(x, 4) for x in letter_logits.tolist()]
            record = dict(id=ex["id"], prediction=predicted, answer=letters[ex["answer"]], letter_logits=rounded)
            outcomes[i] = (task.check(ex, predicted), record)
        if on_batch is not None:
            on_batch(len(batch))
    counts = Counts(truncated=sum(len(p) < len(w) for p, w in zip(prompts, whole)))
    for correct, record in outcomes:
        counts.add(correct, **record)
    return counts


def generative_counts(
    model, tokenizer, task, examples: list[dict], num_samples=1, max_new_tokens=256, temperature=0.0, top_k=50, seed=42
) -> Counts:
    """num_samples replies to each question (the calculator available); solved when any passes task.check."""
    bos = tokenizer.get_bos_token_id()
    counts = Counts()
    for ex in examples:
        whole = tokenizer.render_for_completion(task.conversation(ex))
        prompt, budget = fit_context(whole, max_new_tokens, model.config.sequence_len, bos)
        counts.truncated += len(prompt) < len(whole)
        samples = generate_batch(model, tokenizer, prompt, num_samples, budget, temperature, top_k, seed)
        outcomes = [task.check(ex, s.text) for s in samples]
        counts.add(any(outcomes), id=ex["id"], prediction=samples[0].text, samples_right=sum(outcomes))
    return counts


def _scored_spans(task, tokens: list[list[int]]) -> list[tuple[int, int]]:
    """(start, end) of the tokens scored in each prompt, at least one: after the common prefix (multiple
    choice: choices differ at the end), or the common suffix (schema: contexts differ, the continuation is shared)."""
    suffix, n = task.task_type == SCHEMA, 0
    while n < min(map(len, tokens)) and len({t[-1 - n] if suffix else t[n] for t in tokens}) == 1:
        n += 1
    if suffix:
        return [(max(1, len(t) - n), len(t)) for t in tokens]
    return [(min(n, len(t) - 1), len(t)) for t in tokens]


@torch.no_grad()
def core_counts(
    model, tokenizer, task, items: list[dict], indices=None, batch_size=16, max_seq_len=None, on_batch=None
) -> Counts:
    """A CORE task: `items` are all of its items (the few-shot pool), `indices` those scored here
    (default: all). Prompts longer than max_seq_len (default: the model's) lose their beginning;
    several items share a forward pass, up to batch_size rows; on_batch(n) follows each, of n items."""
    device, bos = model.get_device(), tokenizer.get_bos_token_id()
    max_seq_len = max_seq_len or model.config.sequence_len
    indices = range(len(items)) if indices is None else indices
    counts = Counts()
    pending = []  # (index, rows, spans) waiting for a forward pass

    def flush():
        rows = [r for _, item_rows, _ in pending for r in item_rows]
        inputs = _padded(rows, bos, device)
        targets = torch.full_like(inputs, -1)  # position t predicts token t + 1; padding is ignored
        for i, row in enumerate(rows):
            targets[i, : len(row) - 1] = inputs[i, 1 : len(row)]
        # per-token losses from the model's own loss path (which need not hold all the logits)
        losses = model(inputs, targets=targets, loss_reduction="none").float()
        r = 0
        for index, item_rows, spans in pending:
            # the loss at position t - 1 is that of token t
            mean_losses = [losses[r + j, s - 1 : e - 1].mean().item() for j, (s, e) in enumerate(spans)]
            r += len(item_rows)
            predicted = min(range(len(mean_losses)), key=mean_losses.__getitem__)
            gold, rounded = items[index]["gold"], [round(x, 4) for x in mean_losses]
            counts.add(predicted == gold, id=index, prediction=predicted, answer=gold, losses=rounded)
        if on_batch is not None:
            on_batch(len(pending))
        pending.clear()

    for index in indices:
        item = items[index]
        rows = tokenizer.encode(task.prompts(item, task.fewshot(items, index)), prepend=bos)
        spans = _scored_spans(task, rows)
        counts.truncated += any(len(row) > max_seq_len for row in rows)
        for j, row in enumerate(rows):  # too long: keep the end, where the answer is
            cut = len(row) - max_seq_len
            if cut > 0:
                rows[j] = row[cut:]
                spans[j] = (max(1, spans[j][0] - cut), spans[j][1] - cut)
        if pending and sum(len(p[1]) for p in pending) + len(rows) > batch_size:
            flush()
        pending.append((index, rows, spans))
    if pending:
        flush()
    return counts
