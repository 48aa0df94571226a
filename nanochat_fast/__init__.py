"""nanochat_fast: train small ChatGPT-style models the nanochat way, with fused kernels."""

__version__ = "0.1.0"
