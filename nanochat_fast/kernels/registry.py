"""
Which implementation ("backend") of each op runs on each device: resolved once per (op, device type,
setting), then a dictionary lookup per call (a changed setting is seen). Backends, fastest first: triton
(CUDA; CPU tensors only under TRITON_INTERPRET=1, for tests), cpp (the extension nanochat_fast._C, where
torch's dispatcher holds the op's kernel for the device), torch (an optimised pure-PyTorch path) and
reference (the plain baseline). NANOCHAT_FAST_KERNELS forces one name for every op or per op
(`newton_schulz=triton,pack_rows=cpp`).
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
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


class KernelUnavailableError(RuntimeError):
    """A forced backend cannot run here; the message is one line saying why and what to do."""


@dataclass(frozen=True)
class Backend:
    op: str
    name: str
    fn: Callable
    why_not: Callable[[str], str | None]  # device type -> reason it cannot run there, or None


_OPS: dict[str, dict[str, Backend]] = {}
_AUTO: dict[str, dict[str, tuple[str, ...]]] = {}  # an op's own auto order on a device type
_CHOSEN: dict[tuple, str] = {}  # (op, device type, name, NANOCHAT_FAST_KERNELS, TRITON_INTERPRET) -> backend name


try:
    from nanochat_fast import _C

    _C_ERROR = None
except ImportError as e:
    _C = None
    if os.environ.get("NANOCHAT_FAST_NO_EXT") == "1":
        _C_ERROR = "extension not built (NANOCHAT_FAST_NO_EXT=1 at install)"
    else:
        _C_ERROR = (
            f"extension nanochat_fast._C not built or not loadable ({e}); "
            "rebuild with `pip install -e . --no-build-isolation`"
        )
        warnings.warn(f"nanochat_fast is running on PyTorch fallbacks: {_C_ERROR}")


def extension():
    """The compiled extension nanochat_fast._C (its RowPacker and RowStream), or None where it is not built."""
    return _C


def cpp_why_not(op: str, device_type: str) -> str | None:
    """Why torch.ops.nanochat_fast.<op> has no kernel for `device_type`: the dispatcher routes by device."""
    if _C is None:
        return _C_ERROR
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key and torch._C._dispatch_has_kernel_for_dispatch_key(f"nanochat_fast::{op}", key):
        return None
    if device_type != "cuda":
        return f"no compiled kernel for {device_type}"
    if _C.with_cuda:
        return "this op has no CUDA kernel in csrc/cuda"
    return (
        "extension built without CUDA (at install torch had no CUDA, nvcc was not found or no GPU "
        "was visible; NANOCHAT_FAST_FORCE_CUDA=1 builds it without a GPU)"
    )


def triton_interpreting() -> bool:
    """TRITON_INTERPRET read as Triton reads it (1/true/yes/on, any case)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in TRUE_WORDS


def triton_why_not(device_type: str) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device_type == "cuda" or (device_type == "cpu" and triton_interpreting()):
        return None
    if device_type == "cpu":
        return "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter: exact but slow, for tests)"
    return f"Triton does not run on {device_type}"


def register(op: str, name: str, why_not: Callable[[str], str | None] | None = None, auto: dict | None = None):
    """Decorator: `fn` is backend `name` of `op`. why_not defaults to the name's rule: triton where Triton
    runs, cpp where the dispatcher has the op, torch and reference anywhere. `auto` (device type ->
    backends in order) replaces the default order, every backend fastest first (triton on CUDA only)."""
    assert name in BACKENDS, name
    if why_not is None:
        why_not = {"triton": triton_why_not, "cpp": functools.partial(cpp_why_not, op)}.get(name, lambda d: None)
    _AUTO.setdefault(op, {}).update(auto or {})

    def wrap(fn):
        _OPS.setdefault(op, {})[name] = Backend(op, name, fn, why_not)
        _CHOSEN.clear()
        return fn

    return wrap


def ops() -> list[str]:
    return sorted(_OPS)


def backends(op: str) -> dict[str, Backend]:
    """The backends of `op`, fastest first."""
    return {name: _OPS[op][name] for name in BACKENDS if name in _OPS[op]}


@functools.lru_cache(maxsize=16)
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
            raise KernelUnavailableError(f"{ENV_VAR}={spec!r}: unknown op {op!r}; ops are {', '.join(ops())}")
        choice[op] = name
    return choice


def requested(op: str) -> str:
    """The backend NANOCHAT_FAST_KERNELS asks for `op` ('auto' when it asks for nothing)."""
    choice = parse_request(os.environ.get(ENV_VAR, ""))
    return choice.get(op, choice.get("*", "auto"))


def select(op: str, device_type: str, name: str | None = None) -> Backend:
    """The backend that runs `op` on `device_type`: `name` if given, else the environment, else auto."""
    return _OPS[op][_choose(op, device_type, name, os.environ.get(ENV_VAR, ""), triton_interpreting())]


@torch.compiler.assume_constant_result  # a compiled graph takes the choice as it is
def _choose(op: str, device_type: str, name: str | None, spec: str, interpreting: bool) -> str:
    key = (op, device_type, name, spec, interpreting)  # the settings as they are now: a change is seen
    if key not in _CHOSEN:
        _CHOSEN[key] = _resolve(op, device_type, name or requested(op))
    return _CHOSEN[key]


def _resolve(op: str, device_type: str, name: str) -> str:
    impls = _OPS[op]
    if name == "auto":
        default = [b for b in BACKENDS if b != "triton" or device_type == "cuda"]
        for candidate in _AUTO[op].get(device_type, default):
            if candidate in impls and impls[candidate].why_not(device_type) is None:
                return candidate
        raise KernelUnavailableError(f"{op}: no backend can run on {device_type}")
    if name not in impls:
        raise KernelUnavailableError(
            f"{op} has no {name!r} backend (it has: {', '.join(impls)}); unset {ENV_VAR} or pick one of those"
        )
    reason = impls[name].why_not(device_type)
    if reason is not None:
        raise KernelUnavailableError(
            f"{op}: backend {name!r} is unavailable on {device_type}: {reason}. "
            f"Unset {ENV_VAR} (or set it to auto) to use the best available backend"
        )
    return name


def select_for_inputs(op: str, device_type: str, name: str | None, cpp_refuses: Callable[[], str | None]) -> Backend:
    """select(), for inputs the cpp backend may not take (cpp_refuses() -> why, or None): an automatic
    choice then takes the reference backend, a forced one is a ValueError saying why."""
    impl = select(op, device_type, name)
    reason = cpp_refuses() if impl.name == "cpp" else None
    if reason is None:
        return impl
    if (name or requested(op)) != "auto":
        raise ValueError(f"{op}'s cpp backend {reason}")
    return select(op, device_type, "reference")
