"""
The optimizers of nanochat: AdamW for the embedding and lm_head, Muon for the matrices of the
transformer blocks, each in a single-process form and a ZeRO-2 form (DistAdamW, DistMuon) that
shards gradients and optimizer state over the ranks of torch.distributed (NCCL or gloo, any shape,
any world size), and FsdpAdamW, FsdpMuon for parameters sharded by FSDP2's fully_shard (fsdp.py:
Muon's matrices orthogonalised whole by an owner rank each). All follow one step protocol and share
one world-size independent state format (zero.py), so a run can resume on a different number of
processes and sharding.

    optimizers = model.setup_optimizers(..., muon_recipe="quintic")   # or "polar-normuon", or a MuonRecipe
    ...backward...
    norm = nanochat_fast.optim.step(optimizers, grad_clip=1.0)   # global-norm clip + NaN guard (step.py)
"""

from .adamw import AdamW, DistAdamW
from .fsdp import FsdpAdamW, FsdpMuon
from .muon import DistMuon, Muon
from .recipe import MuonRecipe
from .step import global_grad_norm, step
from .zero import FORMAT, ZeroOptimizer

__all__ = [
    "AdamW",
    "DistAdamW",
    "Muon",
    "DistMuon",
    "FsdpAdamW",
    "FsdpMuon",
    "MuonRecipe",
    "step",
    "global_grad_norm",
    "ZeroOptimizer",
    "FORMAT",
]
