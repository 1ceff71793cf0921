"""Comparisons across seeds: the mean of paired differences and its t-interval."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats as scipy_stats


@dataclasses.dataclass(frozen=True)
class Interval:
  """The mean of n paired differences and its `level` confidence interval."""
  mean: float
  low: float
  high: float
  n: int
  level: float = 0.95

  @property
  def indistinguishable(self) -> bool:
    """The interval contains 0: these seeds cannot tell the two apart."""
    return self.low <= 0 <= self.high

  def format(self, fmt: str = "+.2f") -> str:
    """'+0.63 [+0.21, +1.05]', and ', indistinguishable' when it contains 0."""
    text = f"{format(self.mean, fmt)} [{format(self.low, fmt)}, {format(self.high, fmt)}]"
    return text + (", indistinguishable" if self.indistinguishable else "")


def paired_interval(differences, level: float = 0.95) -> Interval:
  """Student's t-interval of the mean of per-seed differences (a - b on the same seed).
  Needs 2 or more; one seed has no interval (ValueError)."""
  d = np.asarray(differences, dtype=np.float64)
  if d.size < 2:
    raise ValueError(f"an interval needs 2 or more paired differences; got {d.size}")
  mean = float(d.mean())
  half = float(scipy_stats.t.ppf((1 + level) / 2, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size))
  return Interval(mean, mean - half, mean + half, int(d.size), level)
