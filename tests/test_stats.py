"""Paired t-intervals against values worked by hand."""
import numpy as np
import pytest

from jaxsys import stats


def test_five_seeds():
  # mean 1, sample std sqrt(2.5); t(0.975, 4) = 2.7764 -> half-width 2.7764 * 1.5811 / sqrt(5)
  iv = stats.paired_interval([-1.0, 0.0, 1.0, 2.0, 3.0])
  assert iv.mean == 1.0 and iv.n == 5
  assert iv.high - iv.mean == pytest.approx(2.7764 * 2.5 ** 0.5 / 5 ** 0.5, rel=1e-4)
  assert iv.indistinguishable and iv.format() == "+1.00 [-0.96, +2.96], indistinguishable"


def test_a_consistent_gap_is_distinguishable():
  iv = stats.paired_interval([0.9, 1.0, 1.1, 1.0, 1.0])
  assert not iv.indistinguishable and iv.low > 0
  assert iv.format() == "+1.00 [+0.91, +1.09]"
  assert stats.paired_interval([1.0, 1.0]).format() == "+1.00 [+1.00, +1.00]"


def test_one_seed_has_no_interval():
  with pytest.raises(ValueError, match="2 or more"):
    stats.paired_interval([0.5])


def test_bootstrap_of_a_ratio_of_sums():
  """Two models scored on the same 200 batches: one whose every batch costs 1% more bits is
  distinguishable although batches vary by 30%; one that differs only by per-batch noise
  around the same mean is not; the point estimate is the ratio of the sums."""
  rng = np.random.default_rng(0)
  den = rng.uniform(3000, 5000, 200)
  base = den * rng.uniform(1.5, 2.5, 200)  # bits per byte differs a lot between batches
  worse = stats.paired_bootstrap_ratio(base * 1.01, base, den)
  assert worse.mean == pytest.approx(0.01 * base.sum() / den.sum())
  assert 0 < worse.low < worse.mean < worse.high and not worse.indistinguishable
  noisy = stats.paired_bootstrap_ratio(base * rng.normal(1, 0.01, 200), base, den)
  assert noisy.indistinguishable and noisy.high - noisy.low < worse.mean
  with pytest.raises(ValueError, match="2 or more paired values"):
    stats.paired_bootstrap_ratio([1.0], [1.0], [1.0])
