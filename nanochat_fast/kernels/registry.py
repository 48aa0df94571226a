"""
Which implementation ("backend") of each op runs on each device, and why.

Every op has up to four backends, fastest first:
    triton     Triton kernels (CUDA tensors; CPU tensors only under TRITON_INTERPRET=1, for tests)
    cpp        the compiled extension nanochat_fast._C (CPU, and CUDA where a .cu exists)
    torch      an optimised pure-PyTorch path, where the op has one
    reference  the plain PyTorch baseline, runs anywhere (MPS included)

`auto` takes the first available backend in the op's preference list for the tensor's device.
NANOCHAT_FAST_KERNELS forces a choice: one name for every op (`NANOCHAT_FAST_KERNELS=reference`)
or per-op pairs (`NANOCHAT_FAST_KERNELS=newton_schulz=triton,adamw_slice_update=cpp`). Forcing a
backend that cannot run is an error that says why, never a silent fallback.
"""

import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch  # (also loads libtorch before the extension that links against it)

BACKENDS = ("triton", "cpp", "torch", "reference")
DEVICE_TYPES = ("cpu", "cuda", "mps")
ENV_VAR = "NANOCHAT_FAST_KERNELS"


class KernelUnavailableError(RuntimeError):
    """A forced backend cannot run here; the message is one line saying why and what to do."""


@dataclass(frozen=True)
class Backend:
    op: str
    name: str
    fn: Callable
    why_not: Callable[[str], str | None]  # device type -> reason it cannot run there, or None


_OPS: dict[str, dict[str, Backend]] = {}
_AUTO_ORDER: dict[str, dict[str, tuple[str, ...]]] = {}


def register_op(op: str, auto_order: dict[str, tuple[str, ...]]):
    """Declare an op and, per device type, the order in which `auto` tries its backends."""
    _OPS[op] = {}
    _AUTO_ORDER[op] = auto_order


def register_backend(op: str, name: str, why_not: Callable[[str], str | None]):
    """Decorator: register `fn` as backend `name` of `op`."""
    assert name in BACKENDS, name

    def wrap(fn):
        _OPS[op][name] = Backend(op, name, fn, why_not)
        return fn

    return wrap


def ops() -> list[str]:
    return list(_OPS)


def backends(op: str) -> dict[str, Backend]:
    """The backends of `op`, fastest first."""
    return {name: _OPS[op][name] for name in BACKENDS if name in _OPS[op]}


# ---------------------------------------------------------------------------------------------
# availability of the shared ingredients


def _load_extension():
    try:
        from nanochat_fast import _C

        return _C, None
    except ImportError as e:
        if os.environ.get("NANOCHAT_FAST_NO_EXT") == "1":
            return None, "extension not built (NANOCHAT_FAST_NO_EXT=1 at install)"
        reason = (
            f"extension nanochat_fast._C not built or not loadable ({e}); "
            "rebuild with `pip install -e . --no-build-isolation`"
        )
        warnings.warn(f"nanochat_fast is running on PyTorch fallbacks: {reason}", stacklevel=2)
        return None, reason


_C, _C_ERROR = _load_extension()


def extension():
    """The compiled extension nanochat_fast._C (its ops and the RowPacker/RowStream classes), or
    None where it is not built; cpp_why_not says why."""
    return _C


def cpp_why_not(device_type: str, has_cuda_kernel: bool = False) -> str | None:
    if _C is None:
        return _C_ERROR
    if device_type == "cpu":
        return None
    if device_type == "cuda":
        if not has_cuda_kernel:
            return "this op has no CUDA kernel in csrc/cuda"
        if not _C.with_cuda:
            return (
                "extension built without CUDA (at install torch had no CUDA, nvcc was not found or no GPU "
                "was visible; NANOCHAT_FAST_FORCE_CUDA=1 builds it without a GPU)"
            )
        return None
    return f"no compiled kernel for {device_type}"


def triton_why_not(device_type: str) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device_type == "cuda":
        return None
    if device_type == "cpu":
        if triton_interpreting():
            return None
        return "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter: exact but slow, for tests)"
    return f"Triton does not run on {device_type}"


TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def triton_interpreting() -> bool:
    """TRITON_INTERPRET read as Triton reads it (1/true/yes/on, any case)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in TRUE_WORDS


def always(device_type: str) -> str | None:
    return None


def cpp_takes_float32_without_grad(x: torch.Tensor) -> Callable[[str], str | None]:
    """select_for_inputs' why_not_inputs for an op whose cpp backend takes float32 tensors that want
    no gradient (rms_norm, softcap): the reason x is not one, for the cpp backend."""

    def why_not(name: str) -> str | None:
        if name == "cpp" and (x.dtype != torch.float32 or x.requires_grad):
            return f"takes float32 without autograd, got {x.dtype}{' requiring grad' if x.requires_grad else ''}"
        return None

    return why_not


# ---------------------------------------------------------------------------------------------
# choosing


def parse_request(spec: str) -> dict[str, str]:
    """'cpp' -> {'*': 'cpp'}; 'newton_schulz=triton,adamw_slice_update=cpp' -> per op."""
    choice = {}
    for part in filter(None, (s.strip() for s in spec.split(","))):
        op, _, name = part.rpartition("=")
        op = op.strip() or "*"
        name = name.strip()
        if name not in BACKENDS + ("auto",):
            raise KernelUnavailableError(
                f"{ENV_VAR}={spec!r}: unknown backend {name!r}; use one of auto, {', '.join(BACKENDS)}"
            )
        if op != "*" and op not in _OPS:
            raise KernelUnavailableError(f"{ENV_VAR}={spec!r}: unknown op {op!r}; ops are {', '.join(_OPS)}")
        choice[op] = name
    return choice


@functools.lru_cache(maxsize=16)
def _parsed(spec: str) -> dict[str, str]:
    return parse_request(spec)  # a decode step asks a dozen times a layer: parse each setting once


def requested(op: str) -> str:
    """The backend NANOCHAT_FAST_KERNELS asks for `op` ('auto' when it asks for nothing)."""
    choice = _parsed(os.environ.get(ENV_VAR, ""))
    return choice.get(op, choice.get("*", "auto"))


def select(op: str, device_type: str, name: str | None = None) -> Backend:
    """The backend that runs `op` on `device_type`: `name` if given, else the environment, else auto."""
    name = name or requested(op)
    impls = _OPS[op]
    if name == "auto":
        for candidate in _AUTO_ORDER[op].get(device_type, ("reference",)):
            impl = impls.get(candidate)
            if impl is not None and impl.why_not(device_type) is None:
                return impl
        raise KernelUnavailableError(f"{op}: no backend can run on {device_type}")
    impl = impls.get(name)
    if impl is None:
        raise KernelUnavailableError(
            f"{op} has no {name!r} backend (it has: {', '.join(impls)}); unset {ENV_VAR} or pick one of those"
        )
    reason = impl.why_not(device_type)
    if reason is not None:
        raise KernelUnavailableError(
            f"{op}: backend {name!r} is unavailable on {device_type}: {reason}. "
            f"Unset {ENV_VAR} (or set it to auto) to use the best available backend"
        )
    return impl


def select_for_inputs(
    op: str, device_type: str, name: str | None, why_not_inputs: Callable[[str], str | None]
) -> Backend:
    """select(), for inputs the picked backend may not take (why_not_inputs(backend name) -> the
    reason, or None): an automatic choice then takes the op's reference backend, a forced one
    (`name`, or NANOCHAT_FAST_KERNELS) is a ValueError saying why."""
    impl = select(op, device_type, name)
    reason = why_not_inputs(impl.name)
    if reason is None:
        return impl
    if (name or requested(op)) != "auto":
        raise ValueError(f"{op}'s {impl.name} backend {reason}")
    return select(op, device_type, "reference")
