"""
Where a run lives on disk, and the one place that reads and writes it: checkpoints that survive
kills, full disks and changes of world size.

    runs/<run>/checkpoints/step_NNNNNN/
        model.pt            the uncompiled model's state_dict, fp32 tensors        (rank 0)
     or model/              the same, sharded: torch.distributed.checkpoint (DCP)  (every rank its shard)
        optim_rank<R>.pt    rank R's optimizer shards + RNG state                  (every rank)
        meta.json           format version, step, model config, loader and loop state, args, and the
                            sha256 and size of every other file ("files")
        COMPLETE            written last, by rank 0, after a barrier; meta.json's sha256 and size

files.py writes and reads single files (torch.save/torch.load, DCP), step_dirs.py one checkpoint,
run_dirs.py a run's directory, verification.py checks a checkpoint against its recorded digests.
The model, optimizers and training loop hand state dicts in and get
state dicts back; everything is plain tensors and JSON (weights_only=True reads it anywhere).
"""

from .files import read_tensors, write_tensors
from .run_dirs import new_run_dir, newest_run, open_run_dir, run_dir_of
from .step_dirs import (
    COMPLETE,
    FORMAT_VERSION,
    all_finite,
    complete_checkpoints,
    export_model,
    incomplete_checkpoints,
    is_complete,
    load_meta,
    load_model_state,
    load_rank_states,
    remove_incomplete,
    resolve_checkpoint,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)
from .verification import DamagedCheckpoint

__all__ = [
    "read_tensors",
    "write_tensors",
    "new_run_dir",
    "newest_run",
    "open_run_dir",
    "run_dir_of",
    "COMPLETE",
    "FORMAT_VERSION",
    "all_finite",
    "complete_checkpoints",
    "export_model",
    "incomplete_checkpoints",
    "is_complete",
    "load_meta",
    "load_model_state",
    "load_rank_states",
    "remove_incomplete",
    "resolve_checkpoint",
    "save_checkpoint",
    "step_dir",
    "verify_checkpoint",
    "DamagedCheckpoint",
]
