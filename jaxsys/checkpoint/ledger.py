"""The checkpoint ledger: each committed step's manifest digest, recorded outside the step.

A step's manifest (`integrity`: `<step>/checksums.json`) vouches for the step's files, but
it lives inside the step: a step whose data was changed and whose manifest was then
recomputed verifies. So every save also appends one line to `<checkpoints>/ledger.jsonl`:

  {"step": 8, "manifest_sha256": <sha256 of 8/checksums.json>, "prev": <previous entry's
   hash, 64 zeros for the first>, "hash": <sha256 of this entry's other three fields>}

chained as git's and ZFS's hashes are: an entry edited (or dropped from the front or the
middle) breaks the chain at that entry. `problem(directory, step, read(directory))` is
`integrity.problem` and then the ledger's word: the step's manifest must have the digest
of the step's LAST entry (a step re-saved after `on_corrupt=previous` has a newer one).

Commit protocol (manager._CommitWithChecksums): seal the step in orbax's temporary
directory, append its entry and fsync the ledger, then rename the step into place. So a
committed step always has a durable entry. Crash windows:
- after the append, before the rename: an entry for a step that never committed. Harmless:
  the temporary directory is removed at the next start, and a later save of that step
  number appends a newer entry, which is the one checked.
- a committed step without its entry cannot come from a crash; it means the ledger lost
  the entry (truncated, replaced) or the step was copied from another run: refused when
  the step's meta records that it was entered (`integrity.record`) and the ledger covers
  its step (it is not older than the ledger's first entry).
- a crash inside the append can leave a last line without its newline: never an entry
  (its fsync, hence its step's commit, never happened). `read` skips it; the next append
  cuts it off first.
Steps deleted by max_to_keep keep their entries (append-only: deletion is orbax's, in its
own thread, and an entry of a deleted step vouches for nothing that is loaded; a line is
about 200 bytes a save).

What passes with a warning, not silently and not refused: no ledger at all (`NO_LEDGER`:
a run of a version before the ledger, or a ledger deleted), a step older than the ledger
or saved by such a version (`UNLEDGERED`). What it does not protect against: whoever
rewrites the step AND the ledger consistently (the ledger is not signed and nothing
outside the workdir holds its head), nor a change to a file that keeps its CRC-32 (the
manifest's checksum: it catches damage, not forgery).

Example:
  entries = read("/w/checkpoints")          # None without a ledger; CorruptLedger if broken
  problem("/w/checkpoints", 8, entries)     # None, or e.g. "checksums.json differs from ..."
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

from absl import logging

from jaxsys.checkpoint import integrity

NAME = "ledger.jsonl"
GENESIS = "0" * 64  # the `prev` of a ledger's first entry
NO_LEDGER = (f"no {NAME} beside the steps (a run of a version before the ledger, or the "
             "ledger was deleted): verified by its own checksums only")
UNLEDGERED = (f"not in {NAME}, and saved before its first entry (by a version before the "
              "ledger, or before the ledger was replaced): verified by its own checksums only")
# integrity.problem / problem results a step is restored with, with a warning.
WARNINGS = (integrity.LEGACY, NO_LEDGER, UNLEDGERED)
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TAIL = 1 << 16  # bytes read from the end of the ledger to find its last entry


class CorruptLedger(ValueError):
  """The ledger's chain does not verify (a ValueError: the binaries print one line)."""


@dataclasses.dataclass(frozen=True)
class Entry:
  line: int  # 1-based line of the ledger
  step: int
  manifest_sha256: str
  prev: str
  hash: str


def path(directory: str) -> str:
  return os.path.join(directory, NAME)


def entry_hash(step: int, manifest_sha256: str, prev: str) -> str:
  """sha256 of the entry's fields as canonical JSON (sorted keys, no spaces)."""
  body = json.dumps({"manifest_sha256": manifest_sha256, "prev": prev, "step": step},
                    sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(body.encode()).hexdigest()


def manifest_digest(step_dir: str) -> str:
  """sha256 of the step's manifest file, as written."""
  with open(os.path.join(step_dir, integrity.MANIFEST), "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _parse(line: int, text: bytes, prev: str, where: str) -> Entry:
  """One line as an Entry chained to `prev`; CorruptLedger naming the line otherwise."""
  try:
    value = json.loads(text)
    step, digest, got_prev, got_hash = (value["step"], value["manifest_sha256"], value["prev"],
                                        value["hash"])
    if not (type(step) is int and all(isinstance(h, str) and _HEX64.fullmatch(h)
                                      for h in (digest, got_prev, got_hash))):
      raise TypeError("a field of the wrong type")
  except (ValueError, KeyError, TypeError) as e:
    raise CorruptLedger(f"{where} is corrupt: line {line} is not a ledger entry "
                        f"({type(e).__name__}: {e}); nothing in it can be trusted: restore it "
                        "from a copy, or move it aside to resume with each step's own "
                        "checksums only") from None
  if got_hash != entry_hash(step, digest, got_prev):
    why = "its hash does not match its fields (the entry was edited)"
  elif got_prev != prev:
    why = ("it does not chain to the line before it (an entry before it was removed or "
           "edited)" if line > 1 else "it is not the first entry of a chain (entries before "
           "it were removed)")
  else:
    return Entry(line, step, digest, got_prev, got_hash)
  raise CorruptLedger(f"{where} is corrupt: line {line} (step {step}): {why}; the steps "
                      "cannot be checked against it: restore it from a copy, or move it aside "
                      "to resume with each step's own checksums only")


def read(directory: str) -> list[Entry] | None:
  """The ledger's entries, each verified against the one before; None when there is no
  ledger. A last line without its newline (a crash inside an append) is not an entry."""
  where = path(directory)
  if not os.path.lexists(where):
    return None
  if not os.path.isfile(where):  # never open a FIFO: it would block
    raise CorruptLedger(f"{where} is corrupt: not a regular file (a directory, FIFO or broken "
                        "link); move it away, then run again")
  try:
    with open(where, "rb") as f:
      data = f.read()
  except OSError as e:
    raise CorruptLedger(f"{where} is unreadable ({e.strerror}); make it readable, then run "
                        "again") from None
  lines = data.split(b"\n")[:-1]  # the last piece: empty, or a torn append
  entries, prev = [], GENESIS
  for number, text in enumerate(lines, 1):
    entry = _parse(number, text, prev, where)
    entries.append(entry)
    prev = entry.hash
  return entries


def _fsync_dir(directory: str) -> None:
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _head(f, where: str) -> str:
  """The hash of the ledger's last entry (GENESIS when empty); cuts off a torn last line."""
  size = f.seek(0, os.SEEK_END)
  start = f.seek(max(0, size - _TAIL))
  tail = f.read()
  if not tail.endswith(b"\n") and tail:  # a crash inside an append: never an entry
    if b"\n" not in tail and start:
      raise CorruptLedger(f"{where} is corrupt: its last {_TAIL} bytes hold no line end")
    tail = tail[:tail.rfind(b"\n") + 1]
    logging.warning("%s: cutting off its last %d bytes, a line without its end (an append "
                    "that a crash interrupted: never an entry)", where, size - start - len(tail))
    f.truncate(start + len(tail))
  lines = tail.split(b"\n")[:-1]
  if not lines:
    if start:
      raise CorruptLedger(f"{where} is corrupt: its last line is over {_TAIL} bytes")
    return GENESIS
  try:
    return json.loads(lines[-1])["hash"]
  except (ValueError, KeyError, TypeError):
    raise CorruptLedger(f"{where} is corrupt: its last line is not a ledger entry") from None


def append(directory: str, step: int, manifest_sha256: str) -> str:
  """Appends `step`'s entry, chained to the last one, and fsyncs it (and, for a new
  ledger, the directory): durable when this returns. Returns the entry's hash."""
  where = path(directory)
  created = not os.path.exists(where)
  fd = os.open(where, os.O_RDWR | os.O_CREAT, 0o644)
  with os.fdopen(fd, "r+b") as f:
    prev = _head(f, where)
    digest = entry_hash(step, manifest_sha256, prev)
    f.seek(0, os.SEEK_END)
    f.write((json.dumps({"step": step, "manifest_sha256": manifest_sha256, "prev": prev,
                         "hash": digest}) + "\n").encode())
    f.flush()
    os.fsync(f.fileno())
  if created:
    _fsync_dir(directory)
  return digest


def enter(step_dir: str, directory: str, step: int) -> str:
  """`append` of the sealed step at `step_dir` (orbax's temporary directory, before the
  rename that commits it as `directory`/`step`)."""
  return append(directory, step, manifest_digest(step_dir))


def _entered(step_dir: str) -> bool:
  """Whether the step's meta records that it was entered in a ledger when saved."""
  try:
    with open(os.path.join(step_dir, "meta", "metadata"), encoding="utf-8") as f:
      saved = json.load(f).get(integrity.RECORD)
  except (OSError, ValueError, AttributeError):
    return False
  return isinstance(saved, dict) and saved.get("ledger") == NAME


def problem(directory: str, step: int, entries: list[Entry] | None) -> str | None:
  """`integrity.problem` of `directory`/`step`, then whether the ledger (`entries`, from
  `read`) vouches for its manifest: None when it does; NO_LEDGER, UNLEDGERED or
  integrity.LEGACY for a step to restore with a warning; else what differs."""
  step_dir = os.path.join(directory, str(step))
  found = integrity.problem(step_dir)
  if found not in (None, integrity.LEGACY):
    return found
  if entries is None:
    return found or NO_LEDGER
  entry = next((e for e in reversed(entries) if e.step == step), None)
  if entry is not None:
    if found == integrity.LEGACY:
      return (f"{integrity.MANIFEST}: missing (the step passes as saved before checksums), but "
              f"{NAME} line {entry.line} records its sha256 {entry.manifest_sha256[:16]}... "
              "(the step was rewritten after its commit)")
    got = manifest_digest(step_dir)
    if got != entry.manifest_sha256:
      return (f"{integrity.MANIFEST} differs from the ledger: sha256 {got[:16]}..., but "
              f"{NAME} line {entry.line} records {entry.manifest_sha256[:16]}... (the step's "
              "files and manifest were rewritten after its commit)")
    return None
  if found == integrity.LEGACY:
    return found
  if entries and step >= entries[0].step and _entered(step_dir):
    return (f"not in {NAME} (which runs from step {entries[0].step} to {entries[-1].step}), "
            f"though meta/metadata records that the step was entered in it (the ledger lost "
            "the entry, or the step was copied from another run)")
  return UNLEDGERED
