"""experiments/bench_pipeline_wall.py at the tiniest size: in one process (its library,
jaxsys/bench/pipeline_wall.py), and as two pinned processes joined on loopback (the way it
measures)."""
import json
import os
import subprocess
import sys
import pathlib

import pytest

from jaxsys.bench import pipeline_wall
from jaxsys.lab import link as link_lib
from jaxsys.parallel import schedules

pytestmark = pytest.mark.slow  # starts processes or trains end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = dict(d_model=16, n_layers=4, seq=8, vocab_size=64, repeats=1)


def _check(result, names):
  assert [(r["schedule"], r["microbatches"]) for r in result["rows"]] == [(n, 2) for n in names]
  for costs in result["costs"].values():  # each as every process measured it
    assert set(costs) == {"forward", "backward", "backward_input", "backward_weight", "comm",
                          "comm_beside_compute", "comm_weights"}
    assert all(len(v) == result["processes"] for v in costs.values())
    assert min(min(v) for k, v in costs.items() if k != "comm_beside_compute") > 0
  for r in result["rows"]:
    schedule = schedules.make_schedule(r["schedule"], stages=2, microbatches=2,
                                       virtual_stages=r["virtual"])
    assert r["ticks"] == schedule.executed.ticks
    # Lock step waits for every tick's slowest stage: never shorter than asynchronous.
    assert r["predicted_async"] <= r["predicted_lockstep"] * (1 + 1e-12)
    assert r["measured"] > 0 and r["ratio"] == pytest.approx(
        r["measured"] / r["predicted_lockstep"])
    # The step with no layers (the ticks' own work) ran, and its time joins the prediction.
    assert r["measured_empty"] > 0 and r["ratio_calibrated"] == pytest.approx(
        r["measured"] / r["predicted_calibrated"])
    assert 0 <= r["steal"] < 1


def test_tiny_run_in_one_process():
  names = ["gpipe", "zb_h1", "interleaved_1f1b"]
  result = pipeline_wall.rows(names, 2, [2], **TINY)
  _check(result, names)
  # Chunks of 2 layers (one a stage) and of 1 (interleaved v=2), each measured once.
  assert sorted(result["costs"]) == ["1", "2"] and result["processes"] == 1
  lines = pipeline_wall.table(result).splitlines()
  assert lines[0].startswith(
      "| schedule | m | ticks | weight moves (ms) | predicted lock step (ms) |")
  assert sum(line.startswith(("| gpipe", "| zb_h1", "| interleaved")) for line in lines) == 3


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_pinned_processes(tmp_path):
  """Across a shaped link where this may shape one (root), else the host's loopback; the
  link's namespace is gone afterwards."""
  out = tmp_path / "wall.json"
  bandwidth = "none" if link_lib.missing_privileges() else "1gbit"
  before = set(link_lib.namespaces()) if bandwidth != "none" else set()
  flags = [f"--{k}={v}" for k, v in TINY.items()]
  proc = subprocess.run([sys.executable, "-m", "experiments.bench_pipeline_wall", "--stages=2",
                         "--microbatches=2", "--schedules=1f1b", f"--out={out}",
                         f"--bandwidth={bandwidth}", *flags],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["processes"] == 2 and result["bandwidth"] == bandwidth
  _check(result, ["1f1b"])
  assert "| 1f1b | 2 |" in proc.stdout
  if bandwidth != "none":  # its link's namespace is gone (another run's may exist beside it)
    assert not [ns for ns in set(link_lib.namespaces()) - before if ns.startswith("jaxsys-pw")]


def test_a_bad_bandwidth_is_one_line(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "experiments.bench_pipeline_wall",
                         "--bandwidth=fast", f"--out={tmp_path / 'x.json'}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "error: --bandwidth='fast' is not a rate: use a positive number with one of the units")


def test_refuses_more_stages_than_cores(tmp_path):
  """The library refuses; the binary says so as a usage error, exit 1."""
  cores = len(os.sched_getaffinity(0))
  with pytest.raises(ValueError, match=rf"--stages={cores + 1} needs {cores + 1} cores"):
    pipeline_wall.launch(cores + 1, [])
  proc = subprocess.run([sys.executable, "-m", "experiments.bench_pipeline_wall",
                         f"--stages={cores + 1}", f"--out={tmp_path / 'x.json'}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1 and f"--stages={cores + 1} needs {cores + 1} cores" in proc.stderr
