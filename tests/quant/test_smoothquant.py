"""SmoothQuant: folding keeps the float model; it lowers W8A8-INT8 error on outlier channels."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jaxsys.kernels import quant_matmul as qm
from jaxsys.models import transformer
from jaxsys.quant import calibrate, smoothquant

# GQA (4 query heads on 2 kv heads), so the wo fold must tie s over query heads.
CFG = transformer.TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    d_ff=64)


def _batch(b=2, t=16):
  tokens = jax.random.randint(jax.random.key(1), (b, t), 0, CFG.vocab_size)
  return {"inputs": tokens, "positions": jnp.broadcast_to(jnp.arange(t), (b, t)),
          "segment_ids": jnp.ones((b, t), jnp.int32)}


class SmoothQuantTest(parameterized.TestCase):

  def test_factors(self):
    s = smoothquant.smoothing_factors(jnp.array([4.0, 1.0, 0.0]), jnp.array([1.0, 4.0, 2.0]), 0.5)
    np.testing.assert_allclose(s, [2.0, 0.5, 1.0])
    with self.assertRaisesRegex(ValueError, r"alpha=1.5 must be in \[0, 1\]"):
      smoothquant.smoothing_factors(jnp.ones(2), jnp.ones(2), 1.5)

  def test_folding_is_exact(self):
    """Every group smoothed (norm folds, wv and w_up column folds): same logits in float."""
    params = transformer.init_params(CFG, jax.random.key(0))
    # Make the smoothing non-trivial: outlier channels in the residual stream.
    params["embedding"] = params["embedding"] * jnp.where(jnp.arange(32) % 7 == 0, 30.0, 1.0)
    batch = _batch()
    _, stats = calibrate.run_layers(CFG, params, [batch])
    smoothed = [smoothquant.smooth_layer(CFG, calibrate.layer(params["layers"], l), stats[l], 0.5)
                for l in range(CFG.n_layers)]
    changed = {n: float(jnp.max(jnp.abs(smoothed[0][n] - params["layers"][n][0])))
               for n in params["layers"]}
    self.assertTrue(all(v > 1e-3 for v in changed.values()), changed)
    out = dict(params, layers=calibrate.stack_layers(smoothed))
    logits = jax.jit(lambda p: transformer.apply(CFG, p, batch["inputs"], batch["positions"],
                                                 batch["segment_ids"]))
    chex.assert_trees_all_close(logits(out), logits(params), rtol=1e-4, atol=1e-4)

  def test_lowers_int8_error_with_outlier_channels(self):
    k1, k2 = jax.random.split(jax.random.key(2))
    x = jax.random.normal(k1, (256, 64)) * jnp.where(jnp.arange(64) % 9 == 0, 50.0, 1.0)
    w = jax.random.normal(k2, (64, 48)) / 8
    exact = x @ w
    err = lambda y: float(jnp.linalg.norm(y - exact))
    plain = err(qm.qmatmul(x, qm.quantize_weight(w, "w8a8_int8"), impl="reference"))
    s = smoothquant.smoothing_factors(jnp.max(jnp.abs(x), 0), jnp.max(jnp.abs(w), 1), 0.5)
    np.testing.assert_allclose((x / s) @ (w * s[:, None]), exact, rtol=1e-4, atol=1e-3)
    smooth = err(qm.qmatmul(x / s, qm.quantize_weight(w * s[:, None], "w8a8_int8"),
                            impl="reference"))
    self.assertLess(smooth, 0.5 * plain)

  def test_unknown_group(self):
    with self.assertRaisesRegex(ValueError, r"groups=\['qkv'\] unknown"):
      smoothquant.smooth_layer(CFG, {}, {}, 0.5, groups=("qkv",))


if __name__ == "__main__":
  absltest.main()
