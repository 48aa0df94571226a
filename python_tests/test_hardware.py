"""hardware.py: the thread rule (a table, and real launches), the peak-rate cache, MFU arithmetic
against a hand count, and the matmul probe."""
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nanochat_fast import hardware
from nanochat_fast.cli import UserError
from nanochat_fast.gpt import GPT, GPTConfig
from nanochat_fast.hardware import UNKNOWN, Peak, decide_threads

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize("env, cores, launcher_env, bound, threads, why", [
    ({}, 8, None, False, 8, "the 8 core"),
    ({"OMP_NUM_THREADS": "3"}, 8, None, False, 3, "set by the user"),
    ({"OMP_NUM_THREADS": "4,2"}, 8, None, False, 4, "set by the user"),       # nested levels: the first
    (TORCHRUN, 8, {}, False, 4, "split among 2 local ranks"),                 # nproc 2, user set nothing
    ({**TORCHRUN, "OMP_NUM_THREADS": "1"}, 8, {}, False, 4, "torchrun's OMP_NUM_THREADS=1 default replaced"),
    ({**TORCHRUN, "OMP_NUM_THREADS": "1"}, 8, {"OMP_NUM_THREADS": "1"}, False, 1, "set by the user"),
    ({**TORCHRUN, "OMP_NUM_THREADS": "6"}, 8, {"OMP_NUM_THREADS": "6"}, False, 6, "set by the user"),
    ({**TORCHRUN, "OMP_NUM_THREADS": "1"}, 8, UNKNOWN, False, 4, "default replaced"),  # no /proc: torchrun's value
    ({**TORCHRUN, "OMP_NUM_THREADS": "2"}, 8, UNKNOWN, False, 2, "set by the user"),   # not torchrun's value
    ({**TORCHRUN, "OMP_NUM_THREADS": "1"}, 2, {}, False, 1, "2 core(s) split among 2"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "3"}, 2, {}, False, 1, "split among 3"),     # never 0 threads
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "4"}, 10, {}, False, 2, "split among 4"),    # the remainder idles
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "1"}, 8, {}, False, 8, "the 8 core"),
    ({**TORCHRUN, "OMP_NUM_THREADS": "1"}, 4, {}, True, 4, "bound to"),            # pinned per rank
])
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
    assert hardware.cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert hardware.cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert hardware.cgroup_cpu_limit(tmp_path) == 2.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert hardware.cgroup_cpu_limit(v1) == 1.5
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert hardware.cgroup_cpu_limit(v1) is None


WORKER = textwrap.dedent("""
    import json, os, torch
    from nanochat_fast import hardware
    choice = hardware.configure_threads()
    print("RESULT " + json.dumps({"threads": torch.get_num_threads(), "reason": choice.reason,
                                  "rank": os.environ.get("LOCAL_RANK")}), flush=True)
""")


def launch(cmd, omp):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = str(REPO)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def results(proc):
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out[-3000:]
    return [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line]


def test_launchers_environment_tells_torchruns_value_from_the_users(tmp_path):
    """Real launches, all at once: (1) torchrun with 2 processes and OMP_NUM_THREADS unset puts
    OMP_NUM_THREADS=1 in its workers' environment; they split the cores instead (on 2 cores that is
    1 thread too, so the reason is checked). (2, 3) a launcher that sets OMP_NUM_THREADS=1 for its
    child after it started, as torchrun does, vs one started with it from the user: with one local
    rank the outcome differs on any machine (all cores vs 1), and only the launcher's exec-time
    environment tells them apart."""
    script, launcher = tmp_path / "worker.py", tmp_path / "launcher.py"
    script.write_text(WORKER)
    launcher.write_text(textwrap.dedent(f"""
        import os, subprocess, sys
        os.environ.update(OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID="t", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
        sys.exit(subprocess.call([sys.executable, {str(script)!r}]))
    """))
    torchrun = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(script)], None)
    late, early = launch([sys.executable, str(launcher)], None), launch([sys.executable, str(launcher)], "1")
    ranks = results(torchrun)
    assert len(ranks) == 2
    for r in ranks:
        assert r["threads"] == max(1, hardware.usable_cores() // 2), r
        assert "split among 2 local ranks; torchrun's OMP_NUM_THREADS=1 default replaced" in r["reason"], r
    assert results(late)[0]["threads"] == hardware.usable_cores()
    assert results(early) == [{"threads": 1, "reason": "OMP_NUM_THREADS=1 set by the user", "rank": "0"}]


# ---------------------------------------------------------------------------------------------
# the peak cache


@pytest.fixture
def fake_probe(monkeypatch, nanochat_home):
    """measure_matmul_rate replaced by a counter; an empty in-process memo; a quiet machine; one
    thread (with more, the probe also measures one thread as a floor: two more calls)."""
    calls = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def measure(device, dtype, *args, **kwargs):
        calls.append(dtype)
        return {torch.float32: 100e9, torch.bfloat16: 2e9}[dtype] * len(calls)

    monkeypatch.setattr(hardware, "measure_matmul_rate", measure)
    monkeypatch.setattr(hardware, "_probed", {})
    monkeypatch.setattr(hardware, "machine_busy", lambda: False)
    yield calls
    torch.set_num_threads(threads)


def test_cache_hit(fake_probe, monkeypatch):
    first = hardware.measured_peaks("cpu")
    assert len(fake_probe) == 2 and first["fp32"] == 100e9 and first["bf16"] == 4e9
    monkeypatch.setattr(hardware, "_probed", {})  # a new process: only the file remembers
    again = hardware.measured_peaks("cpu")
    assert len(fake_probe) == 2 and again["fp32"] == first["fp32"] and again["bf16"] == first["bf16"]
    peak = hardware.peak_flops("cpu", "bf16")
    assert peak == Peak(4e9, "bf16", "measured", hardware.cpu_model())
    assert [p.name for p in hardware.cache_path().parent.iterdir()] == ["peak_flops.json"]  # no temporary left


def test_cache_is_keyed_by_threads_and_torch_version(fake_probe, monkeypatch):
    threads, version = torch.get_num_threads(), torch.__version__
    hardware.measured_peaks("cpu")
    try:
        torch.set_num_threads(threads + 1)
        hardware.measured_peaks("cpu")
        assert len(fake_probe) == 6  # 2 dtypes at 2 threads, then at 1 thread as a floor
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    hardware.measured_peaks("cpu")
    assert len(fake_probe) == 8
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(hardware, "_probed", {})
    monkeypatch.setattr(hardware, "measure_matmul_rate", lambda *a, **k: pytest.fail("re-measured"))
    assert hardware.measured_peaks("cpu")["fp32"] == 100e9  # the first key's entry, still on file
    assert len(json.loads(hardware.cache_path().read_text())["entries"]) == 3


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "entries": {"k": 3}}', "[]",
                                     '{"version": 1, "entries": {"KEY": {"fp32": -1, "bf16": 1}}}'])
def test_corrupt_cache_is_measured_again(fake_probe, content):
    path = hardware.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", hardware.cache_key("cpu")))
    assert hardware.measured_peaks("cpu")["fp32"] == 100e9
    assert len(fake_probe) == 2
    assert json.loads(path.read_text())["entries"][hardware.cache_key("cpu")]["fp32"] == 100e9


def test_busy_machine_is_not_cached(fake_probe, monkeypatch):
    monkeypatch.setattr(hardware, "machine_busy", lambda: True)
    hardware.measured_peaks("cpu")
    assert not hardware.cache_path().exists()


def test_datasheet_peaks_for_known_gpus(monkeypatch):
    assert hardware.datasheet_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert hardware.datasheet_peak("NVIDIA L40S") == 362e12   # not the L4's
    assert hardware.datasheet_peak("NVIDIA A10G") == 125e12
    assert hardware.datasheet_peak("Tesla V100-SXM2-16GB") is None
    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    assert hardware.peak_flops(torch.device("cuda"), "bf16") == Peak(312e12, "bf16", "datasheet", "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="dtype must be"):
        hardware.peak_flops("cpu", "fp16")


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
    assert hardware.mfu_text(by_hand, 1000, peak, 2) == "mfu 13.2% (of the measured fp32 peak, 10 GFLOP/s)"
    h100 = Peak(989e12, "bf16", "datasheet", "NVIDIA H100 80GB HBM3")
    assert hardware.mfu_text(by_hand, 1e8, h100) == \
        "mfu 26.6% (of the NVIDIA H100 80GB HBM3 datasheet bf16 peak, 989 TFLOP/s)"
    assert hardware.mfu_text(by_hand, 1000, None) == "mfu n/a"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_measures_a_finite_positive_rate(dtype):
    rate = hardware.measure_matmul_rate("cpu", dtype, seconds=0.02, max_size=64)
    assert math.isfinite(rate) and rate > 0
