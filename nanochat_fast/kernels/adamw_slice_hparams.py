"""
The hyperparameter tensor of adamw_slice_update: its layout, named once for Python.

Every backend reads the step's hyperparameters from one small tensor (float64; float32 on MPS,
which has no fp64) instead of Python floats, so a learning-rate schedule neither recompiles a
compiled step nor makes the host wait for the GPU. Slot i holds HPARAMS[i]:

    lr, beta1, beta2, eps, weight_decay     as passed
    bias_correction1                        1 - beta1^step
    bias_correction2_sqrt                   sqrt(1 - beta2^step)

The C++ and CUDA kernels name the same slots in csrc/adamw_slice_hparams.h (kLr, kBeta1, ...);
python_tests/test_adamw_slice.py checks that the two lists agree. The Triton kernel and the
reference read slots through SLOT by name, never by a literal offset.
"""

import math

import torch

HPARAMS = ("lr", "beta1", "beta2", "eps", "weight_decay", "bias_correction1", "bias_correction2_sqrt")
SLOT = {name: i for i, name in enumerate(HPARAMS)}


def make_hparams(step, lr, beta1, beta2, eps, weight_decay, device) -> torch.Tensor:
    """The hyperparameter tensor for update number `step` (1-based), on `device`. Python numbers
    give one host tensor copied once; 0-D tensors (e.g. an lr on the GPU) are combined on device."""
    device = torch.device(device)
    dtype = torch.float32 if device.type == "mps" else torch.float64
    given = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    if not any(isinstance(v, torch.Tensor) for v in (step, *given.values())):
        values = dict(given, bias_correction1=1.0 - beta1**step, bias_correction2_sqrt=math.sqrt(1.0 - beta2**step))
        return torch.tensor([values[name] for name in HPARAMS], dtype=dtype, device=device)
    step = torch.as_tensor(step, dtype=dtype, device=device)
    values = {k: torch.as_tensor(v, dtype=dtype, device=device) for k, v in given.items()}
    values.update(
        bias_correction1=1.0 - values["beta1"] ** step, bias_correction2_sqrt=torch.sqrt(1.0 - values["beta2"] ** step)
    )
    return torch.stack([values[name] for name in HPARAMS])
