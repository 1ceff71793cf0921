"""Seconds left: the report's whole budget, and each part's share of it."""
from __future__ import annotations

import time
from typing import Callable


class Budget:
  """A deadline on a monotonic clock; `share(s)` is a sub-budget ending no later."""

  def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
    self._clock = clock
    self._deadline = clock() + seconds

  def left(self) -> float:
    return max(0.0, self._deadline - self._clock())

  def expired(self) -> bool:
    return self.left() <= 0.0

  def allows(self, seconds: float) -> bool:
    """Whether `seconds` of work still fit before the deadline."""
    return self.left() >= seconds

  def share(self, seconds: float) -> "Budget":
    return Budget(min(seconds, self.left()), self._clock)
