"""
Prepared documents on disk (NANOCHAT_FAST_HOME/data/<dataset>/): {train,val}/shard_NNNNN.parquet
("text" or "messages", and "source"), manifest.json (what was built from what; written last) and
SOURCES.md (sources and licences). `base` is prose for pretraining, `chat` conversations for
mid-training, --input=DIR --name=NAME any other. Files are renamed into place when complete, so a
re-run skips them: docs/measurements.md#prepared-data-on-disk.
"""

import json
import shutil
from collections import Counter
from pathlib import Path

from ..core import paths
from ..core.errors import UserError
from ..core.progress import progress_bar
from .corpus_sources import split_document
from .tokenizer import Tokenizer

TEXT, CHAT = "text", "chat"
SPLITS = ("train", "val")
FORMAT_VERSION = 1


def shard_file(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def check_conversation(conv, where: str) -> dict:
    """A conversation in the stored form ({"messages": [{"role", "content": str}]}, roles alternating
    after an optional system message), or a UserError naming `where`."""
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


def input_files(folder: Path) -> list[Path]:
    """The files of an --input folder that are read, in the order they are read."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl", ".parquet"))


def iter_input_folder(folder: Path, max_doc_chars: int):
    """(doc, file's relative path) from every file under `folder`: a .txt is prose, a .jsonl holds
    {"text"} or {"messages"} objects, a .parquet a "text" or "messages" column. Empty files are skipped
    with a warning; an unreadable one is a UserError naming it (better than dropping data silently)."""
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
            raise UserError(
                f"input file {path} is not UTF-8 text ({e.reason} at byte {e.start}); fix or remove it"
            ) from None


def _parquet_docs(path: Path, rel: str, max_doc_chars: int):
    """The documents of a parquet file, a batch of rows at a time (FineWeb shards are big)."""
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
        names = reader.schema_arrow.names
    except Exception as e:
        raise UserError(
            f"input file {path} is not a readable parquet file ({type(e).__name__}: {e}); fix or remove it"
        ) from None
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
        raise UserError(
            f"input file {path} is damaged after row {row} ({type(e).__name__}: {e}); fix or remove it"
        ) from None


def _object_docs(obj, where, source, max_doc_chars):
    if isinstance(obj, dict) and "messages" in obj:
        yield check_conversation(obj, where), source
    elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
        yield from ((d, source) for d in split_document(obj["text"], max_doc_chars))
    elif isinstance(obj, dict) and obj.get("text") is None and "text" in obj:
        return  # a null text cell: nothing to learn from
    else:
        raise UserError(f"{where}: expected an object with a 'text' string or a 'messages' list")


class ShardWriter:
    """Writes shard_NNNNN.parquet files of about shard_chars characters. With reuse=True an existing
    shard is kept (a resumed run: the document stream is deterministic, so it holds these documents)."""

    def __init__(self, directory: Path, kind: str, shard_chars: int, reuse: bool):
        self.directory, self.kind, self.shard_chars, self.reuse = Path(directory), kind, shard_chars, reuse
        self.directory.mkdir(parents=True, exist_ok=True)
        self.names, self.docs, self.sources, self.chars, self.n_docs = [], [], [], 0, 0

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

        name = shard_file(len(self.names))
        path = self.directory / name
        if not (self.reuse and path.is_file()):
            if self.kind == TEXT:
                column = {"text": pa.array(self.docs, type=pa.string())}
            else:
                message = pa.struct([("role", pa.string()), ("content", pa.string())])
                column = {"messages": pa.array([d["messages"] for d in self.docs], type=pa.list_(message))}
            table = pa.table({**column, "source": pa.array(self.sources, type=pa.string())})
            paths.replace_atomically(path, lambda tmp: pq.write_table(table, tmp, row_group_size=1024))
        self.names.append(name)
        self.docs, self.sources, self.chars = [], [], 0


def write_dataset(name, kind, docs, *, config, sources, val_every, shard_chars, overwrite=False) -> dict:
    """Write data/<name>/ from (doc, source) pairs (or a function returning them, called only when there is
    work), document i to val when i % val_every == 0; its manifest, kept if built with the same `config`
    (unless overwrite)."""
    root = paths.data_dir(name)
    manifest_path, started_path = root / "manifest.json", root / "building.json"
    config = dict(config, kind=kind, val_every=val_every, shard_chars=shard_chars, format=FORMAT_VERSION)
    if not overwrite and manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("config") == config:
            print(
                f"data/{name} is up to date ({manifest['docs']['train']} train + {manifest['docs']['val']} val "
                "documents); --overwrite rebuilds it"
            )
            return manifest
    reuse = not overwrite and started_path.is_file() and json.loads(started_path.read_text()) == config
    if not reuse:  # different options (or a forced rebuild): start from an empty directory
        manifest_path.unlink(missing_ok=True)
        for split in SPLITS:
            shutil.rmtree(root / split, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        paths.write_json(started_path, config)
    docs = docs() if callable(docs) else docs
    writers = {split: ShardWriter(root / split, kind, shard_chars, reuse) for split in SPLITS}
    docs_of, chars_of = Counter(), Counter()  # per source
    total = len(docs) if hasattr(docs, "__len__") else None
    with progress_bar(desc=f"writing data/{name}", unit="doc", total=total) as bar:
        for i, (doc, source) in enumerate(docs):
            writers["val" if val_every > 0 and i % val_every == 0 else "train"].add(doc, source)
            docs_of[source] += 1
            chars_of[source] += doc_chars(doc)
            bar.update()
    for w in writers.values():
        w.flush()
    n_docs = {split: writers[split].n_docs for split in SPLITS}
    if 0 in n_docs.values():
        raise UserError(
            f"data/{name}: {n_docs['train']} train and {n_docs['val']} val documents; "
            f"both need at least one (give more text, or lower --val-every)"
        )
    for source in sources:
        source.update(docs=docs_of[source["name"]], chars=chars_of[source["name"]])
    shards = {split: writers[split].names for split in SPLITS}
    chars = sum(chars_of.values())
    manifest = _write_manifest(name, kind, config, sources, shards, n_docs, chars)
    started_path.unlink(missing_ok=True)
    return manifest


def register_shards(name: str, shards: dict, *, config: dict, sources: list[dict]) -> dict:
    """data/<name>/manifest.json for text shards already in place (downloaded), not copied. The
    parquet footers count documents; characters are not counted ("chars": None)."""
    import pyarrow.parquet as pq

    root = paths.data_dir(name)
    docs = {split: sum(pq.ParquetFile(root / split / s).metadata.num_rows for s in shards[split]) for split in SPLITS}
    size = sum((root / split / s).stat().st_size for split in SPLITS for s in shards[split])
    config = dict(config, kind=TEXT, format=FORMAT_VERSION)
    return _write_manifest(name, TEXT, config, sources, {s: list(shards[s]) for s in SPLITS}, docs, None, size)


def _write_manifest(name, kind, config, sources, shards, docs, chars, size=None) -> dict:
    """SOURCES.md (for people), then manifest.json (last: the dataset is complete)."""
    root = paths.data_dir(name)
    manifest = {"name": name, "kind": kind, "config": config, "sources": sources, "shards": shards, "docs": docs}
    manifest["chars"] = chars
    if size is not None:
        manifest["bytes"] = size
    lines = [
        f"# data/{name}: sources and licences",
        "",
        f"{docs['train']:,} train and {docs['val']:,} validation documents ({kind}), "
        + (f"{chars:,} characters." if chars is not None else f"{size:,} bytes."),
        "",
        "| source | what | fetched as | licence | documents | characters |",
        "|---|---|---|---|---:|---:|",
    ]
    for s in sources:
        lines.append(
            f"| {s['name']} | {s.get('about', '')} | {s.get('spec', '')} | {s.get('licence', '')} | "
            f"{s.get('docs', 0):,} | {s.get('chars') or 0:,} |"
        )
    paths.replace_atomically(root / "SOURCES.md", lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
    paths.write_json(root / "manifest.json", manifest)
    return manifest


def read_dataset_manifest(name: str) -> dict:
    """data/<name>/manifest.json, or a UserError saying how to prepare (or rebuild) the dataset."""
    path = paths.data_dir(name) / "manifest.json"
    if not path.is_file():
        raise UserError(f"{path} not found: prepare the data with `python -m nanochat_fast.scripts.prepare_data`")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, OSError) as e:
        raise UserError(
            f"{path} is unreadable ({e}); re-run `python -m nanochat_fast.scripts.prepare_data --overwrite`"
        ) from None


def prepared_datasets() -> list[str]:
    return sorted(p.parent.name for p in (paths.home() / "data").glob("*/manifest.json"))


def iter_texts(name: str, split: str = "train", doc_cap: int = 0):
    """The documents of a prepared dataset as strings (conversations: their contents joined)."""
    manifest = read_dataset_manifest(name)
    column = "text" if manifest["kind"] == TEXT else "messages"
    for shard in manifest["shards"][split]:
        for values in iter_column(paths.data_dir(name) / split / shard, column):
            for value in values:
                if value is None:
                    continue
                text = value if column == "text" else "\n".join(m["content"] for m in value)
                yield text[:doc_cap] if doc_cap > 0 else text


def iter_column(path: Path, column: str, batch_rows: int = 1024):
    """One column of a parquet shard as lists of values, `batch_rows` rows at a time (a published
    set's shard holds ~250M characters: never read whole)."""
    import pyarrow.parquet as pq

    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=[column]):
            yield batch.column(0).to_pylist()
    except Exception as e:
        raise UserError(
            f"{path} is missing or unreadable ({type(e).__name__}: {e}); rebuild it with "
            "`python -m nanochat_fast.scripts.prepare_data --overwrite`"
        ) from None
