"""SIGTERM at every moment of the train binary's start-up and of a resume: exit 75 with one
line, nothing committed touched, and the resumed run ends where an uninterrupted one does.

The moments are the rows of jaxsys/bench/preemptions.py (run here through
`experiments.fault_injection --preemption`): each is hit deterministically, by a pause
point of `jaxsys.preemption` (JAXSYS_TEST_PAUSE_AT) or a line the binary logs; no sleep
decides where the signal lands.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxsys.bench import preemptions as fault_preemption
from jaxsys import preemption

pytestmark = pytest.mark.slow  # starts processes

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_sigterm_at_every_moment_of_start_up_and_resume_exits_75(small_corpus, tmp_path):
  """Every row of fault_preemption.POINTS (imports, flag parsing, after the config check,
  the set-up and compilation, the first step; of a resume: the set-up, the restore, after
  it, its first step): exit 75, the one line, no traceback, the checkpoint byte for byte
  as it was and the lock released; then the run goes on to the uninterrupted run's losses
  exactly (each checked by the binary; its record checked again here)."""
  report = tmp_path / "preemption.json"
  proc = subprocess.run([sys.executable, "-m", "experiments.fault_injection",
                         f"--workdir={tmp_path / 'runs'}", "--preemption",
                         f"--data_source={small_corpus}", f"--json={report}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=900)
  print(proc.stdout)  # the table, with pytest -s
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
  result = json.loads(report.read_text())
  assert result["problems"] == [] and len(result["rows"]) == len(fault_preemption.POINTS)
  for row, point in zip(result["rows"], fault_preemption.POINTS):
    assert row["exit"] == preemption.EXIT_CODE and not row["traceback"], row
    if point.pause_at:  # paused before the first step: never at a step
      assert row["line"] == preemption.LINE, row
  assert [s for s, _ in result["losses"]] == [1, 2, 3, 4]


_STUCK = textwrap.dedent("""
    import ctypes, signal
    from jaxsys import preemption
    preemption.install(grace_s=1.0)
    signal.signal(signal.SIGTERM, lambda *a: preemption.stop_now())  # as the loop's, before a step
    print("ready", flush=True)
    # glibc's system() waits for its child in C, retrying on EINTR: Python runs no signal
    # handler until it returns, like a main thread in a long XLA compile.
    ctypes.CDLL(None).system(b"sleep 30")
    print("returned", flush=True)
""")


def test_a_main_thread_stuck_in_a_call_still_exits_75_within_the_grace(tmp_path):
  proc = subprocess.Popen([sys.executable, "-c", _STUCK], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)
  assert proc.stdout.readline().strip() == "ready"
  time.sleep(0.2)  # into system(): a signal before it is handled at once, as it should be
  t0 = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  proc.wait(timeout=60)
  took = time.monotonic() - t0
  os.killpg(proc.pid, signal.SIGKILL)  # system()'s shell and `sleep 30`, holding the pipes
  stdout, stderr = proc.communicate(timeout=60)
  assert proc.returncode == preemption.EXIT_CODE, stderr
  assert stdout.strip() == preemption.LINE and 0.9 < took < 20, (stdout, took)  # the grace: 1 s
