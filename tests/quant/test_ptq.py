"""quantize_params: calibration statistics, quantized logits near float, storage, orbax."""
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl.testing import absltest, parameterized

from jaxsys.kernels import quant_matmul as qm
from jaxsys.models import transformer
from jaxsys.quant import calibrate, ptq, rules

CFG = transformer.TransformerConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    d_ff=128)
GROUP = 32


def _batch(b=2, t=32, seed=1):
  tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)
  return {"inputs": tokens, "positions": jnp.broadcast_to(jnp.arange(t), (b, t)),
          "segment_ids": jnp.ones((b, t), jnp.int32)}


@jax.jit
def _logits(params, batch):
  return transformer.apply(CFG, params, batch["inputs"], batch["positions"], batch["segment_ids"])


def _relative_error(got, want) -> float:
  return float(jnp.mean(jnp.abs(got - want)) / jnp.mean(jnp.abs(want)))


class PtqTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params = transformer.init_params(CFG, jax.random.key(0))
    cls.calib = [_batch(seed=2)]
    cls.batch = _batch(seed=3)
    cls.ref = _logits(cls.params, cls.batch)
    cls.cache = {}

  def _quantized(self, scheme, method):
    if (scheme, method) not in self.cache:
      self.cache[scheme, method] = ptq.quantize_params(
          CFG, self.params, rules.default_rules(scheme, group_size=GROUP), method, self.calib)
    return self.cache[scheme, method]

  def test_stats_match_direct_computation(self):
    """Layer 0's attn_in statistics are those of rms_norm(embedding) computed by hand."""
    _, stats = calibrate.run_layers(CFG, self.params, self.calib)
    x = transformer.embed(CFG, self.params["embedding"], self.calib[0]["inputs"])
    h = transformer.rms_norm(x, self.params["layers"]["attn_norm"][0], CFG.norm_eps).reshape(-1, 64)
    s = stats[0]["attn_in"]
    np.testing.assert_allclose(s.xtx, h.T @ h, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s.absmax, jnp.max(jnp.abs(h), 0), rtol=1e-6)
    self.assertEqual(float(s.count), 64.0)
    self.assertEqual(set(stats[1]), {"attn_in", "attn_out", "mlp_in", "mlp_hidden"})
    chex.assert_shape(stats[1]["mlp_hidden"].xtx, (128, 128))

  # Relative logit error of a correct implementation on this model and batch (2026-11-23),
  # +-8%. Wrong ones measured outside: w4a16 RTN with 3-bit codes 0.315, floor instead
  # of round 0.452, scales 1.1x 0.269, w_down left float 0.122; w8a8 without the
  # activation quantization 0.0085 (int8) and 0.0416 (fp8), int8 scales 1.05x 0.112.
  @parameterized.parameters(
      ("w8a8_fp8", "rtn", 0.0587), ("w8a8_int8", "rtn", 0.0152),
      ("w8a8_int8", "smoothquant", 0.0150), ("w4a16", "rtn", 0.1359), ("w4a16", "gptq", 0.1540))
  def test_logits_close_to_float(self, scheme, method, expected):
    q = self._quantized(scheme, method)
    for name in transformer.LAYER_MATMULS:
      w = q["layers"][name]
      self.assertIsInstance(w, qm.QWeight)
      self.assertEqual(w.scheme, scheme)
      self.assertEqual(w.data.shape[0], CFG.n_layers)
    self.assertNotIsInstance(q["unembedding"], qm.QWeight)  # head stays float by default
    got = _logits(q, self.batch)
    self.assertBetween(_relative_error(got, self.ref), 0.92 * expected, 1.08 * expected)
    if method == "gptq":  # on its calibration batch GPTQ must beat round-to-nearest
      ref = _logits(self.params, self.calib[0])
      mse = lambda q: float(jnp.mean((_logits(q, self.calib[0]) - ref) ** 2))
      self.assertLess(mse(q), mse(self._quantized(scheme, "rtn")))

  def test_head_rule_and_storage(self):
    rs = (rules.Rule("layers/w_down", None),) + rules.default_rules("w4a16", group_size=GROUP,
                                                                     head=True)
    q = ptq.quantize_params(CFG, self.params, rs, "rtn")
    self.assertNotIsInstance(q["layers"]["w_down"], qm.QWeight)
    self.assertIsInstance(q["unembedding"], qm.QWeight)
    # w_down float, the head int4: 0.1562 when correct (see test_logits_close_to_float).
    self.assertBetween(_relative_error(_logits(q, self.batch), self.ref), 0.92 * 0.1562,
                       1.08 * 0.1562)
    # The tiny config's shapes (d_model 256, d_ff 768), group 128: int4 + f32 scales.
    tiny = transformer.TransformerConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768)
    fp = jax.eval_shape(lambda: transformer.init_params(tiny, jax.random.key(0)))
    w4 = jax.eval_shape(lambda p: ptq.quantize_params(tiny, p, rules.default_rules("w4a16")), fp)
    bf16 = ptq.weight_bytes(fp) // 2  # float32 params
    self.assertLessEqual(ptq.weight_bytes(w4) / bf16, 0.27)

  def test_orbax_round_trip(self):
    q = ptq.quantize_params(CFG, self.params, rules.default_rules("w4a16", group_size=GROUP)
                            + (rules.Rule("embedding", "w8a8_fp8"),), "rtn")
    with tempfile.TemporaryDirectory() as tmp:
      with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp + "/q", q)
      with ocp.StandardCheckpointer() as ckpt:
        back = ckpt.restore(tmp + "/q", jax.eval_shape(lambda: q))
    chex.assert_trees_all_equal(back, q)
    chex.assert_trees_all_equal_structs(back, q)
    self.assertEqual(back["layers"]["wq"].scheme, "w4a16")
    np.testing.assert_array_equal(_logits(back, self.batch), _logits(q, self.batch))

  def test_bad_input(self):
    rs = rules.default_rules("w4a16", group_size=GROUP)
    with self.assertRaisesRegex(ValueError, r"method='awq' is not known"):
      ptq.quantize_params(CFG, self.params, rs, "awq")
    with self.assertRaisesRegex(ValueError, r"method='gptq' needs calib_batches"):
      ptq.quantize_params(CFG, self.params, rs, "gptq")
    with self.assertRaisesRegex(ValueError, r"group_size=48 must be an even positive divisor"):
      ptq.quantize_params(CFG, self.params, rules.default_rules("w4a16", group_size=48), "rtn")
    q = self._quantized("w4a16", "rtn")
    with self.assertRaisesRegex(ValueError, r"params\['layers/wq'\] is a QWeight, not a float"):
      ptq.quantize_params(CFG, q, rs, "rtn")


if __name__ == "__main__":
  absltest.main()
