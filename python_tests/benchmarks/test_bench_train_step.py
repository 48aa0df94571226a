"""The whole-step benchmark (benchmarks/bench_train_step.py) builds its variants from today's run
layer and its step table says what it must: small eager steps here, the full benchmark in
`make bench`. Its variants are built the way base_train builds a run, so a change of the run
layer's interface fails here, not first in `make bench`."""

import statistics
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from support.repo_paths import ROOT

from nanochat_fast import hardware, optim
from nanochat_fast.data.token_shards import write_token_shard
from nanochat_fast.hardware import precision
from nanochat_fast.hardware.precision import Timing

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_train_step as steps  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(tokens_root, dataset, description): 300 synthetic documents of the benchmark's vocabulary."""
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    bos = steps.VOCAB - 1
    docs = [np.concatenate([[bos], rng.integers(0, bos, n - 1)]) for n in rng.integers(50, 1500, 300)]
    write_token_shard(
        root / "synthetic" / "train",
        "shard_00000",
        docs,
        None,
        np.uint16,
        {"tokenizer": "synthetic", "bos_id": bos, "vocab_size": steps.VOCAB, "kind": "text"},
    )
    return root, "synthetic", "synthetic documents"


@pytest.fixture
def one_thread():
    """One thread: on a shared 2-core machine a 2-thread step waits on busy neighbours at every
    OpenMP barrier (measured 4x slower here); this test checks wiring and arithmetic, not speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def close_all(variants):
    for v in variants:
        v.loader.close()


def measured(model: float, newton_schulz: float):
    """hardware/precision.py's measure, injected: bf16's speed over fp32's per kind of work (this
    machine's own timings would make the chosen dtypes depend on where the test runs)."""
    speedup = {"model": model, "newton_schulz": newton_schulz}

    def measure(work, device, **kwargs):
        return Timing({"fp32": 1.0, "bf16": 1.0 / speedup[work.kind]}, work.what, 5)

    return mock.patch.object(precision, "measure", side_effect=measure)


# (the CPU's bf16 feature, bf16's measured speed-up for the model and for Newton-Schulz) -> the
# dtypes the defaults choose: emulated (AVX2), native but slower (the Xeon of issue 20), native
# and faster for Newton-Schulz only, fast everywhere (AMX-like)
CPUS = {
    "emulated": (None, 0.01, 0.01, "fp32", "fp32"),
    "native, slower": ("AVX512-BF16", 0.5, 0.5, "fp32", "fp32"),
    "native, faster for NS": ("AVX512-BF16", 1.0, 1.5, "fp32", "bf16"),
    "native, fast": ("AMX", 4.0, 4.0, "bf16", "bf16"),
}


@pytest.mark.parametrize("cpu", list(CPUS))
def test_every_variant_is_built_and_ours_as_base_train_builds_it(data, nanochat_home, cpu):
    native_bf16, model_speedup, ns_speedup, dtype, ns_dtype = CPUS[cpu]
    with (
        mock.patch.object(precision, "cpu_bf16_support", return_value=native_bf16),
        measured(model_speedup, ns_speedup) as measure,
    ):
        variants, skipped = steps.build_variants(4, data, muon_apart_s=1.0, with_changes_alone=True)
    try:
        names = [v.name for v in variants]
        ours = variants[0]
        # the compile default at base_train's default horizon (20 tokens per parameter: hours of
        # compute at peak) is on for CPUs
        assert names[0] == "ours (defaults)"
        assert ours.compiled and ours.compile_why.startswith("compiled on cpu")
        # the dtypes tune_for_training measured: the model's forward+backward and Muon's matrices,
        # each timed once, at the run's shapes, and the choice says why
        assert (ours.dtype, ours.ns_dtype) == (dtype, ns_dtype)
        assert sorted(c.args[0].kind for c in measure.call_args_list) == ["model", "newton_schulz"]
        assert ours.choices.startswith(f"model {dtype} (measured here: bf16 {model_speedup:.2f}x fp32 at this model's")
        assert f"Newton-Schulz {ns_dtype} (measured here: bf16 {ns_speedup:.2f}x fp32 at Newton-Schulz" in ours.choices
        # the grid: every forced (--dtype, --ns-dtype, --[no-]compile), bf16 cells only where bf16 is native
        cells = [steps.grid_name(d, n, c) for d in ("fp32", "bf16") for n in ("fp32", "bf16") for c in (True, False)]
        grid = [v for v in variants if steps.is_grid(v)]
        assert names[1 : 1 + len(grid)] == [n for n in cells if native_bf16 or "bf16" not in n]
        assert all(
            (v.dtype, v.ns_dtype, v.compiled)
            == (n.split("--dtype=")[1][:4], n.split("--ns-dtype=")[1][:4], "--compile" in n)
            for v, n in zip(grid, names[1:])
        )
        assert all(
            v.choices.startswith(f"model {v.dtype} (--dtype {v.dtype} asked for") for v in grid if v.dtype == "fp32"
        )
        assert sum(steps.twin_of(ours, v) for v in grid) == 1
        # stock tries bf16 autocast only where the CPU has it natively; the rest are left out, saying why
        stock = (
            [
                "stock eager fp32",
                "stock eager bf16 (= only the dtype)",
                "stock compiled fp32 (= only compile)",
                "stock compiled bf16",
            ]
            if native_bf16
            else ["stock eager fp32", "stock compiled fp32 (= only compile)"]
        )
        assert names[1 + len(grid) : -2] == [f"{n} (Muon apart)" for n in stock]
        assert names[-2:] == ["stock + the model's own loss (fused CE) (Muon apart)", steps.MAIN_BEFORE]
        if native_bf16:
            assert skipped == {}
        else:
            assert set(skipped) == {n for n in cells if "bf16" in n} | {
                "stock eager bf16 (= only the dtype)",
                "stock compiled bf16",
            }
            assert all(why.startswith("not run: this CPU has no bf16 instructions") for why in skipped.values())
        # ours: our AdamW and Muon with base_train's learning rates, AdamW's scaled by (n_embd/768)^-0.5
        adamw, muon = ours.optimizers
        assert type(adamw) is optim.AdamW and type(muon) is optim.Muon
        assert muon.ns_precision.name == ns_dtype
        scale = (ours.model.config.n_embd / 768) ** -0.5
        assert [g["lr"] for g in adamw.param_groups] == pytest.approx([0.004 * scale, 0.2 * scale])
        assert [g["lr"] for g in muon.param_groups] == pytest.approx([0.02] * len(muon.param_groups))
        assert muon.recipe.name == "minimax4"  # base_train's default for the gpt family
        # stock runs torch's optimizers (Muon apart here), main before ours
        assert [type(o) for o in variants[1 + len(grid)].optimizers] == [torch.optim.AdamW]
        assert [type(o) for o in variants[-1].optimizers] == [optim.AdamW, optim.Muon]
    finally:
        close_all(variants)


def test_the_depth_8_grid_keeps_compile_as_the_defaults_choose_it(data, nanochat_home):
    with mock.patch.object(precision, "cpu_bf16_support", return_value="AVX512-BF16"), measured(2.0, 2.0):
        variants, skipped = steps.build_variants(
            2, data, muon_apart_s=1.0, with_changes_alone=False, compile_axis=False
        )
    try:
        ours, grid = variants[0], [v for v in variants if steps.is_grid(v)]
        assert [v.name for v in grid] == [
            steps.grid_name(d, n, ours.compiled) for d in ("fp32", "bf16") for n in ("fp32", "bf16")
        ]
        assert not skipped and not any(" + " in v.name for v in variants)
    finally:
        close_all(variants)


def test_eager_steps_train_and_the_table_states_the_ratios(data, nanochat_home, one_thread):
    depth = 2  # small and eager: the table's arithmetic and wiring, not its speed
    with measured(0.5, 0.5):  # fp32 measured faster: the defaults' twin is the fp32 cell below
        variants = [
            steps.build_ours(depth, data, "--no-compile"),
            steps.build_grid_cell(depth, data, "fp32", "fp32", compiled=False),
            steps.build_stock(depth, data, "stock eager fp32", muon_apart_s=0.25),
            steps.build_stock(depth, data, steps.MAIN_BEFORE, optim="ours"),
        ]
    skipped = {
        steps.grid_name("bf16", "bf16", False): "not run: a reason",
        "stock eager bf16 (= only the dtype)": "not run: a reason",
    }
    try:
        before = {v.name: {n: p.detach().clone() for n, p in v.model.named_parameters()} for v in variants}
        for v in variants:
            v()
            v.phases.clear()
            v.measure_memory = True
        for v in variants:
            v()
        for v in variants:  # every step updated the weights its optimizers own
            changed = {n for n, p in v.model.named_parameters() if not torch.equal(p, before[v.name][n])}
            assert "lm_head.weight" in changed and "transformer.wte.weight" in changed
            assert any(n.startswith("transformer.h.") for n in changed) == (v.muon_apart_s == 0.0)
            assert len(v.phases) == 1 and all(p["forward"] > 0 and p["backward"] > 0 for p in v.phases)
            assert v.rise is None or v.rise > 0
        assert all(p["optimizer"] >= 0.25 for p in variants[2].phases)  # torch.optim.Muon's time added
        config = steps.model_config(steps.training_config(depth))
        lines = steps.step_table(depth, config, variants, {v.name: None for v in variants}, "a note", 12.0, skipped)
    finally:
        close_all(variants)
    text = "\n".join(lines)

    def step_s(v):
        return statistics.median(sum(p.values()) for p in v.phases)

    ours, cell, stock, main_before = variants
    assert hardware.cpu_model() in lines[0] and "native bf16" in lines[0]
    assert "medians of 1 interleaved rounds" in lines[0]
    assert f"ours, --no-compile vs best of the grid ({cell.name}): {step_s(cell) / step_s(ours):.2f}x" in text
    assert f"ours, --no-compile vs stock best ({stock.name}): {step_s(stock) / step_s(ours):.2f}x" in text
    assert f"ours, --no-compile vs main before: {step_s(main_before) / step_s(ours):.2f}x" in text
    assert f"ran at {step_s(cell) / step_s(ours):.2f}x the tokens/s of its twin ({cell.name})" in text
    assert "ours, --no-compile chose: model fp32 (measured here: bf16 0.50x fp32 at this model's" in text
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| variant")]
    timed = [r for r in rows if r.startswith("| ours, --n") or r.startswith("| ours, --d") or r.startswith("| stock")]
    assert [r.split(" | ")[0][2:] for r in timed] == [v.name for v in variants] + list(skipped)
    assert all(r.count("|") == 14 for r in timed)
    assert [r.split(" | ")[1] for r in timed[-2:]] == ["not run: a reason"] * 2
    assert f"| {steps.TOTAL / step_s(ours):,.0f} |" in timed[0]
    # the grid at a glance: the one cell run is the best and the defaults' choice; the left-out one says so
    assert f"| fp32 / fp32 | **{steps.TOTAL / step_s(cell):,.0f}** (best, the defaults' choice) |" in lines
    assert "| bf16 / bf16 | not run |" in lines and "| fp32 / bf16 | - |" in lines
    assert "MFU against the " in text and " peak " in text
    assert "took 12 s" in text
