"""qwix baseline: the per-matmul model is our model in float; qwix really quantizes each scheme."""
import chex
import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

from jaxsys.models import transformer
from jaxsys.quant import ptq, qwix_baseline, rules

CFG = transformer.TransformerConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    d_ff=128)


class QwixBaselineTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params = transformer.init_params(CFG, jax.random.key(0))
    t = 16
    cls.args = (jax.random.randint(jax.random.key(1), (2, t), 0, 64),
                jnp.broadcast_to(jnp.arange(t), (2, t)), jnp.ones((2, t), jnp.int32))
    cls.ref = transformer.apply(CFG, cls.params, *cls.args)

  def test_float_model_is_ours(self):
    got = qwix_baseline.QwixTransformer(CFG, self.params)(*self.args)
    chex.assert_trees_all_close(got, self.ref, atol=1e-5, rtol=1e-5)

  @parameterized.parameters(("w8a8_int8", 0.55), ("w8a8_fp8", 0.55), ("w4a16", 0.32))
  def test_quantizes_every_layer_matmul(self, scheme, max_bytes_ratio):
    model = qwix_baseline.quantize(CFG, self.params, scheme, self.args[0], group_size=32)
    got = model(*self.args)
    # Really quantized (weight-only rules too), and close to our RTN of the same scheme.
    ours = transformer.apply(CFG, ptq.quantize_params(
        CFG, self.params, rules.default_rules(scheme, group_size=32), "rtn"), *self.args)
    scale = float(jnp.mean(jnp.abs(self.ref)))
    self.assertGreater(float(jnp.mean(jnp.abs(got - self.ref))) / scale, 1e-3)
    self.assertLess(float(jnp.mean(jnp.abs(got - ours))) / scale,
                    2 * float(jnp.mean(jnp.abs(ours - self.ref))) / scale)
    float_bytes = ptq.weight_bytes(self.params) // 2  # bf16 bytes of the float32 matmuls
    self.assertLess(qwix_baseline.weight_bytes(model) / float_bytes, max_bytes_ratio)

  def test_unknown_scheme(self):
    with self.assertRaisesRegex(ValueError, r"scheme='int4' is not known"):
      qwix_baseline.qwix_rules("int4")


if __name__ == "__main__":
  absltest.main()
