"""Zero-bubble schedules (ZB-H1, ZBV) run by the pipeline executor: exact against the
unpipelined model, their backward split into input- and weight-gradient passes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import hlo_flops
from jaxsys import mesh as mesh_lib
from jaxsys.models import transformer
from jaxsys.parallel import pipeline, routing
from tests.parallel.test_pipeline import _reference, _run, assert_close


@pytest.mark.parametrize("mesh_spec,name,microbatches,virtual,n_layers,tie,vocab_parallel", [
    ("stage=4,data=2", "zb_h1", 4, 1, 4, False, False),
    pytest.param("stage=4,data=2", "zb_h1", 8, 1, 4, False, True, marks=pytest.mark.slow),
    pytest.param("stage=2,tensor=2,data=2", "zb_h1", 4, 1, 4, True, True, marks=pytest.mark.slow),  # VP over stage x tensor
    # The V on 4 stages: chunks 0-3 down, 4-7 back up, the turn on stage 3, the head on 0.
    ("stage=4,data=2", "zbv", 4, 2, 8, False, False),
    pytest.param("stage=4,tensor=2", "zbv", 8, 2, 8, False, True, marks=pytest.mark.slow),
    pytest.param("stage=2,data=4", "zbv", 4, 2, 4, True, False, marks=pytest.mark.slow),
    pytest.param("stage=2,data=4", "zbv", 4, 2, 4, True, True, marks=pytest.mark.slow),
])
def test_matches_unpipelined(mesh_spec, name, microbatches, virtual, n_layers, tie,
                             vocab_parallel):
  cfg, params, batch, ref_loss, ref_grads = _reference(tie, n_layers=n_layers)
  loss, grads = _run(cfg, params, batch, mesh_spec, name, microbatches, virtual, vocab_parallel)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_close(grads, ref_grads)


@pytest.mark.parametrize("name,virtual,vocab_parallel", [("zb_h1", 1, False), ("zbv", 2, True)])
def test_forward_only_loss(name, virtual, vocab_parallel):
  """Evaluation runs the forwards alone, the V's head on stage 0."""
  cfg, params, batch, ref_loss, _ = _reference(False, n_layers=8)
  mesh = mesh_lib.make_mesh("stage=4,data=2")
  layout = pipeline.Layout(stages=4, virtual=virtual, vocab_size=cfg.vocab_size,
                           vocab_parallel=vocab_parallel)
  schedule = pipeline.make_schedule(name, stages=4, microbatches=4, virtual_stages=virtual)
  fn = jax.jit(lambda p, b: pipeline.pipeline_loss(cfg, schedule, layout, p, b, mesh=mesh))
  np.testing.assert_allclose(fn(pipeline.to_stages(layout, params), batch), ref_loss, rtol=1e-5)


@pytest.mark.slow
def test_executed_ticks_match_the_schedule():
  """The executor runs the table's input- and weight-gradient branches where it says."""
  cfg, params, batch, _, _ = _reference(False)
  mesh = mesh_lib.make_mesh("stage=2,data=4")
  layout = pipeline.Layout(stages=2, virtual=1, vocab_size=cfg.vocab_size, vocab_parallel=False)
  schedule = pipeline.make_schedule("zb_h1", stages=2, microbatches=4)
  _, _, counts = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(
      cfg, schedule, layout, p, b, mesh=mesh, with_counts=True))(
          pipeline.to_stages(layout, params), batch)
  np.testing.assert_array_equal(counts, schedule.executed.counts())
  assert counts[:, pipeline.BACKWARD].sum() == 0 and counts[:, pipeline.BACKWARD_WEIGHT].min() == 4


@pytest.mark.slow
def test_split_backward_does_the_work_once():
  """B (the input gradient and the cotangent chain) and W (the weight gradients' matmuls,
  from B's stash) together run the backward's matmuls once, each about half of them
  (measured, a chunk of 2 layers, d 64: B 17.8 / W 15.7 / whole 33.6 MFLOP of dots), and
  give its values."""
  cfg = transformer.TransformerConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=4,
                                      n_kv_heads=2, d_ff=256, attention_impl="xla")
  params = transformer.init_params(cfg, jax.random.key(0))["layers"]
  x = jax.random.normal(jax.random.key(1), (2, 32, cfg.d_model))
  mb = {"positions": jnp.tile(jnp.arange(32), (2, 1)), "segment_ids": jnp.ones((2, 32), jnp.int32)}
  _, attention_fn = transformer.default_inputs(cfg, mb["positions"], None, None)
  chunk = pipeline.chunk.Chunk(cfg, attention_fn)
  y, res = chunk.forward(params, x, mb)
  dy = jax.random.normal(jax.random.key(2), y.shape)
  dparams, dx = chunk.backward(params, res, dy, mb)
  dx_b, dparams_b, stash = chunk.backward_input(params, res, dy, mb)
  dparams_w = chunk.backward_weight(params, res, dy, stash, mb)
  np.testing.assert_allclose(dx_b, dx, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b, c: np.testing.assert_allclose(a + b, c, rtol=1e-5, atol=1e-6),
               dparams_b, dparams_w, dparams)
  # W computes every weight gradient here: no norm or matmul weight's gradient in B.
  assert all(float(jnp.max(jnp.abs(d))) == 0 for d in jax.tree.leaves(dparams_b))

  def dots(fn, *args):
    return hlo_flops.dot_flops(jax.jit(fn).lower(*args).compile().as_text())
  whole = dots(chunk.backward, params, res, dy, mb)
  b = dots(chunk.backward_input, params, res, dy, mb)
  w = dots(chunk.backward_weight, params, res, dy, stash, mb)
  assert b + w == whole and 0.4 * whole < w < b < 0.6 * whole, (b, w, whole)


def test_routed_replicas_refuse_a_v():
  R, p = 2, 2
  cfg, _, batch, _, _ = _reference(False)
  mesh = mesh_lib.make_mesh("replica=2,stage=2,data=2")
  layout = pipeline.Layout(stages=p, virtual=2, vocab_size=cfg.vocab_size, vocab_parallel=False)
  keys = jax.random.split(jax.random.key(0), R)
  params = jax.vmap(lambda k: pipeline.to_stages(layout, transformer.init_params(cfg, k)))(keys)
  schedule = pipeline.make_schedule("zbv", stages=p, microbatches=2, virtual_stages=2)
  shifts = routing.draw_shifts(0, 0, R, 2, layout.chunks)
  with pytest.raises(ValueError, match=r"pipeline.schedule=zbv sends between stages") as err:
    pipeline.replica_loss_and_grads(cfg, schedule, layout, params, batch, mesh=mesh,
                                    shifts=shifts)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,error", [
    (dict(pipeline__microbatches=2),
     "pipeline.microbatches=2 is fewer than the 4 stages; zbv needs microbatches >= stages (4)"),
    (dict(pipeline__virtual_stages=1),
     "pipeline.virtual_stages=1 is invalid for pipeline.schedule=zbv; valid: 2"),
    (dict(pipeline__schedule="zb_h1", pipeline__virtual_stages=1, pipeline__microbatches=2),
     "pipeline.microbatches=2 is fewer than the 4 stages; zb_h1 needs microbatches >= stages (4)"),
    (dict(), None), (dict(pipeline__schedule="zb_h1", pipeline__virtual_stages=1), None)])
def test_config_check(make_config, overrides, error):
  """A run's config names the schedules; too few microbatches or a V without two virtual
  stages is refused in one line naming the field, the value and what is valid."""
  from jaxsys.train import config_check
  config = make_config(**{"mesh": "stage=4,data=2", "pipeline__schedule": "zbv",
                          "pipeline__virtual_stages": 2, "pipeline__microbatches": 4,
                          "model__n_layers": 8, **overrides})
  if error is None:
    config_check.check_config(config)
    return
  with pytest.raises(ValueError) as err:
    config_check.check_config(config)
  assert error in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.slow
def test_context_axis():
  """With the sequence split over `context` (ring attention's collectives inside each
  chunk; the executor's uniform ticks run every branch), B and W stay exact."""
  cfg, params, batch, ref_loss, ref_grads = _reference(False)
  loss, grads = _run(cfg, params, batch, "stage=2,context=2,data=2", "zb_h1", 2)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_close(grads, ref_grads)


@pytest.mark.slow
def test_training_run_with_zbv(make_config, tmp_path):
  """A run configured with pipeline.schedule=zbv (the V over stage=2, VP, eval) trains as
  the unpipelined run does: same losses, validation loss and canonical parameters."""
  import os

  import chex
  from jaxsys import metrics as metrics_lib
  from jaxsys.train import loop
  from tests.train.test_pipelined import _saved_params
  kw = dict(log_every=1, eval_every=3, eval_steps=1, checkpoint_every=100, total_steps=3,
            optimizer__schedule_steps=3, model__n_layers=4)
  straight, v = str(tmp_path / "straight"), str(tmp_path / "v")
  a = loop.train_and_evaluate(make_config(mesh="data=-1", **kw), straight)
  b = loop.train_and_evaluate(make_config(
      mesh="stage=2,data=-1", pipeline__schedule="zbv", pipeline__virtual_stages=2,
      pipeline__microbatches=2, pipeline__vocab_parallel=True, **kw), v)
  losses = lambda w: [r["loss"] for r in metrics_lib.read_metrics(w) if "loss" in r]
  assert len(losses(v)) == 3
  np.testing.assert_allclose(losses(v), losses(straight), rtol=1e-5)
  np.testing.assert_allclose(b["val_loss"], a["val_loss"], rtol=1e-5)
  chex.assert_trees_all_close(_saved_params(v, 3)["params"], _saved_params(straight, 3)["params"],
                              atol=1e-5)
  assert os.path.isdir(os.path.join(v, "checkpoints"))
