"""Small Triton helpers shared by the kernels, and a fix for the interpreter of older Tritons."""

import inspect
import re

import triton
import triton.language as tl


def fix_interpreter_loop_bounds():
    """Triton's interpreter before 3.8 (3.6.0 is what torch 2.11 installs) turns a runtime loop bound
    into a Python int with int() of a one-element array, which NumPy 2.4 refuses: every kernel looping
    `for k in range(0, n, BLOCK)` over a runtime n fails under TRITON_INTERPRET=1 with "only
    0-dimensional arrays can be converted to Python scalars" (triton-lang/triton#9171). Compiled for a
    GPU the loop is an scf.for over i32 values and no NumPy is involved, so GPUs are not affected, only
    the CPU tests. Rewriting the loops cannot avoid it: any runtime bound, a block count too, goes
    through the same conversion, and a while loop (which does not) would cost the GPU matmul loops their
    software pipelining. So the interpreter gets upstream's one-line fix (triton-lang/triton#9172,
    `int(data.squeeze())`, in 3.8) where it lacks it; compiled kernels never call the patched function.
    Returns whether it patched."""
    version = tuple(int(v) for v in re.findall(r"\d+", triton.__version__)[:2])
    if version >= (3, 8):
        return False
    try:
        from triton.runtime import interpreter

        patch_tensor = interpreter._patch_lang_tensor
        parameters = list(inspect.signature(patch_tensor).parameters)
    except (ImportError, AttributeError):  # an interpreter laid out otherwise: not the one this fixes
        return False
    if getattr(patch_tensor, "fixes_loop_bounds", False) or parameters != ["tensor", "scope"]:
        return False  # patched already, or not the function this fixes

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.fixes_loop_bounds = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


fix_interpreter_loop_bounds()  # every kernel module imports this one


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
