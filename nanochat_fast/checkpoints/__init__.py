"""
The checkpoint home: a run on disk, and the only code that reads and writes tensor files.

    runs/<run>/checkpoints/step_NNNNNN/   model.pt or model/ (DCP shards), optim_rank<R>.pt,
                                          meta.json (with every other file's sha256 and size), COMPLETE
checkpoint.py saves, checks and reads one checkpoint; run_dirs.py decides a run's directory.
"""

from .checkpoint import (  # noqa: F401  (the package's interface)
    COMPLETE,
    FORMAT_VERSION,
    all_finite,
    complete_checkpoints,
    export_model,
    load_meta,
    load_model_state,
    load_rank_states,
    read_tensors,
    resolve_checkpoint,
    save_checkpoint,
    write_meta,
    write_tensors,
)
from .run_dirs import new_run_dir, newest_run, open_run_dir, run_dir_of  # noqa: F401
