"""Rules: a path regex picks each weight's scheme; unknown schemes are refused."""
import jax
from absl.testing import absltest, parameterized

from jaxsys.models import transformer
from jaxsys.quant import rules

CFG = transformer.TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    d_ff=64)


class RulesTest(parameterized.TestCase):

  def test_first_match_wins_and_none_keeps_float(self):
    rs = (rules.Rule("layers/w_down", None), rules.Rule("layers/w_.*", "w4a16", group_size=32),
          rules.Rule("layers/.*", "w8a8_int8"))
    self.assertIsNone(rules.scheme_for("layers/w_down", rs))
    self.assertEqual(rules.scheme_for("layers/w_up", rs).scheme, "w4a16")
    self.assertEqual(rules.scheme_for("layers/w_up", rs).group_size, 32)
    self.assertEqual(rules.scheme_for("layers/wq", rs).scheme, "w8a8_int8")
    self.assertIsNone(rules.scheme_for("unembedding", rs))  # full match only
    self.assertIsNone(rules.scheme_for("layers/wq_extra", (rules.Rule("layers/wq", "w4a16"),)))

  def test_assign_on_model_params(self):
    params = jax.eval_shape(lambda: transformer.init_params(CFG, jax.random.key(0)))
    got = rules.assign(params, rules.default_rules("w8a8_fp8"))
    self.assertEqual(sorted(got), sorted(f"layers/{n}" for n in transformer.LAYER_MATMULS))
    # Norm scales are never candidates, even for a catch-all rule; the head is opt-in.
    got = rules.assign(params, (rules.Rule(".*", "w8a8_int8"),))
    self.assertEqual(sorted(got), sorted([f"layers/{n}" for n in transformer.LAYER_MATMULS]
                                         + ["embedding", "unembedding"]))
    got = rules.assign(params, rules.default_rules("w4a16", head=True))
    self.assertIn("unembedding", got)
    self.assertNotIn("embedding", got)

  @parameterized.parameters("int8", "w4a8", "W8A8_INT8", "")
  def test_unknown_scheme_refused(self, scheme):
    with self.assertRaisesRegex(ValueError, rf"scheme='{scheme}' is not known; choose one of"):
      rules.Rule("layers/.*", scheme)

  def test_bad_regex_and_group_refused(self):
    with self.assertRaisesRegex(ValueError, r"path='layers/\(' is not a valid regex"):
      rules.Rule("layers/(", "w4a16")
    with self.assertRaisesRegex(ValueError, r"group_size=0 must be a positive int"):
      rules.Rule("layers/.*", "w4a16", group_size=0)


if __name__ == "__main__":
  absltest.main()
