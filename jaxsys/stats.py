"""Paired comparisons: across seeds (the mean of paired differences and its t-interval), and
across evaluation batches (a ratio of sums, by a paired bootstrap)."""
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


def paired_bootstrap_ratio(a, b, denominator, *, resamples: int = 2000, level: float = 0.95,
                           seed: int = 0) -> Interval:
  """The difference sum(a)/sum(den) - sum(b)/sum(den) over n paired units (evaluation
  batches: a and b their summed losses under two models, den their bytes) and its
  percentile interval from `resamples` resamplings of the units with replacement, the same
  units for a and b. Needs 2 or more units."""
  a, b, den = (np.asarray(x, dtype=np.float64) for x in (a, b, denominator))
  if not a.shape == b.shape == den.shape or a.ndim != 1 or a.size < 2:
    raise ValueError(f"a, b and denominator must be 2 or more paired values each; got shapes "
                     f"{a.shape}, {b.shape}, {den.shape}")
  idx = np.random.default_rng(seed).integers(0, a.size, (resamples, a.size))
  diffs = (a[idx].sum(1) - b[idx].sum(1)) / den[idx].sum(1)
  tail = 100 * (1 - level) / 2
  low, high = np.percentile(diffs, [tail, 100 - tail])
  return Interval(float((a.sum() - b.sum()) / den.sum()), float(low), float(high), int(a.size),
                  level)
