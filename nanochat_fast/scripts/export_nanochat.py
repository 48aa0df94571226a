"""
Write a run's checkpoint in nanochat's layout, so nanochat's own loaders read it.

    python -m nanochat_fast.scripts.export_nanochat --run=sft_d20 --out=~/nanochat_base
    NANOCHAT_BASE_DIR=~/nanochat_base python -m scripts.chat_cli -i sft      # in a nanochat checkout

Under --out (a nanochat base directory, NANOCHAT_BASE_DIR) it writes

    <phase>_checkpoints/d<n_layer>/model_NNNNNN.pt    the state_dict under nanochat's parameter names, fp32
    <phase>_checkpoints/d<n_layer>/meta_NNNNNN.json   step, val_bpb, model_config, user_config, loop_state
    tokenizer/tokenizer.pkl                           the tokenizer as a pickled tiktoken encoding
    tokenizer/token_bytes.pt                          int32 bytes per token, 0 for the special tokens

with <phase> base, mid or chatsft (our base, mid and sft runs). The optimizer state stays here:
nanochat shards it per rank in its own way, and its later stages start from fresh state anyway.
Every file is written under a temporary name and renamed into place; a different tokenizer
already in --out, or a checkpoint already there, is not replaced without --overwrite.
"""
from pathlib import Path

from ..core import checkpoint, cli, paths
from ..core.errors import UserError
from ..data import nanochat_tokenizer
from ..data.tokenizer import get_tokenizer
from ..model import loading, nanochat_checkpoint
from ..train import run_dirs
from ..train.env_vars import check_environment

FOLDER_OF_PHASE = {"base": "base_checkpoints", "mid": "mid_checkpoints", "sft": "chatsft_checkpoints"}


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.export_nanochat", description=__doc__)
    p.add_argument("--run", type=cli.run_ref, required=True, help="run name or directory")
    p.add_argument("--step", type=cli.non_negative_int, default=None,
                   help="checkpoint step (default: the newest complete one)")
    p.add_argument("--out", required=True, help="nanochat base directory to write into (NANOCHAT_BASE_DIR)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint or tokenizer already in --out")
    return p


def check_out_tokenizer(folder: Path, tokenizer, overwrite: bool):
    """A tokenizer already in --out must be this one (its other checkpoints were made with it)."""
    pkl = folder / nanochat_tokenizer.PICKLE_FILE
    if not pkl.exists() or overwrite:
        return
    state = nanochat_tokenizer.read_encoding_state(pkl)
    theirs = nanochat_tokenizer.tokenizer_from_state(state, pkl)
    if theirs.fingerprint != tokenizer.fingerprint:
        raise UserError(f"{pkl} is another tokenizer; export into another --out, or pass --overwrite to replace it")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    tokenizer = get_tokenizer()
    run_dir = run_dirs.run_dir_of(args.run, ("sft", "mid", "base"))
    ckpt, meta, config = loading.open_checkpoint(run_dir, args.step, tokenizer)
    phase = meta.get("phase")
    if phase not in FOLDER_OF_PHASE:
        raise UserError(f"{ckpt} is a {phase!r} checkpoint; nanochat has folders for base, mid and sft ones")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    folder, step = out / FOLDER_OF_PHASE[phase] / f"d{config.n_layer}", meta["step"]
    model_path = folder / nanochat_checkpoint.MODEL_FILE.format(step)
    if model_path.exists() and not args.overwrite:
        raise UserError(f"{model_path} exists; pass --overwrite to replace it")
    check_out_tokenizer(out / "tokenizer", tokenizer, args.overwrite)
    state = nanochat_checkpoint.export_state(checkpoint.load_model_state(ckpt))
    loop = meta.get("loop_state", {})
    nano_meta = nanochat_checkpoint.export_meta(
        step, config, loop.get("last_val_bpb"), user_config={**meta.get("args", {}), "exported_from": str(ckpt)},
        loop_state={"min_val_bpb": loop.get("last_val_bpb"), "smooth_train_loss": loop.get("smooth_loss"),
                    "total_training_time": loop.get("train_time")})
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint.save_torch(model_path, state)
    paths.write_json(folder / nanochat_checkpoint.META_FILE.format(step), nano_meta)
    nanochat_tokenizer.write_tokenizer_files(tokenizer, out / "tokenizer")
    print(f"exported {ckpt} ({phase}, step {step}) to {folder}: {model_path.name}, "
          f"{nanochat_checkpoint.META_FILE.format(step)}; tokenizer to {out / 'tokenizer'}")
    print(f"in a nanochat checkout: NANOCHAT_BASE_DIR={out} and load_model('{phase}', device, phase='eval', "
          f"model_tag='d{config.n_layer}', step={step})")
    return 0


if __name__ == "__main__":
    cli.run(main)
