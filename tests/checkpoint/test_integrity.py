"""Tests for checkpoint integrity: checksums written at save, verified before a restore."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.checkpoint import integrity
from jaxsys.checkpoint.manager import Checkpointer, CorruptCheckpoint


def _save_steps(directory, steps, async_save=True):
  ckpt = Checkpointer(str(directory), keep=5, async_save=async_save)
  for step in steps:
    state = {"w": jnp.full((64, 64), float(step)), "b": jnp.arange(8.0) + step}
    ckpt.save(step, state, data={"pos": step}, meta={"model": {"step": step}})
  ckpt.close()
  return {"w": jnp.zeros((64, 64)), "b": jnp.zeros(8)}


def _data_file(step_dir):
  """The largest array data file of a step (ocdbt `d/`)."""
  files = [os.path.join(r, n) for r, _, ns in os.walk(step_dir) for n in ns
           if os.sep + "d" + os.sep in os.path.join(r, n)]
  return max(files, key=os.path.getsize)


@pytest.mark.parametrize("async_save", [True, False])
def test_every_committed_step_is_sealed_and_verifies(tmp_path, async_save):
  _save_steps(tmp_path, [1, 2], async_save)
  ckpt = Checkpointer(str(tmp_path))
  try:
    assert ckpt.all_steps() == [1, 2]
    for step in (1, 2):
      assert integrity.is_sealed(ckpt.step_dir(step)) and ckpt.problem(step) is None
    assert ckpt.restore_step() == 2
  finally:
    ckpt.close()


@pytest.mark.parametrize("damage, says", [
    ("flip", "checksum mismatch"),
    ("truncate", "truncated or overwritten"),
    ("delete", "missing"),
])
def test_a_damaged_step_is_refused_naming_the_file_and_the_step_that_verifies(
    tmp_path, damage, says):
  target = _save_steps(tmp_path, [1, 2])
  path = _data_file(tmp_path / "2")
  if damage == "flip":
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
  elif damage == "truncate":
    os.truncate(path, os.path.getsize(path) // 2)
  else:
    os.remove(path)
  rel = os.path.relpath(path, tmp_path / "2")
  ckpt = Checkpointer(str(tmp_path))
  try:
    with pytest.raises(CorruptCheckpoint) as err:
      ckpt.restore_step()
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"checkpoint step 2 in {tmp_path} is corrupt: {rel}: ")
    assert says in line
    assert line.endswith("step 1 verifies: set --config.checkpoint.on_corrupt=previous to "
                         "resume from it")
    # on_corrupt="previous": step 1, with step 2 kept aside (nothing deleted).
    assert ckpt.restore_step("previous") == 1
    assert ckpt.all_steps() == [1] and (tmp_path / "2.corrupt").is_dir()
    state, data = ckpt.restore(1, target)
    np.testing.assert_array_equal(state["b"], np.arange(8.0) + 1)
    assert data == {"pos": 1}
  finally:
    ckpt.close()


def test_no_step_that_verifies(tmp_path):
  _save_steps(tmp_path, [3])
  os.remove(os.path.join(tmp_path, "3", "meta", "metadata"))
  ckpt = Checkpointer(str(tmp_path))
  try:
    with pytest.raises(CorruptCheckpoint, match=r"step 3 .* meta/metadata: missing; no earlier "
                       r"step verifies"):
      ckpt.restore_step("previous")
  finally:
    ckpt.close()


def test_an_unsealed_step_is_restored_unverified(tmp_path, caplog):
  _save_steps(tmp_path, [4])
  os.remove(os.path.join(tmp_path, "4", integrity.MANIFEST))
  ckpt = Checkpointer(str(tmp_path))
  try:
    with caplog.at_level("WARNING"):
      assert ckpt.restore_step() == 4
    assert "restoring it unverified" in caplog.text
    state, _ = ckpt.restore(4, {"w": jnp.zeros((64, 64)), "b": jnp.zeros(8)})
    np.testing.assert_array_equal(state["b"], np.arange(8.0) + 4)
    assert integrity.is_sealed(ckpt.step_dir(4)) and ckpt.problem(4) is None  # sealed now
  finally:
    ckpt.close()


def test_read_params_refuses_a_corrupt_step(tmp_path):
  from jaxsys.checkpoint import reader
  _save_steps(tmp_path, [5])
  os.truncate(_data_file(tmp_path / "5"), 3)
  with pytest.raises(CorruptCheckpoint, match=f"checkpoint step 5 in {tmp_path} is corrupt: "):
    reader.read_params(str(tmp_path))


@pytest.mark.parametrize("damage", ["empty", "no_state_metadata"])
def test_an_unsealed_step_missing_its_files_is_corrupt(tmp_path, damage):
  _save_steps(tmp_path, [1])
  if damage == "empty":
    os.makedirs(tmp_path / "5")
    says = "meta/metadata: missing (and no checksums.json)"
  else:
    _save_steps(tmp_path, [5])
    os.remove(tmp_path / "5" / integrity.MANIFEST)
    os.remove(tmp_path / "5" / "state" / "_METADATA")
    says = "state/_METADATA: missing (and no checksums.json)"
  ckpt = Checkpointer(str(tmp_path))
  try:
    with pytest.raises(CorruptCheckpoint, match=f"step 5 in {tmp_path} is corrupt: "
                       + says.replace("(", r"\(").replace(")", r"\)") + "; step 1 verifies"):
      ckpt.restore_step()
    assert ckpt.restore_step("previous") == 1
  finally:
    ckpt.close()


def test_no_metadata_is_pickled(tmp_path):
  """Every file of a step is JSON, a commit marker, or ocdbt array storage (its manifest and
  `d/` data files): nothing a restore would unpickle."""
  import json
  _save_steps(tmp_path, [1])
  for root, _, names in os.walk(tmp_path / "1"):
    for name in names:
      path = os.path.join(root, name)
      if name == "manifest.ocdbt" or os.path.basename(root) == "d" or name == "commit_success.txt":
        continue
      with open(path, "rb") as f:
        json.loads(f.read())  # raises on anything else
