"""hardware/precision.py's timings and choice on CPUs this machine is not: the measurements of
three kinds of CPU injected (a fake clock that advances by what each call would cost there), and
the choice checked to be the faster dtype; the budget, the fallbacks, the cache and --tune."""

import json
import subprocess
import sys

import pytest
import torch
from support import measurement_files
from support.repo_paths import ROOT

from nanochat_fast.hardware import precision
from nanochat_fast.hardware.precision import Timing, TuningError, Work
from nanochat_fast.model.gpt import GPTConfig
from nanochat_fast.train import model_setup
from nanochat_fast.train.training_config import DataConfig

# Measured machines (issue 20 and the Zen 3 this package was first developed on): the square-matmul
# probe's FLOP/s, and the seconds one call of the work takes in each dtype.
CPUS = {
    # AVX2 only (Zen 3): bf16 emulated, ~80x slower than fp32
    "bf16 emulated": dict(
        probe={"fp32": 140e9, "bf16": 1.8e9},
        model={"fp32": 0.80, "bf16": 62.0},
        ns={"fp32": 0.40, "bf16": 31.0},
        faster="fp32",
    ),
    # Xeon with AVX512-BF16, no AMX: bf16 0.49x fp32 on matmuls, the step 0.62x
    "bf16 present but slower": dict(
        probe={"fp32": 374e9, "bf16": 183e9},
        model={"fp32": 0.77, "bf16": 1.26},
        ns={"fp32": 0.20, "bf16": 0.38},
        faster="fp32",
    ),
    # AMX-like: bf16 4x fp32
    "bf16 fast": dict(
        probe={"fp32": 200e9, "bf16": 800e9},
        model={"fp32": 1.00, "bf16": 0.27},
        ns={"fp32": 0.50, "bf16": 0.13},
        faster="bf16",
    ),
}


class FakeMachine:
    """A clock that only the work's calls advance, by their cost on the machine being faked."""

    def __init__(self, probe: dict):
        self.now, self.calls, self.probe = 0.0, [], probe

    def clock(self) -> float:
        return self.now

    def work(self, kind: str, seconds: dict, flops: float = 1e11, **kwargs) -> Work:
        def call(name):
            def run():
                self.calls.append((kind, name))
                self.now += seconds[name]

            return run

        return Work(
            kind, dict(shapes=kind), f"the {kind}", flops, lambda: {d: call(d) for d in ("fp32", "bf16")}, **kwargs
        )

    def matmul_call(self, matmuls, rows, device, dtype):
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        flops = sum(2 * min(rows, m) * k * n for m, k, n in matmuls)

        def run():
            self.calls.append(("matmuls", name))
            self.now += flops / self.probe[name]

        return run


@pytest.fixture
def machine(monkeypatch, nanochat_home):
    """Install a FakeMachine; the test picks the CPU with machine(name)."""

    def install(cpu: str) -> FakeMachine:
        fake = FakeMachine(CPUS[cpu]["probe"])
        monkeypatch.setattr(precision, "clock", fake.clock)
        monkeypatch.setattr(precision, "measured_peaks", lambda device: dict(fake.probe))
        monkeypatch.setattr(precision, "_matmul_call", fake.matmul_call)
        monkeypatch.setattr(precision, "machine_busy", lambda: False)
        return fake

    return install


def work_flops(cpu: str, part: str) -> float:
    """FLOPs that make the probe predict the call's fp32 time right (the prediction's scale)."""
    return CPUS[cpu][part]["fp32"] * CPUS[cpu]["probe"]["fp32"]


@pytest.mark.parametrize("cpu", list(CPUS))
def test_the_faster_dtype_wins_on_every_kind_of_cpu(machine, cpu):
    """The model's dtype and Newton-Schulz's, each measured in a run of 1,000 steps."""
    fake = machine(cpu)
    for part in ("model", "ns"):
        work = fake.work(part, CPUS[cpu][part], work_flops(cpu, part), matmuls=[(4096, 256, 1024)], run_calls=1000)
        timing = precision.measure(work, "cpu")
        choice = precision.decide("cpu", "auto", timing=timing)
        assert choice.name == CPUS[cpu]["faster"], (part, timing)
        assert choice.reason.startswith("measured here: bf16 ")
        assert f"{CPUS[cpu][part]['fp32'] / CPUS[cpu][part]['bf16']:.2f}x fp32" in choice.reason


def test_emulated_bf16_is_never_run_on_the_full_work(machine):
    """62 s a call would blow the 30 s budget: the probe predicts it and the work is not started;
    the choice comes from its matmuls at fewer rows (which fit)."""
    fake = machine("bf16 emulated")
    work = fake.work(
        "model",
        CPUS["bf16 emulated"]["model"],
        work_flops("bf16 emulated", "model"),
        matmuls=[(4096, 256, 8192), (4096, 256, 1024)],
        run_calls=10_000,
    )
    timing = precision.measure(work, "cpu")
    assert ("model", "bf16") not in fake.calls and ("model", "fp32") not in fake.calls
    assert timing.winner == "fp32" and timing.what.startswith("the matmuls of the model (")
    assert fake.now <= precision.MAX_SECONDS


def test_rounds_are_interleaved_and_a_busy_moment_is_ignored(machine):
    fake = machine("bf16 fast")
    seconds = dict(CPUS["bf16 fast"]["model"])
    work = fake.work("model", seconds, work_flops("bf16 fast", "model"))
    original = work.make

    def make():  # the third fp32 call lands on a busy moment: 20x slower
        calls = original()
        fp32, count = calls["fp32"], [0]

        def busy():
            count[0] += 1
            fp32()
            fake.now += 19.0 if count[0] == 3 else 0.0

        return {"fp32": busy, "bf16": calls["bf16"]}

    work.make = make
    timing = precision.measure(work, "cpu", max_seconds=100)
    assert [name for _, name in fake.calls][:6] == ["fp32", "bf16"] * 3
    assert timing.seconds == pytest.approx({"fp32": 1.0, "bf16": 0.27}) and timing.rounds == precision.ROUNDS


def test_bf16_must_be_clearly_faster(machine):
    fake = machine("bf16 fast")
    work = fake.work("model", {"fp32": 1.0, "bf16": 1.0 / 1.05}, 200e9)
    assert precision.decide("cpu", "auto", timing=precision.measure(work, "cpu")).name == "fp32"  # 1.05x: noise
    work = fake.work("other", {"fp32": 1.0, "bf16": 1.0 / 1.2}, 200e9)
    assert precision.decide("cpu", "auto", timing=precision.measure(work, "cpu")).name == "bf16"


def test_budget_is_a_few_percent_of_the_run(machine):
    """A 20-call run of a 1 s work may spend 5% = 1 s: not enough for the work (4 calls of each
    dtype), so its matmuls are timed at as many rows as fit; a 2,000-call run times the work."""
    fake = machine("bf16 fast")
    short = fake.work(
        "model", CPUS["bf16 fast"]["model"], work_flops("bf16 fast", "model"), matmuls=[(8192, 512, 2048)], run_calls=20
    )
    assert precision.measure(short, "cpu").what.startswith("the matmuls of the model (")
    assert not any(kind == "model" for kind, _ in fake.calls)
    assert fake.now <= max(0.05 * 20 * 1.0, precision.MATMUL_MIN_SECONDS)
    fake.calls.clear()
    long = fake.work("model", CPUS["bf16 fast"]["model"], work_flops("bf16 fast", "model"), run_calls=2000)
    assert precision.measure(long, "cpu").what == "the model"


def test_nothing_fits_the_probe_decides_a_run_and_tune_refuses(machine):
    fake = machine("bf16 emulated")
    work = fake.work("model", {"fp32": 5000.0, "bf16": 400000.0}, 7e14, matmuls=[(65536, 65536, 65536)])
    timing = precision.measure(work, "cpu", max_seconds=1.0)
    assert (timing.source, timing.winner, fake.calls) == ("probe", "fp32", [])
    with pytest.raises(TuningError, match=r"^no timing of the model fits the budget of 1 s .* give a larger --budget$"):
        precision.measure(work, "cpu", max_seconds=1.0, strict=True)
    assert not precision.CACHE.path.exists()  # nothing measured, nothing written


def test_cached_for_later_runs_and_keyed_by_the_machine(machine, monkeypatch):
    fake = machine("bf16 fast")
    work = fake.work("model", CPUS["bf16 fast"]["model"], work_flops("bf16 fast", "model"))
    first = precision.measure(work, "cpu")
    calls = len(fake.calls)
    again = precision.measure(work, "cpu")
    assert (again.source, again.seconds, len(fake.calls)) == ("cached", first.seconds, calls)
    assert again.describe().endswith(", cached")
    threads = torch.get_num_threads()
    try:  # another thread count is another machine
        torch.set_num_threads(threads + 1)
        assert precision.measure(work, "cpu").source == "measured"
    finally:
        torch.set_num_threads(threads)
    other_shapes = fake.work("model", CPUS["bf16 fast"]["model"], work_flops("bf16 fast", "model"))
    other_shapes.spec = dict(shapes="wider")
    assert precision.measure(other_shapes, "cpu").source == "measured"
    assert len(json.loads(precision.CACHE.path.read_text())["entries"]) == 3


@pytest.mark.parametrize(
    "content", ["{not json", "[]", '{"version": 1, "entries": {"k": {"seconds": 3}}}', '{"version": 99, "entries": {}}']
)
def test_a_corrupt_or_foreign_cache_is_measured_again_with_one_notice(machine, capsys, content):
    fake = machine("bf16 fast")
    measurement_files.write_foreign_file(precision.CACHE, content)
    timing = precision.measure(fake.work("model", CPUS["bf16 fast"]["model"], work_flops("bf16 fast", "model")), "cpu")
    assert timing.source == "measured"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("note: ") and "measuring again" in err
    assert json.loads(precision.CACHE.path.read_text())["version"] == 1


@pytest.mark.parametrize("cpu", list(CPUS))
def test_a_training_run_takes_the_measured_dtypes(cpu, monkeypatch):
    """model_setup.tune_for_training (what run_stage calls): the measurements injected per kind of
    work; the model's dtype and Newton-Schulz's follow them, an explicit flag is never overridden."""
    times = {"model": CPUS[cpu]["model"], "newton_schulz": CPUS[cpu]["ns"]}
    measured = []

    def fake_measure(work, device, **kwargs):
        measured.append((work.kind, work.run_calls))
        return Timing(times[work.kind], work.what, 5)

    monkeypatch.setattr(precision, "measure", fake_measure)
    config = GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    dev = fake_device()
    for requested, expected in (("auto", CPUS[cpu]["faster"]), ("fp32", "fp32"), ("bf16", "bf16")):
        model, optimizers = model_setup.build_for_training(
            config, "cpu", dict(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0)
        )
        optimizers[1].defaults["ns_dtype"] = requested
        data = DataConfig(device_batch_size=4, max_seq_len=32)
        tuned, ns = model_setup.tune_for_training(
            model, optimizers, dev, requested, data, grad_accum_steps=2, run_tokens=4 * 32 * 2 * 100
        )
        assert (tuned.precision.name, ns.name) == (expected, expected)
    assert measured == [("model", 200), ("newton_schulz", 100)]  # auto only; run_calls: micro-steps, steps


def fake_device():
    from nanochat_fast.hardware.process_setup import ProcessSetup

    return ProcessSetup(False, 0, 0, 1, torch.device("cpu"), precision.decide("cpu", "fp32"), {})


def test_tune_refuses_a_budget_nothing_fits(nanochat_home):
    """python -m nanochat_fast.hardware --tune: one line, exit 2, nothing written."""
    proc = subprocess.run(
        [sys.executable, "-m", "nanochat_fast.hardware", "--tune", "--depth=20", "--budget=0.01"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: no timing of this model's forward+backward")
    assert not (nanochat_home / "hardware").exists() or not any((nanochat_home / "hardware").iterdir())


def test_tune_times_a_model_and_later_runs_reuse_it(nanochat_home, monkeypatch, capsys):
    """The real thing on this machine, small: --tune --depth times the model and its Muon
    matrices; a second invocation lists them from the cache. (In this process, with the load check
    off: on a loaded machine nothing is cached by design, test_a_busy_machine_is_not_cached...)"""
    from nanochat_fast.hardware import __main__ as hardware_cli
    from nanochat_fast.hardware import cache

    monkeypatch.setattr(cache, "machine_busy", lambda: False)
    monkeypatch.setattr(precision, "machine_busy", lambda: False)
    small = ["--depth=1", "--max-seq-len=32", "--device-batch-size=2", "--budget=5"]
    assert hardware_cli.main(["--tune", *small]) == 0
    timed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("timed: ")]
    assert len(timed) == 2 and "forward+backward (2x32 tokens)" in timed[0] and "Newton-Schulz" in timed[1]
    assert hardware_cli.main([]) == 0
    listed = capsys.readouterr().out
    assert listed.count("cached 0 days ago: bf16 ") == 2, listed


@pytest.mark.parametrize("cpu", list(CPUS))
def test_muon_alone_times_its_own_matrices_at_its_first_step(cpu, monkeypatch):
    """Muon(ns_dtype="auto") used outside a run: its first step measures Newton-Schulz on its own
    stacks (one per shape) and computes in the faster dtype from then on."""
    from nanochat_fast.optim import Muon

    seen = []

    def fake_measure(work, device, **kwargs):
        seen.append(work.spec["shapes"])
        return Timing(CPUS[cpu]["ns"], work.what, 5)

    monkeypatch.setattr(precision, "measure", fake_measure)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((8, 16), (8, 16), (16, 8))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = Muon(params, ns_dtype="auto")
    assert seen == []  # nothing measured before it is needed
    opt.step()
    opt.step()
    assert seen == [[[2, 8, 16], [1, 16, 8]]]  # once, at its own stacks
    assert opt.ns_precision.name == CPUS[cpu]["faster"]


def test_a_busy_machine_is_not_cached_and_old_timings_are_taken_again(machine, monkeypatch):
    fake = machine("bf16 fast")
    work = fake.work("model", CPUS["bf16 fast"]["model"], work_flops("bf16 fast", "model"))
    monkeypatch.setattr(precision, "machine_busy", lambda: True)
    assert precision.measure(work, "cpu").winner == "bf16"  # used for this run
    assert not precision.CACHE.path.exists()
    monkeypatch.setattr(precision, "machine_busy", lambda: False)
    precision.measure(work, "cpu")
    measurement_files.backdate(precision.CACHE)
    assert precision.measure(work, "cpu").source == "measured"


def test_measuring_leaves_the_runs_random_stream_alone(machine):
    """The timed work and the peak probe draw random inputs; the run's own draws after them (its
    initial weights) must be those of a run whose timings came from the cache."""
    from nanochat_fast.hardware import peak

    fake = machine("bf16 fast")
    work = fake.work("model", CPUS["bf16 fast"]["model"], work_flops("bf16 fast", "model"))
    original = work.make
    work.make = lambda: (torch.randn(1000), original())[1]  # as step_work's new model does
    torch.manual_seed(0)
    expected = torch.randn(8)
    torch.manual_seed(0)
    assert precision.measure(work, "cpu").source == "measured"
    peak.measure_matmul_rate("cpu", torch.float32, seconds=0.0, max_size=64)
    assert torch.equal(torch.randn(8), expected)


# The AVX2 Zen 3 of `--tune --depth=1 --max-seq-len=32 --device-batch-size=2 --budget=5`: the probe has bf16
# at 1.1 GFLOP/s (the model's call predicted at ~1.46 s in bf16), and calls this small take ~4x what the
# probe predicts in either dtype (overhead), which the warm-up of fp32 reveals and carries over to bf16.
ZEN3_SMALL = dict(probe={"fp32": 140e9, "bf16": 1.1e9}, flops=1.6e9, overhead=4.0)


def zen3_small_machine(machine, monkeypatch) -> FakeMachine:
    fake = machine("bf16 emulated")
    fake.probe = dict(ZEN3_SMALL["probe"])
    monkeypatch.setattr(precision, "measured_peaks", lambda device: dict(fake.probe))
    plain = fake.matmul_call

    def slow_matmul_call(matmuls, rows, device, dtype):
        call = plain(matmuls, rows, device, dtype)

        def run():
            before = fake.now
            call()
            fake.now += (ZEN3_SMALL["overhead"] - 1) * (fake.now - before)

        return run

    monkeypatch.setattr(precision, "_matmul_call", slow_matmul_call)
    return fake


def test_tune_does_not_refuse_where_emulated_bf16_has_already_lost(machine, monkeypatch):
    """Neither the model's call nor its matmuls fit 5 s in both dtypes there, but bf16 ~130x slower by
    the probe cannot win: fp32 alone is timed (never bf16 on the whole work), the choice is fp32, and it
    is cached for later runs like any timing."""
    fake = zen3_small_machine(machine, monkeypatch)
    predicted = {d: ZEN3_SMALL["flops"] / r for d, r in ZEN3_SMALL["probe"].items()}
    seconds = {d: ZEN3_SMALL["overhead"] * p for d, p in predicted.items()}
    work = fake.work("model", seconds, ZEN3_SMALL["flops"], matmuls=[(64, 64, 65536), (64, 64, 256), (64, 256, 64)])
    rates = precision.measured_peaks("cpu")
    precision.check_fits(work, rates, 5.0)  # what --tune checks before it measures anything: no TuningError
    timing = precision.measure(work, "cpu", max_seconds=5.0, remeasure=True, strict=True)
    assert ("model", "bf16") not in fake.calls and ("model", "fp32") in fake.calls
    assert timing.winner == "fp32" and timing.source == "measured"
    assert timing.seconds["fp32"] == pytest.approx(seconds["fp32"])
    assert timing.seconds["bf16"] == pytest.approx(seconds["fp32"] * 140e9 / 1.1e9)
    assert timing.what.startswith("the model; bf16 not timed: 127x slower by this machine's probe")
    assert fake.now <= 5.0
    again = precision.measure(work, "cpu", max_seconds=5.0)
    assert (again.source, again.seconds) == ("cached", timing.seconds)


@pytest.mark.parametrize("cpu", ["bf16 emulated", "bf16 present but slower"])
def test_tune_refuses_only_where_bf16_is_still_in_question(machine, cpu):
    """A work whose matmuls do not fit even at 16 rows, and whose fp32 call (1 s) fits alone: decided where
    the probe has bf16 dozens of times slower, refused where it is only 2x slower (a shape could still
    turn that round, and nothing of bf16 can be timed)."""
    fake = machine(cpu)
    work = fake.work("model", {"fp32": 1.0, "bf16": 1e3}, 1.0 * CPUS[cpu]["probe"]["fp32"])
    work.matmuls = [(4096, 4096 * 64, 65536)]
    rates = precision.measured_peaks("cpu")
    if cpu == "bf16 emulated":
        precision.check_fits(work, rates, 5.0)
        assert precision.measure(work, "cpu", max_seconds=5.0, strict=True).winner == "fp32"
        assert {name for _, name in fake.calls} == {"fp32"}
    else:
        with pytest.raises(TuningError, match="give a larger --budget$"):
            precision.check_fits(work, rates, 5.0)
        with pytest.raises(TuningError):
            precision.measure(work, "cpu", max_seconds=5.0, strict=True)
        assert fake.calls == []


def test_tune_retimes_a_windowed_runs_entries_as_the_windowed_model():
    """A cached timing of the windowed family (its config has a window_pattern) is rebuilt by --tune as
    that family's model, not the gpt family's: the same cache key, and the windowed model's FLOPs and
    parameter count (value embeddings, windows), which the gpt family's model of the same shape does not have."""
    from nanochat_fast.model import generation_dtype, loading
    from nanochat_fast.model.windowed_gpt import WindowedGPTConfig

    config = WindowedGPTConfig(
        sequence_len=256, vocab_size=320, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, window_pattern="SL"
    )
    model = loading.meta_model(config)
    seeds = loading.meta_model(GPTConfig(**{k: v for k, v in vars(config).items() if k != "window_pattern"}))
    mix = generation_dtype.GenerationMix(2, 16, 8)
    for work, plain in (
        (model_setup.step_work(model, 2, 256, "cpu"), model_setup.step_work(seeds, 2, 256, "cpu")),
        (generation_dtype.generation_work(model, mix, "cpu"), generation_dtype.generation_work(seeds, mix, "cpu")),
    ):
        again = precision._MEASURERS[work.kind](json.loads(json.dumps(work.spec)), "cpu")  # as the cache holds it
        assert precision.cache_key(again, "cpu") == precision.cache_key(work, "cpu")
        assert again.flops == work.flops != plain.flops, work.kind
