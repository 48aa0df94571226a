"""
What /stats reports beyond the slots and the queue: how requests ended, tokens and the time spent
decoding them, time to first token, prompts cut to fit. The pool calls it under its lock.

    tokens_generated  every token the engines produced (the token that ends a reply and the
                      calculator's forced tokens included)
    decode_seconds    the server's decode time: wall time during which at least one replica held a
                      reply (from a reply's admission to its end, so prefill, every step and the
                      streaming between steps count; idle time does not)
    tokens_per_s      tokens_generated / decode_seconds: how fast the server decodes when it has
                      work; it grows with the replies decoded together. Per replica the same over
                      that replica's own busy time
    ttft_s            time to first token, p50/p90/p99 over the last TTFT_WINDOW replies that got
                      one: from the request's arrival in the queue (its body read and validated) to
                      the end of the step that sampled its first token
"""

import collections
import math

OUTCOMES = ("completed", "cancelled", "timed_out", "failed")  # how a request that got in ended
TTFT_WINDOW = 1000


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


class ServerStats:
    def __init__(self, replicas: int):
        self.outcomes = collections.Counter()  # OUTCOMES and "rejected"
        self.tokens = [0] * replicas
        self.ttft = collections.deque(maxlen=TTFT_WINDOW)
        self.truncated = 0
        self.replies, self.reply_seconds = 0, 0.0  # admitted replies that ended, their time from admission
        self.busy_since = [None] * replicas  # when each replica last went from no reply to one
        self.busy_seconds = [0.0] * replicas
        self.any_busy_since = None  # the same for the server: at least one replica busy
        self.decode_seconds = 0.0

    def started(self, replica: int, now: float, truncated: bool):
        """A reply was admitted to `replica`."""
        self.truncated += bool(truncated)
        if self.busy_since[replica] is None:
            if self.any_busy_since is None:
                self.any_busy_since = now
            self.busy_since[replica] = now

    def stepped(self, replica: int, tokens: int, ttfts: list[float]):
        self.tokens[replica] += tokens
        self.ttft.extend(ttfts)

    def ended(self, replica: int, outcome: str, seconds: float | None, now: float, busy: bool):
        """A reply ended (seconds: since its admission; None if it never was); busy: the replica
        still holds others."""
        self.outcomes[outcome] += 1
        if seconds is not None:
            self.replies += 1
            self.reply_seconds += seconds
        if not busy and self.busy_since[replica] is not None:
            self.busy_seconds[replica] += now - self.busy_since[replica]
            self.busy_since[replica] = None
            if all(since is None for since in self.busy_since):
                self.decode_seconds += now - self.any_busy_since
                self.any_busy_since = None

    def mean_reply_seconds(self) -> float | None:
        return self.reply_seconds / self.replies if self.replies else None

    def snapshot(self, now: float) -> dict:
        def rate(tokens, seconds):
            return round(tokens / seconds, 2) if seconds > 0 else None

        decode = self.decode_seconds + (now - self.any_busy_since if self.any_busy_since is not None else 0.0)
        own = [
            seconds + (now - since if since is not None else 0.0)
            for seconds, since in zip(self.busy_seconds, self.busy_since)
        ]
        ttft = list(self.ttft)
        return {
            "requests": {k: self.outcomes[k] for k in OUTCOMES + ("rejected",)},
            "tokens_generated": sum(self.tokens),
            "decode_seconds": round(decode, 3),
            "tokens_per_s": rate(sum(self.tokens), decode),
            "ttft_s": {
                "p50": round(percentile(ttft, 50), 4) if ttft else None,
                "p90": round(percentile(ttft, 90), 4) if ttft else None,
                "p99": round(percentile(ttft, 99), 4) if ttft else None,
                "requests": len(ttft),
            },
            "prompts_truncated": self.truncated,
            "per_replica": [{"tokens_generated": t, "tokens_per_s": rate(t, s)} for t, s in zip(self.tokens, own)],
        }
