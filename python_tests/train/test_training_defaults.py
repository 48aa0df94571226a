"""What the defaults choose (compute dtype, torch.compile, Muon's recipe) and that they train to the
same place as the plainest setup (fp32, eager)."""

import json

import pytest
import torch
from support.tiny_pipeline import DEFAULT_LOOP, TINY_LOOP, TINY_MODEL, run_script, train_rows

from nanochat_fast import hardware
from nanochat_fast.hardware import precision
from nanochat_fast.model import loading
from nanochat_fast.model.gpt import GPTConfig
from nanochat_fast.scripts import base_train
from nanochat_fast.train import model_setup
from nanochat_fast.train.training_config import OptimConfig

STEPS_60 = (
    TINY_MODEL
    + DEFAULT_LOOP
    + [
        "--device-batch-size=4",
        "--total-batch-size=256",
        "--num-iterations=60",
        "--eval-every=60",
        "--eval-tokens=1024",
    ]
)


def final_val_bpb(run_dir) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_bpb"] for r in rows if r["kind"] == "eval"][-1]


@pytest.mark.parametrize(
    "choice",
    [["--compile", "--dtype=fp32", "--ns-dtype=fp32"], ["--dtype=bf16", "--ns-dtype=bf16"]],
    ids=["compiled (what the defaults pick for a real run)", "bf16 (CUDA's and native-bf16 CPUs')"],
)
def test_defaults_reach_the_val_bpb_of_fp32_eager_after_60_steps(choice, home):
    """Same seed, same data: the dtype and compile choices of the defaults change rounding, not
    where training goes. Each variant changes one thing against fp32 eager: the compiled one is
    compiled in fp32 (with `auto` it would also be bf16 on CPUs with native bf16), the bf16 one is
    eager. A tiny run's own default is eager (too short to pay for a compile), so the compiled
    side is asked for explicitly."""
    plain = run_script(
        "base_train", STEPS_60 + ["--dtype=fp32", "--ns-dtype=fp32", "--no-compile", "--run=plain"], home, timeout=600
    )
    chosen = run_script("base_train", STEPS_60 + choice + ["--run=chosen"], home, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    a, b = final_val_bpb(home / "runs" / "plain"), final_val_bpb(home / "runs" / "chosen")
    assert a < 2.0 and abs(a - b) < 0.02, (a, b)
    if "--compile" in choice:
        assert "precision: fp32" in chosen.stdout  # compile alone is what differs from the plain run
        assert "torch.compile: 1 graph(s) compiled" in chosen.stdout  # one graph: evaluation did not recompile
        assert "torch.compile (one-time, not in the steps)" in (home / "runs" / "chosen" / "report.md").read_text()


def test_muon_recipe_polar_normuon_trains_and_is_reported(home, capsys):
    code = base_train.main(
        TINY_MODEL
        + TINY_LOOP
        + [
            "--device-batch-size=4",
            "--total-batch-size=512",
            "--num-iterations=30",
            "--eval-every=-1",
            "--muon-recipe=polar-normuon",
            "--run=polar",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert (
        "muon: polar-normuon: polar_express x5, ns-dtype fp32, MuonEq, Muon+, NorMuon beta 0.9, cautious wd 0.28"
    ) in out
    run_dir = home / "runs" / "polar"
    rows = train_rows(run_dir)
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    report = (run_dir / "report.md").read_text()
    assert "polar-normuon: polar_express" in report and "newton-schulz precision | fp32" in report


def test_recipe_flags_override_the_preset():
    recipe = OptimConfig(muon_recipe="polar-normuon", normuon=False, muon_weight_decay=0.1, warmdown_ratio=0.3).recipe()
    assert (recipe.name, recipe.normuon, recipe.weight_decay, recipe.cautious_weight_decay) == (
        "polar-normuon",
        False,
        0.1,
        True,
    )
    assert recipe.momentum_warmdown_ratio == 0.3  # the polar-normuon recipe's momentum warmdown follows the lr's
    default = OptimConfig().recipe()
    assert (default.name, default.ns_coefficients, default.ns_steps, default.normuon) == (
        "minimax4",
        "minimax4",
        4,
        False,
    )


def test_each_family_gets_its_own_default_recipe():
    """--arch=gpt trains with minimax4 (docs/measurements.md: quintic's val bpb within 0.5% at 300 steps),
    --arch=windowed with nanochat's polar-normuon in minimax4's 4 steps (Polar Express's val bpb within 0.5%);
    --muon-recipe=quintic and --ns-coefficients=polar_express give nanochat's own back."""
    from nanochat_fast.train.training_config import TrainingConfig

    def recipe(*flags):
        return TrainingConfig.from_args(
            base_train.build_parser().parse_args(list(flags)), with_model=True
        ).optim.recipe()

    assert recipe() == recipe("--arch=gpt") == OptimConfig(muon_recipe="minimax4").recipe()
    windowed = recipe("--arch=windowed")
    assert (windowed.name, windowed.ns_coefficients, windowed.ns_steps) == ("polar-normuon", "minimax4", 4)
    nanochats = recipe("--arch=windowed", "--ns-coefficients=polar_express")
    assert nanochats == OptimConfig(muon_recipe="polar-normuon", warmdown_ratio=0.65).recipe()
    assert (nanochats.ns_coefficients, nanochats.ns_steps) == ("polar_express", 5)
    quintic = recipe("--muon-recipe=quintic")
    assert (quintic.ns_coefficients, quintic.ns_steps) == ("quintic", 5) and quintic == OptimConfig(
        muon_recipe="quintic"
    ).recipe()


@pytest.mark.parametrize("preset", ["minimax4", "polar-normuon"])
@pytest.mark.parametrize("coefficients,steps", [("quintic", 5), ("polar_express", 5), ("minimax4", 4)])
def test_ns_coefficients_take_their_own_steps(preset, coefficients, steps):
    """A schedule's steps belong to its coefficients: --ns-coefficients=quintic on minimax4 is nanochat's 5
    steps, minimax4 on polar-normuon 4."""
    recipe = OptimConfig(muon_recipe=preset, ns_coefficients=coefficients).recipe()
    assert (recipe.name, recipe.ns_coefficients, recipe.ns_steps) == (preset, coefficients, steps)


def test_tune_times_the_newton_schulz_a_default_run_uses():
    """hardware --tune --depth caches the entry a default base_train run looks up: the same steps and
    coefficients as the Muon that OptimConfig's defaults build."""
    config = GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=32)
    _, muon = loading.new_model(config, "cpu").setup_optimizers(**OptimConfig().optimizer_kwargs())
    group = muon.param_groups[0]
    ns_work = model_setup.tuning_works(1, 64, 16, 1, "cpu")[1]
    assert (ns_work.spec["steps"], ns_work.spec["coefficients"]) == (group["ns_steps"], group["ns_coefficients"])
    assert ns_work.spec["steps"] == 4


@pytest.mark.parametrize("old,new", [("seeds", "quintic"), ("current", "polar-normuon")])
def test_the_former_recipe_names_still_work_with_one_notice(old, new, monkeypatch, capsys):
    """--muon-recipe=seeds|current (and --muon_recipe): the new name from the flag on, one notice
    line on stderr however often the config is rebuilt and its recipe asked for."""
    from nanochat_fast.optim import recipe as recipes

    monkeypatch.setattr(recipes, "_noticed", set())
    args = base_train.build_parser().parse_args([f"--muon_recipe={old}", "--warmdown-ratio=0.3"])
    assert args.muon_recipe == new
    configs = [OptimConfig.from_args(args) for _ in range(2)] + [OptimConfig(muon_recipe=old, warmdown_ratio=0.3)]
    assert all(c.muon_recipe == new and c.recipe() == configs[0].recipe() for c in configs)
    assert configs[0].recipe() == OptimConfig(muon_recipe=new, warmdown_ratio=0.3).recipe()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"note: the muon recipe '{old}' is now called '{new}'"), err


def test_a_cuda_machine_chooses_bf16_and_compile(monkeypatch):
    """The device queries mocked as an H100: the same code that picks fp32 and (for short runs)
    eager here picks bf16 autocast, bf16 Newton-Schulz and torch.compile there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert precision.choose(cuda, warn=False).name == "bf16"
    assert precision.choose(cuda, OptimConfig().ns_dtype, warn=False).name == "bf16"
    peak = hardware.peak_flops(cuda)
    assert (peak.source, peak.flops) == ("datasheet", 989e12)
    assert hardware.peak.memory_bandwidth(cuda) == hardware.peak.Bandwidth(
        3.35e12, "datasheet", "NVIDIA H100 80GB HBM3"
    )
    model = loading.new_model(
        GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=16), "cpu"
    )  # built here; compile_for_training only decides and wraps
    run_tokens = round(3600 * peak.flops / model.estimate_flops())  # an hour at peak
    compiled, why = model_setup.compile_for_training(model, None, cuda, run_tokens, peak.flops)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule) and "compiled on cuda" in why
    same, why = model_setup.compile_for_training(model, None, "cpu", round(1e9 / model.estimate_flops()), 1e11)
    assert same is model and "short run" in why
