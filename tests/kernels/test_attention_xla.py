"""Blockwise XLA attention against reference_attention: values, grads, masks, GQA, memory."""
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from attention_testing import (FAST_COMPILE, assert_matches_reference, inputs, packed_ids,
                               segment_kwargs)
import pytest

from jaxsys.kernels.attention import reference_attention
from jaxsys.kernels import attention_xla
from jaxsys.kernels.attention_xla import default_blocks, xla_attention



def _ref(segs, **kw):
  return lambda q, k, v: reference_attention(q, k, v, segment_ids=segs, **kw)


def _xla(segs, **kw):
  return lambda q, k, v: xla_attention(q, k, v, **segment_kwargs(segs), **kw)


def _packed_ids(rng, b, n):
  return packed_ids(rng, b, n, lengths=(1, 1, 2, 3, 7, 13, 24))


class XlaAttentionTest(parameterized.TestCase):

  def _check(self, q, k, v, cotangent, segs=None, causal=True, tol=None, sm_scale=None,
             **blocks):
    """Asserts xla_attention == reference_attention, values and grads; returns the output."""
    return assert_matches_reference(
        _xla(segs, causal=causal, sm_scale=sm_scale, **blocks), q, k, v, cotangent, segs=segs,
        causal=causal, tol=tol, sm_scale=sm_scale)[0]

  @parameterized.product(
      causal=(True, False),
      # (T, S, G): T, S not block multiples, T < S (decoding), T > S (rows with no key).
      shape=((37, 37, 1), (20, 50, 4), (50, 20, 2)))
  def test_f32_matches_reference(self, causal, shape):
    t, s, group = shape
    q, k, v, ct = inputs(2, t, s, 2 * group, 2, 8)
    self._check(q, k, v, ct, causal=causal, block_q=16, block_k=16)

  @parameterized.parameters(1, 2, 4, 8)
  def test_gqa_ratios_with_packed_segments(self, group):
    rng = np.random.default_rng(group)
    q, k, v, ct = inputs(2, 45, 45, 8, 8 // group, 16, seed=group)
    seg = _packed_ids(rng, 2, 45)
    self._check(q, k, v, ct, segs=(seg, seg), block_q=8, block_k=16)

  def test_bf16(self):
    rng = np.random.default_rng(3)
    q, k, v, ct = inputs(2, 40, 40, 4, 2, 16, dtype=jnp.bfloat16, seed=3)
    seg = _packed_ids(rng, 2, 40)
    self._check(q, k, v, ct, segs=(seg, seg), causal=True, block_q=16, block_k=32)

  def test_fully_masked_rows_give_zeros_and_finite_grads(self):
    q, k, v, ct = inputs(2, 40, 24, 4, 2, 8, seed=4)
    rng = np.random.default_rng(4)
    # Query ids 7 and 9 have no key with that id; with causal T > S the first 16 rows see
    # no key at all either. Keys padded to the block size must never be attended.
    q_seg = jnp.asarray(rng.choice([0, 1, 7, 9], size=(2, 40)).astype(np.int32))
    kv_seg = jnp.asarray(rng.choice([0, 1], size=(2, 24)).astype(np.int32))
    out = self._check(q, k, v, ct, segs=(q_seg, kv_seg), block_q=8, block_k=16)
    dead = (q_seg == 7) | (q_seg == 9) | (jnp.arange(40) < 16)[None]
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(dead)], 0.0)

  def test_unsorted_segment_ids(self):
    """Ids that do not increase along the sequence: block ranges are hulls, still exact."""
    rng = np.random.default_rng(5)
    q, k, v, ct = inputs(2, 50, 50, 4, 4, 8, seed=5)
    seg = jnp.asarray(rng.integers(0, 3, size=(2, 50)).astype(np.int32))
    self._check(q, k, v, ct, segs=(seg, seg), causal=False, block_q=16, block_k=8)
    self._check(q, k, v, ct, segs=(seg, seg), causal=True, block_q=16, block_k=8)

  def test_default_blocks_one_tile_and_many(self):
    """Default blocks: short sequences are one tile (no loop); long ones loop, with padding."""
    self.assertEqual(default_blocks(4), (256, 512))
    rng = np.random.default_rng(6)
    for t in (33, 300):  # 300 > 256 rows: two q blocks, the last one padded
      q, k, v, ct = inputs(1, t, t, 4, 2, 8, seed=t)
      seg = _packed_ids(rng, 1, t)
      self._check(q, k, v, ct, segs=(seg, seg))

  def test_sm_scale(self):
    q, k, v, ct = inputs(1, 24, 24, 2, 1, 8, seed=7)
    seg = _packed_ids(np.random.default_rng(7), 1, 24)
    self._check(q, k, v, ct, segs=(seg, seg), sm_scale=0.3, block_q=8, block_k=8)

  def test_single_segment_array_means_self_attention(self):
    q, k, v, _ = inputs(1, 24, 24, 2, 1, 8, seed=7)
    seg = _packed_ids(np.random.default_rng(7), 1, 24)
    both = jax.jit(lambda q, k, v: xla_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg))
    one = jax.jit(lambda q, k, v: xla_attention(q, k, v, q_segment_ids=seg))
    np.testing.assert_array_equal(one(q, k, v), both(q, k, v))

  def test_decode_one_query(self):
    q, k, v, ct = inputs(2, 1, 77, 8, 2, 16, seed=8)
    self._check(q, k, v, ct, block_q=16, block_k=16)

  @hypothesis.settings(max_examples=15, deadline=None, derandomize=True)
  @hypothesis.given(
      t=st.integers(1, 40), s=st.integers(1, 40), hkv=st.sampled_from([1, 2]),
      group=st.sampled_from([1, 2, 4]), d=st.sampled_from([4, 8]), causal=st.booleans(),
      packed=st.booleans(), block_q=st.sampled_from([8, 16]), block_k=st.sampled_from([8, 16]),
      seed=st.integers(0, 2**16))
  @pytest.mark.slow
  def test_random_shapes(self, t, s, hkv, group, d, causal, packed, block_q, block_k, seed):
    q, k, v, ct = inputs(2, t, s, hkv * group, hkv, d, seed=seed)
    segs = None
    if packed:
      rng = np.random.default_rng(seed)
      segs = (_packed_ids(rng, 2, t), _packed_ids(rng, 2, s))
    self._check(q, k, v, ct, segs=segs, causal=causal, block_q=block_q, block_k=block_k)

  def test_forward_and_backward_memory_is_linear_in_t(self):
    def temp_bytes(fn, t):
      q = k = v = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.float32)
      loss = lambda q, k, v: jnp.sum(fn(q, k, v))
      # Buffer assignment, hence temp size, does not depend on the LLVM optimisation level.
      compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile(FAST_COMPILE)
      return compiled.memory_analysis().temp_size_in_bytes

    flash = _xla(None, block_q=128, block_k=256)
    small, big = temp_bytes(flash, 1024), temp_bytes(flash, 2048)
    reference = temp_bytes(_ref(None), 2048)
    self.assertLess(big, 2.3 * small, (small, big))  # quadratic would be 4x
    self.assertLess(big, reference / 8, (big, reference))

  def _keyed(self, seed, t=40, s=40, group=2):
    """Inputs with packed ids and shuffled per-document positions (non-monotone keys), and
    the dense reference: masked softmax of (same id and q_pos >= kv_pos)."""
    q, k, v, ct = inputs(2, t, s, 2 * group, 2, 8, seed=seed)
    rng = np.random.default_rng(seed)
    q_seg, kv_seg = _packed_ids(rng, 2, t), _packed_ids(rng, 2, s)
    q_pos = jnp.asarray(rng.integers(0, 12, size=(2, t)), jnp.int32)
    kv_pos = jnp.asarray(rng.integers(0, 12, size=(2, s)), jnp.int32)
    keys = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos,
                kv_positions=kv_pos)
    mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_pos[:, :, None] >= kv_pos[:, None, :])

    def dense(q, k, v):
      b, t, hq, d = q.shape
      q5 = q.reshape(b, t, 2, group, d)
      sc = jnp.einsum("btkgd,bskd->bkgts", q5, k) / np.sqrt(d)
      sc = jnp.where(mask[:, None, None], sc, -jnp.inf)
      m = jnp.max(sc, -1, keepdims=True)
      p = jnp.exp(sc - jnp.where(jnp.isfinite(m), m, 0.0))
      lse = jnp.log(jnp.sum(p, -1)) + jnp.where(jnp.isfinite(m), m, 0.0)[..., 0]
      p = p / jnp.maximum(jnp.sum(p, -1, keepdims=True), 1e-30)
      out = jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, hq, d)
      return out, lse.transpose(0, 3, 1, 2).reshape(b, t, hq)  # lse -inf for empty rows

    return (q, k, v, ct), keys, mask, dense

  @parameterized.parameters((8, 16), (16, 8), (64, 64))
  def test_forward_with_lse_arbitrary_positions(self, block_q, block_k):
    (q, k, v, _), keys, mask, dense = self._keyed(9)
    out, lse = jax.jit(lambda q, k, v: attention_xla.forward_with_lse(
        q, k, v, **keys, block_q=block_q, block_k=block_k))(q, k, v)
    want_out, want_lse = dense(q, k, v)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    empty = ~np.asarray(mask).any(-1)
    self.assertTrue(empty.any())  # some rows see no key: output 0, lse -inf
    np.testing.assert_array_equal(np.asarray(lse)[empty], -np.inf)
    np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(want_lse)[~empty], rtol=1e-5)

  def test_backward_from_lse_matches_autodiff(self):
    """Given the rows' lse and delta, the backward equals autodiff of the dense reference."""
    (q, k, v, ct), keys, _, dense = self._keyed(10, t=37, s=29)
    out, vjp = jax.vjp(lambda q, k, v: dense(q, k, v)[0], q, k, v)
    want = vjp(jnp.asarray(ct))
    lse = dense(q, k, v)[1]
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    delta = jnp.sum(ct * out, -1)
    got = jax.jit(lambda *a: attention_xla.backward_from_lse(
        *a, **keys, block_q=8, block_k=8))(q, k, v, ct, lse, delta)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(w).max())),
                                 err_msg=name)

  def test_positions_skip_tiles(self):
    """Tiles are visited by per-block min/max keys: reversed positions under a causal mask
    visit the mirror image of the usual triangle, the same count."""
    q = jax.ShapeDtypeStruct((1, 64, 2, 8), jnp.float32)
    pos = jnp.arange(64, dtype=jnp.int32)[None]
    count = lambda **kw: int(attention_xla.visited_tiles(q, q, block_q=8, block_k=8, **kw)[0])
    self.assertEqual(count(), 36)  # 8 x 8 tiles, lower triangle with diagonal
    self.assertEqual(count(q_positions=pos, kv_positions=pos), 36)
    self.assertEqual(count(q_positions=63 - pos, kv_positions=63 - pos), 36)
    self.assertEqual(count(causal=False), 64)
    self.assertEqual(count(q_positions=jnp.zeros_like(pos), kv_positions=pos + 1), 0)

  def test_bad_input(self):
    q, k, v, _ = inputs(1, 8, 8, 4, 2, 8)
    seg = jnp.zeros((1, 8), jnp.int32)
    with self.assertRaisesRegex(ValueError, "kv_segment_ids given without q_segment_ids"):
      xla_attention(q, k, v, kv_segment_ids=seg)
    with self.assertRaisesRegex(ValueError, "block_k must be a positive int"):
      xla_attention(q, k, v, block_k=0)
    with self.assertRaisesRegex(ValueError, "multiple of k/v heads"):
      xla_attention(q[:, :, :3], k, v)
    with self.assertRaisesRegex(ValueError, "q_segment_ids must be an integer array"):
      xla_attention(q, k, v, q_segment_ids=seg[:, :5], kv_segment_ids=seg)
    with self.assertRaisesRegex(ValueError, "sm_scale must be a Python number"):
      jax.jit(lambda s: xla_attention(q, k, v, sm_scale=s))(0.5)
    pos = jnp.zeros((1, 8), jnp.int32)
    with self.assertRaisesRegex(ValueError, "pass both q_positions and kv_positions or neither"):
      attention_xla.forward_with_lse(q, k, v, q_positions=pos)
    with self.assertRaisesRegex(ValueError, r"kv_positions must be an integer array of shape \(1, 8\)"):
      attention_xla.forward_with_lse(q, k, v, q_positions=pos, kv_positions=pos[:, :5])
    with self.assertRaisesRegex(ValueError, r"lse, delta \[B, T, Hq\]"):
      attention_xla.backward_from_lse(q, k, v, q, pos, pos)


if __name__ == "__main__":
  absltest.main()
