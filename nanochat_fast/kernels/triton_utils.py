"""What the Triton kernels share: triton itself (a stand-in where it is not installed), fp32 -> bf16
rounding on store, and a fix for the interpreter of older Tritons."""

import inspect
import re

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU builds of torch, macOS: the kernels stay plain functions, never launched
    HAVE_TRITON = False

    class _NoTriton:
        def jit(self, fn):
            return fn

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    triton = tl = _NoTriton()


def fix_interpreter_loop_bounds():
    """Triton's interpreter before 3.8 (torch 2.11 installs 3.6) takes a runtime loop bound by int() of a
    one-element array, which NumPy 2.4 refuses (triton-lang/triton#9171): such loops fail under
    TRITON_INTERPRET=1 only. A while loop would cost the GPU its pipelining, so the interpreter gets
    upstream's one-line fix (triton-lang/triton#9172, in 3.8). Returns whether it patched."""
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


if HAVE_TRITON:
    fix_interpreter_loop_bounds()  # every kernel module imports this one


@triton.jit
def store(ptrs, x, mask):
    """Store fp32 `x` in the pointers' dtype, bf16 rounded to nearest even (the kernels compute in fp32)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        tl.store(ptrs, to_bf16_rtne(x), mask=mask)
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def to_bf16_rtne(x):
    """fp32 -> bf16 rounded to nearest even, in integer arithmetic: what `x.to(tl.bfloat16)` does on a
    GPU, where the interpreter truncates. Explicit (as c10::BFloat16 does it), the bits are a GPU's on both."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).to(tl.uint16)
    rounded = tl.where(x != x, 0x7FC0, rounded)  # any NaN -> the canonical quiet NaN
    return rounded.to(tl.bfloat16, bitcast=True)
