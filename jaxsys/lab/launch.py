"""P runner processes joined by `jax.distributed`, started, watched and stopped together.

Each process gets its own process group (so a runner that re-executes itself, or starts
helpers, is stopped whole), its own core where there are enough (`taskset`), its own
log file, and the environment the runner reads to join the job (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID). When one process fails, the others are stopped.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

from jaxsys import xla_flags
from jaxsys.lab.link import LabError

COORDINATOR_PORT = 8476  # the namespace is new: nothing else listens there


def free_port() -> int:
  """A TCP port free on this host's loopback now (for a coordinator outside a namespace)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class Job:
  """The running processes of one lab run."""
  procs: list[subprocess.Popen]
  logs: list[str]

  def poll(self) -> bool:
    """True once every process exited 0; a LabError naming the first that failed."""
    codes = [p.poll() for p in self.procs]
    for i, code in enumerate(codes):
      if code not in (None, 0):
        raise LabError(f"process {i} of {len(self.procs)} exited with {_describe(code)}"
                       f"{_last_error(self.logs[i])}; the others were stopped (its log: "
                       f"{self.logs[i]})")
    return all(code == 0 for code in codes)

  def wait(self, timeout: float | None = None, interval: float = 0.1) -> None:
    """Returns when all exited 0; raises (after stopping the rest) when one failed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not self.poll():
      if deadline is not None and time.monotonic() > deadline:
        raise LabError(f"the run did not end within {timeout:.0f} s; stopped")
      time.sleep(interval)

  def stop(self, grace: float = 5.0) -> None:
    """SIGTERM to every process group still running, SIGKILL after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
      live = [p for p in self.procs if p.poll() is None]
      for p in live:
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass
      deadline = time.monotonic() + grace
      while any(p.poll() is None for p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in self.procs:  # reap, and kill what a process group left behind
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()


def _describe(code: int) -> str:
  if code < 0:
    return f"signal {signal.Signals(-code).name}"
  return f"code {code}"


def _last_error(log: str) -> str:
  """': <its last error: line>' from a process's log, if it wrote one."""
  try:
    with open(log, errors="replace") as f:
      lines = [l.strip() for l in f if l.startswith("error:")]
  except OSError:
    return ""
  return f" ({lines[-1]})" if lines else ""


def start(argv: list[str], *, processes: int, devices_per_process: int, log_dir: str,
          prefix: Callable[[int], list[str]] = lambda i: [], host: str = "127.0.0.1",
          port: int = COORDINATOR_PORT, extra_env: dict[str, str] | None = None,
          first_env: dict[str, str] | None = None) -> Job:
  """Starts `processes` copies of `python argv...`, process i behind `prefix(i)` (e.g.
  `ip netns exec NS`) and on core i where there are enough; logs to
  `log_dir/process_<i>.log`; the coordinator (process 0) at `host:port`. `first_env` is
  added to process 0's environment only."""
  os.makedirs(log_dir, exist_ok=True)
  cores = sorted(os.sched_getaffinity(0))
  pin = len(cores) >= processes
  procs, logs = [], []
  try:
    for i in range(processes):
      env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"{host}:{port}",
                 JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i),
                 XLA_FLAGS=xla_flags.with_cpu_devices(devices_per_process))
      env.update(extra_env or {}, **((first_env or {}) if i == 0 else {}))
      cmd = [*prefix(i), *(["taskset", "-c", str(cores[i])] if pin else []), sys.executable,
             *argv]
      logs.append(os.path.join(log_dir, f"process_{i}.log"))
      with open(logs[-1], "w") as log:
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True))
  except BaseException:
    Job(procs, logs).stop()
    raise
  return Job(procs, logs)
