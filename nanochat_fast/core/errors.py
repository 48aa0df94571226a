"""
The exit codes every script uses, and UserError: a mistake in the user's input (a flag, an
environment variable, a file), which cli.run prints as one line, without a traceback.
"""

EXIT_OK = 0  # also a run stopped by SIGTERM/Ctrl-C after saving its checkpoint
EXIT_NETWORK = 1  # a download that still failed after its retries (re-run to resume)
EXIT_BAD_INPUT = 2  # one line on stderr: what is wrong and how to fix it
EXIT_NONFINITE = 3  # stopped by the NaN guard (a non-finite loss or gradient norm)
EXIT_COLLECTIVE_FAILED = 4  # a collective failed or timed out: another rank is stuck or dead


class UserError(Exception):
    exit_code = EXIT_BAD_INPUT


class NetworkError(UserError):
    """A server that kept failing after the retries: the network, not the input."""

    exit_code = EXIT_NETWORK


class CollectiveFailed(Exception):
    """A collective timed out or lost a rank (rank_watch.py): exit code 4, so that torchrun
    --max-restarts with --resume auto starts the run again."""

    exit_code = EXIT_COLLECTIVE_FAILED
