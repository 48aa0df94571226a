"""
The training loaders, one global deterministic stream per dataset and split: every micro-step takes
device_batch_size * world_size rows and rank r takes rows r*B ... (r+1)*B-1, so N processes see the
rows of one process with N times the batch and the state (a global cursor, plain JSON) resumes on
any number of processes. Packed rows: best-fit from the token shards, packed ahead by a thread
(docs/measurements.md#packed-loaders); chat_sft's padded conversations: #padded-conversations.
"""

import atexit
import contextlib
import hashlib
import sys
import weakref

import numpy as np
import torch

from ..core.errors import UserError
from ..kernels.pack_rows import make_row_stream
from .documents import CHAT
from .token_shards import TokenShards
from .tokenizer import get_tokenizer

MASK_SHIFT = 30  # conversation tokens travel through the packer as token | (supervised << 30)
STATE_VERSION = 1  # of both loaders' states
PADDED_KIND = "padded_conversations"  # the padded-conversation loader state's kind


class DocStream:
    """The documents of one split as an endless stream: position p is document p % n_docs of the
    epoch order (the shards in order, extra documents interleaved evenly), kept as `runs` of
    consecutive documents (tokens, offsets, mask or None) straight on the memory-mapped shards."""

    def __init__(self, shards: TokenShards, with_mask: bool, extra=None):
        extra = extra or []
        self.n_docs = shards.n_docs + len(extra)
        tokens = [torch.from_numpy(t) for t in shards.tokens]
        offsets = [torch.from_numpy(o) for o in shards.offsets]
        masks = [torch.from_numpy(m) if with_mask else None for m in shards.masks]
        self.runs = []

        def shard_docs(first: int, count: int):  # shard documents first ... first + count - 1, as runs
            while count > 0:
                shard, local = shards.locate(first)
                n = min(count, len(shards.offsets[shard]) - 1 - local)
                self.runs.append((tokens[shard], offsets[shard][local : local + n + 1], masks[shard]))
                first, count = first + n, count - n

        done = 0  # shard documents placed so far
        if extra:
            k = np.arange(len(extra), dtype=np.int64)
            extra_at = (2 * k + 1) * self.n_docs // (2 * len(extra))  # strictly increasing epoch positions
            extra_tokens = torch.from_numpy(np.concatenate([np.asarray(ids, np.int32) for ids, _ in extra]))
            extra_masks = torch.from_numpy(np.concatenate([np.asarray(mask, np.uint8) for _, mask in extra]))
            extra_offsets = torch.from_numpy(np.cumsum([0] + [len(ids) for ids, _ in extra]).astype(np.int64))
            for j, at in enumerate(extra_at.tolist()):
                shard_docs(done, at - j - done)  # the shard documents before epoch position `at`
                done = at - j
                self.runs.append((extra_tokens, extra_offsets[j : j + 2], extra_masks if with_mask else None))
        shard_docs(done, shards.n_docs - done)
        self.run_starts = np.cumsum([0] + [len(o) - 1 for _, o, _ in self.runs]).astype(np.int64)

    def add_to(self, packer, start: int, count: int):
        """Add stream positions [start, start + count) to the packer, in order (ids = positions)."""
        p, end = start, start + count
        while p < end:
            i = p % self.n_docs
            r = int(np.searchsorted(self.run_starts, i, side="right")) - 1
            first = int(self.run_starts[r])
            n = min(end - p, int(self.run_starts[r + 1]) - i)
            tokens, offsets, mask = self.runs[r]
            # the packer reads the memory-mapped shard directly (conversations: tokens and mask)
            if mask is None:
                packer.add(tokens, offsets[i - first : i - first + n + 1], p)
            else:
                packer.add(tokens, offsets[i - first : i - first + n + 1], p, mask, MASK_SHIFT)
            p += n


_PREFETCHING = weakref.WeakSet()  # streams with a prefetch thread, stopped at exit


@atexit.register
def _stop_all():
    for stream in list(_PREFETCHING):
        stream.stop()


class Loader:
    """What the training loop uses of a loader besides next(), state_dict() and epoch_progress."""

    def __iter__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        pass

    @property
    def epochs_done(self) -> int:
        return int(self.epoch_progress)


class TokenRowLoader(Loader):
    """Pretraining batches, forever: (inputs, targets), contiguous int64 [device_batch_size, seq_len], from
    tokens_root/<dataset>/<split>/ (default NANOCHAT_FAST_HOME/tokens); buffer_docs: documents to choose
    from; prefetch: True (2 batches ahead), a queue depth or False; backend: the packer's (None: registry's)."""

    with_mask = False

    def __init__(
        self,
        dataset: str = "base",
        split: str = "train",
        device_batch_size: int = 32,
        seq_len: int = 2048,
        rank: int = 0,
        world_size: int = 1,
        device="cpu",
        tokens_root=None,
        buffer_docs: int = 1000,
        prefetch=True,
        backend: str | None = None,
        _extra=None,
        _shards=None,
    ):
        for name, value, low in (
            ("device_batch_size", device_batch_size, 1),
            ("seq_len", seq_len, 1),
            ("world_size", world_size, 1),
            ("buffer_docs", buffer_docs, 1),
            ("rank", rank, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
        self.dataset, self.split = dataset, split
        self.device_batch_size, self.seq_len, self.rank, self.world_size = device_batch_size, seq_len, rank, world_size
        self.device = torch.device(device)
        self.rows = device_batch_size * world_size  # the global batch packed at every micro-step
        self.shards = _shards if _shards is not None else TokenShards(dataset, split, tokens_root)
        if self.with_mask and self.shards.kind != CHAT:
            raise UserError(
                f"dataset {dataset!r} holds prose, not conversations: use a conversation dataset "
                "(e.g. chat) for mid-training"
            )
        self._extra_digest = None  # what a saved state with extra conversations is valid for
        if _extra:
            h = hashlib.sha256()
            for ids, mask in _extra:
                h.update(np.asarray(ids, np.int64).tobytes() + b"|" + np.asarray(mask, np.uint8).tobytes() + b";")
            self._extra_digest = h.hexdigest()[:16]
        self.docs = DocStream(self.shards, self.with_mask, _extra)
        self.n_docs = self.docs.n_docs
        # (a buffer larger than the split would only hold several copies of its documents)
        buffer_docs = min(buffer_docs, self.docs.n_docs)
        mask_shift = MASK_SHIFT if self.with_mask else -1
        self._stream_args = (self.docs, self.rows, seq_len + 1, self.shards.bos_id, buffer_docs, mask_shift, backend)
        self._depth = 2 if prefetch is True else max(0, int(prefetch or 0))
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            torch.cuda.init()  # before a prefetch thread allocates pinned memory
        # this rank's rows; on CUDA as pinned [B, T+1] rows (split on the GPU), else as the pair
        self._rows_args = (self.rank * device_batch_size, device_batch_size, not self._cuda, self._cuda)
        self._closed = False
        self._new_stream(make_row_stream(*self._stream_args))

    def _new_stream(self, stream):
        """Start producing from `stream` (its prefetch thread, if any, must be stopped)."""
        self._stream = stream
        self._state = stream.state()  # the state after the last batch handed out
        if self._depth > 0:
            stream.start(self._depth, *self._rows_args)
            _PREFETCHING.add(stream)

    def __next__(self):
        if self._closed:
            raise RuntimeError("the loader is closed")
        try:
            if self._stream.prefetching:
                batch, state = self._stream.get()
            else:
                batch, state = self._stream.next(*self._rows_args)
        except Exception:  # (the stream is broken: its thread, if any, has stopped)
            self._stream.stop()
            raise
        if self._cuda:
            # the one host-to-device copy, from pinned memory: torch's pinned-memory cache records the
            # copy and hands that block out again only once the copy has finished
            rows = batch.to(self.device, non_blocking=True)
            if self.with_mask:  # token | (supervised << MASK_SHIFT): targets -1 where not supervised
                tokens, supervised = rows & ((1 << MASK_SHIFT) - 1), (rows >> MASK_SHIFT) != 0
                inputs, targets = tokens[:, :-1].contiguous(), torch.where(supervised[:, 1:], tokens[:, 1:], -1)
            else:
                inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        else:
            inputs, targets = batch
            if self.device.type != "cpu":
                inputs, targets = inputs.to(self.device), targets.to(self.device)
        self._state = state
        return inputs, targets

    @property
    def epoch_tokens(self) -> int:
        """Tokens in one epoch of documents (rows crop some of them: an upper bound of those trained on)."""
        return sum(int(offsets[-1] - offsets[0]) for _, offsets, _ in self.docs.runs)

    @property
    def epoch_progress(self) -> float:
        """Documents consumed so far, in epochs (1.0 = as many documents as the split holds)."""
        next_pos, buffer = self._state[:2]
        return (next_pos - len(buffer)) / self.docs.n_docs

    @property
    def cropped_fraction(self) -> float:
        """Of the tokens taken from documents so far, the fraction discarded by cropping."""
        used, cropped = self._state[3:5]
        return cropped / (used + cropped) if used + cropped else 0.0

    def _identity(self) -> dict:  # what a saved state is valid for
        return {
            "dataset": self.dataset,
            "split": self.split,
            "n_docs": self.docs.n_docs,
            "tokenizer": self.shards.fingerprint,
            "extra": self._extra_digest,
        }

    def state_dict(self) -> dict:
        next_pos, buffer, batches, used, cropped = self._state
        return {
            "version": STATE_VERSION,
            **self._identity(),
            "seq_len": self.seq_len,
            "rows": self.rows,
            "next_pos": int(next_pos),
            "buffer": buffer.tolist(),
            "batches": int(batches),
            "tokens_used": int(used),
            "tokens_cropped": int(cropped),
        }

    def load_state_dict(self, state: dict):
        """Continue from `state` (from state_dict(), possibly saved by a run with another world size)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"state: not a loader state of version {STATE_VERSION}")
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise ValueError(
                    f"state: saved for {key}={state.get(key)!r} but this loader has {key}={mine!r} "
                    "(the data, tokenizer or extra conversations changed since it was saved)"
                )
        if (state["rows"], state["seq_len"]) != (self.rows, self.seq_len) and self.rank == 0:
            print(
                f"warning: resuming the data stream with {self.rows} rows of {self.seq_len + 1} tokens per "
                f"micro-step instead of {state['rows']} rows of {state['seq_len'] + 1}: documents are grouped into "
                "rows differently from the original run (none is repeated or skipped)",
                file=sys.stderr,
                flush=True,
            )
        self._stream.stop()
        counts = (int(state[key]) for key in ("batches", "tokens_used", "tokens_cropped"))
        self._stream.restore(int(state["next_pos"]), [int(i) for i in state["buffer"]], *counts)
        self._new_stream(self._stream)

    def reset(self):
        """Back to the start of the split (e.g. before each evaluation on val)."""
        self._stream.stop()
        self._new_stream(make_row_stream(*self._stream_args))

    def close(self):
        self._stream.stop()
        self._closed = True

    def __del__(self):
        with contextlib.suppress(Exception):
            self._stream.stop()


class ConversationRowLoader(TokenRowLoader):
    """Mid-training batches: TokenRowLoader's, targets -1 where the token is not the assistant's.
    `extra_conversations` are rendered with `tokenizer` (default: the trained one) and interleaved evenly
    into the epoch; `shards`: any object shaped like TokenShards (train/stage_data.ConversationShards)."""

    with_mask = True

    def __init__(
        self, dataset="chat", split="train", *args, extra_conversations=None, tokenizer=None, shards=None, **kw
    ):
        extra = None
        if extra_conversations:
            if tokenizer is None:
                tokenizer = get_tokenizer()
            shards = shards if shards is not None else TokenShards(dataset, split, kw.get("tokens_root"))
            if tokenizer.fingerprint != shards.fingerprint:
                raise UserError(
                    f"the token shards of {dataset!r} were made with another tokenizer; re-run "
                    "`python -m nanochat_fast.scripts.prepare_data --stage=tokens`"
                )
            extra = []
            for i, conv in enumerate(extra_conversations):
                try:
                    extra.append(tokenizer.render_conversation(conv))
                except ValueError as e:
                    raise ValueError(f"extra_conversations[{i}]: {e}") from None
        super().__init__(dataset, split, *args, _extra=extra, _shards=shards, **kw)


class ConversationMixture:
    """Sources of rendered conversations (shaped like TokenShards: tokens, masks and
    offsets per shard, locate(i), n_docs) behind one index, in a seeded order per epoch."""

    def __init__(self, parts: list[tuple[str, object]], seed: int = 42, shuffle: bool = True):
        self.parts = [(name, shards) for name, shards in parts if shards.n_docs > 0]
        if not self.parts:
            raise ValueError("a conversation mixture needs at least one conversation")
        self.starts = np.cumsum([0] + [shards.n_docs for _, shards in self.parts]).astype(np.int64)
        self.n_docs = int(self.starts[-1])
        self.seed, self.shuffle = seed, shuffle
        self._order = (None, None)  # (epoch, its permutation)

    def at(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, mask: 1 where the assistant speaks) of the conversation at stream position
        `position`: epoch position // n_docs, in that epoch's order."""
        epoch, index = divmod(position, self.n_docs)
        if self.shuffle:
            if self._order[0] != epoch:
                self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_docs))
            index = int(self._order[1][index])
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        shards = self.parts[part][1]
        shard, local = shards.locate(index - int(self.starts[part]))
        lo, hi = int(shards.offsets[shard][local]), int(shards.offsets[shard][local + 1])
        return shards.tokens[shard][lo:hi], shards.masks[shard][lo:hi]

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(o) for _, shards in self.parts for o in shards.offsets])

    def digest(self) -> str:
        """Names, sizes and tokenizers of the parts, and the seed: what a saved cursor is only valid for."""
        h = hashlib.sha256(f"{self.seed}|{self.shuffle}".encode())
        for name, shards in self.parts:
            h.update(f"|{name}:{shards.n_docs}:{shards.fingerprint}".encode())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        return " + ".join(f"{name} {shards.n_docs:,}" for name, shards in self.parts)


class PaddedConversationLoader(Loader):
    """chat_sft's batches: one conversation per row, padded, not packed (nanochat's SFT), so each starts at
    position 0 as when the model chats: (inputs ids[:-1], targets ids[1:] where the assistant speaks), int64
    [device_batch_size, L], padded with pad_id (targets -1) to the rank's longest of at most seq_len + 1."""

    def __init__(self, mixture, device_batch_size, seq_len, pad_id, rank=0, world_size=1, device="cpu"):
        self.mixture, self.pad_id, self.n_docs = mixture, pad_id, mixture.n_docs
        self.device_batch_size, self.seq_len, self.rank, self.world_size = device_batch_size, seq_len, rank, world_size
        self.device = torch.device(device)
        self.rows = device_batch_size * world_size  # conversations per micro-step, all ranks
        self.cursor = 0  # stream position of the next micro-step's first conversation

    def __next__(self):
        """This rank's conversations of the micro-step, padded on the right to the longest."""
        first = self.cursor + self.rank * self.device_batch_size
        convs = [self.mixture.at(p) for p in range(first, first + self.device_batch_size)]
        self.cursor += self.rows
        convs = [(ids[: self.seq_len + 1], mask[: self.seq_len + 1]) for ids, mask in convs]
        width = max(len(ids) for ids, _ in convs) - 1
        inputs = torch.full((len(convs), width), self.pad_id, dtype=torch.long)
        targets = torch.full((len(convs), width), -1, dtype=torch.long)
        for row, (ids, mask) in enumerate(convs):
            ids = torch.from_numpy(ids.astype(np.int64))
            n = len(ids) - 1
            inputs[row, :n] = ids[:-1]
            # the target at position t is token t + 1, trained on only where the assistant says it
            targets[row, :n] = torch.where(torch.from_numpy(mask[1:].astype(bool)), ids[1:], -1)
        return inputs.to(self.device), targets.to(self.device)

    @property
    def epoch_progress(self) -> float:
        return self.cursor / self.mixture.n_docs

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "kind": PADDED_KIND,
            "mixture": self.mixture.digest(),
            "n_docs": self.mixture.n_docs,
            "cursor": self.cursor,
            "rows": self.rows,
        }

    def load_state_dict(self, state: dict):
        """Continue from `state`, saved by a run with any number of processes."""
        if not isinstance(state, dict) or (state.get("version"), state.get("kind")) != (STATE_VERSION, PADDED_KIND):
            raise ValueError("state: not a padded-conversation loader state")
        if state["mixture"] != self.mixture.digest():
            raise ValueError(
                f"state: saved for another conversation mixture ({state['n_docs']:,} conversations; "
                f"this one has {self.mixture.n_docs:,}): the data, its tokenizer or "
                "--extra-conversations changed since it was saved"
            )
        self.cursor = int(state["cursor"])
