"""experiments/quant_eval.py end to end on a tiny checkpoint trained in the test."""
import json
import os
import subprocess
import sys

import pytest

from jaxsys import xla_flags
from jaxsys.checkpoint import integrity, ledger
from jaxsys.cli import quant_runs
from jaxsys.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
  # One device (a fast subprocess), the suite's other XLA flags kept.
  env = dict(os.environ, XLA_FLAGS=xla_flags.with_cpu_devices(None), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "experiments.quant_eval", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_quant_eval_end_to_end(make_config, tmp_path):
  workdir = str(tmp_path / "run")
  config = make_config(total_steps=2, eval_every=2, checkpoint_every=2, eval_steps=2)
  trained = loop.train_and_evaluate(config, workdir)

  rows = "w4a16:gptq,w4a16:rtn,w4a16:qwix"
  proc = _run(f"--workdir={workdir}", "--calib_batches=1", "--group_size=32", f"--rows={rows}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "| float | - |" in proc.stdout and "| w4a16 | gptq |" in proc.stdout
  with open(os.path.join(workdir, "quant_eval.json")) as f:
    table = json.load(f)
  assert table["step"] == 2 and table["eval_steps"] == 2
  got = [(r["scheme"], r["method"]) for r in table["rows"]]
  assert got == [("float", "-"), ("w4a16", "gptq"), ("w4a16", "rtn"), ("w4a16", "qwix")]
  float_row, w4, rtn, qw4 = table["rows"]
  # RTN against qwix's PTQ (also round to nearest), paired on the same batches.
  assert rtn["vs_qwix_bpb"]["mean"] == pytest.approx(rtn["val_bpb"] - qw4["val_bpb"], rel=1e-6,
                                                     abs=1e-9)
  assert "vs_qwix_bpb" not in w4
  # The float row is the training run's own last eval: same checkpoint, same val batches.
  assert float_row["val_bpb"] == pytest.approx(trained["val_bpb"], rel=1e-5)
  for r in table["rows"]:
    assert r["error"] is None, r
    assert r["recovery_pct"] == pytest.approx(100 * float_row["val_bpb"] / r["val_bpb"])
  # Two steps from init, int4 (group 32) costs GPTQ and qwix 0.27-0.29% of the float
  # bpb. A quantizer that is a no-op (or a row scored with the float weights) costs 0%,
  # 3-bit codes 0.46%, scales 1.5x too large 2.3%.
  for r in (w4, qw4):
    assert 0.15 < 100 - r["recovery_pct"] < 0.4, r
    # Each row is paired with the float one on the same val batches: the bootstrap's point
    # estimate is the difference of their bits per byte.
    gap = r["vs_float_bpb"]
    assert gap["n"] == 2 and gap["low"] <= gap["mean"] <= gap["high"]
    assert gap["mean"] == pytest.approx(r["val_bpb"] - float_row["val_bpb"], rel=1e-6)
  assert w4["weight_bytes"] == qw4["weight_bytes"] < float_row["weight_bytes"] / 6
  assert os.path.exists(os.path.join(workdir, "quant_eval.md"))

  # A checkpoint whose saved model config disagrees with its arrays: one clear line.
  meta = os.path.join(workdir, "checkpoints", "2", "meta", "metadata")
  with open(meta) as f:
    bad = json.load(f)
  bad["model"]["d_ff"] = 96
  with open(meta, "w") as f:
    json.dump(bad, f)
  # Edited after the save, it fails its checksum; as if saved so (sealed and entered in the
  # ledger), its shapes disagree.
  with pytest.raises(ValueError, match=r"checkpoint step 2 in .* is corrupt: meta/metadata: "):
    quant_runs.load_run(workdir)
  integrity.seal(os.path.join(workdir, "checkpoints", "2"))
  ledger.enter(os.path.join(workdir, "checkpoints", "2"), os.path.join(workdir, "checkpoints"), 2)
  with pytest.raises(ValueError, match=r"checkpoint step 2 in .* does not match the model in its "
                                       r"meta .*'d_ff': 96") as e:
    quant_runs.load_run(workdir)
  assert "\n" not in str(e.value)


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match=r"--workdir=.*: no checkpoints directory"):
    quant_runs.load_run(str(tmp_path))
  with pytest.raises(ValueError, match=r"--rows item 'w4a16:awq': want scheme:method"):
    quant_runs.parse_rows("w4a16:awq")
  assert quant_runs.parse_rows("w4a16:gptq+act_order,w8a8_fp8:qwix") == (
      ("w4a16", "gptq", {"act_order": True}), ("w8a8_fp8", "qwix", {}))
