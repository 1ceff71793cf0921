"""One run per workdir: a lock file naming its holder (pid, host, start time).

Two runs on one workdir would overwrite each other's checkpoints and interleave
`metrics.jsonl`. The lock is `<workdir>/run.lock`, created atomically (written whole, then
hard-linked into place) and holding JSON. A second run refuses in one line naming the
holder. A lock whose holder is gone (same host, no such pid) is stale: the next run takes
it over with a warning. A lock from another host is never taken over, since its holder
cannot be checked from here.

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
    try:
      with open(self.path, encoding="utf-8") as f:
        return json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {}  # unreadable or half-written: treated as held by an unknown run

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
          if (holder.get("host") == me["host"] and isinstance(holder.get("pid"), int)
              and not _alive(holder["pid"])):
            logging.warning("%s: taking over a stale lock of pid %d on %s (no such process)",
                            self.path, holder["pid"], holder["host"])
            os.remove(self.path)
            continue
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
