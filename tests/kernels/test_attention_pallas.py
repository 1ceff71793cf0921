"""Pallas flash attention (interpret mode on CPU) against reference_attention: values and grads."""
import functools
from unittest import mock

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jaxsys.kernels import attention_pallas
from jaxsys.kernels.attention import reference_attention
from jaxsys.kernels.attention_pallas import block_ranges, default_blocks, pallas_attention

TOL = {np.dtype(np.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2}


def _inputs(b, t, s, hq, hkv, d, dtype, seed=0):
  """Random q, k, v (in dtype) and an f32 cotangent; numpy, so no per-shape compiles."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
  q, k, v = normal(b, t, hq, d), normal(b, s, hkv, d), normal(b, s, hkv, d)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), normal(b, t, hq, d)


def _packed_ids(rng, b, n, lengths=None):
  """[B, n] int32 monotonic segment ids; random lengths including 1-token segments."""
  rows = []
  for _ in range(b):
    ids, seg = [], 0
    while len(ids) < n:
      length = int(rng.choice([1, 1, 2, 5, 9, 17])) if lengths is None else lengths[seg]
      ids += [seg] * length
      seg += 1
    rows.append(ids[:n])
  return np.asarray(rows, np.int32)


# Compile-time bound: optimising the interpret-mode loops costs more than running them.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _value_and_grads(fn, kwargs, q, k, v, cotangent, segs):
  """Output and grads of <out, cotangent> wrt q, k, v, in one compilation."""
  kwargs = dict(kwargs)
  if segs is not None and fn is pallas_attention:
    kwargs.update(q_segment_ids=segs[0], kv_segment_ids=segs[1])
  elif segs is not None:
    kwargs.update(segment_ids=segs)

  def value_and_grads(q, k, v, cotangent):
    def loss(q, k, v):
      out = fn(q, k, v, **kwargs)
      return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return out, grads

  compiled = jax.jit(value_and_grads).lower(q, k, v, cotangent).compile(_FAST_COMPILE)
  return compiled(q, k, v, cotangent)


def _compare(test, q, k, v, cotangent, segs=None, causal=True, block_q=16, block_k=16):
  pallas_kw = (("block_k", block_k), ("block_q", block_q), ("causal", causal))
  out, grads = _value_and_grads(pallas_attention, pallas_kw, q, k, v, cotangent, segs)
  # The reference runs in f32 from the same (possibly bf16) inputs: the truth to approach.
  f32 = lambda x: np.asarray(x, np.float32)
  ref_out, ref_grads = _value_and_grads(reference_attention, (("causal", causal),),
                                        f32(q), f32(k), f32(v), cotangent, segs)
  chex.assert_type(out, q.dtype)
  chex.assert_shape(out, q.shape)
  tol = TOL[np.dtype(q.dtype)]
  for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
    chex.assert_tree_all_finite(got)
    want = np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(np.asarray(f32(got)), want, rtol=tol, atol=tol * scale,
                               err_msg=name)
  return out, grads


class PallasAttentionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # T not a multiple of the block, self-attention.
      dict(testcase_name="causal_T50", t=50, s=50, causal=True, block_q=32, block_k=16),
      # Cross-attention and decoding-style causal with a longer key cache.
      dict(testcase_name="cross_noncausal", t=40, s=70, causal=False, block_q=16, block_k=32),
      dict(testcase_name="causal_S_gt_T", t=24, s=64, causal=True, block_q=16, block_k=32),
      # T > S causal: the first T - S queries see no key and must give zeros.
      dict(testcase_name="causal_T_gt_S", t=40, s=20, causal=True, block_q=16, block_k=16),
  )
  def test_shapes_f32(self, t, s, causal, block_q, block_k):
    q, k, v, ct = _inputs(1, t, s, 4, 2, 64, jnp.float32)
    out, _ = _compare(self, q, k, v, ct, causal=causal, block_q=block_q, block_k=block_k)
    if t > s and causal:
      np.testing.assert_array_equal(np.asarray(out[:, :t - s]), 0.0)

  @parameterized.parameters(1, 2, 4, 8)
  def test_gqa_packed(self, groups):
    rng = np.random.default_rng(groups)
    b, t, hkv = 2, 48, 1 if groups == 8 else 2
    ids = _packed_ids(rng, b, t)
    q, k, v, ct = _inputs(b, t, t, hkv * groups, hkv, 64, jnp.float32, seed=groups)
    _compare(self, q, k, v, ct, segs=(ids, ids), causal=groups % 2 == 0)

  def test_head_dim_128_noncausal_packed(self):
    ids = _packed_ids(np.random.default_rng(7), 1, 40)
    q, k, v, ct = _inputs(1, 40, 40, 2, 1, 128, jnp.float32)
    _compare(self, q, k, v, ct, segs=(ids, ids), causal=False, block_q=32, block_k=16)

  def test_bfloat16_causal_packed(self):
    ids = _packed_ids(np.random.default_rng(3), 2, 64)
    q, k, v, ct = _inputs(2, 64, 64, 4, 2, 64, jnp.bfloat16)
    _compare(self, q, k, v, ct, segs=(ids, ids), causal=True, block_q=32, block_k=16)

  def test_fully_masked_rows_are_zero_with_finite_grads(self):
    # Queries with id 7 or 9 have no key of their id; id-9 rows fill a whole q block.
    t, s = 40, 24
    q_ids = np.asarray([[0] * 10 + [7] * 6 + [9] * 16 + [1] * 8], np.int32)
    kv_ids = np.asarray([[0] * 12 + [1] * 12], np.int32)
    q, k, v, ct = _inputs(1, t, s, 2, 2, 64, jnp.float32)
    empty = np.asarray((q_ids[0] == 7) | (q_ids[0] == 9))
    out, (dq, _, _) = _compare(self, q, k, v, ct, segs=(q_ids, kv_ids), causal=False)
    np.testing.assert_array_equal(np.asarray(out[0, empty]), 0.0)
    np.testing.assert_array_equal(np.asarray(dq[0, empty]), 0.0)

  def test_default_blocks_and_arbitrary_head_dim(self):
    # block_q / block_k None pick default_blocks; D=48 is padded inside to 64.
    q, k, v, ct = _inputs(1, 20, 20, 2, 1, 48, jnp.float32)
    _compare(self, q, k, v, ct, causal=True, block_q=None, block_k=None)

  def test_block_skipping_visits_only_unmasked_blocks(self):
    # Four packed segments of 16 in T=S=64 with blocks of 16: each q block needs only its
    # own kv block (1 of 4); causal alone needs the blocks up to the diagonal.
    ids = np.repeat(np.arange(4, dtype=np.int32), 16)[None]
    ranges = jax.jit(functools.partial(block_ranges, t=64, s=64, block_q=16, block_k=16,
                                       batch=1), static_argnames="causal")
    kv_lo, kv_hi, q_lo, q_hi = ranges(ids, ids, causal=True)
    np.testing.assert_array_equal(kv_lo[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(kv_hi[0], [1, 2, 3, 4])
    np.testing.assert_array_equal(q_lo[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(q_hi[0], [1, 2, 3, 4])
    self.assertEqual(int(np.sum(kv_hi - kv_lo)), 4)  # dense would visit 16
    kv_lo, kv_hi, q_lo, q_hi = ranges(None, None, causal=True)
    np.testing.assert_array_equal(kv_hi[0] - kv_lo[0], [1, 2, 3, 4])
    np.testing.assert_array_equal(q_hi[0] - q_lo[0], [4, 3, 2, 1])

    # The kernels really skip: NaN in the last segment's q and v cannot reach the other
    # segments' outputs or grads unless their blocks were visited (0 * NaN = NaN).
    q, k, v, ct = _inputs(1, 64, 64, 2, 1, 64, jnp.float32)
    poison = np.where(ids[0, :, None, None] == 3, np.nan, 0.0).astype(np.float32)
    kw = (("block_k", 16), ("block_q", 16), ("causal", False))
    out, (dq, dk, dv) = _value_and_grads(pallas_attention, kw, q + poison, k, v + poison, ct,
                                         (ids, ids))
    ref_out, (ref_dq, ref_dk, ref_dv) = _value_and_grads(
        reference_attention, (("causal", False),), q, k, v, ct, (ids, ids))
    for got, want in ((out, ref_out), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
      np.testing.assert_allclose(got[:, :48], want[:, :48], rtol=1e-5, atol=1e-5)
    self.assertTrue(np.isnan(np.asarray(out[:, 48:])).all())

  @hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
  @hypothesis.given(
      t=st.integers(1, 40), cross=st.booleans(), s=st.integers(1, 40),
      groups=st.sampled_from([1, 2, 4]), causal=st.booleans(), packed=st.booleans(),
      block_q=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
  def test_hypothesis_shapes(self, t, cross, s, groups, causal, packed, block_q, seed):
    s = s if cross else t
    rng = np.random.default_rng(seed)
    segs = None
    if packed:
      q_ids = _packed_ids(rng, 1, t)
      # Cross-attention ids drawn independently: any layout, including no shared id.
      segs = (q_ids, q_ids if not cross else _packed_ids(rng, 1, s))
    q, k, v, ct = _inputs(1, t, s, groups, 1, 16, jnp.float32, seed=seed)
    _compare(self, q, k, v, ct, segs=segs, causal=causal, block_q=block_q, block_k=16)

  def test_default_blocks(self):
    self.assertEqual(default_blocks(4096, 4096, 128), (128, 64))
    self.assertEqual(default_blocks(4096, 4096, 64), (128, 64))
    self.assertEqual(default_blocks(4096, 4096, 256), (64, 32))
    self.assertEqual(default_blocks(20, 5, 64), (32, 16))

  def test_bad_input(self):
    q, k, v, _ = _inputs(1, 16, 16, 2, 1, 64, jnp.float32)
    for bad in (24, 8, 0):
      with self.assertRaisesRegex(ValueError, "block_q"):
        pallas_attention(q, k, v, block_q=bad)
    with self.assertRaisesRegex(ValueError, "block_k"):
      pallas_attention(q, k, v, block_k=48)
    with self.assertRaisesRegex(ValueError, "kv_segment_ids"):
      pallas_attention(q, k, v, q_segment_ids=np.zeros((1, 16), np.int32))
    with self.assertRaisesRegex(ValueError, "k.dtype"):
      pallas_attention(q, k.astype(jnp.bfloat16), v)
    with self.assertRaisesRegex(ValueError, "heads"):
      pallas_attention(q[:, :, :1], k[:, :, :1].repeat(2, axis=2), v[:, :, :1].repeat(2, axis=2))
    with self.assertRaisesRegex(ValueError, "interpret=False"):
      pallas_attention(q, k, v, interpret=False)
    with mock.patch.object(attention_pallas.jax, "default_backend", return_value="tpu"):
      with self.assertRaisesRegex(NotImplementedError, "TPU"):
        pallas_attention(q, k, v)


if __name__ == "__main__":
  absltest.main()
