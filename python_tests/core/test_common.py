"""Process setup in a single process: device choice, user errors, seeding, determinism, rank-0
printing. The multi-process side (gloo under torchrun and spawn, all_reduce_sum across ranks)
runs in distributed/test_dist_parity.py."""

import pytest
import torch

from nanochat_fast.core import distributed
from nanochat_fast.core.cli import UserError
from nanochat_fast.core.distributed import (
    all_reduce_sum,
    autodetect_device_type,
    compute_cleanup,
    compute_init,
    get_dist_info,
    print0,
)

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


@pytest.fixture
def plain_process(monkeypatch):
    """No torchrun environment; determinism switched back off afterwards."""
    for k in TORCHRUN_VARS:
        monkeypatch.delenv(k, raising=False)
    yield
    distributed.set_deterministic(False)


def fake_torchrun(monkeypatch, rank, world_size):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))


def test_single_process_init(plain_process):
    assert get_dist_info() == (False, 0, 0, 1)
    ddp, rank, local_rank, world_size, device = compute_init("cpu")
    assert (ddp, rank, local_rank, world_size, device) == (False, 0, 0, 1, torch.device("cpu"))
    assert not torch.distributed.is_initialized()
    compute_cleanup()  # nothing to tear down: no error


def test_autodetect_prefers_cuda_then_mps(plain_process, monkeypatch):
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert autodetect_device_type() == expected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert autodetect_device_type() == "mps"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert autodetect_device_type() == "cuda"


def test_dist_info_from_torchrun_environment(monkeypatch):
    fake_torchrun(monkeypatch, 1, 4)
    assert get_dist_info() == (True, 1, 1, 4)


def test_seed_and_deterministic_flag(plain_process):
    compute_init("cpu", seed=123)
    a = torch.rand(5)
    torch.manual_seed(123)
    assert torch.equal(a, torch.rand(5))
    assert not torch.are_deterministic_algorithms_enabled()
    compute_init("cpu", seed=123, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()


def test_deterministic_runs_are_bitwise_equal(plain_process):
    from nanochat_fast import optim
    from nanochat_fast.model.gpt import GPT, GPTConfig
    from nanochat_fast.optim import MuonRecipe

    def train():
        compute_init("cpu", seed=7, deterministic=True)
        model = GPT(GPTConfig(sequence_len=8, vocab_size=50, n_layer=1, n_head=2, n_kv_head=1, n_embd=16))
        model.init_weights()
        initial = model.transformer.wte.weight.detach().clone()
        # Newton-Schulz in fp32, stated rather than left to `auto` (the model runs in fp32 here)
        opts = model.setup_optimizers(muon_recipe=MuonRecipe.preset("quintic", ns_dtype="fp32"))
        for _ in range(3):
            x = torch.randint(0, 50, (2, 8))
            model(x, x).backward()
            optim.step(opts, grad_clip=1.0)
            model.zero_grad(set_to_none=True)
        return initial, [p.detach().clone() for p in model.parameters()]

    (initial, first), (_, second) = train(), train()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(initial, first[0])  # training did change the weights


@pytest.mark.parametrize("device_type,message", [("tpu", "unknown device type 'tpu'"), ("CPU", "unknown device type")])
def test_unknown_device_type_is_a_user_error(plain_process, device_type, message):
    with pytest.raises(UserError, match=message) as e:
        compute_init(device_type)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_is_a_user_error(plain_process):
    with pytest.raises(UserError, match="no CUDA GPU.*--device-type=cpu"):
        compute_init("cuda")


def test_mps_with_several_processes_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    fake_torchrun(monkeypatch, 0, 2)
    with pytest.raises(UserError, match="MPS runs a single process.*instead of torchrun") as e:
        compute_init("mps")
    assert "\n" not in str(e.value)
    assert not torch.distributed.is_initialized()


def test_print0_prints_on_rank_0_only(monkeypatch, capsys):
    fake_torchrun(monkeypatch, 1, 2)
    print0("from rank 1")
    fake_torchrun(monkeypatch, 0, 2)
    print0("from rank 0", end="!")
    assert capsys.readouterr().out == "from rank 0!"


def test_all_reduce_sum_without_a_process_group(plain_process):
    t = torch.tensor([1.5, 2.5])
    total = all_reduce_sum(t)
    assert torch.equal(total, t)
    total += 1  # a copy, not the input
    assert torch.equal(t, torch.tensor([1.5, 2.5]))
