"""model/generation_dtype.py: generation's dtype measured on the command's own mix (prefills and decode steps at
its batch), as training's is: the measurements of three kinds of CPU injected, the faster dtype taken, an
explicit --dtype never overridden; the mix timed for real on a tiny model and cached; infer_bench deciding
per batch size; chat_web's replica stepping under the chosen autocast from its worker thread."""

import json
import threading

import pytest
import torch
from support.chat_web_support import random_model
from support.stub_models import byte_tokenizer, one_thread  # noqa: F401 (an autouse fixture)

from nanochat_fast.hardware import precision
from nanochat_fast.hardware.precision import Timing
from nanochat_fast.hardware.process_setup import ProcessSetup
from nanochat_fast.model import generation_dtype
from nanochat_fast.model.batch_engine import BatchEngine, Request
from nanochat_fast.model.generation_dtype import GenerationMix, chat_mix, for_generation, generation_work
from nanochat_fast.model.gpt import GPTConfig

CONFIG = GPTConfig(sequence_len=64, vocab_size=300, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
# Seconds of a generation mix in each dtype on three kinds of CPU (the kinds of test_tuning.py): where bf16
# is emulated it loses by far; where it is native but slow it loses; on an AMX-class CPU a decode step of one
# row can still lose in bf16 (the stock matmuls against our packed fp32 kernels, 4.02 ms vs 1.84 ms on a
# Zen 4) while a batch of 8 wins.
CPUS = {
    "bf16 emulated": {1: {"fp32": 0.20, "bf16": 9.0}, 8: {"fp32": 0.60, "bf16": 30.0}},
    "bf16 present but slower": {1: {"fp32": 0.20, "bf16": 0.31}, 8: {"fp32": 0.60, "bf16": 0.90}},
    "bf16 fast": {1: {"fp32": 0.18, "bf16": 0.40}, 8: {"fp32": 0.90, "bf16": 0.50}},
}


def fastest(seconds: dict) -> str:
    return min(seconds, key=seconds.get)


def cpu_setup() -> ProcessSetup:
    return ProcessSetup(False, 0, 0, 1, torch.device("cpu"), precision.decide("cpu", "fp32"), {})


@pytest.fixture
def inject(monkeypatch):
    """precision.measure replaced by the injected seconds of `cpu`, by the mix's batch; the works it got."""
    seen = []

    def install(cpu: str):
        def fake_measure(work, device, **kwargs):
            seen.append(work)
            return Timing(CPUS[cpu][work.spec["batch"]], work.what, 5)

        monkeypatch.setattr(precision, "measure", fake_measure)
        return seen

    return install


@pytest.mark.parametrize("cpu", list(CPUS))
def test_generation_takes_the_faster_dtype_of_its_own_mix_on_every_kind_of_cpu(inject, cpu):
    seen = inject(cpu)
    model = random_model(CONFIG)
    for batch in (1, 8):
        mix = GenerationMix(batch, 16, 32)
        dev = for_generation(cpu_setup(), "auto", model, mix)
        assert dev.precision.name == fastest(CPUS[cpu][batch]), (cpu, batch)
        assert dev.precision.reason.startswith("measured here: bf16 ")
        assert "generation" in dev.precision.reason and f"{batch} row(s) x (16 prompt + 32 generated" in (
            dev.precision.reason
        )
    assert [(w.kind, w.spec["batch"], w.spec["prompt_tokens"], w.spec["decode_tokens"]) for w in seen] == [
        ("generation", 1, 16, 32),
        ("generation", 8, 16, 32),
    ]
    for requested in ("fp32", "bf16"):  # an explicit --dtype is never overridden, and nothing is timed
        assert for_generation(cpu_setup(), requested, model, GenerationMix(8, 16, 32)) == cpu_setup()
    assert len(seen) == 2


def test_off_the_cpu_nothing_is_timed(inject):
    seen = inject("bf16 fast")
    setup = ProcessSetup(
        False, 0, 0, 1, torch.device("meta"), precision.decide("cuda", "auto", cuda_capability=(9, 0)), {}
    )
    assert for_generation(setup, "auto", random_model(CONFIG), GenerationMix(1, 4, 4)) is setup
    assert seen == []


def test_chat_mix_keeps_within_the_context():
    assert chat_mix(CONFIG, 8, 512) == GenerationMix(8, 32, 32)  # half the context for the prompt
    big = GPTConfig(sequence_len=2048, vocab_size=300, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    assert chat_mix(big, 1, 512) == GenerationMix(1, 64, 64) and chat_mix(big, 1, 10) == GenerationMix(1, 64, 10)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        GenerationMix(0, 4, 4)


def test_the_mix_is_timed_for_real_generating_every_token_and_cached(monkeypatch, nanochat_home):
    """Each timed call runs the whole mix in its dtype: `batch` prefills and every decode step, the cache
    of its engine in that dtype; the timing is cached under kind "generation" and read back."""
    monkeypatch.setattr(precision, "machine_busy", lambda: False)
    emitted = {}

    class Counting(BatchEngine):
        def step(self):
            tokens = super().step()
            key = self.cache.kv.dtype
            emitted[key] = emitted.get(key, 0) + len(tokens)
            return tokens

    monkeypatch.setattr(generation_dtype, "BatchEngine", Counting)
    model = random_model(CONFIG)
    before = [p.detach().clone() for p in model.parameters()]
    mix = GenerationMix(2, 8, 4)
    timing = precision.measure(generation_work(model, mix, "cpu"), "cpu", max_seconds=60.0)
    assert (
        timing.source == "measured"
        and timing.what == "this model's generation (2 row(s) x (8 prompt + 4 generated tokens))"
    )
    calls = 1 + timing.rounds  # the warm-up and the rounds, in each dtype
    assert emitted == {torch.float32: calls * 2 * 4, torch.bfloat16: calls * 2 * 4}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    again = precision.measure(generation_work(model, mix, "cpu"), "cpu", max_seconds=60.0)
    assert (again.source, again.seconds) == ("cached", timing.seconds)
    entry = next(iter(json.loads(precision.CACHE.path.read_text())["entries"].values()))
    assert entry["kind"] == "generation" and entry["spec"]["batch"] == 2


def test_infer_bench_decides_each_batch_size_on_its_own_mix(inject, nanochat_home, capsys):
    """--dtype auto: batch 1 and 8 each timed on their own mix; each row runs, and counts its bytes, in the
    dtype its timing chose (the fast-bf16 CPU: fp32 at one row, bf16 at eight)."""
    from nanochat_fast.scripts import infer_bench

    seen = inject("bf16 fast")
    argv = ["--depth=1", "--vocab-size=512", "--max-seq-len=64", "--prompt-tokens=8", "--decode-tokens=5"]
    assert infer_bench.main(argv + ["--batch-sizes=1,8", "--dtype=auto"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [(w.spec["batch"], w.spec["prompt_tokens"], w.spec["decode_tokens"]) for w in seen] == [(1, 8, 5), (8, 8, 5)]
    assert [row["dtype"] for row in out["sweep"]] == ["fp32", "bf16"]
    params = out["params"]
    for row, itemsize in zip(out["sweep"], (4, 2)):  # weights read per step, in the row's dtype
        kv = row["batch_size"] * (1 * 2 * 1 * 128 * itemsize) * out["mean_context"]
        assert row["bytes_per_step"] == (params - 512 * 128 + row["batch_size"] * 128) * itemsize + kv
    seen.clear()
    assert infer_bench.main(argv + ["--batch-sizes=1,8", "--dtype=bf16"]) == 0  # forced: never timed
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert seen == [] and [row["dtype"] for row in out["sweep"]] == ["bf16", "bf16"]


def test_a_chat_web_replica_steps_in_its_precision_from_the_pool_thread():
    """The pool's worker thread steps the engine; autocast is per thread, so the replica's engine sets it
    itself: its cache is bf16 and its reply the one the engine gives under bf16 autocast directly."""
    from nanochat_fast.scripts import chat_web

    model, tokenizer = random_model(CONFIG), byte_tokenizer()
    bf16 = precision.decide("cpu", "bf16", cpu_bf16="AMX")
    replica = chat_web.replica(chat_web.make_engine(model, tokenizer, 2, bf16), model.config, tokenizer, "cpu")
    assert replica.engine.cache.kv.dtype == torch.bfloat16
    prompt = [tokenizer.get_bos_token_id(), 72, 105]
    got = []

    def worker():
        replica.engine.add(Request(prompt, 6, use_tools=False))
        while replica.engine.active:
            got.extend(t.token for t in replica.engine.step())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    direct = BatchEngine(model, tokenizer, 1, max_len=CONFIG.sequence_len)
    expected = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        direct.add(Request(prompt, 6, use_tools=False))
        while direct.active:
            expected.extend(t.token for t in direct.step())
    assert got == expected and len(got) >= 1
    # no precision: the model as loaded, fp32
    plain = chat_web.replica(chat_web.make_engine(model, tokenizer, 2), model.config, tokenizer, "cpu")
    assert plain.engine.cache.kv.dtype == torch.float32
