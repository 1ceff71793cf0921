"""The lab without root: --bandwidth=none on the host's loopback, no byte counts."""
import pathlib

import pytest

from jaxsys.lab import link, run

pytestmark = pytest.mark.slow  # starts processes or trains end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_unprivileged_runs_unshaped_without_counters(tmp_path, monkeypatch):
  monkeypatch.setattr(link, "missing_privileges", lambda: ["root (this process runs as uid 7)"])
  monkeypatch.chdir(ROOT)
  args = ("--config=configs/tiny_lm.py:size=test", "--config.mesh=data=2",
          "--config.total_steps=3", "--config.log_every=1", "--config.eval_every=0",
          "--config.checkpoint_every=0", "--config.data.num_threads=0", f"--workdir={tmp_path}")
  with pytest.raises(link.LabError, match="needs root"):
    run.run_lab(run.LabConfig(processes=2, bandwidth="10mbit", runner_args=args), echo=False)
  s = run.run_lab(run.LabConfig(processes=2, bandwidth="none", runner_args=args), echo=False)
  assert s["bandwidth_bps"] is None and s["wire_bytes_per_step"] is None
  assert s["timed_steps"] == 2 and s["step_time_s"] > 0
  # The compiled all-reduce is still read from the program that ran.
  assert s["collective_bytes_per_step"] > 400_000
  assert (tmp_path / "lab" / "process_1.log").read_text().count("process 1 of 2")
