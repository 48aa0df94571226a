"""
How a GPT's weights are spread over the ranks (--sharding): zero2 (the default) keeps the whole model on
every rank and shards the optimizer state (optim/zero.py); fsdp runs FSDP2's fully_shard on every block
and the root, parameters, gradients and state sharded by rows, blocks gathered in the run's compute dtype
and gradients reduced in fp32 (optim/fsdp.py's optimizers). A forward on some ranks only would wait for
the others' share of a gather: `whole_weights` gathers the weights once into a plain GPT.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist


def shard(model: torch.nn.Module, compute_dtype: torch.dtype) -> torch.nn.Module:
    """fully_shard every block of `model` (a GPT), then the root, in place; its optimizers come after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype, reduce_dtype=torch.float32
    )
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def whole_weights(model: torch.nn.Module):
    """A plain GPT with `model`'s whole weights (`model` itself when not sharded), for forwards on some ranks
    only: FSDP's hooks there would also put its record of the forward order out of step with the others'."""
    if not is_sharded(model):
        yield model
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ..hardware.machine import rng_untouched
    from .loading import new_model

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    device = next(iter(state.values())).device
    with rng_untouched(device):  # the copy's init, overwritten at once, must not move the run's random stream
        plain = new_model(model.config, device, state)
    plain.train(model.training)
    try:
        yield plain
    finally:
        del plain, state


def model_state_dict(model: torch.nn.Module, full: bool = False) -> dict:
    """The state_dict a checkpoint saves: DTensors (each rank's rows) when sharded; `full`: on rank 0's CPU."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
