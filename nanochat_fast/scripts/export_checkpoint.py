"""
Write a checkpoint's weights as one file of whole fp32 tensors.

    python -m nanochat_fast.scripts.export_checkpoint --run=base_d32            # newest checkpoint
    python -m nanochat_fast.scripts.export_checkpoint --run=base_d32 --step=2000 --output=d32.pt

A run trained with --sharding=fsdp saves its model as shards (torch.distributed.checkpoint, one file per rank, in
the checkpoint's model/ folder). Every reader (chat_cli, chat_web, base_eval, chat_eval, a later stage) assembles
them by itself; this command does it once: by default it writes model.pt into the checkpoint, which the readers
then load directly, or --output a file anywhere (a state_dict for torch.load). One process, no GPU needed.
"""

from pathlib import Path

from .. import checkpoints
from ..core import cli
from ..core.errors import UserError
from ..train.env_vars import check_environment


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.export_checkpoint", description=__doc__)
    cli.add_checkpoint_flags(p)
    p.add_argument("--output", default="", help="file to write (default: model.pt inside the checkpoint directory)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    run_dir = checkpoints.run_dir_of(args.run, ("sft", "mid", "base"))
    ckpt = checkpoints.resolve_checkpoint(run_dir, args.step)
    output = Path(args.output).expanduser() if args.output else None
    if output is not None and (output.is_dir() or not output.parent.is_dir()):
        raise UserError(f"--output {args.output}: give a file name in an existing directory")
    written = checkpoints.export_model(ckpt, output)
    print(f"exported {ckpt} -> {written}")
    return 0


if __name__ == "__main__":
    cli.run(main)
