"""The public name of process setup (`from nanochat_fast.common import compute_init`): the code
lives in core/distributed.py."""

from .core.distributed import (
    autodetect_device_type,
    compute_cleanup,
    compute_init,
    get_dist_info,
    is_distributed,
    print0,
)

__all__ = [
    "autodetect_device_type",
    "compute_cleanup",
    "compute_init",
    "get_dist_info",
    "is_distributed",
    "print0",
]
