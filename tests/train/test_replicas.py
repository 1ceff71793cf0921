"""Training with an outer optimizer: exact resume, replica layout, comm bytes, one-line config errors."""
import os

import chex
import jax
import numpy as np
import pytest

from jaxsys import mesh as mesh_lib
from jaxsys import metrics as metrics_lib
from jaxsys.checkpoint.manager import Checkpointer
from jaxsys.models import transformer
from jaxsys.train import config_check
from jaxsys.train import loop
from jaxsys.train import replicas
from jaxsys.train.setup import make_setup


def _restore_state(workdir, step):
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints"),
                             item_names=("state", "data", "meta")) as m:
    return m.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


def _rows(workdir):
  return [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]


def _straight_and_in_two_legs(make_config, tmp_path, **kw):
  """8 steps straight and 4 + stop + 4: each run's {step: (loss, outer_bytes, comm_bytes)},
  and each run's state at step 8."""
  straight, legs = str(tmp_path / "straight"), str(tmp_path / "legs")
  loop.train_and_evaluate(make_config(total_steps=8, **kw), straight)
  loop.train_and_evaluate(make_config(total_steps=4, **kw), legs)
  loop.train_and_evaluate(make_config(total_steps=8, **kw), legs)
  rows = lambda w: {r["step"]: (r["loss"], r["outer_bytes"], r["comm_bytes"]) for r in _rows(w)}
  return rows(straight), rows(legs), _restore_state(straight, 8), _restore_state(legs, 8)


@pytest.mark.slow
def test_resume_is_exact_with_outer_state(make_config, tmp_path):
  """CO2 (the most outer state: anchor, previous anchor, pending average, momentum):
  8 steps straight == 4 steps, stop, restore, 4 more; syncs every 3 steps cross the stop."""
  kw = dict(mesh="replica=4,data=2", log_every=1, eval_every=0, checkpoint_every=100,
            optimizer__schedule_steps=8, outer__name="co2", outer__sync_every=3)
  a, b, sa, sb = _straight_and_in_two_legs(make_config, tmp_path, **kw)
  assert sorted(a) == sorted(b) == list(range(1, 9))
  np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-6)
  chex.assert_trees_all_close(sb["params"], sa["params"], atol=1e-6)
  chex.assert_trees_all_close(sb["outer"], sa["outer"], atol=1e-6)
  chex.assert_trees_all_close(sb["opt_state"], sa["opt_state"], atol=1e-6)
  # Two syncs (steps 3 and 6) were counted, each the ring all-reduce of one replica's params.
  n = sum(x.size for x in jax.tree.leaves(sa["params"])) // 4
  assert a[8][1] == 2 * (2 * 3 * n * 4 // 4)
  # All bytes: also each step's gradient all-reduce within a replica (data=2: ring, n floats).
  assert a[8][2] == a[8][1] + 8 * (2 * 1 * n * 4 // 2)
  # Replicas really diverge between syncs: after step 8 (2 inner steps since the sync).
  w = sa["params"]["layers"]["wq"]
  assert w.shape[0] == 4 and not np.allclose(w[0], w[1])


@pytest.mark.slow
def test_streaming_diloco_resumes_exactly_mid_overlap(make_config, tmp_path):
  """Streaming DiLoCo, 2 fragments of the 2-layer model, every 4 steps, each landing a step
  after it starts (fused into that step's program): 8 steps straight == 4, stop (fragment 1
  started, not landed), restore, 4 more. Each start sends half of DiLoCo's bytes."""
  kw = dict(mesh="replica=4,data=2", log_every=1, eval_every=0, checkpoint_every=100,
            optimizer__schedule_steps=8, outer__name="streaming_diloco",
            outer__sync_every=4, outer__fragments=2,
            outer__overlap_steps=1, outer__mixing=0.25)
  a, b, sa, sb = _straight_and_in_two_legs(make_config, tmp_path, **kw)
  np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-6)
  chex.assert_trees_all_close(sb["params"], sa["params"], atol=1e-6)
  chex.assert_trees_all_close(sb["outer"], sa["outer"], atol=1e-6)
  assert int(sa["outer"]["events"][0]) == 8  # starts at 2, 4, 6, 8 and landings at 3, 5, 7, 9
  n = sum(x.size for x in jax.tree.leaves(sa["params"])) // 4
  round_bytes = 2 * 3 * n * 4 // 4  # DiLoCo's ring all-reduce over 4 replicas
  assert [a[s][1] for s in (1, 2, 4, 8)] == [0, round_bytes // 2, round_bytes, 2 * round_bytes]


def test_layout_and_sync(make_config):
  """Params/opt_state/outer have a leading [R] dim sharded on `replica`; a sync makes DiLoCo's
  replicas equal again, while the inner (AdamW) moments stay per replica."""
  config = make_config(mesh="replica=2,fsdp=2,data=2", outer__name="diloco",
                       outer__sync_every=2)
  run = config_check.check_config(config)
  mesh, model_cfg = mesh_lib.make_mesh(run.mesh), run.model
  setup = make_setup(run, mesh)
  state = setup.init_state(0)
  wq = state.params["layers"]["wq"]
  assert wq.sharding.spec[0] == "replica" and "fsdp" in str(wq.sharding.spec)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=(16, 65))
  batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
           "segment_ids": np.ones((16, 64), np.int32),
           "positions": np.tile(np.arange(64, dtype=np.int32), (16, 1)),
           "loss_mask": np.ones((16, 64), np.float32)}
  batch = jax.device_put(batch, setup.batch_sh)
  for _ in range(2):  # the first step's learning rate is 0 (warmup)
    state, _ = setup.train_fn(state, batch)
  p = jax.device_get(state.params)
  assert not np.allclose(p["unembedding"][0], p["unembedding"][1])  # different rows -> different replicas
  state = setup.sync_fn(state)
  p = jax.device_get(state.params)
  np.testing.assert_array_equal(p["unembedding"][0], p["unembedding"][1])
  mu = jax.device_get(state.opt_state)[1][0].mu["unembedding"]
  assert not np.allclose(mu[0], mu[1])
  one = setup.eval_params(state.params)
  np.testing.assert_array_equal(jax.device_get(one["unembedding"]), p["unembedding"][0])


@pytest.mark.parametrize("overrides, message", [
    (dict(outer__name="dilcoo"),
     r"^outer.name='dilcoo' is unknown; valid: none, diloco, noloco, co2, streaming_diloco$"),
    (dict(outer__name="streaming_diloco", outer__fragments=2,
          outer__mixing=1.5),
     r"^outer.mixing=1.5 is invalid; it must be a number >= 0 and <= 1$"),
    (dict(outer__name="diloco", outer__sync_every=0),
     r"^outer.sync_every=0 is invalid; it must be an int >= 1"),
    (dict(outer__name="diloco", outer__compression="int4"),
     r"^outer.compression='int4' is unknown; valid: none, bf16, int8, fp8$"),
    (dict(outer__name="noloco", outer__lr=-0.5),
     r"^outer.lr=-0.5 is invalid"),
    (dict(outer__name="diloco", mesh="data=-1"),
     r"^outer.name='diloco' needs a mesh with a 'replica' axis of size >= 2, but the mesh "
     r"is data=8 \(8 cpu devices\); e.g. mesh='replica=4,data=-1'$"),
    (dict(outer__name="co2", mesh="replica=1,data=-1"),
     r"^outer.name='co2' needs a mesh with a 'replica' axis of size >= 2"),
])
def test_bad_config_one_line_error(make_config, tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message) as err:
    loop.train_and_evaluate(make_config(total_steps=2, **overrides), str(tmp_path))
  assert "\n" not in str(err.value)
  assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.slow
def test_data_parallel_logs_gradient_bytes(make_config, tmp_path):
  loop.train_and_evaluate(make_config(total_steps=2, eval_every=0, log_every=1), str(tmp_path))
  rows = _rows(str(tmp_path))
  params = jax.eval_shape(lambda: transformer.init_params(
      transformer.TransformerConfig.from_config(make_config().model), jax.random.key(0)))
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  assert [r["comm_bytes"] for r in rows] == [2 * 7 * n * 4 // 8, 2 * (2 * 7 * n * 4 // 8)]
