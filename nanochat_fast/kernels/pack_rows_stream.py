"""
The loader's whole step around the packer, in plain Python: RowStream is the twin of the compiled
nanochat_fast._C.RowStream (csrc/pack_rows_stream.h), with the same calls, batches and states,
and make_row_stream() picks one through pack_rows' backend (cpp -> compiled, else this twin).

A RowStream owns a document buffer (a RowPacker, pack_rows.py) and a cursor into a document
stream (`docs`: anything with n_docs, runs and add_to(packer, start, count), i.e.
data/packed_loaders.DocStream). next() packs the next global batch from the buffer and refills it; start()
runs next() ahead in a prefetch thread. The compiled twin does all of this without the GIL.
"""

import queue
import threading

import torch

from . import registry
from .pack_rows import OP, make_row_packer

# A document read more than WAIT_FACTOR buffers ago is due and starts a row. Without this, best-fit
# leaves documents of awkward lengths waiting for good; the price is some cropping, the more the
# smaller the factor (the figures: docs/measurements.md#packing-due-documents).
WAIT_FACTOR = 4


class RowStream:
    """The deterministic part: document buffer + cursor -> global batches; the plain-Python twin of
    the compiled RowStream (csrc/pack_rows_stream.h), with the same calls, batches and states.

    next(first_row, out_rows, pairs, pinned) packs the next global batch of `rows` rows of row_len
    tokens and returns (rows [first_row, first_row + out_rows) of it, state): as rows (pinned if
    asked) or, if `pairs`, as (inputs, targets) with targets -1 where a masked token is not
    supervised. The state after it: (next_pos, buffer ids, batches, tokens_used, tokens_cropped).
    start(depth, ...) runs next() ahead in a thread; get() takes its batches; stop() ends it."""

    def __init__(
        self,
        docs,
        rows: int,
        row_len: int,
        bos_id: int,
        buffer_docs: int,
        wait_factor: int = WAIT_FACTOR,
        mask_bit: int = -1,
        backend: str | None = "reference",
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
        """Top the buffer up to buffer_docs documents and at least 2 * rows * row_len tokens (the
        packer counts at most row_len of a document): enough for best-fit to fill every row, since
        filling a row consumes at most 2 * row_len of them (whole documents that fit, plus one
        that is cropped)."""
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
        # best-fit alone can leave a document of an awkward length waiting for good: one read more
        # than wait_factor buffers ago is due and starts a row (see csrc/pack_rows.h)
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
        k = 0
        while k < len(ids):  # re-add the buffered documents in buffer order, consecutive runs at once
            run = 1
            while k + run < len(ids) and ids[k + run] == ids[k] + run:
                run += 1
            self.docs.add_to(self.packer, ids[k], run)
            k += run
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
        if isinstance(item, _Failure):
            raise item.error
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


class _Failure:
    def __init__(self, error):
        self.error = error


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
