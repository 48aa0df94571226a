"""
pack_rows: best-fit packing of pre-tokenized documents into BOS-aligned training rows of T+1 tokens. Into
each row, in order, goes the largest unused document that fits the space left (ties: lowest index), again
and again; when none fits, the shortest unused one is cropped to fill the row. Backends: cpp
(csrc/pack_rows_cpu.cpp) and reference (the rule in plain Python): identical rows. Beside the op, the
plain-Python twins of the compiled RowPacker and RowStream: docs/measurements.md#token-packing.
"""

import itertools
import queue
import threading

import numpy as np
import torch

from . import registry

OP = "pack_rows"
# A document read more than WAIT_FACTOR buffers ago is due and starts a row. Without this, best-fit
# leaves documents of awkward lengths waiting for good; the price is some cropping, the more the
# smaller the factor (the figures: docs/measurements.md#packing-due-documents).
WAIT_FACTOR = 4


def _check(tokens, offsets, out, bos_id):
    for name, t in (("tokens", tokens), ("offsets", offsets), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor (pin `out` for fast copies to the GPU), got {t.device}")
    if tokens.dtype != torch.int32 or tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D int32 tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}")
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(
            f"offsets must be a 1-D int64 tensor of D+1 >= 1 entries, got {offsets.dtype} "
            f"of shape {tuple(offsets.shape)}"
        )
    if out.dtype != torch.int64 or out.dim() != 2:
        raise ValueError(f"out must be a 2-D int64 tensor [B, T+1], got {out.dtype} of shape {tuple(out.shape)}")
    if out.shape[1] < 2:
        raise ValueError(f"out must have T+1 >= 2 columns (T >= 1), got {out.shape[1]}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous: pack into a row-major [B, T+1] buffer, then slice")
    if not tokens.is_contiguous() or not offsets.is_contiguous():
        raise ValueError("tokens and offsets must be contiguous")
    if not isinstance(bos_id, int) or isinstance(bos_id, bool) or bos_id < 0:
        raise ValueError(f"bos_id must be an int >= 0, got {bos_id!r}")


def pack_rows(tokens: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, bos_id: int, *, backend=None):
    """Fill `out` [B, T+1] with best-fit BOS-aligned rows; returns (used: bool[D], n_tokens_used,
    n_tokens_cropped). `backend` forces one by name (default: NANOCHAT_FAST_KERNELS, else auto)."""
    _check(tokens, offsets, out, bos_id)
    return registry.select(OP, "cpu", backend).fn(tokens, offsets, out, bos_id)


def plan_reference(lengths: list[int], rows: int, row_len: int, row_starts=()):
    """The rule over document lengths, as plainly as possible: a list of (row, doc, pos, n), "the first
    n tokens of doc go to row at pos", and the tokens cropped; ValueError when the documents run out.
    Row r < len(row_starts) begins with document row_starts[r] (RowPacker's due documents)."""
    used = [False] * len(lengths)
    for d in row_starts:
        used[d] = True
    placements, cropped = [], 0
    for row in range(rows):
        pos = 0
        if row < len(row_starts):
            placements.append((row, row_starts[row], 0, lengths[row_starts[row]]))
            pos = lengths[row_starts[row]]
        while pos < row_len:
            space = row_len - pos
            unused = [d for d, u in enumerate(used) if not u]
            fits = [d for d in unused if lengths[d] <= space]
            if fits:  # the largest unused document that fits (first on ties)
                d = max(fits, key=lambda d: (lengths[d], -d))
                n = lengths[d]
            elif unused:  # none fits: the shortest unused one (first on ties), cropped to fill the row
                d = min(unused, key=lambda d: (lengths[d], d))
                n = space
                cropped += lengths[d] - space
            else:
                raise ValueError(
                    f"pack_rows: the {len(lengths)} documents ({sum(lengths)} tokens) ran out "
                    f"after {row} of {rows} rows of {row_len} tokens; pass more documents"
                )
            used[d] = True
            placements.append((row, d, pos, n))
            pos += n
    return placements, cropped


@registry.register(OP, "reference")
def pack_rows_reference(tokens, offsets, out, bos_id):
    toks, offs = tokens.tolist(), offsets.tolist()
    if offs[0] != 0 or offs[-1] != len(toks):
        raise ValueError(
            f"pack_rows: offsets must start at 0 and end at tokens.numel() = {len(toks)}, got {offs[0]} and {offs[-1]}"
        )
    lengths = [b - a for a, b in zip(offs, offs[1:])]
    for d, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"pack_rows: document {d} is empty (offsets must increase strictly)")
        if toks[offs[d]] != bos_id:
            raise ValueError(
                f"pack_rows: document {d} starts with token {toks[offs[d]]}, not bos_id={bos_id} "
                "(documents must begin with <|bos|>)"
            )
    rows, row_len = out.shape
    placements, cropped = plan_reference(lengths, rows, row_len)
    flat = [0] * (rows * row_len)
    used = [False] * len(lengths)
    for row, d, pos, n in placements:
        flat[row * row_len + pos : row * row_len + pos + n] = toks[offs[d] : offs[d] + n]
        used[d] = True
    out.copy_(torch.tensor(flat, dtype=torch.int64).view(rows, row_len))
    return torch.tensor(used, dtype=torch.bool), rows * row_len, cropped


# packing runs on the host whatever the training device (CUDA gets the rows through a pinned buffer)
@registry.register(OP, "cpp", why_not=lambda device_type: registry.cpp_why_not(OP, "cpu"))
def pack_rows_cpp(tokens, offsets, out, bos_id):
    return torch.ops.nanochat_fast.pack_rows(tokens, offsets, out, bos_id)


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::pack_rows")
    def _(tokens, offsets, out, bos_id):
        ctx = torch.library.get_ctx()  # the token counts depend on the data
        return offsets.new_empty(offsets.shape[0] - 1, dtype=torch.bool), ctx.new_dynamic_size(), ctx.new_dynamic_size()


# -- the plain-Python twins of the compiled RowPacker and RowStream ------------------------------------


class RowPackerReference:
    """The compiled RowPacker's twin (csrc/pack_rows.h, which says why): a document buffer across calls,
    in arrival order, of at most row_len tokens a document (the cut-off tails count as cropped). add()
    appends documents with ids; pack() plans `total_rows` rows over the buffer (ties: the oldest), writes
    rows [first_row, first_row + out.shape[0]), drops the documents used and returns (documents used,
    tokens placed, tokens cropped)."""

    def __init__(self, row_len: int, bos_id: int):
        if row_len < 2:
            raise ValueError(f"row_len (T+1) must be >= 2, got {row_len}")
        if bos_id < 0:
            raise ValueError(f"bos_id must be >= 0, got {bos_id}")
        self.row_len, self.bos_id = row_len, bos_id
        self.clear()

    def clear(self):
        self._docs: list[tuple[int, np.ndarray, int]] = []  # (id, the tokens kept, full length) per document

    @property
    def num_docs(self) -> int:
        return len(self._docs)

    @property
    def mass(self) -> int:
        return sum(len(kept) for _, kept, _ in self._docs)

    def ids(self) -> torch.Tensor:
        return torch.tensor([i for i, _, _ in self._docs], dtype=torch.int64)

    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(kept) for _, kept, _ in self._docs], dtype=torch.int64)

    def add(self, tokens: torch.Tensor, offsets: torch.Tensor, first_id: int, mask=None, mask_bit: int = -1):
        toks, offs = tokens.numpy(), offsets.tolist()
        if any(b <= a for a, b in zip(offs, offs[1:])) or (offs and (offs[0] < 0 or offs[-1] > len(toks))):
            raise ValueError(f"RowPacker.add: offsets must increase strictly and stay within the {len(toks)} tokens")
        for j, a in enumerate(offs[:-1]):
            if int(toks[a]) != self.bos_id:
                raise ValueError(
                    f"RowPacker.add: document {first_id + j} starts with token {int(toks[a])}, not bos_id={self.bos_id}"
                )
        if mask is not None:
            if not 0 <= mask_bit < 31:
                raise ValueError(f"RowPacker.add: mask_bit must be in [0, 31) with a mask, got {mask_bit}")
            toks = toks.astype(np.int32) | (mask.numpy().astype(np.int32) << mask_bit)
        for j, (a, b) in enumerate(zip(offs, offs[1:])):
            self._docs.append((first_id + j, np.array(toks[a : min(b, a + self.row_len)], dtype=np.int32), b - a))

    def pack(self, out, total_rows: int, first_row=0, due_before=-(1 << 63), targets=None, mask_bit=-1):
        """Documents with an id below `due_before` are due: the oldest (at most one per row) start the
        rows, in id order, before best-fit fills the rest (csrc/pack_rows.h). Given `targets`, the rows
        are written as pairs, out = row[:-1] and targets = row[1:]; with mask_bit >= 0 a token's bit
        mask_bit is its "supervised" flag, dropped from the token, and an unflagged target is -1."""
        width = self.row_len - (targets is not None)
        if out.dtype != torch.int64 or out.dim() != 2 or out.shape[1] != width or not out.is_contiguous():
            raise ValueError(f"RowPacker.pack: out must be a contiguous int64 CPU tensor [rows, {width}]")
        if targets is not None and (
            targets.dtype != torch.int64 or targets.shape != out.shape or not targets.is_contiguous()
        ):
            raise ValueError("RowPacker.pack: targets must be a contiguous int64 CPU tensor shaped like out")
        if first_row < 0 or first_row + out.shape[0] > total_rows:
            raise ValueError(
                f"RowPacker.pack: rows [{first_row}, {first_row + out.shape[0]}) are not within total_rows={total_rows}"
            )
        due = sorted((i, d) for d, (i, _, _) in enumerate(self._docs) if i < due_before)[:total_rows]
        try:
            placements, cropped = plan_reference(
                [len(kept) for _, kept, _ in self._docs], total_rows, self.row_len, row_starts=[d for _, d in due]
            )
        except ValueError as e:
            raise ValueError(str(e).replace("pack_rows:", "RowPacker.pack:").replace("pass more", "add more")) from None
        rows = torch.empty(out.shape[0], self.row_len, dtype=torch.int64) if targets is not None else out
        for row, d, pos, n in placements:
            if first_row <= row < first_row + out.shape[0]:
                rows[row - first_row, pos : pos + n] = torch.from_numpy(self._docs[d][1][:n])
        if targets is not None:
            tokens = rows & ~(1 << mask_bit) if mask_bit >= 0 else rows
            out.copy_(tokens[:, :-1])
            supervised = (rows[:, 1:] >> mask_bit) & 1 if mask_bit >= 0 else torch.ones_like(targets)
            targets.copy_(torch.where(supervised.bool(), tokens[:, 1:], -1))
        used = {d for _, d, _, _ in placements}
        cropped += sum(full - len(kept) for d, (_, kept, full) in enumerate(self._docs) if d in used)
        self._docs = [doc for d, doc in enumerate(self._docs) if d not in used]
        return len(used), total_rows * self.row_len, cropped


def make_row_packer(row_len: int, bos_id: int, backend: str | None = None):
    """The compiled RowPacker where pack_rows' selected backend is `cpp`, else RowPackerReference."""
    if registry.select(OP, "cpu", backend).name == "cpp":
        return registry.extension().RowPacker(row_len, bos_id)
    return RowPackerReference(row_len, bos_id)


class RowStream:
    """The loader's step, the plain-Python twin of the compiled RowStream (csrc/pack_rows_stream.h), with
    the same calls, batches and states: a document buffer (a RowPacker) and a cursor into `docs` (n_docs,
    runs, add_to(packer, start, count): data/packed_loaders.DocStream). next(first_row, out_rows, pairs,
    pinned) packs the next global batch and returns (its rows [first_row, first_row + out_rows), as rows
    or (inputs, targets) pairs; state), the state (next_pos, buffer ids, batches, tokens_used,
    tokens_cropped). start(depth, ...) runs next() ahead in a thread, get() takes, stop() ends it."""

    def __init__(
        self, docs, rows, row_len, bos_id, buffer_docs, wait_factor=WAIT_FACTOR, mask_bit=-1, backend="reference"
    ):
        self.docs, self.rows, self.row_len, self.buffer_docs = docs, rows, row_len, buffer_docs
        self.wait_factor, self.mask_bit = wait_factor, mask_bit
        self.packer = make_row_packer(row_len, bos_id, backend)
        self.next_pos, self.batches, self.tokens_used, self.tokens_cropped = 0, 0, 0, 0
        self._producer = None
        self.refill()

    @property
    def n_docs(self) -> int:
        return self.docs.n_docs

    def _add(self, count):
        self.docs.add_to(self.packer, self.next_pos, count)
        self.next_pos += count

    def refill(self):
        """Top the buffer up to buffer_docs documents and 2 * rows * row_len tokens: enough for best-fit
        to fill every row, a row taking at most 2 * row_len (documents that fit, plus one cropped)."""
        self._add(max(self.buffer_docs - self.packer.num_docs, 0))
        target = 2 * self.rows * self.row_len
        while self.packer.mass < target:  # as many documents as the buffer's average suggests
            average = max(1, self.packer.mass // max(1, self.packer.num_docs))
            self._add(-(-(target - self.packer.mass) // average))

    def next(self, first_row: int, out_rows: int, pairs: bool, pinned: bool = False):
        if self.prefetching:  # the prefetch thread owns the packer
            raise RuntimeError("RowStream.next: not while prefetching (stop() first)")
        return self._next(first_row, out_rows, pairs, pinned)

    def _next(self, first_row: int, out_rows: int, pairs: bool, pinned: bool):
        if not (first_row >= 0 and out_rows >= 0 and first_row + out_rows <= self.rows):
            raise ValueError(
                f"RowStream.next: rows [{first_row}, {first_row + out_rows}) are not within the batch of {self.rows}"
            )
        due_before = self.next_pos - self.wait_factor * self.packer.num_docs
        if pairs:
            data = tuple(torch.empty((out_rows, self.row_len - 1), dtype=torch.int64) for _ in range(2))
            _, used, cropped = self.packer.pack(data[0], self.rows, first_row, due_before, data[1], self.mask_bit)
        else:
            data = torch.empty((out_rows, self.row_len), dtype=torch.int64, pin_memory=pinned)
            _, used, cropped = self.packer.pack(data, self.rows, first_row, due_before)
        self.batches += 1
        self.tokens_used += used
        self.tokens_cropped += cropped
        self.refill()
        return data, self.state()

    def state(self):
        return self.next_pos, self.packer.ids(), self.batches, self.tokens_used, self.tokens_cropped

    def restore(self, next_pos: int, buffer, batches: int, tokens_used: int, tokens_cropped: int):
        ids = [int(i) for i in buffer]
        if any(not 0 <= i < next_pos for i in ids):
            raise ValueError(f"RowStream.restore: a buffered position is not in [0, next_pos={next_pos})")
        self.packer.clear()
        # re-add the buffered documents in buffer order, each run of consecutive positions at once
        for _, run in itertools.groupby(enumerate(ids), lambda k_id: k_id[1] - k_id[0]):
            run = [i for _, i in run]
            self.docs.add_to(self.packer, run[0], len(run))
        self.next_pos, self.batches = int(next_pos), int(batches)
        self.tokens_used, self.tokens_cropped = int(tokens_used), int(tokens_cropped)
        self.refill()

    def start(self, depth: int, first_row: int, out_rows: int, pairs: bool, pinned: bool = False):
        if self._producer is not None:
            raise RuntimeError("RowStream.start: already prefetching")
        self._producer = _Producer(lambda: self._next(first_row, out_rows, pairs, pinned), depth)

    def get(self):
        if self._producer is None:
            raise RuntimeError("RowStream.get: not prefetching (start() first)")
        item = self._producer.get()
        if isinstance(item, BaseException):  # the prefetch thread's failure
            raise item
        return item

    def stop(self):
        if self._producer is not None:
            self._producer.stop()
            self._producer = None

    @property
    def prefetching(self) -> bool:
        return self._producer is not None


def make_row_stream(
    docs, rows: int, row_len: int, bos_id: int, buffer_docs: int, mask_bit: int = -1, backend: str | None = None
):
    """The compiled RowStream where pack_rows' selected backend is `cpp`, else the Python twin."""
    if registry.select(OP, "cpu", backend).name == "cpp":
        return registry.extension().RowStream(docs.runs, rows, row_len, bos_id, buffer_docs, WAIT_FACTOR, mask_bit)
    return RowStream(docs, rows, row_len, bos_id, buffer_docs, WAIT_FACTOR, mask_bit, backend="reference")


class _Producer:
    """The Python twin's prefetch thread: runs make_batch() ahead into a bounded queue. It holds no
    reference to the loader, so a loader dropped without close() is still collected (and stops it)."""

    def __init__(self, make_batch, depth: int):
        self.make_batch, self.queue, self.halt = make_batch, queue.Queue(maxsize=depth), threading.Event()
        self.thread = threading.Thread(target=self._run, name="nanochat_fast-prefetch", daemon=True)
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
                self._put(self.make_batch())
        except BaseException as e:  # handed to the consumer, raised by get()
            self._put(e)

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
