"""GPTQ: equals RTN when inputs are uncorrelated; beats RTN on correlated / outlier inputs."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jaxsys.kernels import quant_matmul as qm
from jaxsys.quant import gptq

K, N, M = 64, 32, 512


def _layer(outliers: bool, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  mix = jax.random.normal(k1, (K, K)) / 8 + jnp.eye(K)  # correlated input channels
  x = jax.random.normal(k2, (M, K)) @ mix
  if outliers:  # a few channels 20x larger, as in LLM activations
    x = x * jnp.where(jnp.arange(K) % 29 == 0, 20.0, 1.0)
  w = jax.random.normal(k3, (K, N)) / jnp.sqrt(K)
  return x, w


def _err(x, w, qw):
  return float(jnp.linalg.norm(x @ qm.dequantize(qw) - x @ w))


class GptqTest(parameterized.TestCase):

  @parameterized.parameters(("w8a8_int8", False), ("w8a8_fp8", True), ("w4a16", False),
                            ("w4a16", True))
  def test_identity_hessian_is_rtn(self, scheme, act_order):
    """With H ~ I no error is propagated: codes and scales are exactly RTN's (the reference)."""
    _, w = _layer(False)
    got = gptq.gptq_quantize(w, jnp.eye(K), scheme, group_size=32, act_order=act_order)
    want = qm.quantize_weight(w, scheme, group_size=32)
    chex.assert_trees_all_equal(got, want)

  @parameterized.parameters(
      ("w8a8_int8", False, False), ("w8a8_fp8", True, False), ("w4a16", False, False),
      ("w4a16", True, False), ("w4a16", True, True))
  def test_beats_rtn_on_layer_output(self, scheme, outliers, act_order):
    x, w = _layer(outliers)
    h = x.T @ x
    rtn = _err(x, w, qm.quantize_weight(w, scheme, group_size=32))
    qw = gptq.gptq_quantize(w, h, scheme, group_size=32, block_size=16, act_order=act_order)
    group = 32 if scheme == "w4a16" else K
    self.assertEqual((qw.scheme, qw.group_size, qw.shape), (scheme, group, (K, N)))
    self.assertLess(_err(x, w, qw), 0.9 * rtn)

  def test_dead_inputs_and_block_sizes(self):
    """Never-active inputs get code 0; the block size changes only the order of float sums."""
    x, w = _layer(False, seed=1)
    x = x.at[:, :5].set(0.0)
    h = x.T @ x
    a = gptq.gptq_quantize(w, h, "w4a16", group_size=32, block_size=32)
    b = gptq.gptq_quantize(w, h, "w4a16", group_size=32, block_size=8)
    np.testing.assert_array_equal(qm.codes_of(a)[:5], 0)
    same = np.mean(np.asarray(qm.codes_of(a)) == np.asarray(qm.codes_of(b)))
    self.assertGreater(same, 0.99)

  def test_bad_input(self):
    _, w = _layer(False)
    with self.assertRaisesRegex(ValueError, r"scheme='int4' is not known"):
      gptq.gptq_quantize(w, jnp.eye(K), "int4")
    with self.assertRaisesRegex(ValueError, r"hessian \(4, 4\)"):
      gptq.gptq_quantize(w, jnp.eye(4), "w4a16")
    with self.assertRaisesRegex(ValueError, r"group_size=48 must divide K=64"):
      gptq.gptq_quantize(w, jnp.eye(K), "w4a16", group_size=48)


if __name__ == "__main__":
  absltest.main()
