"""Every user mistake is one line on stderr naming the flag, variable or file, exit code 2, no
traceback.

The tables call each script's main(argv) in-process through cli.run (what `python -m` runs): the
mistakes found deep in a run (CASES, each on its own copy of a trained home), a bad value of every
flag of every script (BAD_VALUES; a test fails when a script gains a flag without a row) and of
every environment variable the package reads, for every script (ENV_CASES). Two cases also run as
real subprocesses."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from support.tiny_pipeline import ROOT, TINY_LOOP, TINY_MODEL, disk_full_at, home_env, home_with_base_run, private_home

from nanochat_fast import checkpoints
from nanochat_fast.core import cli
from nanochat_fast.hardware import __main__ as hardware
from nanochat_fast.scripts import (
    base_eval,
    base_train,
    chat_cli,
    chat_eval,
    chat_rl,
    chat_sft,
    chat_web,
    export_checkpoint,
    export_hf,
    export_nanochat,
    import_hf,
    import_nanochat,
    infer_bench,
    mid_train,
    prepare_data,
    report,
    tok_train,
)
from nanochat_fast.train import env_vars

TINY = TINY_MODEL + TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1"]
SCRIPTS = {
    "base_train": base_train,
    "mid_train": mid_train,
    "base_eval": base_eval,
    "chat_cli": chat_cli,
    "prepare_data": prepare_data,
    "tok_train": tok_train,
    "chat_web": chat_web,
    "chat_sft": chat_sft,
    "chat_eval": chat_eval,
    "report": report,
    "hardware": hardware,
    "infer_bench": infer_bench,
    "import_nanochat": import_nanochat,
    "export_nanochat": export_nanochat,
    "chat_rl": chat_rl,
    "export_checkpoint": export_checkpoint,
    "export_hf": export_hf,
    "import_hf": import_hf,
}
# infer_bench on a random model small enough to finish at once, should a bad value slip through
BENCH = [
    "--depth=1",
    "--vocab-size=300",
    "--max-seq-len=32",
    "--batch-sizes=1",
    "--prompt-tokens=4",
    "--decode-tokens=2",
    "--dtype=fp32",
]


@pytest.fixture(scope="module")
def trained_home(tiny_home, tmp_path_factory):
    """tiny_home plus a 4-step base run `b` (checkpoints at steps 2 and 4), exported in nanochat's
    layout to nanochat/ (what import_nanochat's rows read); beside the home (not among its runs),
    `sft_like`: run b labelled an sft run, a chat model for chat_rl to start from."""
    home = home_with_base_run(
        tiny_home, tmp_path_factory.mktemp("bad") / "home", TINY + ["--num-iterations=4", "--save-every=2", "--run=b"]
    )
    with home_env(home):
        assert export_nanochat.main(["--run=b", f"--out={home / 'nanochat'}"]) == 0
    shutil.copytree(home / "runs" / "b", home.parent / "sft_like")
    for meta_file in (home.parent / "sft_like").glob("checkpoints/*/meta.json"):
        meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "phase": "sft"}))
    return home


def truncate(path, keep=100):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def first(pattern, home):
    return sorted(home.glob(pattern))[0]


def retrain_tokenizer(home):
    assert tok_train.main(["--vocab-size=300", "--no-tokenize"]) == 0


# import_nanochat's source: run b exported by export_nanochat (trained_home)
NANO = ["--from={home}/nanochat/base_checkpoints/d2", "--tokenizer={home}/nanochat/tokenizer"]

CASES = [
    # (id, script, argv, setup(home), expected text in the one line)
    ("unknown-flag", "base_train", ["--bogus=1"], None, "unrecognized arguments: --bogus=1"),
    ("zero-depth", "base_train", ["--depth=0"], None, "argument --depth: must be a positive integer, got 0"),
    (
        "negative-batch",
        "base_train",
        ["--device-batch-size=-4"],
        None,
        "--device-batch-size: must be a positive integer",
    ),
    ("bad-fraction", "base_train", ["--warmdown-ratio=1.5"], None, "--warmdown-ratio: must be in [0, 1]"),
    ("unknown-arch", "base_train", ["--arch=llama"], None, "argument --arch: must be one of 'gpt', 'windowed'"),
    ("window-letters", "base_train", ["--window-pattern=SML"], None, "must be letters S (short) and L (long)"),
    (
        "arch-mismatch",
        "mid_train",
        ["--base-run=b", "--arch=windowed"],
        None,
        "is a gpt model but --arch=windowed: drop --arch",
    ),
    (
        "arch-mismatch-on-resume",
        "base_train",
        TINY + ["--run=b", "--resume=auto", "--arch=windowed", "--num-iterations=3"],
        None,
        "is a gpt model but --arch=windowed",
    ),
    (
        "batch-not-divisible",
        "base_train",
        TINY + ["--total-batch-size=1000"],
        None,
        "nearest valid values: 768 or 1024",
    ),
    ("no-horizon", "base_train", TINY + ["--target-param-data-ratio=-1"], None, "no training horizon"),
    (
        "seq-len-above-checkpoint",
        "mid_train",
        ["--base-run=b", "--max-seq-len=128"],
        None,
        "above the base model's sequence_len 64",
    ),
    ("data-missing", "base_train", TINY + ["--run=x"], lambda h: shutil.rmtree(h / "tokens" / "base"), "prepare_data"),
    (
        "data-empty",
        "base_train",
        TINY + ["--run=x"],
        lambda h: [p.unlink() for p in (h / "tokens" / "base" / "train").iterdir()],
        "no token shards in",
    ),
    (
        "token-shard-truncated",
        "base_train",
        TINY + ["--run=x"],
        lambda h: truncate(first("tokens/base/train/*.tokens.npy", h)),
        "token shard",
    ),
    (
        "parquet-corrupt",
        "prepare_data",
        ["--stage=tokens", "--overwrite"],
        lambda h: truncate(first("data/base/train/*.parquet", h)),
        ".parquet",
    ),
    ("tokenizer-missing", "base_train", TINY + ["--run=x"], lambda h: shutil.rmtree(h / "tokenizer"), "tok_train"),
    ("tokenizer-not-the-checkpoints", "base_eval", ["--run=b"], retrain_tokenizer, "is not the one checkpoint"),
    ("shards-of-another-tokenizer", "base_train", TINY + ["--run=x"], retrain_tokenizer, "another tokenizer"),
    (
        "checkpoint-of-another-config",
        "base_train",
        TINY[:1] + ["--depth=3"] + TINY[1:] + ["--run=b", "--resume=auto"],
        None,
        "another model config: n_layer=2 (this run: 3)",
    ),
    (
        "checkpoint-truncated",
        "base_eval",
        ["--run=b"],
        lambda h: truncate(h / "runs/b/checkpoints/step_000004/model.pt"),
        "step_000004/model.pt has",  # its size differs from the one recorded when it was saved
    ),
    (
        "checkpoint-meta-corrupt",
        "base_eval",
        ["--run=b"],
        lambda h: (h / "runs/b/checkpoints/step_000004/meta.json").write_text("{"),
        "step_000004/meta.json has",
    ),
    (
        "resume-path-not-a-checkpoint",
        "base_train",
        TINY + ["--resume=/nonexistent/step_000001"],
        None,
        "not a complete checkpoint directory",
    ),
    (
        "fsdp-on-one-process",
        "base_train",
        TINY + ["--sharding=fsdp", "--num-iterations=1", "--run=x"],
        None,
        "--sharding=fsdp shards the model over processes but this run has one: launch with torchrun",
    ),
    ("run-dir-exists", "base_train", TINY + ["--run=b"], None, "already exists: pass --resume auto"),
    ("out-dir-not-writable", "base_train", TINY + ["--out-dir=/dev/null/run"], None, "cannot write to run directory"),
    ("no-such-run", "base_eval", ["--run=nope"], None, "no run named 'nope'"),
    ("no-mid-run-to-chat-with", "chat_cli", ["--prompt=hi"], None, "no sft or mid run with a complete checkpoint"),
    ("no-chat-run-to-evaluate", "chat_eval", [], None, "no sft or mid run with a complete checkpoint"),
    (
        "no-eval-data",
        "chat_eval",
        ["--run=b", "--task=gsm8k"],
        None,
        "no evaluation data for gsm8k in {home}/data/eval/gsm8k: run `python -m nanochat_fast.scripts.prepare_data "
        "--datasets=eval`",
    ),
    (
        "sft-examples-not-divisible",
        "chat_sft",
        ["--source-run=b", "--target-examples-per-step=30"],
        None,
        "--target-examples-per-step 30 is not a multiple of device_batch_size x world_size = 4 x 1 = 4; nearest "
        "valid values: 28 or 32",
    ),
    (
        "sft-nothing-to-train-on",
        "chat_sft",
        ["--source-run=b"],
        lambda h: shutil.rmtree(h / "tokens" / "chat"),
        "nothing to fine-tune on",
    ),
    # chat_rl: its sampling flags and its starting point (a chat model)
    (
        "rl-no-samples",
        "chat_rl",
        ["--num-samples=0"],
        None,
        "argument --num-samples: must be a positive integer, got 0",
    ),
    (
        "rl-one-sample",
        "chat_rl",
        ["--num-samples=1"],
        None,
        "argument --num-samples: must be at least 2 (the advantage compares a question's samples), got 1",
    ),
    ("rl-negative-temperature", "chat_rl", ["--temperature=-1"], None, "argument --temperature: must be >= 0, got -1"),
    ("rl-zero-temperature", "chat_rl", ["--temperature=0"], None, "argument --temperature: must be > 0"),
    (
        "rl-unknown-task",
        "chat_rl",
        ["--task=unknown"],
        None,
        "argument --task: unknown RL task 'unknown'; choose one of GSM8K, SpellingBee, last-digit",
    ),
    (
        "rl-from-a-base-model",
        "chat_rl",
        ["--source-run=b", "--task=last-digit"],
        None,
        "is a base checkpoint, not a sft or mid one",
    ),
    ("rl-no-chat-model", "chat_rl", ["--task=last-digit"], None, "no sft or mid run with a complete checkpoint"),
    ("report-output-is-a-folder", "report", ["--output={tmp}"], None, "is a directory; give a file name"),
    (
        "no-such-step",
        "base_eval",
        ["--run=b", "--step=3"],
        None,
        "no complete checkpoint at step 3 (complete steps: 2, 4)",
    ),
    ("cuda-without-gpu", "base_train", ["--device-type=cuda"], None, "no CUDA GPU is available"),
    (
        "no-chat-dataset",
        "mid_train",
        ["--base-run=b"],
        lambda h: shutil.rmtree(h / "tokens" / "chat"),
        "or train on your own conversations with --extra-conversations=FILE.jsonl",
    ),
    # chat_web's --body-timeout: checked before the port and the model (run "nope" would be the error otherwise)
    *[
        (
            f"body-timeout-{value}",
            "chat_web",
            ["--run=nope", "--port=0", f"--body-timeout={value}"],
            None,
            f"--body-timeout must be > 0 seconds (and finite), got {float(value)}",
        )
        for value in ("-1", "nan", "inf", "1e-400")
    ],
    (
        "body-timeout-not-a-number",
        "chat_web",
        ["--run=nope", "--port=0", "--body-timeout=soon"],
        None,
        "argument --body-timeout: invalid float value: 'soon'",
    ),
    # chat_web's KV cache: checked against the run's model before any weights load or a request is served
    (
        "kv-memory-below-one-slot",
        "chat_web",
        ["--run=b", "--port=0", "--kv-memory=1K"],
        None,
        "--kv-memory 1.00 KiB cannot hold one slot: the KV cache needs",
    ),
    (
        "slots-beyond-kv-memory",
        "chat_web",
        ["--run=b", "--port=0", "--slots=64", "--kv-memory=1M"],
        None,
        "--slots 64 need 4.00 MiB of KV cache (64.00 KiB per reply at the model's 64 positions), more than "
        "--kv-memory 1.00 MiB: use --slots=16 or a larger --kv-memory",
    ),
    (
        "kv-memory-not-a-size",
        "chat_web",
        ["--run=b", "--port=0", "--kv-memory=2 gigs"],
        None,
        "argument --kv-memory: expected a size like 512M or 2G (bytes, or K/M/G/T), got '2 gigs'",
    ),
    (
        "kv-memory-zero",
        "chat_web",
        ["--run=b", "--port=0", "--kv-memory=0G"],
        None,
        "argument --kv-memory: must be a positive size, got 0G",
    ),
    (
        "slots-zero",
        "chat_web",
        ["--run=b", "--port=0", "--slots=0"],
        None,
        "argument --slots: must be a positive integer, got 0",
    ),
    (
        "extra-conversations-malformed",
        "mid_train",
        ["--base-run=b", "--extra-conversations={tmp}/bad.jsonl"],
        lambda h: (h.parent / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n'),
        "bad.jsonl line 2: expected",
    ),
    # infer_bench: the sweep, the memory limit, the context, which model
    (
        "bench-batch-sizes-not-positive",
        "infer_bench",
        BENCH + ["--batch-sizes=0,-1"],
        None,
        "argument --batch-sizes: must be a positive integer, got 0",
    ),
    (
        "bench-batch-sizes-not-integers",
        "infer_bench",
        BENCH + ["--batch-sizes=1,two"],
        None,
        "argument --batch-sizes: expected an integer, got 'two'",
    ),
    (
        "bench-batch-sizes-empty",
        "infer_bench",
        BENCH + ["--batch-sizes="],
        None,
        "argument --batch-sizes: expected batch sizes separated by commas, e.g. 1,4,16, got ''",
    ),
    (
        "bench-batch-beyond-kv-memory",
        "infer_bench",
        BENCH + ["--batch-sizes=1,64", "--kv-memory=64KiB"],
        None,
        "--batch-sizes: batch 64 needs 384.00 KiB of KV cache (64 rows x 6 positions), above --kv-memory 64.00 KiB; "
        "at most "
        "10 rows fit",
    ),
    (
        "bench-beyond-context",
        "infer_bench",
        ["--run=b", "--prompt-tokens=60", "--decode-tokens=8"],
        None,
        "--prompt-tokens 60 + --decode-tokens 8 = 68 is beyond the model's context of 64 tokens",
    ),
    (
        "bench-no-model",
        "infer_bench",
        ["--batch-sizes=1"],
        None,
        "give --run=NAME (a run's checkpoint) or --depth=N (a random model)",
    ),
    ("bench-two-models", "infer_bench", ["--run=b", "--depth=2"], None, "or --depth=N (a random model), not both"),
    # import_nanochat / export_nanochat (interop/test_nanochat_interop.py has the rest: pickles, shapes, vocab)
    (
        "import-not-a-nanochat-folder",
        "import_nanochat",
        ["--from={tmp}", "--tokenizer={tmp}", "--run=x"],
        None,
        "no meta_*.json there",
    ),
    ("import-run-exists", "import_nanochat", NANO + ["--run=b"], None, "already exists: pick another --run"),
    (
        "export-over-a-checkpoint",
        "export_nanochat",
        ["--run=b", "--out={home}/nanochat"],
        None,
        "model_000004.pt exists; pass --overwrite",
    ),
    ("export-no-run", "export_nanochat", ["--run=nope", "--out={tmp}"], None, "no run named 'nope'"),
    # export_hf / import_hf (interop/test_hf_folder.py has the rest: model types, shapes, tokenizers)
    ("export-hf-non-empty", "export_hf", ["--run=b", "--out={home}/data"], None, "is not empty; pass --overwrite"),
    ("import-hf-not-a-folder", "import_hf", ["--from={tmp}", "--run=x"], None, "no config.json there"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, trained_home, tmp_path, monkeypatch, capsys):
    name, script, argv, setup, expected = case
    if name == "cuda-without-gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    home = private_home(trained_home, tmp_path / "home", monkeypatch)
    if setup:
        setup(home)
        capsys.readouterr()
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{home}", str(home)) for a in argv]
    assert expected.replace("{home}", str(home)) in one_line_exit_2(script, argv, capsys)


def one_line_exit_2(script, argv, capsys) -> str:
    """Run the script in-process; assert exit code 2 and one line on stderr; return the line."""
    with pytest.raises(SystemExit) as exit_info:
        cli.run(SCRIPTS[script].main, argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # not the progress bars
    assert exit_info.value.code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# every flag of every script

# flags that take any value (switches, free text), only print help, or (--host) are checked by
# binding to them (a made-up host name would wait on a DNS lookup here)
NO_BAD_VALUE = {
    "--help",
    "--overwrite",
    "--deterministic",
    "--compile",
    "--no-compile",
    "--no-tokenize",
    "--prompt",
    "--host",
    "--normuon",
    "--no-normuon",
    "--tune",
    "--replica-process",
    "--no-replica-process",
    "--no-optimizer",
    "--tensorboard",
    "--accept-norm-eps",
}
BAD_VALUES = {  # flag -> a value every script that has the flag must refuse
    "--depth": "0",
    "--aspect-ratio": "-1",
    "--head-dim": "3",
    "--max-seq-len": "0",
    "--dataset": "../x",
    "--device-batch-size": "-4",
    "--total-batch-size": "0",
    "--num-iterations": "0",
    "--target-flops": "-5",
    "--target-param-data-ratio": "nan",
    "--embedding-lr": "-1",
    "--unembedding-lr": "inf",
    "--matrix-lr": "abc",
    "--weight-decay": "-0.1",
    "--grad-clip": "-1",
    "--warmup-ratio": "1.5",
    "--warmdown-ratio": "-0.1",
    "--final-lr-frac": "2",
    "--ns-coefficients": "cubic",
    "--muon-recipe": "latest",
    "--arch": "transformer",
    "--window-pattern": "SXL",
    "--warmup-steps": "-1",
    "--scalar-lr": "-1",
    "--sharding": "bogus",
    "--ns-dtype": "tf32",
    "--muon-weight-decay": "-0.5",
    "--eval-every": "x",
    "--eval-tokens": "0",
    "--sample-every": "1.5",
    "--save-every": "often",
    "--keep-last": "-1",
    "--collective-timeout": "0",
    "--skip-nonfinite": "-2",
    "--device-type": "tpu",
    "--dtype": "fp16",
    "--run": "../../x",
    "--out-dir": "/dev/null",
    "--resume": "/nonexistent/step_000001",
    "--seed": "-1",
    "--base-run": "../nope",
    "--base-step": "-1",
    "--extra-conversations": "missing.jsonl",
    "--step": "-1",
    "--samples": "-1",
    "--max-tokens": "0",
    "--temperature": "-1",
    "--top-k": "-1",
    "--datasets": "prose",
    "--extras": "bogus",
    "--input": "/nonexistent",
    "--download": "imagenet",
    "--shards": "0",
    "--base-url": "ftp://mirror/x",
    "--download-workers": "0",
    "--retries": "-1",
    "--retry-wait": "-1",
    "--max-memory-mb": "0",
    "--name": "../x",
    "--stage": "bogus",
    "--doc-chars": "-1",
    "--shard-chars": "0",
    "--val-every": "0",
    "--synthetic": "-1",
    "--limit-per-source": "-1",
    "--num-threads": "0",
    "--vocab-size": "100",
    "--max-chars": "0",
    "--doc-cap": "-1",
    "--port": "-1",
    "--workers": "0",
    "--max-new-tokens": "0",
    "--queue-size": "-1",
    "--admission-gap-ms": "-1",
    "--request-timeout": "0",
    "--body-timeout": "0",
    "--slots": "0",
    "--batch-sizes": "0,-1",
    "--prompt-tokens": "0",
    "--decode-tokens": "1",
    "--kv-memory": "lots",
    "--source-run": "../nope",
    "--source-step": "-1",
    "--target-examples-per-step": "0",
    "--chat-eval-examples": "-1",
    "--task": "ARC-Hard",
    "--max-examples": "-1",
    "--num-samples": "0",
    "--batch-size": "0",
    "--budget": "-1",
    "--device": "tpu",
    "--mid-run": "../nope",
    "--sft-run": "../nope",
    "--output": "/dev/null/card.md",
    "--rl-run": "../nope",
    "--examples-per-step": "0",
    "--num-epochs": "0",
    "--eval-examples": "-1",
    "--from": "/nonexistent",
    "--tokenizer": "/nonexistent",
    "--phase": "rl",
    "--out": "/dev/null",
    "--wandb": "a/b",
}
# what each script gets before the bad flag: enough to run and end, should the bad value slip through
# (chat_web: a port that is taken, so it stops before serving)
CONTEXT = {
    "base_train": TINY + ["--num-iterations=1", "--run=flagcheck"],
    "mid_train": ["--base-run=b"],
    "base_eval": ["--run=b"],
    "chat_cli": ["--prompt=hi"],
    "prepare_data": [],
    "tok_train": [],
    "chat_web": ["--run=b", "--host=127.0.0.1", "--port={busy_port}"],
    "chat_sft": ["--source-run=b", "--num-iterations=1", "--eval-every=-1", "--run=sftcheck"],
    "chat_eval": ["--run=b", "--task=ARC-Easy", "--max-examples=1"],
    "report": [],
    "hardware": ["--tune", "--depth=1", "--max-seq-len=16", "--device-batch-size=1"],
    "infer_bench": BENCH,
    "import_nanochat": NANO + ["--run=imported"],
    "export_nanochat": ["--run=b", "--out={home}/exported"],
    "chat_rl": [
        "--source-run={home}/../sft_like",
        "--task=last-digit",
        "--num-iterations=1",
        "--eval-examples=2",
        "--max-new-tokens=4",
        "--run=rlcheck",
    ],
    "export_checkpoint": ["--run=b"],
    "export_hf": ["--run=b", "--out={home}/hf_exported"],
    "import_hf": ["--from={home}/hf_exported", "--run=imported_hf"],
}


@pytest.fixture(scope="module")
def busy_port():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        yield taken.getsockname()[1]


def context(script, busy_port, home) -> list[str]:
    return [a.replace("{busy_port}", str(busy_port)).replace("{home}", str(home)) for a in CONTEXT[script]]


def long_flags(script) -> list[str]:
    return [o for a in SCRIPTS[script].build_parser()._actions for o in a.option_strings if o.startswith("--")]


FLAG_ROWS = [(script, flag) for script in SCRIPTS for flag in long_flags(script) if flag not in NO_BAD_VALUE]


def test_every_flag_of_every_script_has_a_row():
    missing = [(s, f) for s in SCRIPTS for f in long_flags(s) if f not in BAD_VALUES and f not in NO_BAD_VALUE]
    assert not missing, f"flags without a bad-value row: {missing}"


@pytest.mark.parametrize("script, flag", FLAG_ROWS, ids=[f"{s}{f}" for s, f in FLAG_ROWS])
def test_bad_flag_value_is_one_line_naming_the_flag(script, flag, trained_home, busy_port, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(trained_home))
    line = one_line_exit_2(script, context(script, busy_port, trained_home) + [f"{flag}={BAD_VALUES[flag]}"], capsys)
    assert flag in line, line


@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan"])
def test_collective_timeout_must_be_a_positive_number(value, trained_home, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(trained_home))
    line = one_line_exit_2("base_train", ["--depth=2", f"--collective-timeout={value}"], capsys)
    assert "--collective-timeout" in line, line


# ---------------------------------------------------------------------------------------------
# every environment variable, for every script

TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
ENV_CASES = [  # (id, variables set, expected text); torchrun rows start from a consistent torchrun set
    ("home-not-a-folder", {"NANOCHAT_FAST_HOME": "/dev/null"}, "NANOCHAT_FAST_HOME='/dev/null': exists and is not"),
    ("kernels-bogus", {"NANOCHAT_FAST_KERNELS": "bogus"}, "unknown backend 'bogus'"),
    ("kernels-unknown-op", {"NANOCHAT_FAST_KERNELS": "adamw=cpp"}, "unknown op 'adamw'"),
    ("no-ext", {"NANOCHAT_FAST_NO_EXT": "yes"}, "NANOCHAT_FAST_NO_EXT='yes': must be 0 or 1"),
    ("force-cuda", {"NANOCHAT_FAST_FORCE_CUDA": "2"}, "NANOCHAT_FAST_FORCE_CUDA='2': must be 0 or 1"),
    ("misspelt", {"NANOCHAT_FAST_KERNEL": "cpp"}, "did you mean NANOCHAT_FAST_KERNELS?"),
    ("omp-zero", {"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS='0': must be a positive integer"),
    ("triton-interpret", {"TRITON_INTERPRET": "maybe"}, "TRITON_INTERPRET='maybe'"),
    ("rank-without-world", {"RANK": "0", "LOCAL_RANK": "0"}, "RANK, LOCAL_RANK set, WORLD_SIZE missing"),
    ("world-not-a-number", {**TORCHRUN, "WORLD_SIZE": "two"}, "WORLD_SIZE='two': must be an integer >= 1"),
    ("rank-too-big", {**TORCHRUN, "RANK": "1"}, "RANK='1': must be an integer in [0, 0]"),
    (
        "local-rank-too-big",
        {**TORCHRUN, "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
        "LOCAL_RANK='2': must be an integer in [0, 1]",
    ),
    ("local-world-zero", {**TORCHRUN, "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0'"),
    ("master-addr-missing", {k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR is not set"),
    ("master-port", {**TORCHRUN, "MASTER_PORT": "99999"}, "MASTER_PORT='99999': must be an integer in [1, 65535]"),
]
MODEL_SCRIPTS = ("base_train", "mid_train", "base_eval", "chat_cli", "chat_sft", "chat_eval", "infer_bench")


def test_every_environment_variable_has_a_row():
    covered = {name for _, env, _ in ENV_CASES for name in env}
    read = set(env_vars.KNOWN) | {
        "OMP_NUM_THREADS",
        "TRITON_INTERPRET",
        "LOCAL_WORLD_SIZE",
        *env_vars.TORCHRUN_CORE,
        "MASTER_ADDR",
        "MASTER_PORT",
    }
    assert read <= covered, read - covered


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("case", ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_bad_environment_variable_is_one_line(case, script, trained_home, busy_port, monkeypatch, capsys):
    name, env, expected = case
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(trained_home))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert expected in one_line_exit_2(script, context(script, busy_port, trained_home), capsys)


@pytest.mark.parametrize("script", MODEL_SCRIPTS)
def test_a_backend_that_cannot_run_on_the_device(script, trained_home, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(trained_home))
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "adamw_slice_update=triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    line = one_line_exit_2(script, CONTEXT[script], capsys)
    assert "backend 'triton' is unavailable on cpu" in line, line


def test_mps_with_several_processes(trained_home, monkeypatch, capsys):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    for k, v in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exit_info:
        cli.run(base_train.main, ["--device-type=mps"])
    assert exit_info.value.code == 2
    assert "MPS runs a single process but 2 were launched" in capsys.readouterr().err


def test_disk_full_while_saving_keeps_the_previous_checkpoint(trained_home, tmp_path, monkeypatch, capsys):
    home = private_home(trained_home, tmp_path / "home", monkeypatch)
    with disk_full_at("step_000004"), pytest.raises(SystemExit) as exit_info:
        cli.run(base_train.main, TINY + ["--num-iterations=6", "--save-every=2", "--run=full"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "disk full" in err and "step_000002 is intact" in err
    run_dir = home / "runs" / "full"
    assert [p.name for p in checkpoints.complete_checkpoints(run_dir)] == ["step_000002"]
    assert not (run_dir / "checkpoints" / "step_000004").exists()
    assert not (run_dir / "checkpoints" / "step_000004.partial").exists()
    checkpoints.load_model_state(run_dir / "checkpoints" / "step_000002")


def test_a_real_process_exits_2_with_one_line(trained_home):
    out = subprocess.run(
        [sys.executable, "-m", "nanochat_fast.scripts.base_train", "--total-batch-size=0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "python -m nanochat_fast.scripts.base_train: error: argument --total-batch-size: "
        "must be a positive integer, got 0 (see --help)"
    ]


def test_a_real_process_with_a_bad_kernel_choice_exits_2_with_one_line(trained_home):
    out = subprocess.run(
        [sys.executable, "-m", "nanochat_fast.scripts.base_train", "--run=x"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "NANOCHAT_FAST_KERNELS": "bogus", "NANOCHAT_FAST_HOME": str(trained_home)},
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: NANOCHAT_FAST_KERNELS='bogus': unknown backend 'bogus'; use one of auto, triton, cpp, torch, reference"
    ]
