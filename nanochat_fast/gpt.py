"""SPEC's public name for the model (`from nanochat_fast.gpt import GPT, GPTConfig`): a re-export,
nothing more; the code lives in model/gpt.py."""

from .model.gpt import GPT, GPTConfig, config_from_depth  # noqa: F401
