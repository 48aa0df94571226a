"""
Every environment variable nanochat_fast reads, checked before a script does any work, so a wrong
value is one line and exit 2 instead of a late traceback or nothing at all (a misspelt
NANOCHAT_FAST_KERNEL, refused as not KNOWN, would be ignored). check_kernels: the forced backends
run on the device.
"""

import os
from difflib import get_close_matches
from pathlib import Path

from ..core.errors import UserError
from ..kernels import registry

KNOWN = (
    "NANOCHAT_FAST_HOME",  # where data, tokenizer and runs live: a directory (or not yet there)
    "NANOCHAT_FAST_KERNELS",  # backend choice: one name or op=name pairs (kernels/registry.py)
    "NANOCHAT_FAST_NO_EXT",  # 1: the extension was not built on purpose (also read by setup.py)
    "NANOCHAT_FAST_FORCE_CUDA",  # 1: setup.py builds the CUDA sources without a visible GPU
)
FLAGS_01 = ("NANOCHAT_FAST_NO_EXT", "NANOCHAT_FAST_FORCE_CUDA")
TORCHRUN_CORE = ("RANK", "LOCAL_RANK", "WORLD_SIZE")  # set by torchrun: all or none


def _bad(name: str, value: str, why: str) -> UserError:
    return UserError(f"environment variable {name}={value!r}: {why}")


def _int(env, name: str, low: int, high: int | None = None) -> int:
    value = env[name]
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or n < low or (high is not None and n > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise _bad(name, value, f"must be an integer {bound}")
    return n


def check_environment(env=None):
    """Check every variable above (`env`: os.environ by default); UserError naming the first wrong one."""
    env = os.environ if env is None else env
    for name in env:
        if name.startswith("NANOCHAT_FAST_") and name not in KNOWN:
            close = get_close_matches(name, KNOWN, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UserError(
                f"environment variable {name} is not one nanochat_fast reads; {hint}"
                f"known: {', '.join(KNOWN)} (unset it)"
            )
    for name in FLAGS_01:
        if env.get(name, "") not in ("", "0", "1"):
            raise _bad(name, env[name], "must be 0 or 1")
    interpret = env.get("TRITON_INTERPRET")
    if interpret is not None and interpret.strip().lower() not in registry.TRUE_WORDS + registry.FALSE_WORDS:
        raise _bad("TRITON_INTERPRET", interpret, "must be 1 or 0 (or true/false, yes/no, on/off)")
    omp = env.get("OMP_NUM_THREADS")
    if omp is not None and not all(p.strip().isdigit() and int(p) > 0 for p in omp.split(",")):
        raise _bad("OMP_NUM_THREADS", omp, "must be a positive integer (threads per process), e.g. 2; or unset it")
    try:
        registry.parse_request(env.get(registry.ENV_VAR, ""))
    except registry.KernelUnavailableError as e:
        raise UserError(str(e)) from None
    _check_torchrun(env)
    home = env.get("NANOCHAT_FAST_HOME", "")
    if home and Path(home).expanduser().exists() and not Path(home).expanduser().is_dir():
        raise _bad(
            "NANOCHAT_FAST_HOME", home, "exists and is not a directory; point it at a folder (created if missing)"
        )


def _check_torchrun(env):
    present = [k for k in TORCHRUN_CORE if k in env]
    if not present:
        return
    if len(present) != len(TORCHRUN_CORE):
        missing = [k for k in TORCHRUN_CORE if k not in env]
        raise UserError(
            f"torchrun's environment variables are incomplete: {', '.join(present)} set, "
            f"{', '.join(missing)} missing; launch several processes with torchrun (it sets them all), "
            "or unset them for one process"
        )
    world = _int(env, "WORLD_SIZE", 1)
    _int(env, "RANK", 0, world - 1)
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1, world) if "LOCAL_WORLD_SIZE" in env else world
    _int(env, "LOCAL_RANK", 0, local_world - 1)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name, "").strip():
            raise UserError(
                f"environment variable {name} is not set but RANK/WORLD_SIZE are: launch with torchrun "
                "(it sets MASTER_ADDR and MASTER_PORT), or set both"
            )
    if any(c.isspace() for c in env["MASTER_ADDR"]):
        raise _bad("MASTER_ADDR", env["MASTER_ADDR"], "must be a host name or address, without spaces")
    _int(env, "MASTER_PORT", 1, 65535)


def check_kernels(device_type: str) -> dict:
    """{op: backend} that will run on `device_type`; UserError when a forced backend cannot."""
    try:
        return {op: registry.select(op, device_type).name for op in registry.ops()}
    except registry.KernelUnavailableError as e:
        raise UserError(str(e)) from None
