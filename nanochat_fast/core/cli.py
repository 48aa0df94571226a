"""
Command-line plumbing of every script: flags are `--key=value` or `--key value`, hyphens canonical
(`--max-seq-len`) and nanochat's underscores (`--max_seq_len`) accepted; a user mistake (argparse's
or a UserError) is one line on stderr and exit code 2. The value checks are argparse types that
also validate values set in code (training_config's fields), so each rule is written once.
"""

import argparse
import math
import re
import sys
from pathlib import Path

from .errors import EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_OK, CollectiveFailed, UserError  # noqa: F401  (re-exported)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout (usage examples) and shows defaults the help does not state."""

    def _get_help_string(self, action):
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with underscore spellings of flags, failing in one line, keeping the flags given."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # `--lr` must not silently mean `--lr-warmup`
        kwargs.setdefault("epilog", "Flags take --key=value or --key value; --key_name is accepted for --key-name.")
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if args[:1] == ["--"]:  # `torchrun -m module -- --flags`: the separator is not ours
            args = args[1:]
        args = [_canonical(a) for a in args]
        namespace, extras = super().parse_known_args(args, namespace)
        given = {a.partition("=")[0] for a in args if a.startswith("--")}
        namespace._explicit = frozenset(
            action.dest for action in self._actions if given.intersection(action.option_strings)
        )
        namespace._argv = args
        return namespace, extras

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def _canonical(arg: str) -> str:
    """'--max_seq_len=512' -> '--max-seq-len=512'; anything that is not a long flag is unchanged."""
    if not arg.startswith("--") or arg == "--":
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def explicit_flags(args) -> frozenset:
    """The destinations (e.g. 'matrix_lr') of the flags given on the command line, not defaulted."""
    return getattr(args, "_explicit", frozenset())


def flag_values(args) -> dict:
    """The parsed flags as plain JSON values (for meta.json and the report)."""
    plain = (str, int, float, bool, type(None))
    return {k: v if isinstance(v, plain) else str(v) for k, v in vars(args).items() if not k.startswith("_")}


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


# value checks: text (from argparse) or a value (from code) in, the value out, or
# argparse.ArgumentTypeError saying what is wrong


def _number(value, kind):
    """`value` as an int or a finite float (kind), from text or from a number (never a bool)."""
    what = "an integer" if kind is int else "a number"
    if isinstance(value, str):
        try:
            x = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
    elif isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
    else:
        x = kind(value)
    if kind is float and not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
    return x


def integer(value) -> int:
    return _number(value, int)


def _bounded(kind, ok, must: str):
    """The check of a number of `kind` that `ok` accepts; otherwise "<must>, got <value>"."""

    def check(value):
        x = _number(value, kind)
        if not ok(x):
            raise argparse.ArgumentTypeError(f"{must}, got {value}")
        return x

    return check


positive_int = _bounded(int, lambda n: n > 0, "must be a positive integer")
non_negative_int = _bounded(int, lambda n: n >= 0, "must be >= 0")
random_seed = _bounded(int, lambda n: 0 <= n < 2**63, "must be an integer in [0, 2^63)")
# -1: not set (the next option decides)
positive_or_unset_int = _bounded(int, lambda n: n == -1 or n > 0, "must be > 0 (or -1: not set)")
positive_or_unset_float = _bounded(float, lambda x: x == -1 or x > 0, "must be > 0 (or -1: not set)")
positive_float = _bounded(float, lambda x: x > 0, "must be > 0")
non_negative_float = _bounded(float, lambda x: x >= 0, "must be >= 0")
fraction = _bounded(float, lambda x: 0.0 <= x <= 1.0, "must be in [0, 1]")


def choice(*values):
    """A check that the value is one of `values` (for fields set in code; argparse has choices=)."""

    def check(value):
        if value not in values:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(map(repr, values))}, got {value!r}")
        return value

    return check


def boolean(value) -> bool:
    if not isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"must be True or False, got {value!r}")
    return value


def optional(check):
    """`check`, or None (a flag whose default is decided later, e.g. from a checkpoint)."""
    return lambda value: None if value is None else check(value)


def check_value(dest: str, check, value):
    """check(value), with a failure as the UserError argparse would have printed for the flag."""
    try:
        return check(value)
    except argparse.ArgumentTypeError as e:
        raise UserError(f"argument {flag_name(dest)}: {e}") from None


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def byte_size(value) -> int:
    """A memory size in bytes: a number, optionally with K, M, G or T (powers of 1024; KB, KiB, kb...
    mean the same), e.g. 512M or 1.5G."""
    if isinstance(value, str):
        match = _SIZE.fullmatch(value.strip())
        if not match:
            raise argparse.ArgumentTypeError(f"expected a size like 512M or 2G (bytes, or K/M/G/T), got {value!r}")
        n = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    else:
        n = _number(value, int)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {value}")
    return n


def format_bytes(n: int) -> str:
    """2147483648 -> '2.00 GiB' (the unit that keeps the number below 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")


def plain_name(value) -> str:
    """One path component under NANOCHAT_FAST_HOME (no '/', not '..': a name never reaches outside
    its folder). '' means the default."""
    if not isinstance(value, str):
        raise argparse.ArgumentTypeError(f"expected a name, got {value!r}")
    if value and (not _PLAIN_NAME.fullmatch(value) or value.strip(".") == ""):
        raise argparse.ArgumentTypeError(
            f"must be a plain name (letters, digits, '.', '_', '+', '-'; at most 100 characters, no '/'), got {value!r}"
        )
    return value


def is_plain_name(value) -> bool:
    try:
        return bool(plain_name(value))
    except argparse.ArgumentTypeError:
        return False


def run_name(value) -> str:
    try:
        return plain_name(value)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(
            f"{e}; a run name is a folder under NANOCHAT_FAST_HOME/runs, use --out-dir=PATH to write a run elsewhere"
        ) from None


def run_ref(value) -> str:
    """A run to read from: a run name, or the path of a run directory that exists ('': the newest)."""
    if isinstance(value, str) and Path(value).expanduser().is_dir():
        return value
    try:
        return plain_name(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be a run name (a folder under NANOCHAT_FAST_HOME/runs) or an existing run directory, got {value!r}"
        ) from None


def add_checkpoint_flags(parser, newest: str = "the newest run", required: bool = False):
    """--run and --step: the checkpoint a command reads (a run's newest complete step unless --step)."""
    run_help = "run name or directory" + ("" if required else f" (default: {newest})")
    parser.add_argument("--run", type=run_ref, default="", required=required, help=run_help)
    parser.add_argument(
        "--step", type=non_negative_int, default=None, help="checkpoint step (default: the newest complete one)"
    )


def run(main, argv=None):
    """Entry point for `python -m nanochat_fast.scripts.X`: exit code from main, one line for a UserError."""
    try:
        code = main(argv)
    except (UserError, CollectiveFailed) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
    sys.exit(code or EXIT_OK)
