"""WorkdirLock under a race: many processes taking over one stale lock at once; locks that
are not lock files; a filesystem without kernel locks.

The racers are plain Python processes (no jax), started once and driven round by round
through their pipes: each round the test writes a stale lock, every racer tries to take
it at one agreed moment, and the holders keep it until every racer has answered.
"""
import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jaxsys.checkpoint import lock

RACERS, ROUNDS = 8, 30  # 240 raced acquisitions

# One racer: "go T" -> at time T, try the lock; answer "held" or "refused: <line>";
# "release" -> release it if held, answer "released"; "exit" -> exit. argv[1]: the workdir,
# argv[2]: the lock module (another implementation can be raced the same way).
_RACER = textwrap.dedent("""
    import importlib, sys, time
    module = importlib.import_module(sys.argv[2])
    held = None
    for line in sys.stdin:
      cmd = line.split()
      if cmd[0] == "go":
        time.sleep(max(0.0, float(cmd[1]) - time.time()))
        held = module.WorkdirLock(sys.argv[1])
        try:
          held.acquire()
          print("held", flush=True)
        except ValueError as e:
          held = None
          print(f"refused: {e}".replace("\\n", " "), flush=True)
      elif cmd[0] == "release":
        if held is not None:
          held.release()
          held = None
        print("released", flush=True)
      else:
        break
""")


def _dead_pid() -> int:
  proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  return int(proc.stdout)


def race(workdir, module: str = "jaxsys.checkpoint.lock", racers: int = RACERS,
         rounds: int = ROUNDS) -> list[list[str]]:
  """Each round's answers: `racers` processes taking over one stale lock at once."""
  procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(workdir), module], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
           for _ in range(racers)]
  path = os.path.join(workdir, lock.LOCK_NAME)
  stale = json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": 0})
  answers = []
  try:
    for _ in range(rounds):
      with open(path, "w", encoding="utf-8") as f:
        f.write(stale)
      start = time.time() + 0.05  # every racer asleep until then: they start together
      for p in procs:
        p.stdin.write(f"go {start}\n")
        p.stdin.flush()
      answers.append([p.stdout.readline().strip() for p in procs])
      for p in procs:
        p.stdin.write("release\n")
        p.stdin.flush()
      assert all(p.stdout.readline().strip() == "released" for p in procs)
  finally:
    for p in procs:
      try:
        p.stdin.write("exit\n")
        p.stdin.close()
      except OSError:
        pass
      p.wait(timeout=60)
  return answers


def test_racers_over_a_stale_lock_never_both_hold(tmp_path):
  """8 processes taking over a dead run's lock at once, 30 times: exactly one holds it
  each time (the check-then-delete takeover gave two holders in 2 of 6 such races); every
  other is refused in one line naming the holder, and nothing is left behind."""
  t0 = time.monotonic()
  answers = race(tmp_path)
  holders = [sum(a == "held" for a in round_) for round_ in answers]
  print(f"{len(answers) * RACERS} raced acquisitions, holders per round {holders}, "
        f"{time.monotonic() - t0:.1f} s")
  assert holders == [1] * ROUNDS, answers
  for round_ in answers:
    for a in round_:
      assert a == "held" or (a.startswith(f"refused: workdir {tmp_path} is in use by pid ")
                             and "since" in a), round_
  assert os.listdir(tmp_path) == []  # each holder released; no racer's file left


@pytest.mark.parametrize("age_s", [0, 3600])
def test_a_lock_that_is_a_directory_is_refused_in_one_line(tmp_path, age_s):
  """Fresh or old, a directory is no lock any run wrote: refused, never taken over (it
  was an IsADirectoryError once 10 s old, and a promise of a takeover before)."""
  path = tmp_path / lock.LOCK_NAME
  (path / "inside").mkdir(parents=True)
  os.utime(path, (time.time() - age_s,) * 2)
  with pytest.raises(lock.BadLock) as e:
    lock.WorkdirLock(tmp_path).acquire()
  assert str(e.value) == (f"{path} is a directory, not a lock file a run writes; it must be a "
                          f"regular file this user can read and write: remove it if no run "
                          f"uses {tmp_path}, then run again")
  assert (path / "inside").is_dir() and sorted(os.listdir(tmp_path)) == [lock.LOCK_NAME]


@pytest.mark.parametrize("kind", ["fifo", "dangling symlink", "symlink to a file"])
def test_a_lock_that_is_not_a_regular_file_is_refused(tmp_path, kind):
  path = tmp_path / lock.LOCK_NAME
  if kind == "fifo":
    os.mkfifo(path)
  elif kind == "dangling symlink":
    os.symlink(tmp_path / "nowhere", path)
  else:
    (tmp_path / "target").write_text("{}")
    os.symlink(tmp_path / "target", path)
  with pytest.raises(lock.BadLock, match=r"is not a regular file \(a symlink, FIFO or socket\)"):
    lock.WorkdirLock(tmp_path).acquire()
  assert os.path.lexists(path)


def _without_root_powers() -> list[str]:
  """A command prefix: as root, the command runs without the capabilities that let root
  read any file (so a chmod 000 file is unreadable, as for any user)."""
  return ["setpriv", "--inh-caps=-all", "--bounding-set=-all"] if os.geteuid() == 0 else []


def test_an_unreadable_lock_file_is_refused_in_one_line(tmp_path):
  path = tmp_path / lock.LOCK_NAME
  path.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": 0}))
  path.chmod(0)
  code = textwrap.dedent("""
      import sys
      from jaxsys.checkpoint import lock
      try:
        lock.WorkdirLock(sys.argv[1]).acquire()
      except lock.BadLock as e:
        print(e)
  """)
  proc = subprocess.run([*_without_root_powers(), sys.executable, "-c", code, str(tmp_path)],
                        capture_output=True, text=True, timeout=60,
                        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
  assert proc.stdout.strip() == (
      f"{path} cannot be opened (Permission denied), not a lock file a run writes; it must be "
      f"a regular file this user can read and write: remove it if no run uses {tmp_path}, "
      "then run again"), proc.stderr
  assert proc.returncode == 0 and path.exists()


@pytest.fixture
def no_kernel_locks(monkeypatch):
  """A filesystem without flock (some NFS and FUSE mounts): ENOLCK."""
  def flock(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
  monkeypatch.setattr(lock.fcntl, "flock", flock)


def test_without_kernel_locks_a_free_workdir_is_taken_a_stale_lock_refused(
    tmp_path, no_kernel_locks):
  """The hard link alone is atomic: a free workdir is taken and released as before. A
  takeover is not, so a stale lock is refused in one line (the user deletes it)."""
  path = tmp_path / lock.LOCK_NAME
  with lock.WorkdirLock(tmp_path):
    assert json.loads(path.read_text())["pid"] == os.getpid()
    with pytest.raises(lock.WorkdirInUse, match=f"in use by pid {os.getpid()}"):
      lock.WorkdirLock(tmp_path).acquire()
  assert not path.exists()
  stale = json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": 0})
  path.write_text(stale)
  with pytest.raises(lock.WorkdirInUse) as e:
    lock.WorkdirLock(tmp_path).acquire()
  assert str(e.value).startswith(f"{path} is a stale lock of pid ")
  assert "this filesystem has no kernel locks (flock)" in str(e.value)
  assert path.read_text() == stale and os.listdir(tmp_path) == [lock.LOCK_NAME]


def test_a_live_process_named_without_a_kernel_lock_is_not_taken_over(tmp_path):
  """A lock naming a live process on this host whose kernel lock is free (a run of a
  version before the kernel lock, or a reused pid): refused, as before."""
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    path = tmp_path / lock.LOCK_NAME
    path.write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(),
                                "started": 0}))
    with pytest.raises(lock.WorkdirInUse, match=f"in use by pid {sleeper.pid} on host "):
      lock.WorkdirLock(tmp_path).acquire()
    assert json.loads(path.read_text())["pid"] == sleeper.pid
  finally:
    sleeper.kill()
    sleeper.wait()


def test_the_kernel_lock_is_held_for_the_runs_life(tmp_path):
  """While a run holds the workdir, another open file of run.lock cannot take its kernel
  lock; after the release the file is gone."""
  import fcntl
  with lock.WorkdirLock(tmp_path) as held:
    fd = os.open(held.path, os.O_RDWR)
    try:
      with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
      os.close(fd)
  assert not os.path.exists(held.path)
