"""SIGTERM at any moment of a binary: exit 75 (EX_TEMPFAIL) with one line; run it again.

Schedulers preempt with SIGTERM, then SIGKILL after a grace period (SLURM's KillWait,
Kubernetes' terminationGracePeriodSeconds), and requeue a job that exits 75. Once the
training loop runs, it answers SIGTERM by saving the step and stopping (`jaxsys.train.loop`,
"preempted at step N"). Before its first step (imports, argument parsing, compilation, the
restore) there is nothing new to save, so the binary stops at once. `install()`, its first
line, makes SIGTERM print "preempted before the first step" and exit 75 right away while
nothing of a run exists yet (imports, flags, the config check). Inside the training
function (`jaxsys.train.loop`, until its first step is launched) SIGTERM raises `Preempted`
in the main thread instead, which unwinds (the workdir lock released, the checkpoints
closed: nothing committed is touched) to `exits_preempted()`, which prints the line and
exits 75 (`os._exit`: the interpreter's teardown under jax's threads can crash). Raised
where Python swallows it (a gc callback, a `__del__`), it is raised again from the next
line of the main thread.

A main thread inside a call that does not return to Python for long (an XLA compile, a
restore's read) is not waited for beyond `grace_s` (JAXSYS_PREEMPT_GRACE_S, 10 s): a
watchdog thread prints the line and exits 75 then, as a SIGKILL would end the process
(every write of a run survives a SIGKILL). With several processes, jax.distributed's
preemption service takes SIGTERM over when it starts (`jax.distributed.initialize`); the
loop then stops every process at one step. Not covered: the interpreter's own start-up
before the binary's first line (tens of ms of CPU), and its teardown after a finished run.

`pause_point(name)` marks a moment of start-up: with JAXSYS_TEST_PAUSE_AT=name the process
announces "paused at <name>" on stderr and waits there for a signal (tests preempt each
moment deterministically).

Example (a binary's first lines):
  with preemption.exits_preempted():
    preemption.install()
    import jax  # ... and everything else
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Iterator

EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL: stopped early by SIGTERM, run again to resume
LINE = ("preempted before the first step by SIGTERM (the checkpoints are as they were); run "
        "the same command again to resume")
GRACE_S = float(os.environ.get("JAXSYS_PREEMPT_GRACE_S", "10"))
TEST_PAUSE = "JAXSYS_TEST_PAUSE_AT"


class Preempted(BaseException):
  """SIGTERM before the first step: unwinds to the binary (a BaseException, like
  KeyboardInterrupt: no `except Exception` on the way swallows it)."""


_said = threading.Lock()
_unwinding = False  # Preempted raised and not swallowed: later SIGTERMs change nothing
_training = False  # the loop launched a step: SIGTERM saves and stops there, in its time
_watched = False  # install()'s watchdog runs


def _exit() -> None:
  """The line (once), then exit 75 without the interpreter's teardown."""
  if _said.acquire(blocking=False):
    print(LINE, flush=True)
  sys.stderr.flush()
  os._exit(EXIT_CODE)  # pylint: disable=protected-access


def install(grace_s: float = GRACE_S) -> None:
  """SIGTERM exits 75 from now on (see the module docstring), within `grace_s` even while
  the main thread is in a long call; a SIGTERM blocked across a re-exec
  (`blocked_across_exec`) arrives here."""
  global _watched
  signal.signal(signal.SIGTERM, _on_sigterm)
  if not _watched:
    # The watchdog learns of a SIGTERM from the signal's own handler (the wakeup fd), not
    # from Python code of the main thread, which may not run for minutes.
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_watchdog, args=(read, grace_s), daemon=True,
                     name="jaxsys-preemption").start()
    _watched = True
  signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _watchdog(fd: int, grace_s: float) -> None:
  while signal.SIGTERM not in os.read(fd, 512):
    pass
  if _training:
    return
  time.sleep(grace_s)
  if not _training:  # the main thread has not exited by itself: it is stuck in a call
    _exit()


def training_started() -> None:
  """From the loop's first launched step on, SIGTERM saves that step and stops."""
  global _training
  _training = True


def _on_sigterm(signum, frame) -> None:
  del signum, frame
  if not _training:  # after a run trained, its own outcome stands
    _exit()  # nothing of a run exists yet: nothing to unwind


def stop_now() -> None:
  """Raises `Preempted` (once: a later SIGTERM while it unwinds changes nothing)."""
  global _unwinding
  if _unwinding:
    return
  _unwinding = True
  raise Preempted()


def _unraisable(hook):
  """sys.unraisablehook: a `Preempted` that Python swallowed (raised in a gc callback or a
  `__del__`) is raised again, by the same signal, from the main thread's next line."""
  def unraisable(info):
    global _unwinding
    if isinstance(info.exc_value, Preempted):
      _unwinding = False
      signal.raise_signal(signal.SIGTERM)  # a handler raising Preempted must be in place
      return
    hook(info)
  return unraisable


sys.unraisablehook = _unraisable(sys.unraisablehook)


@contextlib.contextmanager
def exits_preempted() -> Iterator[None]:
  """`Preempted` inside: its one line, then exit 75."""
  try:
    yield
  except Preempted:
    _exit()


@contextlib.contextmanager
def blocked_across_exec() -> Iterator[None]:
  """SIGTERM held back around an exec (the signal mask and a pending signal survive it):
  the new image's `install()` receives it. Released here if no exec happened."""
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def pause_point(name: str) -> None:
  """A named moment of start-up; see the module docstring (JAXSYS_TEST_PAUSE_AT)."""
  if os.environ.get(TEST_PAUSE) == name:
    print(f"paused at {name}", file=sys.stderr, flush=True)
    time.sleep(600)  # a signal ends it (SIGTERM: Preempted)
