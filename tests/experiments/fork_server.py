"""Runs of the train binary forked on demand from one start-up.

  with fork_server.Server(directory) as server:
    proc = server.run(argv)  # a subprocess.CompletedProcess
    child = server.start(argv, env={"JAX_PROCESS_ID": "1"})  # poll, send_signal, communicate

tests/experiments/forked_cli.py takes every command line at once and runs them one after
the other; here a test sends each when it is ready for it (after it damaged, copied or
checked a workdir), and runs may overlap (the processes of a multi-process run). One
process imports what experiments.train imports (jax, orbax, jaxsys: ~2.5 s of CPU a
start) and forks a child per command line, which runs it as forked_cli's children do
(its flags parsed there, its status the binary's exit status; `file_limit`: RLIMIT_FSIZE,
as on a full disk). `env` is set in the child before jax starts its backends (XLA_FLAGS'
device count, jax.distributed's variables). `unprivileged`: the child first gives up every
capability, as `setpriv --inh-caps=-all --bounding-set=-all` leaves a process (chmod 000
then stops root too). Left out, as in forked_cli: the binary's re-exec with huge pages.
Runs not waited for when the block ends are killed.
"""
import ctypes
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import forked_cli  # its children's way of running a command line

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULE = "experiments.train"


def _drop_capabilities() -> None:
  libc = ctypes.CDLL(None, use_errno=True)
  for cap in range(64):  # the bounding set: none regained by an exec (EINVAL past the last)
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
  header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
  if libc.capset(header, (ctypes.c_uint32 * 6)()):  # effective, permitted, inheritable: none
    raise OSError(ctypes.get_errno(), "capset failed")


def _start(case: dict, replies: int) -> tuple[int, list[threading.Thread]]:
  """Forks the child of `case`; (its pid, the threads copying its output into files)."""

  def before() -> None:
    # Not the server's pipes: with a child holding them, the client would wait for ever on
    # a server that died.
    os.close(replies)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.update(case["env"])
    if case["unprivileged"]:
      _drop_capabilities()

  return forked_cli.fork(MODULE, case, before)


def main() -> None:
  """The server: a request a line on stdin ({"start": case} or {"poll": pid}), the reply a
  line on stdout (the child's pid; its exit status once it ended, else null)."""
  replies = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # what the imports print goes to stderr, not into the replies
  import jaxsys.cli.train  # pylint: disable=import-outside-toplevel,unused-import
  print("ready", file=replies, flush=True)
  copying = {}
  for line in sys.stdin:
    request = json.loads(line)
    if "start" in request:
      pid, copying[pid] = _start(request["start"], replies.fileno())
      reply = pid
    else:
      pid, status = os.waitpid(request["poll"], os.WNOHANG)
      reply = None
      if pid:
        for copy in copying.pop(pid):  # its output, all of it in the files
          copy.join()
        reply = os.waitstatus_to_exitcode(status)
    print(json.dumps(reply), file=replies, flush=True)
  for pid, copies in copying.items():  # the client is gone: a run it left (a test failed) ends
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    for copy in copies:
      copy.join()


class Child:
  """A forked run, used as a subprocess.Popen is (poll, send_signal, wait, communicate)."""

  def __init__(self, server: "Server", pid: int, case: dict):
    self.pid, self.args, self.returncode = pid, [MODULE, *case["argv"]], None
    self._server, self._case = server, case

  def poll(self) -> int | None:
    if self.returncode is None:
      self.returncode = self._server._ask({"poll": self.pid})  # pylint: disable=protected-access
    return self.returncode

  def send_signal(self, sig: int) -> None:
    if self.poll() is None:
      os.kill(self.pid, sig)

  def wait(self, timeout: float | None = None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      if deadline is not None and time.monotonic() > deadline:
        raise subprocess.TimeoutExpired(self.args, timeout)
      time.sleep(0.1)
    return self.returncode

  def communicate(self, timeout: float | None = None) -> tuple[str, str]:
    """(stdout, stderr) once it ended; stderr begins with what the server's imports printed,
    as a process's with what its own did."""
    self.wait(timeout)
    return (pathlib.Path(self._case["stdout"]).read_text(),
            self._server.imports_err + pathlib.Path(self._case["stderr"]).read_text())


class Server:
  """The client: `start` forks a run, `run` forks one and waits for it."""

  def __init__(self, directory):
    self._dir = pathlib.Path(directory)
    self._dir.mkdir(parents=True, exist_ok=True)
    self._lock = threading.Lock()
    self._runs = 0
    with open(self._dir / "server.err", "w", encoding="utf-8") as err:
      self._proc = subprocess.Popen([sys.executable, __file__], cwd=ROOT, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    ready = self._proc.stdout.readline().strip()
    self.imports_err = (self._dir / "server.err").read_text()
    assert ready == "ready", self.imports_err[-3000:]

  def _ask(self, request: dict):
    with self._lock:
      self._proc.stdin.write(json.dumps(request) + "\n")
      self._proc.stdin.flush()
      reply = self._proc.stdout.readline()
    assert reply, "the fork server died: " + (self._dir / "server.err").read_text()[-3000:]
    return json.loads(reply)

  def start(self, argv, *, env: dict[str, str] | None = None, file_limit: int | None = None,
            unprivileged: bool = False) -> Child:
    """`python -m experiments.train *argv` begun, with `env` added to the environment."""
    with self._lock:
      n, self._runs = self._runs, self._runs + 1
    case = {"argv": [str(a) for a in argv], "env": env or {},
            "stdout": str(self._dir / f"{n}.out"), "stderr": str(self._dir / f"{n}.err"),
            "file_limit": file_limit, "unprivileged": unprivileged}
    return Child(self, self._ask({"start": case}), case)

  def run(self, argv, *, timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`start`, then its end: exit status, stdout and stderr."""
    child = self.start(argv, **kwargs)
    stdout, stderr = child.communicate(timeout)
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)

  def close(self) -> None:
    try:
      self._proc.stdin.close()
    except BrokenPipeError:  # it died: said below
      pass
    assert self._proc.wait(timeout=60) == 0, (self._dir / "server.err").read_text()[-3000:]

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


if __name__ == "__main__":
  main()
