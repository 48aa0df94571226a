"""SPEC's public name for process setup (`from nanochat_fast.common import compute_init`): a
re-export, nothing more; the code lives in core/distributed.py."""

from .core.distributed import (  # noqa: F401  (re-exported)
    autodetect_device_type,
    compute_cleanup,
    compute_init,
    get_dist_info,
    is_distributed,
    print0,
)
