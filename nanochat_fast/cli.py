"""
Command-line plumbing shared by every script in nanochat_fast.scripts.

- Flags are `--key=value` or `--key value`; hyphens are canonical (`--max-seq-len`) and the
  nanochat spelling with underscores (`--max_seq_len`) is accepted as an alias.
- A user mistake is one line on stderr and exit code 2: argparse errors, and any UserError raised
  by a script (`raise UserError("--depth must be > 0, got -1")`). No traceback for those.
- Exit codes: 0 success, 2 bad input, 3 stopped by the NaN guard (see EXIT_*).
"""
import argparse
import sys

EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3


class UserError(Exception):
    """A problem with the user's input: the message is printed as one line, exit code 2."""

    exit_code = EXIT_BAD_INPUT


def _canonical(arg: str) -> str:
    """'--max_seq_len=512' -> '--max-seq-len=512'; anything that is not a long flag is unchanged."""
    if not arg.startswith("--") or arg == "--":
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout (scripts put usage examples there) and shows defaults."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that accepts underscore spellings of hyphenated flags and fails in one line."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # `--lr` must not silently mean `--lr-warmup`
        kwargs.setdefault("epilog", "Flags take --key=value or --key value; --key_name is accepted for --key-name.")
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if args[:1] == ["--"]:  # `torchrun -m module -- --flags`: the separator is not ours
            args = args[1:]
        return super().parse_known_args([_canonical(a) for a in args], namespace)

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_float(text):
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text):
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def run(main, argv=None):
    """Entry point for `python -m nanochat_fast.scripts.X`: exit code from main, one line for a UserError."""
    try:
        code = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    sys.exit(code or 0)
