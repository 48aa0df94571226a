"""The old spelling of `python -m nanochat_fast.tools.triton_aot` (the tool moved out of the kernels),
kept working for one release: it says so in one line and runs the tool."""

import runpy
import sys

if __name__ == "__main__":
    print(
        "note: python -m nanochat_fast.kernels.triton_aot is deprecated and goes in the next release; "
        "use python -m nanochat_fast.tools.triton_aot",
        file=sys.stderr,
    )
    runpy.run_module("nanochat_fast.tools.triton_aot", run_name="__main__", alter_sys=True)
