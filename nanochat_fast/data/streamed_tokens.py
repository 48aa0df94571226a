"""
Prose tokenized as a stream: a text shard read a few row groups at a time, each batch of documents
encoded on every core by worker processes and appended to the shard's .npy file. Resident memory is
set by the batch, not the shard (a published set's shard holds ~250M characters):
batch_chars_within(memory_mb, workers) sizes it. Why processes, and the costs behind the sizes:
docs/measurements.md#preparing-published-sets.
"""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..core import paths
from ..core.errors import UserError
from .documents import iter_column

DEFAULT_MEMORY_MB = 2048
BYTES_PER_CHAR = 10  # peak resident bytes per character of a batch in flight, parent and workers together
WORKER_MB = 120  # a worker's own resident memory (Python, numpy, tiktoken and the ranks)
MIN_BATCH_CHARS = 1 << 20
ROWS_PER_READ = 256  # rows read from parquet at a time; a batch gathers reads up to its characters


def batch_chars_within(memory_mb: int, workers: int = 0) -> int:
    """Characters per batch so that what tokenizing adds (the workers and the text in flight) stays
    within memory_mb; what the calling process already holds is not the tokenizer's to bound. A
    UserError when the workers alone take nearly all of it."""
    held = workers * WORKER_MB
    chars = int((memory_mb - held) * 2**20 / BYTES_PER_CHAR)
    if chars < MIN_BATCH_CHARS:
        need = held + MIN_BATCH_CHARS * BYTES_PER_CHAR / 2**20
        raise UserError(
            f"--max-memory-mb={memory_mb} leaves too little to tokenize in: its {workers} workers hold about "
            f"{held:.0f} MB before any text is read; give at least {need:.0f} (or fewer --num-threads)"
        )
    return chars


def text_batches(source: Path, batch_chars: int):
    """Lists of documents (null cells dropped) of about batch_chars characters, in file order."""
    batch, chars = [], 0
    for values in iter_column(source, "text", ROWS_PER_READ):
        for text in values:
            if text is not None:
                batch.append(text)
                chars += len(text)
        if chars >= batch_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


_ENCODER = None  # in a worker: the tokenizer's tiktoken encoding


def _start_worker(pattern: str, ranks: dict, specials: dict):
    global _ENCODER
    import tiktoken

    _ENCODER = tiktoken.Encoding(name="worker", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def _encode_part(texts):
    # allowed_special=set() and disallowed_special=(): special-token strings in the text are plain
    # text, exactly as encode_ordinary does (python_tests/data/test_download.py checks it)
    return [_ENCODER.encode_to_numpy(t, allowed_special=set(), disallowed_special=()) for t in texts]


@contextmanager
def encoder_pool(tokenizer, workers: int):
    """`workers` processes holding the tokenizer, spawned (none of the parent's threads or locks
    are forked into them)."""
    args = (tokenizer.pattern, tokenizer.enc._mergeable_ranks, tokenizer.special_tokens)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=args) as pool:
        yield pool


def encode_batch(texts, pool, parts: int) -> list:
    """uint32 token arrays of `texts`, in order, encoded in `parts` contiguous slices on the pool
    (a task per document would cost more than a short document's encoding)."""
    step = max(1, -(-len(texts) // parts))
    slices = pool.map(_encode_part, [texts[i : i + step] for i in range(0, len(texts), step)])
    return [ids for part in slices for ids in part]


class NpyAppender:
    """A 1-D .npy file written in pieces to a `.partial`: its header (numpy leaves room for the shape
    to grow) is rewritten with the final length on close, then the file is renamed."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.length = Path(path), np.dtype(dtype), 0
        self.tmp = self.path.with_name(f".{self.path.name}.partial")  # one name: a killed run's is overwritten
        self.file = open(self.tmp, "wb")
        self.header_bytes = self._write_header()

    def _write_header(self) -> int:
        start = self.file.tell()
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.length,)}
        np.lib.format.write_array_header_1_0(self.file, header)
        return self.file.tell() - start

    def append(self, array: np.ndarray):
        self.file.write(np.ascontiguousarray(array, dtype=self.dtype).tobytes())
        self.length += len(array)

    def close(self):
        self.file.seek(0)
        if self._write_header() != self.header_bytes:
            raise RuntimeError("the .npy header grew with the length")  # numpy pads for 21 digits: cannot happen
        self.file.close()
        self.tmp.replace(self.path)

    def discard(self):
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def tokenize_text_shard(source: Path, tokenizer, out_dir: Path, stem: str, dtype, pool, workers: int, batch_chars: int):
    """<stem>.{tokens,offsets}.npy from one text shard, a batch at a time on `pool` (encoder_pool):
    the files write_token_shard makes from the whole shard at once. Returns the counts."""
    bos = tokenizer.get_bos_token_id()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = NpyAppender(out_dir / f"{stem}.tokens.npy", dtype)
    lengths = []
    try:
        for texts in text_batches(source, batch_chars):
            arrays = encode_batch(texts, pool, parts=4 * workers)
            sizes = np.fromiter((len(a) + 1 for a in arrays), np.int64, len(arrays))
            ends = np.cumsum(sizes)
            out = np.empty(int(ends[-1]), dtype)
            for ids, end, size in zip(arrays, ends, sizes):
                out[end - size] = bos
                out[end - size + 1 : end] = ids
            tokens.append(out)
            lengths.append(sizes)
            del arrays, out  # (the next batch's memory, not twice this one's)
        offsets = np.zeros(sum(map(len, lengths)) + 1, np.int64)
        np.cumsum(np.concatenate(lengths) if lengths else np.zeros(0, np.int64), out=offsets[1:])
        tokens.close()
    except BaseException:
        tokens.discard()
        raise

    def save(tmp):
        with open(tmp, "wb") as f:
            np.save(f, offsets)

    paths.replace_atomically(out_dir / f"{stem}.offsets.npy", save)
    return {"n_docs": len(offsets) - 1, "n_tokens": int(offsets[-1]), "dtype": np.dtype(dtype).name}
