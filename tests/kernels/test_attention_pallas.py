"""Pallas flash attention (interpret mode on CPU) against reference_attention: values and grads."""
import functools
from unittest import mock

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from attention_testing import (assert_matches_reference, inputs, packed_ids,
                               reference_value_and_grads, segment_kwargs, value_and_grads)
import pytest

from jaxsys.kernels import attention_pallas
from jaxsys.kernels.attention_blocks import block_ranges
from jaxsys.kernels.attention_pallas import default_blocks, pallas_attention



def _pallas(segs=None, **kw):
  return lambda q, k, v: pallas_attention(q, k, v, **segment_kwargs(segs), **kw)


def _compare(q, k, v, cotangent, segs=None, causal=True, block_q=16, block_k=16):
  return assert_matches_reference(_pallas(segs, causal=causal, block_q=block_q, block_k=block_k),
                                  q, k, v, cotangent, segs=segs, causal=causal)


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
    q, k, v, ct = inputs(1, t, s, 4, 2, 64, jnp.float32)
    out, _ = _compare(q, k, v, ct, causal=causal, block_q=block_q, block_k=block_k)
    if t > s and causal:
      np.testing.assert_array_equal(np.asarray(out[:, :t - s]), 0.0)

  @parameterized.parameters(1, 2, 4, 8)
  def test_gqa_packed(self, groups):
    rng = np.random.default_rng(groups)
    b, t, hkv = 2, 48, 1 if groups == 8 else 2
    ids = packed_ids(rng, b, t)
    q, k, v, ct = inputs(b, t, t, hkv * groups, hkv, 64, jnp.float32, seed=groups)
    _compare(q, k, v, ct, segs=(ids, ids), causal=groups % 2 == 0)

  def test_head_dim_128_noncausal_packed(self):
    ids = packed_ids(np.random.default_rng(7), 1, 40)
    q, k, v, ct = inputs(1, 40, 40, 2, 1, 128, jnp.float32)
    _compare(q, k, v, ct, segs=(ids, ids), causal=False, block_q=32, block_k=16)

  def test_bfloat16_causal_packed(self):
    ids = packed_ids(np.random.default_rng(3), 2, 64)
    q, k, v, ct = inputs(2, 64, 64, 4, 2, 64, jnp.bfloat16)
    _compare(q, k, v, ct, segs=(ids, ids), causal=True, block_q=32, block_k=16)

  def test_fully_masked_rows_are_zero_with_finite_grads(self):
    # Queries with id 7 or 9 have no key of their id; id-9 rows fill a whole q block.
    t, s = 40, 24
    q_ids = np.asarray([[0] * 10 + [7] * 6 + [9] * 16 + [1] * 8], np.int32)
    kv_ids = np.asarray([[0] * 12 + [1] * 12], np.int32)
    q, k, v, ct = inputs(1, t, s, 2, 2, 64, jnp.float32)
    empty = np.asarray((q_ids[0] == 7) | (q_ids[0] == 9))
    out, (dq, _, _) = _compare(q, k, v, ct, segs=(q_ids, kv_ids), causal=False)
    np.testing.assert_array_equal(np.asarray(out[0, empty]), 0.0)
    np.testing.assert_array_equal(np.asarray(dq[0, empty]), 0.0)

  def test_default_blocks_and_arbitrary_head_dim(self):
    # block_q / block_k None pick default_blocks; D=48 is padded inside to 64.
    q, k, v, ct = inputs(1, 20, 20, 2, 1, 48, jnp.float32)
    _compare(q, k, v, ct, causal=True, block_q=None, block_k=None)

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
    q, k, v, ct = inputs(1, 64, 64, 2, 1, 64, jnp.float32)
    poison = np.where(ids[0, :, None, None] == 3, np.nan, 0.0).astype(np.float32)
    out, (dq, dk, dv) = value_and_grads(
        _pallas((ids, ids), block_k=16, block_q=16, causal=False), q + poison, k, v + poison, ct)
    ref_out, (ref_dq, ref_dk, ref_dv) = reference_value_and_grads(q, k, v, ct, (ids, ids),
                                                                  causal=False)
    for got, want in ((out, ref_out), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
      np.testing.assert_allclose(got[:, :48], want[:, :48], rtol=1e-5, atol=1e-5)
    self.assertTrue(np.isnan(np.asarray(out[:, 48:])).all())

  @hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
  @hypothesis.given(
      t=st.integers(1, 40), cross=st.booleans(), s=st.integers(1, 40),
      groups=st.sampled_from([1, 2, 4]), causal=st.booleans(), packed=st.booleans(),
      block_q=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
  @pytest.mark.slow
  def test_hypothesis_shapes(self, t, cross, s, groups, causal, packed, block_q, seed):
    s = s if cross else t
    rng = np.random.default_rng(seed)
    segs = None
    if packed:
      q_ids = packed_ids(rng, 1, t)
      # Cross-attention ids drawn independently: any layout, including no shared id.
      segs = (q_ids, q_ids if not cross else packed_ids(rng, 1, s))
    q, k, v, ct = inputs(1, t, s, groups, 1, 16, jnp.float32, seed=seed)
    _compare(q, k, v, ct, segs=segs, causal=causal, block_q=block_q, block_k=16)

  def test_default_blocks(self):
    self.assertEqual(default_blocks(4096, 4096, 128), (128, 64))
    self.assertEqual(default_blocks(4096, 4096, 64), (128, 64))
    self.assertEqual(default_blocks(4096, 4096, 256), (64, 32))
    self.assertEqual(default_blocks(20, 5, 64), (32, 16))

  def test_bad_input(self):
    q, k, v, _ = inputs(1, 16, 16, 2, 1, 64, jnp.float32)
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
    with mock.patch.object(attention_pallas.jax, "default_backend", return_value="tpu"):
      with self.assertRaisesRegex(NotImplementedError, "TPU"):
        pallas_attention(q, k, v)


if __name__ == "__main__":
  absltest.main()
