"""Checksums of a checkpoint step: written inside its save, before it commits; verified
before a restore.

Orbax's own checksums cover the ocdbt index, not the array data: a flipped bit in a
`d/` file loads as wrong parameters. Every file of a step directory is therefore listed
in `<step>/checksums.json` with its size and CRC-32 (JSON: nothing pickled). The manager
writes it into orbax's temporary directory just before the rename that commits the step,
so a committed step of this version always has it. `problem(step_dir)` names the first
file that is missing, truncated, changed or not listed, or returns None when all verify.

The manifest alone would vouch for itself (one listing nothing, or deleted, proves
nothing), so the step's meta item also records that it was saved with checksums, the
step and the loader position (`record`): a manifest missing from such a step, a loader
position that differs from the recorded copy, and a packed loader whose position is not
the step's (it reads one batch a step) are corrupt. A step without manifest or record
was saved by an older version: `LEGACY`, restored unverified (it must still hold the
files every step has, `REQUIRED`).

Example:
  seal("/w/checkpoints/30")      # what the save does, in its temporary directory
  problem("/w/checkpoints/30")   # None, or e.g. "state/d/7c93...: checksum mismatch ..."
"""
from __future__ import annotations

import errno
import json
import os
import zlib

MANIFEST = "checksums.json"
RECORD = "integrity"  # meta's key for `record`
FORMAT = 1
LEGACY = (f"no {MANIFEST} and no checksum record in meta/metadata (saved by a version "
          "before checksums)")
# Files every step of a run has (jaxsys.checkpoint.manager's items): checked when a step
# has no manifest, so an empty or half-deleted step is never taken as a checkpoint.
REQUIRED = ("meta/metadata", "data/metadata", "state/_METADATA")
_META, _DATA = "meta/metadata", "data/metadata"
_BLOCK = 8 << 20


def record(step: int, data: dict, ledger: str | None = None) -> dict:
  """What meta holds beside the model: the format, the step, a copy of the loader position
  and the name of the ledger the step is entered in (jaxsys.checkpoint.ledger: a step that
  says so and is missing from a ledger that covers it is corrupt, not an older version's)."""
  out = {"format": FORMAT, "step": step, "data": data}
  return out if ledger is None else {**out, "ledger": ledger}


def _crc32(path: str) -> str:
  crc = 0
  with open(path, "rb") as f:
    while block := f.read(_BLOCK):
      crc = zlib.crc32(block, crc)
  return f"{crc:08x}"


def _raise(error: OSError) -> None:
  raise error


def _files(step_dir: str) -> list[str]:
  """The step's files (relative paths); a directory that cannot be listed raises."""
  out = []
  for root, _, names in os.walk(step_dir, onerror=_raise):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      if rel not in (MANIFEST, MANIFEST + ".tmp"):
        out.append(rel)
  return sorted(out)


def _json(step_dir: str, rel: str):
  path = os.path.join(step_dir, rel)
  if os.path.lexists(path) and not os.path.isfile(path):  # never open a FIFO: it would block
    raise IsADirectoryError(errno.EISDIR, "not a regular file", path)
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _unreadable(rel: str, error: OSError) -> str:
  """What `problem` says of a file or directory it cannot read (e.g. chmod 000)."""
  return f"{rel}: unreadable ({error.strerror or type(error).__name__})"


def seal(step_dir: str) -> None:
  """Writes `step_dir`'s manifest: every file's size and CRC-32."""
  files = {rel: [os.path.getsize(os.path.join(step_dir, rel)),
                 _crc32(os.path.join(step_dir, rel))] for rel in _files(step_dir)}
  tmp = os.path.join(step_dir, MANIFEST + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"crc32": files}, f, indent=0)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_dir, MANIFEST))


def problem(step_dir: str) -> str | None:
  """None when the manifest lists every file of the step and each matches, and the
  loader position agrees with meta's record; else the first difference, naming the file
  (`LEGACY` for a step of an older version, which cannot be verified)."""
  if not os.path.isdir(step_dir):
    return "the step directory is missing"
  try:
    listed = _json(step_dir, MANIFEST)["crc32"]
    if not isinstance(listed, dict):
      raise TypeError(type(listed).__name__)
  except FileNotFoundError:
    return _unsealed(step_dir)
  except OSError as e:
    return _unreadable(MANIFEST, e)
  except (ValueError, KeyError, TypeError) as e:
    return f"{MANIFEST}: unreadable ({type(e).__name__})"
  try:
    return _files_problem(step_dir, listed) or _record_problem(step_dir)
  except OSError as e:  # a directory of the step that cannot be listed
    rel = os.path.relpath(e.filename, step_dir) if e.filename else "a directory"
    return _unreadable(rel, e)


def _record_of(meta) -> dict | None:
  """meta's `record`, None for a step of an older version."""
  return meta.get(RECORD) if isinstance(meta, dict) else None


def _unsealed(step_dir: str) -> str:
  missing = next((rel for rel in REQUIRED if not os.path.exists(os.path.join(step_dir, rel))),
                 None)
  if missing is not None:
    return f"{missing}: missing (and no {MANIFEST})"
  try:
    saved = _record_of(_json(step_dir, _META))
  except (OSError, ValueError) as e:
    return f"{_META}: unreadable ({type(e).__name__}) (and no {MANIFEST})"
  if saved is not None:
    return (f"{MANIFEST}: missing, though {_META} records that the step was saved with it "
            "(deleted since)")
  return LEGACY


def _files_problem(step_dir: str, listed: dict) -> str | None:
  """The manifest's first entry that fails, or the files it does not list."""
  present = _files(step_dir)
  unlisted = [rel for rel in present if rel not in listed]
  if unlisted:
    more = f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else ""
    return (f"{MANIFEST}: lists {len(present) - len(unlisted)} of the step's {len(present)} "
            f"files, not {', '.join(unlisted[:3])}{more}")
  for rel, entry in sorted(listed.items()):
    if not (isinstance(entry, list) and len(entry) == 2):
      return f"{MANIFEST}: unreadable (entry of {rel} is {entry!r})"
    size, crc = entry
    path = os.path.join(step_dir, rel)
    if not os.path.lexists(path):
      return f"{rel}: missing"
    if not os.path.isfile(path):
      return f"{rel}: not a regular file (a directory, FIFO or broken link)"
    try:
      if os.path.getsize(path) != size:
        return f"{rel}: {os.path.getsize(path)} bytes, {size} when saved (truncated or overwritten)"
      if _crc32(path) != crc:
        return f"{rel}: checksum mismatch (the file changed after it was saved)"
    except OSError as e:
      return _unreadable(rel, e)
  return None


def _record_problem(step_dir: str) -> str | None:
  """Whether the loader position is the one saved with the step (files already verified)."""
  read = {}
  for rel in (_META, _DATA):
    try:
      read[rel] = _json(step_dir, rel)
    except OSError as e:  # a missing one was unlisted too: else named above
      return _unreadable(rel, e)
    except ValueError as e:
      return f"{rel}: unreadable ({type(e).__name__})"
  saved = _record_of(read[_META])
  if saved is None:  # an older version's manifest: it verified, there is nothing more
    return None
  data = read[_DATA]
  if not isinstance(saved, dict) or saved.get("format") != FORMAT:
    got = saved.get("format") if isinstance(saved, dict) else saved
    return f"{_META}: checkpoint format {got!r}, this version reads format {FORMAT}"
  name = os.path.basename(os.path.normpath(step_dir))
  step = int(name) if name.isdigit() else saved.get("step")
  if saved.get("step") != step:
    return f"{_META}: records step {saved.get('step')!r}, the directory is step {step}"
  if data != saved.get("data"):
    return (f"{_DATA}: the loader position differs from the copy saved in {_META} "
            f"({_difference(data, saved.get('data'))})")
  # The packed loader (jaxsys.data.loader) reads one batch a step: after step s its grain
  # iterator's next index is s. A position rewritten in both copies still fails here.
  grain = data.get("grain") if isinstance(data, dict) else None
  if isinstance(grain, dict) and "next_index" in grain and grain["next_index"] != step:
    return (f"{_DATA}: the loader's next_index is {grain['next_index']!r}, but step {step} "
            f"has read {step} batches (one a step)")
  return None


def _difference(got, want, path: str = "") -> str:
  """The first key whose value differs, e.g. "grain.next_index: 7 there, 4 in meta"."""
  if isinstance(got, dict) and isinstance(want, dict):
    for key in sorted(set(got) | set(want)):
      if got.get(key) != want.get(key):
        return _difference(got.get(key), want.get(key), f"{path}.{key}" if path else key)
  return f"{path or 'the position'}: {got!r} there, {want!r} in meta"
