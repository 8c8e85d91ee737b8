"""Per-peer token buckets for the RPC handlers (libp2p and HTTP).

A peer that floods a node's RPC must cost that node a dictionary lookup per request, not a
handler run: each peer (libp2p peer id, or the client IP for HTTP) gets a bucket of ``burst``
tokens refilled at ``rate_per_s``; a request without a token is answered "rate limited" at once.
The table of buckets is bounded (least recently used peers are forgotten first), so a swarm of
throw-away peer ids cannot grow it without bound either.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["TokenBucket", "PeerRateLimiter", "DEFAULT_MAX_TRACKED_PEERS"]

#: Buckets kept at most; a forgotten peer simply starts again with a full bucket.
DEFAULT_MAX_TRACKED_PEERS = 4096


@dataclass
class TokenBucket:
    """``burst`` tokens, refilled continuously at ``rate_per_s``; one request takes one token."""

    rate_per_s: float
    burst: float
    tokens: float = field(default=-1.0)
    updated: float | None = None

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0 or self.burst < 1:
            raise ValueError("a token bucket needs rate_per_s > 0 and burst >= 1")
        if self.tokens < 0:
            self.tokens = float(self.burst)

    def take(self, now: float, cost: float = 1.0) -> bool:
        if self.updated is not None:
            self.tokens = min(float(self.burst), self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False


class PeerRateLimiter:
    """One :class:`TokenBucket` per key; ``allow(key)`` says whether this request may run."""

    def __init__(
        self,
        rate_per_s: float,
        burst: float,
        max_peers: int = DEFAULT_MAX_TRACKED_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        TokenBucket(rate_per_s, burst)  # validate the parameters once, here
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_peers = max_peers
        self._clock = clock
        self._buckets: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self.rejected = 0

    def allow(self, key: str) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate_per_s, self.burst)
            while len(self._buckets) > self.max_peers:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        ok = bucket.take(self._clock())
        if not ok:
            self.rejected += 1
        return ok

    def __len__(self) -> int:
        return len(self._buckets)
