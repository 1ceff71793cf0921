"""The output layer's cross-entropy: exact against optax's on whole logits, in any number of
vocabulary tiles, and keeping for the backward only what it says."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized

from jaxsys.models import output_layer

B, T, D, V = 2, 64, 16, 96  # D x V < B x T x V / 4: the weight is smaller than a logits tile


def _inputs(dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(k[0], (B, T, D)).astype(dtype)
  w = (jax.random.normal(k[1], (D, V)) * 0.5).astype(dtype)
  targets = jax.random.randint(k[2], (B, T), 0, V)
  weights = jax.random.uniform(k[3], (B, T)) * (jnp.arange(T) % 5 != 0)  # some tokens masked
  return h, w, targets, weights


def _reference(h, w, targets, weights):
  logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
  return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights)


def _tiled(tiles):
  return lambda h, w, targets, weights: jnp.sum(
      output_layer.token_losses(h, w, targets, tiles) * weights)


def _largest_buffer(fn, *args) -> int:
  """Elements of the largest array in `fn`'s compiled gradient program."""
  text = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(*args).compile().as_text()
  return max(np.prod([int(d) for d in dims.split(",") if d] or [1])
             for dims in re.findall(r"\b(?:f32|bf16|s32|pred)\[([\d,]*)\]", text))


class OutputLayerTest(parameterized.TestCase):

  @parameterized.parameters(1, 2, 3, 4, 96)
  def test_matches_optax_on_whole_logits(self, tiles):
    args = _inputs()
    got, got_grads = jax.value_and_grad(_tiled(tiles), argnums=(0, 1))(*args)
    want, want_grads = jax.value_and_grad(_reference, argnums=(0, 1))(*args)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, r in zip(got_grads, want_grads):
      np.testing.assert_allclose(g, r, atol=2e-6)

  def test_bf16_tiles_agree_with_the_whole_vocabulary(self):
    """Tiles change only the order of the logsumexp's sums: each tile's logits are the same
    bf16 matmul outputs as the whole layer's."""
    args = _inputs(jnp.bfloat16)
    whole, whole_grads = jax.value_and_grad(_tiled(1), argnums=(0, 1))(*args)
    tiled, tiled_grads = jax.value_and_grad(_tiled(4), argnums=(0, 1))(*args)
    np.testing.assert_allclose(tiled, whole, rtol=1e-6)
    for g, r in zip(tiled_grads, whole_grads):
      self.assertEqual(g.dtype, jnp.bfloat16)  # the weight gradient is a bf16 matmul
      np.testing.assert_allclose(g.astype(jnp.float32), r.astype(jnp.float32), atol=1e-2)

  def test_saves_bf16_logits_or_none(self):
    """The backward's residuals: autodiff of optax's loss keeps float32 logits-sized
    tensors; the untiled layer keeps its bf16 logits; tiled, nothing of that size."""
    h, w, targets, weights = _inputs(jnp.bfloat16)

    def saved(fn):
      _, vjp = jax.vjp(lambda h, w: fn(h, w, targets, weights), h, w)
      return [(x.dtype, x.size) for x in jax.tree.leaves(vjp) if x.size >= B * T * V]

    self.assertIn((jnp.dtype(jnp.float32), B * T * V), saved(_reference))
    self.assertEqual(saved(_tiled(1)), [(jnp.dtype(jnp.bfloat16), B * T * V)])
    self.assertEqual(saved(_tiled(4)), [])

  def test_tiled_program_never_holds_the_whole_logits(self):
    args = _inputs()
    self.assertGreaterEqual(_largest_buffer(_reference, *args), B * T * V)
    self.assertGreaterEqual(_largest_buffer(_tiled(1), *args), B * T * V)
    self.assertLessEqual(_largest_buffer(_tiled(4), *args), B * T * V // 4)


if __name__ == "__main__":
  absltest.main()
