"""The one Pallas backend resolver: flavor and interpret mode per backend."""
from absl.testing import absltest, parameterized
from jax.experimental.pallas import tpu as pltpu

from jaxsys.kernels import backends


class ResolveInterpretTest(parameterized.TestCase):

  @parameterized.parameters(
      ("gpu", "cpu", True), ("tpu", "cpu", True), ("gpu", "gpu", False), ("tpu", "tpu", False))
  def test_default_compiles_on_own_backend_interprets_on_cpu(self, flavor, backend, want):
    self.assertIs(backends.resolve_interpret("k", flavor, None, backend), want)

  @parameterized.parameters(("gpu", "tpu", "GPU .Triton.*TPU"), ("tpu", "gpu", "TPU .Mosaic.*GPU"))
  def test_default_refuses_the_other_accelerator(self, flavor, backend, message):
    with self.assertRaisesRegex(NotImplementedError, f"^k: .*{message}.*interpret=True"):
      backends.resolve_interpret("k", flavor, None, backend)

  def test_explicit_values_pass_through(self):
    params = pltpu.InterpretParams()
    self.assertIs(backends.resolve_interpret("k", "tpu", params, "cpu"), params)
    for backend in ("cpu", "gpu", "tpu"):  # False compiles anywhere: jax.export for a device
      self.assertIs(backends.resolve_interpret("k", "gpu", False, backend), False)
      self.assertIs(backends.resolve_interpret("k", "tpu", True, backend), True)

  def test_bad_values_are_one_line(self):
    with self.assertRaisesRegex(ValueError, r"^k: interpret='yes' is not valid; pass None, True, "
                                r"False or a pltpu.InterpretParams$"):
      backends.resolve_interpret("k", "tpu", "yes", "cpu")
    with self.assertRaisesRegex(ValueError, r"^k: interpret=.*; pass None, True, False$"):
      backends.resolve_interpret("k", "gpu", pltpu.InterpretParams(), "cpu")
    with self.assertRaisesRegex(ValueError, r"^k: flavor='metal' is not known"):
      backends.pallas_flavor("k", "metal")

  def test_flavor_follows_the_backend(self):
    self.assertEqual(backends.pallas_flavor("k", None, "tpu"), "tpu")
    self.assertEqual(backends.pallas_flavor("k", None, "cpu"), "gpu")
    self.assertEqual(backends.pallas_flavor("k", "tpu", "cpu"), "tpu")


if __name__ == "__main__":
  absltest.main()
