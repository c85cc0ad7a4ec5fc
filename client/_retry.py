"""When a failed call may be tried again, and how long to wait first (shared by sync and aio).

Only Unavailable and ResourceExhausted are retried, and only while nothing has been received:
the request either never reached a worker or was refused before producing anything, so a
second attempt cannot duplicate output the caller has seen. Waits never outlive the deadline.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import grpc

from client.errors import DeadlineExceeded, LogitpoolError, ResourceExhausted, Unavailable

RETRYABLE: tuple[type[LogitpoolError], ...] = (Unavailable, ResourceExhausted)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Up to ``max_retries`` retries, waiting ``backoff * 2**k`` seconds before retry k (0-based)."""

    max_retries: int = 3
    backoff: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries: must be an integer >= 0, got {self.max_retries!r}")
        if not math.isfinite(self.backoff) or self.backoff < 0:
            raise ValueError(f"backoff: must be a finite number >= 0, got {self.backoff!r}")

    def wait_before_retry(self, retries_done: int, error: LogitpoolError, remaining: float) -> float | None:
        """Seconds to sleep before the next attempt, or None when ``error`` must be raised."""
        if retries_done >= self.max_retries or not isinstance(error, RETRYABLE):
            return None
        wait = self.backoff * 2**retries_done
        return wait if wait < remaining else None


def check_timeout(timeout: float) -> float:
    """A call's deadline must be a finite positive number of seconds: every wait is bounded."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout: must be a finite number of seconds > 0, got {timeout!r}")
    return float(timeout)


@dataclass(frozen=True, slots=True)
class Deadline:
    """The absolute end of one logical call, across all of its attempts."""

    at: float
    timeout: float

    @classmethod
    def after(cls, timeout: float) -> Deadline:
        return cls(time.monotonic() + timeout, timeout)

    def remaining(self) -> float:
        """Seconds left; raises DeadlineExceeded when none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"deadline of {self.timeout:g}s exceeded", grpc.StatusCode.DEADLINE_EXCEEDED)
        return left
