"""Bad input a user can give the train binary (jaxsys/bench/bad_input.py's table, run
through `experiments.fault_injection --bad_input`): one `error:` line each naming the path
or field, exit 1, no traceback, nothing of the workdir changed."""
import json
import pathlib
import subprocess
import sys

import pytest

from jaxsys.bench import bad_input

pytestmark = pytest.mark.slow  # starts processes

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_bad_input_is_one_error_line(small_corpus, tmp_path):
  """A run.lock that is a directory (fresh or old) or unreadable; a dangling or looping
  symlink in checkpoints/, or checkpoints/ a file; a checkpoint file unreadable or a
  directory; metrics.jsonl a directory; a config file that does not parse, cannot be read
  or defines no get_config; an override before --config (each a traceback, or a failure
  later that named nothing, before)."""
  report = tmp_path / "bad_input.json"
  proc = subprocess.run([sys.executable, "-m", "experiments.fault_injection",
                         f"--workdir={tmp_path / 'runs'}", "--bad_input",
                         f"--data_source={small_corpus}", f"--json={report}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=900)
  print(proc.stdout)  # the table, with pytest -s
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  result = json.loads(report.read_text())
  assert result["problems"] == [], result["problems"]
  assert [r["case"] for r in result["rows"]] == list(bad_input.CASES)
  assert all(r["exit"] == 1 and r["line"].startswith("error: ") for r in result["rows"])
