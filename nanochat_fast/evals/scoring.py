"""
Scoring a model on the tasks (tasks/): every function takes the model, the tokenizer, a task and
its examples, and returns Counts (correct, total and one record per example), so a distributed
script gives each rank a shard (`shard`), all-reduces [correct, total] and gathers the records.

    categorical_counts  chat model, letter answers (ARC, MMLU): the answer letters' logits right
                        after <|assistant_start|>, the vocabulary projection at that position alone
    generative_counts   chat model, written answers (GSM8K, HumanEval, SpellingBee), checked by the
                        task; with num_samples > 1 solved when any sample is right (pass@k)
    core_counts         base model, a CORE task: the few-shot mean loss of each choice
    pass_at_k, wilson_interval, centered, core_summary   pass@k, a 95% interval, chance-centred scores

A prompt longer than the model's context never reaches the model whole: every path keeps its end
(where the answer is) and counts it in Counts.truncated, which the result line reports. So an
evaluation, also one inside a training run, never fails on its input.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..model.generation import fit_context, generate_batch
from .tasks.core_benchmark import CORE_TOTAL_TASKS

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
        return Counts(
            self.correct + other.correct,
            self.total + other.total,
            self.records + other.records,
            self.truncated + other.truncated,
        )

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")


def shard(n: int, rank: int, world_size: int) -> range:
    """The example indices of `rank`: every world_size-th, starting at rank."""
    return range(rank, n, world_size)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn (without replacement) from n samples, c of
    them right, is right: 1 - C(n-c, k) / C(n, k), the unbiased estimator of pass@k (Chen et al.
    2021); it does not depend on the order the samples came in."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson_interval(correct: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default): unlike the normal
    approximation p ± z·sqrt(p(1-p)/n) it stays inside [0, 1] and is sound at 0% or 100% and for
    small n."""
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
    """{"results": accuracy per task, "centered": centred per task, "core_subset": their mean,
    "name": what the mean is, e.g. "CORE subset (10/22 tasks)"}: DCLM's CORE metric (the mean of
    the centred accuracies), over the tasks given. Print the name with the number: it is not CORE."""
    centred = {label: centered(acc, chances[label]) for label, acc in accuracies.items()}
    mean = sum(centred.values()) / len(centred) if centred else float("nan")
    return {
        "name": f"CORE subset ({len(centred)}/{CORE_TOTAL_TASKS} tasks)",
        "results": dict(accuracies),
        "centered": centred,
        "core_subset": mean,
    }


def _device_of(model, device):
    return torch.device(device) if device is not None else model.get_device()


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    """Rows of different lengths padded on the right. The model is causal, so the logits at a
    row's real positions do not depend on the padding after them."""
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def _single_token_ids(tokenizer, letters: str) -> list[int]:
    ids = []
    for letter in letters:
        encoded = tokenizer.encode(letter)
        if len(encoded) != 1:
            raise ValueError(f"answer letter {letter!r} is {len(encoded)} tokens; categorical scoring needs one")
        ids.append(encoded[0])
    return ids


@contextmanager
def logits_only_at(model, positions: torch.Tensor):
    """While active, a GPT's forward projects onto the vocabulary only the hidden state at
    positions[b] of each row b (a pre-hook on lm_head): logits (B, 1, V) instead of (B, T, V). For
    a 4K-8K vocabulary and a small model that projection (and the softcap over its output) is most
    of the work of a forward pass. Yields a list that holds True once the hook has run, so a model
    without an lm_head module, or one that does not call it, gets its full logits (B, T, V)."""
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
def categorical_counts(
    model, tokenizer, task, examples: list[dict], batch_size: int = 8, device=None, on_batch=None
) -> Counts:
    """Each example's prompt (its conversation up to <|assistant_start|>) is run; among the answer
    letters, the one with the largest logit at the last position is the model's answer. Prompts go
    through in batches of similar length (shortest first: little padding); the records keep the
    order of `examples`. on_batch(n) is called after each batch of n examples (progress)."""
    device = _device_of(model, device)
    bos = tokenizer.get_bos_token_id()
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
            letter_logits = logits[row, at, _single_token_ids(tokenizer, letters)]
            predicted = letters[int(letter_logits.argmax())]
            outcomes[i] = (
                task.check(ex, predicted),
                dict(
                    id=ex["id"],
                    prediction=predicted,
                    answer=letters[ex["answer"]],
                    letter_logits=[round(x, 4) for x in letter_logits.tolist()],
                ),
            )
        if on_batch is not None:
            on_batch(len(batch))
    counts = Counts(truncated=sum(len(p) < len(w) for p, w in zip(prompts, whole)))
    for correct, record in outcomes:
        counts.add(correct, **record)
    return counts


def generative_counts(
    model,
    tokenizer,
    task,
    examples: list[dict],
    num_samples: int = 1,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = 50,
    seed: int = 42,
) -> Counts:
    """Each example's question is answered num_samples times (one prefill, a batch of samples,
    the calculator available); solved when any answer passes task.check."""
    bos = tokenizer.get_bos_token_id()
    counts = Counts()
    for ex in examples:
        whole = tokenizer.render_for_completion(task.conversation(ex))
        prompt, budget = fit_context(whole, max_tokens, model.config.sequence_len, bos)
        counts.truncated += len(prompt) < len(whole)
        samples = generate_batch(model, tokenizer, prompt, num_samples, budget, temperature, top_k, seed)
        outcomes = [task.check(ex, s.text) for s in samples]
        counts.add(any(outcomes), id=ex["id"], prediction=samples[0].text, samples_right=sum(outcomes))
    return counts


def _scored_spans(task, tokens: list[list[int]]) -> list[tuple[int, int]]:
    """(start, end) of the tokens scored in each prompt: after the prompts' common prefix
    (multiple choice: the choices differ at the end) or the common suffix (schema: the contexts
    differ and the continuation is shared). At least one token each."""
    if task.task_type == "schema":
        n = 0
        while n < min(map(len, tokens)) and len({t[-1 - n] for t in tokens}) == 1:
            n += 1
        return [(max(1, len(t) - n), len(t)) for t in tokens]
    n = 0
    while n < min(map(len, tokens)) and len({t[n] for t in tokens}) == 1:
        n += 1
    return [(min(n, len(t) - 1), len(t)) for t in tokens]


@torch.no_grad()
def core_counts(
    model,
    tokenizer,
    task,
    items: list[dict],
    indices=None,
    batch_size: int = 16,
    max_seq_len: int | None = None,
    device=None,
) -> Counts:
    """Accuracy on a CORE task (tasks.core_benchmark). `items` are all the task's items (few-shot examples are
    drawn from them); `indices` the ones scored here (default: all). Prompts longer than
    max_seq_len (default: the model's sequence_len) lose their beginning. Rows of several items
    share a forward pass, up to batch_size rows."""
    device = _device_of(model, device)
    max_seq_len = max_seq_len or model.config.sequence_len
    bos = tokenizer.get_bos_token_id()
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
            counts.add(
                predicted == items[index]["gold"],
                id=index,
                prediction=predicted,
                answer=items[index]["gold"],
                losses=[round(x, 4) for x in mean_losses],
            )
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
