"""
What each training stage reads: its training loader and its validation batches.

A stage's data is an object with two methods (stage.py calls them): grad_accum_steps(data_config,
world_size), the micro-steps per optimizer step, checked before any work (UserError if the batch
does not divide), and open(args, cfg, tokenizer, dev, model) -> Data, this rank's training loader
and a factory of its validation batches (model: the one being trained, which chat_rl's rollouts
sample from). A loader yields this rank's (inputs, targets) forever (targets -1 are not trained on)
and has state_dict()/load_state_dict() (the global cursor), epoch_progress and close().

    PackedRows(ConversationRowLoader)  packed rows of conversations, assistant tokens supervised (mid)
    PackedRows(TokenRowLoader)         packed rows of prose, every token supervised (base)
    PaddedConversations(sft_sources)   one conversation per row, padded (chat_sft)

Validation reads the same rows on any number of processes (val_batches). What mid_train's own
conversations and chat_sft's mixture add: docs/measurements.md#training-data-mixtures.
"""

import argparse
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..core.errors import UserError
from ..core.paths import tokens_dir
from ..data.dataloader import ConversationRowLoader, TokenRowLoader
from ..data.documents import CHAT, check_conversation
from ..data.padded_conversations import ConversationMixture, PaddedConversationLoader
from ..data.token_shards import TokenShards, token_dtype
from ..evals import prepared_benchmarks, tasks
from .training_config import micro_steps

VAL_EVERY = 50  # of conversations brought alone, every 50th is held out (prepare_data's default too)
TASK_LIMITS = {"SpellingBee": 600}  # SFT: examples taken from a task's train split (None: all)


@dataclass
class Data:
    """A stage's data for this rank."""

    train: Iterator  # the training loader (see the module docstring)
    val_batches: Callable[[], Iterator]  # a fresh pass over this rank's validation batches
    dataset: str  # what it is, for meta.json and the report
    describe: str  # one line for the run's summary

    def close(self):
        self.train.close()


def val_batches(make_loader, eval_tokens: int, device_batch_size: int, seq_len: int, rank: int, world_size: int):
    """This rank's share of up to eval_tokens of the val split: the batches a single process would
    evaluate (device_batch_size rows each, packed from the start of the split, at most one pass),
    batch i going to rank i mod world_size. So every process count sees the same rows, and val bpb
    (all ranks' sums added) is the same on 1 or N processes. make_loader(split, rank, world_size)
    opens a loader."""
    steps = max(1, eval_tokens // (device_batch_size * seq_len))
    with make_loader("val", rank=0, world_size=1) as val:  # every rank packs every batch, as in training
        for i in range(steps):
            if val.epochs_done:
                break
            batch = next(val)
            if i % world_size == rank:
                yield batch


def stage_val_batches(make_loader, cfg, dev):
    """val_batches with a stage's settings (its eval tokens, batch and context) on this process."""
    return val_batches(
        make_loader, cfg.loop.eval_tokens, cfg.data.device_batch_size, cfg.data.max_seq_len, dev.rank, dev.world_size
    )


class Conversations(list):
    """The conversations of a JSONL file ({"messages": [...]} per line), checked line by line;
    str() is the file's name. Used as the argparse type of --extra-conversations."""

    def __init__(self, path: str):
        file = Path(path).expanduser()
        if not file.is_file():
            raise argparse.ArgumentTypeError(f"{path}: no such file")
        super().__init__()
        self.path = path
        for n, line in enumerate(file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                conv = check_conversation(json.loads(line), f"{path} line {n}")
            except UserError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
            except json.JSONDecodeError:
                raise argparse.ArgumentTypeError(
                    f"{path} line {n}: expected "
                    '{"messages": [{"role": "user"|"assistant"|"system", "content": "..."}, ...]}'
                ) from None
            self.append(conv)
        if not self:
            raise argparse.ArgumentTypeError(f"{path} holds no conversations")

    def __str__(self):
        return self.path


class ConversationShards:
    """Rendered conversations held in memory, shaped like data/token_shards.TokenShards (one shard), so the
    loaders read them as they read a prepared conversation dataset."""

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
    """Rows packed best-fit from a tokenized dataset (base: prose; mid: conversations, plus the
    user's own with --extra-conversations); the batch is --total-batch-size tokens per step."""

    varying_shapes = False  # every row is max_seq_len long: one compiled graph

    def __init__(self, loader_class, default_dataset: str):
        self.loader_class, self.default_dataset = loader_class, default_dataset

    def grad_accum_steps(self, data_config, world_size: int) -> int:
        return data_config.grad_accum_steps(world_size)

    def open(self, args, cfg, tokenizer, dev, model=None) -> Data:
        data = cfg.data
        extra = getattr(args, "extra_conversations", None) or None
        dataset, options, note = data.dataset or self.default_dataset, {}, ""
        if self.loader_class is ConversationRowLoader:
            options = dict(tokenizer=tokenizer)
            if not data.dataset and not tokens_dir(dataset).is_dir():
                if extra is None:
                    raise UserError(
                        f"no conversation dataset is prepared ({tokens_dir(dataset)}): prepare one with "
                        "`python -m nanochat_fast.scripts.prepare_data --datasets=chat`, or train on your "
                        "own conversations with --extra-conversations=FILE.jsonl"
                    )
                return self._conversations_alone(extra, cfg, tokenizer, dev)
            note = f" + {len(extra):,} conversations of {extra}" if extra else ""

        def make_loader(split, rank, world_size, **more):
            return self.loader_class(
                dataset=dataset,
                split=split,
                device_batch_size=data.device_batch_size,
                seq_len=data.max_seq_len,
                rank=rank,
                world_size=world_size,
                device=dev.device,
                **options,
                **more,
            )

        train = make_loader("train", dev.rank, dev.world_size, **({"extra_conversations": extra} if extra else {}))
        check_shards(train, tokenizer)
        return Data(
            train,
            self._val(make_loader, cfg, dev),
            dataset,
            f"data: tokens/{dataset}{note} ({train.n_docs:,} documents per epoch)",
        )

    def _conversations_alone(self, extra, cfg, tokenizer, dev) -> Data:
        """No conversation dataset is prepared: train on the user's conversations alone."""
        if len(extra) < 2:
            raise UserError(
                f"--extra-conversations {extra} holds one conversation; training on it alone needs at "
                f"least 2 (every {VAL_EVERY}th, from the first, is held out for validation)"
            )
        held_out = {"val": extra[::VAL_EVERY], "train": [c for i, c in enumerate(extra) if i % VAL_EVERY]}
        shards = {
            split: ConversationShards(convs, tokenizer, f"{extra} ({split})") for split, convs in held_out.items()
        }
        data, name = cfg.data, f"conversations:{Path(str(extra)).name}"

        def make_loader(split, rank, world_size):
            return ConversationRowLoader(
                dataset=name,
                split=split,
                device_batch_size=data.device_batch_size,
                seq_len=data.max_seq_len,
                rank=rank,
                world_size=world_size,
                device=dev.device,
                tokenizer=tokenizer,
                shards=shards[split],
            )

        return Data(
            make_loader("train", dev.rank, dev.world_size),
            self._val(make_loader, cfg, dev),
            name,
            f"data: {len(held_out['train']):,} conversations of {extra} alone (no conversation dataset "
            f"prepared; {len(held_out['val'])} held out for val bpb)",
        )

    @staticmethod
    def _val(make_loader, cfg, dev):
        return functools.partial(stage_val_batches, make_loader, cfg, dev)


def check_shards(loader, tokenizer):
    """The token shards must have been made with the tokenizer this run encodes prompts with."""
    from ..core.paths import tokenizer_dir

    if loader.shards.fingerprint != tokenizer.fingerprint:
        raise UserError(
            f"the token shards in {loader.shards.directory} were made with another tokenizer than the "
            f"one in {tokenizer_dir()}; re-tokenize with "
            "`python -m nanochat_fast.scripts.prepare_data --stage=tokens`"
        )


TOKEN_ROWS = PackedRows(TokenRowLoader, "base")
CONVERSATION_ROWS = PackedRows(ConversationRowLoader, "chat")


class PaddedConversations:
    """The data object of chat_sft (the module docstring describes the two methods): padded rows of the
    mixture that `sources(args, cfg, tokenizer)` returns as (train parts, val parts, dataset name,
    notes); examples_per_step conversations per optimizer step."""

    varying_shapes = True  # rows as long as the batch's longest conversation

    def __init__(self, examples_per_step: int, sources):
        self.examples_per_step, self.sources = examples_per_step, sources

    def grad_accum_steps(self, data_config, world_size: int) -> int:
        """Micro-steps per optimizer step: examples_per_step / (device_batch_size x world_size)."""
        return micro_steps(
            "--target-examples-per-step",
            self.examples_per_step,
            "device_batch_size x world_size",
            (data_config.device_batch_size, world_size),
        )

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

        batches = functools.partial(stage_val_batches, make_loader, cfg, dev)

        train = mixtures["train"]
        cut = int((train.lengths() > data.max_seq_len + 1).sum())
        notes = notes + (
            [f"{cut:,} conversations longer than {data.max_seq_len + 1} tokens lose their end"] if cut else []
        )
        describe = (
            f"{train.n_docs:,} conversations, one per row ({train.describe()}); val "
            f"{mixtures['val'].describe()}" + "".join(f"; {n}" for n in notes)
        )
        return Data(make_loader("train", dev.rank, dev.world_size), batches, dataset, describe)


def prepared_conversation_shards(dataset: str, split: str, tokenizer) -> TokenShards:
    shards = TokenShards(dataset, split)
    if shards.kind != CHAT:
        raise UserError(
            f"dataset {dataset!r} holds prose, not conversations: pass a conversation dataset (e.g. --dataset=chat)"
        )
    if shards.fingerprint != tokenizer.fingerprint:
        raise UserError(
            f"the token shards in {shards.directory} were made with another tokenizer; re-tokenize with "
            "`python -m nanochat_fast.scripts.prepare_data --stage=tokens`"
        )
    return shards


def task_conversations() -> tuple[list[tuple[str, list]], list[str]]:
    """[(name, conversations)] of every chat task's train splits that are prepared, and the names of
    the tasks left out because their data is not."""
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
    """(train parts, val parts, dataset name, notes) of the mixture (docs/measurements.md#training-data-mixtures)."""
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
    # no conversation dataset: every VAL_EVERY-th conversation of each source is held out for val bpb
    train, val = [], []
    for name, convs in in_memory:
        kept = [c for i, c in enumerate(convs) if i % VAL_EVERY]
        if kept:
            train.append((name, ConversationShards(kept, tokenizer, name)))
        val.append((name, ConversationShards(convs[::VAL_EVERY], tokenizer, f"{name} (val)")))
    if not train:
        raise UserError(
            f"--extra-conversations {extra} holds one conversation; training on it alone needs at least "
            f"2 (every {VAL_EVERY}th, from the first, is held out for validation)"
        )
    notes.append(f"no conversation dataset prepared: every {VAL_EVERY}th conversation is held out for val bpb")
    return train, val, "conversations:" + "+".join(name.split()[0] for name, _ in in_memory), notes
