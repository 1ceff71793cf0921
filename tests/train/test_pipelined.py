"""Pipelined runs through train_and_evaluate: canonical checkpoints, resume under another layout."""
import os

import chex
import jax
import numpy as np
import pytest

from jaxsys import comm_bytes
from jaxsys import mesh as mesh_lib
from jaxsys import metrics as metrics_lib
from jaxsys.checkpoint.manager import Checkpointer
from jaxsys.data import packing
from jaxsys.models import transformer
from jaxsys.train import config_check
from jaxsys.train import loop
from jaxsys.train.setup import make_setup


def _losses(workdir):
  return {r["step"]: r["loss"] for r in metrics_lib.read_metrics(workdir) if "loss" in r}


def _saved_params(workdir, step):
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints"),
                             item_names=("state", "data", "meta")) as m:
    return m.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


@pytest.mark.slow
def test_resume_under_another_schedule_and_stage_count(make_config, tmp_path):
  """8 steps unpipelined == 4 steps GPipe over 2 stages, then 4 more 1F1B over 4 stages with
  vocabulary parallelism: same losses, same saved (canonical) parameters."""
  kw = dict(log_every=1, eval_every=0, checkpoint_every=100, optimizer__schedule_steps=8,
            model__n_layers=4)
  straight, legs = str(tmp_path / "straight"), str(tmp_path / "legs")
  loop.train_and_evaluate(make_config(total_steps=8, mesh="data=-1", **kw), straight)
  loop.train_and_evaluate(make_config(total_steps=4, mesh="stage=2,data=-1",
                                      pipeline__schedule="gpipe", **kw), legs)
  assert Checkpointer(os.path.join(legs, "checkpoints")).all_steps() == [4]
  result = loop.train_and_evaluate(make_config(
      total_steps=8, mesh="stage=4,data=-1", pipeline__schedule="1f1b",
      pipeline__vocab_parallel=True, **kw), legs)
  assert result["step"] == 8
  a, b = _losses(straight), _losses(legs)
  assert sorted(b) == list(range(1, 9))
  np.testing.assert_allclose([b[s] for s in range(1, 9)], [a[s] for s in range(1, 9)], rtol=1e-5)
  saved, ref = _saved_params(legs, 8)["params"], _saved_params(straight, 8)["params"]
  chex.assert_trees_all_equal_shapes(saved, ref)  # canonical: [layers, ...], vocab unpadded
  chex.assert_trees_all_close(saved, ref, atol=1e-5)


@pytest.mark.slow
def test_views_round_trip(make_config):
  """init_from's canonical parameters enter the stage view and come back unchanged."""
  config = make_config(mesh="stage=2,data=-1", pipeline__schedule="interleaved_1f1b",
                       pipeline__virtual_stages=2, pipeline__vocab_parallel=True,
                       model__n_layers=4, model__vocab_size=257)
  run = config_check.check_config(config)
  model_cfg, setup = run.model, make_setup(run, mesh_lib.make_mesh(run.mesh))
  params = transformer.init_params(model_cfg, jax.random.key(3))
  state = setup.start_from(setup.init_state(0), jax.device_put(params, setup.param_sh))
  assert state.params["embedding"].shape == (258, model_cfg.d_model)  # padded for 2 stages
  chex.assert_trees_all_equal(setup.to_saved(state).params, params)
  again = setup.from_saved(setup.to_saved(state))
  chex.assert_trees_all_equal(again, state)


@pytest.mark.parametrize("overlap", [False, True])
def test_vocab_overlap_is_the_schedule_s(make_config, overlap):
  """pipeline.vocab_overlap reaches the schedule the trainer runs (its exactness and carried
  all-reduces: tests/parallel/test_vocab_schedule.py): two more microbatches in flight."""
  run = config_check.check_config(make_config(
      mesh="stage=2,data=-1", pipeline__schedule="1f1b", pipeline__microbatches=4,
      pipeline__vocab_parallel=True, pipeline__vocab_overlap=overlap))
  schedule = make_setup(run, mesh_lib.make_mesh(run.mesh)).schedule
  assert schedule.vocab_overlap is overlap
  assert schedule.max_in_flight == 2 + 2 * overlap


@pytest.mark.slow
def test_outer_optimizer_over_pipelined_replicas_with_random_routing(make_config, tmp_path):
  """NoLoCo over two replicas of a two-stage 1F1B pipeline, randomly routed: 2 steps, stop,
  resume, 2 more (a sync at step 3, an eval at the end); the checkpoint holds the canonical
  replica form, the logged bytes are the compiled programs'."""
  kw = dict(mesh="replica=2,stage=2,data=2", pipeline__schedule="1f1b",
            pipeline__microbatches=2, pipeline__routing="random", outer__name="noloco",
            outer__sync_every=3, log_every=1, eval_steps=1, checkpoint_every=100,
            optimizer__schedule_steps=4)
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(make_config(total_steps=2, eval_every=0, **kw), workdir)
  result = loop.train_and_evaluate(make_config(total_steps=4, eval_every=4, **kw), workdir)
  assert result["step"] == 4 and np.isfinite(result["val_loss"])
  rows = [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]
  assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in rows)
  saved = _saved_params(workdir, 4)["params"]
  config = make_config(**kw)
  assert saved["layers"]["wq"].shape[:2] == (2, config.model.n_layers)  # [R, layers, ...]
  assert not np.allclose(saved["layers"]["wq"][0], saved["layers"]["wq"][1])  # a step apart
  setup = make_setup(config_check.check_config(config), mesh_lib.make_mesh(config.mesh))
  # The bytes logged each step are what the compiled programs send (ring rules, every tick
  # counted): the train step's collectives, and at step 3 the sync's on top.
  state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                       setup.abstract, setup.state_sh)
  b, t = config.data.batch_size, config.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((b, t), np.float32 if k == "loss_mask" else np.int32,
                                    sharding=setup.batch_sh) for k in packing.FIELDS}
  sent = lambda fn, *args: comm_bytes.collective_bytes_from_hlo(
      fn.lower(*args).compile().as_text(), 8, trips=True)
  step, sync = sent(setup.train_fn, state, batch), sent(setup.sync_fn, state)
  logged = np.diff([0] + [r["comm_bytes"] for r in rows])
  # Not counted: the loss's and a few flags' scalars (about 100 bytes).
  np.testing.assert_allclose(logged, [step, step, step + sync, step], atol=200)


@pytest.mark.parametrize("overrides, message", [
    (dict(mesh="stage=2,data=-1", pipeline__schedule="1f1b", pipeline__routing="random"),
     r"^pipeline.routing='random' is invalid with mesh axis replica=1, mesh axis stage=2; it "
     r"must be fixed unless the mesh has both a replica and a stage axis larger than 1"),
])
def test_bad_routing_config_one_line_error(make_config, tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message) as err:
    loop.train_and_evaluate(make_config(total_steps=2, **overrides), str(tmp_path))
  assert "\n" not in str(err.value)
  assert not os.path.exists(tmp_path / "checkpoints")
