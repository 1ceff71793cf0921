"""Transformer: shapes, axes, causality, document isolation, GQA, tied embeddings, bf16, remat."""
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
import pytest

from jaxsys import hlo_flops
from jaxsys.models import transformer

CFG = transformer.TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    d_ff=64)


def _inputs(b=2, t=12, seed=0):
  tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  return tokens, positions, jnp.ones((b, t), jnp.int32)


def _dots(stablehlo: str) -> list[tuple[set[int], set[str]]]:
  """(operand dims, operand element types) of every dot_general in a lowered module's text."""
  out = []
  for sig in re.findall(r"stablehlo\.dot_general .*: \(tensor<([^>]*)>, tensor<([^>]*)>\)",
                        stablehlo):
    operands = [t.split("x") for t in sig]
    out.append(({int(d) for o in operands for d in o[:-1]}, {o[-1] for o in operands}))
  return out


def _dot_flops(jaxpr) -> int:
  """2 x M x N x K summed over the dot_generals of a jaxpr, scan bodies times their length."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      k = math.prod(eqn.invars[0].aval.shape[d] for d in contract)
      total += 2 * k * math.prod(eqn.outvars[0].aval.shape)
    repeat = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
        if hasattr(sub, "eqns"):
          total += repeat * _dot_flops(sub)
  return total


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

  @pytest.mark.slow
  def test_bf16_compute_f32_params(self):
    cfg = transformer.TransformerConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    params = transformer.init_params(cfg, jax.random.key(0))
    chex.assert_trees_all_equal_dtypes(params, jax.tree.map(lambda p: p.astype(jnp.float32), params))
    logits32 = transformer.apply(CFG, params, *_inputs())
    logits16 = transformer.apply(cfg, params, *_inputs())
    chex.assert_type(logits16, jnp.float32)
    np.testing.assert_allclose(logits16, logits32, atol=0.1)
    self.assertGreater(float(jnp.abs(logits16 - logits32).max()), 1e-4)  # not an f32 run
    # The matmuls of a training step take bf16 operands (the f32 model's take f32, so the
    # check sees what it is meant to), except the LM head's backward: JAX promotes its
    # bf16 weight to the f32 logits' cotangent. A vocab size no other dim has finds it.
    vocab = 48
    with_vocab = lambda **kw: transformer.TransformerConfig(**{**CFG.__dict__, "vocab_size": vocab,
                                                               **kw})
    p = transformer.init_params(with_vocab(), jax.random.key(0))
    for dtype, want in (("bfloat16", "bf16"), ("float32", "f32")):
      c = with_vocab(dtype=dtype)
      grad = jax.grad(lambda p: jnp.mean(transformer.apply(c, p, *_inputs()) ** 2))
      dots = _dots(jax.jit(grad).lower(p).as_text())
      layer_types = [types for dims, types in dots if vocab not in dims]
      # A layer's 7 weights x (fwd, dx, dw) and attention's 2 + 4 (one copy per function).
      self.assertGreaterEqual(len(layer_types), 7 * 3 + 6, dtype)
      self.assertEqual(set.union(*layer_types), {want}, dtype)
      head = [types for dims, types in dots if vocab in dims]
      self.assertIn({want}, head, dtype)  # the forward's output projection
    # The training loss (`transformer.losses`, its backward by hand) runs every matmul of
    # the step in bf16, the output layer's backward too.
    c = with_vocab(dtype="bfloat16")
    tokens = _inputs()[0] % vocab
    grad = jax.grad(lambda p: jnp.mean(transformer.losses(c, p, tokens, tokens)))
    self.assertEqual(set.union(*[t for _, t in _dots(jax.jit(grad).lower(p).as_text())]),
                     {"bf16"})

  @pytest.mark.slow
  def test_remat_matches_and_saves_less(self):
    """Same gradients; the saved residuals shrink by what each policy must recompute, and
    the compiled backward recomputes exactly the matmuls the policy leaves out."""
    params = transformer.init_params(CFG, jax.random.key(0))
    tokens = _inputs(t=64)[0]  # more than one attention tile: the kernel's own residuals
    grads, saved, flops = {}, {}, {}
    for remat in ("none", "minimal", "dots", "qkv", "full"):
      cfg = transformer.TransformerConfig(**{**CFG.__dict__, "remat": remat,
                                             "attention_impl": "xla"})
      loss = lambda p: jnp.mean(transformer.losses(cfg, p, tokens, tokens))
      # The vjp's leaves are the residuals the forward keeps for the backward.
      _, vjp = jax.jit(lambda p: jax.vjp(loss, p))(params)
      saved[remat] = sum(x.size for x in jax.tree.leaves(vjp))
      grads[remat] = vjp(jnp.ones(()))[0]
      flops[remat] = hlo_flops.dot_flops(jax.jit(jax.grad(loss)).lower(params).compile()
                                         .as_text())
    for remat in ("minimal", "dots", "qkv", "full"):
      chex.assert_trees_all_close(grads[remat], grads["none"], atol=1e-6)
    (b, t), L, D, F = tokens.shape, CFG.n_layers, CFG.d_model, CFG.d_ff
    # minimal keeps every projection and the flash attention's output and statistics: no
    # matmul and no attention forward again; dots reruns the attention (its output is no
    # plain dot), qkv every other matmul too, full the whole layer.
    self.assertEqual(flops["minimal"], flops["none"])
    self.assertLess(flops["minimal"], flops["dots"])
    self.assertLess(flops["dots"], flops["qkv"])
    self.assertLess(flops["qkv"], flops["full"])
    # What each keeps beyond the next: minimal's attention output over dots'; dots' output
    # projection and SwiGLU's gate and up over qkv's; qkv's q, k, v over full's.
    self.assertGreaterEqual(saved["minimal"] - saved["dots"], L * b * t * CFG.n_heads * CFG.hd)
    self.assertGreaterEqual(saved["dots"] - saved["qkv"], L * b * t * (D + 2 * F))
    self.assertEqual(saved["qkv"] - saved["full"],
                     L * b * t * (CFG.n_heads + 2 * CFG.n_kv_heads) * CFG.hd)

  @parameterized.parameters(dict(tie=False), dict(tie=True))
  def test_train_flops_per_token_counts_the_models_dots(self, tie):
    """3x the forward's dot FLOPs, read from its jaxpr; reference attention does all T x T."""
    cfg = transformer.TransformerConfig(**{**CFG.__dict__, "tie_embeddings": tie,
                                           "attention_impl": "reference"})
    params = transformer.init_params(cfg, jax.random.key(0))
    tokens = _inputs()[0]
    b, t = tokens.shape
    dots = _dot_flops(jax.make_jaxpr(lambda p: transformer.apply(cfg, p, *_inputs()))(params).jaxpr)
    self.assertEqual(transformer.train_flops_per_token(cfg, t) * b * t, 3 * dots)
    causal = transformer.train_flops_per_token(cfg, t, pairs_per_row=t * (t + 1) / 2)
    attention = 3 * 4 * cfg.n_layers * cfg.n_heads * cfg.hd * t * (t - 1) / 2 / t  # pairs k > q
    self.assertAlmostEqual(transformer.train_flops_per_token(cfg, t) - causal, attention)

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
