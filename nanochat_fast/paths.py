"""
Where nanochat_fast keeps its files: everything lives under NANOCHAT_FAST_HOME
(default ~/.cache/nanochat_fast):

    data/<dataset>/{train,val}/*.parquet     prepared text / conversations
    tokens/<dataset>/...                     pre-tokenized shards
    tokenizer/                               BPE ranks, pattern, special tokens, token_bytes.pt
    runs/<run>/checkpoints/step_NNNNNN/      model.pt, optim_rank<R>.pt, meta.json, COMPLETE
    runs/<run>/{metrics.jsonl, loss.png, report.md}
"""
import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("NANOCHAT_FAST_HOME") or Path.home() / ".cache" / "nanochat_fast").expanduser()


def data_dir(dataset: str) -> Path:
    return home() / "data" / dataset


def tokens_dir(dataset: str) -> Path:
    return home() / "tokens" / dataset


def tokenizer_dir() -> Path:
    return home() / "tokenizer"


def runs_dir() -> Path:
    return home() / "runs"
