"""Inner optimizer schedule: warmup + cosine, and an offset that continues another run's curve."""
import dataclasses

import numpy as np

from conftest import load_run_config
from jaxsys.optim.inner import make_schedule


def _cfg(offset=0):
  return dataclasses.replace(load_run_config().optimizer, learning_rate=1.0, warmup_steps=10,
                             final_lr_fraction=0.1, schedule_steps=100, schedule_offset=offset)


def test_offset_continues_the_curve():
  base, shifted = make_schedule(_cfg(), 60), make_schedule(_cfg(40), 60)
  np.testing.assert_allclose([float(shifted(c)) for c in range(61)],
                             [float(base(c + 40)) for c in range(61)], rtol=1e-6)
  assert float(shifted(0)) > 0.5  # no second warmup
