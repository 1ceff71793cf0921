"""Tests for checkpoint integrity: checksums written inside the save, before the step
commits, verified before a restore; the loader position cross-checked against the step."""

import errno
import json
import os
import re
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import storage
from jaxsys.checkpoint import integrity, ledger
from jaxsys.checkpoint.manager import Checkpointer, CorruptCheckpoint


def _position(step):
  """A packed loader's position after `step` steps (jaxsys.data.loader: one batch a step)."""
  return {"grain": {"next_index": step}, "split": "train", "seed": 0}


def _save_steps(directory, steps, async_save=True):
  ckpt = Checkpointer(str(directory), keep=5, async_save=async_save)
  for step in steps:
    state = {"w": jnp.full((64, 64), float(step)), "b": jnp.arange(8.0) + step}
    ckpt.save(step, state, data=_position(step), meta={"model": {"step": step}})
  ckpt.close()
  return {"w": jnp.zeros((64, 64)), "b": jnp.zeros(8)}


def _data_file(step_dir, under=None):
  """The largest array data file of a step (an ocdbt `d/` file), or the largest in `under`."""
  files = [os.path.join(r, n) for r, _, ns in os.walk(step_dir) for n in ns
           if (os.path.join(r, "") == os.path.join(step_dir, under, "") if under else
               os.sep + "d" + os.sep in os.path.join(r, n))]
  return max(files, key=os.path.getsize)


def _flip(path):
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0x01
  open(path, "wb").write(bytes(data))


def _manifest(step_dir):
  return json.load(open(os.path.join(step_dir, integrity.MANIFEST)))["crc32"]


def _write_manifest(step_dir, listed):
  with open(os.path.join(step_dir, integrity.MANIFEST), "w") as f:
    json.dump({"crc32": listed}, f)


def _rewrite_json(path, edit):
  with open(path) as f:
    value = json.load(f)
  edit(value)
  with open(path, "w") as f:
    json.dump(value, f)


def _refused(directory, step, says, good=1):
  """Asserts the one line restore_step gives for corrupt `step`; returns it."""
  ckpt = Checkpointer(str(directory))
  try:
    with pytest.raises(CorruptCheckpoint) as err:
      ckpt.restore_step()
  finally:
    ckpt.close()
  line = str(err.value)
  assert "\n" not in line
  assert line.startswith(f"checkpoint step {step} in {directory} is corrupt: {says}"), line
  assert line.endswith(f"step {good} verifies: set --config.checkpoint.on_corrupt=previous to "
                       "resume from it"), line
  return line


@pytest.mark.parametrize("async_save", [True, False])
def test_every_committed_step_lists_every_file_and_records_its_position(tmp_path, async_save):
  _save_steps(tmp_path, [1, 2], async_save)
  ckpt = Checkpointer(str(tmp_path))
  try:
    assert ckpt.all_steps() == [1, 2]
    for step in (1, 2):
      step_dir = ckpt.step_dir(step)
      assert sorted(_manifest(step_dir)) == integrity._files(step_dir)
      assert ckpt.problem(step) is None
      assert ckpt.read_meta(step)[integrity.RECORD] == {
          "format": integrity.FORMAT, "step": step, "data": _position(step),
          "ledger": "ledger.jsonl"}
    assert ckpt.restore_step() == 2
    _, data = ckpt.restore(2, {"w": jnp.zeros((64, 64)), "b": jnp.zeros(8)})
    assert data == _position(2)
  finally:
    ckpt.close()
  assert integrity.problem(str(tmp_path / "2")) is None  # a restore writes nothing there


def test_a_step_commits_only_with_its_checksums(tmp_path, monkeypatch):
  """The manifest is written before the commit: a step directory seen while saves run
  already holds it, and a manifest that cannot be written leaves no committed step."""
  seen, stop = {}, threading.Event()

  def watch():
    while not stop.is_set():
      for name in os.listdir(tmp_path):
        if name.isdigit() and name not in seen:
          seen[name] = os.path.exists(tmp_path / name / integrity.MANIFEST)
  watcher = threading.Thread(target=watch)
  watcher.start()
  try:
    _save_steps(tmp_path, range(1, 7))
  finally:
    stop.set()
    watcher.join()
  assert seen == {str(s): True for s in range(1, 7)}

  def full_disk(step_dir):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(integrity, "seal", full_disk)
  ckpt = Checkpointer(str(tmp_path), keep=10)
  try:
    ckpt.save(7, {"w": jnp.zeros((64, 64)), "b": jnp.zeros(8)}, data=_position(7), meta={})
    with pytest.raises(storage.WriteError, match=r"^saving checkpoint step 7 to .* failed: No "
                       r"space left on device \(errno 28\); older checkpoints are intact: "
                       r"steps \[2, 3, 4, 5, 6\]$"):
      ckpt.wait()
  finally:
    ckpt.close()
  assert Checkpointer(str(tmp_path)).all_steps() == list(range(2, 7))  # keep=5
  assert not (tmp_path / "7").exists()


@pytest.mark.parametrize("damage, file, says", [
    ("flip", "array data", "checksum mismatch"),
    ("flip", "state/d", "checksum mismatch"),
    ("truncate", "array data", "truncated or overwritten"),
    ("delete", "array data", "missing"),
])
def test_a_damaged_step_is_refused_naming_the_file_and_the_step_that_verifies(
    tmp_path, damage, file, says):
  target = _save_steps(tmp_path, [1, 2])
  path = _data_file(tmp_path / "2", "state/d" if file == "state/d" else None)
  if damage == "flip":
    _flip(path)
  elif damage == "truncate":
    os.truncate(path, os.path.getsize(path) // 2)
  else:
    os.remove(path)
  rel = os.path.relpath(path, tmp_path / "2")
  assert says in _refused(tmp_path, 2, f"{rel}: ")
  ckpt = Checkpointer(str(tmp_path))
  try:
    # on_corrupt="previous": step 1, with step 2 kept aside (nothing deleted).
    assert ckpt.restore_step("previous") == 1
    assert ckpt.all_steps() == [1] and (tmp_path / "2.corrupt").is_dir()
    state, data = ckpt.restore(1, target)
    np.testing.assert_array_equal(state["b"], np.arange(8.0) + 1)
    assert data == _position(1)
  finally:
    ckpt.close()


def test_a_manifest_that_lists_nothing_does_not_vouch_for_a_flipped_byte(tmp_path):
  _save_steps(tmp_path, [1, 2])
  files = integrity._files(str(tmp_path / "2"))
  _flip(_data_file(tmp_path / "2"))
  _write_manifest(tmp_path / "2", {})
  _refused(tmp_path, 2, f"{integrity.MANIFEST}: lists 0 of the step's {len(files)} files, not "
                        f"{', '.join(files[:3])} and {len(files) - 3} more")


def test_a_manifest_lacking_one_entry_names_it(tmp_path):
  _save_steps(tmp_path, [1, 2])
  listed = _manifest(tmp_path / "2")
  dropped = os.path.relpath(_data_file(tmp_path / "2"), tmp_path / "2")
  del listed[dropped]
  _write_manifest(tmp_path / "2", listed)
  _refused(tmp_path, 2, f"{integrity.MANIFEST}: lists {len(listed)} of the step's "
                        f"{len(listed) + 1} files, not {dropped}")


def test_a_deleted_manifest_is_corrupt_not_unverified(tmp_path):
  """This version's step without its manifest: meta records that it had one."""
  _save_steps(tmp_path, [1, 2])
  os.remove(tmp_path / "2" / integrity.MANIFEST)
  _refused(tmp_path, 2, f"{integrity.MANIFEST}: missing, though meta/metadata records that the "
                        "step was saved with it (deleted since)")


def _as_legacy(step_dir):
  """A step as a version before checksums saved it: no manifest, no record in meta, no
  entry in the ledger (the others' entries chained anew)."""
  os.remove(os.path.join(step_dir, integrity.MANIFEST))
  _rewrite_json(os.path.join(step_dir, "meta", "metadata"), lambda m: m.pop(integrity.RECORD))
  directory, step = os.path.split(os.path.normpath(step_dir))
  kept = [e for e in ledger.read(directory) if e.step != int(step)]
  os.remove(ledger.path(directory))
  for entry in kept:
    ledger.append(directory, entry.step, entry.manifest_sha256)


def test_a_legacy_step_is_restored_with_a_warning_and_never_sealed(tmp_path, caplog):
  target = _save_steps(tmp_path, [4])
  _as_legacy(tmp_path / "4")
  assert integrity.problem(str(tmp_path / "4")) == integrity.LEGACY
  ckpt = Checkpointer(str(tmp_path))
  try:
    with caplog.at_level("WARNING"):
      assert ckpt.restore_step() == 4
    assert "restoring it unverified" in caplog.text
    state, data = ckpt.restore(4, target)
    np.testing.assert_array_equal(state["b"], np.arange(8.0) + 4)
    assert data == _position(4)
  finally:
    ckpt.close()
  # Its files may have changed before this restore: a manifest now would vouch for them.
  assert not (tmp_path / "4" / integrity.MANIFEST).exists()
  assert integrity.problem(str(tmp_path / "4")) == integrity.LEGACY


@pytest.mark.parametrize("where", ["data", "data and meta"])
def test_a_rewritten_loader_position_is_refused(tmp_path, where):
  """next_index changed (and the manifest recomputed, as a consistent rewrite would): in
  the data item alone it differs from meta's copy; in both, from the step."""
  _save_steps(tmp_path, [1, 2])
  step_dir = str(tmp_path / "2")

  def skip(position):
    position["grain"]["next_index"] = 7
  _rewrite_json(os.path.join(step_dir, "data", "metadata"), skip)
  if where == "data and meta":
    _rewrite_json(os.path.join(step_dir, "meta", "metadata"),
                  lambda m: skip(m[integrity.RECORD]["data"]))
  integrity.seal(step_dir)
  says = ("data/metadata: the loader position differs from the copy saved in meta/metadata "
          "(grain.next_index: 7 there, 2 in meta)" if where == "data" else
          "data/metadata: the loader's next_index is 7, but step 2 has read 2 batches")
  _refused(tmp_path, 2, says)


def test_a_rewritten_document_loader_position_is_refused(tmp_path):
  """The whole-document loader's position (jaxsys.data.documents) has no fixed relation to
  the step: the copy in meta is what catches it."""
  ckpt = Checkpointer(str(tmp_path))
  for step in (1, 2):
    ckpt.save(step, {"w": jnp.zeros(4)}, data={"epoch": 0, "position": 3 * step, "carry": []},
              meta={})
  ckpt.close()
  step_dir = str(tmp_path / "2")
  _rewrite_json(os.path.join(step_dir, "data", "metadata"), lambda d: d.update(position=9))
  integrity.seal(step_dir)
  _refused(tmp_path, 2, "data/metadata: the loader position differs from the copy saved in "
                        "meta/metadata (position: 9 there, 6 in meta)")


def test_restore_verifies_a_step_that_restore_step_did_not_choose(tmp_path):
  target = _save_steps(tmp_path, [1, 2])
  _flip(_data_file(tmp_path / "1"))
  ckpt = Checkpointer(str(tmp_path))
  try:
    with pytest.raises(CorruptCheckpoint, match=r"^checkpoint step 1 in .* is corrupt: .*checksum "
                       r"mismatch .*; restore another step \(steps there: \[1, 2\]\)$"):
      ckpt.restore(1, target)
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


def test_read_params_refuses_a_corrupt_step(tmp_path):
  from jaxsys.checkpoint import reader
  _save_steps(tmp_path, [5])
  os.truncate(_data_file(tmp_path / "5"), 3)
  with pytest.raises(CorruptCheckpoint, match=f"checkpoint step 5 in {tmp_path} is corrupt: "):
    reader.read_params(str(tmp_path))


@pytest.mark.parametrize("damage", ["empty", "no_state_metadata"])
def test_a_step_without_manifest_missing_its_files_is_corrupt(tmp_path, damage):
  _save_steps(tmp_path, [1])
  if damage == "empty":
    os.makedirs(tmp_path / "5")
    says = "meta/metadata: missing (and no checksums.json)"
  else:
    _save_steps(tmp_path, [5])
    _as_legacy(tmp_path / "5")
    os.remove(tmp_path / "5" / "state" / "_METADATA")
    says = "state/_METADATA: missing (and no checksums.json)"
  _refused(tmp_path, 5, says)
  ckpt = Checkpointer(str(tmp_path))
  try:
    assert ckpt.restore_step("previous") == 1
  finally:
    ckpt.close()


def test_checkpoint_info_tells_verified_legacy_and_corrupt_apart(tmp_path):
  from experiments import checkpoint_info
  _save_steps(tmp_path, [1, 2, 3, 4])
  _as_legacy(tmp_path / "2")
  _write_manifest(tmp_path / "3", {})
  os.remove(tmp_path / "4" / integrity.MANIFEST)
  lines = checkpoint_info.describe(str(tmp_path))
  status = dict(re.match(r"\s*step\s+(\d+)\s+[\d.]+ MiB  (.*?); ", l).groups()
                for l in lines if l.lstrip().startswith("step"))
  assert status["1"] == "verified, in ledger"
  assert status["2"] == "legacy, unverified"
  assert status["3"].startswith(f"CORRUPT: {integrity.MANIFEST}: lists 0 of the step's ")
  assert status["4"].startswith(f"CORRUPT: {integrity.MANIFEST}: missing, though")


def test_no_metadata_is_pickled(tmp_path):
  """Every file of a step is JSON, a commit marker, or ocdbt array storage (its manifest and
  `d/` data files): nothing a restore would unpickle."""
  _save_steps(tmp_path, [1])
  for root, _, names in os.walk(tmp_path / "1"):
    for name in names:
      path = os.path.join(root, name)
      if name == "manifest.ocdbt" or os.path.basename(root) == "d" or name == "commit_success.txt":
        continue
      with open(path, "rb") as f:
        json.loads(f.read())  # raises on anything else
