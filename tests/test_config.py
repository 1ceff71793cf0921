"""The typed run config: every field of the config file, once, in its section."""
import dataclasses

import pytest

from conftest import load_test_config
from jaxsys.train import config_check


def test_round_trip_is_the_config_file():
  """What a checkpoint records (`RunConfig.to_dict`) is the config file's own form."""
  config = load_test_config("stdlib", optimizer__outer_lr=0.5, allow_model_change="dtype,norm_eps")
  run = config_check.check_config(config)
  assert run.to_dict() == config.to_dict()
  assert config_check.parse(run.to_dict()) == run


def test_sections_hold_their_fields():
  run = config_check.check_config(load_test_config(
      "stdlib", mesh="replica=2,data=-1", optimizer__outer="noloco", optimizer__outer_lr=0.5,
      optimizer__outer_seed=7, data__seq_len=32, allow_model_change="dtype, rope_theta"))
  assert (run.outer.name, run.outer.lr, run.outer.seed, run.outer.gamma) == ("noloco", 0.5, 7,
                                                                             None)
  assert run.data.seq_len == 32 and run.model.d_model == 64
  assert run.allow_model_change == ("dtype", "rope_theta")
  assert not hasattr(run.optimizer, "outer_lr")


def test_frozen():
  run = config_check.check_config(load_test_config("stdlib"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.data.seq_len = 1  # pytype: disable=not-writable



def test_a_saved_config_from_before_a_field_was_added_still_parses():
  """A checkpoint's config written before profile.steps existed means no profile."""
  saved = load_test_config("stdlib").to_dict()
  del saved["profile"]
  assert config_check.parse(saved).profile.steps == ""
  with pytest.raises(ValueError, match=r"^config has no field 'seed'"):
    config_check.parse({k: v for k, v in saved.items() if k != "seed"})
