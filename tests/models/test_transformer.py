"""Transformer: shapes, axes, causality, document isolation, GQA, tied embeddings."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jaxsys.models import transformer

CFG = transformer.TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    d_ff=64)


def _inputs(b=2, t=12, seed=0):
  tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  return tokens, positions, jnp.ones((b, t), jnp.int32)


class TransformerTest(parameterized.TestCase):

  @parameterized.parameters(dict(tie=False), dict(tie=True))
  def test_shapes_and_axes(self, tie):
    cfg = transformer.TransformerConfig(**{**CFG.__dict__, "tie_embeddings": tie})
    params = transformer.init_params(cfg, jax.random.key(0))
    axes = transformer.param_axes(cfg)
    # Every parameter is annotated, one logical name per dimension; layers are stacked first.
    jax.tree.map(lambda p, a: self.assertLen(a, p.ndim), params, axes,
                 is_leaf=lambda x: isinstance(x, tuple))
    for name, p in params["layers"].items():
      self.assertEqual(p.shape[0], cfg.n_layers, name)
      self.assertEqual(axes["layers"][name][0], "layers")
    self.assertEqual("unembedding" in params, not tie)
    self.assertEqual(sum(p.size for p in jax.tree.leaves(params)), transformer.param_count(cfg))
    logits = transformer.apply(cfg, params, *_inputs())
    chex.assert_shape(logits, (2, 12, cfg.vocab_size))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)
    # Initial logits are O(1) so the first loss is near log(vocab).
    self.assertBetween(float(jnp.std(logits)), 0.3, 3.0)

  def test_causal(self):
    params = transformer.init_params(CFG, jax.random.key(1))
    tokens, positions, seg = _inputs()
    base = transformer.apply(CFG, params, tokens, positions, seg)
    changed = transformer.apply(CFG, params, tokens.at[:, 7].set((tokens[:, 7] + 1) % 64),
                                positions, seg)
    np.testing.assert_allclose(base[:, :7], changed[:, :7], atol=1e-6)
    self.assertGreater(float(jnp.abs(base[:, 7:] - changed[:, 7:]).max()), 1e-4)

  def test_packed_documents_are_isolated(self):
    """Two documents packed in one row give the same logits as each alone."""
    params = transformer.init_params(CFG, jax.random.key(2))
    a = jax.random.randint(jax.random.key(3), (1, 5), 0, 64)
    b = jax.random.randint(jax.random.key(4), (1, 7), 0, 64)
    packed = jnp.concatenate([a, b], axis=1)
    positions = jnp.concatenate([jnp.arange(5), jnp.arange(7)])[None]
    seg = jnp.array([[1] * 5 + [2] * 7])
    out = transformer.apply(CFG, params, packed, positions, seg)
    alone_a = transformer.apply(CFG, params, a, jnp.arange(5)[None], jnp.ones((1, 5), jnp.int32))
    alone_b = transformer.apply(CFG, params, b, jnp.arange(7)[None], jnp.ones((1, 7), jnp.int32))
    np.testing.assert_allclose(out[:, :5], alone_a, atol=2e-5)
    np.testing.assert_allclose(out[:, 5:], alone_b, atol=2e-5)

  def test_bf16_compute_f32_params(self):
    cfg = transformer.TransformerConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    params = transformer.init_params(cfg, jax.random.key(0))
    chex.assert_trees_all_equal_dtypes(params, jax.tree.map(lambda p: p.astype(jnp.float32), params))
    logits32 = transformer.apply(CFG, params, *_inputs())
    logits16 = transformer.apply(cfg, params, *_inputs())
    chex.assert_type(logits16, jnp.float32)
    np.testing.assert_allclose(logits16, logits32, atol=0.1)

  def test_remat_matches(self):
    cfg = transformer.TransformerConfig(**{**CFG.__dict__, "remat": "full"})
    params = transformer.init_params(CFG, jax.random.key(0))
    loss = lambda c: lambda p: jnp.mean(transformer.apply(c, p, *_inputs()) ** 2)
    chex.assert_trees_all_close(jax.grad(loss(CFG))(params), jax.grad(loss(cfg))(params),
                                atol=1e-6)

  @parameterized.parameters(
      dict(field="n_kv_heads", value=3, match="n_kv_heads"),
      dict(field="remat", value="some", match="model.remat"),
      dict(field="dtype", value="float33", match="model.dtype"),
  )
  def test_bad_config(self, field, value, match):
    with self.assertRaisesRegex(ValueError, match):
      transformer.TransformerConfig(**{**CFG.__dict__, field: value})


if __name__ == "__main__":
  absltest.main()
