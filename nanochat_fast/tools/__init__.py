"""
Tooling beside training, which no training, evaluation or serving path imports: the ahead-of-time
compile of every Triton kernel for GPUs that need not be present, each variant checked against its
target's limits.

    triton_aot.py          the compile and its checks; `python -m nanochat_fast.tools.triton_aot`
    triton_kernel_list.py  every Triton kernel of kernels/ with its signature, configs and a call's cost
    gpu_targets.py         the GPUs compiled for (limits, peak rates) and `ptxas -v`'s report
"""
