"""experiments/quant_eval.py refuses a bad numeric flag in one line, before loading anything."""
import pathlib
import subprocess
import sys
import pytest

pytestmark = pytest.mark.slow  # starts processes or trains end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bad_flag_is_one_line(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "experiments.quant_eval", f"--workdir={tmp_path}",
                         "--alpha=1.5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert proc.stderr.strip() == "error: --alpha=1.5 is invalid; it must be a number >= 0 and <= 1"
