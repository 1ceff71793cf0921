"""The pipeline executor against the unpipelined model: loss and gradients, every schedule."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import mesh as mesh_lib
from jaxsys.data import packing
from jaxsys.models import transformer
from jaxsys.parallel import pipeline
from jaxsys.train import step as step_lib

CFG = transformer.TransformerConfig(vocab_size=61, d_model=32, n_layers=4, n_heads=4,
                                    n_kv_heads=2, d_ff=64, attention_impl="xla")


def _batch(batch=8, seq=16, seed=0):
  b = packing.random_packed_batch(batch, seq, docs_per_row=2, vocab_size=CFG.vocab_size, seed=seed)
  return {k: jnp.asarray(v) for k, v in b.items()}


@functools.lru_cache(maxsize=None)
def _reference(tie: bool):
  cfg = dataclasses_replace(CFG, tie_embeddings=tie)
  params = transformer.init_params(cfg, jax.random.key(1))
  batch = _batch()
  loss_fn = lambda p: jnp.sum(step_lib.token_losses(cfg, p, batch))
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  return cfg, params, batch, loss, grads


def dataclasses_replace(cfg, **kw):
  import dataclasses
  return dataclasses.replace(cfg, **kw)


def _run(cfg, params, batch, mesh_spec, name, microbatches, virtual=1, vocab_parallel=False,
         algorithm=2):
  mesh = mesh_lib.make_mesh(mesh_spec)
  stages = dict(mesh.shape)["stage"]
  layout = pipeline.Layout(stages=stages, virtual=virtual, vocab_size=cfg.vocab_size,
                           vocab_parallel=vocab_parallel)
  schedule = pipeline.make_schedule(name, stages=stages, microbatches=microbatches,
                                    virtual_stages=virtual)
  staged = pipeline.to_stages(layout, params)
  fn = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(
      cfg, schedule, layout, p, b, mesh=mesh, vocab_algorithm=algorithm))
  loss, grads = fn(staged, batch)
  return loss, pipeline.from_stages(layout, grads)


CASES = [
    ("stage=2,data=4", "gpipe", 4, 1),
    ("stage=2,tensor=2,data=2", "1f1b", 4, 1),
    ("stage=4,data=2", "1f1b", 4, 1),
    ("stage=2,data=4", "interleaved_1f1b", 4, 2),
    ("stage=4,data=2", "gpipe", 8, 1),
    ("stage=4,tensor=2", "interleaved_1f1b", 8, 1),
]


@pytest.mark.parametrize("vocab_parallel", [False, True])
@pytest.mark.parametrize("mesh_spec,name,microbatches,virtual", CASES)
def test_matches_unpipelined(mesh_spec, name, microbatches, virtual, vocab_parallel):
  cfg, params, batch, ref_loss, ref_grads = _reference(False)
  loss, grads = _run(cfg, params, batch, mesh_spec, name, microbatches, virtual, vocab_parallel)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_close(grads, ref_grads)


def assert_close(tree, ref, rtol=1e-5):
  """Every leaf within rtol of the reference leaf's largest magnitude (summation order
  differs between microbatched and whole-batch gradients, so tiny entries wobble)."""
  chex.assert_trees_all_equal_shapes(tree, ref)
  for path, a, b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(tree),
                        jax.tree.leaves(ref)):
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    assert err < rtol, f"{jax.tree_util.keystr(path[0])}: relative error {err:.2e}"
