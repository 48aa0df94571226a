"""
What a script reports when it stops: the exit codes every script uses, and UserError, the
exception for a mistake in the user's input (a flag, an environment variable, a file).

    0  success (also a run stopped by SIGTERM/Ctrl-C after saving its checkpoint)
    1  a download that still failed after its retries (the network, not the input: re-run to resume)
    2  bad input: one line on stderr saying what is wrong and how to fix it, no traceback
    3  stopped by the NaN guard (a non-finite loss or gradient norm)
    4  a collective failed or timed out: another rank is stuck or dead (one line naming it)

Library code raises UserError where the cause is the user's input and the message can say what
to do; cli.run turns it into the one line and exit code 2.
"""

EXIT_OK = 0
EXIT_NETWORK = 1
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_COLLECTIVE_FAILED = 4


class UserError(Exception):
    """A problem with the user's input: the message is printed as one line, exit code 2."""

    exit_code = EXIT_BAD_INPUT


class NetworkError(UserError):
    """A server that kept failing after the retries: one line like a UserError, exit code 1."""

    exit_code = EXIT_NETWORK


class CollectiveFailed(Exception):
    """A collective timed out or lost a rank (core/rank_watch.py): printed as one line, exit code 4,
    so that torchrun --max-restarts with --resume auto starts the run again."""

    exit_code = EXIT_COLLECTIVE_FAILED
