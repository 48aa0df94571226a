"""hardware/peak.py's memory bandwidth: its cache (hit, busy machine, stale entry), datasheet
GPUs by exact name, MBU arithmetic against a hand count, the read probe itself, its buffer size
from the last-level cache, and the line `python -m nanochat_fast.hardware` prints."""

import json
import math

import pytest
import torch
from support import measurement_files

from nanochat_fast import hardware
from nanochat_fast.hardware import cache, machine, peak
from nanochat_fast.hardware.peak import Bandwidth
from nanochat_fast.model.gpt import GPT, GPTConfig


@pytest.fixture
def fake_probe(monkeypatch, nanochat_home):
    """measure_read_bandwidth replaced by a recorder returning rate[0] bytes/s; an empty in-process
    memo; a quiet machine."""
    calls, rate = [], [30e9]

    def measure(device, nbytes=None, rounds=peak.BANDWIDTH_ROUNDS):
        calls.append(nbytes)
        return rate[0]

    monkeypatch.setattr(peak, "measure_read_bandwidth", measure)
    monkeypatch.setattr(peak.BANDWIDTH_CACHE, "probed", {})
    monkeypatch.setattr(cache, "machine_busy", lambda: False)
    return calls, rate


def new_process(monkeypatch):
    measurement_files.new_process(monkeypatch, peak.BANDWIDTH_CACHE)


def test_the_probe_is_cached(fake_probe, monkeypatch):
    calls, _ = fake_probe
    first = peak.measured_bandwidth("cpu")
    assert len(calls) == 1 and first["bytes_per_s"] == 30e9 and first["buffer_bytes"] == calls[0]
    assert first["probe_seconds"] >= 0 and first["measured"]
    new_process(monkeypatch)
    assert peak.memory_bandwidth("cpu") == Bandwidth(30e9, "measured", hardware.cpu_model())
    assert len(calls) == 1  # read back from the file
    assert peak.memory_bandwidth("cpu").describe() == "memory bandwidth 30 GB/s, measured here"
    assert [p.name for p in peak.BANDWIDTH_CACHE.path.parent.iterdir()] == ["memory_bandwidth.json"]
    assert peak.memory_bandwidth("cpu", remeasure=True).bytes_per_s == 30e9 and len(calls) == 2


def test_busy_machine_is_not_cached(fake_probe, monkeypatch):
    calls, _ = fake_probe
    monkeypatch.setattr(cache, "machine_busy", lambda: True)
    assert peak.memory_bandwidth("cpu").bytes_per_s == 30e9
    assert not peak.BANDWIDTH_CACHE.path.exists()
    assert peak.memory_bandwidth("cpu").bytes_per_s == 30e9 and len(calls) == 1  # kept by this process
    new_process(monkeypatch)
    peak.memory_bandwidth("cpu")
    assert len(calls) == 2  # the next process measures again


def test_a_stale_probe_is_taken_again(fake_probe, monkeypatch):
    calls, rate = fake_probe
    peak.measured_bandwidth("cpu")
    measurement_files.backdate(peak.BANDWIDTH_CACHE, hardware.machine_key("cpu"))
    new_process(monkeypatch)
    rate[0] = 40e9
    assert peak.memory_bandwidth("cpu").bytes_per_s == 40e9 and len(calls) == 2
    new_process(monkeypatch)
    assert peak.memory_bandwidth("cpu").bytes_per_s == 40e9 and len(calls) == 2  # the fresh entry


def test_a_foreign_cache_is_measured_again(fake_probe, capsys):
    calls, _ = fake_probe
    path = measurement_files.write_foreign_file(
        peak.BANDWIDTH_CACHE, json.dumps({"version": 1, "entries": {hardware.machine_key("cpu"): {"bytes_per_s": -1}}})
    )
    assert peak.memory_bandwidth("cpu").bytes_per_s == 30e9 and len(calls) == 1
    assert capsys.readouterr().err.startswith(f"note: {path} is not a cache this version wrote")


# Every datasheet row by the exact name torch.cuda.get_device_name() gives, and names that are not rows.
DATASHEET = [
    ("NVIDIA B200", 8e12),
    ("NVIDIA H200", 4.8e12),
    ("NVIDIA H200 NVL", 4.8e12),
    ("NVIDIA GH200 480GB", 4e12),
    ("NVIDIA H100 80GB HBM3", 3.35e12),
    ("NVIDIA H100 NVL", 3.9e12),
    ("NVIDIA H100 PCIe", 2e12),
    ("NVIDIA A100-SXM4-80GB", 2.039e12),
    ("NVIDIA A100-SXM4-40GB", 1.555e12),
    ("NVIDIA A100 80GB PCIe", 1.935e12),
    ("NVIDIA A100-PCIE-40GB", 1.555e12),
    ("NVIDIA L40S", 864e9),
    ("NVIDIA L40", 864e9),
    ("NVIDIA L4", 300e9),
    ("NVIDIA A10", 600e9),
    ("NVIDIA GeForce RTX 4090", 1.008e12),
    ("NVIDIA GeForce RTX 3090", 936e9),
    ("NVIDIA A10G", None),
    ("NVIDIA H100", None),
    ("NVIDIA GeForce RTX 4090 D", None),
]


@pytest.mark.parametrize("name, rate", DATASHEET)
def test_datasheet_bandwidth_by_exact_name(name, rate):
    assert peak.datasheet_bandwidth(name) == rate


def test_every_datasheet_row_is_tested_and_has_a_peak():
    assert set(peak.DATASHEET_BANDWIDTH) == {name for name, rate in DATASHEET if rate}
    assert set(peak.DATASHEET_BANDWIDTH) == set(peak.DATASHEET_BF16)


def test_a_known_gpu_uses_its_datasheet_and_an_unknown_one_is_measured(fake_probe, monkeypatch):
    calls, _ = fake_probe
    monkeypatch.setattr(peak, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    h100 = peak.memory_bandwidth(torch.device("cuda"))
    assert h100 == Bandwidth(3.35e12, "datasheet", "NVIDIA H100 80GB HBM3") and calls == []
    assert h100.describe() == "memory bandwidth 3.35 TB/s (NVIDIA H100 80GB HBM3 datasheet)"
    monkeypatch.setattr(peak, "device_name", lambda device: "NVIDIA A10G")
    monkeypatch.setattr(peak, "machine_key", lambda device: "cuda | NVIDIA A10G")
    monkeypatch.setattr(peak, "buffer_bytes", lambda device: 1 << 30)
    assert peak.memory_bandwidth(torch.device("cuda")) == Bandwidth(30e9, "measured", "NVIDIA A10G")
    assert calls == [1 << 30]


def test_mbu_against_a_hand_count():
    """One decode step of 2 layers of width 128 (one 128-wide head, one KV head), vocab 100, in
    bf16, at position 63 (64 keys and values after this token's): it reads every matrix, the
    100x128 lm_head, one 128-wide embedding row, and the K and V of 64 positions in 2 layers."""
    model = GPT(GPTConfig(sequence_len=64, vocab_size=100, n_layer=2, n_head=1, n_kv_head=1, n_embd=128))
    read = {n: p.numel() for n, p in model.named_parameters() if n != "transformer.wte.weight"}
    assert sum(read.values()) == 2 * 12 * 128 * 128 + 100 * 128
    weights = 2 * (2 * 12 * 128 * 128 + 100 * 128 + 128)
    kv = 2 * 2 * 64 * 128 * 2  # K and V, layers, positions, head_dim, bytes
    assert weights + kv == 877_824
    # 1000 steps/s on 2 processes reading 10 GB/s each: 8.77824e8 / 2e10
    measured = Bandwidth(10e9, "measured", "cpu")
    assert math.isclose(peak.mbu(weights + kv, 1000, measured, world_size=2), 4.38912)
    assert math.isclose(peak.mbu(weights + kv, 1000, 10e9), 8.77824)
    assert measured.describe() == "memory bandwidth 10 GB/s, measured here"
    h100 = Bandwidth(3.35e12, "datasheet", "NVIDIA H100 80GB HBM3")
    assert f"{peak.mbu(weights + kv, 1e6, h100):.1f}" == "26.2"  # 8.77824e11 / 3.35e12
    assert h100.describe() == "memory bandwidth 3.35 TB/s (NVIDIA H100 80GB HBM3 datasheet)"


def test_the_probe_reads_a_finite_positive_rate_and_keeps_the_threads():
    threads = torch.get_num_threads()
    rate = peak.measure_read_bandwidth("cpu", nbytes=1 << 20, rounds=2)
    assert math.isfinite(rate) and rate > 0
    assert torch.get_num_threads() == threads


def test_the_buffer_is_several_times_the_last_level_cache(tmp_path, monkeypatch):
    """Two chiplets, each with its own 32 MiB L3 and two cores with their own L2: 64 MiB of L3."""
    for cpu in range(4):
        caches = {
            "index0": (1, "Data", "32K", str(cpu)),
            "index1": (1, "Instruction", "32K", str(cpu)),
            "index2": (2, "Unified", "1024K", str(cpu)),
            "index3": (3, "Unified", "32M", "0-1" if cpu < 2 else "2-3"),
        }
        for index, (level, kind, size, shared) in caches.items():
            d = tmp_path / f"cpu{cpu}" / "cache" / index
            d.mkdir(parents=True)
            for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
                (d / name).write_text(f"{value}\n")
    assert machine.last_level_cache_bytes(tmp_path) == 64 << 20
    assert machine.last_level_cache_bytes(tmp_path / "none") is None
    monkeypatch.setattr(peak, "last_level_cache_bytes", lambda: 64 << 20)
    assert peak.buffer_bytes("cpu") == 256 << 20
    monkeypatch.setattr(peak, "last_level_cache_bytes", lambda: 96 << 20)
    assert peak.buffer_bytes("cpu") == 384 << 20
    monkeypatch.setattr(peak, "last_level_cache_bytes", lambda: 1 << 30)
    assert peak.buffer_bytes("cpu") == peak.MAX_BUFFER
    monkeypatch.setattr(peak, "last_level_cache_bytes", lambda: None)
    assert peak.buffer_bytes("cpu") == peak.MIN_BUFFER


def test_the_listing_shows_the_bandwidth_and_tune_measures_it_again(fake_probe, monkeypatch, capsys):
    from nanochat_fast.hardware import __main__ as listing

    calls, rate = fake_probe
    monkeypatch.setattr(peak, "measure_matmul_rate", lambda *a, **k: 100e9)
    monkeypatch.setattr(peak.CACHE, "probed", {})
    assert listing.main(["--device", "cpu"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("bandwidth: "))
    assert line.startswith("bandwidth: memory bandwidth 30 GB/s, measured here (probe of ")
    assert str(peak.BANDWIDTH_CACHE.path) in line and len(calls) == 1
    rate[0] = 35e9
    assert listing.main(["--device", "cpu", "--tune"]) == 0
    assert "bandwidth: memory bandwidth 35 GB/s, measured here" in capsys.readouterr().out and len(calls) == 2
    new_process(monkeypatch)
    assert peak.memory_bandwidth("cpu").bytes_per_s == 35e9 and len(calls) == 2  # --tune cached it
