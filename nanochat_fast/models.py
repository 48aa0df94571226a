"""
Building a GPT for a run, and loading trained ones.

    new_model(config, device, state)        a GPT on `device`, initialised (and loaded with `state`)
    build_for_training(...)                 + its optimizers
    compile_for_training(model, ...)        the module the training step calls: compiled or not, and why
    open_checkpoint(run_dir, step, tok)     (checkpoint, meta, GPTConfig), checked against the tokenizer
    load_model(run_dir, step, device, tok)  a trained model in eval mode, for evaluation and chat

Every script that needs a model goes through here, so the rules live once: models are built on
the meta device and materialised where they run, checkpoints must match the model config and the
tokenizer, and whether to torch.compile is decided by `compile_for_training`.
"""
from dataclasses import asdict
from pathlib import Path

import torch

from . import checkpoint, paths
from .compiling import default_compile
from .errors import UserError
from .gpt import GPT, GPTConfig


def new_model(config: GPTConfig, device, state: dict | None = None) -> GPT:
    """GPT(config) built on the meta device and materialised on `device` with nanochat's init
    (which also fills the rotary buffers, not saved in checkpoints), then loaded with `state`."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
    if state is not None:
        model.load_state_dict(state)
    return model


def build_for_training(config: GPTConfig, device, optimizer_kwargs: dict, state: dict | None = None):
    """(the model, [adamw, muon]): the optimizers hold the plain module's parameters."""
    model = new_model(config, device, state)
    return model, model.setup_optimizers(**optimizer_kwargs)


def compile_for_training(model: GPT, requested: bool | None, device, run_tokens: int | None,
                         peak_flops: float | None, varying_shapes: bool = False):
    """(the module the training step calls, why): torch.compile'd or `model` itself.
    --compile/--no-compile as given; by default compiling.default_compile's rule (CUDA and CPU
    unless the run's FLOPs, model.estimate_flops() x run_tokens, are too few at peak_flops: the
    peak of all processes), and eager where the rows' length varies from batch to batch (padded
    conversations), which would compile a new graph for every length."""
    if requested is not None:
        on, why = requested, f"{'compiled' if requested else 'eager'}: {'--compile' if requested else '--no-compile'}"
    elif varying_shapes:
        on, why = False, "eager: the rows' length varies from batch to batch (one compile per length)"
    else:
        run_flops = model.estimate_flops() * run_tokens if run_tokens else None
        on, why = default_compile(torch.device(device).type, run_flops, peak_flops)
    # dynamic=False: one training shape; evaluation and sampling use the plain module (compiling.py)
    return (torch.compile(model, dynamic=False) if on else model), why


def check_tokenizer(meta: dict, ckpt: Path, tokenizer):
    saved = meta.get("tokenizer", {})
    if saved.get("vocab_size") != tokenizer.get_vocab_size() or (
            saved.get("fingerprint") and saved.get("fingerprint") != tokenizer.fingerprint):
        raise UserError(f"the tokenizer in {paths.tokenizer_dir()} (vocab {tokenizer.get_vocab_size()}) is not the one "
                        f"checkpoint {ckpt} was trained with (vocab {saved.get('vocab_size')}); restore that tokenizer "
                        "or train a new model")


def check_compatible(meta: dict, ckpt: Path, config: GPTConfig, tokenizer):
    """A checkpoint to resume must be of the same model config and tokenizer as this run."""
    saved, wanted = meta["model_config"], asdict(config)
    diff = [f"{k}={saved.get(k)} (this run: {v})" for k, v in wanted.items() if saved.get(k) != v]
    if diff:
        raise UserError(f"checkpoint {ckpt} is of another model config: {', '.join(diff)}; pass the flags it was "
                        "trained with (see its meta.json) or start a new --run")
    check_tokenizer(meta, ckpt, tokenizer)


def open_checkpoint(run_dir: Path, step: int | None, tokenizer):
    """(checkpoint path, meta, GPTConfig) of run_dir's checkpoint at `step` (None: the newest
    complete one), made with `tokenizer`."""
    ckpt = checkpoint.resolve_checkpoint(run_dir, step)
    meta = checkpoint.load_meta(ckpt)
    check_tokenizer(meta, ckpt, tokenizer)
    return ckpt, meta, GPTConfig(**meta["model_config"])


def load_model(run_dir: Path, step: int | None, device, tokenizer):
    """(model in eval mode, checkpoint path, meta) for inference."""
    ckpt, meta, config = open_checkpoint(run_dir, step, tokenizer)
    model = new_model(config, device, checkpoint.load_model_state(ckpt, device))
    model.eval()
    return model, ckpt, meta
