"""The attention entry point: every impl agrees with the reference; dispatch; bad input."""
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jaxsys.kernels import attention as attention_lib


def _qkv(b=2, t=40, hq=4, hkv=2, d=16, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, t, hq, d)), jax.random.normal(kk, (b, t, hkv, d)),
          jax.random.normal(kv, (b, t, hkv, d)))


class AttentionDispatchTest(parameterized.TestCase):

  @parameterized.product(impl=["pallas", "xla"], causal=[True, False])
  def test_matches_reference_values_and_grads(self, impl, causal):
    q, k, v = _qkv()
    seg = jnp.asarray(np.repeat([[1, 2, 3, 3], [1, 1, 2, 4]], 10, axis=1), jnp.int32)
    ct = jax.random.normal(jax.random.key(9), q.shape)

    def loss(impl):
      return lambda q, k, v: jnp.sum(ct * attention_lib.attention(
          q, k, v, segment_ids=seg, causal=causal, impl=impl))

    np.testing.assert_allclose(
        attention_lib.attention(q, k, v, segment_ids=seg, causal=causal, impl=impl),
        attention_lib.attention(q, k, v, segment_ids=seg, causal=causal, impl="reference"),
        atol=2e-5, rtol=2e-5)
    got = jax.grad(loss(impl), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss("reference"), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)

  def test_auto_resolves_by_backend(self):
    self.assertEqual(attention_lib.resolve_impl("auto", "cpu"), "xla")
    self.assertEqual(attention_lib.resolve_impl("auto", "gpu"), "pallas")
    self.assertEqual(attention_lib.resolve_impl("auto", "tpu"), "pallas")

  @parameterized.parameters(
      dict(kw=dict(impl="flash"), match="impl='flash'"),
      dict(kw=dict(segment_ids=jnp.zeros((2, 39), jnp.int32)), match="segment_ids"),
      dict(kw=dict(segment_ids=jnp.zeros((2, 40), jnp.float32)), match="integer"),
  )
  def test_bad_input(self, kw, match):
    q, k, v = _qkv()
    with self.assertRaisesRegex(ValueError, match):
      attention_lib.attention(q, k, v, **kw)

  def test_heads_must_divide(self):
    q, k, v = _qkv(hq=3, hkv=2)
    with self.assertRaisesRegex(ValueError, r"q heads \(3\) must be a multiple of k/v heads \(2\)"):
      attention_lib.attention(q, k, v)


if __name__ == "__main__":
  absltest.main()
