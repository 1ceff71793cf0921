"""Tests for the checkpoint ledger: each committed step's manifest digest, hash-chained in
`<checkpoints>/ledger.jsonl`, outside the step; checked on every restore."""

import errno
import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import storage
from jaxsys.checkpoint import integrity, ledger, manager
from jaxsys.checkpoint.manager import Checkpointer, CorruptCheckpoint


def _position(step):
  return {"grain": {"next_index": step}, "split": "train", "seed": 0}


TARGET = {"w": jnp.zeros((64, 64)), "b": jnp.zeros(8)}


def _save_steps(directory, steps, keep=5):
  ckpt = Checkpointer(str(directory), keep=keep)
  try:
    for step in steps:
      state = {"w": jnp.full((64, 64), float(step)), "b": jnp.arange(8.0) + step}
      ckpt.save(step, state, data=_position(step), meta={"model": {"step": step}})
  finally:
    ckpt.close()


def _flip_and_reseal(step_dir):
  """The issue's case: a byte of the largest state `d/` file flipped, then the manifest
  recomputed over the files (the step verifies by its own checksums)."""
  files = [os.path.join(r, n) for r, _, ns in os.walk(step_dir) for n in ns
           if os.sep + "d" + os.sep in os.path.join(r, n)]
  path = max(files, key=os.path.getsize)
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0x01
  open(path, "wb").write(bytes(data))
  integrity.seal(str(step_dir))
  assert integrity.problem(str(step_dir)) is None


def _lines(directory):
  return (directory / ledger.NAME).read_bytes().splitlines(keepends=True)


def _restore_step(directory, on_corrupt="error"):
  ckpt = Checkpointer(str(directory))
  try:
    return ckpt.restore_step(on_corrupt)
  finally:
    ckpt.close()


def _restored_b(directory, step):
  ckpt = Checkpointer(str(directory))
  try:
    state, _ = ckpt.restore(step, TARGET)
    return np.asarray(state["b"])
  finally:
    ckpt.close()


def test_each_committed_step_has_a_chained_entry_and_deleted_steps_keep_theirs(tmp_path):
  _save_steps(tmp_path, [1, 2, 3, 4], keep=2)
  entries = ledger.read(str(tmp_path))
  assert [e.step for e in entries] == [1, 2, 3, 4]  # steps 1 and 2 deleted (keep=2): kept
  assert entries[0].prev == ledger.GENESIS
  assert [e.prev for e in entries[1:]] == [e.hash for e in entries[:-1]]
  assert entries[3].manifest_sha256 == ledger.manifest_digest(str(tmp_path / "4"))
  assert sorted(os.listdir(tmp_path)) == ["3", "4", ledger.NAME]
  for step in (3, 4):
    assert ledger.problem(str(tmp_path), step, entries) is None


def test_data_flipped_and_manifest_recomputed_is_refused_then_skipped(tmp_path):
  """The step vouches for itself; the ledger does not: one line naming the step and the
  digests, then on_corrupt=previous resumes from step 1 (step 2 kept aside)."""
  _save_steps(tmp_path, [1, 2])
  _flip_and_reseal(tmp_path / "2")
  with pytest.raises(CorruptCheckpoint) as err:
    _restore_step(tmp_path)
  line = str(err.value)
  assert "\n" not in line
  assert re.fullmatch(
      rf"checkpoint step 2 in {re.escape(str(tmp_path))} is corrupt: checksums.json differs "
      r"from the ledger: sha256 [0-9a-f]{16}\.\.\., but ledger.jsonl line 2 records "
      r"[0-9a-f]{16}\.\.\. \(the step's files and manifest were rewritten after its commit\); "
      r"step 1 verifies: set --config.checkpoint.on_corrupt=previous to resume from it", line)
  assert _restore_step(tmp_path, "previous") == 1
  assert (tmp_path / "2.corrupt").is_dir()
  np.testing.assert_array_equal(_restored_b(tmp_path, 1), np.arange(8.0) + 1)


def test_restore_and_read_params_check_the_ledger_too(tmp_path):
  from jaxsys.checkpoint import reader
  _save_steps(tmp_path, [5, 6])
  _flip_and_reseal(tmp_path / "5")
  with pytest.raises(CorruptCheckpoint, match=r"^checkpoint step 5 .* checksums.json differs "
                     r"from the ledger: .*; restore another step \(steps there: \[5, 6\]\)$"):
    _restored_b(tmp_path, 5)
  with pytest.raises(CorruptCheckpoint, match=r"^checkpoint step 5 .* differs from the ledger"):
    reader.read_params(str(tmp_path), 5)


def _rewrite(directory, edit):
  """The ledger's entries as dicts, edited by `edit(list)`, written back as lines."""
  rows = [json.loads(l) for l in _lines(directory)]
  edit(rows)
  (directory / ledger.NAME).write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rehash(row):
  row["hash"] = ledger.entry_hash(row["step"], row["manifest_sha256"], row["prev"])


def _edit_digest(rows, rehash):
  rows[1]["manifest_sha256"] = "ab" * 32
  if rehash:
    _rehash(rows[1])


@pytest.mark.parametrize("edit, says", [
    (lambda rows: _edit_digest(rows, False),
     "line 2 (step 2): its hash does not match its fields (the entry was edited)"),
    (lambda rows: _edit_digest(rows, True),
     "line 3 (step 3): it does not chain to the line before it (an entry before it was "
     "removed or edited)"),
    (lambda rows: rows.pop(0),
     "line 1 (step 2): it is not the first entry of a chain (entries before it were removed)"),
    (lambda rows: rows[2].update(step=2),
     "line 3 (step 2): its hash does not match its fields (the entry was edited)"),
])
def test_a_broken_chain_is_refused_naming_the_entry(tmp_path, edit, says):
  """Whatever on_corrupt says: a broken ledger cannot tell a good step from a rewritten one."""
  _save_steps(tmp_path, [1, 2, 3])
  _rewrite(tmp_path, edit)
  for on_corrupt in ("error", "previous"):
    with pytest.raises(ledger.CorruptLedger) as err:
      _restore_step(tmp_path, on_corrupt)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"{tmp_path / ledger.NAME} is corrupt: {says}; "), line
  assert sorted(os.listdir(tmp_path)) == ["1", "2", "3", ledger.NAME]  # nothing moved aside


def test_a_line_that_is_not_an_entry_is_refused(tmp_path):
  _save_steps(tmp_path, [1, 2])
  lines = _lines(tmp_path)
  (tmp_path / ledger.NAME).write_bytes(lines[0] + b"{not json}\n" + lines[1])
  with pytest.raises(ledger.CorruptLedger, match=r"is corrupt: line 2 is not a ledger entry "
                     r"\(JSONDecodeError"):
    _restore_step(tmp_path)


def test_a_missing_ledger_is_one_warning_then_a_new_one_begins(tmp_path, caplog):
  """A run of a version before the ledger: each step verified by its own checksums, one
  warning line. The resumed run's saves begin a ledger; the older steps stay restorable
  (with the warning that they predate it), never refused."""
  _save_steps(tmp_path, [1, 2])
  os.remove(tmp_path / ledger.NAME)
  with caplog.at_level("WARNING"):
    assert _restore_step(tmp_path) == 2
  warned = [r.getMessage() for r in caplog.records if ledger.NAME in r.getMessage()]
  assert warned == [f"checkpoint step 2 in {tmp_path}: {ledger.NO_LEDGER}; restoring it"]
  _save_steps(tmp_path, [3])
  assert [e.step for e in ledger.read(str(tmp_path))] == [3]
  _flip_and_reseal(tmp_path / "3")
  caplog.clear()
  with caplog.at_level("WARNING"):
    assert _restore_step(tmp_path, "previous") == 2
  assert f"checkpoint step 2 in {tmp_path}: {ledger.UNLEDGERED}; restoring it" in caplog.text


def test_crash_after_the_entry_before_the_rename(tmp_path, monkeypatch):
  """The save's entry is durable but the rename that commits the step fails: no step 3,
  an entry for it. The next run resumes from step 2 without a warning, and its own save
  of step 3 appends the entry that counts (the step's last)."""
  _save_steps(tmp_path, [1, 2])

  rename = manager.async_path.rename

  async def crash(src, dst):  # the step's own rename only: its items commit as before
    if os.path.basename(dst) == "3":
      raise OSError(errno.EIO, "Input/output error")
    return await rename(src, dst)
  monkeypatch.setattr(manager.async_path, "rename", crash)
  ckpt = Checkpointer(str(tmp_path))
  try:
    ckpt.save(3, {"w": jnp.zeros((64, 64)), "b": jnp.zeros(8)}, data=_position(3), meta={})
    with pytest.raises(storage.WriteError, match="saving checkpoint step 3"):
      ckpt.wait()
  finally:
    ckpt.close()
  monkeypatch.undo()
  assert [e.step for e in ledger.read(str(tmp_path))] == [1, 2, 3]
  ckpt = Checkpointer(str(tmp_path))
  try:
    assert ckpt.remove_partial_saves()  # the uncommitted step 3, as a run's start does
    assert ckpt.restore_step() == 2
  finally:
    ckpt.close()
  _save_steps(tmp_path, [3])
  entries = ledger.read(str(tmp_path))
  assert [e.step for e in entries] == [1, 2, 3, 3]
  assert ledger.problem(str(tmp_path), 3, entries) is None
  assert _restore_step(tmp_path) == 3


def test_a_committed_step_without_its_entry_is_refused(tmp_path):
  """Not a crash window (the entry is durable before the commit): the ledger lost the
  entry, as when its last line is cut off to hide a rewrite of the step."""
  _save_steps(tmp_path, [1, 2])
  _flip_and_reseal(tmp_path / "2")
  (tmp_path / ledger.NAME).write_bytes(_lines(tmp_path)[0])
  with pytest.raises(CorruptCheckpoint, match=r"^checkpoint step 2 .* is corrupt: not in "
                     r"ledger.jsonl \(which runs from step 1 to 1\), though meta/metadata "
                     r"records that the step was entered in it .*; step 1 verifies"):
    _restore_step(tmp_path)
  assert _restore_step(tmp_path, "previous") == 1


def test_a_torn_last_line_is_no_entry_and_the_next_save_cuts_it(tmp_path):
  """A crash inside the append (before its fsync, so before its step's commit)."""
  _save_steps(tmp_path, [1, 2])
  with open(tmp_path / ledger.NAME, "ab") as f:
    f.write(b'{"step": 3, "manifest_sha2')
  assert [e.step for e in ledger.read(str(tmp_path))] == [1, 2]
  assert _restore_step(tmp_path) == 2
  _save_steps(tmp_path, [3])
  assert [e.step for e in ledger.read(str(tmp_path))] == [1, 2, 3]
  assert all(l.endswith(b"}\n") for l in _lines(tmp_path))


def test_a_step_made_legacy_is_refused_by_its_entry(tmp_path):
  """Manifest and meta's record removed: the step passes as an older version's, but the
  ledger knows it was sealed."""
  _save_steps(tmp_path, [1, 2])
  os.remove(tmp_path / "2" / integrity.MANIFEST)
  path = tmp_path / "2" / "meta" / "metadata"
  meta = json.loads(path.read_text())
  del meta[integrity.RECORD]
  path.write_text(json.dumps(meta))
  with pytest.raises(CorruptCheckpoint, match=r"step 2 .* checksums.json: missing \(the step "
                     r"passes as saved before checksums\), but ledger.jsonl line 2 records"):
    _restore_step(tmp_path)


def test_checkpoint_info_says_whether_each_step_matches_the_ledger(tmp_path):
  from jaxsys.cli import checkpoint_info
  _save_steps(tmp_path, [1, 2])
  _flip_and_reseal(tmp_path / "2")

  def status():
    lines = checkpoint_info.describe(str(tmp_path))
    return lines[1], dict(re.match(r"\s*step\s+(\d+)\s+[\d.]+ MiB  (.*?); ", l).groups()
                          for l in lines if l.lstrip().startswith("step"))
  head, steps = status()
  assert head == f"  {ledger.NAME}: 2 entries, chain verifies"
  assert steps["1"] == "verified, in ledger"
  assert steps["2"].startswith("CORRUPT: checksums.json differs from the ledger: sha256 ")
  _rewrite(tmp_path, lambda rows: rows[0].update(step=7))
  head, steps = status()
  assert head.startswith(f"  BROKEN LEDGER: {tmp_path / ledger.NAME} is corrupt: line 1 (step "
                         "7): its hash does not match")
  assert steps == {"1": "verified, ledger broken", "2": "verified, ledger broken"}
  os.remove(tmp_path / ledger.NAME)
  head, steps = status()
  assert head == f"  {ledger.NAME}: absent: steps verified by their own checksums only"
  assert steps == {"1": "verified, no ledger", "2": "verified, no ledger"}
