"""Tests for jaxsys.checkpoint.lock: one run per workdir, across real processes."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from jaxsys.checkpoint import lock

# Takes the lock in another process and reports: "held" (then waits for stdin to close)
# or the error line.
_OTHER = textwrap.dedent("""
    import sys
    from jaxsys.checkpoint import lock
    try:
      with lock.WorkdirLock(sys.argv[1]):
        print("held", flush=True)
        sys.stdin.read()
    except lock.WorkdirInUse as e:
      print(f"refused: {e}", flush=True)
""")


def _other(workdir, **kw):
  return subprocess.Popen([sys.executable, "-c", _OTHER, str(workdir)], text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, **kw)


def test_a_second_run_is_refused_in_one_line(tmp_path):
  with lock.WorkdirLock(tmp_path) as held:
    holder = json.loads(open(held.path).read())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    out, _ = _other(tmp_path).communicate(timeout=60)
  line = out.strip()
  assert line.startswith(f"refused: workdir {tmp_path} is in use by pid {os.getpid()} on host "
                         f"{socket.gethostname()} since ")
  assert "\n" not in line and "another --workdir" in line
  assert not (tmp_path / lock.LOCK_NAME).exists()  # released on exit


def test_the_lock_of_a_live_process_holds_and_is_released(tmp_path):
  proc = _other(tmp_path)
  assert proc.stdout.readline().strip() == "held"
  with pytest.raises(lock.WorkdirInUse, match=f"in use by pid {proc.pid}"):
    lock.WorkdirLock(tmp_path).acquire()
  proc.communicate("", timeout=60)  # closes its stdin: it releases and exits
  with lock.WorkdirLock(tmp_path):
    pass


class _Signalled(BaseException):
  """What SIGTERM raises mid-acquire (as preemption.Preempted does)."""


@pytest.mark.parametrize("over_a_stale_lock", [False, True])
def test_a_signal_mid_acquire_leaves_no_lock(tmp_path, monkeypatch, over_a_stale_lock):
  """SIGTERM's exception right after the lock file appears at its path (the link, or the
  rename over a stale lock) unwinds with no lock of ours left: __exit__ never runs for an
  __enter__ that raised (CI saw 'run.lock remains' after a SIGTERM at start-up)."""
  path = tmp_path / lock.LOCK_NAME
  if over_a_stale_lock:
    path.write_text(json.dumps({"pid": 2**22 + 7, "host": socket.gethostname(), "started": 0}))
  real = os.rename if over_a_stale_lock else os.link

  def then_signalled(src, dst):
    real(src, dst)
    raise _Signalled()
  monkeypatch.setattr(os, "rename" if over_a_stale_lock else "link", then_signalled)
  with pytest.raises(_Signalled):
    with lock.WorkdirLock(tmp_path):
      pass
  assert not path.exists() and not list(tmp_path.glob("*.tmp"))
  monkeypatch.undo()
  with lock.WorkdirLock(tmp_path):  # and the next run takes it
    assert path.exists()


def test_a_stale_lock_is_taken_over(tmp_path):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  pid = int(dead.stdout)
  path = tmp_path / lock.LOCK_NAME
  path.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": 0}))
  with lock.WorkdirLock(tmp_path) as held:
    assert json.loads(path.read_text())["pid"] == os.getpid() == json.loads(
        open(held.path).read())["pid"]


def test_another_hosts_lock_is_never_taken_over(tmp_path):
  (tmp_path / lock.LOCK_NAME).write_text(json.dumps(
      {"pid": 1, "host": "elsewhere.example", "started": 0}))
  with pytest.raises(lock.WorkdirInUse, match="pid 1 on host elsewhere.example"):
    lock.WorkdirLock(tmp_path).acquire()
  assert (tmp_path / lock.LOCK_NAME).exists()


@pytest.mark.parametrize("content", ["", "garbage{", "[1, 2]", '{"host": "h"}'])
def test_a_lock_naming_no_holder_is_taken_over_once_old(tmp_path, content):
  """Never written by a run (its locks appear whole): refused while another writer could
  still be filling it, taken over once `UNNAMED_GRACE_S` old."""
  path = tmp_path / lock.LOCK_NAME
  path.write_text(content)
  with pytest.raises(lock.WorkdirInUse, match="names no holder .* less than 10 s ago"):
    lock.WorkdirLock(tmp_path).acquire()
  old = os.stat(path).st_mtime - lock.UNNAMED_GRACE_S
  os.utime(path, (old, old))
  with lock.WorkdirLock(tmp_path):
    assert json.loads(path.read_text())["pid"] == os.getpid()
  assert not path.exists()
