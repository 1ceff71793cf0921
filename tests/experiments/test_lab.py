"""The network lab for real: two processes over a shaped link, and its cleanup on failure.

Needs root and iproute2 (`ip`, `tc`), as CI's machine has; skipped where they are missing.
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxsys.lab import link, physics, run

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow,  # starts processes
              pytest.mark.skipif(bool(link.missing_privileges()),
                                 reason=f"the lab needs {link.missing_privileges()}")]


def _args(workdir, *extra):
  return ("--config=configs/tiny_lm.py:size=test", "--config.mesh=data=2",
          "--config.total_steps=3", "--config.log_every=1", "--config.eval_every=0",
          "--config.checkpoint_every=0", "--config.data.num_threads=0", *extra,
          f"--workdir={workdir}")


def _ours() -> tuple[list[str], list[int]]:
  """The lab namespaces left on this machine, and live processes started by this test
  process's lab runs (their environment names JAX_COORDINATOR_ADDRESS and a lab log)."""
  left = [ns for ns in link.namespaces() if ns.startswith("jaxsys-lab-")]
  procs = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      env = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
      status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
      continue
    if b"JAXSYS_LAB_TEST=" + str(os.getpid()).encode() in env and "State:\tZ" not in status:
      procs.append(int(pid))
  return left, procs


@pytest.fixture(autouse=True)
def _tagged(monkeypatch):
  monkeypatch.setenv("JAXSYS_LAB_TEST", str(os.getpid()))  # inherited by every process
  monkeypatch.chdir(ROOT)
  yield
  assert _ours() == ([], []), "a lab run left a namespace or a process behind"


def test_a_slower_link_costs_what_its_bytes_predict(tmp_path):
  """3 steps at two rates on the shared link, and at the slower rate on a link a process:
  the slower link's extra step time is its extra wire time for the compiled all-reduce's
  bytes, and the shared link's extra over the switched one is the other process's share
  through the same bucket (differences of two timings, so the compute, and any load on the
  machine, cancel); the wire carries those bytes plus their headers."""
  slow, fast = 10e6, 40e6
  runs = {"slow": (slow, "shared"), "fast": (fast, "shared"), "switched": (slow, "switched")}
  s = {name: run.run_lab(run.LabConfig(processes=2, bandwidth=f"{int(bw / 1e6)}mbit",
                                       runner_args=_args(tmp_path / name), topology=topology),
                         echo=False)
       for name, (bw, topology) in runs.items()}
  payload = s["slow"]["collective_bytes_per_step"]
  assert payload == s["fast"]["collective_bytes_per_step"] > 400_000  # gradients, 2 processes
  for summary in s.values():
    # TCP's payload within 10% of what the compiled collectives send (gloo adds its framing,
    # the coordinator its keep-alives); all the bytes within 10% of payload + headers.
    assert summary["wire_payload_bytes_per_step"] == pytest.approx(payload, rel=0.1)
    assert summary["wire_bytes_per_step"] == pytest.approx(physics.wire_bytes(payload), rel=0.1)
    assert summary["shaper"]["drops"] == 0
  wire_s = physics.wire_bytes(payload) * 8  # bit-seconds of the whole payload
  slower = s["slow"]["step_time_s"] - s["fast"]["step_time_s"]
  assert slower == pytest.approx(wire_s * (1 / slow - 1 / fast), rel=0.35)  # ~0.54 s
  shared = s["slow"]["step_time_s"] - s["switched"]["step_time_s"]
  switched_wire_s = physics.wire_bytes(physics.link_payload(payload, 2, "switched")) * 8
  assert shared == pytest.approx((wire_s - switched_wire_s) / slow, rel=0.35)  # ~0.36 s
  steps = [json.loads(l) for l in (tmp_path / "slow" / "lab/steps.jsonl").open()]
  assert [r["step"] for r in steps] == [2, 3]
  # The link holds each step for at least most of its payload's wire time (load on the
  # machine only adds to a step's compute, so no share of the step is asserted).
  assert all(r["comm_s"] > 0.5 * wire_s / slow for r in steps)


def _lab(workdir, *extra, bandwidth="20mbit", processes=2):
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.lab", f"--processes={processes}",
       f"--bandwidth={bandwidth}", "--", *_args(workdir, *extra)],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _error_line(proc, timeout=240):
  out, err = proc.communicate(timeout=timeout)
  assert proc.returncode == 1, err[-2000:]
  assert out == ""
  return err.strip().splitlines()[-1]


def test_a_process_that_fails_stops_the_run_and_is_named(tmp_path):
  # The runner refuses its config in every process: the lab names the first and its line.
  # Either may exit first: both refuse it.
  line = _error_line(_lab(tmp_path, "--config.optimizer.learning_rate=-1"))
  found = re.match(r"error: process ([01]) of 2 exited with code 1 \(error: ", line)
  assert found, line
  assert "optimizer.learning_rate" in line and f"process_{found.group(1)}.log" in line


def _wait_for_steps(workdir, timeout=180):
  deadline = time.monotonic() + timeout
  metrics = pathlib.Path(workdir) / "metrics.jsonl"
  while time.monotonic() < deadline:
    if metrics.exists() and metrics.read_text().count('"loss"') >= 1:
      return
    time.sleep(0.2)
  raise AssertionError("the run logged no step")


def test_a_killed_process_and_a_stopped_lab_leave_nothing(tmp_path):
  long_run = ("--config.total_steps=100000",)
  proc = _lab(tmp_path / "kill", *long_run)
  _wait_for_steps(tmp_path / "kill")
  _, pids = _ours()
  victim = next(p for p in pids if b"JAX_PROCESS_ID=1\0" in
                pathlib.Path(f"/proc/{p}/environ").read_bytes()
                and b"jaxsys.cli.train" in pathlib.Path(f"/proc/{p}/cmdline").read_bytes())
  os.kill(victim, signal.SIGKILL)
  line = _error_line(proc)
  assert line.startswith("error: process 1 of 2 exited with signal SIGKILL"), line
  assert _ours() == ([], [])

  proc = _lab(tmp_path / "term", *long_run)
  _wait_for_steps(tmp_path / "term")
  proc.send_signal(signal.SIGTERM)
  assert _error_line(proc) == ("error: stopped by SIGTERM; the namespace and every process "
                               "are removed")


def test_the_binary_refuses_bad_input_in_one_line(tmp_path):
  for flags, message in [(["--processes=1"], "--processes=1: "),
                         (["--bandwidth=10mbs"], "--bandwidth='10mbs' is not a rate")]:
    proc = subprocess.run([sys.executable, "-m", "experiments.lab", *flags, "--",
                           *_args(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith(f"error: {message}")
  assert not (tmp_path / "lab").exists()
