"""
python -m nanochat_fast.kernels [--json]

Prints, for every op and backend, whether it can run on each device type and why not, and which
backend `auto` (or NANOCHAT_FAST_KERNELS) picks per device. Device types this machine lacks are
still shown: the table says what would run there (e.g. triton for CUDA tensors).
"""

import argparse
import json
import os
import sys

import torch

from . import registry
from .registry import DEVICE_TYPES, KernelUnavailableError


def selected(op: str, device_type: str) -> str:
    try:
        return registry.select(op, device_type).name
    except KernelUnavailableError as e:
        return f"error: {e}"


def table() -> dict:
    present = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    ops = {
        op: {
            "backends": {
                name: {d: impl.why_not(d) for d in DEVICE_TYPES} for name, impl in registry.backends(op).items()
            },
            "selected": {d: selected(op, d) for d in DEVICE_TYPES},
        }
        for op in registry.ops()
    }
    return {"devices_present": present, "env": {registry.ENV_VAR: os.environ.get(registry.ENV_VAR, "")}, "ops": ops}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m nanochat_fast.kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    t = table()
    if args.json:
        print(json.dumps(t, indent=2))
        return 0
    present = ", ".join(f"{d} ({'present' if p else 'not present here'})" for d, p in t["devices_present"].items())
    print(f"devices: {present}")
    print(f"{registry.ENV_VAR}={t['env'][registry.ENV_VAR] or '(unset: auto)'}\n")
    width = 26
    print(f"{'op':<22} {'backend':<10} " + " ".join(f"{d:<{width}}" for d in DEVICE_TYPES))
    for op, entry in t["ops"].items():
        for i, (name, per_device) in enumerate(entry["backends"].items()):
            cells = " ".join(f"{('yes' if r is None else 'no'):<{width}}" for r in per_device.values())
            print(f"{op if i == 0 else '':<22} {name:<10} {cells}")
        cells = " ".join(f"{'-> ' + s:<{width}}" for s in entry["selected"].values())
        print(f"{'':<22} {'uses':<10} {cells}\n")
    print("why not:")
    for op, entry in t["ops"].items():
        for name, per_device in entry["backends"].items():
            for d, reason in per_device.items():
                if reason is not None:
                    print(f"  {op}/{name} on {d}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
