"""The public name of the model (`from nanochat_fast.gpt import GPT, GPTConfig`): the code lives in
model/gpt.py."""

from .model.gpt import GPT, GPTConfig, config_from_depth

__all__ = [
    "GPT",
    "GPTConfig",
    "config_from_depth",
]
