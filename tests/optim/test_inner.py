"""Inner optimizer schedule: warmup + cosine, and an offset that continues another run's curve."""
import ml_collections
import numpy as np
import pytest

from jaxsys.optim.inner import make_schedule


def _cfg(offset=0):
  return ml_collections.ConfigDict(dict(learning_rate=1.0, warmup_steps=10, final_lr_fraction=0.1,
                                        schedule_steps=100, schedule_offset=offset))


def test_offset_continues_the_curve():
  base, shifted = make_schedule(_cfg(), 60), make_schedule(_cfg(40), 60)
  np.testing.assert_allclose([float(shifted(c)) for c in range(61)],
                             [float(base(c + 40)) for c in range(61)], rtol=1e-6)
  assert float(shifted(0)) > 0.5  # no second warmup


@pytest.mark.parametrize("offset", [-1, 2.5, True])
def test_bad_offset_is_one_line(offset):
  cfg = ml_collections.ConfigDict(dict(learning_rate=1.0, warmup_steps=10, final_lr_fraction=0.1,
                                       schedule_steps=100), type_safe=False)
  cfg.schedule_offset = offset
  with pytest.raises(ValueError, match=r"^optimizer.schedule_offset=.* is invalid; "
                     r"it must be an int >= 0$"):
    make_schedule(cfg, 60)
