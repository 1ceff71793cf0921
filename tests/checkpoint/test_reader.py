"""checkpoint.reader.read_params: the one checkpoint-to-params reader, and the model checks."""
import dataclasses
import json
import os
import tempfile

import chex
import jax
import numpy as np
from absl.testing import absltest, parameterized

from jaxsys.checkpoint import integrity, ledger, reader
from jaxsys.checkpoint.manager import Checkpointer, check_same_model
from jaxsys.models import transformer

MODEL = transformer.TransformerConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                                      n_kv_heads=1, d_ff=32)
META = dataclasses.asdict(MODEL)


def _params(seed):
  return jax.device_get(transformer.init_params(MODEL, jax.random.key(seed)))


def _save(workdir, steps, replicas=0):
  """Checkpoints as the training loop writes them: state {step, params, ...}, data, meta."""
  meta = {"model": META, "config": {"seed": 0}}
  if replicas:
    meta["outer"] = {"view": "replica", "name": "diloco", "replicas": replicas, "sync_every": 2}
  saved = {}
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
  for step in steps:
    params = _params(step)
    if replicas:  # replica r holds the parameters of seed step + r
      params = jax.tree.map(lambda *xs: np.stack(xs), *[_params(step + r) for r in range(replicas)])
    saved[step] = params
    outer = {"anchor": jax.tree.map(lambda x: x + 1, params)} if replicas else {}
    ckpt.save(step, {"step": np.int32(step), "params": params, "opt_state": {"count": np.int32(0)},
                     **({"outer": outer} if replicas else {})}, data={}, meta=meta)
  ckpt.close()
  return saved


class ReaderTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.workdir = tmp.name

  @parameterized.parameters("workdir", "checkpoints")
  def test_latest_and_given_step(self, where):
    saved = _save(self.workdir, [1, 3])
    path = self.workdir if where == "workdir" else os.path.join(self.workdir, "checkpoints")
    got = reader.read_params(path)
    self.assertEqual((got.step, got.replicas), (3, 0))
    self.assertEqual(got.model_cfg, MODEL)
    chex.assert_trees_all_equal(got.params, saved[3])
    chex.assert_trees_all_equal(got.one(), saved[3])
    chex.assert_trees_all_equal(reader.read_params(path, 1).params, saved[1])

  def test_replica_run_gives_replica_zero(self):
    saved = _save(self.workdir, [2], replicas=2)
    got = reader.read_params(self.workdir)
    self.assertEqual(got.replicas, 2)
    chex.assert_trees_all_equal(got.params, saved[2])
    chex.assert_trees_all_equal(got.one(), _params(2))
    anchor = reader.read_params(self.workdir, field=("outer", "anchor"))  # the outer state's
    chex.assert_trees_all_equal(anchor.params, jax.tree.map(lambda x: x + 1, saved[2]))

  def test_no_checkpoint_is_none_and_missing_step_one_line(self):
    self.assertIsNone(reader.read_params(os.path.join(self.workdir, "nowhere")))
    _save(self.workdir, [1])
    with self.assertRaisesRegex(ValueError, r"^.*checkpoints: no checkpoint at step 5; steps "
                                            r"there: \[1\]$"):
      reader.read_params(self.workdir, 5)

  def test_arrays_that_disagree_with_the_meta_are_refused(self):
    _save(self.workdir, [1])
    path = os.path.join(self.workdir, "checkpoints", "1", "meta", "metadata")
    with open(path) as f:
      meta = json.load(f)
    meta["model"]["d_ff"] = 48
    with open(path, "w") as f:
      json.dump(meta, f)
    # As if saved so (an edit after the save fails its checksum: test_integrity.py, and
    # the ledger: test_ledger.py).
    integrity.seal(os.path.join(self.workdir, "checkpoints", "1"))
    ledger.enter(os.path.join(self.workdir, "checkpoints", "1"),
                 os.path.join(self.workdir, "checkpoints"), 1)
    with self.assertRaisesRegex(ValueError, r"checkpoint step 1 in .* does not match the model "
                                            r"in its meta .* is \(1, 32, 16\) there but the "
                                            r"meta's model gives \(1, 48, 16\)$"):
      reader.read_params(self.workdir)

  def test_expect_model_refuses_other_numerics_unless_allowed(self):
    saved = _save(self.workdir, [1])
    other = dict(META, rope_theta=500_000.0)
    with self.assertRaisesRegex(
        ValueError, r"^checkpoint in .* computes another function: model.rope_theta=10000.0 "
                    r"there but 500000.0 in the config; set "
                    r"--config.allow_model_change=rope_theta to continue"):
      reader.read_params(self.workdir, expect_model=other)
    got = reader.read_params(self.workdir, expect_model=other, allow_model_change=("rope_theta",))
    chex.assert_trees_all_equal(got.params, saved[1])


class CheckSameModelTest(parameterized.TestCase):

  @parameterized.parameters(("norm_eps", 1e-5), ("dtype", "bfloat16"), ("rope_theta", 1e6),
                            ("rope_scaling", "linear:factor=4"))
  def test_each_numeric_field_is_refused_and_can_be_allowed(self, field, value):
    current = dict(META, **{field: value})
    with self.assertRaisesRegex(ValueError, rf"model.{field}=.* there but {value!r} in the "
                                            rf"config; set --config.allow_model_change={field} "):
      check_same_model(META, current, "/ckpt")
    check_same_model(META, current, "/ckpt", allow=(field, "rope_theta"))

  def test_a_meta_from_before_rope_scaling_means_none(self):
    """A checkpoint written before model.rope_scaling existed computed plain RoPE."""
    old = {k: v for k, v in META.items() if k != "rope_scaling"}
    check_same_model(old, dict(old, rope_scaling=""), "/ckpt")
    with self.assertRaisesRegex(ValueError, r"model.rope_scaling='' there but 'linear:factor=4'"):
      check_same_model(old, dict(old, rope_scaling="linear:factor=4"), "/ckpt")

  def test_shapes_are_never_allowed(self):
    with self.assertRaisesRegex(ValueError, r"different model: model.d_model=16 there but 32"):
      check_same_model(META, dict(META, d_model=32), "/ckpt", allow=("rope_theta",))

  def test_schedule_fields_may_differ(self):
    check_same_model(META, dict(META, remat="full", attention_impl="xla"), "/ckpt")


if __name__ == "__main__":
  absltest.main()
