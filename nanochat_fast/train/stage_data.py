"""
What each training stage reads. A stage's data object has grad_accum_steps(data_config,
world_size), checked before any work, and open(args, cfg, tokenizer, dev, model) -> Data: this
rank's training loader (batches forever; state_dict, epoch_progress, close) and its validation
batches, the same rows on any number of processes. PackedRows: prose (base) or conversations (mid);
PaddedConversations: chat_sft's mixture (docs/measurements.md#training-data-mixtures).
"""

import argparse
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..core.errors import UserError
from ..core.paths import tokenizer_dir, tokens_dir
from ..data.dataloader import ConversationMixture, ConversationRowLoader, PaddedConversationLoader, TokenRowLoader
from ..data.documents import CHAT, check_conversation
from ..data.token_shards import TokenShards, token_dtype
from ..evals import prepared_benchmarks, tasks
from .training_config import micro_steps

VAL_EVERY = 50  # of conversations brought alone, every 50th is held out (prepare_data's default too)
TASK_LIMITS = {"SpellingBee": 600}  # SFT: examples taken from a task's train split (None: all)
RETOKENIZE = "re-tokenize with `python -m nanochat_fast.scripts.prepare_data --stage=tokens`"


@dataclass
class Data:
    """A stage's data for this rank."""

    train: Iterator  # the training loader: this rank's (inputs, targets) forever, targets -1 not trained on
    val_batches: Callable[[], Iterator]  # a fresh pass over this rank's validation batches
    dataset: str  # what it is, for meta.json and the report
    describe: str  # one line for the run's summary

    def close(self):
        self.train.close()


def val_batches(make_loader, eval_tokens: int, device_batch_size: int, seq_len: int, rank: int, world_size: int):
    """This rank's share of up to eval_tokens of the val split: the batches one process would
    evaluate (packed from the start of the split, at most one pass), batch i to rank i mod
    world_size, so val bpb is the same on 1 or N processes. make_loader(split, rank, world_size)."""
    steps = max(1, eval_tokens // (device_batch_size * seq_len))
    with make_loader("val", rank=0, world_size=1) as val:  # every rank packs every batch, as in training
        for i in range(steps):
            if val.epochs_done:
                break
            batch = next(val)
            if i % world_size == rank:
                yield batch


def stage_val_batches(make_loader, cfg, dev):
    """val_batches with a stage's settings, on this process."""
    return val_batches(
        make_loader, cfg.loop.eval_tokens, cfg.data.device_batch_size, cfg.data.max_seq_len, dev.rank, dev.world_size
    )


class Conversations(list):
    """--extra-conversations' type: the conversations of a JSONL file ({"messages": [...]} per line),
    checked line by line; str() is the file's name."""

    def __init__(self, path: str):
        file = Path(path).expanduser()
        if not file.is_file():
            raise argparse.ArgumentTypeError(f"{path}: no such file")
        self.path = path
        for n, line in enumerate(file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                self.append(check_conversation(json.loads(line), f"{path} line {n}"))
            except UserError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
            except json.JSONDecodeError:
                raise argparse.ArgumentTypeError(
                    f"{path} line {n}: expected "
                    '{"messages": [{"role": "user"|"assistant"|"system", "content": "..."}, ...]}'
                ) from None
        if not self:
            raise argparse.ArgumentTypeError(f"{path} holds no conversations")

    def __str__(self):
        return self.path


def held_out(conversations: list) -> tuple[list, list]:
    """(train, val) of conversations brought alone: every VAL_EVERY-th, from the first, is val."""
    return [c for i, c in enumerate(conversations) if i % VAL_EVERY], conversations[::VAL_EVERY]


def too_few_conversations(extra) -> UserError:
    return UserError(
        f"--extra-conversations {extra} holds one conversation; training on it alone needs at least "
        f"2 (every {VAL_EVERY}th, from the first, is held out for validation)"
    )


class ConversationShards:
    """Rendered conversations in memory, which the loaders read as a one-shard token_shards.TokenShards."""

    kind = CHAT

    def __init__(self, conversations: list[dict], tokenizer, name: str):
        rendered = [tokenizer.render_conversation(c) for c in conversations]
        dtype = token_dtype(tokenizer.get_vocab_size())
        lengths = [len(ids) for ids, _ in rendered]
        self.tokens = [np.concatenate([np.asarray(ids, dtype) for ids, _ in rendered])]
        self.masks = [np.concatenate([np.asarray(mask, np.uint8) for _, mask in rendered])]
        self.offsets = [np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)]
        self.n_docs, self.n_tokens = len(rendered), int(sum(lengths))
        self.bos_id, self.fingerprint, self.directory = tokenizer.get_bos_token_id(), tokenizer.fingerprint, name

    def locate(self, index: int) -> tuple[int, int]:
        return 0, index


class PackedRows:
    """Rows packed best-fit from a tokenized dataset (base: prose; mid: conversations, with or, when
    none is prepared, instead of them the user's --extra-conversations), --total-batch-size a step."""

    varying_shapes = False  # every row is max_seq_len long: one compiled graph

    def __init__(self, loader_class, default_dataset: str):
        self.loader_class, self.default_dataset = loader_class, default_dataset

    def grad_accum_steps(self, data_config, world_size: int) -> int:
        return data_config.grad_accum_steps(world_size)

    def open(self, args, cfg, tokenizer, dev, model=None) -> Data:
        extra = getattr(args, "extra_conversations", None) or None
        dataset, options, alone = cfg.data.dataset or self.default_dataset, {}, None
        if self.loader_class is ConversationRowLoader:
            options = dict(tokenizer=tokenizer)
            if not cfg.data.dataset and not tokens_dir(dataset).is_dir():
                if extra is None:
                    raise UserError(
                        f"no conversation dataset is prepared ({tokens_dir(dataset)}): prepare one with "
                        "`python -m nanochat_fast.scripts.prepare_data --datasets=chat`, or train on your "
                        "own conversations with --extra-conversations=FILE.jsonl"
                    )
                if len(extra) < 2:
                    raise too_few_conversations(extra)
                alone = {
                    split: ConversationShards(convs, tokenizer, f"{extra} ({split})")
                    for split, convs in zip(("train", "val"), held_out(extra))
                }
                dataset = f"conversations:{Path(str(extra)).name}"

        def make_loader(split, rank, world_size, **more):
            if alone is not None:
                more["shards"] = alone[split]
            return self.loader_class(
                dataset=dataset,
                split=split,
                device_batch_size=cfg.data.device_batch_size,
                seq_len=cfg.data.max_seq_len,
                rank=rank,
                world_size=world_size,
                device=dev.device,
                **options,
                **more,
            )

        batches = functools.partial(stage_val_batches, make_loader, cfg, dev)
        if alone is not None:
            describe = (
                f"data: {alone['train'].n_docs:,} conversations of {extra} alone (no conversation dataset "
                f"prepared; {alone['val'].n_docs} held out for val bpb)"
            )
            return Data(make_loader("train", dev.rank, dev.world_size), batches, dataset, describe)
        train = make_loader("train", dev.rank, dev.world_size, **({"extra_conversations": extra} if extra else {}))
        if train.shards.fingerprint != tokenizer.fingerprint:  # prompts are encoded with this run's tokenizer
            raise UserError(
                f"the token shards in {train.shards.directory} were made with another tokenizer than the "
                f"one in {tokenizer_dir()}; {RETOKENIZE}"
            )
        note = f" + {len(extra):,} conversations of {extra}" if extra else ""
        return Data(train, batches, dataset, f"data: tokens/{dataset}{note} ({train.n_docs:,} documents per epoch)")


TOKEN_ROWS = PackedRows(TokenRowLoader, "base")
CONVERSATION_ROWS = PackedRows(ConversationRowLoader, "chat")


class PaddedConversations:
    """chat_sft's data: one conversation per row, padded, examples_per_step a step, from the mixture
    sources(args, cfg, tokenizer) returns: (train parts, val parts, dataset name, notes)."""

    varying_shapes = True  # rows as long as the batch's longest conversation

    def __init__(self, examples_per_step: int, sources):
        self.examples_per_step, self.sources = examples_per_step, sources

    def grad_accum_steps(self, data_config, world_size: int) -> int:
        rows = data_config.device_batch_size
        what = f"device_batch_size x world_size = {rows} x {world_size} = {rows * world_size}"
        return micro_steps("--target-examples-per-step", self.examples_per_step, rows * world_size, what)

    def open(self, args, cfg, tokenizer, dev, model=None) -> Data:
        train_parts, val_parts, dataset, notes = self.sources(args, cfg, tokenizer)
        data, pad = cfg.data, tokenizer.encode_special("<|assistant_end|>")
        mixtures = {
            "train": ConversationMixture(train_parts, seed=cfg.run.seed),
            "val": ConversationMixture(val_parts, shuffle=False),
        }

        def make_loader(split, rank, world_size):
            return PaddedConversationLoader(
                mixtures[split], data.device_batch_size, data.max_seq_len, pad, rank, world_size, dev.device
            )

        train = mixtures["train"]
        cut = int((train.lengths() > data.max_seq_len + 1).sum())
        if cut:
            notes = notes + [f"{cut:,} conversations longer than {data.max_seq_len + 1} tokens lose their end"]
        describe = (
            f"{train.n_docs:,} conversations, one per row ({train.describe()}); val "
            f"{mixtures['val'].describe()}" + "".join(f"; {n}" for n in notes)
        )
        batches = functools.partial(stage_val_batches, make_loader, cfg, dev)
        return Data(make_loader("train", dev.rank, dev.world_size), batches, dataset, describe)


def prepared_conversation_shards(dataset: str, split: str, tokenizer) -> TokenShards:
    shards = TokenShards(dataset, split)
    if shards.kind != CHAT:
        raise UserError(
            f"dataset {dataset!r} holds prose, not conversations: pass a conversation dataset (e.g. --dataset=chat)"
        )
    if shards.fingerprint != tokenizer.fingerprint:
        raise UserError(f"the token shards in {shards.directory} were made with another tokenizer; {RETOKENIZE}")
    return shards


def task_conversations() -> tuple[list[tuple[str, list]], list[str]]:
    """[(name, conversations)] of every chat task's prepared train splits; the tasks not prepared."""
    found, missing = [], []
    for task in tasks.CHAT_TASKS:
        if not task.train_splits:
            continue
        if prepared_benchmarks.read_task_manifest(task.folder) is None:
            missing.append(task.name)
            continue
        for split in task.train_splits:
            examples = task.load(split, max_examples=TASK_LIMITS.get(task.name))
            found.append((f"{task.name} {split}", [task.conversation(ex) for ex in examples]))
    return found, missing


def sft_sources(args, cfg, tokenizer):
    """(train parts, val parts, dataset name, notes) of the SFT mixture."""
    dataset = cfg.data.dataset or "chat"
    use_dataset = bool(cfg.data.dataset) or tokens_dir(dataset).is_dir()
    in_memory, notes = task_conversations()
    if notes:
        notes = [
            f"{', '.join(notes)} left out: no evaluation data (`python -m nanochat_fast.scripts.prepare_data "
            "--datasets=eval` adds them)"
        ]
    extra = args.extra_conversations
    if extra:
        in_memory.append((Path(str(extra)).name, list(extra)))
    if not use_dataset and not in_memory:
        raise UserError(
            f"nothing to fine-tune on: no conversation dataset ({tokens_dir(dataset)}) and no evaluation "
            "data; prepare them with `python -m nanochat_fast.scripts.prepare_data --datasets=chat,eval`, "
            "or bring your own conversations with --extra-conversations=FILE.jsonl"
        )
    if use_dataset:
        train = [(dataset, prepared_conversation_shards(dataset, "train", tokenizer))]
        val = [(dataset, prepared_conversation_shards(dataset, "val", tokenizer))]
        train += [(name, ConversationShards(convs, tokenizer, name)) for name, convs in in_memory]
        return train, val, dataset, notes
    train, val = [], []  # no conversation dataset: each source's held-out conversations are val
    for name, convs in in_memory:
        kept, val_convs = held_out(convs)
        if kept:
            train.append((name, ConversationShards(kept, tokenizer, name)))
        val.append((name, ConversationShards(val_convs, tokenizer, f"{name} (val)")))
    if not train:
        raise too_few_conversations(extra)
    notes.append(f"no conversation dataset prepared: every {VAL_EVERY}th conversation is held out for val bpb")
    return train, val, "conversations:" + "+".join(name.split()[0] for name, _ in in_memory), notes
