"""
Prepared data on disk, under NANOCHAT_FAST_HOME (see paths.py):

    data/<dataset>/{train,val}/shard_00000.parquet   a "text" column (prose) or a "messages" column
                                                     (conversations: [{"role", "content"}, ...]), and
                                                     "source" (which source each document came from)
    data/<dataset>/manifest.json                     kind, shards, sources with licences, the options
                                                     that built it (written last: its presence = done)
    data/<dataset>/SOURCES.md                        the sources and licences, for people
    tokens/<dataset>/{train,val}/shard_00000.tokens.npy   uint16 (vocab <= 65536) or uint32: the
                                                     shard's documents back to back, each starting
                                                     with <|bos|>; memory-mapped by the loaders
                                 shard_00000.offsets.npy  int64[D+1]: document d is tokens[o[d]:o[d+1]]
                                 shard_00000.mask.npy     uint8, conversations only: 1 on supervised tokens
                                 shard_00000.json         counts, dtype, tokenizer fingerprint, source
                                                     shard; written last, so a shard without it is
                                                     unfinished and is redone

Names used by the package: `base` (prose for pretraining) and `chat` (conversations for
mid-training); `--input=DIR --name=NAME` makes any other. Every file is written under a temporary
name and renamed into place, so an interrupted run never leaves a partial shard looking complete,
and a re-run skips the shards that are complete.
"""
import json
import shutil
from pathlib import Path

import numpy as np

from . import paths
from .errors import UserError

TEXT, CHAT = "text", "chat"
SPLITS = ("train", "val")
FORMAT_VERSION = 1


def progress_bar(**kwargs):
    from tqdm.auto import tqdm
    return tqdm(dynamic_ncols=True, **kwargs)


def _write_json(path: Path, obj):
    paths.replace_atomically(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"))


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


# ---------------------------------------------------------------------------------------------
# documents


def check_conversation(conv, where: str) -> dict:
    """A conversation in the stored form ({"messages": [{"role", "content": str}]}, roles
    alternating user/assistant after an optional system message), or a UserError naming `where`."""
    from .tokenizer import Tokenizer
    try:
        Tokenizer.turns(conv)
        messages = [{"role": m["role"], "content": m["content"]} for m in conv["messages"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{where}: not a valid conversation ({e})") from None
    if not all(isinstance(m["content"], str) for m in messages):
        raise UserError(f"{where}: message contents must be strings")
    return {"messages": messages}


def doc_chars(doc) -> int:
    return len(doc) if isinstance(doc, str) else sum(len(m["content"]) for m in doc["messages"])


INPUT_SUFFIXES = (".txt", ".jsonl", ".parquet")


def input_files(folder: Path) -> list[Path]:
    """The files of an --input folder that are read, in the order they are read."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in INPUT_SUFFIXES)


def iter_input_folder(folder: Path, max_doc_chars: int):
    """Documents from every .txt / .jsonl / .parquet file under `folder` (sorted, recursive), as
    (doc, source) pairs where source is the file's relative path.

        .txt      the whole file is prose (cut at paragraph breaks into documents <= max_doc_chars)
        .jsonl    one JSON object per line: {"text": str} or {"messages": [...]}
        .parquet  a "text" column (e.g. FineWeb shards) or a "messages" column

    Empty files are skipped with a warning naming them. A file that cannot be read (bad UTF-8,
    a bad JSON line, a broken parquet, no text/messages column, an invalid conversation) stops
    the run with a UserError naming the file: silently dropping part of someone's data is worse
    than asking them to fix or remove one file.
    """
    from .sources import split_document

    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--input {folder} is not a directory")
    files = input_files(folder)
    if not files:
        raise UserError(f"--input {folder} has no .txt, .jsonl or .parquet files")
    for path in files:
        rel = str(path.relative_to(folder))
        if path.stat().st_size == 0:
            print(f"warning: skipping empty input file {path}", flush=True)
            continue
        try:
            if path.suffix == ".txt":
                docs = split_document(path.read_text(encoding="utf-8"), max_doc_chars)
                if not docs:
                    print(f"warning: skipping input file {path}: it holds only whitespace", flush=True)
                yield from ((d, rel) for d in docs)
            elif path.suffix == ".jsonl":
                with open(path, encoding="utf-8") as f:
                    for line_no, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise UserError(f"input file {path}, line {line_no}: not valid JSON ({e.msg})") from None
                        yield from _object_docs(obj, f"input file {path}, line {line_no}", rel, max_doc_chars)
            else:
                yield from _parquet_docs(path, rel, max_doc_chars)
        except UnicodeDecodeError as e:
            raise UserError(f"input file {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                            "fix or remove it") from None


def _parquet_docs(path: Path, rel: str, max_doc_chars: int):
    """The documents of one parquet file, read a batch of rows at a time (FineWeb shards are big)."""
    import pyarrow.parquet as pq
    try:
        reader = pq.ParquetFile(path)
        names = reader.schema_arrow.names
    except Exception as e:
        raise UserError(f"input file {path} is not a readable parquet file ({type(e).__name__}: {e}); "
                        "fix or remove it") from None
    column = "messages" if "messages" in names else "text"
    if column not in names:
        raise UserError(f"input file {path} has neither a 'text' nor a 'messages' column (columns: {', '.join(names)})")
    if reader.metadata.num_rows == 0:
        print(f"warning: skipping input file {path}: it has no rows", flush=True)
        return
    row = 0
    try:
        for batch in reader.iter_batches(batch_size=1024, columns=[column]):
            for value in batch.column(0).to_pylist():
                yield from _object_docs({column: value}, f"input file {path}, row {row}", rel, max_doc_chars)
                row += 1
    except UserError:
        raise
    except Exception as e:  # a damaged row group
        raise UserError(f"input file {path} is damaged after row {row} ({type(e).__name__}: {e}); "
                        "fix or remove it") from None


def _object_docs(obj, where, source, max_doc_chars):
    from .sources import split_document
    if isinstance(obj, dict) and "messages" in obj:
        yield check_conversation(obj, where), source
    elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
        yield from ((d, source) for d in split_document(obj["text"], max_doc_chars))
    elif isinstance(obj, dict) and obj.get("text") is None and "text" in obj:
        return  # a null text cell: nothing to learn from
    else:
        raise UserError(f"{where}: expected an object with a 'text' string or a 'messages' list")


# ---------------------------------------------------------------------------------------------
# parquet shards


class ShardWriter:
    """Accumulates documents and writes shard_NNNNN.parquet files of about shard_chars characters.
    With reuse=True a shard file that already exists is kept (an interrupted run is resumed: the
    document stream is deterministic, so that file holds exactly these documents)."""

    def __init__(self, directory: Path, kind: str, shard_chars: int, reuse: bool):
        self.directory, self.kind, self.shard_chars, self.reuse = Path(directory), kind, shard_chars, reuse
        self.directory.mkdir(parents=True, exist_ok=True)
        self.names, self.docs, self.sources, self.chars = [], [], [], 0
        self.n_docs = 0

    def add(self, doc, source: str):
        self.docs.append(doc)
        self.sources.append(source)
        self.chars += doc_chars(doc)
        self.n_docs += 1
        if self.chars >= self.shard_chars:
            self.flush()

    def flush(self):
        if not self.docs:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq
        name = shard_name(len(self.names)) + ".parquet"
        path = self.directory / name
        if not (self.reuse and path.is_file()):
            if self.kind == TEXT:
                column = pa.array(self.docs, type=pa.string())
            else:
                message = pa.struct([("role", pa.string()), ("content", pa.string())])
                column = pa.array([d["messages"] for d in self.docs], type=pa.list_(message))
            table = pa.table({"text" if self.kind == TEXT else "messages": column,
                              "source": pa.array(self.sources, type=pa.string())})
            paths.replace_atomically(path, lambda tmp: pq.write_table(table, tmp, row_group_size=1024))
        self.names.append(name)
        self.docs, self.sources, self.chars = [], [], 0


def write_dataset(name: str, kind: str, docs, *, config: dict, sources: list[dict], val_every: int,
                  shard_chars: int, overwrite: bool = False) -> dict:
    """Write data/<name>/ from (doc, source) pairs: document i goes to val when i % val_every == 0,
    else to train. `docs` is an iterable, or a function returning one (called only when there is
    work to do: nothing is downloaded for a dataset that is up to date). Returns the manifest.
    Skips the work when a manifest built with the same `config` exists (unless overwrite)."""
    root = paths.data_dir(name)
    manifest_path, started_path = root / "manifest.json", root / "building.json"
    config = dict(config, kind=kind, val_every=val_every, shard_chars=shard_chars, format=FORMAT_VERSION)
    if not overwrite and manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("config") == config:
            print(f"data/{name} is up to date ({manifest['docs']['train']} train + {manifest['docs']['val']} val "
                  "documents); --overwrite rebuilds it")
            return manifest
    reuse = not overwrite and started_path.is_file() and json.loads(started_path.read_text()) == config
    if not reuse:  # different options (or a forced rebuild): start from an empty directory
        manifest_path.unlink(missing_ok=True)
        for split in SPLITS:
            shutil.rmtree(root / split, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        _write_json(started_path, config)
    docs = docs() if callable(docs) else docs
    writers = {split: ShardWriter(root / split, kind, shard_chars, reuse) for split in SPLITS}
    per_source = {}
    total = len(docs) if hasattr(docs, "__len__") else None
    with progress_bar(desc=f"writing data/{name}", unit="doc", total=total) as bar:
        for i, (doc, source) in enumerate(docs):
            writers["val" if val_every > 0 and i % val_every == 0 else "train"].add(doc, source)
            counts = per_source.setdefault(source, {"docs": 0, "chars": 0})
            counts["docs"] += 1
            counts["chars"] += doc_chars(doc)
            bar.update()
    for w in writers.values():
        w.flush()
    if writers["train"].n_docs == 0 or writers["val"].n_docs == 0:
        raise UserError(f"data/{name}: {writers['train'].n_docs} train and {writers['val'].n_docs} val documents; "
                        f"both need at least one (give more text, or lower --val-every)")
    for source in sources:
        source.update(per_source.get(source["name"], {"docs": 0, "chars": 0}))
    manifest = {"name": name, "kind": kind, "config": config, "sources": sources,
                "shards": {split: writers[split].names for split in SPLITS},
                "docs": {split: writers[split].n_docs for split in SPLITS},
                "chars": sum(c["chars"] for c in per_source.values())}
    _write_sources_md(root / "SOURCES.md", manifest)
    _write_json(manifest_path, manifest)
    started_path.unlink(missing_ok=True)
    return manifest


def _write_sources_md(path: Path, manifest: dict):
    lines = [f"# data/{manifest['name']}: sources and licences", "",
             f"{manifest['docs']['train']:,} train and {manifest['docs']['val']:,} validation documents "
             f"({manifest['kind']}), {manifest['chars']:,} characters.", "",
             "| source | what | fetched as | licence | documents | characters |", "|---|---|---|---|---:|---:|"]
    for s in manifest["sources"]:
        lines.append(f"| {s['name']} | {s.get('about', '')} | {s.get('spec', '')} | {s.get('licence', '')} | "
                     f"{s.get('docs', 0):,} | {s.get('chars', 0):,} |")
    paths.replace_atomically(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))


def read_manifest(name: str) -> dict:
    path = paths.data_dir(name) / "manifest.json"
    if not path.is_file():
        raise UserError(f"{path} not found: prepare the data with `python -m nanochat_fast.scripts.prepare_data`")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, OSError) as e:
        raise UserError(f"{path} is unreadable ({e}); re-run `python -m nanochat_fast.scripts.prepare_data "
                        "--overwrite`") from None


def prepared_datasets() -> list[str]:
    root = paths.home() / "data"
    return sorted(p.parent.name for p in root.glob("*/manifest.json")) if root.is_dir() else []


def iter_texts(name: str, split: str = "train", doc_cap: int = 0):
    """The documents of a prepared dataset as strings (conversations: their contents joined)."""
    manifest = read_manifest(name)
    for shard in manifest["shards"][split]:
        path = paths.data_dir(name) / split / shard
        column = "text" if manifest["kind"] == TEXT else "messages"
        for value in _read_parquet(path, [column]).column(column).to_pylist():
            text = value if column == "text" else "\n".join(m["content"] for m in value)
            yield text[:doc_cap] if doc_cap > 0 else text


def _read_parquet(path: Path, columns):
    import pyarrow.parquet as pq
    try:
        return pq.read_table(path, columns=columns)
    except Exception as e:
        raise UserError(f"{path} is missing or unreadable ({type(e).__name__}: {e}); rebuild it with "
                        "`python -m nanochat_fast.scripts.prepare_data --overwrite`") from None


# ---------------------------------------------------------------------------------------------
# token shards


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def tokenize_dataset(name: str, tokenizer, *, overwrite: bool = False, num_threads: int = 8,
                     batch_docs: int = 4096) -> dict:
    """Pre-tokenize data/<name>/ into tokens/<name>/ (every document starts with <|bos|>;
    conversations also get their loss mask). Complete shards made by this tokenizer from the
    current text shards are skipped. Returns {"tokens": n, "docs": n, "skipped_shards": n} over all
    splits."""
    manifest = read_manifest(name)
    kind, out_root = manifest["kind"], paths.tokens_dir(name)
    fingerprint, bos = tokenizer.fingerprint, tokenizer.get_bos_token_id()
    dtype = token_dtype(tokenizer.get_vocab_size())
    jobs = [(split, shard) for split in SPLITS for shard in manifest["shards"][split]]
    totals = {"tokens": 0, "docs": 0, "skipped_shards": 0}
    with progress_bar(desc=f"tokenizing data/{name}", unit="shard", total=len(jobs)) as bar:
        for split, shard in jobs:
            source = paths.data_dir(name) / split / shard
            out_dir = out_root / split
            out_dir.mkdir(parents=True, exist_ok=True)
            stem = shard.removesuffix(".parquet")
            meta_path = out_dir / f"{stem}.json"
            stat = source.stat() if source.is_file() else None
            signature = {"source": f"{split}/{shard}", "source_bytes": stat and stat.st_size,
                         "source_mtime_ns": stat and stat.st_mtime_ns}
            meta = None if overwrite else _current_shard_meta(meta_path, fingerprint, signature)
            if meta is not None:
                totals["skipped_shards"] += 1
            else:
                meta = _tokenize_shard(source, kind, tokenizer, out_dir, stem, dtype, num_threads, batch_docs)
                meta.update(signature, tokenizer=fingerprint, bos_id=bos, vocab_size=tokenizer.get_vocab_size(),
                            kind=kind, format=FORMAT_VERSION)
                _write_json(meta_path, meta)  # last: the shard is complete
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
    """The token shard's metadata if it is complete and was made by this tokenizer from the
    current text shard, else None."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    files = [meta_path.with_name(meta_path.stem + ext) for ext in (".tokens.npy", ".offsets.npy")]
    current = (meta.get("tokenizer") == fingerprint and all(meta.get(k) == v for k, v in signature.items())
               and all(f.is_file() for f in files))
    return meta if current else None


def _tokenize_shard(source: Path, kind: str, tokenizer, out_dir: Path, stem: str, dtype, num_threads, batch_docs):
    column = "text" if kind == TEXT else "messages"
    values = _read_parquet(source, [column]).column(column).to_pylist()
    docs, masks = [], []
    bos = tokenizer.get_bos_token_id()
    for start in range(0, len(values), batch_docs):
        batch = values[start:start + batch_docs]
        if kind == TEXT:  # (numpy right away: a list of Python ints costs ~30 bytes a token)
            docs += [np.asarray(ids, dtype) for ids in tokenizer.encode(batch, prepend=bos, num_threads=num_threads)]
        else:
            for messages in batch:
                ids, mask = tokenizer.render_conversation({"messages": messages})
                docs.append(np.asarray(ids, dtype))
                masks.append(np.asarray(mask, np.uint8))
    return write_token_shard(out_dir, stem, docs, masks if kind == CHAT else None, dtype)


def write_token_shard(out_dir: Path, stem: str, docs, masks=None, dtype=np.uint16, meta: dict | None = None) -> dict:
    """Write one token shard's arrays (documents back to back + offsets [+ masks]); with `meta`,
    also its .json (counts + meta), last. Returns the counts."""
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    arrays = {"tokens": np.concatenate([np.asarray(d, dtype=dtype) for d in docs]) if docs else np.zeros(0, dtype),
              "offsets": offsets}
    if masks is not None:
        arrays["mask"] = (np.concatenate([np.asarray(m, dtype=np.uint8) for m in masks]) if masks
                          else np.zeros(0, np.uint8))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for what, array in arrays.items():
        def save(tmp, array=array):
            with open(tmp, "wb") as f:
                np.save(f, array)
        paths.replace_atomically(Path(out_dir) / f"{stem}.{what}.npy", save)
    counts = {"n_docs": len(docs), "n_tokens": int(offsets[-1]), "dtype": np.dtype(dtype).name}
    if meta is not None:
        _write_json(Path(out_dir) / f"{stem}.json", {**counts, **meta})
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
                return UserError(f"token shard {meta_path.with_suffix('')} is {why}; rebuild it with "
                                 "`python -m nanochat_fast.scripts.prepare_data --stage=tokens --overwrite`")
            try:
                meta = json.loads(meta_path.read_text())
                # mmap_mode="c": copy-on-write pages, so torch.from_numpy gets a writable array without a copy
                tokens = np.load(meta_path.with_name(meta_path.stem + ".tokens.npy"), mmap_mode="c")
                offsets = np.load(meta_path.with_name(meta_path.stem + ".offsets.npy"))
                mask = (np.load(meta_path.with_name(meta_path.stem + ".mask.npy"), mmap_mode="c")
                        if meta.get("kind") == CHAT else None)
            except Exception as e:
                raise fail(f"missing or unreadable ({type(e).__name__}: {e})") from None
            n_docs, n_tokens = meta.get("n_docs"), meta.get("n_tokens")
            if (tokens.shape != (n_tokens,) or offsets.shape != (n_docs + 1,) or offsets[0] != 0
                    or offsets[-1] != n_tokens or (mask is not None and mask.shape != tokens.shape)):
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
                raise UserError(f"the token shards in {self.directory} come from different tokenizers or kinds; "
                                "re-run `python -m nanochat_fast.scripts.prepare_data --stage=tokens`")
        self.kind, self.bos_id, self.fingerprint = first["kind"], first["bos_id"], first["tokenizer"]
        self.doc_starts = np.cumsum([0] + [m["n_docs"] for m in self.meta])  # global index of each shard's first doc
        self.n_docs = int(self.doc_starts[-1])
        self.n_tokens = sum(m["n_tokens"] for m in self.meta)

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, document within the shard) of global document `index`."""
        shard = int(np.searchsorted(self.doc_starts, index, side="right")) - 1
        return shard, index - int(self.doc_starts[shard])
