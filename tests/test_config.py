"""The typed run config: every field of the config file, once, in its section."""
import dataclasses
import typing

import pytest

from conftest import load_test_config
from jaxsys import config as config_lib
from jaxsys import fields
from jaxsys.train import config_check


def test_round_trip_is_the_config_file():
  """What a checkpoint records (`RunConfig.to_dict`) is the config file's own form."""
  config = load_test_config("stdlib", outer__lr=0.5, allow_model_change="dtype,norm_eps")
  run = config_check.check_config(config)
  assert run.to_dict() == config.to_dict()
  assert config_check.parse(run.to_dict()) == run


def test_sections_hold_their_fields():
  run = config_check.check_config(load_test_config(
      "stdlib", mesh="replica=2,data=-1", outer__name="noloco", outer__lr=0.5,
      outer__seed=7, data__seq_len=32, allow_model_change="dtype, rope_theta"))
  assert (run.outer.name, run.outer.lr, run.outer.seed, run.outer.gamma) == ("noloco", 0.5, 7,
                                                                             None)
  assert run.data.seq_len == 32 and run.model.d_model == 64
  assert run.model_changes == ("dtype", "rope_theta")
  assert not hasattr(run.optimizer, "outer_lr")


def test_frozen():
  run = config_check.check_config(load_test_config("stdlib"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.data.seq_len = 1  # pytype: disable=not-writable



def test_a_saved_config_from_before_a_field_was_added_still_parses():
  """A checkpoint's config written before profile.steps existed means no profile: a field
  a config leaves out takes its default."""
  saved = load_test_config("stdlib").to_dict()
  del saved["profile"]
  assert config_check.parse(saved).profile.steps == ""
  assert config_check.parse({k: v for k, v in saved.items() if k != "seed"}).seed == 0


def test_a_saved_config_with_the_outer_optimizer_in_the_optimizer_section_still_parses():
  """Checkpoints before the `outer` section kept its fields as optimizer.outer_*."""
  new = load_test_config("stdlib", outer__name="diloco", outer__lr=0.5, outer__sync_every=7)
  old = new.to_dict()
  outer = old.pop("outer")
  old["optimizer"].update({"outer" if k == "name" else f"outer_{k}": v for k, v in outer.items()})
  assert config_check.parse(old) == config_check.parse(new)


def test_every_field_has_a_default_its_rule_accepts_and_a_doc():
  """The one place a field is declared: its default, rule and doc together."""
  defaults = config_lib.default_values()
  assert set(defaults) == set(config_check.FIELDS)
  for path, rule in config_check.FIELDS.items():
    if path not in ("data.source",):  # 'stdlib' needs no file: its rule reads the disk
      assert rule.error(path, defaults[path]) is None, path
  sections = [config_lib.RunConfig, *config_lib._SECTIONS.values()]
  undocumented = [f"{cls.__name__}.{name}" for cls in sections
                  for name, doc in fields.docs(cls).items()
                  if not doc and not dataclasses.is_dataclass(
                      typing.get_type_hints(cls)[name])]
  assert not undocumented


def test_a_literal_field_is_checked_by_its_type():
  assert config_check.field_error("outer.name", "adam") == (
      "outer.name='adam' is unknown; valid: none, diloco, noloco, co2, streaming_diloco")
  assert config_check.field_error("model.tie_embeddings", "yes") == (
      "model.tie_embeddings='yes' is invalid; it must be True or False")
