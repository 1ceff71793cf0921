"""jaxsys.hugepages: the re-exec that turns on huge-page malloc, once, and its opt-outs."""
import os
import subprocess
import sys

import pytest

from jaxsys import hugepages

_PRINT_AFTER_REEXEC = ("import os; from jaxsys import hugepages; "
                       "print('started', flush=True); hugepages.reexec_with_huge_pages(); "
                       "print('tunables', os.environ.get('GLIBC_TUNABLES', ''))")


def _run(**env):
  base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hugepages.OPT_OUT)}
  out = subprocess.run([sys.executable, "-c", _PRINT_AFTER_REEXEC], env={**base, **env},
                       capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
  starts = out.count("started")
  return starts, out[-2].removeprefix("tunables ")


@pytest.mark.skipif(not hugepages.supported(), reason="needs Linux, glibc >= 2.35 and THP")
def test_reexecs_once_with_the_tunable_added():
  starts, tunables = _run()
  assert starts == 2  # the command ran again, once
  assert tunables == "glibc.malloc.hugetlb=1"
  starts, tunables = _run(GLIBC_TUNABLES="glibc.malloc.arena_max=2")
  assert (starts, tunables) == (2, "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")


def test_opt_out_and_an_explicit_value_are_kept():
  assert _run(JAXSYS_HUGE_PAGES="0") == (1, "")
  assert _run(GLIBC_TUNABLES="glibc.malloc.hugetlb=0") == (1, "glibc.malloc.hugetlb=0")
