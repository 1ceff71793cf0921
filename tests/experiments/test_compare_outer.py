"""experiments/compare_outer.py end to end: warm start, two rows, table, plot, sync timing, seeds;
bytes checked against the compiled programs' collectives."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forked_cli
from jaxsys import comm_bytes
from jaxsys import mesh as mesh_lib
from jaxsys.bench import compare_outer
from jaxsys.models import transformer
from jaxsys.optim import outer as outer_lib
from jaxsys.train import config_check
from jaxsys.train.setup import make_setup

pytestmark = pytest.mark.slow  # starts processes or trains end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The rows' model and batch: 8 rows still split over DP's 8 workers and DiLoCo's 4 replicas
# x 2, and a step computes an eighth of the config's 32 x 128 tokens.
SIZES = {"model": dict(d_model=32, d_ff=64), "data": dict(batch_size=8, seq_len=64)}


def _cmd(workdir, source, *flags):
  return [sys.executable, "-m", "experiments.compare_outer", "--config=configs/compare_outer.py",
          f"--workdir={workdir}", f"--config.data.source={source}",
          "--config.data.num_threads=0",
          *(f"--config.{part}.{k}={v}" for part, kv in SIZES.items() for k, v in kv.items()),
          *flags]


def test_two_rows_from_a_warm_start(small_corpus, tmp_path):
  proc = subprocess.run(
      _cmd(tmp_path, small_corpus, "--runs=dp,diloco_k4_h10", "--time_sync=diloco_k4_h10",
           "--seeds=3",
           "--time_reps=1", "--config.pretrain_steps=2", "--config.total_steps=4",
           "--config.eval_every=2", "--config.eval_steps=1", "--config.log_every=2",
           "--config.checkpoint_every=4", "--config.continue_schedule=true",
           "--config.optimizer.warmup_steps=5",
           "--config.run_specs.diloco_k4_h10.outer.sync_every=2"),
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "seed 3 of [3]" in proc.stderr
  seed_table = (tmp_path / "results_seeds.md").read_text()
  assert seed_table.startswith("Mean ± sample std over seeds 3 ") and "| ratio |" in seed_table
  assert "| diloco_k4_h10 | 4 | 2 | " in seed_table
  tmp_path = tmp_path / "seed3"  # the single-seed layout, one level down
  rows = {r["run"]: r for r in json.loads((tmp_path / "results.json").read_text())}
  assert set(rows) == {"dp", "diloco_k4_h10"}
  assert (tmp_path / "pretrain" / "checkpoints" / "2").is_dir()
  dp, diloco = rows["dp"], rows["diloco_k4_h10"]
  assert dp["steps"] == diloco["steps"] == 4 and dp["workers"] == 8 and diloco["workers"] == 4
  # The table scores the final checkpoint on the whole val split; DiLoCo's last step synced,
  # so its replicas agree and their mean scores the same.
  scored = json.loads((tmp_path / "diloco_k4_h10" / "final_eval.json").read_text())
  assert scored["step"] == 4 and scored["batches"] == 0 and scored["val_bpb"] == diloco["val_bpb"]
  assert diloco["val_bpb_replica_mean"] == pytest.approx(diloco["val_bpb"], rel=1e-4)
  assert dp["val_bpb_replica_mean"] is None and dp["val_bpb_last_eval"] > 0

  # Bytes against the collectives XLA compiled: DP's train step (its gradient all-reduce
  # over 8 workers) and DiLoCo's sync (a mean over the 4 replicas), as the runs built them.
  dp_step, diloco_sync = _compiled_bytes("dp"), _compiled_bytes("diloco_k4_h10")
  # DP's step also sums the loss and a few flags across workers: under 100 bytes.
  assert 0 <= dp_step - dp["comm_bytes"] / 4 < 100, (dp_step, dp["comm_bytes"])
  assert diloco["comm_bytes"] == 2 * diloco_sync  # 2 syncs in 4 steps
  assert diloco["peak_bytes_per_sync"] == diloco_sync
  assert dp["peak_bytes_per_sync"] == dp["comm_bytes"] / 4
  assert diloco["dp_bytes_same_k"] == 4 * comm_bytes.ring_allreduce_bytes(
      comm_bytes.tree_bytes(_params()), 4)
  # Every 2 steps DiLoCo all-reduces what DP all-reduces every step (float32 deltas of the
  # same parameters over the same 4 workers): 2x fewer bytes, from the compiled sync above.
  assert diloco["bytes_reduction"] == pytest.approx(2.0, rel=1e-3)

  # One learning-rate curve over pretrain + row (5 warmup steps of 6): the
  # row's step 2 runs at the curve's step 1 + 2.
  dp_rows = [json.loads(l) for l in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
  assert next(r["lr"] for r in dp_rows if r["step"] == 2) == pytest.approx(3e-3 * 3 / 5)

  table = (tmp_path / "results.md").read_text()
  assert table.startswith("Protocol: every row starts from one data-parallel run pretrained for 2")
  assert "the learning-rate curve continued" in table.splitlines()[0]
  assert "val bpb: the final parameters (replica 0) on the val split, all of it" in table
  assert "| replicas' mean bpb |" in table and "| peak bytes / sync |" in table
  assert "| diloco_k4_h10 | diloco | 4 | 2 |" in table
  assert (tmp_path / "outer_comparison.png").stat().st_size > 10_000
  timing = json.loads((tmp_path.parent / "sync_timing.json").read_text())["diloco_k4_h10"]
  assert timing["step_s"] > 0 and timing["ratio"] > 0.5


def _run_config(name: str):
  """Row `name` of configs/compare_outer.py with the sizes `_cmd` sets."""
  spec = importlib.util.spec_from_file_location("compare", ROOT / "configs" / "compare_outer.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  base = module.get_config()
  for part, kv in SIZES.items():
    base[part].update(kv)
  return compare_outer.run_config(base, base.run_specs[name].to_dict())


def _params():
  cfg = transformer.TransformerConfig.from_config(_run_config("dp").model)
  return jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))


def _compiled_bytes(name: str) -> int:
  """Bytes one worker sends in row `name`'s compiled program: DP's step or the outer sync."""
  config = _run_config(name)
  run = config_check.check_config(config)
  mesh = mesh_lib.make_mesh(run.mesh)
  setup = make_setup(run, mesh)
  if setup.outer is None:
    b, t = config.data.batch_size, config.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((b, t), jnp.float32 if k == "loss_mask" else jnp.int32)
             for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
    compiled = setup.train_fn.lower(setup.abstract, batch).compile()
  else:
    compiled = setup.sync_fn.lower(setup.abstract).compile()
  return comm_bytes.collective_bytes_from_hlo(compiled.as_text(), outer_lib.num_workers(config.mesh))


@pytest.fixture(scope="module")
def bad_command_lines(small_corpus, tmp_path_factory):
  """{name: (exit status, stderr, workdir)} of the two bad command lines below, run from one
  start-up of the binary (tests/experiments/forked_cli.py: a child forked for each, ~2 s
  of CPU less than a process each); each workdir exists, empty, before its run."""
  root = tmp_path_factory.mktemp("bad_command_lines")
  lines = {"unknown_run": (small_corpus, "--runs=dp,nope"), "bad_seeds": ("stdlib", "--seeds=0,x")}
  for name in lines:
    (root / name).mkdir()
  runs = forked_cli.run("experiments.compare_outer",
                        [_cmd(root / name, *args)[3:] for name, args in lines.items()],
                        root / "forked")
  return {name: (code, err, root / name) for name, (code, _, err) in zip(lines, runs)}


def test_unknown_run_is_one_line(bad_command_lines):
  returncode, stderr, workdir = bad_command_lines["unknown_run"]
  assert returncode != 0
  assert "--runs: unknown run(s) ['nope']; valid: dp, diloco_k4_h50" in stderr
  assert not (workdir / "results.md").exists()


def _row(run, method, bpb, k=4, h=50, compression="none", replica_mean=None, distance=None):
  return {"run": run, "method": method, "workers": k, "sync_every": h,
          "compression": compression, "val_bpb": bpb, "val_bpb_replica_mean": replica_mean,
          "replica_distance": distance}


def test_seed_table_gaps_are_per_seed(tmp_path):
  per_seed = {
      0: [_row("dp", "data parallel", 2.0, k=8, h=1), _row("dl", "diloco", 2.02),
          _row("dl8", "diloco", 2.04, compression="int8"),
          _row("nl", "noloco", 2.0402, replica_mean=2.0, distance=0.01)],
      1: [_row("dp", "data parallel", 1.0, k=8, h=1), _row("dl", "diloco", 1.03),
          _row("dl8", "diloco", 1.05, compression="int8"),
          _row("nl", "noloco", 1.0403, replica_mean=1.0, distance=0.02)]}
  table = compare_outer.write_seed_table(per_seed, str(tmp_path))
  lines = {l.split(" | ")[0][2:]: l for l in table.splitlines() if l.startswith("| ")}
  # DiLoCo: +1% and +3% vs DP -> mean 2.00, t(0.975, 1) x 1.41 / sqrt(2) = 12.71 either side;
  # NoLoCo vs the uncompressed DiLoCo: +1% twice, no spread.
  assert "| +2.00 [-10.71, +14.71], indistinguishable | - | +1.00 / +3.00 |" in lines["dl"]
  # Replica 0 against the replicas' mean: +2.01% and +4.03%; then the replicas' distance to
  # their mean. Columns only replica runs fill.
  assert "| +1.00 [+1.00, +1.00] |" in lines["nl"]
  assert lines["nl"].endswith("| +3.02 ± 1.43 | 0.01500 ± 0.00707 |")
  assert lines["dp"].endswith("| 1.5000 ± 0.7071 | - | - | - | - | - |")
  assert lines["dl"].endswith(" | - | - |")
  saved = json.loads((tmp_path / "results_seeds.json").read_text())
  assert saved["nl"]["diloco"] == pytest.approx([1.0, 1.0])
  assert (tmp_path / "results_seeds.md").read_text() == table


def test_replica_distance():
  # Two replicas over two leaves: mean (2, 0, 0), each replica 1 away from it.
  params = {"a": np.array([[1.0, 0.0], [3.0, 0.0]]), "b": np.zeros((2, 1, 1))}
  assert compare_outer.replica_distance(params) == pytest.approx(0.5)
  synced = {"a": np.ones((4, 3))}
  assert compare_outer.replica_distance(synced) == 0.0


def test_bad_seeds_is_one_line(bad_command_lines):
  returncode, stderr, workdir = bad_command_lines["bad_seeds"]
  assert returncode != 0
  assert "--seeds=0,x: expected comma-separated integers, e.g. --seeds=0,1,2" in stderr
  assert not list(workdir.iterdir())


@pytest.mark.parametrize("variant,rows", [
    ("streaming", ["dp", "diloco_k4_h50", "streaming_k4_h50_f2", "streaming_k4_h50_f4",
                   "streaming_k4_h50_f4_t5_a05"]),
    ("routing", ["dp"] + [f"{m}_k{k}_h50_pp{r}" for k in (2, 4) for m, r in
                          (("diloco", ""), ("noloco", ""), ("noloco", "_routed"))]),
])
def test_variant_rows_pass_the_config_check(variant, rows):
  """`configs/compare_outer.py:streaming` and `:routing`: every row valid (Streaming DiLoCo's
  fragments divide its 4 layers; routing has a replica and a stage axis)."""
  spec = importlib.util.spec_from_file_location("compare", ROOT / "configs" / "compare_outer.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  base = module.get_config(variant)
  assert base.runs.split(",") == rows
  for name in rows:
    config = compare_outer.run_config(base, base.run_specs[name].to_dict())
    config_check.check_config(config)
    assert name.endswith("_routed") == (config.pipeline.routing == "random")
  with pytest.raises(ValueError, match="argument 'stream' is unknown"):
    module.get_config("stream")
