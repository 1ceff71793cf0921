"""experiments/device_report.py --smoke: every part of the GPU report at tiny sizes on CPU
(interpret-mode kernels), so the report cannot rot between GPU runs; and its bad input."""
import json
import os
import pathlib
import subprocess
import sys
import pytest

import forked_cli
from jaxsys import xla_flags
from jaxsys.device_report import report

pytestmark = pytest.mark.slow  # starts processes or trains end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*flags, devices=1):
  env = dict(os.environ, XLA_FLAGS=xla_flags.with_cpu_devices(devices))
  return subprocess.run([sys.executable, "-m", "experiments.device_report", *flags], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600, check=False)


def test_smoke_report_runs_every_part_and_writes_both_files(tmp_path):
  r = _run("--smoke", f"--out={tmp_path}")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  result = json.loads((tmp_path / "device_report.json").read_text())
  text = (tmp_path / "device_report.md").read_text()
  assert [s["key"] for s in result["sections"]] == list(report.NAMES)
  for s in result["sections"]:
    assert s["status"] == "ok" and s["rows"], (s["key"], s["status"], s["notes"])
    assert all(row.get("status", "ok") == "ok" for row in s["rows"]), s["rows"]
    assert f"## {s['title']}" in text
  rows = {s["key"]: s["rows"] for s in result["sections"]}
  assert all(row["passed"] for row in rows["checks"])
  assert {row["impl"] for row in rows["attention"]} == {"jaxsys pallas", "jaxsys xla", "jax xla"}
  assert {(row["preset"], row["attention"]) for row in rows["train"]} == {
      (p, a) for p in ("gpt2", "1b") for a in ("pallas", "xla")}
  assert all(row["tokens/s"] > 0 and row["loss"] > 0 for row in rows["train"])
  assert {row["weights"] for row in rows["generate"]} == {"float", "w8a8_int8", "w4a16"}
  assert [t["met"] for t in result["targets"]] == [None, None, None]  # no cuDNN, no datasheet
  assert text in r.stdout


@pytest.fixture(scope="module")
def bad_command_lines(tmp_path_factory):
  """{name: (exit status, stderr, --out directory)} of the two bad command lines below, run
  on one device from one start-up of the binary (tests/experiments/forked_cli.py: a child
  forked for each, ~2.5 s of CPU less than a process each); each --out exists, empty."""
  root = tmp_path_factory.mktemp("bad_command_lines")
  lines = {"no_gpu": [], "unknown_part": ["--smoke", "--parts=checks,speed"]}
  for name in lines:
    (root / name).mkdir()
  with pytest.MonkeyPatch.context() as env:
    env.setenv("XLA_FLAGS", xla_flags.with_cpu_devices(1))
    runs = forked_cli.run("experiments.device_report",
                          [[*flags, f"--out={root / name}"] for name, flags in lines.items()],
                          root / "forked")
  return {name: (code, err, root / name) for name, (code, _, err) in zip(lines, runs)}


def test_without_a_gpu_or_smoke_one_line(bad_command_lines):
  returncode, stderr, out = bad_command_lines["no_gpu"]
  assert returncode == 1
  assert stderr.strip().splitlines()[-1].startswith(
      "error: no GPU found (jax's backend is 'cpu'): run this on a GPU machine, or pass --smoke")
  assert not list(out.iterdir())


def test_unknown_part_one_line(bad_command_lines):
  returncode, stderr, _ = bad_command_lines["unknown_part"]
  assert returncode == 1
  assert stderr.strip().splitlines()[-1] == (
      "error: --parts: 'speed' is not a part; choose from " + ", ".join(report.NAMES))
