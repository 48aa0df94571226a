"""
Bring a Hugging Face transformers nanochat folder into nanochat_fast as a run.

    python -m nanochat_fast.scripts.import_hf --from=~/d20-hf --run=d20 [--phase=sft]

The folder is one export_hf wrote, or one transformers' save_pretrained of a NanoChatForCausalLM
wrote (what its nanochat converter makes): config.json, model.safetensors (or its shards) and
tokenizer.json, whose BPE and special tokens must be nanochat's. Every setting that changes the
logits is checked against what our model computes, and the import stops with one line where it
differs. The run gets NANOCHAT_FAST_HOME/runs/<run>/ with one fp32 checkpoint and fresh optimizer
state; the tokenizer becomes NANOCHAT_FAST_HOME/tokenizer/ (or must equal the one there). Then
it trains (mid_train, chat_sft, chat_rl), evaluates and chats like any other run.
"""

from pathlib import Path

import torch

from .. import checkpoints, interop
from ..core import cli, paths
from ..core.errors import UserError
from ..data.tokenizer import save_token_bytes
from ..interop import nanochat_checkpoint
from ..model import loading
from ..train.env_vars import check_environment
from ..train.run_state import LoopState
from . import import_nanochat


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.import_hf", description=__doc__)
    p.add_argument("--from", dest="source", required=True, metavar="DIR", help="the transformers model folder")
    p.add_argument(
        "--run", type=cli.run_name, required=True, help="name of the run to create under NANOCHAT_FAST_HOME/runs"
    )
    p.add_argument(
        "--phase",
        default="",
        choices=["", "base", "mid", "sft"],
        help="what the run counts as ('': what export_hf recorded in config.json, else base)",
    )
    p.add_argument(
        "--accept-norm-eps",
        action="store_true",
        help="import a config.json whose rms_norm_eps is not ours (float32's epsilon); the logits then differ slightly",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing run of that name")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    hf_folder = interop.hf_folder_module("import_hf")
    folder = Path(args.source).expanduser()
    if not folder.is_dir():
        raise UserError(f"--from {folder}: no such folder (give a transformers model folder)")
    run_dir = paths.runs_dir() / args.run
    if run_dir.exists() and any(run_dir.iterdir()) and not args.overwrite:
        raise UserError(f"run directory {run_dir} already exists: pick another --run or pass --overwrite")
    config, state, tokenizer, record = hf_folder.read_folder(folder, args.accept_norm_eps)
    write_tokenizer = import_nanochat.home_tokenizer_to_write(tokenizer)
    phase = args.phase or (record.get("phase") if record.get("phase") in ("base", "mid", "sft") else "base")
    step = record.get("step") if isinstance(record.get("step"), int) and record["step"] >= 0 else 0
    origin = {"hf_folder": str(folder), **record}
    meta = import_nanochat.imported_meta(phase, config, tokenizer, LoopState(step=step), origin)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with checkpoints.new_run_dir(run_dir) as tmp:  # built under a temporary name, then renamed
        rank_state = {
            "optimizers": nanochat_checkpoint.fresh_optimizer_shards(config),
            "rng": {"cpu": torch.get_rng_state()},
        }
        checkpoints.save_checkpoint(tmp, step, model_state=state, rank_state=rank_state, meta=meta)
        if write_tokenizer:
            save_token_bytes(tokenizer, tokenizer.save(paths.tokenizer_dir()))
    print(
        f"imported {folder} ({loading.arch_of(config)} family) as {phase} run {run_dir} (checkpoint step {step}); "
        f"tokenizer {'written to' if write_tokenizer else 'already in'} {paths.tokenizer_dir()}"
    )
    print(import_nanochat.what_next(phase, args.run, config))
    return 0


if __name__ == "__main__":
    cli.run(main)
