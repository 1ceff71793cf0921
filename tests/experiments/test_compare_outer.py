"""experiments/compare_outer.py end to end: warm start, two rows, table, plot, sync timing."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import jax
import pytest

from jaxsys import optim
from jaxsys.models import transformer
from jaxsys.optim import outer as outer_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cmd(workdir, source, *flags):
  return [sys.executable, "-m", "experiments.compare_outer", "--config=configs/compare_outer.py",
          f"--workdir={workdir}", f"--config.data.source={source}",
          "--config.data.num_threads=0", "--config.model.d_model=32", "--config.model.d_ff=64",
          *flags]


def test_two_rows_from_a_warm_start(small_corpus, tmp_path):
  proc = subprocess.run(
      _cmd(tmp_path, small_corpus, "--runs=dp,diloco_k4_h10", "--time_sync=diloco_k4_h10",
           "--time_reps=2", "--config.pretrain_steps=2", "--config.total_steps=4",
           "--config.eval_every=2", "--config.eval_steps=1", "--config.log_every=2",
           "--config.checkpoint_every=4", "--config.continue_schedule=true",
           "--config.run_specs.diloco_k4_h10.optimizer.outer_sync_every=2"),
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {r["run"]: r for r in json.loads((tmp_path / "results.json").read_text())}
  assert set(rows) == {"dp", "diloco_k4_h10"}
  assert (tmp_path / "pretrain" / "checkpoints" / "2").is_dir()
  dp, diloco = rows["dp"], rows["diloco_k4_h10"]
  assert dp["steps"] == diloco["steps"] == 4 and dp["workers"] == 8 and diloco["workers"] == 4

  spec = importlib.util.spec_from_file_location("compare", ROOT / "configs" / "compare_outer.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  model = module.get_config().model
  model.update(dict(d_model=32, d_ff=64))
  cfg = transformer.TransformerConfig.from_config(model)
  params = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  per_sync = optim.diloco(sync_every=2).bytes_per_sync(params, 4)
  assert diloco["comm_bytes"] == 2 * per_sync  # 2 syncs in 4 steps
  assert diloco["dp_bytes_same_k"] == 4 * outer_lib.ring_allreduce_bytes(
      outer_lib.tree_bytes(params), 4)
  assert diloco["bytes_reduction"] == diloco["dp_bytes_same_k"] / diloco["comm_bytes"]

  # One learning-rate curve over pretrain + row (warmup min(20, 6 - 1) = 5 steps): the
  # row's step 2 runs at the curve's step 1 + 2.
  dp_rows = [json.loads(l) for l in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
  assert next(r["lr"] for r in dp_rows if r["step"] == 2) == pytest.approx(3e-3 * 3 / 5)

  table = (tmp_path / "results.md").read_text()
  assert table.startswith("Protocol: every row starts from one data-parallel run pretrained for 2")
  assert "the learning-rate curve continued" in table.splitlines()[0]
  assert "| diloco_k4_h10 | diloco | 4 | 2 |" in table and "| ratio |" in table
  assert (tmp_path / "outer_comparison.png").stat().st_size > 10_000
  timing = json.loads((tmp_path / "sync_timing.json").read_text())["diloco_k4_h10"]
  assert timing["step_s"] > 0 and timing["ratio"] > 0.5


def test_unknown_run_is_one_line(small_corpus, tmp_path):
  proc = subprocess.run(_cmd(tmp_path, small_corpus, "--runs=dp,nope"), cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "--runs: unknown run(s) ['nope']; valid: dp, diloco_k4_h50" in proc.stderr
  assert not (tmp_path / "results.md").exists()
