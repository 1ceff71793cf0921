"""train_and_evaluate: metrics, resume exactness, refusing bad checkpoints, NaN handling."""
import gzip
import json
import os

import chex
import jax
import numpy as np
import pytest

from jaxsys import mesh as mesh_lib
from jaxsys import metrics as metrics_lib
from jaxsys.checkpoint.manager import Checkpointer
from jaxsys.train import loop


def _train_rows(workdir):
  return [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]


def _restore_params(workdir, step):
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints"),
                             item_names=("state", "data", "meta")) as m:
    return m.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


@pytest.mark.slow
def test_trains_evaluates_and_checkpoints(make_config, tmp_path):
  config = make_config(total_steps=6, log_every=1, eval_every=3, checkpoint_every=3)
  result = loop.train_and_evaluate(config, str(tmp_path))
  assert result["step"] == 6
  rows = metrics_lib.read_metrics(str(tmp_path))
  train = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "val_bpb" in r]
  assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
  assert all(np.isfinite(r["loss"]) for r in train)
  # Step 1 compiles, so throughput is reported from step 2 on.
  assert "tokens_per_s" not in train[0] and all(r["tokens_per_s"] > 0 for r in train[1:])
  assert [r["step"] for r in evals] == [3, 6]
  # Byte-level: bits per byte is the loss in bits.
  np.testing.assert_allclose(evals[-1]["val_bpb"], evals[-1]["val_loss"] / np.log(2), rtol=1e-5)
  assert Checkpointer(result["checkpoints"]).all_steps() == [3, 6]
  assert os.listdir(result["tensorboard"])


@pytest.mark.parametrize("mesh, extra", [
    ("data=-1", {}),
    ("stage=2,data=-1", dict(pipeline__schedule="1f1b", pipeline__microbatches=2)),
    ("data=-1", dict(data__variable_length=True, parallel__hdp=True, data__max_len=256,
                     data__truncate_long=True))],
    ids=["dp", "pipeline", "hdp"])
@pytest.mark.slow
def test_profile_holds_the_annotated_steps(make_config, tmp_path, mesh, extra):
  """profile.steps='2,3' of 4: a trace of steps 2 and 3 only (each annotated once), for
  TensorBoard (xplane) and Perfetto, and a device-memory profile after step 2."""
  config = make_config(mesh=mesh, total_steps=4, eval_every=0, log_every=1,
                       profile__steps="2,3", **extra)
  result = loop.train_and_evaluate(config, str(tmp_path))
  directory = tmp_path / "profile"
  (session,) = (directory / "plugins" / "profile").iterdir()
  assert next(session.glob("*.xplane.pb")).stat().st_size > 0
  with gzip.open(session / "perfetto_trace.json.gz") as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
  assert steps == [2, 3]
  assert (directory / "memory_step2.prof").stat().st_size > 0
  assert result["profile"] == str(directory)


HDP = dict(data__variable_length=True, parallel__hdp=True, data__max_len=256,
           data__truncate_long=True)


@pytest.mark.parametrize("mesh, extra", [
    ("data=-1", {}), ("data=-1,fsdp=2,tensor=2", {}), ("data=-1,fsdp=2,tensor=2", HDP),
    ("replica=2,data=-1,tensor=2", {**HDP, "data__max_len": 128, "outer__name": "diloco",
                                    "outer__sync_every": 2})],
    ids=["dp", "fsdp_tensor", "hdp_fsdp_tensor", "hdp_in_diloco_replicas"])
@pytest.mark.slow
def test_resume_is_exact(make_config, tmp_path, mesh, extra):
  """2N steps straight == N steps, stop, restore, N more: same losses and parameters.
  With HDP the whole-document loader resumes at its position too; in replicas, the outer
  state with it (syncs at steps 2, 4 and 6, the stop at 3 between them)."""
  kw = dict(mesh=mesh, log_every=1, eval_every=0, checkpoint_every=100,
            optimizer__schedule_steps=6, **extra)
  straight, legs = str(tmp_path / "straight"), str(tmp_path / "legs")
  loop.train_and_evaluate(make_config(total_steps=6, **kw), straight)
  loop.train_and_evaluate(make_config(total_steps=3, **kw), legs)
  assert Checkpointer(os.path.join(legs, "checkpoints")).all_steps() == [3]
  loop.train_and_evaluate(make_config(total_steps=6, **kw), legs)
  loss = lambda workdir: {r["step"]: r["loss"] for r in _train_rows(workdir)}
  a, b = loss(straight), loss(legs)
  assert sorted(a) == sorted(b) == list(range(1, 7))
  np.testing.assert_allclose([b[s] for s in range(1, 7)], [a[s] for s in range(1, 7)], rtol=1e-6)
  chex.assert_trees_all_close(_restore_params(legs, 6)["params"],
                              _restore_params(straight, 6)["params"], atol=1e-6)


@pytest.mark.slow
def test_refuses_checkpoint_of_another_model(make_config, tmp_path):
  loop.train_and_evaluate(make_config(total_steps=2), str(tmp_path))
  before = sorted((p, os.path.getmtime(p)) for p in _files(tmp_path / "checkpoints"))
  with pytest.raises(ValueError, match=r"model.d_model=64 there but 32 in the config"):
    loop.train_and_evaluate(make_config(total_steps=4, model__d_model=32), str(tmp_path))
  assert sorted((p, os.path.getmtime(p)) for p in _files(tmp_path / "checkpoints")) == before


@pytest.mark.slow
def test_resume_with_other_numerics_refused_unless_allowed(make_config, tmp_path):
  """rope_theta keeps every shape but changes the function: refused in one line, or allowed."""
  loop.train_and_evaluate(make_config(total_steps=2, eval_every=0), str(tmp_path))
  other = dict(total_steps=3, eval_every=0, model__rope_theta=500_000.0)
  with pytest.raises(ValueError, match=r"^checkpoint in .* computes another function: "
                                       r"model.rope_theta=10000.0 there but 500000.0 in the "
                                       r"config; set --config.allow_model_change=rope_theta "
                                       r"[^\n]*$"):
    loop.train_and_evaluate(make_config(**other), str(tmp_path))
  assert Checkpointer(str(tmp_path / "checkpoints")).all_steps() == [2]
  result = loop.train_and_evaluate(make_config(**other, allow_model_change="rope_theta"),
                                   str(tmp_path))
  assert result["step"] == 3 and not result["preempted"]
  saved = _restore_params(str(tmp_path), 3)
  assert set(saved) == {"step", "params", "opt_state"}  # no unused state (the old rng)


@pytest.mark.slow
def test_nan_stops_without_saving(make_config, tmp_path):
  """A run that diverges raises, and the last checkpoint before it stays the latest, intact."""
  loop.train_and_evaluate(make_config(total_steps=2, checkpoint_every=1), str(tmp_path))
  good = _restore_params(str(tmp_path), 2)["params"]
  diverging = make_config(total_steps=8, checkpoint_every=1, log_every=1,
                          optimizer__learning_rate=1e30, optimizer__warmup_steps=0,
                          optimizer__grad_clip=1e30)
  with pytest.raises(loop.NonFiniteLossError, match="stopping without saving"):
    loop.train_and_evaluate(diverging, str(tmp_path))
  steps = Checkpointer(str(tmp_path / "checkpoints")).all_steps()
  assert 2 in steps
  latest = max(steps)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(_restore_params(str(tmp_path), latest)))
  chex.assert_trees_all_equal(_restore_params(str(tmp_path), 2)["params"], good)


class _Rows:
  """A sharding whose local devices hold the given row slices (as one process would see)."""

  def __init__(self, slices, mesh):
    self.slices, self.mesh = slices, mesh

  def addressable_devices_indices_map(self, shape):
    return {i: (s, slice(None)) for i, s in enumerate(self.slices)}


def test_batch_block_is_the_rows_of_this_process(monkeypatch):
  """The loader reads the one contiguous block of batch rows this process's devices hold."""
  mesh = mesh_lib.make_mesh("data=-1")
  assert loop._batch_block(mesh_lib.batch_sharding(mesh), 16) == (0, 1)  # pylint: disable=protected-access
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  # Process 1 of 2 holding rows 8..15: block 1 of 2.
  assert loop._batch_block(_Rows([slice(8, 12), slice(12, 16)], mesh), 16) == (1, 2)  # pylint: disable=protected-access
  # Every process holding every row (stages across hosts): all read the whole batch.
  assert loop._batch_block(_Rows([slice(0, 8), slice(8, 16)], mesh), 16) == (0, 1)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=r"^mesh data=8 .* gives process 0 batch rows \[0, 16\) "
                                       r"of 16, not one of 2 equal blocks or fewer; [^\n]*$"):
    loop._batch_block(_Rows([slice(0, 4), slice(12, 16)], mesh), 16)  # pylint: disable=protected-access


def _files(root):
  return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
