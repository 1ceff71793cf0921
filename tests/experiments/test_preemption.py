"""SIGTERM at every moment of the train binary's start-up and of a resume: exit 75 with one
line, nothing committed touched, and the resumed run ends where an uninterrupted one does.

Each moment is hit deterministically: the binary pauses there when JAXSYS_TEST_PAUSE_AT
names it and says so on stderr (`jaxsys.preemption.pause_point`), or the test waits for a
line the binary logs; no sleep decides where the signal lands.
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

from jaxsys import preemption
from jaxsys.checkpoint import integrity
from jaxsys.checkpoint.manager import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The schedule's length is fixed, so a run to step 2 resumed to step 4 trains as a run to 4.
_FLAGS = ("--config.checkpoint_every=2", "--config.optimizer.schedule_steps=16",
          "--config.optimizer.warmup_steps=1", "--config.log_every=1", "--config.eval_every=0",
          "--config.data.num_threads=0")
LINE = preemption.LINE


def _cmd(workdir, source, steps):
  return [sys.executable, "-m", "experiments.train", "--config=configs/tiny_lm.py:size=test",
          f"--config.data.source={source}", f"--workdir={workdir}",
          f"--config.total_steps={steps}", *_FLAGS]


def _run(workdir, source, steps):
  proc = subprocess.run(_cmd(workdir, source, steps), cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _preempt(workdir, source, steps, *, pause_at=None, after_line=None):
  """Starts the binary, SIGTERMs it once it paused at `pause_at` (or logged a line
  containing `after_line`); (exit status, stdout, stderr, seconds from signal to exit)."""
  env = dict(os.environ)
  if pause_at:
    env[preemption.TEST_PAUSE] = pause_at
  proc = subprocess.Popen(_cmd(workdir, source, steps), cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  wanted = f"paused at {pause_at}" if pause_at else after_line
  seen = []
  for line in proc.stderr:
    seen.append(line)
    if wanted in line:
      break
  else:
    proc.wait(timeout=60)
    pytest.fail(f"exited {proc.returncode} before {wanted!r}: {''.join(seen)[-3000:]}")
  proc.send_signal(signal.SIGTERM)
  t0 = time.monotonic()
  stdout, stderr = proc.communicate(timeout=120)
  return proc.returncode, stdout, "".join(seen) + stderr, time.monotonic() - t0


def _losses(workdir):
  rows = (json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines())
  return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _assert_preempted_before_the_first_step(code, stdout, stderr):
  assert code == preemption.EXIT_CODE, stderr[-3000:]
  assert stdout.strip() == LINE, stdout
  assert "Traceback" not in stderr, stderr[-3000:]


# Start-up of a fresh workdir, then of a resume (a checkpoint at step 2): each moment a
# pause point names, in the order the binary reaches them.
FRESH = ["imports", "flags", "set_up", "first_step"]
RESUME = ["set_up", "restore", "first_step"]


def test_sigterm_at_every_moment_of_start_up_and_resume_exits_75(small_corpus, tmp_path):
  """At every moment of start-up (imports, flag parsing, the set-up and compilation, the
  first step) and of a resume (the restore, the first step after it): exit 75, the one
  line, no traceback, the checkpoint untouched and the lock released. The run then goes
  on to the same losses as an uninterrupted run, bit for bit."""
  reference = tmp_path / "reference"
  _run(reference, small_corpus, 4)
  workdir = tmp_path / "run"
  codes = {}
  for point in FRESH:
    code, stdout, stderr, took = _preempt(workdir, small_corpus, 4, pause_at=point)
    codes[f"fresh: {point}"] = code
    _assert_preempted_before_the_first_step(code, stdout, stderr)
    assert not (workdir / "checkpoints").exists() or not os.listdir(workdir / "checkpoints")
    assert not (workdir / "run.lock").exists()
  # A moment no pause point marks: right after the config was logged (the binary may be
  # anywhere after it when the signal lands; it is before the first step or at it).
  code, stdout, stderr, _ = _preempt(workdir, small_corpus, 4, after_line="config:")
  codes["fresh: after the config line"] = code
  assert code == preemption.EXIT_CODE and "Traceback" not in stderr, stderr[-3000:]
  assert stdout.strip() == LINE or stdout.startswith("preempted at step "), stdout
  if (workdir / "checkpoints").exists():  # at a step: it saved that step; start again clean
    import shutil
    shutil.rmtree(workdir)
  _run(workdir, small_corpus, 2)
  saved = workdir / "checkpoints" / "2"
  before = {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()}
  for point in RESUME:
    code, stdout, stderr, _ = _preempt(workdir, small_corpus, 4, pause_at=point)
    codes[f"resume: {point}"] = code
    _assert_preempted_before_the_first_step(code, stdout, stderr)
    if point != "set_up":
      assert f"resumed from {workdir / 'checkpoints'} at step 2" in stderr or point == "restore"
    assert Checkpointer(str(workdir / "checkpoints")).all_steps() == [2]
    assert {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()} == before
    assert integrity.problem(str(saved)) is None
    assert not (workdir / "run.lock").exists()
  code, stdout, stderr, _ = _preempt(workdir, small_corpus, 4, after_line="resumed from")
  codes["resume: after the resumed line"] = code
  assert code == preemption.EXIT_CODE and "Traceback" not in stderr, stderr[-3000:]
  print(codes)
  _run(workdir, small_corpus, 4)
  assert _losses(workdir) == _losses(reference) and [s for s, _ in _losses(workdir)] == [1, 2, 3, 4]


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
  assert stdout.strip() == LINE and 0.9 < took < 20, (stdout, took)  # the grace: 1 s
