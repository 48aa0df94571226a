"""
What this machine gives a training process, measured once and cached:

    machine.py   what a device is called and reports (CPU model, ISA, bf16 feature): cache keys
    peak.py      the peak matmul rate MFU is quoted against: a GPU's datasheet, or measured here
    bandwidth.py the memory bandwidth MBU is quoted against: a GPU's datasheet, or measured here
    tuning.py    fp32 or bf16, by timing both at the shapes that will run
    cache.py     the measurement files under NANOCHAT_FAST_HOME/hardware/, and the probes' rules
    precision.py the compute-dtype rule: CUDA sm80+ bf16, MPS fp32, a CPU what tuning.py measured
    process_setup.py  a process once set up: device, rank, compute dtype, the kernels that run there

    python -m nanochat_fast.hardware            threads, peaks, bandwidth, dtype timings cached here
    python -m nanochat_fast.hardware --tune     measure them again
"""

from .bandwidth import (
    DATASHEET_BANDWIDTH,
    Bandwidth,
    datasheet_bandwidth,
    format_bandwidth,
    mbu,
    mbu_text,
    measure_read_bandwidth,
    measured_bandwidth,
    memory_bandwidth,
)
from .machine import cpu_bf16_support, cpu_model, device_name, machine_key
from .peak import (
    DATASHEET_BF16,
    Peak,
    datasheet_peak,
    format_flops,
    measure_matmul_rate,
    measured_peaks,
    mfu,
    mfu_text,
    peak_flops,
    revise_peak,
)

__all__ = [
    "cpu_bf16_support",
    "cpu_model",
    "device_name",
    "machine_key",
    "DATASHEET_BF16",
    "Peak",
    "datasheet_peak",
    "format_flops",
    "measure_matmul_rate",
    "measured_peaks",
    "mfu",
    "mfu_text",
    "peak_flops",
    "revise_peak",
    "DATASHEET_BANDWIDTH",
    "Bandwidth",
    "datasheet_bandwidth",
    "format_bandwidth",
    "mbu",
    "mbu_text",
    "measure_read_bandwidth",
    "measured_bandwidth",
    "memory_bandwidth",
]
