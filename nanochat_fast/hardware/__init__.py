"""
What this machine gives a training process, measured once and cached: what a device is (machine.py),
the peak matmul rate MFU is quoted against (peak.py) and the memory bandwidth of MBU (bandwidth.py),
the dtypes the arithmetic runs in (precision.py), the measurement files (cache.py), and a process
once set up (process_setup.py). `python -m nanochat_fast.hardware [--tune]` lists (or re-measures) them.
"""

from .bandwidth import (
    DATASHEET_BANDWIDTH,
    Bandwidth,
    datasheet_bandwidth,
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
    "mbu",
    "mbu_text",
    "measure_read_bandwidth",
    "measured_bandwidth",
    "memory_bandwidth",
]
