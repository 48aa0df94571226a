"""
chat_web with a slow model, for the tests of what happens while replies are being written (stop
midway, overlapping requests, a full queue): every engine step first sleeps. In-process, wrap an
engine in Slowed; as a process (chat_web_support.chat_web_process's token_delay):
    python python_tests/support/slow_chat_web.py --token-delay=0.2 -- CHAT_WEB_ARGS
"""

import argparse
import sys
import time

from nanochat_fast.core import cli
from nanochat_fast.scripts import chat_web

build_replica = chat_web.build_replica  # as imported: main() replaces chat_web's with a SlowBuild


class SlowBuild:
    """chat_web.build_replica with its engine Slowed. It pickles by this module's name and its delay: a
    replica's own process builds the replica."""

    def __init__(self, delay: float):
        self.delay = delay

    def __call__(self, *args):
        engine, info = build_replica(*args)
        return Slowed(engine, self.delay), info


class Slowed:
    """An engine whose every step first sleeps `delay` seconds; everything else is the engine's."""

    def __init__(self, engine, delay: float):
        self.engine, self.delay = engine, delay

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        time.sleep(self.delay)
        return self.engine.step()


def main(argv: list[str]):
    p = argparse.ArgumentParser(prog="python_tests/support/slow_chat_web.py", allow_abbrev=False)
    p.add_argument("--token-delay", type=float, required=True, help="seconds before every engine step")
    p.add_argument("args", nargs=argparse.REMAINDER, help="chat_web's arguments, after --")
    a = p.parse_args(argv)
    # load_replicas looks build_replica up in chat_web's module at each call, for a replica in this
    # process or in one of its own
    chat_web.build_replica = SlowBuild(a.token_delay)
    cli.run(chat_web.main, a.args[1:] if a.args[:1] == ["--"] else a.args)  # as `python -m` runs it


if __name__ == "__main__":
    main(sys.argv[1:])
