"""Small Triton helpers shared by the kernels."""
import triton
import triton.language as tl


@triton.jit
def to_bf16_rtne(x):
    """fp32 -> bf16 rounded to nearest even, in integer arithmetic.

    On a GPU this is what `x.to(tl.bfloat16)` does; the Triton interpreter instead truncates, so a
    kernel tested there would not be the kernel a GPU runs. Doing the rounding explicitly (as
    c10::BFloat16 does) gives the same bits on both, for a handful of integer ops per element.
    """
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).to(tl.uint16)
    rounded = tl.where(x != x, 0x7FC0, rounded)  # any NaN -> the canonical quiet NaN
    return rounded.to(tl.bfloat16, bitcast=True)
