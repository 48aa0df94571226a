"""prepare_data --download: a published set's shards fetched from a misbehaving host on 127.0.0.1
(cut-off connections, 503s, a truncated shard, a redirect to the CDN), resumed, skipped when present,
and the bad inputs, one line each; then the shards prepared in place and tokenized as a stream."""

import errno
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from support.shard_server import ShardServer, parquet_bytes

from nanochat_fast.core import paths
from nanochat_fast.core.errors import NetworkError, UserError
from nanochat_fast.data import documents, shard_download, token_shards
from nanochat_fast.data.tokenizer import Tokenizer
from nanochat_fast.scripts import prepare_data, tok_train

WORDS = "river stone light morning quiet harbor lantern winter orchard silver letter garden <|bos|> café 42".split()
LAST = shard_download.DATASETS["climbmix"].last_shard


def shard_texts(index: int, n_docs: int = 60) -> list[str]:
    rng = random.Random(index)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 300))) for _ in range(n_docs)]


def published(n_train: int) -> dict[str, bytes]:
    """The host's files: training shards 0..n_train-1 and the validation shard, ClimbMix's names."""
    indices = list(range(n_train + 1)) + [LAST]
    return {shard_download.shard_file(i): parquet_bytes(shard_texts(i)) for i in indices}


def download(server, *extra, shards=3):
    argv = ["--download=climbmix", f"--shards={shards}", f"--base-url={server.base_url}", "--retry-wait=0.01"]
    return prepare_data.main(argv + ["--stage=text", *extra])


def on_disk(name="climbmix") -> dict[str, bytes]:
    root = paths.data_dir(name)
    return {p.name: p.read_bytes() for split in ("train", "val") for p in (root / split).iterdir()}


def test_misbehaving_host_gives_identical_shards_and_a_second_run_fetches_nothing(nanochat_home, capsys):
    files = published(4)
    wanted = {shard_download.shard_file(i) for i in (0, 1, 2, LAST)}
    with ShardServer(files, drop_once=wanted, fail_503=2, truncate_once={"shard_00001.parquet"}) as server:
        assert download(server) == 0
        out = capsys.readouterr().out
        assert on_disk() == {name: files[name] for name in wanted}  # byte for byte, nothing else
        # 4 cut-off bodies, 2 503s (HEAD or GET) and the truncated shard: each one retry
        assert "4 shards downloaded (0 already present)" in out and ", 7 retries" in out
        resumed = [r for m, p, r in server.requests if m == "GET" and p.startswith("/cdn/") and r]
        assert len(resumed) >= 4  # the cut-off shards went on where they stopped, after the redirect
        assert not list(paths.data_dir("climbmix").rglob("*.partial"))
        manifest = documents.read_dataset_manifest("climbmix")
        assert manifest["shards"] == {
            "train": ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"],
            "val": [shard_download.shard_file(LAST)],
        }
        assert manifest["docs"] == {"train": 180, "val": 60}
        # the documents are whole, as published: the val split is the last shard
        assert list(documents.iter_texts("climbmix", "val")) == shard_texts(LAST)

        before = len(server.requests)
        assert download(server) == 0
        assert "all 4 shards already present" in capsys.readouterr().out
        assert len(server.requests) == before  # not even a HEAD


def test_a_partial_file_from_a_killed_run_is_resumed_with_a_range_request(nanochat_home, capsys):
    files = published(1)
    root = paths.data_dir("climbmix")
    (root / "train").mkdir(parents=True)
    first = files["shard_00000.parquet"]
    (root / "train" / "shard_00000.parquet.partial").write_bytes(first[:1000])
    with ShardServer(files) as server:
        assert download(server, shards=1) == 0
        assert ("GET", "/cdn/shard_00000.parquet", "bytes=1000-") in server.requests
    assert on_disk()["shard_00000.parquet"] == first


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--shards=0"], "--shards must be at least 1"),
        ([f"--shards={LAST + 1}"], f"climbmix has {LAST} training shards"),
        (["--shards=2", "--base-url=ftp://mirror/x"], "--base-url must be an http:// or https://"),
        (["--shards=2", "--input=/tmp"], "give one"),
    ],
)
def test_bad_flags(nanochat_home, flags, message):
    with pytest.raises(UserError, match=message):
        prepare_data.main(["--download=climbmix", *flags])


def test_a_missing_shard_is_one_line_and_exit_2(nanochat_home):
    files = published(2)
    with ShardServer(files, missing={"shard_00001.parquet"}) as server:
        result = subprocess.run(
            [sys.executable, "-m", "nanochat_fast.scripts.prepare_data", "--download=climbmix", "--shards=2"]
            + [f"--base-url={server.base_url}", "--retry-wait=0.01"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2, result.stderr
    assert "HTTP 404" in result.stderr and result.stderr.strip().count("\n") == 0
    assert "Traceback" not in result.stderr


def test_a_host_that_keeps_failing_is_exit_1_and_keeps_the_complete_shards(nanochat_home):
    files = published(2)
    with ShardServer(files) as server:
        assert download(server, shards=1) == 0
        server.fail_503 = 1000
        with pytest.raises(NetworkError, match="still failing after 3 tries|no answer to HEAD") as e:
            download(server, "--retries=2", shards=2)
    assert e.value.exit_code == 1
    assert set(on_disk()) == {"shard_00000.parquet", shard_download.shard_file(LAST)}


def test_a_full_disk_removes_the_partial_file_and_keeps_the_complete_shards(nanochat_home, monkeypatch):
    files = published(3)
    real = shard_download._append

    def append(f, data):
        if "shard_00002" in f.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, data)

    monkeypatch.setattr(shard_download, "_append", append)
    with ShardServer(files) as server:
        with pytest.raises(UserError, match="the disk is full while writing .*shard_00002.parquet") as e:
            download(server, "--download-workers=1")
    assert e.value.exit_code == 2
    kept = set(on_disk())  # (the validation shard may have been fetched while shard 2 failed)
    assert {"shard_00000.parquet", "shard_00001.parquet"} <= kept and "shard_00002.parquet" not in kept
    assert not [name for name in kept if name.endswith(".partial")]
    assert all(documents_verified(name) for name in kept)
    assert not (paths.data_dir("climbmix") / "manifest.json").exists()


def documents_verified(name):
    split = "val" if name == shard_download.shard_file(LAST) else "train"
    return shard_download.verify_shard(paths.data_dir("climbmix") / split / name) is None


def test_too_little_free_space_is_said_before_anything_is_fetched(nanochat_home, monkeypatch):
    files = published(2)
    monkeypatch.setattr(shard_download.shutil, "disk_usage", lambda folder: SimpleNamespace(free=1000))
    with ShardServer(files) as server:
        with pytest.raises(UserError, match=r"3 shards need 0\.00 GB but .* GB short"):
            download(server, shards=2)
        assert server.count("GET") == 0 and server.count("HEAD") > 0  # sizes asked, nothing fetched


def test_another_dataset_in_the_folder_is_not_mixed_in(nanochat_home, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("\n\n".join(shard_texts(0)))
    prepare_data.main(["--input", str(tmp_path / "mine"), "--name=climbmix", "--stage=text", "--val-every=5"])
    with pytest.raises(UserError, match="data/climbmix holds another dataset"):
        prepare_data.main(["--download=climbmix", "--shards=1", "--base-url=http://127.0.0.1:9"])


# ---------------------------------------------------------------------------------------------
# preparation: the tokenizer trained on the downloaded shards, token shards made from them in place


def test_tokenizer_and_token_shards_from_the_downloaded_shards(nanochat_home, capsys):
    files = published(3)
    with ShardServer(files) as server:
        assert download(server) == 0
    assert tok_train.main(["--vocab-size=300", "--dataset=climbmix", "--no-tokenize"]) == 0
    tok = Tokenizer.load(paths.tokenizer_dir())
    assert prepare_data.main(["--download=climbmix", "--stage=tokens", "--num-threads=2"]) == 0
    for split, indices in (("train", [0, 1, 2]), ("val", [LAST])):
        shards = token_shards.TokenShards("climbmix", split)
        texts = [t for i in indices for t in shard_texts(i)]
        expected = tok.encode(texts, prepend=tok.get_bos_token_id())  # tiktoken's own batch encoder
        got = [shards.tokens[s][a:b].tolist() for s in range(len(shards.tokens)) for a, b in _spans(shards, s)]
        assert got == expected
    assert "tokens/climbmix" in capsys.readouterr().out


def _spans(shards, s):
    offsets = shards.offsets[s]
    return zip(offsets[:-1], offsets[1:])


def test_streamed_shard_equals_the_whole_shard_at_once(tmp_path):
    """Batches of ~1 document, or all at once, give the files write_token_shard makes from the
    whole shard (the format a loader reads), byte for byte."""
    tok = Tokenizer.train(shard_texts(7), 300)
    source = tmp_path / "shard.parquet"
    texts = shard_texts(5, 200) + [None, ""]
    source.write_bytes(parquet_bytes(texts, row_group_size=7))
    kept = [t for t in texts if t is not None]
    reference = token_shards.write_token_shard(
        tmp_path / "ref", "s", [np.asarray(ids, np.uint16) for ids in tok.encode(kept, prepend=tok.bos_token_id)]
    )
    with token_shards.encoder_pool(tok, 2) as pool:
        for batch_chars in (1, 10_000, 10**9):
            counts = token_shards.tokenize_text_shard(
                source, tok, tmp_path / "out", "s", np.uint16, pool, 2, batch_chars
            )
            assert counts == reference
            for what in ("tokens", "offsets"):
                ours, ref = (tmp_path / d / f"s.{what}.npy" for d in ("out", "ref"))
                assert ours.read_bytes() == ref.read_bytes()
    assert not list((tmp_path / "out").glob(".*"))


def test_memory_setting_sizes_the_batch_and_too_little_is_one_line():
    held = 2 * token_shards.WORKER_MB  # the process's own memory is not the tokenizer's to bound
    chars = token_shards.batch_chars_within(int(held) + 500, 2)
    assert abs(chars * token_shards.BYTES_PER_CHAR / 2**20 - 500) < 50
    with pytest.raises(UserError, match="--max-memory-mb=10 leaves too little"):
        token_shards.batch_chars_within(10, 2)


def test_a_killed_preparation_resumes_at_its_shard_and_gives_identical_token_shards(nanochat_home, monkeypatch):
    """Stopped in the middle of the third shard (an exception where a kill would land), then run
    again: the two finished shards are reused, and every file equals an uninterrupted run's."""
    files = published(4)
    with ShardServer(files) as server:
        assert download(server, shards=4) == 0
    tok = Tokenizer.train(shard_texts(9), 300)
    tok.save(paths.tokenizer_dir())
    small = ["--download=climbmix", "--stage=tokens", "--num-threads=2", "--max-memory-mb=4000"]
    monkeypatch.setattr(token_shards, "ROWS_PER_READ", 4)
    monkeypatch.setattr(token_shards, "batch_chars_within", lambda mb, workers: 3000)  # several batches a shard
    assert prepare_data.main(small) == 0
    root = paths.tokens_dir("climbmix")
    reference = {p.relative_to(root): p.read_bytes() for p in root.rglob("*.npy")}
    for path in root.rglob("*"):
        if path.is_file():
            path.unlink()
    real = token_shards.text_batches

    def killed_in_shard_2(source, batch_chars):
        for n, batch in enumerate(real(source, batch_chars)):
            if source.name == "shard_00002.parquet" and n == 2:
                raise KeyboardInterrupt  # the third shard, after two of its batches were written
            yield batch

    monkeypatch.setattr(token_shards, "text_batches", killed_in_shard_2)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.main(small)
    assert sorted(p.name for p in (root / "train").glob("*.json")) == ["shard_00000.json", "shard_00001.json"]
    assert not list(root.rglob(".*"))  # the unfinished shard's partial file went with it
    monkeypatch.setattr(token_shards, "text_batches", real)
    before = {p: p.stat().st_mtime_ns for p in (root / "train").glob("shard_0000[01].*")}
    assert prepare_data.main(small) == 0
    assert {p: p.stat().st_mtime_ns for p in before} == before  # reused, not redone
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*.npy")} == reference
