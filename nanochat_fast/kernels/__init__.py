"""
The hot paths of nanochat_fast, each with several backends chosen per device (see registry.py):

    adamw_slice_update   AdamW over the parameter slices a rank owns
    newton_schulz        Newton-Schulz orthogonalization (Muon)

`python -m nanochat_fast.kernels` prints which backend each op uses here and why.
"""
from .registry import KernelUnavailableError, backends, ops, requested, select
from .adamw import adamw_slice_update
from .newton_schulz import newton_schulz

__all__ = ["adamw_slice_update", "newton_schulz",
           "KernelUnavailableError", "backends", "ops", "requested", "select"]
