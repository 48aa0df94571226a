"""A process once set up: where it runs, its rank, its compute dtype and the kernels that run there.
train.training_config.DeviceConfig.init makes one; the loop, evaluation and chat read it."""

from dataclasses import dataclass

import torch

from . import precision


@dataclass(frozen=True)
class ProcessSetup:
    ddp: bool
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    precision: precision.Precision
    kernels: dict  # op -> backend that runs here

    def autocast(self):
        return precision.autocast(self.device, self.precision)

    def describe(self, precision: bool = True) -> str:
        """The device lines of a script's log; a training stage prints its precision later, once
        it is measured at the run's shapes."""
        dtype = f" | precision: {self.precision.describe()}" if precision else ""
        return (
            f"device: {self.device} x {self.world_size} process(es){dtype}\n"
            f"kernels: {', '.join(f'{op}={name}' for op, name in self.kernels.items())}"
        )
