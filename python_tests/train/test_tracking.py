"""--wandb (offline) and --tensorboard: a short run logs nanochat's metric names, TensorBoard's own
event reader reads back the values metrics.jsonl holds, a missing package is one line naming the
extra, and without the flags nothing is made."""

import json

import pytest
from support.tiny_pipeline import TINY_LOOP, TINY_MODEL

from nanochat_fast.core import cli
from nanochat_fast.scripts import base_train
from nanochat_fast.train import tracking

RUN = (
    TINY_MODEL
    + TINY_LOOP
    + ["--device-batch-size=4", "--total-batch-size=512", "--no-compile", "--num-iterations=5", "--eval-every=5"]
)


def wandb_records(path):
    """The records of an offline run's .wandb file: wandb's LevelDB-style log (a 7-byte header,
    then 32 KiB blocks of chunks: crc32, length, type FULL/FIRST/MIDDLE/LAST, payload), each a
    wandb_internal_pb2.Record."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, chunks, out = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        chunks = payload if kind in (1, 2) else chunks + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            out.append(record)
    return out


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_wandb_offline_and_tensorboard_get_nanochat_metric_names(home, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert base_train.main(RUN + ["--run=tracked", "--wandb=nanochat-test", "--tensorboard"]) == 0
    run_dir = home / "runs" / "tracked"
    rows = rows_of(run_dir)
    assert sum(r["kind"] == "train" for r in rows) == 5

    # wandb: one offline run in the run folder, named after --run, with the run's settings and every
    # row's metrics under nanochat's names and values
    offline = list((run_dir / "wandb").glob("offline-run-*/*.wandb"))
    assert len(offline) == 1
    records = wandb_records(offline[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.display_name, run.project) == ("tracked", "nanochat-test")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["depth"] == 2 and config["num_iterations"] == 5
    history = {}  # step -> {name: value}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update(items)
    for row in rows:
        for name, value in tracking.tracked_metrics(row).items():
            assert history[row["step"]][name] == pytest.approx(value, rel=1e-12), name
    names = set().union(*history.values())
    assert {"train/loss", "train/lrm", "train/dt", "train/tok_per_sec", "train/mfu", "val/bpb"} <= names

    # TensorBoard: every metric of every row, read back by TensorBoard's reader, equal to metrics.jsonl
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    expected = {}
    for row in rows:
        for name, value in tracking.tracked_metrics(row).items():
            expected.setdefault(name, []).append((row["step"], value))
    assert "train/loss" in expected and "val/bpb" in expected and "train/mfu" in expected
    assert set(events.Tags()["scalars"]) == set(expected)
    for name, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(name)]
        assert [s for s, _ in got] == [s for s, _ in points], name
        for (_, value), (_, want) in zip(got, points):
            assert value == pytest.approx(want, rel=1e-6), name  # event files store float32
    # train/loss is nanochat's: the debiased smoothed loss
    assert [v for _, v in expected["train/loss"]] == [r["smooth_loss"] for r in rows if r["kind"] == "train"]


def test_without_the_flags_no_tracker_is_made(home, monkeypatch):
    made = []
    monkeypatch.setattr(tracking, "WandbTracker", lambda *a: made.append(a))
    monkeypatch.setattr(tracking, "TensorBoardTracker", lambda *a: made.append(a))
    assert base_train.main(RUN[:-2] + ["--num-iterations=1", "--eval-every=-1", "--run=plain"]) == 0
    run_dir = home / "runs" / "plain"
    assert not made and not (run_dir / "wandb").exists() and not (run_dir / "tensorboard").exists()


@pytest.mark.parametrize("flag, extra", [("--wandb=proj", "wandb"), ("--tensorboard", "tensorboard")])
def test_a_missing_package_is_one_line_naming_the_extra(flag, extra, home, monkeypatch, capsys):
    what = "wandb" if flag.startswith("--wandb") else "tensorboard"
    monkeypatch.setitem(tracking.PACKAGES, what, ("nanochat_fast_no_such_module", extra, flag.split("=")[0]))
    with pytest.raises(SystemExit) as e:
        cli.run(base_train.main, RUN + ["--run=missing", flag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f'pip install "nanochat_fast[{extra}]"' in err
    assert not (home / "runs" / "missing").exists()
