"""Quantized weights and qmatmul: error bounds, int4 packing, xla vs reference, pytree use.

Quantization error bounds on random and outlier-heavy weights; exact int4 packing (hypothesis
over shapes); `impl="xla"` against the dequantized reference for every scheme, f32 and bf16,
ragged and batched x; QWeight under jit, vmap, lax.scan, NamedSharding and an orbax round
trip; storage size; one-line errors. The Pallas kernels: test_quant_matmul_pallas.py.
"""
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl.testing import absltest, parameterized
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

from jaxsys.kernels import quant_matmul as qm

SCHEMES = qm.SCHEMES


def _weight(k, n, outliers=False, seed=0):
  """Gaussian [K, N] f32; with outliers, 1% of entries 50x larger (LLM-like heavy tails)."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((k, n), dtype=np.float32) * 0.05
  if outliers:
    mask = rng.random((k, n)) < 0.01
    w = np.where(mask, w * 50.0, w)
  return w


def _bound_ok(w, qw):
  """Per-element bound: |w - deq| <= scale / 2 (int) or the e4m3 rounding bound (fp8)."""
  deq = np.asarray(qm.dequantize(qw))
  k, n = qw.shape
  scale = np.repeat(np.asarray(qw.scale), qw.group_size, axis=0)  # [K, N]
  err = np.abs(w - deq)
  if qw.scheme == "w8a8_fp8":
    # 3 mantissa bits: relative error 2^-4 for normals; subnormal spacing 2^-9 (x scale).
    bound = np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10)
  else:
    bound = scale / 2
  return np.all(err <= bound * (1 + 1e-6) + 1e-12), float(np.max(err / bound))


class QuantizeTest(parameterized.TestCase):

  @parameterized.product(scheme=SCHEMES, outliers=(False, True))
  def test_error_bound(self, scheme, outliers):
    w = _weight(256, 48, outliers=outliers)
    qw = qm.quantize_weight(w, scheme, group_size=64)
    ok, worst = _bound_ok(w, qw)
    self.assertTrue(ok, f"{scheme}: worst error / bound = {worst}")
    self.assertEqual(qw.shape, (256, 48))
    chex.assert_shape(qm.dequantize(qw), (256, 48))

  def test_codes_and_dtypes(self):
    w = _weight(128, 16, outliers=True)
    i8 = qm.quantize_weight(w, "w8a8_int8")
    self.assertEqual(i8.data.dtype, jnp.int8)
    self.assertLessEqual(int(jnp.max(jnp.abs(i8.data.astype(jnp.int32)))), 127)
    self.assertEqual(i8.scale.shape, (1, 16))
    self.assertEqual(i8.group_size, 128)  # per channel: one group spans K
    f8 = qm.quantize_weight(w, "w8a8_fp8")
    self.assertEqual(f8.data.dtype, jnp.float8_e4m3fn)
    self.assertTrue(bool(jnp.all(jnp.isfinite(f8.data.astype(jnp.float32)))))
    i4 = qm.quantize_weight(w, "w4a16", group_size=32)
    self.assertEqual((i4.data.dtype, i4.data.shape, i4.scale.shape), (jnp.uint8, (64, 16), (4, 16)))
    codes = qm.unpack_int4(i4.data)
    self.assertTrue(bool(jnp.all((codes >= -8) & (codes <= 7))))
    # The group absmax lands on +-7 exactly (symmetric, scale = absmax / 7).
    np.testing.assert_array_equal(np.abs(np.asarray(codes)).reshape(4, 32, 16).max(1), 7)

  def test_zero_weight(self):
    for scheme in SCHEMES:
      qw = qm.quantize_weight(np.zeros((64, 8), np.float32), scheme, group_size=32)
      np.testing.assert_array_equal(qm.dequantize(qw), 0.0)

  def test_w4a16_storage_vs_bf16(self):
    # eval_shape: the storage of the real [4096, 4096] weight without materialising it.
    qw = jax.eval_shape(lambda w: qm.quantize_weight(w, "w4a16", group_size=128),
                        jax.ShapeDtypeStruct((4096, 4096), jnp.float32))
    bf16_bytes = 4096 * 4096 * 2
    self.assertEqual(qw.nbytes, 4096 * 2048 + 32 * 4096 * 4)
    self.assertLessEqual(qw.nbytes / bf16_bytes, 0.27)
    i8 = jax.eval_shape(lambda w: qm.quantize_weight(w, "w8a8_int8"),
                        jax.ShapeDtypeStruct((4096, 4096), jnp.float32))
    self.assertLessEqual(i8.nbytes / bf16_bytes, 0.51)

  def test_from_codes(self):
    rng = np.random.default_rng(1)
    c4 = rng.integers(-8, 8, (64, 8)).astype(np.int8)
    s4 = rng.random((2, 8)).astype(np.float32)
    qw = qm.from_codes(c4, s4, "w4a16", group_size=32)
    np.testing.assert_array_equal(qm.unpack_int4(qw.data), c4)
    np.testing.assert_allclose(qm.dequantize(qw), c4 * np.repeat(s4, 32, 0), rtol=1e-6)
    c8 = rng.integers(-127, 128, (64, 8)).astype(np.int8)
    qw8 = qm.from_codes(c8, s4[:1], "w8a8_int8")
    np.testing.assert_allclose(qm.dequantize(qw8), c8 * s4[:1], rtol=1e-6)
    cf = jnp.asarray(rng.standard_normal((64, 8)), jnp.float8_e4m3fn)
    qwf = qm.from_codes(cf, s4[:1], "w8a8_fp8")
    np.testing.assert_allclose(qm.dequantize(qwf), np.asarray(cf, np.float32) * s4[:1], rtol=1e-6)


class PackingTest(parameterized.TestCase):

  @settings(max_examples=12, deadline=None)
  @given(k2=st.integers(1, 12), n=st.integers(1, 9), lead=st.integers(0, 2),
         seed=st.integers(0, 2**16))
  @pytest.mark.slow
  def test_round_trip(self, k2, n, lead, seed):
    shape = (2,) * lead + (2 * k2, n)
    codes = np.random.default_rng(seed).integers(-8, 8, shape).astype(np.int8)
    packed = np.asarray(qm.pack_int4(codes))
    self.assertEqual((packed.dtype, packed.shape), (np.uint8, shape[:-2] + (k2, n)))
    np.testing.assert_array_equal(qm.unpack_int4(packed), codes)
    # Halves layout: byte row r = code row r (low nibble) | code row r + K/2 (high nibble).
    np.testing.assert_array_equal(packed & 0xF, codes[..., :k2, :].astype(np.uint8) & 0xF)

  def test_every_byte(self):
    packed = np.arange(256, dtype=np.uint8).reshape(1, 256)
    np.testing.assert_array_equal(qm.pack_int4(qm.unpack_int4(packed)), packed)


def _x(shape, dtype, seed=2):
  x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
  return jnp.asarray(x, dtype)


# Relative (to max |ref|) tolerance of a fast path against the reference.
TOL = {("w4a16", jnp.float32): 1e-5, ("w4a16", jnp.bfloat16): 2e-2}


def _tol(scheme, dtype):
  # w8a8 fast paths see the same codes as the reference (exact up to summation order and
  # the final cast); w4a16 in bf16 dequantizes into bf16, a relative rounding of 2^-8.
  return TOL.get((scheme, dtype), 1e-5 if dtype == jnp.float32 else 1e-2)


def assert_close_to_ref(test, out, ref, scheme, dtype):
  chex.assert_equal_shape([out, ref])
  test.assertEqual(out.dtype, ref.dtype)
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  err = np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-6)
  test.assertLessEqual(err, _tol(scheme, dtype), f"{scheme} {dtype}: rel err {err}")


class QMatmulXlaTest(parameterized.TestCase):

  @parameterized.product(scheme=SCHEMES, dtype=(jnp.float32, jnp.bfloat16),
                         x_shape=((1, 256), (33, 256), (2, 8, 256)))
  def test_xla_vs_reference(self, scheme, dtype, x_shape):
    w = _weight(256, 64, outliers=True)
    qw = qm.quantize_weight(w, scheme, group_size=64)
    x = _x(x_shape, dtype)
    ref = qm.qmatmul(x, qw, impl="reference")
    out = jax.jit(lambda x, qw: qm.qmatmul(x, qw, impl="xla"))(x, qw)
    chex.assert_shape(out, x_shape[:-1] + (64,))
    assert_close_to_ref(self, out, ref, scheme, dtype)
    self.assertEqual(qm.qmatmul(x, qw).dtype, dtype)  # auto: xla on CPU

  @parameterized.parameters(*SCHEMES)
  def test_reference_near_float_matmul(self, scheme):
    # The quantized product approximates x @ w; a sanity bound on the whole scheme.
    w = _weight(512, 64)
    x = _x((16, 512), jnp.float32)
    out = np.asarray(qm.qmatmul(x, qm.quantize_weight(w, scheme)))
    exact = np.asarray(x) @ w
    rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    self.assertLess(rel, {"w8a8_int8": 0.02, "w8a8_fp8": 0.06, "w4a16": 0.12}[scheme])

  def test_activation_codes(self):
    x = _x((4, 64), jnp.float32)
    for scheme, qmax in (("w8a8_int8", 127), ("w8a8_fp8", 448)):
      codes, scale = qm.quantize_activations(x, scheme)
      chex.assert_shape(scale, (4, 1))
      c = np.abs(np.asarray(codes, np.float32))
      np.testing.assert_array_equal(c.max(-1), qmax)  # absmax maps to the top code
      np.testing.assert_allclose(np.asarray(codes, np.float32) * scale, x,
                                 rtol=2**-4, atol=float(np.max(scale)) * 0.5)

  def test_w4a16_gradient(self):
    # w4a16 is differentiable in x (w8a8 rounds x: zero gradient almost everywhere).
    qw = qm.quantize_weight(_weight(128, 32), "w4a16", group_size=64)
    x, ct = _x((3, 128), jnp.float32), _x((3, 32), jnp.float32, seed=5)
    grad = lambda impl: jax.grad(lambda x: jnp.sum(qm.qmatmul(x, qw, impl=impl) * ct))(x)
    np.testing.assert_allclose(grad("xla"), grad("reference"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad("reference"), ct @ qm.dequantize(qw).T, rtol=1e-5, atol=1e-5)

  def test_zero_rows(self):
    qw = qm.quantize_weight(_weight(64, 8), "w8a8_int8")
    out = qm.qmatmul(jnp.zeros((2, 64)), qw)
    np.testing.assert_array_equal(out, 0.0)


class PytreeTest(parameterized.TestCase):

  def test_vmap_stack_and_scan(self):
    # PTQ: vmap quantize over stacked layers, then scan slices one layer at a time.
    ws = jnp.stack([_weight(128, 32, seed=s) for s in range(2)])
    x = _x((4, 128), jnp.float32)
    for scheme in SCHEMES:
      qws = jax.jit(jax.vmap(lambda w: qm.quantize_weight(w, scheme, group_size=64)))(ws)
      self.assertEqual(qws.shape, (128, 32))
      chex.assert_shape(qws.scale, (2, 1 if scheme != "w4a16" else 2, 32))

      def body(h, qw):
        return h, qm.qmatmul(h, qw, impl="xla")

      _, ys = jax.lax.scan(body, x, qws)
      want = jnp.stack([qm.qmatmul(x, qm.quantize_weight(ws[i], scheme, group_size=64),
                                   impl="reference") for i in range(2)])
      np.testing.assert_allclose(ys, want, rtol=1e-5, atol=1e-5)
      # vmap of qmatmul over the stacked weights gives the same.
      yv = jax.vmap(lambda qw: qm.qmatmul(x, qw, impl="xla"))(qws)
      np.testing.assert_allclose(yv, ys, rtol=1e-6, atol=1e-6)
      # Static metadata does not depend on the stacking.
      single = qm.quantize_weight(ws[0], scheme, group_size=64)
      self.assertEqual(jax.tree.structure(single), jax.tree.structure(qws))

  def test_sharding_on_n(self):
    mesh = jax.make_mesh((8,), ("tensor",))
    x = _x((16, 256), jnp.float32)
    for scheme in SCHEMES:
      qw = qm.quantize_weight(_weight(256, 64), scheme, group_size=64)
      sharded = jax.device_put(qw, NamedSharding(mesh, P(None, "tensor")))
      self.assertEqual(sharded.data.sharding.spec, P(None, "tensor"))
      out = jax.jit(lambda x, qw: qm.qmatmul(x, qw, impl="xla"))(x, sharded)
      np.testing.assert_allclose(out, qm.qmatmul(x, qw, impl="reference"), rtol=1e-5, atol=1e-5)
      # The output stays split over N: no gather of the weight.
      self.assertEqual(out.sharding.spec, P(None, "tensor"))

  def test_orbax_round_trip(self):
    tree = {"layers": {s: qm.quantize_weight(_weight(64, 16), s, group_size=32) for s in SCHEMES},
            "step": jnp.int32(3)}
    path = tempfile.mkdtemp() + "/ckpt"  # absl's create_tempdir needs parsed flags (pytest)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
      ckptr.save(path, args=ocp.args.StandardSave(tree))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
      restored = ckptr.restore(path, args=ocp.args.StandardRestore(abstract))
    self.assertEqual(jax.tree.structure(restored), jax.tree.structure(tree))
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(restored)):
      self.assertEqual(a.dtype, b.dtype)
      # Bitwise (fp8 included).
      np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
    self.assertIsInstance(restored["layers"]["w4a16"], qm.QWeight)
    self.assertEqual(restored["layers"]["w4a16"].group_size, 32)


def assert_one_line_errors(test, cases):
  """Each (fn, pattern): fn() raises a ValueError matching pattern, in one line."""
  for fn, pattern in cases:
    with test.assertRaisesRegex(ValueError, pattern) as cm:
      fn()
    test.assertNotIn("\n", str(cm.exception))


class ErrorTest(parameterized.TestCase):

  def test_one_line_errors(self):
    w = _weight(96, 8)
    cases = [
        (lambda: qm.quantize_weight(w, "w3a3"), r"scheme='w3a3'.*w8a8_int8"),
        (lambda: qm.quantize_weight(w, "w4a16", group_size=64), r"group_size=64.*K=96"),
        (lambda: qm.quantize_weight(w[:, 0], "w8a8_int8"), r"\[\.\.\., K, N\].*\(96,\)"),
        (lambda: qm.pack_int4(np.zeros((5, 3), np.int8)), r"even K.*\(5, 3\)"),
        (lambda: qm.from_codes(np.zeros((8, 2), np.int8), np.ones((1, 2)), "w4a16",
                               group_size=4), r"scale must have shape \(2, 2\).*\(1, 2\)"),
        (lambda: qm.from_codes(np.zeros((8, 2), np.float32), np.ones((1, 2)), "w8a8_int8"),
         r"codes must be int8.*float32"),
        (lambda: qm.qmatmul(jnp.ones((2, 95)), qm.quantize_weight(w, "w8a8_int8")),
         r"K=96.*\(2, 95\)"),
        (lambda: qm.qmatmul(jnp.ones((2, 96)), qm.QWeight(
            jnp.zeros((48, 8), jnp.int8), jnp.ones((1, 8)), "w4a16", 96)),
         r"w4a16 QWeight stores uint8 data; got int8"),
        (lambda: qm.qmatmul(jnp.ones((2, 96)), qm.quantize_weight(w, "w8a8_int8"), impl="cuda"),
         r"impl='cuda'.*'auto', 'pallas', 'xla', 'reference'"),
    ]
    assert_one_line_errors(self, cases)


if __name__ == "__main__":
  absltest.main()
