"""
What this machine gives a training process, measured once and cached: what a device is (machine.py),
the peak matmul rate and memory bandwidth MFU and MBU are quoted against (peak.py), the dtypes the
arithmetic runs in (precision.py), the measurement files (cache.py), and a process once set up
(process_setup.py). `python -m nanochat_fast.hardware [--tune]` lists (or re-measures) them.
"""

# ruff: noqa: F401  (the package's interface)
from .machine import cpu_bf16_support, cpu_model, device_name, machine_key
from .peak import (
    DATASHEET_BANDWIDTH,
    DATASHEET_BF16,
    Bandwidth,
    Peak,
    datasheet_bandwidth,
    datasheet_peak,
    format_flops,
    mbu,
    measure_matmul_rate,
    measure_read_bandwidth,
    measured_bandwidth,
    measured_peaks,
    memory_bandwidth,
    mfu,
    mfu_text,
    peak_flops,
    revise_peak,
)
