"""
Token shards: a prepared dataset tokenized once, as arrays the loaders memory-map (the layout under
tokens/<dataset>/: docs/measurements.md#prepared-data-on-disk). Each shard's .json is written last,
so a shard without it is unfinished and is redone; a shard made with another tokenizer is redone too.
Prose is streamed: a few row groups at a time, each batch encoded on every core by worker processes,
memory set by the batch, not the shard: docs/measurements.md#preparing-published-sets.
"""

import contextlib
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from ..core import paths
from ..core.cli import positive_int
from ..core.errors import UserError
from ..core.progress import progress_bar
from .documents import CHAT, FORMAT_VERSION, SPLITS, TEXT, iter_column, read_dataset_manifest

DEFAULT_MEMORY_MB = 2048
BYTES_PER_CHAR = 10  # peak resident bytes per character of a batch in flight, parent and workers together
WORKER_MB = 120  # a worker's own resident memory (Python, numpy, tiktoken and the ranks)
MIN_BATCH_CHARS = 1 << 20
ROWS_PER_READ = 256  # rows read from parquet at a time; a batch gathers reads up to its characters


def add_tokenizing_flags(parser):
    """--num-threads and --max-memory-mb: how prepare_data and tok_train tokenize text shards."""
    parser.add_argument("--num-threads", type=positive_int, default=os.cpu_count() or 1, help="tokenizer threads")
    parser.add_argument(
        "--max-memory-mb",
        type=positive_int,
        default=DEFAULT_MEMORY_MB,
        help="tokenizing: memory its workers and the text in flight may add to this process (read a batch at a time)",
    )


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def tokenize_dataset(name, tokenizer, *, overwrite=False, num_threads=8, memory_mb=DEFAULT_MEMORY_MB) -> dict:
    """Pre-tokenize data/<name>/ into tokens/<name>/ (each document starts with <|bos|>; conversations get
    their loss mask), skipping complete shards of this tokenizer and the current text (prose streamed on
    `num_threads` workers within `memory_mb`). Returns {"tokens", "docs", "skipped_shards"}."""
    manifest = read_dataset_manifest(name)
    kind, out_root = manifest["kind"], paths.tokens_dir(name)
    batch_chars = batch_chars_within(memory_mb, num_threads) if kind == TEXT else 0
    pool = None
    fingerprint, bos, vocab = tokenizer.fingerprint, tokenizer.get_bos_token_id(), tokenizer.get_vocab_size()
    dtype = token_dtype(vocab)
    jobs = [(split, shard) for split in SPLITS for shard in manifest["shards"][split]]
    totals = {"tokens": 0, "docs": 0, "skipped_shards": 0}
    with (
        contextlib.ExitStack() as stack,
        progress_bar(desc=f"tokenizing data/{name}", unit="shard", total=len(jobs)) as bar,
    ):
        for split, shard in jobs:
            source = paths.data_dir(name) / split / shard
            out_dir = out_root / split
            stem = shard.removesuffix(".parquet")
            meta_path = out_dir / f"{stem}.json"
            stat = source.stat() if source.is_file() else None
            signature = {
                "source": f"{split}/{shard}",
                "source_bytes": stat and stat.st_size,
                "source_mtime_ns": stat and stat.st_mtime_ns,
            }
            meta = None if overwrite else _current_shard_meta(meta_path, fingerprint, signature)
            if meta is not None:
                totals["skipped_shards"] += 1
            else:
                if kind == TEXT:
                    if pool is None:  # started for the first shard to do: none when all are done
                        pool = stack.enter_context(encoder_pool(tokenizer, num_threads))
                    meta = tokenize_text_shard(source, tokenizer, out_dir, stem, dtype, pool, num_threads, batch_chars)
                else:
                    meta = _tokenize_chat_shard(source, tokenizer, out_dir, stem, dtype)
                meta.update(
                    signature, tokenizer=fingerprint, bos_id=bos, vocab_size=vocab, kind=kind, format=FORMAT_VERSION
                )
                paths.write_json(meta_path, meta)  # last: the shard is complete
            totals["tokens"] += meta["n_tokens"]
            totals["docs"] += meta["n_docs"]
            bar.set_postfix(tokens=f"{totals['tokens']:,}")
            bar.update()
    # token shards of text shards that no longer exist (the data was rebuilt with other options)
    for split in SPLITS:
        keep = {s.removesuffix(".parquet") for s in manifest["shards"][split]}
        for path in (out_root / split).glob("shard_*"):
            if path.name.split(".")[0] not in keep:
                path.unlink()
    return totals


def _current_shard_meta(meta_path: Path, fingerprint: str, signature: dict) -> dict | None:
    """The token shard's metadata if complete and made by this tokenizer from the current text."""
    meta = paths.read_json_or_none(meta_path) or {}
    files = [meta_path.with_name(meta_path.stem + ext) for ext in (".tokens.npy", ".offsets.npy")]
    current = meta.get("tokenizer") == fingerprint and all(meta.get(k) == v for k, v in signature.items())
    return meta if current and all(f.is_file() for f in files) else None


def _tokenize_chat_shard(source: Path, tokenizer, out_dir: Path, stem: str, dtype):
    """Conversations (small sets: mid-training's and SFT's), rendered one by one with their masks."""
    docs, masks = [], []
    for values in iter_column(source, "messages"):
        for messages in values:
            ids, mask = tokenizer.render_conversation({"messages": messages})
            docs.append(np.asarray(ids, dtype))  # (numpy right away: a list of Python ints costs ~30 bytes a token)
            masks.append(np.asarray(mask, np.uint8))
    return write_token_shard(out_dir, stem, docs, masks, dtype)


def write_token_shard(out_dir: Path, stem: str, docs, masks=None, dtype=np.uint16, meta: dict | None = None) -> dict:
    """One token shard's arrays (documents back to back, offsets, masks if any); with `meta`, its
    .json (counts and meta) last. Returns the counts."""

    def joined(parts, part_dtype):  # (an empty shard too)
        return np.concatenate([np.zeros(0, part_dtype)] + [np.asarray(p, part_dtype) for p in parts])

    offsets = np.cumsum([0] + [len(d) for d in docs], dtype=np.int64)
    arrays = {"tokens": joined(docs, dtype), "offsets": offsets}
    if masks is not None:
        arrays["mask"] = joined(masks, np.uint8)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for what, array in arrays.items():
        paths.write_durably(Path(out_dir) / f"{stem}.{what}.npy", lambda f: np.save(f, array))
    counts = {"n_docs": len(docs), "n_tokens": int(offsets[-1]), "dtype": np.dtype(dtype).name}
    if meta is not None:
        paths.write_json(Path(out_dir) / f"{stem}.json", {**counts, **meta})
    return counts


def batch_chars_within(memory_mb: int, workers: int = 0) -> int:
    """Characters per batch so that what tokenizing adds (the workers and the text in flight) stays within
    memory_mb (not what the caller already holds); a UserError when the workers alone take nearly all."""
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


def encoder_pool(tokenizer, workers: int) -> ProcessPoolExecutor:
    """`workers` processes holding the tokenizer, spawned (none of the parent's threads or locks are forked)."""
    args = (tokenizer.pattern, tokenizer.enc._mergeable_ranks, tokenizer.special_tokens)
    context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=args)


class NpyAppender:
    """A 1-D .npy file written in pieces to a `.partial`: its header (numpy leaves room for the shape
    to grow) is rewritten with the final length on close, then the file is renamed."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.length = Path(path), np.dtype(dtype), 0
        self.tmp = self.path.with_name(f".{self.path.name}.partial")  # one name: a killed run's is overwritten
        self.file = open(self.tmp, "wb")
        self.header_bytes = self._write_header()

    def _write_header(self) -> int:  # at the file's start; its size
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.length,)}
        np.lib.format.write_array_header_1_0(self.file, header)
        return self.file.tell()

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
            # in 4 * workers contiguous slices: a task per document costs more than a short one's encoding
            step = max(1, -(-len(texts) // (4 * workers)))
            slices = pool.map(_encode_part, [texts[i : i + step] for i in range(0, len(texts), step)])
            arrays = [ids for part in slices for ids in part]
            sizes = np.fromiter((len(a) + 1 for a in arrays), np.int64, len(arrays))
            ends = np.cumsum(sizes)
            out = np.empty(int(ends[-1]), dtype)
            for ids, end, size in zip(arrays, ends, sizes):
                out[end - size] = bos
                out[end - size + 1 : end] = ids
            tokens.append(out)
            lengths.append(sizes)
            del arrays, out  # (the next batch's memory, not twice this one's)
        tokens.close()
    except BaseException:
        tokens.discard()
        raise
    offsets = np.concatenate([np.zeros(1, np.int64), *lengths]).cumsum()
    paths.write_durably(out_dir / f"{stem}.offsets.npy", lambda f: np.save(f, offsets))
    return {"n_docs": len(offsets) - 1, "n_tokens": int(offsets[-1]), "dtype": np.dtype(dtype).name}


class TokenShards:
    """The token shards of one split, memory-mapped: documents addressed by a global index."""

    def __init__(self, dataset: str, split: str, tokens_root=None):
        root = Path(tokens_root) if tokens_root is not None else paths.home() / "tokens"
        self.directory = root / dataset / split
        prepare = "`python -m nanochat_fast.scripts.prepare_data` (then `python -m nanochat_fast.scripts.tok_train`)"
        metas = sorted(self.directory.glob("shard_*.json"))
        if not metas:
            raise UserError(f"no token shards in {self.directory}: prepare them with {prepare}")
        rebuild = "rebuild it with `python -m nanochat_fast.scripts.prepare_data --stage=tokens --overwrite`"
        self.tokens, self.offsets, self.masks, self.meta = [], [], [], []
        for meta_path in metas:
            stem = meta_path.with_suffix("")
            try:
                meta = json.loads(meta_path.read_text())
                # mmap_mode="c": copy-on-write pages, so torch.from_numpy gets a writable array without a copy
                tokens = np.load(f"{stem}.tokens.npy", mmap_mode="c")
                offsets = np.load(f"{stem}.offsets.npy")
                mask = np.load(f"{stem}.mask.npy", mmap_mode="c") if meta.get("kind") == CHAT else None
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                raise UserError(f"token shard {stem} is missing or unreadable ({why}); {rebuild}") from None
            n_docs, n_tokens = meta.get("n_docs"), meta.get("n_tokens")
            if (
                tokens.shape != (n_tokens,)
                or offsets.shape != (n_docs + 1,)
                or offsets[0] != 0
                or offsets[-1] != n_tokens
                or (mask is not None and mask.shape != tokens.shape)
            ):
                raise UserError(f"token shard {stem} is truncated or inconsistent with its .json; {rebuild}")
            if n_docs == 0:
                continue
            self.tokens.append(tokens)
            self.offsets.append(offsets)
            self.masks.append(mask)
            self.meta.append(meta)
        if not self.meta:
            raise UserError(f"the token shards in {self.directory} hold no documents: prepare them with {prepare}")
        first = self.meta[0]
        for meta in self.meta[1:]:
            if any(meta[key] != first[key] for key in ("tokenizer", "bos_id", "kind")):
                raise UserError(
                    f"the token shards in {self.directory} come from different tokenizers or kinds; "
                    "re-run `python -m nanochat_fast.scripts.prepare_data --stage=tokens`"
                )
        self.kind, self.bos_id, self.fingerprint = first["kind"], first["bos_id"], first["tokenizer"]
        self.doc_starts = np.cumsum([0] + [m["n_docs"] for m in self.meta])  # global index of each shard's first doc
        self.n_docs = int(self.doc_starts[-1])
        self.n_tokens = sum(m["n_tokens"] for m in self.meta)

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, document within the shard) of global document `index`."""
        shard = int(np.searchsorted(self.doc_starts, index, side="right")) - 1
        return shard, index - int(self.doc_starts[shard])
