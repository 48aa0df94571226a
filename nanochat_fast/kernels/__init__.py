"""
The hot paths of nanochat_fast, each with several backends chosen per device (see registry.py):

    adamw_slice_update   AdamW over the parameter slices a rank owns
    decode_attention     a decode step's attention from the projections on (rotary, QK-norm, the
                         cache writes), each row over its own cached entries
    decode_block         a decode step's whole block (the seeds' GPT, the windowed family)
    newton_schulz        Newton-Schulz orthogonalization (Muon)
    packed_linear        few-row products (decode steps) through a packed copy of the weight
    pack_rows            best-fit packing of documents into BOS-aligned training rows
    rms_norm             the models' RMSNorm where no gradient is wanted (decode steps, evaluation)
    smear_decode         the windowed family's smear in a decode step
    softcap              the models' logit softcap where no gradient is wanted (decode steps, sampling)
    softcap_cross_entropy  the lm_head's softcapped cross-entropy, in row chunks (no full logits)

`python -m nanochat_fast.kernels` prints which backend each op uses here and why.
"""

from .adamw_slice import adamw_slice_update
from .decode_attention import decode_attention
from .decode_block import decode_block
from .newton_schulz import newton_schulz
from .pack_rows import pack_rows
from .packed_linear import pack_linear
from .registry import KernelUnavailableError, backends, ops, requested, select
from .rms_norm import rms_norm
from .smear import smear_decode
from .softcap import softcap
from .softcap_cross_entropy import softcap_cross_entropy

__all__ = [
    "adamw_slice_update",
    "decode_attention",
    "decode_block",
    "newton_schulz",
    "pack_linear",
    "pack_rows",
    "rms_norm",
    "smear_decode",
    "softcap",
    "softcap_cross_entropy",
    "KernelUnavailableError",
    "backends",
    "ops",
    "requested",
    "select",
]
