"""
Making a GPT of either family and loading a trained one, for every script: models are built on the meta
device and materialised where they run; a checkpoint's family (meta.json's "arch") picks the class, and it
must match the model config and the tokenizer. Setting a model up for training is train/model_setup.py.
"""

from dataclasses import asdict
from pathlib import Path

import torch

from .. import checkpoints
from ..core import paths
from ..core.errors import UserError
from .gpt import GPT, GPTConfig
from .windowed_gpt import WindowedGPT, WindowedGPTConfig

# the model families: --arch's values and meta.json's "arch" -> (config class, model class)
FAMILIES = {"gpt": (GPTConfig, GPT), "windowed": (WindowedGPTConfig, WindowedGPT)}


def arch_of(config: GPTConfig) -> str:
    return next(name for name, (cls, _) in FAMILIES.items() if type(config) is cls)


def config_of(meta: dict, ckpt: Path) -> GPTConfig:
    """The model config a checkpoint's meta.json describes, of its family."""
    arch = meta.get("arch", "gpt")  # runs saved before families existed have no "arch"
    if arch not in FAMILIES:
        raise UserError(f"checkpoint {ckpt} is of model family {arch!r}, which this nanochat_fast does not know")
    try:
        return FAMILIES[arch][0](**meta["model_config"])
    except (TypeError, ValueError) as e:
        raise UserError(f"checkpoint {ckpt}: its model_config is not a {arch} model ({e})") from None


def family_config(config: GPTConfig, arch: str, window_pattern: str) -> GPTConfig:
    """A depth's `config` as family `arch`'s: the windowed GPT adds its window pattern (else ignored)."""
    return WindowedGPTConfig(**asdict(config), window_pattern=window_pattern) if arch == "windowed" else config


def config_from_fields(fields: dict) -> GPTConfig:
    """A config back from its fields (the dtype timings' cache keys), of its family."""
    return (WindowedGPTConfig if "window_pattern" in fields else GPTConfig)(**fields)


def meta_model(config: GPTConfig) -> GPT:
    """The model of config's family on the meta device: shapes, parameters and FLOPs, no storage."""
    with torch.device("meta"):
        return FAMILIES[arch_of(config)][1](config)


def check_arch(wanted: str, config: GPTConfig, ckpt: Path):
    """A run that names --arch must start from a checkpoint of that family."""
    if wanted and wanted != arch_of(config):
        raise UserError(
            f"checkpoint {ckpt} is a {arch_of(config)} model but --arch={wanted}: drop --arch (the "
            f"checkpoint decides) or pass --arch={arch_of(config)}"
        )


def new_model(config: GPTConfig, device, state: dict | None = None) -> GPT:
    """The model of config's family on `device`, initialised (the rotary buffers too), then loaded with `state`."""
    model = meta_model(config)
    model.to_empty(device=device)
    model.init_weights()
    if state is not None:
        model.load_state_dict(state)
    return model


def check_tokenizer(meta: dict, ckpt: Path, tokenizer):
    saved = meta.get("tokenizer", {})
    if saved.get("vocab_size") != tokenizer.get_vocab_size() or (
        saved.get("fingerprint") and saved.get("fingerprint") != tokenizer.fingerprint
    ):
        raise UserError(
            f"the tokenizer in {paths.tokenizer_dir()} (vocab {tokenizer.get_vocab_size()}) is not the one "
            f"checkpoint {ckpt} was trained with (vocab {saved.get('vocab_size')}); restore that tokenizer "
            "or train a new model"
        )


def check_compatible(meta: dict, ckpt: Path, config: GPTConfig, tokenizer):
    """A checkpoint to resume must be of the same model config and tokenizer as this run."""
    check_arch(arch_of(config), config_of(meta, ckpt), ckpt)
    saved, wanted = meta["model_config"], asdict(config)
    diff = [f"{k}={saved.get(k)} (this run: {v})" for k, v in wanted.items() if saved.get(k) != v]
    if diff:
        raise UserError(
            f"checkpoint {ckpt} is of another model config: {', '.join(diff)}; pass the flags it was "
            "trained with (see its meta.json) or start a new --run"
        )
    check_tokenizer(meta, ckpt, tokenizer)


def open_checkpoint(run_dir: Path, step: int | None, tokenizer):
    """(checkpoint path, meta, GPTConfig) of run_dir's checkpoint at `step` (None: the newest complete one)."""
    ckpt = checkpoints.resolve_checkpoint(run_dir, step)
    meta = checkpoints.load_meta(ckpt)
    check_tokenizer(meta, ckpt, tokenizer)
    return ckpt, meta, config_of(meta, ckpt)


def restore_model(ckpt: Path, config: GPTConfig, device) -> GPT:
    """An opened checkpoint's model on `device`, in eval mode."""
    return new_model(config, device, checkpoints.load_model_state(ckpt, device)).eval()


def load_model(run_dir: Path, step: int | None, device, tokenizer):
    """(model in eval mode, checkpoint path, meta) for inference."""
    ckpt, meta, config = open_checkpoint(run_dir, step, tokenizer)
    return restore_model(ckpt, config, device), ckpt, meta
