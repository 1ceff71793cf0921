"""experiments/bench_pipeline_wall.py at the tiniest size: in one process (its library,
jaxsys/bench/pipeline_wall.py), and as two pinned processes joined on loopback (the way it
measures)."""
import json
import os
import sys
import pathlib

import pytest
from absl import flags
from absl.testing import flagsaver

import forked_cli
from conftest import binary_flags, import_binary
from jaxsys.bench import pipeline_wall
from jaxsys.lab import link as link_lib
from jaxsys.parallel import schedules

pytestmark = pytest.mark.slow  # starts processes or trains end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = dict(d_model=16, n_layers=4, seq=8, vocab_size=64, repeats=1)
CORES = len(os.sched_getaffinity(0))
binary = import_binary("bench_pipeline_wall")  # it defines its flags only when it runs


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


@pytest.mark.skipif(CORES < 2, reason="needs two cores")
def test_two_pinned_processes(tmp_path, monkeypatch, capfd):
  """Across a shaped link where this may shape one (root), else the host's loopback; the
  link's namespace is gone afterwards."""
  out = tmp_path / "wall.json"
  bandwidth = "none" if link_lib.missing_privileges() else "1gbit"
  before = set(link_lib.namespaces()) if bandwidth != "none" else set()
  # 1F1B runs a chunk a stage: one layer each (TINY's 4 give interleaved 2 chunks a stage).
  argv = [str(ROOT / "experiments" / "bench_pipeline_wall.py"), "--stages=2",
          "--microbatches=2", "--schedules=1f1b", f"--out={out}", f"--bandwidth={bandwidth}",
          *(f"--{k}={v}" for k, v in dict(TINY, n_layers=2).items())]
  # The launcher's main runs here, as `python -m experiments.bench_pipeline_wall` runs it
  # (a process start less); it starts the workers with the flags in sys.argv.
  monkeypatch.setattr(sys, "argv", argv)
  monkeypatch.chdir(ROOT)
  with binary_flags(binary), flagsaver.flagsaver():
    binary._define_flags()  # pylint: disable=protected-access
    flags.FLAGS(argv)
    binary.main(argv[:1])
  result = json.loads(out.read_text())
  assert result["processes"] == 2 and result["bandwidth"] == bandwidth
  _check(result, ["1f1b"])
  assert "| 1f1b | 2 |" in capfd.readouterr().out
  if bandwidth != "none":  # its link's namespace is gone (another run's may exist beside it)
    assert not [ns for ns in set(link_lib.namespaces()) - before if ns.startswith("jaxsys-pw")]


@pytest.fixture(scope="module")
def bad_command_lines(tmp_path_factory):
  """{name: (exit status, stderr)} of the two bad command lines below, run from one start-up
  of the binary (tests/experiments/forked_cli.py: a child forked for each, ~2 s of CPU less
  than a process each)."""
  root = tmp_path_factory.mktemp("bad_command_lines")
  lines = {"bandwidth": ["--bandwidth=fast"], "stages": [f"--stages={CORES + 1}"]}
  runs = forked_cli.run("experiments.bench_pipeline_wall",
                        [[*flags, f"--out={root / name}.json"] for name, flags in lines.items()],
                        root / "forked")
  return {name: (code, err) for name, (code, _, err) in zip(lines, runs)}


def test_a_bad_bandwidth_is_one_line(bad_command_lines):
  returncode, stderr = bad_command_lines["bandwidth"]
  assert returncode == 1
  assert stderr.strip().splitlines()[-1].startswith(
      "error: --bandwidth='fast' is not a rate: use a positive number with one of the units")


def test_refuses_more_stages_than_cores(bad_command_lines):
  """The library refuses; the binary says so as a usage error, exit 1."""
  with pytest.raises(ValueError, match=rf"--stages={CORES + 1} needs {CORES + 1} cores"):
    pipeline_wall.launch(CORES + 1, [])
  returncode, stderr = bad_command_lines["stages"]
  assert returncode == 1 and f"--stages={CORES + 1} needs {CORES + 1} cores" in stderr
