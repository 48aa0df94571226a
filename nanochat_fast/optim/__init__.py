"""
The optimizers of nanochat: AdamW for the embedding and lm_head, Muon for the matrices of the
transformer blocks; each in one process, ZeRO-2 over torch.distributed (DistAdamW, DistMuon) and
over FSDP2's shards (FsdpAdamW, FsdpMuon), all with one world-size independent state format.

    optimizers = model.setup_optimizers(..., muon_recipe="quintic")   # or "polar-normuon", or a MuonRecipe
    norm = nanochat_fast.optim.step(optimizers, grad_clip=1.0)   # global-norm clip + NaN guard (zero.py)
"""

# ruff: noqa: F401  (the package's interface)
from .adamw import AdamW, DistAdamW
from .fsdp import FsdpAdamW, FsdpMuon
from .muon import DistMuon, Muon
from .recipe import MuonRecipe
from .zero import FORMAT, ZeroOptimizer, step
