"""RAM snapshots (checkpoint.snapshot_every=N): a process killed with SIGKILL loses at most
2N steps (those since the last snapshot began, and the one save still in flight), and
resumes exactly."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxsys.checkpoint import integrity
from jaxsys.checkpoint.manager import Checkpointer, snapshot_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cmd(workdir, source, *flags):
  return [sys.executable, "-m", "experiments.train", "--config=configs/tiny_lm.py:size=test",
          f"--config.data.source={source}", "--config.data.num_threads=0", f"--workdir={workdir}",
          "--config.eval_every=0", "--config.log_every=1", "--config.optimizer.schedule_steps=40",
          "--config.optimizer.warmup_steps=2",
          *flags]


def _losses(workdir):
  path = pathlib.Path(workdir) / "metrics.jsonl"
  rows = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_snapshot_dir_is_per_workdir(tmp_path):
  a, b = snapshot_dir(str(tmp_path / "a")), snapshot_dir(str(tmp_path / "b"))
  assert a != b and a == snapshot_dir(str(tmp_path / "a" / ".." / "a"))
  assert snapshot_dir("w", str(tmp_path / "ram")) == str(tmp_path / "ram")


@pytest.mark.slow
def test_sigkill_loses_at_most_the_steps_since_the_last_snapshot(small_corpus, tmp_path):
  work, ram = tmp_path / "run", tmp_path / "ram"
  snap = [f"--config.checkpoint.snapshot_dir={ram}", "--config.checkpoint.snapshot_every=1",
          "--config.checkpoint_every=0"]  # disk: only at the end
  proc = subprocess.Popen(_cmd(work, small_corpus, "--config.total_steps=40", *snap), cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  deadline = time.monotonic() + 240
  while max(_losses(work), default=0) < 6:
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.05)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  logged = max(_losses(work))  # steps known done when it died
  assert Checkpointer(str(work / "checkpoints")).all_steps() == []  # nothing on disk yet
  steps = sorted(Checkpointer(str(ram)).all_steps())
  # The kill can land after snapshot k commits and before snapshot k-1 is deleted: then both
  # are there, and the newest is the one a resume must take.
  assert 1 <= len(steps) <= 2 and integrity.problem(str(ram / str(steps[-1]))) is None, steps
  # Snapshot k starts after step k is logged, once snapshot k-1 has committed: with N=1 the
  # kill can land after the log of L, before snapshot L starts, with L-1 still in flight.
  assert steps[-1] >= logged - 2, (steps, logged)

  proc = subprocess.run(_cmd(work, small_corpus, "--config.total_steps=10", *snap), cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"resumed from {ram} at step {steps[-1]}" in proc.stderr
  assert not ram.exists()  # saved to disk at the end: the RAM copy is freed
  straight = tmp_path / "straight"
  proc = subprocess.run(_cmd(straight, small_corpus, "--config.total_steps=10",
                             "--config.checkpoint_every=0"), cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  a, b = _losses(straight), _losses(work)
  assert sorted(b) == list(range(1, 11))
  np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-6)
