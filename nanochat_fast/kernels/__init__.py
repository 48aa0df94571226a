"""
The hot paths of nanochat_fast, each an op with several backends chosen per device (registry.py):
adamw_slice_update, newton_schulz, softcap_cross_entropy (training), pack_rows (the loader), and the
decode step's packed_linear, rms_norm, softcap, decode_attention, decode_block and smear_decode.
`python -m nanochat_fast.kernels` prints which backend each op uses here and why.
"""

# ruff: noqa: F401  (the package's interface)
from .adamw_slice import adamw_slice_update
from .decode_step import decode_attention, decode_block, pack_linear, rms_norm, smear_decode, softcap
from .newton_schulz import newton_schulz
from .pack_rows import pack_rows
from .registry import KernelUnavailableError, backends, ops, requested, select
from .softcap_cross_entropy import softcap_cross_entropy
