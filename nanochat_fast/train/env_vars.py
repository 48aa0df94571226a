"""
Every environment variable nanochat_fast reads, checked in one place before a script does any work:
check_environment() turns a wrong value, which would otherwise surface late as a traceback or not at
all (a misspelt NANOCHAT_FAST_KERNEL is silently ignored), into one line, exit 2:

    NANOCHAT_FAST_HOME            where data, tokenizer and runs live: a directory (or not yet there)
    NANOCHAT_FAST_KERNELS         backend choice: one name or op=name pairs (kernels/registry.py)
    NANOCHAT_FAST_NO_EXT          1: the extension was not built on purpose (also read by setup.py)
    NANOCHAT_FAST_FORCE_CUDA      1: setup.py builds the CUDA sources without a visible GPU
    OMP_NUM_THREADS               threads per process: a positive integer (or OpenMP's list "4,2")
    TRITON_INTERPRET              1/true/yes/on: run Triton kernels on CPU tensors (tests)
    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
                                  set by torchrun; all or none of the first three, consistent ranks

Any other NANOCHAT_FAST_* variable is refused as a likely misspelling (KNOWN lists the names);
check_kernels(device_type) then checks that the forced backends can run on the chosen device.
"""

import os
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path

from ..core.errors import UserError
from ..kernels import registry

PREFIX = "NANOCHAT_FAST_"
KNOWN = ("NANOCHAT_FAST_HOME", "NANOCHAT_FAST_KERNELS", "NANOCHAT_FAST_NO_EXT", "NANOCHAT_FAST_FORCE_CUDA")
FLAGS_01 = ("NANOCHAT_FAST_NO_EXT", "NANOCHAT_FAST_FORCE_CUDA")
TORCHRUN_CORE = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class Environment:
    """What the environment asks for, after checking (for the log and the run report)."""

    home: str
    kernels: str
    omp_num_threads: str | None
    torchrun: dict | None  # RANK, LOCAL_RANK, WORLD_SIZE, ... as ints/strings, or None: one plain process

    def describe(self) -> dict:
        out = {
            "NANOCHAT_FAST_HOME": self.home,
            "NANOCHAT_FAST_KERNELS": self.kernels or "(unset: auto)",
            "OMP_NUM_THREADS": self.omp_num_threads or "(unset)",
        }
        if self.torchrun:
            out["torchrun"] = ", ".join(f"{k}={v}" for k, v in self.torchrun.items())
        return out


def _bad(name: str, value: str, why: str) -> UserError:
    return UserError(f"environment variable {name}={value!r}: {why}")


def _int(name: str, value: str, low: int, high: int | None = None) -> int:
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or n < low or (high is not None and n > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise _bad(name, value, f"must be an integer {bound}")
    return n


def _check_names(env):
    for name in env:
        if name.startswith(PREFIX) and name not in KNOWN:
            close = get_close_matches(name, KNOWN, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UserError(
                f"environment variable {name} is not one nanochat_fast reads; {hint}"
                f"known: {', '.join(KNOWN)} (unset it)"
            )


def _check_home(env) -> str:
    value = env.get("NANOCHAT_FAST_HOME", "")
    if value:
        path = Path(value).expanduser()
        if path.exists() and not path.is_dir():
            raise _bad(
                "NANOCHAT_FAST_HOME", value, "exists and is not a directory; point it at a folder (created if missing)"
            )
    from ..core.paths import home

    return str(home())


def _check_simple(env):
    for name in FLAGS_01:
        if env.get(name, "") not in ("", "0", "1"):
            raise _bad(name, env[name], "must be 0 or 1")
    interpret = env.get("TRITON_INTERPRET")
    if interpret is not None and interpret.strip().lower() not in registry.TRUE_WORDS + registry.FALSE_WORDS:
        raise _bad("TRITON_INTERPRET", interpret, "must be 1 or 0 (or true/false, yes/no, on/off)")
    omp = env.get("OMP_NUM_THREADS")
    if omp is not None:
        parts = omp.split(",")
        if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise _bad("OMP_NUM_THREADS", omp, "must be a positive integer (threads per process), e.g. 2; or unset it")
    return omp


def _check_kernel_request(env) -> str:
    spec = env.get(registry.ENV_VAR, "")
    try:
        registry.parse_request(spec)
    except registry.KernelUnavailableError as e:
        raise UserError(str(e)) from None
    return spec


def _check_torchrun(env) -> dict | None:
    present = [k for k in TORCHRUN_CORE if k in env]
    if not present:
        return None
    if len(present) != len(TORCHRUN_CORE):
        missing = [k for k in TORCHRUN_CORE if k not in env]
        raise UserError(
            f"torchrun's environment variables are incomplete: {', '.join(present)} set, "
            f"{', '.join(missing)} missing; launch several processes with torchrun (it sets them all), "
            "or unset them for one process"
        )
    world = _int("WORLD_SIZE", env["WORLD_SIZE"], 1)
    rank = _int("RANK", env["RANK"], 0, world - 1)
    local_world = _int("LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"], 1, world) if "LOCAL_WORLD_SIZE" in env else None
    local_rank = _int("LOCAL_RANK", env["LOCAL_RANK"], 0, (local_world or world) - 1)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name, "").strip():
            raise UserError(
                f"environment variable {name} is not set but RANK/WORLD_SIZE are: launch with torchrun "
                "(it sets MASTER_ADDR and MASTER_PORT), or set both"
            )
    addr = env["MASTER_ADDR"]
    if any(c.isspace() for c in addr):
        raise _bad("MASTER_ADDR", addr, "must be a host name or address, without spaces")
    port = _int("MASTER_PORT", env["MASTER_PORT"], 1, 65535)
    out = dict(RANK=rank, LOCAL_RANK=local_rank, WORLD_SIZE=world, MASTER_ADDR=addr, MASTER_PORT=port)
    if local_world is not None:
        out["LOCAL_WORLD_SIZE"] = local_world
    return out


def check_environment(env=None) -> Environment:
    """Check every variable above (`env`: os.environ by default); UserError naming the first wrong one."""
    env = os.environ if env is None else env
    _check_names(env)
    omp = _check_simple(env)
    kernels = _check_kernel_request(env)
    torchrun = _check_torchrun(env)
    return Environment(home=_check_home(env), kernels=kernels, omp_num_threads=omp, torchrun=torchrun)


def check_kernels(device_type: str) -> dict:
    """{op: backend} that will run on `device_type`; UserError when a forced backend cannot."""
    chosen = {}
    for op in registry.ops():
        try:
            chosen[op] = registry.select(op, device_type).name
        except registry.KernelUnavailableError as e:
            raise UserError(str(e)) from None
    return chosen
