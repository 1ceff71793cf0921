"""One run per workdir: a lock file naming its holder (pid, host, start time).

Two runs on one workdir would overwrite each other's checkpoints and interleave
`metrics.jsonl`. The lock is `<workdir>/run.lock`, created atomically (written whole, then
hard-linked into place) and holding JSON. A second run refuses in one line naming the
holder. A lock whose holder is gone (same host, no such pid) is stale: the next run takes
it over with a warning. So is a lock that does not name a holder (empty, or not the JSON
this module writes) once it is `UNNAMED_GRACE_S` old: jaxsys never writes one (its locks
appear whole), so only another tool mid-write could still be filling it. A lock from
another host is never taken over, since its holder cannot be checked from here.

Example:
  with WorkdirLock(workdir):
    ...  # train
"""
from __future__ import annotations

import json
import os
import socket
import time

from absl import logging

from jaxsys import storage

LOCK_NAME = "run.lock"
# How long a lock that names no holder is left alone: ample for any writer to finish it.
UNNAMED_GRACE_S = 10.0


class WorkdirInUse(ValueError):
  """Another live run holds the workdir (a ValueError: the binaries print it in one line)."""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


class WorkdirLock:
  """Holds `<workdir>/run.lock` from __enter__ to __exit__ (see the module docstring)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
    self._held = False

  def _holder(self) -> dict | None:
    """The lock's JSON; {} if it names no holder (unreadable, empty, not this module's)."""
    try:
      with open(self.path, encoding="utf-8") as f:
        holder = json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {}
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else {}

  def _stale(self, holder: dict, host: str) -> str | None:
    """Why `holder`'s lock may be taken over, or None while it may still be held."""
    if holder.get("host") == host and "pid" in holder and not _alive(holder["pid"]):
      return f"of pid {holder['pid']} on {host} (no such process)"
    if not holder:
      try:
        age = time.time() - os.stat(self.path).st_mtime
      except FileNotFoundError:
        return None
      if age >= UNNAMED_GRACE_S:
        return f"that names no holder ({age:.0f} s old, not the JSON a run writes)"
    return None

  def acquire(self) -> None:
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    # The lock appears whole or not at all: written to a file of our own, then hard-linked
    # into place (link refuses an existing name, like O_EXCL). A kill can never leave an
    # empty lock that refuses every later run.
    mine = f"{self.path}.{me['pid']}.tmp"
    try:
      with open(mine, "w", encoding="utf-8") as f:
        json.dump(me, f)
    except OSError as e:  # e.g. a full disk
      if os.path.exists(mine):
        os.remove(mine)
      raise storage.WriteError(f"writing {self.path}", e) from e
    try:
      for _ in range(2):  # a second try after removing a stale lock
        try:
          os.link(mine, self.path)
        except FileExistsError:
          holder = self._holder()
          if holder is None:
            continue  # released between our link and our read
          stale = self._stale(holder, me["host"])
          if stale:
            logging.warning("%s: taking over a stale lock %s", self.path, stale)
            os.remove(self.path)
            continue
          if not holder:
            raise WorkdirInUse(
                f"{self.path} names no holder (empty or not a run's JSON) and was written "
                f"less than {UNNAMED_GRACE_S:.0f} s ago; a run takes it over once it is "
                f"older, so run again then")
          since = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
                   if isinstance(holder.get("started"), (int, float)) else "an unknown time")
          raise WorkdirInUse(
              f"workdir {os.path.dirname(self.path)} is in use by pid {holder.get('pid', '?')} "
              f"on host {holder.get('host', '?')} since {since}; stop that run or use another "
              f"--workdir (delete {self.path} only if that run is gone)")
        self._held = True
        return
      raise WorkdirInUse(f"{self.path}: could not take the lock; another run keeps taking it")
    finally:
      os.remove(mine)

  def release(self) -> None:
    if self._held:
      self._held = False
      holder = self._holder()
      if holder and holder.get("pid") == os.getpid():
        os.remove(self.path)

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()
