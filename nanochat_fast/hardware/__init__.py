"""
What this machine gives a training process, measured once and cached: what a device is (machine.py),
the peak matmul rate and memory bandwidth MFU and MBU are quoted against (peak.py), the dtypes the
arithmetic runs in (precision.py), the measurement files (cache.py), and a process once set up
(process_setup.py). `python -m nanochat_fast.hardware [--tune]` lists (or re-measures) them.
"""

# ruff: noqa: F401  (what other packages use; the rest is reached through the modules)
from .machine import cpu_bf16_support, cpu_model, device_name, machine_key
from .peak import Peak, format_rate, measured_peaks, mfu, mfu_text, peak_flops, revise_peak
