"""experiments/quant_eval.py end to end on a tiny checkpoint trained in the test."""
import json
import os
import subprocess
import sys

import pytest

from jaxsys.quant import evaluate
from jaxsys.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")  # one device: a fast subprocess
  return subprocess.run([sys.executable, "-m", "experiments.quant_eval", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_quant_eval_end_to_end(make_config, tmp_path):
  workdir = str(tmp_path / "run")
  config = make_config(total_steps=2, eval_every=0, checkpoint_every=2, eval_steps=2)
  loop.train_and_evaluate(config, workdir)

  rows = "w4a16:gptq,w4a16:qwix"
  proc = _run(f"--workdir={workdir}", "--calib_batches=1", "--group_size=32", f"--rows={rows}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "| float | - |" in proc.stdout and "| w4a16 | gptq |" in proc.stdout
  with open(os.path.join(workdir, "quant_eval.json")) as f:
    table = json.load(f)
  assert table["step"] == 2 and table["eval_steps"] == 2
  got = [(r["scheme"], r["method"]) for r in table["rows"]]
  assert got == [("float", "-"), ("w4a16", "gptq"), ("w4a16", "qwix")]
  for r in table["rows"]:
    assert r["error"] is None, r
    assert 50 < r["recovery_pct"] < 150 and r["val_bpb"] > 0
  float_row, w4, qw4 = table["rows"]
  assert float_row["recovery_pct"] == 100.0
  assert w4["weight_bytes"] == qw4["weight_bytes"] < float_row["weight_bytes"] / 6
  assert os.path.exists(os.path.join(workdir, "quant_eval.md"))

  # A checkpoint whose saved model config disagrees with its arrays: one clear line.
  meta = os.path.join(workdir, "checkpoints", "2", "meta", "metadata")
  with open(meta) as f:
    bad = json.load(f)
  bad["model"]["d_ff"] = 96
  with open(meta, "w") as f:
    json.dump(bad, f)
  with pytest.raises(ValueError, match=r"checkpoint step 2 in .* does not match the model in its "
                                       r"meta .*'d_ff': 96") as e:
    evaluate.load_run(workdir)
  assert "\n" not in str(e.value)


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match=r"--workdir=.*: no checkpoints directory"):
    evaluate.load_run(str(tmp_path))
  with pytest.raises(ValueError, match=r"--rows item 'w4a16:awq': want scheme:method"):
    evaluate.parse_rows("w4a16:awq")
  assert evaluate.parse_rows("w4a16:gptq+act_order,w8a8_fp8:qwix") == (
      ("w4a16", "gptq", {"act_order": True}), ("w8a8_fp8", "qwix", {}))
