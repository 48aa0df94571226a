"""Runs a module as `python -m MODULE ARGS...` would, with every checkpoint tensor file (model.pt,
model/ shards, optim_rank<R>.pt) taking at least SECONDS longer to write, so that a test can kill a
save midway:

    python python_tests/support/slow_checkpoint_writes.py SECONDS MODULE [ARGS...]

The delay comes after the file is in place, as a slow disk would leave things: the save's partial
folder holds some files and no COMPLETE. The package itself has no such switch."""

import runpy
import sys
import time

from nanochat_fast.checkpoints import checkpoint


def slowed(write, seconds: float):
    def write_slowly(*args, **kwargs):
        result = write(*args, **kwargs)
        time.sleep(seconds)
        return result

    return write_slowly


def main():
    seconds, module, args = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
    checkpoint.write_tensors = slowed(checkpoint.write_tensors, seconds)
    checkpoint.write_shards = slowed(checkpoint.write_shards, seconds)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
