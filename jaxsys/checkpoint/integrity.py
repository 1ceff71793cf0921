"""Checksums of a committed checkpoint step: written once it is saved, verified before a restore.

Orbax's own checksums cover the ocdbt index, not the array data: a flipped bit in a
`d/` file loads as wrong parameters. Every file of a step directory is therefore listed
in `<step>/checksums.json` with its size and CRC-32 (JSON: nothing pickled), written
atomically (temporary file, then rename) after the step has committed. `problem(step_dir)`
names the first file that is missing, truncated or changed, or None when all verify.

A step without the manifest was saved before it existed, or by a run that stopped
between the commit and the manifest; it cannot be verified (`UNSEALED`), but it must
still hold the files every step has (`REQUIRED`).

Example:
  seal("/w/checkpoints/30")
  problem("/w/checkpoints/30")   # None, or e.g. "state/d/7c93...: checksum mismatch"
"""
from __future__ import annotations

import json
import os
import zlib

MANIFEST = "checksums.json"
UNSEALED = "no checksums.json (saved before checksums, or stopped before writing them)"
# Files every step of a run has (jaxsys.checkpoint.manager's items): checked when a step
# has no manifest, so an empty or half-deleted step is never taken as a checkpoint.
REQUIRED = ("meta/metadata", "data/metadata", "state/_METADATA")
_BLOCK = 8 << 20


def _crc32(path: str) -> str:
  crc = 0
  with open(path, "rb") as f:
    while block := f.read(_BLOCK):
      crc = zlib.crc32(block, crc)
  return f"{crc:08x}"


def _files(step_dir: str) -> list[str]:
  out = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      if rel != MANIFEST and not rel.startswith(MANIFEST + "."):
        out.append(rel)
  return sorted(out)


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


def is_sealed(step_dir: str) -> bool:
  return os.path.exists(os.path.join(step_dir, MANIFEST))


def problem(step_dir: str) -> str | None:
  """None when every file the manifest lists is there with its size and checksum; else
  the first difference, naming the file (`UNSEALED` when there is no manifest)."""
  if not os.path.isdir(step_dir):
    return "the step directory is missing"
  try:
    with open(os.path.join(step_dir, MANIFEST), encoding="utf-8") as f:
      files = json.load(f)["crc32"]
  except FileNotFoundError:
    missing = next((rel for rel in REQUIRED if not os.path.exists(os.path.join(step_dir, rel))),
                   None)
    return UNSEALED if missing is None else f"{missing}: missing (and no {MANIFEST})"
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"{MANIFEST}: unreadable ({type(e).__name__})"
  for rel, (size, crc) in sorted(files.items()):
    path = os.path.join(step_dir, rel)
    if not os.path.exists(path):
      return f"{rel}: missing"
    if os.path.getsize(path) != size:
      return f"{rel}: {os.path.getsize(path)} bytes, {size} when saved (truncated or overwritten)"
    if _crc32(path) != crc:
      return f"{rel}: checksum mismatch (the file changed after it was saved)"
  return None
