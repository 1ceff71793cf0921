"""Failures to write a run's files (a full disk, a quota, a file-size limit) as one line.

Python reports them as an OSError; tensorstore (orbax's array writes) as a ValueError whose
text ends `No space left on device [os_error_code='28']`, raised and logged once per array
piece. A `WriteError` is one line: what was being written, the system's reason and what
is left; the binaries print it as their `error:` line.

Example:
  try:
    f.write(row)
  except OSError as e:
    raise WriteError(f"writing {path}", e) from e
  # str(): "writing /w/metrics.jsonl failed: No space left on device (errno 28)"
"""
from __future__ import annotations

import errno
import os
import re

# A full device, a quota or a file-size limit (RLIMIT_FSIZE): freeing space is the remedy.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_TENSORSTORE_CODE = re.compile(r"\[os_error_code='(\d+)'\]")


def os_errno(error: BaseException | None) -> int | None:
  """The OS error code behind `error`, or behind an error it was raised from; else None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno is not None:
      return error.errno
    match = _TENSORSTORE_CODE.search(str(error))
    if match:
      return int(match[1])
    error = error.__cause__ or error.__context__
  return None


class WriteError(OSError):
  """Writing `what` failed for a reason of the OS (`error`'s); str() is one line:
  "<what> failed: <reason> (errno N)[; <after>]"."""

  def __init__(self, what: str, error: BaseException, after: str = ""):
    code = os_errno(error)
    reason = (f"{os.strerror(code)} (errno {code})" if code is not None
              else str(error).strip().splitlines()[0][:300])
    super().__init__(code, reason)
    self.message = f"{what} failed: {reason}" + (f"; {after}" if after else "")

  def __str__(self) -> str:
    return self.message
