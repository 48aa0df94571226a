"""
chat_rl's data: batches sampled from the model being trained (on-policy), not read from files.

Rollouts is a stage's data object (stage_data.py describes the two methods): its loader,
RolloutLoader, yields one micro-batch per question, rl_objective.rollout_batch of the question's
--num-samples samples with their advantages. Each optimizer step takes --examples-per-step
questions, all ranks together; rank r samples questions r*E/W ... (r+1)*E/W - 1 of the step.
Sampling goes through the batch engine (a question's samples share its prompt's prefill; the
calculator is on and its forced tokens are marked). A sample's seed depends only on its place in
the global stream of questions, so 1 and N processes draw the same samples and take the same step,
and the loader's state (the place of the next step's first question) resumes on any number of
processes. The seeds, groups and stream in full: docs/measurements.md#rl-rollouts.
"""

import random
from dataclasses import dataclass

import torch

from ..core.distributed import all_reduce_sum
from ..core.errors import UserError
from ..data.padded_conversations import ConversationMixture, PaddedConversationLoader
from ..model.batch_engine import BatchEngine, Request, stop_tokens
from ..model.generation import decode_reply, fit_context
from . import rl_objective
from .run_state import Horizon
from .stage_data import ConversationShards, Data, stage_val_batches


@dataclass(frozen=True)
class Sampling:
    """How a question's samples are drawn (chat_rl's flags)."""

    num_samples: int
    max_new_tokens: int
    temperature: float
    top_k: int | None
    device_batch_size: int  # rows sampled together (at least one question's samples)

    @property
    def questions_per_group(self) -> int:
        return max(1, self.device_batch_size // self.num_samples)


def split_examples(task, eval_examples: int) -> tuple[list, list, str]:
    """(train questions, held-out questions, note). The held-out ones are the first eval_examples of
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
    return (
        train,
        held_out,
        (
            f"{task.name} has no train split prepared: RL trains on its other {len(train):,} "
            f"{task.eval_split} questions, so chat_eval's {task.name} score of this run is not clean"
        ),
    )


class Rollouts:
    """The data object of chat_rl (module docstring)."""

    varying_shapes = True  # rows as long as the question's longest sample

    def __init__(self, task, examples_per_step: int, sampling: Sampling, eval_examples: int, num_epochs: int = 1):
        self.task, self.examples_per_step, self.num_epochs = task, examples_per_step, num_epochs
        self.sampling, self.eval_examples = sampling, eval_examples

    def grad_accum_steps(self, data_config, world_size: int) -> int:
        """One micro-step per question of this rank: examples_per_step / world_size."""
        if self.examples_per_step % world_size:
            below = self.examples_per_step // world_size * world_size
            options = " or ".join(str(v) for v in (below, below + world_size) if v > 0)
            raise UserError(
                f"--examples-per-step {self.examples_per_step} is not a multiple of the {world_size} "
                f"processes (each samples the same number of questions); nearest valid values: {options}"
            )
        return self.examples_per_step // world_size

    def open(self, args, cfg, tokenizer, dev, model=None) -> Data:
        train, held_out, note = split_examples(self.task, self.eval_examples)
        loader = RolloutLoader(
            model,
            tokenizer,
            self.task,
            train,
            self.examples_per_step,
            self.sampling,
            cfg.data.max_seq_len,
            cfg.run.seed,
            dev,
            self.num_epochs,
        )
        pad = tokenizer.encode_special("<|assistant_end|>")
        val = (
            ConversationMixture(
                [
                    (
                        self.task.name,
                        ConversationShards(
                            [self.task.conversation(ex) for ex in held_out], tokenizer, f"{self.task.name} held out"
                        ),
                    )
                ],
                shuffle=False,
            )
            if held_out
            else None
        )

        def batches():
            if val is None:  # --eval-examples=0: nothing held out (val bpb n/a)
                return iter(())

            def make_loader(split, rank, world_size):
                return PaddedConversationLoader(
                    val, cfg.data.device_batch_size, cfg.data.max_seq_len, pad, rank, world_size, dev.device
                )

            return stage_val_batches(make_loader, cfg, dev)

        s = self.sampling
        describe = (
            f"{len(train):,} {self.task.name} questions, {self.examples_per_step} per step x {s.num_samples} "
            f"samples (temperature {s.temperature:g}, top-k {s.top_k}, at most {s.max_new_tokens} new tokens); "
            f"{len(held_out):,} held out" + (f"; {note}" if note else "")
        )
        return Data(loader, batches, f"rl:{self.task.name}", describe)


def rl_horizon(cfg, model, data) -> Horizon:
    """--num-iterations steps, else --num-epochs passes over the train questions."""
    loader = data.train
    per_epoch = max(1, len(loader.examples) // loader.examples_per_step)
    steps = cfg.horizon.num_iterations if cfg.horizon.num_iterations > 0 else loader.num_epochs * per_epoch
    return Horizon(
        steps,
        lambda step: step / steps,
        lambda: False,
        f"{steps} steps ({per_epoch} per epoch of {len(loader.examples):,} questions)",
    )


class RolloutLoader:
    """This rank's micro-batches of the stream of questions (docs/measurements.md#rl-rollouts)."""

    def __init__(
        self,
        model,
        tokenizer,
        task,
        examples: list,
        examples_per_step: int,
        sampling: Sampling,
        seq_len: int,
        seed: int,
        dev,
        num_epochs: int = 1,
    ):
        self.model, self.tokenizer, self.task, self.examples = model, tokenizer, task, examples
        self.examples_per_step, self.sampling, self.seed, self.dev = examples_per_step, sampling, seed, dev
        self.device_batch_size, self.seq_len, self.num_epochs = sampling.num_samples, seq_len, num_epochs
        self.position = 0  # place in the stream of the next step's first question
        self._order = (None, None)  # (epoch, its order of the questions)
        self.pending = []  # this step's micro-batches not handed out yet
        self.stats = torch.zeros(5, dtype=torch.float64)  # rewards, right samples, samples, questions solved, tokens
        self.pad = tokenizer.encode_special("<|assistant_end|>")
        self.stop = stop_tokens(tokenizer)

    @property
    def n_docs(self) -> int:
        return len(self.examples)

    @property
    def epochs_done(self) -> int:
        return self.position // len(self.examples)

    @property
    def epoch_progress(self) -> float:
        return self.position / len(self.examples)

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
        """Sample this rank's questions of the next step, group by group; their micro-batches."""
        per_rank = self.examples_per_step // self.dev.world_size
        first = self.position + self.dev.rank * per_rank
        self.position += self.examples_per_step
        self.stats.zero_()
        places = list(range(first, first + per_rank))
        group = self.sampling.questions_per_group
        batches = []
        for start in range(0, per_rank, group):
            batches += self.sample_group(places[start : start + group])
        return batches

    def sample_group(self, places: list[int]) -> list:
        s, bos = self.sampling, self.tokenizer.get_bos_token_id()
        questions = [self.question(p) for p in places]
        prompts = [
            fit_context(
                self.tokenizer.render_for_completion(self.task.conversation(q)), s.max_new_tokens, self.seq_len, bos
            )
            for q in questions
        ]
        samples = sample_rows(
            self.model, self.tokenizer, prompts, s, [self.seed + p * s.num_samples for p in places], self.dev
        )
        batches = []
        for question, (prompt, _), rows in zip(questions, prompts, samples):
            texts = [decode_reply(self.tokenizer, [t for t in ids if t not in self.stop]) for ids, _ in rows]
            rewards = torch.tensor([float(self.task.check(question, text)) for text in texts])
            self.stats += torch.tensor(
                [
                    rewards.sum(),
                    (rewards >= 1).sum(),
                    len(rows),
                    float((rewards >= 1).any()),
                    sum(len(ids) for ids, _ in rows),
                ],
                dtype=torch.float64,
            )
            batches.append(
                rl_objective.rollout_batch(prompt, rows, rl_objective.advantages(rewards), self.pad, self.dev.device)
            )
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
