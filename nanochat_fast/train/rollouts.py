"""
chat_rl's data. Rollouts, a stage's data object, samples each step's questions from the model being
trained, through the batch engine, and yields one micro-batch (inputs, targets, advantages) per
question; the same samples on 1 and N processes. The objective (nanochat's "GRPO", close to
REINFORCE; training_loop.micro_batch_loss): -sum A * log p over the sampled tokens of the step,
divided by their count. The stream, seeds and objective in full: docs/measurements.md#rl-rollouts.
"""

import random
from dataclasses import dataclass

import torch

from ..core.distributed import all_reduce_sum
from ..core.errors import UserError
from ..data.dataloader import ConversationMixture, PaddedConversationLoader
from ..model.batch_engine import BatchEngine, Request, stop_tokens
from ..model.generation import decode_reply, fit_context
from .run_state import Horizon
from .stage_data import ConversationShards, Data, stage_val_batches
from .training_config import micro_steps


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(..., num_samples) rewards of each question's samples -> reward minus its question's mean."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


def rollout_batch(prompt: list[int], samples: list[tuple[list[int], list[bool]]], advantage, pad_id: int, device):
    """One question's samples as a micro-batch (inputs, targets, advantages): row i is prompt +
    sample i's tokens (ids, forced flags), right-padded; a target is -1 where the next token is the
    prompt's, forced by the calculator, or padding: only sampled tokens carry loss."""
    rows = [(prompt + ids, [False] * len(prompt) + [not f for f in forced]) for ids, forced in samples]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    sampled = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        sampled[i, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    targets = ids[:, 1:].masked_fill(~sampled[:, 1:], -1)
    return ids[:, :-1].to(device), targets.to(device), advantage.to(device=device, dtype=torch.float32)


@dataclass(frozen=True)
class Sampling:
    """How a question's samples are drawn (chat_rl's flags)."""

    num_samples: int
    max_new_tokens: int
    temperature: float
    top_k: int | None
    device_batch_size: int  # rows sampled together (at least one question's samples)


def split_examples(task, eval_examples: int) -> tuple[list, list, str]:
    """(train questions, held-out questions, note): the held-out ones are the first eval_examples of
    the task's evaluated split; a task without a train split trains on the rest of that split."""
    evaluated = task.load()
    held_out = evaluated[:eval_examples]
    if "train" in task.train_splits:
        return task.load("train"), held_out, ""
    train = evaluated[eval_examples:]
    if not train:
        raise UserError(
            f"--eval-examples {eval_examples} leaves no {task.name} question to train on (its "
            f"{task.eval_split} split holds {len(evaluated)}); lower it"
        )
    note = (
        f"{task.name} has no train split prepared: RL trains on its other {len(train):,} "
        f"{task.eval_split} questions, so chat_eval's {task.name} score of this run is not clean"
    )
    return train, held_out, note


class Rollouts:
    """chat_rl's data object: --examples-per-step questions per step, one micro-step per question."""

    varying_shapes = True  # rows as long as the question's longest sample

    def __init__(self, task, examples_per_step: int, sampling: Sampling, eval_examples: int, num_epochs: int = 1):
        self.task, self.examples_per_step, self.num_epochs = task, examples_per_step, num_epochs
        self.sampling, self.eval_examples = sampling, eval_examples

    def grad_accum_steps(self, data_config, world_size: int) -> int:
        what = f"the {world_size} processes (each samples the same number of questions)"
        return micro_steps("--examples-per-step", self.examples_per_step, world_size, what)

    def open(self, args, cfg, tokenizer, dev, model=None) -> Data:
        train, held_out, note = split_examples(self.task, self.eval_examples)
        loader = RolloutLoader(self, model, tokenizer, train, cfg.data.max_seq_len, cfg.run.seed, dev)
        pad = tokenizer.encode_special("<|assistant_end|>")
        name, conversations = self.task.name, [self.task.conversation(ex) for ex in held_out]
        if held_out:
            shards = ConversationShards(conversations, tokenizer, f"{name} held out")
            val = ConversationMixture([(name, shards)], shuffle=False)

        def make_loader(split, rank, world_size):
            return PaddedConversationLoader(
                val, cfg.data.device_batch_size, cfg.data.max_seq_len, pad, rank, world_size, dev.device
            )

        def batches():  # --eval-examples=0: nothing held out (val bpb n/a)
            return stage_val_batches(make_loader, cfg, dev) if held_out else iter(())

        s = self.sampling
        describe = (
            f"{len(train):,} {name} questions, {self.examples_per_step} per step x {s.num_samples} "
            f"samples (temperature {s.temperature:g}, top-k {s.top_k}, at most {s.max_new_tokens} new tokens); "
            f"{len(held_out):,} held out" + (f"; {note}" if note else "")
        )
        return Data(loader, batches, f"rl:{name}", describe)


def rl_horizon(cfg, model, data) -> Horizon:
    """--num-iterations steps, else --num-epochs passes over the train questions."""
    loader = data.train
    per_epoch = max(1, len(loader.examples) // loader.examples_per_step)
    steps = cfg.horizon.num_iterations if cfg.horizon.num_iterations > 0 else loader.num_epochs * per_epoch
    return Horizon(steps, f"{steps} steps ({per_epoch} per epoch of {len(loader.examples):,} questions)")


class RolloutLoader:
    """This rank's micro-batches of the stream of questions (its state: `position`)."""

    def __init__(self, rollouts: Rollouts, model, tokenizer, examples: list, seq_len: int, seed: int, dev):
        self.task, self.sampling, self.num_epochs = rollouts.task, rollouts.sampling, rollouts.num_epochs
        self.examples_per_step, self.examples = rollouts.examples_per_step, examples
        self.model, self.tokenizer, self.seq_len, self.seed, self.dev = model, tokenizer, seq_len, seed, dev
        self.device_batch_size = self.sampling.num_samples
        self.position = 0  # place in the stream of the next step's first question
        self._order = (None, None)  # (epoch, its order of the questions)
        self.pending = []  # this step's micro-batches not handed out yet
        self.stats = torch.zeros(5, dtype=torch.float64)  # rewards, right samples, samples, questions solved, tokens
        self.pad = tokenizer.encode_special("<|assistant_end|>")
        self.stop = stop_tokens(tokenizer)

    def question(self, place: int) -> dict:
        n, epoch = len(self.examples), place // len(self.examples)
        if self._order[0] != epoch:
            order = list(range(n))
            random.Random(self.seed + epoch).shuffle(order)
            self._order = (epoch, order)
        return self.examples[self._order[1][place % n]]

    def __iter__(self):
        return self

    def __next__(self):
        if not self.pending:
            self.pending = self.sample_step()
        return self.pending.pop(0)

    def sample_step(self) -> list:
        """This rank's questions of the next step, sampled group by group, as micro-batches."""
        per_rank = self.examples_per_step // self.dev.world_size
        first = self.position + self.dev.rank * per_rank
        self.position += self.examples_per_step
        self.stats.zero_()
        places = list(range(first, first + per_rank))
        group = max(1, self.sampling.device_batch_size // self.sampling.num_samples)  # questions sampled together
        batches = []
        for start in range(0, per_rank, group):
            batches += self.sample_group(places[start : start + group])
        return batches

    def sample_group(self, places: list[int]) -> list:
        s, bos, render = self.sampling, self.tokenizer.get_bos_token_id(), self.tokenizer.render_for_completion
        questions = [self.question(p) for p in places]
        prompts = [
            fit_context(render(self.task.conversation(q)), s.max_new_tokens, self.seq_len, bos) for q in questions
        ]
        seeds = [self.seed + p * s.num_samples for p in places]
        samples = sample_rows(self.model, self.tokenizer, prompts, s, seeds, self.dev)
        batches = []
        for question, (prompt, _), rows in zip(questions, prompts, samples):
            texts = [decode_reply(self.tokenizer, [t for t in ids if t not in self.stop]) for ids, _ in rows]
            rewards = torch.tensor([float(self.task.check(question, text)) for text in texts])
            right, tokens = rewards >= 1, sum(len(ids) for ids, _ in rows)
            stats = [rewards.sum(), right.sum(), len(rows), float(right.any()), tokens]
            self.stats += torch.tensor(stats, dtype=torch.float64)
            batches.append(rollout_batch(prompt, rows, advantages(rewards), self.pad, self.dev.device))
        return batches

    def step_metrics(self) -> dict:
        """The step's samples on all ranks: mean reward, pass@1 (the share of right samples), pass@n
        (questions with a right sample) and mean length in tokens."""
        rewards, right, samples, solved, tokens = all_reduce_sum(self.stats.to(self.dev.device)).tolist()
        n = self.sampling.num_samples
        return {
            "reward": rewards / samples,
            "pass@1": right / samples,
            f"pass@{n}": solved / (samples / n),
            "seq_len": tokens / samples,
        }

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict):
        self.position, self.pending = int(state["position"]), []

    def close(self):
        pass


def sample_rows(model, tokenizer, prompts: list[tuple[list[int], int]], s: Sampling, seeds: list[int], dev) -> list:
    """For each (prompt, max_tokens): num_samples samples as (token ids, forced flags), drawn
    together in one batch engine; question q's sample c uses the seed seeds[q] + c."""
    engine = BatchEngine(
        model, tokenizer, slots=len(prompts) * s.num_samples, max_len=max(len(p) + m for p, m in prompts)
    )
    rows = [
        engine.add(Request(p, m, s.temperature, s.top_k, seed), copies=s.num_samples)
        for (p, m), seed in zip(prompts, seeds)
    ]
    forced = {row: [] for group in rows for row in group}
    with dev.autocast():
        while engine.active:
            for token in engine.step():
                forced[token.row].append(token.forced)
    return [[(row.tokens, forced[row]) for row in group] for group in rows]
