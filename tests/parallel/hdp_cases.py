"""Inputs the HDP planners' property tests share: long-tailed document lengths."""
import numpy as np
from hypothesis import strategies as st

# hypothesis.given keywords for long_tail_case.
LONG_TAIL = dict(log_devices=st.integers(0, 5), tokens=st.integers(1, 300),
                 seed=st.integers(0, 2**31), count=st.integers(0, 80),
                 sigma=st.floats(0.1, 2.5))


def long_tail(rng, count, pool, median=800.0, sigma=1.6):
  """Lognormal lengths, clipped to the pool."""
  lengths = np.ceil(rng.lognormal(np.log(median), sigma, count)).astype(np.int64)
  return np.clip(lengths, 1, pool)


def long_tail_case(log_devices, tokens, seed, count, sigma):
  """(lengths, num_devices): lognormal lengths of median tokens / 2 on 2**log_devices
  devices, one of them as long as the whole pool holds."""
  num_devices = 2**log_devices
  pool = num_devices * tokens
  rng = np.random.default_rng(seed)
  lengths = long_tail(rng, count, pool, median=tokens / 2, sigma=sigma)
  if count:
    lengths[rng.integers(count)] = pool
  return lengths, num_devices
