"""
Bring a nanochat checkpoint and its tokenizer into nanochat_fast: a run of ours that every command
takes like a run trained here.

    python -m nanochat_fast.scripts.import_nanochat --from=~/.cache/nanochat/base_checkpoints/d20 \\
        --tokenizer=~/.cache/nanochat/tokenizer --run=nanochat_d20
    python -m nanochat_fast.scripts.import_nanochat --from=.../chatsft_checkpoints/d20 --step=700 \\
        --tokenizer=.../tokenizer --run=d20_sft --phase=sft

The run gets NANOCHAT_FAST_HOME/runs/<run>/ with one checkpoint at the same step: the weights as
fp32, the model config, and the optimizer state when the checkpoint has it (so `base_train
--resume=auto` goes on with its momentum); the tokenizer becomes NANOCHAT_FAST_HOME/tokenizer/ (or
must equal the one there). Nothing is unpickled blindly: tokenizer.pkl goes through a restricted
unpickler, every .pt file loads with weights_only=True. What carries over, the checks, and what
--phase decides: docs/nanochat.md.
"""

import math
from dataclasses import asdict
from pathlib import Path

import torch

from .. import checkpoints
from ..core import cli, paths
from ..core.errors import UserError
from ..data.tokenizer import RANKS_FILE, Tokenizer, get_tokenizer, save_token_bytes
from ..interop import nanochat_checkpoint, nanochat_tokenizer
from ..model import loading
from ..model.gpt import GPTConfig
from ..train.env_vars import check_environment
from ..train.run_state import LoopState


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.import_nanochat", description=__doc__)
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="DIR",
        help=f"nanochat's checkpoint folder ({nanochat_checkpoint.FOLDER_FILES})",
    )
    p.add_argument("--step", type=cli.non_negative_int, help="checkpoint step (default: the newest)")
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="DIR",
        help=f"nanochat's tokenizer folder ({nanochat_tokenizer.FOLDER_FILES})",
    )
    p.add_argument(
        "--run", type=cli.run_name, required=True, help="name of the run to create under NANOCHAT_FAST_HOME/runs"
    )
    p.add_argument(
        "--phase",
        default="",
        choices=["", "base", "mid", "sft"],
        help="what the run counts as ('': from nanochat's folder name, else base)",
    )
    p.add_argument("--no-optimizer", action="store_true", help="leave the optimizer state out (fresh state)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run of that name")
    return p


def home_tokenizer_to_write(tokenizer: Tokenizer) -> bool:
    """Whether NANOCHAT_FAST_HOME/tokenizer must be written (False: it is this tokenizer already)."""
    if not (paths.tokenizer_dir() / RANKS_FILE).is_file():
        return True
    if get_tokenizer().fingerprint == tokenizer.fingerprint:
        return False
    raise UserError(
        f"{paths.tokenizer_dir()} holds another tokenizer, which this home's runs and token shards use; "
        "import into a fresh home (NANOCHAT_FAST_HOME=DIR) or move that tokenizer away"
    )


def base_train_flags(config: GPTConfig) -> str | None:
    """base_train's model flags that rebuild `config` (None when the depth dial cannot)."""
    head_dim = config.n_embd // config.n_head
    if config.n_kv_head != config.n_head:
        return None
    for aspect in (64, config.n_embd // config.n_layer, *range(1, config.n_embd + 1)):  # nanochat's 64 first
        if math.ceil(aspect * config.n_layer / head_dim) * head_dim == config.n_embd:
            family = loading.arch_of(config)
            arch = f"--arch={family} --window-pattern={config.window_pattern} " if family != "gpt" else ""
            return (
                f"{arch}--depth={config.n_layer} --aspect-ratio={aspect} --head-dim={head_dim} "
                f"--max-seq-len={config.sequence_len}"
            )
    return None


def imported_meta(phase: str, config: GPTConfig, tokenizer: Tokenizer, loop_state: LoopState, origin: dict) -> dict:
    """meta.json of an imported run's one checkpoint: what a run trained here records, and where it came from."""
    return {
        "phase": phase,
        "arch": loading.arch_of(config),
        "model_config": asdict(config),
        "tokenizer": {"vocab_size": tokenizer.get_vocab_size(), "fingerprint": tokenizer.fingerprint},
        "args": {},
        "device": None,
        "world_size": 1,
        "loader_state": None,
        "loop_state": asdict(loop_state),
        "imported_from": origin,
    }


def what_next(phase: str, run: str, config: GPTConfig) -> str:
    """The commands an imported run of `phase` is ready for, one a line."""
    cmd = "python -m nanochat_fast.scripts."
    if phase == "base":
        steps = [f"evaluate: {cmd}base_eval --run={run}", f"mid-train: {cmd}mid_train --base-run={run}"]
        if flags := base_train_flags(config):
            steps.append(f"keep pretraining: {cmd}base_train --run={run} --resume=auto {flags} --num-iterations=N")
    else:
        steps = [f"chat: {cmd}chat_cli --run={run}", f"evaluate: {cmd}chat_eval --run={run}"]
    if phase in ("base", "mid"):
        steps.append(f"fine-tune: {cmd}chat_sft --source-run={run}")
    else:
        steps.append(f"reinforce: {cmd}chat_rl --source-run={run}")
    return "\n  ".join(["what you can run on it now:", *steps])


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    ckpt = nanochat_checkpoint.open_checkpoint(args.source, args.step)
    print(nanochat_checkpoint.meta_summary(ckpt))
    phase = args.phase or ckpt.phase
    run_dir = paths.runs_dir() / args.run
    if run_dir.exists() and any(run_dir.iterdir()) and not args.overwrite:
        raise UserError(f"run directory {run_dir} already exists: pick another --run or pass --overwrite")
    tok_dir = Path(args.tokenizer).expanduser()
    tokenizer, n, old_bytes = nanochat_tokenizer.read_tokenizer(tok_dir, ckpt.config.vocab_size)
    print(
        f"tokenizer: {tokenizer.get_vocab_size():,} tokens; same ids as nanochat's on a {n}-token multilingual "
        "sample with every special token"
    )
    if old_bytes:
        print(nanochat_tokenizer.old_token_bytes_notice(tok_dir, old_bytes, tokenizer.get_vocab_size()))
    write_tokenizer = home_tokenizer_to_write(tokenizer)
    model_state = nanochat_checkpoint.model_state(ckpt)
    shards, optim_line = nanochat_checkpoint.optimizer_shards(
        ckpt, {k: tuple(v.shape) for k, v in model_state.items()}, args.no_optimizer
    )
    print(optim_line)
    loop_state, origin = nanochat_checkpoint.carried_meta(ckpt, bool(shards[0]["num_updates"] or shards[1]["state"]))
    if old_bytes:  # base_eval reports the bpb nanochat's own file gives beside the true one
        origin["nanochat_token_bytes"] = {str(i): b for i, b in old_bytes.items()}
    meta = imported_meta(phase, ckpt.config, tokenizer, LoopState(**loop_state), origin)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with checkpoints.new_run_dir(run_dir) as tmp:  # built under a temporary name, then renamed
        rank_state = {"optimizers": shards, "rng": {"cpu": torch.get_rng_state()}}
        checkpoints.save_checkpoint(tmp, ckpt.step, model_state=model_state, rank_state=rank_state, meta=meta)
        if write_tokenizer:
            save_token_bytes(tokenizer, tokenizer.save(paths.tokenizer_dir()))
    print(
        f"imported as {phase} run {run_dir} (checkpoint step {ckpt.step}); tokenizer "
        f"{'written to' if write_tokenizer else 'already in'} {paths.tokenizer_dir()}"
    )
    print(what_next(phase, args.run, ckpt.config))
    return 0


if __name__ == "__main__":
    cli.run(main)
