"""
Training data loaders: (inputs, targets) rows packed from the pre-tokenized shards (dataset.py).

One global, deterministic row stream per dataset and split. The documents are read in a fixed
order (shard by shard, repeated epoch after epoch; position p of the stream is document p mod D)
into a buffer, and every micro-step packs a global batch of device_batch_size * world_size rows of
T+1 tokens from it with best-fit packing (kernels/pack_rows.py: every row starts with <|bos|>, no
padding, little cropping; a document that best-fit keeps passing over becomes due after a while and
starts a row, so none waits for good). Rank r takes rows r*B ... (r+1)*B-1. So every rank packs
the same global batch (deciding all rows, writing only its own): the ranks see disjoint documents,
and a run on N processes sees exactly the rows of a 1-process run with N times the batch.

The state is the global cursor: the stream position of the next document to read, and the
positions of the documents waiting in the buffer. It is plain JSON (it goes into a checkpoint's
meta.json), and resuming from it continues with the exact next batch. Resuming with a different
number of rows per micro-step (another world size times device batch) repeats and skips nothing;
only the grouping of documents into rows differs, and the loader says so in one warning line.

A background thread packs the next batches (the packer releases the GIL) while the step runs; on
CUDA it packs into pinned buffers and each batch reaches the GPU in one non-blocking copy.
"""
import atexit
import hashlib
import queue
import sys
import threading
import weakref

import numpy as np
import torch

from .cli import UserError
from .dataset import CHAT, TokenShards
from .kernels.pack_rows import make_row_packer

MASK_SHIFT = 30  # conversation tokens travel through the packer as token | (supervised << 30)
STATE_VERSION = 1
# A document read more than WAIT_FACTOR buffers ago is due and starts a row. Without this, best-fit
# leaves documents of awkward lengths waiting for good (default corpus, T=512: 4% of documents
# still waiting after 3 epochs); the price is some cropping (there: 11% of tokens cropped with no
# limit, 14% / 17% / 19% with a factor of 8 / 4 / 2; at T=2048 about 1.4% either way).
WAIT_FACTOR = 4


class DocStream:
    """The documents of one split as an endless stream: position p is document p % n_docs of the
    epoch order: the token shards in order, with any extra documents interleaved evenly."""

    def __init__(self, shards: TokenShards, with_mask: bool, extra=None):
        self.shards, self.with_mask = shards, with_mask
        extra = extra or []
        self.n_docs = shards.n_docs + len(extra)
        self._tokens = [torch.from_numpy(t) for t in shards.tokens]
        self._offsets = [torch.from_numpy(o) for o in shards.offsets]
        self._masks = [torch.from_numpy(m) for m in shards.masks] if with_mask else None
        if extra:
            k = np.arange(len(extra), dtype=np.int64)
            self.extra_at = (2 * k + 1) * self.n_docs // (2 * len(extra))  # strictly increasing
            self._extra_tokens = torch.from_numpy(np.concatenate([np.asarray(ids, np.int32) for ids, _ in extra]))
            self._extra_masks = torch.from_numpy(np.concatenate([np.asarray(mask, np.uint8) for _, mask in extra]))
            self._extra_offsets = torch.from_numpy(np.cumsum([0] + [len(ids) for ids, _ in extra]).astype(np.int64))
        else:
            self.extra_at = np.zeros(0, np.int64)

    def add_to(self, packer, start: int, count: int):
        """Add stream positions [start, start + count) to the packer, in order (ids = positions)."""
        p, end = start, start + count
        while p < end:
            i = p % self.n_docs
            j = int(np.searchsorted(self.extra_at, i))  # extra documents before position i
            if j < len(self.extra_at) and self.extra_at[j] == i:
                packer.add(self._extra_tokens, self._extra_offsets[j:j + 2], p, self._extra_masks, MASK_SHIFT)
                p += 1
                continue
            limit = int(self.extra_at[j]) if j < len(self.extra_at) else self.n_docs
            shard, local = self.shards.locate(i - j)
            run = min(end - p, limit - i, len(self.shards.offsets[shard]) - 1 - local)
            self._add_run(packer, shard, local, run, p)
            p += run

    def _add_run(self, packer, shard, local, run, first_id):
        # the packer reads the memory-mapped shard directly (conversations: tokens and mask)
        offsets = self._offsets[shard][local:local + run + 1]
        if self.with_mask:
            packer.add(self._tokens[shard], offsets, first_id, self._masks[shard], MASK_SHIFT)
        else:
            packer.add(self._tokens[shard], offsets, first_id)


class RowStream:
    """The deterministic part: document buffer + cursor -> global batches. No threads."""

    def __init__(self, docs: DocStream, rows: int, row_len: int, buffer_docs: int, bos_id: int, backend=None):
        self.docs, self.rows, self.row_len, self.buffer_docs = docs, rows, row_len, buffer_docs
        self.packer = make_row_packer(row_len, bos_id, backend)
        self.next_pos, self.batches, self.tokens_used, self.tokens_cropped = 0, 0, 0, 0
        self.refill()

    def _add(self, count):
        self.docs.add_to(self.packer, self.next_pos, count)
        self.next_pos += count

    def refill(self):
        """Top the buffer up to buffer_docs documents and at least 2 * rows * row_len tokens (the
        packer keeps at most row_len of a document): enough for best-fit to fill every row, since
        filling a row consumes at most 2 * row_len of them (whole documents that fit, plus one
        that is cropped)."""
        self._add(max(self.buffer_docs - self.packer.num_docs, 0))
        target = 2 * self.rows * self.row_len
        while self.packer.mass < target:  # as many documents as the buffer's average suggests
            average = max(1, self.packer.mass // max(1, self.packer.num_docs))
            self._add(-(-(target - self.packer.mass) // average))

    def pack(self, out: torch.Tensor, first_row: int, targets: torch.Tensor | None = None, mask_bit: int = -1):
        """Rows [first_row, first_row + out.shape[0]) of the next global batch into out [R, T+1],
        or, given targets, the training pair out = inputs, targets [R, T] (RowPacker.pack)."""
        # best-fit alone can leave a document of an awkward length waiting for good: one read more
        # than WAIT_FACTOR buffers ago is due and starts a row (see csrc/pack_rows.h)
        due_before = self.next_pos - WAIT_FACTOR * self.packer.num_docs
        _, used, cropped = self.packer.pack(out, self.rows, first_row, due_before, targets, mask_bit)
        self.batches += 1
        self.tokens_used += used
        self.tokens_cropped += cropped
        self.refill()

    def snapshot(self) -> dict:
        return {"next_pos": self.next_pos, "buffer": self.packer.ids(), "batches": self.batches,
                "tokens_used": self.tokens_used, "tokens_cropped": self.tokens_cropped}

    def restore(self, state: dict):
        self.packer.clear()
        ids = [int(i) for i in state["buffer"]]
        k = 0
        while k < len(ids):  # re-add the buffered documents in buffer order, consecutive runs at once
            run = 1
            while k + run < len(ids) and ids[k + run] == ids[k] + run:
                run += 1
            self.docs.add_to(self.packer, ids[k], run)
            k += run
        self.next_pos, self.batches = int(state["next_pos"]), int(state["batches"])
        self.tokens_used, self.tokens_cropped = int(state["tokens_used"]), int(state["tokens_cropped"])
        self.refill()


class _Failure:
    def __init__(self, error):
        self.error = error


class _BatchMaker:
    """Packs this rank's rows of the next global batch. On CUDA into a ring of pinned [B, T+1]
    buffers (a buffer comes back with the event of its copy to the GPU, and is reused once that
    has finished); elsewhere straight into fresh, contiguous (inputs, targets)."""

    def __init__(self, stream: RowStream, first_row: int, rows: int, row_len: int, with_mask: bool, cuda: bool,
                 ring: int):
        self.stream, self.first_row, self.rows, self.row_len = stream, first_row, rows, row_len
        self.mask_bit = MASK_SHIFT if with_mask else -1
        self.cuda, self.free = cuda, queue.Queue()
        for _ in range(ring if cuda else 0):
            self.free.put((torch.empty((rows, row_len), dtype=torch.int64, pin_memory=True), None))

    def __call__(self, halt: threading.Event | None = None):
        """(rows or (inputs, targets), state snapshot); None when `halt` is set while waiting."""
        if not self.cuda:  # CPU (and MPS): the packer writes the training pair itself
            inputs, targets = (torch.empty((self.rows, self.row_len - 1), dtype=torch.int64) for _ in range(2))
            self.stream.pack(inputs, self.first_row, targets, self.mask_bit)
            return (inputs, targets), self.stream.snapshot()
        while True:
            try:
                buf, event = self.free.get(timeout=0.05)
                break
            except queue.Empty:
                if halt is not None and halt.is_set():
                    return None
        if event is not None:
            event.synchronize()
        self.stream.pack(buf, self.first_row)
        return buf, self.stream.snapshot()  # the consumer releases buf after its copy

    def release(self, buf, event):
        self.free.put((buf, event))


_PRODUCERS = weakref.WeakSet()


@atexit.register
def _stop_all():
    for producer in list(_PRODUCERS):
        producer.stop()


class _Producer:
    """The prefetch thread: runs a _BatchMaker ahead into a bounded queue. It holds no reference to
    the loader, so a loader dropped without close() is still collected (and stops its thread)."""

    def __init__(self, make_batch: _BatchMaker, depth: int):
        self.make_batch, self.queue, self.halt = make_batch, queue.Queue(maxsize=depth), threading.Event()
        self.thread = threading.Thread(target=self._run, name="nanochat_fast-prefetch", daemon=True)
        _PRODUCERS.add(self)
        self.thread.start()

    def _put(self, item):
        while not self.halt.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                pass

    def _run(self):
        try:
            while not self.halt.is_set():
                item = self.make_batch(self.halt)
                if item is not None:
                    self._put(item)
        except BaseException as e:  # handed to the consumer, raised by next()
            self._put(_Failure(e))

    def get(self):
        while True:
            try:
                return self.queue.get(timeout=1.0)
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError("the data loader's prefetch thread stopped") from None

    def stop(self):
        self.halt.set()
        while True:  # unblock a put() waiting for room
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        _PRODUCERS.discard(self)


class TokenRowLoader:
    """Pretraining batches: next(loader) -> (inputs, targets), contiguous int64 [device_batch_size,
    seq_len] on `device`, each target the token after its input. Iterates forever, epoch after epoch.

    dataset, split   token shards under tokens_root/<dataset>/<split>/ (tokens_root defaults to
                     NANOCHAT_FAST_HOME/tokens; prepare_data + tok_train make them)
    rank, world_size this process's share of the global batch (rows rank*B ... (rank+1)*B-1)
    buffer_docs      documents kept to choose from (more: a little less cropping; capped at the split)
    prefetch         True (2 batches ahead), a queue depth, or False (pack in next() itself)
    backend          the packer: None (NANOCHAT_FAST_KERNELS / best available), "cpp" or "reference"
    """

    with_mask = False

    def __init__(self, dataset: str = "base", split: str = "train", device_batch_size: int = 32,
                 seq_len: int = 2048, rank: int = 0, world_size: int = 1, device="cpu", tokens_root=None,
                 buffer_docs: int = 1000, prefetch=True, backend: str | None = None, _extra=None):
        for name, value, low in (("device_batch_size", device_batch_size, 1), ("seq_len", seq_len, 1),
                                 ("world_size", world_size, 1), ("buffer_docs", buffer_docs, 1), ("rank", rank, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
        self.dataset, self.split = dataset, split
        self.device_batch_size, self.seq_len, self.rank, self.world_size = device_batch_size, seq_len, rank, world_size
        self.device = torch.device(device)
        self.rows = device_batch_size * world_size  # the global batch packed at every micro-step
        self.shards = TokenShards(dataset, split, tokens_root)
        if self.with_mask and self.shards.kind != CHAT:
            raise UserError(f"dataset {dataset!r} holds prose, not conversations: use a conversation dataset "
                            "(e.g. chat) for mid-training")
        self._extra_digest = _digest(_extra) if _extra else None
        self.docs = DocStream(self.shards, self.with_mask, _extra)
        # (a buffer larger than the split would only hold several copies of its documents)
        buffer_docs = min(buffer_docs, self.docs.n_docs)
        self._stream_args = (self.docs, self.rows, seq_len + 1, buffer_docs, self.shards.bos_id, backend)
        self._depth = 2 if prefetch is True else max(0, int(prefetch or 0))
        self._cuda = self.device.type == "cuda"
        self._producer, self._closed = None, False
        self._new_stream(RowStream(*self._stream_args))

    def _new_stream(self, stream: RowStream):
        """Start producing from `stream` (the prefetch thread, if any, must be stopped)."""
        self._stream = stream
        self._state = stream.snapshot()  # the state after the last batch handed out
        self._maker = _BatchMaker(stream, self.rank * self.device_batch_size, self.device_batch_size,
                                  self.seq_len + 1, self.with_mask, self._cuda, ring=self._depth + 2)
        if self._depth > 0:
            self._producer = _Producer(self._maker, self._depth)

    def _stop(self):
        if self._producer is not None:
            self._producer.stop()
            self._producer = None

    # -----------------------------------------------------------------------------------------
    # consuming

    def __iter__(self):
        return self

    def __next__(self):
        if self._closed:
            raise RuntimeError("the loader is closed")
        item = self._producer.get() if self._producer is not None else self._maker()
        if isinstance(item, _Failure):
            self._stop()
            raise item.error
        batch, state = item
        if self._cuda:
            rows = batch.to(self.device, non_blocking=True)  # the one host-to-device copy
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._maker.release(batch, event)
            inputs, targets = _split(rows, self.with_mask)
        else:
            inputs, targets = batch
            if self.device.type != "cpu":
                inputs, targets = inputs.to(self.device), targets.to(self.device)
        self._state = state
        return inputs, targets

    # -----------------------------------------------------------------------------------------
    # progress and state

    @property
    def n_docs(self) -> int:
        return self.docs.n_docs

    @property
    def epoch_progress(self) -> float:
        """Documents consumed so far, in epochs (1.0 = as many documents as the split holds)."""
        return (self._state["next_pos"] - len(self._state["buffer"])) / self.docs.n_docs

    @property
    def epochs_done(self) -> int:
        return int(self.epoch_progress)

    @property
    def last_step(self) -> bool:
        """True once a full epoch of documents has been consumed (mid-training stops there)."""
        return self.epochs_done >= 1

    @property
    def cropped_fraction(self) -> float:
        """Of the tokens taken from documents so far, the fraction discarded by cropping."""
        used, cropped = self._state["tokens_used"], self._state["tokens_cropped"]
        return cropped / (used + cropped) if used + cropped else 0.0

    def state_dict(self) -> dict:
        s = self._state
        return {"version": STATE_VERSION, "dataset": self.dataset, "split": self.split, "n_docs": self.docs.n_docs,
                "tokenizer": self.shards.fingerprint, "extra": self._extra_digest, "seq_len": self.seq_len,
                "rows": self.rows, "next_pos": int(s["next_pos"]), "buffer": s["buffer"].tolist(),
                "batches": int(s["batches"]), "tokens_used": int(s["tokens_used"]),
                "tokens_cropped": int(s["tokens_cropped"])}

    def load_state_dict(self, state: dict):
        """Continue from `state` (from state_dict(), possibly saved by a run with another world size)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"state: not a loader state of version {STATE_VERSION}")
        for key, mine in (("dataset", self.dataset), ("split", self.split), ("n_docs", self.docs.n_docs),
                          ("tokenizer", self.shards.fingerprint), ("extra", self._extra_digest)):
            if state.get(key) != mine:
                raise ValueError(f"state: saved for {key}={state.get(key)!r} but this loader has {key}={mine!r} "
                                 "(the data, tokenizer or extra conversations changed since it was saved)")
        if (state["rows"], state["seq_len"]) != (self.rows, self.seq_len) and self.rank == 0:
            print(f"warning: resuming the data stream with {self.rows} rows of {self.seq_len + 1} tokens per "
                  f"micro-step instead of {state['rows']} rows of {state['seq_len'] + 1}: documents are grouped into "
                  "rows differently from the original run (none is repeated or skipped)", file=sys.stderr, flush=True)
        self._stop()
        self._stream.restore(state)
        self._new_stream(self._stream)

    def reset(self):
        """Back to the start of the split (e.g. before each evaluation on val)."""
        self._stop()
        self._new_stream(RowStream(*self._stream_args))

    def close(self):
        self._stop()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._stop()
        except Exception:
            pass


class ConversationRowLoader(TokenRowLoader):
    """Mid-training batches from a conversation dataset: like TokenRowLoader, with targets -1 where
    the token is not the assistant's (the loss ignores them). `extra_conversations` (a list of
    {"messages": [...]}) are rendered with `tokenizer` (default: the trained one) and interleaved
    evenly into the epoch. `last_step` turns True after one full epoch of the mixture."""

    with_mask = True

    def __init__(self, dataset: str = "chat", split: str = "train", device_batch_size: int = 32,
                 seq_len: int = 2048, rank: int = 0, world_size: int = 1, device="cpu", tokens_root=None,
                 buffer_docs: int = 1000, prefetch=True, backend: str | None = None,
                 extra_conversations: list[dict] | None = None, tokenizer=None):
        extra = None
        if extra_conversations:
            if tokenizer is None:
                from .tokenizer import get_tokenizer
                tokenizer = get_tokenizer()
            shards = TokenShards(dataset, split, tokens_root)
            if tokenizer.fingerprint != shards.fingerprint:
                raise UserError(f"the token shards of {dataset!r} were made with another tokenizer; re-run "
                                "`python -m nanochat_fast.scripts.prepare_data --stage=tokens`")
            extra = []
            for i, conv in enumerate(extra_conversations):
                try:
                    extra.append(tokenizer.render_conversation(conv))
                except ValueError as e:
                    raise ValueError(f"extra_conversations[{i}]: {e}") from None
        super().__init__(dataset, split, device_batch_size, seq_len, rank, world_size, device, tokens_root,
                         buffer_docs, prefetch, backend, _extra=extra)


def _split(rows: torch.Tensor, with_mask: bool):
    """[B, T+1] packed rows -> contiguous (inputs, targets) [B, T]."""
    if not with_mask:
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    tokens = rows & ((1 << MASK_SHIFT) - 1)
    supervised = (rows >> MASK_SHIFT) != 0
    return tokens[:, :-1].contiguous(), torch.where(supervised[:, 1:], tokens[:, 1:], -1)


def _digest(extra) -> str:
    h = hashlib.sha256()
    for ids, mask in extra:
        h.update(np.asarray(ids, np.int64).tobytes() + b"|" + np.asarray(mask, np.uint8).tobytes() + b";")
    return h.hexdigest()[:16]
