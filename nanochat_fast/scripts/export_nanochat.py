"""
Write a run's checkpoint in nanochat's layout, so nanochat's own loaders read it.

    python -m nanochat_fast.scripts.export_nanochat --run=sft_d20 --out=~/nanochat_base
    NANOCHAT_BASE_DIR=~/nanochat_base python -m scripts.chat_cli -i sft      # in a nanochat checkout

Under --out (a nanochat base directory, NANOCHAT_BASE_DIR) it writes

    <phase>_checkpoints/d<n_layer>/model_NNNNNN.pt    the state_dict under nanochat's parameter names, fp32
    <phase>_checkpoints/d<n_layer>/meta_NNNNNN.json   step, val_bpb, model_config, user_config, loop_state
    tokenizer/tokenizer.pkl, tokenizer/token_bytes.pt the tokenizer (a pickled tiktoken encoding; int32
                                                      bytes per token, 0 for the special tokens)

with <phase> base, mid or chatsft (our base, mid and sft runs); not the optimizer state (nanochat's
later stages start fresh anyway). Files are written under a temporary name and renamed into place;
a different tokenizer or a checkpoint already in --out is not replaced without --overwrite.
"""

from pathlib import Path

from .. import checkpoints
from ..core import cli
from ..core.errors import UserError
from ..data.tokenizer import get_tokenizer
from ..interop import nanochat_checkpoint, nanochat_tokenizer
from ..model import loading
from ..train.env_vars import check_environment


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.export_nanochat", description=__doc__)
    cli.add_checkpoint_flags(p, required=True)
    p.add_argument("--out", required=True, help="nanochat base directory to write into (NANOCHAT_BASE_DIR)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint or tokenizer already in --out")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    tokenizer = get_tokenizer()
    run_dir = checkpoints.run_dir_of(args.run, ("sft", "mid", "base"))
    ckpt, meta, config = loading.open_checkpoint(run_dir, args.step, tokenizer)
    phase = meta.get("phase")
    if phase not in nanochat_checkpoint.FOLDER_OF_PHASE:
        raise UserError(f"{ckpt} is a {phase!r} checkpoint; nanochat has folders for base, mid and sft ones")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    step = meta["step"]
    model_path, meta_path = nanochat_checkpoint.export_paths(out, phase, config.n_layer, step)
    if model_path.exists() and not args.overwrite:
        raise UserError(f"{model_path} exists; pass --overwrite to replace it")
    tokenizer_dir = out / nanochat_tokenizer.FOLDER
    nanochat_tokenizer.check_out_tokenizer(tokenizer_dir, tokenizer, args.overwrite)
    nanochat_checkpoint.write_checkpoint(model_path, meta_path, checkpoints.load_model_state(ckpt), config, meta, ckpt)
    nanochat_tokenizer.write_tokenizer_files(tokenizer, tokenizer_dir)
    print(
        f"exported {ckpt} ({phase}, step {step}) to {model_path.parent}: {model_path.name}, "
        f"{meta_path.name}; tokenizer to {tokenizer_dir}"
    )
    print(
        f"in a nanochat checkout: NANOCHAT_BASE_DIR={out} and load_model('{phase}', device, phase='eval', "
        f"model_tag='d{config.n_layer}', step={step})"
    )
    return 0


if __name__ == "__main__":
    cli.run(main)
