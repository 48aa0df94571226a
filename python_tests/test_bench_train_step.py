"""The whole-step benchmark (benchmarks/bench_train_step.py) builds its variants from today's run
layer and its step table says what it must: small eager steps here, the full benchmark in
`make bench`. Its variants are built the way base_train builds a run, so a change of the run
layer's interface fails here, not first in `make bench`."""
import statistics
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from nanochat_fast import hardware, optim, precision
from nanochat_fast.dataset import write_token_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_train_step as steps  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(tokens_root, dataset, description): 300 synthetic documents of the benchmark's vocabulary."""
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    bos = steps.VOCAB - 1
    docs = [np.concatenate([[bos], rng.integers(0, bos, n - 1)]) for n in rng.integers(50, 1500, 300)]
    write_token_shard(root / "synthetic" / "train", "shard_00000", docs, None, np.uint16,
                      {"tokenizer": "synthetic", "bos_id": bos, "vocab_size": steps.VOCAB, "kind": "text"})
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


@pytest.mark.parametrize("native_bf16", [None, "AVX512-BF16"])
def test_every_variant_is_built_and_ours_as_base_train_builds_it(data, nanochat_home, native_bf16):
    with mock.patch.object(precision, "cpu_bf16_support", return_value=native_bf16):  # this CPU, or one with bf16
        variants = steps.build_variants(4, data, muon_apart_s=1.0, with_changes_alone=True)
    try:
        names = [v.name for v in variants]
        ours = variants[0]
        # the compile default at base_train's default horizon (20 tokens per parameter: hours of
        # compute at peak) is on for CPUs; the flipped variant is eager
        assert names[:2] == ["ours (defaults)", "ours, --no-compile"]
        assert ours.compiled and ours.compile_why.startswith("compiled on cpu") and not variants[1].compiled
        # the precision policy's dtype; stock tries bf16 autocast only where the CPU has it natively
        assert ours.dtype == ("bf16" if native_bf16 else "fp32")
        stock = (["stock eager fp32", "stock eager bf16 (= only the dtype)", "stock compiled fp32 (= only compile)",
                  "stock compiled bf16"] if native_bf16 else ["stock eager fp32", "stock compiled fp32 (= only compile)"])
        assert names[2:-2] == [f"{n} (Muon apart)" for n in stock]
        assert names[-2:] == ["stock + the model's own loss (fused CE) (Muon apart)", steps.MAIN_BEFORE]
        # ours: our AdamW and Muon with base_train's learning rates, AdamW's scaled by (n_embd/768)^-0.5
        adamw, muon = ours.optimizers
        assert type(adamw) is optim.AdamW and type(muon) is optim.Muon
        scale = (ours.model.config.n_embd / 768) ** -0.5
        assert [g["lr"] for g in adamw.param_groups] == pytest.approx([0.004 * scale, 0.2 * scale])
        assert [g["lr"] for g in muon.param_groups] == pytest.approx([0.02] * len(muon.param_groups))
        assert muon.recipe.name == "seeds"
        # stock runs torch's optimizers (Muon apart here), main before ours
        assert [type(o) for o in variants[2].optimizers] == [torch.optim.AdamW]
        assert [type(o) for o in variants[-1].optimizers] == [optim.AdamW, optim.Muon]
    finally:
        close_all(variants)


def test_eager_steps_train_and_the_table_states_the_ratios(data, nanochat_home, one_thread):
    depth = 2  # small and eager: the table's arithmetic and wiring, not its speed
    variants = [steps.build_ours(depth, data, "--no-compile"),
                steps.build_stock(depth, data, "stock eager fp32", muon_apart_s=0.25),
                steps.build_stock(depth, data, steps.MAIN_BEFORE, optim="ours")]
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
        assert all(p["optimizer"] >= 0.25 for p in variants[1].phases)  # torch.optim.Muon's time added
        config = steps.model_config(steps.training_config(depth))
        lines = steps.step_table(depth, config, variants, {v.name: None for v in variants}, "a note", 12.0)
    finally:
        close_all(variants)
    text = "\n".join(lines)

    def step_s(v):
        return statistics.median(sum(p.values()) for p in v.phases)

    ours, stock, main_before = variants
    assert hardware.cpu_model() in lines[0] and "native bf16" in lines[0]
    assert "medians of 1 interleaved rounds" in lines[0]
    assert f"ours, --no-compile vs stock best ({stock.name}): {step_s(stock) / step_s(ours):.2f}x" in text
    assert f"ours, --no-compile vs main before: {step_s(main_before) / step_s(ours):.2f}x" in text
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| variant")]
    assert [r.split(" | ")[0][2:] for r in rows] == [v.name for v in variants]
    assert f"| {steps.TOTAL / step_s(ours):,.0f} |" in rows[0]
    assert "took 12 s" in text
