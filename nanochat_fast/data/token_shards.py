"""
Token shards: a prepared dataset tokenized once, as arrays the loaders memory-map (the layout under
tokens/<dataset>/: docs/measurements.md#prepared-data-on-disk). Each shard's .json is written last,
so a shard without it is unfinished and is redone; a shard made with another tokenizer is redone too.
"""

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from ..core import paths
from ..core.cli import positive_int
from ..core.errors import UserError
from ..core.progress import progress_bar
from . import streamed_tokens
from .documents import CHAT, FORMAT_VERSION, SPLITS, TEXT, read_dataset_manifest, read_parquet
from .streamed_tokens import DEFAULT_MEMORY_MB


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


def tokenize_dataset(
    name: str, tokenizer, *, overwrite: bool = False, num_threads: int = 8, memory_mb: int = DEFAULT_MEMORY_MB
) -> dict:
    """Pre-tokenize data/<name>/ into tokens/<name>/ (each document starts with <|bos|>; conversations
    get their loss mask), skipping complete shards of this tokenizer and the current text. Prose is
    streamed on `num_threads` workers within `memory_mb`. Returns {"tokens", "docs", "skipped_shards"}."""
    manifest = read_dataset_manifest(name)
    kind, out_root = manifest["kind"], paths.tokens_dir(name)
    batch_chars = streamed_tokens.batch_chars_within(memory_mb, num_threads) if kind == TEXT else 0
    pool = None
    fingerprint, bos = tokenizer.fingerprint, tokenizer.get_bos_token_id()
    dtype = token_dtype(tokenizer.get_vocab_size())
    jobs = [(split, shard) for split in SPLITS for shard in manifest["shards"][split]]
    totals = {"tokens": 0, "docs": 0, "skipped_shards": 0}
    with (
        contextlib.ExitStack() as stack,
        progress_bar(desc=f"tokenizing data/{name}", unit="shard", total=len(jobs)) as bar,
    ):
        for split, shard in jobs:
            source = paths.data_dir(name) / split / shard
            out_dir = out_root / split
            out_dir.mkdir(parents=True, exist_ok=True)
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
                        pool = stack.enter_context(streamed_tokens.encoder_pool(tokenizer, num_threads))
                    meta = streamed_tokens.tokenize_text_shard(
                        source, tokenizer, out_dir, stem, dtype, pool, num_threads, batch_chars
                    )
                else:
                    meta = _tokenize_chat_shard(source, tokenizer, out_dir, stem, dtype)
                meta.update(
                    signature,
                    tokenizer=fingerprint,
                    bos_id=bos,
                    vocab_size=tokenizer.get_vocab_size(),
                    kind=kind,
                    format=FORMAT_VERSION,
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
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    files = [meta_path.with_name(meta_path.stem + ext) for ext in (".tokens.npy", ".offsets.npy")]
    current = (
        meta.get("tokenizer") == fingerprint
        and all(meta.get(k) == v for k, v in signature.items())
        and all(f.is_file() for f in files)
    )
    return meta if current else None


def _tokenize_chat_shard(source: Path, tokenizer, out_dir: Path, stem: str, dtype):
    """Conversations (small sets: mid-training's and SFT's), rendered one by one with their masks."""
    docs, masks = [], []
    for messages in read_parquet(source, ["messages"]).column("messages").to_pylist():
        ids, mask = tokenizer.render_conversation({"messages": messages})
        docs.append(np.asarray(ids, dtype))  # (numpy right away: a list of Python ints costs ~30 bytes a token)
        masks.append(np.asarray(mask, np.uint8))
    return write_token_shard(out_dir, stem, docs, masks, dtype)


def write_token_shard(out_dir: Path, stem: str, docs, masks=None, dtype=np.uint16, meta: dict | None = None) -> dict:
    """One token shard's arrays (documents back to back, offsets, masks if any); with `meta`, its
    .json (counts and meta) last. Returns the counts."""
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    arrays = {
        "tokens": np.concatenate([np.asarray(d, dtype=dtype) for d in docs]) if docs else np.zeros(0, dtype),
        "offsets": offsets,
    }
    if masks is not None:
        arrays["mask"] = (
            np.concatenate([np.asarray(m, dtype=np.uint8) for m in masks]) if masks else np.zeros(0, np.uint8)
        )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for what, array in arrays.items():

        def save(tmp, array=array):
            with open(tmp, "wb") as f:
                np.save(f, array)

        paths.replace_atomically(Path(out_dir) / f"{stem}.{what}.npy", save)
    counts = {"n_docs": len(docs), "n_tokens": int(offsets[-1]), "dtype": np.dtype(dtype).name}
    if meta is not None:
        paths.write_json(Path(out_dir) / f"{stem}.json", {**counts, **meta})
    return counts


class TokenShards:
    """The token shards of one split, memory-mapped: documents addressed by a global index."""

    def __init__(self, dataset: str, split: str, tokens_root=None):
        root = Path(tokens_root) if tokens_root is not None else paths.home() / "tokens"
        self.directory = root / dataset / split
        prepare = "`python -m nanochat_fast.scripts.prepare_data` (then `python -m nanochat_fast.scripts.tok_train`)"
        metas = sorted(self.directory.glob("shard_*.json"))
        if not metas:
            raise UserError(f"no token shards in {self.directory}: prepare them with {prepare}")
        self.tokens, self.offsets, self.masks, self.meta = [], [], [], []
        for meta_path in metas:

            def fail(why, meta_path=meta_path):
                return UserError(
                    f"token shard {meta_path.with_suffix('')} is {why}; rebuild it with "
                    "`python -m nanochat_fast.scripts.prepare_data --stage=tokens --overwrite`"
                )

            try:
                meta = json.loads(meta_path.read_text())
                # mmap_mode="c": copy-on-write pages, so torch.from_numpy gets a writable array without a copy
                tokens = np.load(meta_path.with_name(meta_path.stem + ".tokens.npy"), mmap_mode="c")
                offsets = np.load(meta_path.with_name(meta_path.stem + ".offsets.npy"))
                mask = (
                    np.load(meta_path.with_name(meta_path.stem + ".mask.npy"), mmap_mode="c")
                    if meta.get("kind") == CHAT
                    else None
                )
            except Exception as e:
                raise fail(f"missing or unreadable ({type(e).__name__}: {e})") from None
            n_docs, n_tokens = meta.get("n_docs"), meta.get("n_tokens")
            if (
                tokens.shape != (n_tokens,)
                or offsets.shape != (n_docs + 1,)
                or offsets[0] != 0
                or offsets[-1] != n_tokens
                or (mask is not None and mask.shape != tokens.shape)
            ):
                raise fail("truncated or inconsistent with its .json")
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
