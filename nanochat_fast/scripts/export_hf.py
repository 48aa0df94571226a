"""
Write a run's checkpoint as a Hugging Face transformers model folder.

    python -m nanochat_fast.scripts.export_hf --run=sft_d20 --out=~/d20-hf

The folder holds config.json, model.safetensors (fp32), generation_config.json, tokenizer.json,
tokenizer_config.json and chat_template.jinja: AutoModelForCausalLM.from_pretrained(DIR) and
AutoTokenizer.from_pretrained(DIR) load it, the gpt family as transformers' own NanoChatForCausalLM.
The windowed family also gets modeling_nanochat_windowed.py (load both with trust_remote_code=True;
it needs torch and transformers, not nanochat_fast). The folder is built under a temporary name and
renamed into place; a non-empty --out is replaced only with --overwrite. docs/guide.md has more.
"""

from pathlib import Path

from .. import checkpoints, interop
from ..core import cli
from ..data.tokenizer import get_tokenizer
from ..model import loading
from ..train.env_vars import check_environment


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.export_hf", description=__doc__)
    cli.add_checkpoint_flags(p, newest="the newest sft, mid or base run")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (absent or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    hf_folder = interop.hf_folder_module("export_hf")
    out = Path(args.out).expanduser()
    hf_folder.check_out(out, args.overwrite)
    tokenizer = get_tokenizer()
    run_dir = checkpoints.run_dir_of(args.run, ("sft", "mid", "base"))
    ckpt, meta, config = loading.open_checkpoint(run_dir, args.step, tokenizer)
    record = {"phase": meta.get("phase"), "step": meta["step"], "run": run_dir.name}
    hf_folder.write_folder(out, checkpoints.load_model_state(ckpt), config, tokenizer, record)
    family = loading.arch_of(config)
    print(f"exported {ckpt} ({family} family, {meta.get('phase')}, step {meta['step']}) to {out}")
    remote = ", trust_remote_code=True" if family != "gpt" else ""
    print(
        f"in Python: AutoModelForCausalLM.from_pretrained({str(out)!r}{remote}) and "
        f"AutoTokenizer.from_pretrained({str(out)!r}{remote})"
    )
    return 0


if __name__ == "__main__":
    cli.run(main)
