"""The run layer: configs validated when built, the learning-rate rule on resume, a stage's own
evaluations, and the schedule's clock."""

import json
from dataclasses import replace

import pytest
import torch
from support.tiny_pipeline import TINY_LOOP, TINY_MODEL

from nanochat_fast import checkpoints
from nanochat_fast.core.errors import UserError
from nanochat_fast.scripts import base_train
from nanochat_fast.train.stage import run_stage
from nanochat_fast.train.training_config import DataConfig, ModelConfig, OptimConfig, RunConfig
from nanochat_fast.train.training_loop import lr_multiplier

TINY = TINY_MODEL + TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1"]


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: OptimConfig(matrix_lr=-1.0), "argument --matrix-lr: must be >= 0, got -1.0"),
        (lambda: OptimConfig(embedding_lr=float("inf")), "argument --embedding-lr: must be a finite number"),
        (lambda: OptimConfig(warmup_ratio=0.6, warmdown_ratio=0.6), "would overlap"),
        (lambda: ModelConfig(depth=0), "argument --depth: must be a positive integer, got 0"),
        (lambda: ModelConfig(head_dim=63), "argument --head-dim: must be even"),
        (lambda: DataConfig(device_batch_size=True), "argument --device-batch-size: expected an integer, got True"),
        (lambda: RunConfig(run="../x"), "argument --run: must be a plain name"),
        (lambda: RunConfig(resume="auto", overwrite=True), "contradict each other"),
    ],
)
def test_a_config_built_in_code_is_checked_like_the_flag(build, message):
    with pytest.raises(UserError, match=None) as e:
        build()
    assert message in str(e.value)


def test_grad_accum_names_the_nearest_valid_batches():
    data = DataConfig(max_seq_len=64, device_batch_size=4, total_batch_size=1000)
    with pytest.raises(UserError, match="nearest valid values: 768 or 1536"):
        data.grad_accum_steps(world_size=3)
    assert replace(data, total_batch_size=1536).grad_accum_steps(world_size=3) == 2


def test_lr_schedule_never_runs_past_its_end():
    """An epoch-bound stage can read past its epoch within the last step: progress above 1 gives
    the final lr, not a negative one."""
    assert lr_multiplier(1.7, 0.0, 0.2, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(0.9, 0.0, 0.2, 0.0) == pytest.approx(0.5)


def initial_lrs(ckpt) -> dict:
    """{first parameter name of the group: initial_lr} over the optimizers saved in `ckpt`."""
    state = torch.load(ckpt / "optim_rank0.pt", weights_only=True)
    return {g["param_names"][0]: g["initial_lr"] for opt in state["optimizers"] for g in opt["param_groups"]}


def test_an_explicit_lr_flag_wins_on_resume_and_a_default_one_does_not(home, capsys):
    run_dir = home / "runs" / "r"
    assert base_train.main(TINY + ["--num-iterations=2", "--run=r", "--matrix-lr=0.01"]) == 0
    saved = initial_lrs(checkpoints.complete_checkpoints(run_dir)[-1])
    muon = [k for k in saved if k.startswith("transformer.h")]
    assert muon and all(saved[k] == 0.01 for k in muon)
    capsys.readouterr()

    # no lr flag given: the checkpoint's 0.01 stays (the default would be 0.02), and the log says so
    assert base_train.main(TINY + ["--num-iterations=3", "--run=r", "--resume=auto"]) == 0
    out = capsys.readouterr().out
    assert "transformer.h keeps the checkpoint's initial lr 0.01" in out
    assert initial_lrs(checkpoints.complete_checkpoints(run_dir)[-1]) == saved

    # --matrix-lr given: it replaces the checkpoint's; the AdamW groups keep theirs
    assert base_train.main(TINY + ["--num-iterations=4", "--run=r", "--resume=auto", "--matrix-lr=0.03"]) == 0
    out = capsys.readouterr().out
    assert "--matrix-lr=0.03 given: it replaces the checkpoint's learning rate of transformer.h" in out
    now = initial_lrs(checkpoints.complete_checkpoints(run_dir)[-1])
    assert all(now[k] == 0.03 for k in muon)
    assert {k: v for k, v in now.items() if k not in muon} == {k: v for k, v in saved.items() if k not in muon}


def ns_schedules(ckpt) -> set:
    state = torch.load(ckpt / "optim_rank0.pt", weights_only=True)
    groups = [g for opt in state["optimizers"] for g in opt["param_groups"] if "ns_steps" in g]
    return {(g["ns_coefficients"], g["ns_steps"]) for g in groups}


def test_newton_schulz_follows_the_resume_rule(home, capsys):
    """The checkpoint's schedule stays unless --ns-coefficients is given (a run started before a default
    changed keeps its own), and the log says which."""
    run_dir = home / "runs" / "n"
    args = TINY + ["--run=n", "--arch=windowed", "--window-pattern=L"]
    assert base_train.main(args + ["--num-iterations=2", "--ns-coefficients=polar_express"]) == 0
    assert ns_schedules(checkpoints.complete_checkpoints(run_dir)[-1]) == {("polar_express", 5)}
    capsys.readouterr()

    assert base_train.main(args + ["--num-iterations=3", "--resume=auto"]) == 0
    out = capsys.readouterr().out
    assert "muon keeps the checkpoint's Newton-Schulz, polar_express x5 (the default would give minimax4 x4" in out
    assert ns_schedules(checkpoints.complete_checkpoints(run_dir)[-1]) == {("polar_express", 5)}

    assert base_train.main(args + ["--num-iterations=4", "--resume=auto", "--ns-coefficients=quintic"]) == 0
    out = capsys.readouterr().out
    assert "--ns-coefficients=quintic given: it replaces the checkpoint's polar_express x5" in out
    assert ns_schedules(checkpoints.complete_checkpoints(run_dir)[-1]) == {("quintic", 5)}


def test_a_stage_can_add_its_own_evaluations(home):
    """Stage.evals run with every val bpb eval: their values go to metrics.jsonl and the report."""

    def make(cfg, tokenizer, dev):
        return lambda model: {"embedding_norm": model.transformer.wte.weight.norm().item()}

    stage = replace(base_train.BASE, evals=(("embedding norm", make),))
    args = base_train.build_parser().parse_args(TINY[:-1] + ["--eval-every=2", "--num-iterations=2", "--run=e"])
    assert run_stage(args, stage) == 0
    run_dir = home / "runs" / "e"
    evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    final = checkpoints.load_model_state(checkpoints.complete_checkpoints(run_dir)[-1])
    assert evals[-1]["embedding_norm"] == pytest.approx(final["transformer.wte.weight"].norm().item(), rel=1e-6)
    assert evals[0]["embedding_norm"] != evals[-1]["embedding_norm"]
    assert "| embedding_norm (last eval) |" in (run_dir / "report.md").read_text()


def test_dtype_choice_and_its_reason_open_the_log_and_the_report(home, capsys):
    """--dtype=bf16 where the CPU has no native bf16 runs (slowly) after precision's one warning
    line; the run's first lines (before its first step) and the report name the choice and why."""
    from nanochat_fast.hardware import precision

    assert base_train.main(TINY + ["--num-iterations=1", "--run=bf", "--dtype=bf16"]) == 0
    captured = capsys.readouterr()
    chosen = precision.choose(torch.device("cpu"), "bf16", warn=False)
    lines = captured.out.splitlines()
    assert lines[0] == "device: cpu x 1 process(es)"
    before_steps = lines[: next(i for i, line in enumerate(lines) if line.startswith("step 00001"))]
    assert f"precision: {chosen.describe()}" in before_steps
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning: --dtype bf16")]
    assert len(warnings) == (0 if chosen.native else 1)
    assert f"| precision | {chosen.describe()} |" in (home / "runs" / "bf" / "report.md").read_text()
