"""core/threads.py and hardware/peak.py: the thread rule (a table, and real launches), the
peak-rate cache, MFU arithmetic against a hand count, and the matmul probe."""

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from support import measurement_files
from support.repo_paths import ROOT

from nanochat_fast import hardware
from nanochat_fast.core import threads
from nanochat_fast.core.cli import UserError
from nanochat_fast.core.threads import UNKNOWN, decide_threads
from nanochat_fast.hardware import Peak, cache, peak
from nanochat_fast.model.gpt import GPT, GPTConfig

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize(
    "env, cores, launcher_env, bound, threads, why",
    [
        ({}, 8, None, False, 8, "the 8 core"),
        ({"OMP_NUM_THREADS": "3"}, 8, None, False, 3, "set by the user"),
        ({"OMP_NUM_THREADS": "4,2"}, 8, None, False, 4, "set by the user"),  # nested levels: the first
        (TORCHRUN, 8, {}, False, 4, "split among 2 local ranks"),  # nproc 2, user set nothing
        ({**TORCHRUN, "OMP_NUM_THREADS": "1"}, 8, {}, False, 4, "torchrun's OMP_NUM_THREADS=1 default replaced"),
        ({**TORCHRUN, "OMP_NUM_THREADS": "1"}, 8, {"OMP_NUM_THREADS": "1"}, False, 1, "set by the user"),
        ({**TORCHRUN, "OMP_NUM_THREADS": "6"}, 8, {"OMP_NUM_THREADS": "6"}, False, 6, "set by the user"),
        ({**TORCHRUN, "OMP_NUM_THREADS": "1"}, 8, UNKNOWN, False, 4, "default replaced"),  # no /proc: torchrun's value
        ({**TORCHRUN, "OMP_NUM_THREADS": "2"}, 8, UNKNOWN, False, 2, "set by the user"),  # not torchrun's value
        ({**TORCHRUN, "OMP_NUM_THREADS": "1"}, 2, {}, False, 1, "2 core(s) split among 2"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "3"}, 2, {}, False, 1, "split among 3"),  # never 0 threads
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "4"}, 10, {}, False, 2, "split among 4"),  # the remainder idles
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "1"}, 8, {}, False, 8, "the 8 core"),
        ({**TORCHRUN, "OMP_NUM_THREADS": "1"}, 4, {}, True, 4, "bound to"),  # pinned per rank
    ],
)
def test_thread_rule(env, cores, launcher_env, bound, threads, why):
    choice = decide_threads(env, cores, launcher_env, bound)
    assert choice.threads == threads
    assert why in choice.reason


@pytest.mark.parametrize("value", ["abc", "0", "-2", ""])
def test_bad_omp_num_threads_is_one_line(value):
    with pytest.raises(UserError, match="OMP_NUM_THREADS=.* is not a positive number of threads") as e:
        decide_threads({"OMP_NUM_THREADS": value}, 2)
    assert "\n" not in str(e.value)


def test_cgroup_quota(tmp_path):
    assert threads.cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) == 2.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_limit(v1) == 1.5
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_cpu_limit(v1) is None


WORKER = textwrap.dedent("""
    import json, os, torch
    from nanochat_fast.core import threads
    choice = threads.configure_threads()
    print("RESULT " + json.dumps({"threads": torch.get_num_threads(), "reason": choice.reason,
                                  "rank": os.environ.get("LOCAL_RANK")}), flush=True)
""")


def launch(cmd, omp):
    env = {
        k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    }
    env["PYTHONPATH"] = str(ROOT)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def results(proc):
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out[-3000:]
    # Two ranks share one pipe, so their lines can interleave: find each whole JSON object instead.
    return [json.loads(found) for found in re.findall(r"RESULT (\{[^{}]*\})", out)]


def test_launchers_environment_tells_torchruns_value_from_the_users(tmp_path):
    """Real launches, all at once: (1) torchrun with 2 processes and OMP_NUM_THREADS unset puts
    OMP_NUM_THREADS=1 in its workers' environment; they split the cores instead (on 2 cores that is
    1 thread too, so the reason is checked). (2, 3) a launcher that sets OMP_NUM_THREADS=1 for its
    child after it started, as torchrun does, vs one started with it from the user: with one local
    rank the outcome differs on any machine (all cores vs 1), and only the launcher's exec-time
    environment tells them apart."""
    script, launcher = tmp_path / "worker.py", tmp_path / "launcher.py"
    script.write_text(WORKER)
    launcher.write_text(
        textwrap.dedent(f"""
        import os, subprocess, sys
        os.environ.update(OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID="t", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
        sys.exit(subprocess.call([sys.executable, {str(script)!r}]))
    """)
    )
    torchrun = launch(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)], None
    )
    late, early = launch([sys.executable, str(launcher)], None), launch([sys.executable, str(launcher)], "1")
    ranks = results(torchrun)
    assert len(ranks) == 2
    for r in ranks:
        assert r["threads"] == max(1, threads.usable_cores() // 2), r
        assert "split among 2 local ranks; torchrun's OMP_NUM_THREADS=1 default replaced" in r["reason"], r
    assert results(late)[0]["threads"] == threads.usable_cores()
    assert results(early) == [{"threads": 1, "reason": "OMP_NUM_THREADS=1 set by the user", "rank": "0"}]


# ---------------------------------------------------------------------------------------------
# the peak cache


@pytest.fixture
def fake_probe(monkeypatch, nanochat_home):
    """measure_matmul_rate replaced by a recorder returning rates[dtype]; an empty in-process memo;
    a quiet machine; one thread (with more, the probe also measures one thread as a floor)."""
    calls, rates = [], {torch.float32: 100e9, torch.bfloat16: 4e9}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def measure(device, dtype, *args, **kwargs):
        calls.append(dtype)
        rate = rates[dtype]
        return rate() if callable(rate) else rate

    monkeypatch.setattr(peak, "measure_matmul_rate", measure)
    monkeypatch.setattr(peak.CACHE, "probed", {})
    monkeypatch.setattr(cache, "machine_busy", lambda: False)
    yield calls, rates
    torch.set_num_threads(threads)


def new_process(monkeypatch):
    measurement_files.new_process(monkeypatch, peak.CACHE)


def test_cache_hit_and_the_best_peak(fake_probe, monkeypatch):
    calls, _ = fake_probe
    first = hardware.measured_peaks("cpu")
    assert len(calls) == 2 * peak.PROBE_ROUNDS and (first["fp32"], first["bf16"]) == (100e9, 4e9)
    new_process(monkeypatch)
    again = hardware.measured_peaks("cpu")
    assert len(calls) == 2 * peak.PROBE_ROUNDS and (again["fp32"], again["bf16"]) == (100e9, 4e9)
    best = hardware.peak_flops("cpu")  # the best dtype's, naming the other
    assert best == Peak(100e9, "fp32", "measured", hardware.cpu_model(), (("bf16", 4e9),))
    assert best.describe() == "fp32 peak 100 GFLOP/s (bf16 4), measured here"
    assert [p.name for p in peak.CACHE.path.parent.iterdir()] == ["peak_flops.json"]  # no temporary left


def test_probe_keeps_the_best_of_interleaved_rounds(fake_probe):
    """A neighbour slowing the first rounds does not lower the peak: the best round counts."""
    calls, rates = fake_probe
    fp32 = iter([20e9, 30e9, 100e9])  # busy, busy, quiet
    rates[torch.float32] = lambda: next(fp32)
    assert hardware.measured_peaks("cpu")["fp32"] == 100e9
    assert calls == [torch.float32, torch.bfloat16] * peak.PROBE_ROUNDS


def test_cache_is_keyed_by_threads_and_torch_version(fake_probe, monkeypatch):
    calls, _ = fake_probe
    threads, version = torch.get_num_threads(), torch.__version__
    hardware.measured_peaks("cpu")
    try:
        torch.set_num_threads(threads + 1)
        hardware.measured_peaks("cpu")
        assert len(calls) == 4 * peak.PROBE_ROUNDS + 2  # at 2 threads, then at 1 thread as a floor
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    hardware.measured_peaks("cpu")
    monkeypatch.setattr(torch, "__version__", version)
    new_process(monkeypatch)
    monkeypatch.setattr(peak, "measure_matmul_rate", lambda *a, **k: pytest.fail("re-measured"))
    assert hardware.measured_peaks("cpu")["fp32"] == 100e9  # the first key's entry, still on file
    assert len(json.loads(peak.CACHE.path.read_text())["entries"]) == 3


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"version": 2, "entries": {"k": 3}}',
        "[]",
        '{"version": 1, "entries": {}}',
        '{"version": 2, "entries": {"KEY": {"fp32": -1, "bf16": 1}}}',
    ],
)
def test_corrupt_or_foreign_cache_is_measured_again(fake_probe, capsys, content):
    calls, _ = fake_probe
    path = measurement_files.write_foreign_file(peak.CACHE, content.replace("KEY", hardware.machine_key("cpu")))
    assert hardware.measured_peaks("cpu")["fp32"] == 100e9
    assert len(calls) == 2 * peak.PROBE_ROUNDS
    assert json.loads(path.read_text())["entries"][hardware.machine_key("cpu")]["fp32"] == 100e9
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"note: {path} is not a cache this version wrote")


def test_busy_machine_is_not_cached(fake_probe, monkeypatch):
    monkeypatch.setattr(cache, "machine_busy", lambda: True)
    hardware.measured_peaks("cpu")
    assert not peak.CACHE.path.exists()


def test_a_stale_probe_is_taken_again(fake_probe, monkeypatch):
    calls, rates = fake_probe
    hardware.measured_peaks("cpu")
    measurement_files.backdate(peak.CACHE, hardware.machine_key("cpu"))
    new_process(monkeypatch)
    rates[torch.float32] = 120e9
    assert hardware.measured_peaks("cpu")["fp32"] == 120e9 and len(calls) == 4 * peak.PROBE_ROUNDS


def test_a_probe_taken_under_load_is_replaced_once_a_run_beats_it(fake_probe, monkeypatch):
    """The Xeon of issue 20: bf16 cached at 97 GFLOP/s while the test suite ran, 183 on a quiet
    machine. A run reaching 150 GFLOP/s per process shows the cached peak was low: it is probed
    again, the cache replaced, and the next process reads the quiet figure."""
    calls, rates = fake_probe
    rates.update({torch.float32: 50e9, torch.bfloat16: 97e9})  # the probe under load
    low = hardware.peak_flops("cpu")
    assert (low.dtype, low.flops) == ("bf16", 97e9)
    assert hardware.revise_peak(low, 90e9, "cpu") is low  # below its peak: nothing to do
    rates.update({torch.float32: 374e9, torch.bfloat16: 183e9})  # quiet now
    revised = hardware.revise_peak(low, 150e9, "cpu")
    assert (revised.dtype, revised.flops, revised.others) == ("fp32", 374e9, (("bf16", 183e9),))
    new_process(monkeypatch)
    assert hardware.peak_flops("cpu") == revised
    rates.update({torch.float32: 100e9, torch.bfloat16: 80e9})  # re-probed, still below the run
    assert hardware.revise_peak(revised, 400e9, "cpu").flops == 400e9  # never below what was achieved


# Every datasheet row by the exact name torch.cuda.get_device_name() gives, and names that a
# substring match got wrong (an L40 is not an L4, a PCIe H100 is not an SXM one) or that are not rows.
DATASHEET = [
    ("NVIDIA B200", 2250e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-SXM4-40GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12),
    ("NVIDIA L40S", 362e12),
    ("NVIDIA L40", 181e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA A10", 125e12),
    ("NVIDIA GeForce RTX 4090", 165e12),
    ("NVIDIA GeForce RTX 3090", 71e12),
    ("NVIDIA A10G", None),
    ("Tesla V100-SXM2-16GB", None),
    ("NVIDIA H100", None),
    ("NVIDIA GeForce RTX 4090 D", None),
]


@pytest.mark.parametrize("name, flops", DATASHEET)
def test_datasheet_peaks_by_exact_name(name, flops):
    assert peak.datasheet_peak(name) == flops


def test_every_datasheet_row_is_tested():
    assert set(peak.DATASHEET_BF16) == {name for name, flops in DATASHEET if flops}


def test_a_known_gpu_uses_its_datasheet_and_an_unknown_one_is_measured(monkeypatch, fake_probe):
    monkeypatch.setattr(peak, "device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    assert hardware.peak_flops(torch.device("cuda")) == Peak(312e12, "bf16", "datasheet", "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(peak, "device_name", lambda device: "NVIDIA A10G")
    monkeypatch.setattr(peak, "machine_key", lambda device: "cuda | NVIDIA A10G")
    measured = hardware.peak_flops(torch.device("cuda"))
    assert (measured.source, measured.flops) == ("measured", 100e9)


# ---------------------------------------------------------------------------------------------
# MFU and the probe


def test_mfu_against_a_hand_count():
    """2 layers of width 128 (one 128-wide head), vocab 100, T=64. Per token: 6 FLOPs per
    non-embedding weight, 4*128^2 attention + 8*128^2 MLP per layer and the 100x128 lm_head, plus
    attention 12 * layers * heads * head_dim * T."""
    model = GPT(GPTConfig(sequence_len=64, vocab_size=100, n_layer=2, n_head=1, n_kv_head=1, n_embd=128))
    by_hand = 6 * (2 * 12 * 128 * 128 + 100 * 128) + 12 * 2 * 1 * 128 * 64
    assert model.estimate_flops() == by_hand == 2_632_704
    # 1000 tokens/s on 2 processes with a 10 GFLOP/s peak each: 2.632704e9 / 2e10
    peak = Peak(10e9, "fp32", "measured", "cpu")
    assert math.isclose(hardware.mfu(by_hand, 1000, peak, world_size=2), 13.16352)
    assert math.isclose(hardware.mfu(by_hand, 1000, 10e9), 26.32704)
    assert hardware.mfu_text(by_hand, 1000, peak, 2) == "mfu 13.2% (of the fp32 peak 10 GFLOP/s, measured here)"
    h100 = Peak(989e12, "bf16", "datasheet", "NVIDIA H100 80GB HBM3")
    assert (
        hardware.mfu_text(by_hand, 1e8, h100)
        == "mfu 26.6% (of the bf16 peak 989 TFLOP/s (NVIDIA H100 80GB HBM3 datasheet))"
    )
    assert hardware.mfu_text(by_hand, 1000, None) == "mfu n/a"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_measures_a_finite_positive_rate(dtype):
    rate = peak.measure_matmul_rate("cpu", dtype, seconds=0.02, max_size=64)
    assert math.isfinite(rate) and rate > 0
