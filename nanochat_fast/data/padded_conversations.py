"""
What chat_sft reads: one conversation per row, padded, not packed (nanochat's SFT), so each starts at
position 0 as when the model chats, and batches count conversations. A row: inputs ids[:-1], targets
ids[1:] where the assistant speaks, padded with <|assistant_end|> (targets -1) to the longest of the
rank's batch, at most --max-seq-len + 1 tokens. One global stream over a ConversationMixture with a
global cursor, as the packed loaders: docs/measurements.md#padded-conversations.
"""

import hashlib

import numpy as np
import torch

STATE_VERSION = 1
KIND = "padded_conversations"  # the state's kind


class ConversationMixture:
    """Sources of rendered conversations (shaped like token_shards.TokenShards: tokens, masks and
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


class PaddedConversationLoader:
    """next(loader) -> (inputs, targets), int64 [device_batch_size, L] on `device`, forever; the
    interface of dataloader.TokenRowLoader that the training loop uses."""

    def __init__(self, mixture, device_batch_size, seq_len, pad_id, rank=0, world_size=1, device="cpu"):
        self.mixture, self.pad_id = mixture, pad_id
        self.device_batch_size, self.seq_len, self.rank, self.world_size = device_batch_size, seq_len, rank, world_size
        self.device = torch.device(device)
        self.rows = device_batch_size * world_size  # conversations per micro-step, all ranks
        self.cursor = 0  # stream position of the next micro-step's first conversation

    @property
    def n_docs(self) -> int:
        return self.mixture.n_docs

    def __iter__(self):
        return self

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

    @property
    def epochs_done(self) -> int:
        return self.cursor // self.mixture.n_docs

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "kind": KIND,
            "mixture": self.mixture.digest(),
            "n_docs": self.mixture.n_docs,
            "cursor": self.cursor,
            "rows": self.rows,
        }

    def load_state_dict(self, state: dict):
        """Continue from `state`, saved by a run with any number of processes."""
        if not isinstance(state, dict) or (state.get("version"), state.get("kind")) != (STATE_VERSION, KIND):
            raise ValueError("state: not a padded-conversation loader state")
        if state["mixture"] != self.mixture.digest():
            raise ValueError(
                f"state: saved for another conversation mixture ({state['n_docs']:,} conversations; "
                f"this one has {self.mixture.n_docs:,}): the data, its tokenizer or "
                "--extra-conversations changed since it was saved"
            )
        self.cursor = int(state["cursor"])

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
