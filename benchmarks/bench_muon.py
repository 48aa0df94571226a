"""One Muon step over the matrices of a depth-8 GPT: ours vs torch.optim.Muon.

depth 8 -> n_embd 512, 8 layers of q, k, v, o (512x512) and the MLP's 2048x512 and 512x2048: 48 fp32
matrices, 25.2M values. Both optimizers get the same lr (0.02), momentum (0.95, Nesterov), 5 quintic
Newton-Schulz steps and update scale (torch's adjust_lr_fn="original" is max(1, rows/cols)^0.5,
ours too), weight_decay=0 for torch's. Ours groups same-shape matrices and orthogonalizes each
group with one newton_schulz call (fp32 on CPU, bf16 Triton on a GPU); torch.optim.Muon runs one
matrix at a time, in bf16 on every device. Before timing, one step of each from the same state is
checked to give the same update (to bf16 accuracy), so the comparison is like for like.
"""
import contextlib
import os

import torch

from harness import compare
from nanochat_fast.gpt import GPT, config_from_depth
from nanochat_fast.kernels.newton_schulz import QUINTIC
from nanochat_fast.optim import Muon

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(lr=0.02, momentum=0.95, nesterov=True)


def depth8_matrices():
    """(name, shape) of the Muon-optimized matrices of a depth-8 GPT, read from the model itself."""
    with torch.device("meta"):
        model = GPT(config_from_depth(8, vocab_size=256, sequence_len=64))
    return [(name, tuple(p.shape)) for name, p in model.transformer.h.named_parameters()]


def make_params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).mul_(0.02).to(DEVICE)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(DEVICE)
    return params


@contextlib.contextmanager
def kernels_env(value):
    """NANOCHAT_FAST_KERNELS=value for the duration (None: leave it as it is)."""
    old = os.environ.get("NANOCHAT_FAST_KERNELS")
    if value is not None:
        os.environ["NANOCHAT_FAST_KERNELS"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("NANOCHAT_FAST_KERNELS", None)
        else:
            os.environ["NANOCHAT_FAST_KERNELS"] = old


def ours(shapes, kernels=None):
    params = make_params(shapes)
    opt = Muon([(f"m{i}", p) for i, p in enumerate(params)], ns_steps=5, ns_coefficients="quintic", **HP)

    def step():
        with kernels_env(kernels):
            opt.step()
    return params, step


def torch_muon(shapes):
    params = make_params(shapes)
    opt = torch.optim.Muon(params, weight_decay=0.0, ns_coefficients=QUINTIC, ns_steps=5, eps=1e-7,
                           adjust_lr_fn="original", **HP)
    return params, opt.step


def check_same_update(shapes):
    """One step from identical params, grads and (zero) momentum: the updates agree."""
    (p_ours, step_ours), (p_torch, step_torch) = ours(shapes), torch_muon(shapes)
    start = [p.detach().clone() for p in p_ours]
    step_ours()
    step_torch()
    for s, a, b in zip(start, p_ours, p_torch):
        da, db = (a.detach() - s).double(), (b.detach() - s).double()
        assert (da - db).abs().max() <= 0.05 * da.abs().max(), "torch.optim.Muon computes a different update"


def test_muon_step_depth8_gpt(benchmark):
    named = depth8_matrices()
    shapes = [s for _, s in named]
    check_same_update(shapes)
    kinds = sorted({s for s in shapes})
    variants = {"ours (auto backend)": ours(shapes)[1],
                "torch.optim.Muon": torch_muon(shapes)[1],
                "ours, reference newton_schulz": ours(shapes, kernels="newton_schulz=reference")[1]}
    compare(benchmark, op=f"Muon step ({DEVICE})", baseline="torch.optim.Muon", rounds=7, warmup_rounds=1,
            shape_set=f"depth-8 GPT: {len(shapes)} matrices, {sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f}M fp32 "
                      f"({', '.join(f'{shapes.count(k)}x {k[0]}x{k[1]}' for k in kinds)})",
            variants=variants,
            notes="same lr, momentum, Nesterov, 5 quintic steps and update scale; torch.optim.Muon "
                  "computes Newton-Schulz in bf16 on every device (CPUs with AVX512-BF16 run bf16 "
                  "matmuls at ~2.2x their fp32 rate), ours in fp32 on CPU")
