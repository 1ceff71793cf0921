"""One run per workdir: a kernel lock held for the run's life, in a file naming its holder.

Two runs on one workdir would overwrite each other's checkpoints and interleave
`metrics.jsonl`. The lock is `<workdir>/run.lock`: a file holding JSON (pid, host, start
time) for humans and other hosts, on which the holder keeps a kernel lock (`flock`) open
until it releases. The kernel decides who holds it, so no interleaving of runs starting
together can give it two holders: a run takes it (or takes it over) only with the kernel
lock of the very file at that path in hand, and replaces the file by a rename, never by a
delete that could remove a fresh lock of another run.

A run's file appears whole (written to a file of its own, locked, then hard-linked or
renamed into place), so a kill never leaves an empty lock. A second run refuses in one
line naming the holder. A lock whose holder is gone (its kernel lock free: the holder
exited, however it ended) is stale when it names a pid on this host that no longer runs:
the next run takes it over with a warning. So is a lock that does not name a holder
(empty, or not the JSON this module writes) once it is `UNNAMED_GRACE_S` old: jaxsys never
writes one, so only another tool mid-write could still be filling it. A lock from another
host is never taken over, since its holder cannot be checked from here; nor one that
names a live process (a run of a version before the kernel lock, or a pid reused).

On a filesystem without `flock` (some network and FUSE mounts) the lock falls back to the
hard link alone, which is atomic: a free workdir is taken as before, but a stale lock is
refused in one line (delete it by hand), since a takeover there could race. A `run.lock`
that is a directory, not a regular file, or cannot be opened is refused in one line
(`BadLock`).

Example:
  with WorkdirLock(workdir):
    ...  # train
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time

from absl import logging

from jaxsys import storage

LOCK_NAME = "run.lock"
# How long a lock that names no holder is left alone: ample for any writer to finish it.
UNNAMED_GRACE_S = 10.0
# How long a run waits for another run's takeover to finish (its kernel lock held over a
# file still naming the dead holder) before it reports the lock as held.
_TAKEOVER_WAIT_S = 1.0


class WorkdirInUse(ValueError):
  """Another live run holds the workdir (a ValueError: the binaries print it in one line)."""


class BadLock(ValueError):
  """`run.lock` is not a lock file a run could take (a directory, unreadable): one line."""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def _kernel_lock(fd: int) -> bool | None:
  """Takes `fd`'s exclusive kernel lock without waiting: True when taken, False when
  another open file holds it, None when the filesystem has no such locks."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except (BlockingIOError, InterruptedError):
    return False
  except OSError as e:
    if e.errno in (errno.EAGAIN, errno.EACCES):
      return False
    return None  # ENOLCK, EOPNOTSUPP, ENOSYS, EINVAL, EBADF: no kernel locks here
  return True


def _parse(raw: bytes) -> dict:
  """The holder a lock's bytes name; {} if none (empty, not this module's JSON)."""
  try:
    holder = json.loads(raw.decode("utf-8"))
  except ValueError:
    return {}
  return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else {}


def _read(fd: int) -> bytes:
  os.lseek(fd, 0, os.SEEK_SET)
  chunks = []
  while chunk := os.read(fd, 1 << 16):
    chunks.append(chunk)
  return b"".join(chunks)


class WorkdirLock:
  """Holds `<workdir>/run.lock` from __enter__ to __exit__ (see the module docstring)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
    self._fd: int | None = None  # our lock file, its kernel lock held while we hold it

  def _holder(self) -> dict | None:
    """The lock's JSON; {} if it names no holder (unreadable, empty, not this module's)."""
    try:
      with open(self.path, "rb") as f:
        return _parse(f.read())
    except FileNotFoundError:
      return None
    except OSError:
      return {}

  def _bad(self, what: str) -> BadLock:
    return BadLock(f"{self.path} {what}, not a lock file a run writes; it must be a regular "
                   f"file this user can read and write: remove it if no run uses "
                   f"{os.path.dirname(self.path)}, then run again")

  def _stale(self, holder: dict, host: str, age: float) -> str | None:
    """Why `holder`'s lock may be taken over, or None while it may still be held."""
    if holder.get("host") == host and not _alive(holder["pid"]):
      return f"of pid {holder['pid']} on {host} (no such process)"
    if not holder and age >= UNNAMED_GRACE_S:
      return f"that names no holder ({age:.0f} s old, not the JSON a run writes)"
    return None

  def _in_use(self, holder: dict, age: float, kernel_held: bool) -> WorkdirInUse:
    """The one-line refusal while `holder` holds the lock."""
    if not holder:
      if kernel_held:
        return WorkdirInUse(f"workdir {os.path.dirname(self.path)} is in use: {self.path} is "
                            "locked by a live process, though it names no holder; stop that "
                            "run or use another --workdir")
      return WorkdirInUse(
          f"{self.path} names no holder (empty or not a run's JSON) and was written "
          f"less than {UNNAMED_GRACE_S:.0f} s ago; a run takes it over once it is older, so "
          "run again then")
    since = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
             if isinstance(holder.get("started"), (int, float)) else "an unknown time")
    gone = (kernel_held and holder.get("host") == socket.gethostname()
            and not _alive(holder["pid"]))
    by = (f"a process that pid {holder['pid']} started (pid {holder['pid']} has exited; "
          "a child of it still holds the kernel lock)" if gone
          else f"pid {holder['pid']} on host {holder.get('host', '?')}")
    return WorkdirInUse(
        f"workdir {os.path.dirname(self.path)} is in use by {by} since {since}; stop that "
        f"run or use another --workdir (delete {self.path} only if that run is gone)")

  def acquire(self) -> None:
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    host = socket.gethostname()
    me = {"pid": os.getpid(), "host": host, "started": time.time()}
    # Our lock file, written whole and locked before anyone can see it; it then appears at
    # the lock's path by a hard link (refused if the name exists, like O_EXCL) or, over a
    # stale lock whose kernel lock we hold, by a rename (atomic).
    mine = f"{self.path}.{me['pid']}.tmp"
    fd = None
    try:
      fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
      data = json.dumps(me).encode("utf-8")
      while data:
        data = data[os.write(fd, data):]
    except OSError as e:  # e.g. a full disk
      if fd is not None:
        os.close(fd)
      if os.path.exists(mine):
        os.remove(mine)
      raise storage.WriteError(f"writing {self.path}", e) from e
    try:
      kernel = _kernel_lock(fd) is not None  # our own new file: only "unsupported" fails
      # Ours before it can appear at the lock's path: whatever stops the take (a refusal, or
      # SIGTERM's Preempted between the link and here), release() removes the lock only if
      # it is this file, so no lock of ours is left behind.
      self._fd, fd = fd, None
      self._take(mine, host, kernel)
    except BaseException:
      self.release()
      raise
    finally:
      if fd is not None:
        os.close(fd)
      try:
        os.remove(mine)  # still there after a link (a second name) or a refusal
      except FileNotFoundError:
        pass

  def _take(self, mine: str, host: str, kernel: bool) -> None:
    """Puts `mine` at the lock's path, or raises why not (see the module docstring)."""
    deadline = time.monotonic() + _TAKEOVER_WAIT_S
    while True:
      try:
        os.link(mine, self.path)
        return
      except FileExistsError:
        pass
      try:
        info = os.lstat(self.path)
      except FileNotFoundError:
        continue  # released meanwhile
      if stat.S_ISDIR(info.st_mode):
        raise self._bad("is a directory")
      if not stat.S_ISREG(info.st_mode):
        raise self._bad("is not a regular file (a symlink, FIFO or socket)")
      try:
        # Read-write: NFS grants a kernel lock only on a file open for writing.
        theirs = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
      except FileNotFoundError:
        continue
      except OSError as e:
        raise self._bad(f"cannot be opened ({e.strerror})") from e
      try:
        got = _kernel_lock(theirs) if kernel else None
        if got is not None:
          try:
            now = os.stat(self.path)
          except FileNotFoundError:
            continue  # its holder released it while we waited for its lock: try again
          mine_now = os.fstat(theirs)
          if (now.st_dev, now.st_ino) != (mine_now.st_dev, mine_now.st_ino):
            continue  # replaced meanwhile: the lock of that old file means nothing now
        try:
          raw = _read(theirs)
        except OSError as e:
          raise self._bad(f"cannot be read ({e.strerror})") from e
        holder = _parse(raw)
        age = time.time() - os.fstat(theirs).st_mtime
        if got is False:  # held: by a live run, or by a run mid-takeover of a dead one's
          if (not holder or self._stale(holder, host, UNNAMED_GRACE_S)) and (
              time.monotonic() < deadline):
            time.sleep(0.02)
            continue
          raise self._in_use(holder, age, kernel_held=True)
        stale = self._stale(holder, host, age)
        if not stale:
          raise self._in_use(holder, age, kernel_held=False)
        if got is None:
          raise WorkdirInUse(
              f"{self.path} is a stale lock {stale}, but this filesystem has no kernel locks "
              "(flock), so taking it over could race another run; delete it if no run uses "
              f"{os.path.dirname(self.path)}, then run again")
        logging.warning("%s: taking over a stale lock %s", self.path, stale)
        os.rename(mine, self.path)  # we hold the old file's kernel lock: no one else renames
        return
      finally:
        os.close(theirs)

  def release(self) -> None:
    """Removes the lock (if it is still ours), then lets go of its kernel lock."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      ours, there = os.fstat(fd), os.stat(self.path)
      if (ours.st_dev, ours.st_ino) == (there.st_dev, there.st_ino):
        os.remove(self.path)  # before the kernel lock goes: a waiter then finds it gone
    except FileNotFoundError:
      pass
    finally:
      os.close(fd)

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()
