"""Universal checkpoints: the layout transforms, the description each checkpoint records, and
resumes under another mesh, another replica count or outer optimizer, pipelined or not,
with the vocabulary padded or not."""
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsys import metrics as metrics_lib
from jaxsys.checkpoint import layouts
from jaxsys.checkpoint.manager import Checkpointer
from jaxsys.models import transformer
from jaxsys.parallel import pipeline
from jaxsys.train import loop


def _tree(r=None, seed=0):
  shape = lambda *s: s if r is None else (r, *s)
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w": jax.random.normal(k1, shape(3, 2)), "b": jax.random.normal(k2, shape(2))}


def test_regroup_every_direction():
  one, four = _tree(), _tree(4)
  chex.assert_trees_all_equal(layouts.regroup(one, 0, 0), one)
  stacked = layouts.regroup(one, 0, 4)
  chex.assert_trees_all_equal(stacked, jax.tree.map(lambda x: jnp.stack([x] * 4), one))
  chex.assert_trees_all_equal(layouts.regroup(stacked, 4, 0), one)  # mean of copies: exact
  chex.assert_trees_all_close(layouts.regroup(four, 4, 0, "mean"),
                              jax.tree.map(lambda x: x.mean(0), four), rtol=1e-6)
  chex.assert_trees_all_equal(layouts.regroup(four, 4, 0, "replica0"),
                              jax.tree.map(lambda x: x[0], four))
  # 4 -> 2: neighbouring pairs merged; 2 -> 4: each copied twice, in order.
  chex.assert_trees_all_close(layouts.regroup(four, 4, 2),
                              jax.tree.map(lambda x: x.reshape(2, 2, *x.shape[1:]).mean(1), four),
                              rtol=1e-6)
  two = _tree(2)
  chex.assert_trees_all_equal(layouts.regroup(two, 2, 4),
                              jax.tree.map(lambda x: x[jnp.array([0, 0, 1, 1])], two))


@pytest.mark.parametrize("saved, target", [(4, 3), (6, 4), (3, 2)])
def test_a_replica_count_that_does_not_divide_is_one_line(saved, target):
  with pytest.raises(ValueError, match=rf"holds {saved} replicas and the config's mesh has "
                                       rf"replica={target}") as err:
    layouts.regroup(_tree(saved), saved, target)
  assert "\n" not in str(err.value)


def test_moments_follow_their_parameters_and_counts_take_replica_0():
  optimizer = optax.adamw(1e-3)
  params = _tree(4)
  opt_state = jax.vmap(optimizer.init)(params)
  opt_state = jax.tree.map(lambda x: x + jnp.arange(4, dtype=x.dtype).reshape(-1, *[1] * (x.ndim - 1)),
                           opt_state)  # replicas' moments and counts differ
  one = layouts.Form()
  merged_p, merged_s = layouts.convert(optimizer, params, opt_state, layouts.Form(4, "diloco"), one)
  chex.assert_trees_all_close(merged_p, jax.tree.map(lambda x: x.mean(0), params), rtol=1e-6)
  adam = merged_s[0]
  chex.assert_trees_all_close(adam.mu, jax.tree.map(lambda x: x.mean(0), opt_state[0].mu), rtol=1e-6)
  chex.assert_trees_all_close(adam.nu, jax.tree.map(lambda x: x.mean(0), opt_state[0].nu), rtol=1e-6)
  assert adam.count == opt_state[0].count[0]
  # The merged state is one model's: the optimizer steps it.
  optimizer.update(merged_p, merged_s, merged_p)


# One example parameter per registered layout: a transform added without one fails here.
EXAMPLES = {"replicas": 4,  # a power of two: the mean of copies is exact
            "stages": pipeline.Layout(stages=2, virtual=2, vocab_size=257, vocab_parallel=True,
                                      tensor=2)}  # 257 padded to 260, 2 x 2 shards


@pytest.mark.parametrize("name", sorted(layouts.TRANSFORMS))
def test_every_registered_layout_round_trips(name):
  """canonical -> view -> canonical is the identity, for the parameters and Adam's moments."""
  assert name in EXAMPLES, f"add an example for the layout {name!r} to EXAMPLES"
  cfg = transformer.TransformerConfig(vocab_size=257, d_model=32, n_layers=4, n_heads=2,
                                      n_kv_heads=1, d_ff=64)
  params = transformer.init_params(cfg, jax.random.key(0))
  transform, arg = layouts.TRANSFORMS[name], EXAMPLES[name]
  view = transform.to_view(params, arg)
  assert jax.tree.structure(view) == jax.tree.structure(params)
  assert any(v.shape != p.shape for v, p in zip(jax.tree.leaves(view), jax.tree.leaves(params)))
  chex.assert_trees_all_equal(transform.to_canonical(view, arg), params)
  # Adam's moments are parameter-shaped trees: the same pair carries them.
  mu = optax.adamw(1e-3).init(params)[0].mu
  chex.assert_trees_all_equal(transform.to_canonical(transform.to_view(mu, arg), arg), mu)


def _losses(workdir):
  return {r["step"]: r["loss"] for r in metrics_lib.read_metrics(workdir) if "loss" in r}


KW = dict(log_every=1, eval_every=0, checkpoint_every=100, optimizer__schedule_steps=8)


@pytest.mark.parametrize("a, b, extra", [
    (dict(mesh="fsdp=8"), dict(mesh="data=2,tensor=4"), dict(model__n_kv_heads=4)),
    # Pipelined (4 stages, vocabulary split over stage x tensor and padded 258 -> 264) ->
    # unpipelined (into a padded layout on restore: tests/train/test_pipelined.py's resume).
    (dict(mesh="stage=4,tensor=2", pipeline__schedule="1f1b", pipeline__vocab_parallel=True),
     dict(mesh="data=-1"), dict(model__vocab_size=258, model__n_layers=4)),
], ids=["fsdp8_to_data2_tensor4", "pipelined_vocab_padded_to_plain"])
@pytest.mark.slow
def test_resume_under_another_layout_is_exact(make_config, tmp_path, a, b, extra):
  """N steps under layout A, resume under B, N more == 2N straight under A."""
  straight, legs = str(tmp_path / "straight"), str(tmp_path / "legs")
  loop.train_and_evaluate(make_config(total_steps=8, **a, **extra, **KW), straight)
  loop.train_and_evaluate(make_config(total_steps=4, **a, **extra, **KW), legs)
  loop.train_and_evaluate(make_config(total_steps=8, **b, **extra, **KW), legs)
  x, y = _losses(straight), _losses(legs)
  assert sorted(x) == sorted(y) == list(range(1, 9))
  np.testing.assert_allclose([y[s] for s in x], [x[s] for s in x], rtol=2e-5)


def _restored(make_config, workdir, **overrides):
  """(setup, state) a run of `overrides` resumes `workdir` with, and the step it resumes."""
  setup, state = loop.restore(make_config(**overrides), workdir)
  return setup, state, int(state.step)


def _saved(workdir, step):
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints"),
                             item_names=("state", "data", "meta")) as m:
    return m.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


@pytest.mark.slow
def test_one_model_to_diloco_replicas_and_back(make_config, tmp_path):
  """data=8 -> replica=4 x data=2 (DiLoCo) -> data=8, merging by the mean. Every replica
  starts as the saved model, its Adam moments too, with a fresh outer state; the first
  step after the switch scores the same parameters on the same batch as a straight run.
  Merging takes the replicas' mean, moments included."""
  w, straight = str(tmp_path / "w"), str(tmp_path / "straight")
  dp = dict(mesh="data=8", **KW)
  diloco = dict(mesh="replica=4,data=2", outer__name="diloco",
                outer__sync_every=2, **KW)
  loop.train_and_evaluate(make_config(total_steps=5, **dp), straight)
  loop.train_and_evaluate(make_config(total_steps=4, **dp), w)
  saved = _saved(w, 4)
  setup, state, step = _restored(make_config, w, total_steps=8, **diloco)
  assert step == 4 and int(state.step) == 4
  stack4 = lambda t: jax.tree.map(lambda x: np.stack([x] * 4), t)
  chex.assert_trees_all_equal(state.params, stack4(saved["params"]))
  # Every inner optimizer leaf (Adam's moments and count) is the saved one, per replica.
  chex.assert_trees_all_equal(jax.tree.leaves(state.opt_state),
                              stack4(jax.tree.leaves(saved["opt_state"])))
  assert state.params["layers"]["wq"].sharding.spec[0] == "replica"
  chex.assert_trees_all_equal(state.outer, jax.jit(jax.vmap(setup.outer.init))(state.params))

  loop.train_and_evaluate(make_config(total_steps=8, **diloco), w)
  np.testing.assert_allclose(_losses(w)[5], _losses(straight)[5], rtol=2e-5)
  replicas = _saved(w, 8)
  # Synced at step 8: the replicas agree, so mean and replica 0 are the same model.
  chex.assert_trees_all_close(replicas["params"]["layers"]["wq"][1],
                              replicas["params"]["layers"]["wq"][0], atol=1e-6)
  _, merged, _ = _restored(make_config, w, total_steps=12, **dp)
  chex.assert_trees_all_close(merged.params, jax.tree.map(lambda x: x.mean(0), replicas["params"]),
                              rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(
      jax.tree.leaves(merged.opt_state),
      [x.mean(0).astype(x.dtype) for x in jax.tree.leaves(replicas["opt_state"])],
      rtol=1e-5, atol=1e-9)  # mean of 4 in another order: rounding
  loop.train_and_evaluate(make_config(total_steps=12, **dp), w)
  assert sorted(_losses(w)) == list(range(1, 13))


@pytest.mark.slow
def test_every_checkpoint_describes_its_layout(make_config, tmp_path):
  loop.train_and_evaluate(make_config(total_steps=2, mesh="replica=2,fsdp=4",
                                      outer__name="noloco", **KW), str(tmp_path))
  meta = Checkpointer(str(tmp_path / "checkpoints")).read_meta(2)
  layout = meta["layout"]
  assert layout["form"] == {"replicas": 2, "outer": "noloco"}
  assert layout["run"]["mesh"] == "replica=2,fsdp=4"
  wq = layout["arrays"][".params['layers']['wq']"]
  assert wq["transforms"] == ["replicas"] and wq["logical_axes"][:2] == ["replica", "layers"]
  assert wq["shape"] == [2, *wq["canonical_shape"]] and wq["spec"].startswith("P('replica'")
  mu = next(v for k, v in layout["arrays"].items() if k.endswith(".mu['layers']['wq']"))
  assert mu["logical_axes"] == wq["logical_axes"]  # moments follow their parameters
  assert layout["arrays"][".step"]["transforms"] == []
