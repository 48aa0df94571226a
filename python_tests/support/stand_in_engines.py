"""
Stand-in engines with BatchEngine's interface, cheap to step, built in a replica's own process by
web/replica_process.ProcessEngine (these builders pickle by name: this folder is on the child's path).

CountingEngine: a request's row yields prompt[0] * 100 + 0, + 1, ... one token a step, max_tokens of
them (the last flagged), so every row's tokens are known in advance. A prompt that starts with
FAIL_STEP makes the step after its prefill raise; CRASH makes it end the process. score(ids, top):
ids[k] / 2 for each of ids[1:], and [ids[k]] * top as its most likely; FAIL_STEP first makes it raise.
"""

import os
from dataclasses import dataclass

from nanochat_fast.model.batch_engine import EngineFull, RequestLimits

FAIL_STEP = 7
CRASH = 9


@dataclass(eq=False)
class Row:
    first: int
    max_tokens: int
    made: int = 0
    done: bool = False


@dataclass
class Token:
    row: Row
    token: int
    forced: bool
    last: bool


class CountingEngine:
    def __init__(self, slots: int):
        self.slots = slots
        self.limits = RequestLimits(vocab_size=100, max_len=64, slots=slots, tools=True)  # tools: Request's default
        self.active: list[Row] = []
        self.step_sizes: list[int] = []  # rows in each step, in order

    def add(self, request):
        self.limits.check(request)
        if len(self.active) == self.slots:
            raise EngineFull(f"all {self.slots} slots busy")
        row = Row(request.prompt[0], request.max_tokens, done=request.max_tokens == 0)
        if not row.done:
            self.active.append(row)
        return [row]

    def cancel(self, row):
        if row in self.active:
            self.active.remove(row)
            row.done = True

    def score(self, ids: list[int], top: int):
        self.limits.check_scoring(ids, top)
        if ids[0] == FAIL_STEP:
            raise RuntimeError("no score")
        return [t / 2 for t in ids[1:]], [[t] * top for t in ids[1:]], [[t / 2] * top for t in ids[1:]]

    def step(self):
        for row in self.active:
            if row.made == 1 and row.first == FAIL_STEP:
                raise RuntimeError("boom")
            if row.made == 1 and row.first == CRASH:
                os._exit(3)
        self.step_sizes.append(len(self.active))
        tokens = []
        for row in list(self.active):
            row.made += 1
            last = row.made == row.max_tokens
            tokens.append(Token(row, row.first * 100 + row.made - 1, False, last))
            if last:
                row.done = True
                self.active.remove(row)
        return tokens


def counting_engine(slots: int):
    return CountingEngine(slots), {"slots": slots}


def refuse_to_build(message: str):
    raise ValueError(message)
