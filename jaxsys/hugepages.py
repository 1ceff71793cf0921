"""Transparent huge pages for glibc's malloc, by re-executing a binary once at its start.

XLA:CPU allocates a step's buffers with malloc, which maps every allocation above 32 MiB
with mmap in 4 KiB pages and unmaps it when the step ends. At 100M parameters that
unmapping holds the process's mmap lock for ~200 ms after each step, and any thread that
maps memory meanwhile waits: an asynchronous checkpoint save, which starts threads, then
blocks the training loop that long. glibc's `glibc.malloc.hugetlb=1` tunable advises
those mappings into 2 MiB transparent huge pages: the unmapping takes a few ms and the step
itself runs ~30% faster (`experiments/bench_checkpoint.py` measures both). glibc reads
tunables only at process start, hence the re-exec; the pid stays the same.

`JAXSYS_HUGE_PAGES=0` opts out; a GLIBC_TUNABLES that already names the tunable is kept.
"""
from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "JAXSYS_HUGE_PAGES"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def supported() -> bool:
  """Linux with glibc >= 2.35 (the tunable's first release) and THP not `never`."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    with open(_THP_MODE, encoding="ascii") as f:
      thp = f.read()
  except (ValueError, OSError, AttributeError):
    return False
  major, minor = (int(x) for x in version.split(".")[:2])
  return name == "glibc" and (major, minor) >= (2, 35) and "[never]" not in thp


def enabled() -> bool:
  """Whether this process runs with huge-page malloc."""
  return f"{TUNABLE}=1" in os.environ.get("GLIBC_TUNABLES", "").split(":")


def reexec_with_huge_pages() -> None:
  """Replaces this process by the same command with `glibc.malloc.hugetlb=1`, unless it has
  it (or another value of it) already, the user opted out, or the host cannot use it. Call
  it first thing in a binary: the work done before it is done again."""
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  if (os.environ.get(OPT_OUT) == "0" or TUNABLE in tunables or not supported()
      or not sys.executable or not getattr(sys, "orig_argv", None)):
    return
  os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [tunables, f"{TUNABLE}=1"]))
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
