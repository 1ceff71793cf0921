"""Tests for jaxsys.parallel.hdp: the HDP planner's invariants, examples, errors, balance."""

import math

import numpy as np
from absl.testing import absltest, parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsys.parallel import cost, hdp
from tests.parallel import hdp_cases


def _check_plan(steps, lengths, num_devices, tokens_per_device):
  """Every invariant the planner promises; fails with the offending entry."""
  lengths = [int(n) for n in lengths]
  T = tokens_per_device
  seen = [entry[0] for step in steps for entry in step]
  assert sorted(seen) == list(range(len(lengths))), "each sequence exactly once"
  assert all(steps), "no empty micro-step"
  for m, step in enumerate(steps):
    tokens = np.zeros(num_devices, np.int64)
    rings = {}  # device -> the ring (c > 1) it serves this step
    for i, devs in step:
      c, n = len(devs), lengths[i]
      b = hdp.block_size(c)
      assert devs == tuple(range(devs[0], devs[0] + c)), (m, i, devs)
      assert devs[0] // b == devs[-1] // b, f"ring {devs} crosses an aligned block of {b}"
      assert 0 <= devs[0] and devs[-1] < num_devices, (m, i, devs)
      if n <= T:
        assert c == 1, f"short sequence {i} (L={n}) split over {devs}"
      else:
        need = math.ceil(n / T)
        assert need <= c <= 2 * need, (i, n, devs)
        # Long sequences share a ring only whole: the same devices, each split over all.
        assert all(rings.get(d, devs) == devs for d in devs), f"rings overlap at {devs}"
        rings.update({d: devs for d in devs})
      tokens[list(devs)] += math.ceil(n / c)
    assert tokens.max(initial=0) <= T, (m, tokens)
  if lengths:
    low = hdp.min_steps(lengths, num_devices=num_devices, tokens_per_device=T)
    assert len(steps) >= low


def _first_fit(lengths, num_devices, tokens_per_device):
  """Naive baseline: in input order, each sequence in the first step and devices it fits.

  Same rules as the planner (aligned rings, one ring per device and step), no balance.
  """
  N, T = num_devices, tokens_per_device
  steps, tokens, served = [], [], []
  for i, n in enumerate(int(x) for x in lengths):
    c = hdp.devices_needed(n, T)
    b = hdp.block_size(c)
    for m in range(len(steps) + 1):
      if m == len(steps):
        steps.append([])
        tokens.append(np.zeros(N, np.int64))
        served.append(np.zeros(N, np.int64))
      if c > 1:
        free = [k for k in range(N // b) if (served[m][k * b:k * b + c] == 0).all()]
        if free:
          devs = tuple(range(free[0] * b, free[0] * b + c))
          break
      else:
        fit = [d for d in range(N) if tokens[m][d] + n <= T]
        if fit:
          devs = (fit[0],)
          break
    served[m][list(devs)] = c
    tokens[m][list(devs)] += math.ceil(n / c)
    steps[m].append((i, devs))
  return steps


class ExamplesTest(parameterized.TestCase):

  def test_empty(self):
    self.assertEqual(hdp.plan([], num_devices=8, tokens_per_device=16), [])

  def test_docstring_example(self):
    steps = hdp.plan([9000, 300, 5000, 120], num_devices=4, tokens_per_device=4096)
    self.assertEqual(steps, [[(0, (0, 1, 2, 3)), (1, (0,)), (2, (0, 1, 2, 3)), (3, (1,))]])

  def test_equal_short_sequences_fill_the_pool(self):
    steps = hdp.plan([10] * 4, num_devices=2, tokens_per_device=10)
    self.assertEqual(steps, [[(0, (0,)), (1, (1,))], [(2, (0,)), (3, (1,))]])

  def test_short_ones_share_a_device(self):
    steps = hdp.plan([3, 3, 3, 3], num_devices=2, tokens_per_device=6)
    self.assertLen(steps, 1)
    _check_plan(steps, [3] * 4, 2, 6)

  def test_whole_pool(self):
    self.assertEqual(hdp.plan([64], num_devices=8, tokens_per_device=8),
                     [[(0, tuple(range(8)))]])

  @parameterized.parameters((10, 1), (11, 2), (20, 2), (21, 4), (30, 4), (40, 4), (41, 8),
                            (1, 1))
  def test_ring_size(self, length, ring):
    self.assertEqual(hdp.ring_size(length, 10), ring)

  def test_heavy_work_side_by_side(self):
    # Four long-ish and four tiny sequences on 4 devices: the heavy four share a step.
    lengths = [100, 2, 100, 2, 100, 2, 100, 2]
    steps = hdp.plan(lengths, num_devices=4, tokens_per_device=100)
    self.assertLen(steps, 2)
    heavy_step = [m for m, s in enumerate(steps) if any(lengths[i] == 100 for i, _ in s)]
    self.assertLen(heavy_step, 1)

  def test_summary(self):
    lengths = [9000, 300, 5000, 120]
    steps = hdp.plan(lengths, num_devices=4, tokens_per_device=4096)
    s = hdp.summary(steps, lengths, num_devices=4, tokens_per_device=4096)
    # 9000 and 5000 share a ring of 4 (each on at most twice the devices it needs).
    np.testing.assert_array_equal(s.tokens, [[3800, 3620, 3500, 3500]])
    self.assertGreater(s.step_imbalance[0], 1.0)
    self.assertAlmostEqual(s.utilisation, sum(lengths) / (1 * 4 * 4096))
    self.assertAlmostEqual(s.cost.sum(), float(cost.sequence_cost(np.array(lengths)).sum()))
    self.assertAlmostEqual(s.imbalance, s.cost.max(axis=1).sum() / s.cost.mean(axis=1).sum())


class ErrorsTest(parameterized.TestCase):

  @parameterized.parameters(0, -3)
  def test_tokens_per_device(self, t):
    with self.assertRaisesRegex(ValueError, rf"^tokens_per_device={t}: must be an int >= 1"):
      hdp.plan([1], num_devices=2, tokens_per_device=t)

  @parameterized.parameters(0, 3, 6, 12)
  def test_num_devices(self, n):
    with self.assertRaisesRegex(ValueError, rf"^num_devices={n}: must be a power of two.*"
                                "aligned power-of-two groups"):
      hdp.plan([1], num_devices=n, tokens_per_device=8)

  def test_too_long(self):
    with self.assertRaisesRegex(
        ValueError, r"^document 1 has 65 tokens, more than the pool holds \(num_devices \* "
        r"tokens_per_device = 8 \* 8 = 64\); lower data.max_len to <= 64"):
      hdp.plan([3, 65, 2], num_devices=8, tokens_per_device=8)

  def test_empty_sequence(self):
    with self.assertRaisesRegex(ValueError, r"^lengths\[2\]=0: a sequence needs at least 1"):
      hdp.plan([3, 4, 0], num_devices=2, tokens_per_device=8)

  def test_not_ints(self):
    with self.assertRaisesRegex(ValueError, r"^lengths: must be a flat sequence of ints"):
      hdp.plan([3.5], num_devices=2, tokens_per_device=8)

  def test_one_line_each(self):
    for kwargs in [dict(num_devices=3, tokens_per_device=8),
                   dict(num_devices=2, tokens_per_device=0),
                   dict(num_devices=2, tokens_per_device=1)]:
      with self.assertRaises(ValueError) as err:
        hdp.plan([5], **kwargs)
      self.assertNotIn("\n", str(err.exception))


class PropertiesTest(absltest.TestCase):

  @settings(max_examples=150, deadline=None)
  @given(**hdp_cases.LONG_TAIL)
  def test_long_tail_invariants(self, log_devices, tokens, seed, count, sigma):
    lengths, num_devices = hdp_cases.long_tail_case(log_devices, tokens, seed, count, sigma)
    steps = hdp.plan(lengths, num_devices=num_devices, tokens_per_device=tokens)
    _check_plan(steps, lengths, num_devices, tokens)

  @settings(max_examples=100, deadline=None)
  @given(data=st.data(), log_devices=st.integers(0, 4), tokens=st.integers(1, 40))
  def test_arbitrary_lengths(self, data, log_devices, tokens):
    num_devices = 2**log_devices
    lengths = data.draw(st.lists(st.integers(1, num_devices * tokens), max_size=40))
    steps = hdp.plan(lengths, num_devices=num_devices, tokens_per_device=tokens)
    _check_plan(steps, lengths, num_devices, tokens)

  def test_few_steps_on_long_tail(self):
    # Short sequences fill the slots ring members leave, so the plan needs no more steps
    # than rings holding their devices whole would (measured: 17, 48, 12 steps against
    # that bound's 18, 50, 13 and the token bound's 14, 42, 10: shorts up to
    # tokens_per_device long cannot fill every leftover slot).
    rng = np.random.default_rng(0)
    for num_devices, tokens, count in [(8, 4096, 200), (8, 2048, 300), (64, 4096, 1000)]:
      lengths = hdp_cases.long_tail(rng, count, num_devices * tokens)
      steps = hdp.plan(lengths, num_devices=num_devices, tokens_per_device=tokens)
      _check_plan(steps, lengths, num_devices, tokens)
      rings = np.array([hdp.ring_size(n, tokens) for n in lengths])
      whole = rings[rings > 1].sum() * tokens + lengths[rings == 1].sum()
      self.assertLessEqual(len(steps), math.ceil(whole / (num_devices * tokens)))


class BalanceTest(parameterized.TestCase):

  # Measured (seed 0): 8 devices, hdp 1.004 vs first-fit 1.107; 64 devices, 1.110 vs 1.671.
  # At 64 devices the rest is the rings: a step holds two 32-device rings whose per-device
  # costs differ (lengths 64K..256K).
  @parameterized.parameters((8, 4096, 1000, 1.05, 1.10), (64, 4096, 2000, 1.20, 1.50))
  def test_better_than_first_fit(self, num_devices, tokens, count, hdp_max, ff_min):
    rng = np.random.default_rng(0)
    lengths = hdp_cases.long_tail(rng, count, num_devices * tokens)
    kw = dict(num_devices=num_devices, tokens_per_device=tokens)
    ours = hdp.summary(hdp.plan(lengths, **kw), lengths, **kw)
    naive = hdp.summary(_first_fit(lengths, **kw), lengths, **kw)
    print(f"N={num_devices} T={tokens} n={count}: imbalance hdp {ours.imbalance:.3f} "
          f"({len(ours.cost)} steps, util {ours.utilisation:.3f}) vs first-fit "
          f"{naive.imbalance:.3f} ({len(naive.cost)} steps, util {naive.utilisation:.3f})")
    self.assertLessEqual(len(ours.cost), len(naive.cost))
    self.assertLess(ours.imbalance, hdp_max)
    self.assertGreater(naive.imbalance, ff_min)
    # Lock-step time, sum over steps of the most loaded device.
    self.assertLess(ours.cost.max(axis=1).sum(), naive.cost.max(axis=1).sum())
    _check_plan(_first_fit(lengths, **kw), lengths, num_devices, tokens)


if __name__ == "__main__":
  absltest.main()
