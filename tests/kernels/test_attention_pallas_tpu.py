"""TPU (Mosaic) Pallas flash attention, interpreted on CPU, against reference_attention.

Values and gradients in f32 (tight) and bf16; GQA; causal and not; T, S not multiples of
the blocks; packed segments; fully masked rows; block skipping (compute and DMA); and the
Mosaic lowering of forward and backward (what can be checked without a TPU).
"""
import numpy as np
import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized
from jax.experimental.pallas import tpu as pltpu

from attention_testing import (assert_matches_reference, inputs, packed_ids,
                               reference_value_and_grads, segment_kwargs, value_and_grads)
import pytest

from jaxsys.kernels import attention_pallas_tpu as tpu_attn
from jaxsys.kernels.attention_blocks import block_ranges
from jaxsys.kernels.attention_pallas_tpu import default_blocks, pallas_tpu_attention

# TPU interpret mode simulates the block pipeline, NaN-filled scratch and a random order
# of the "parallel" grid axes, at ~30 ms a grid step. interpret=True (the default on CPU)
# runs the same kernels in Pallas' generic interpreter, ~20x faster: the shape sweeps use
# it, the tests of the TPU mechanics use TPU interpret mode.
GENERIC = True
SIMULATED = pltpu.InterpretParams()


def _tpu(segs=None, **kw):
  return lambda q, k, v: pallas_tpu_attention(q, k, v, **segment_kwargs(segs), **kw)


def _packed_ids(rng, n, b=1):
  """Longer segments than the GPU tests use: TPU blocks are 128 rows and more."""
  return packed_ids(rng, b, n, lengths=(1, 1, 3, 9, 40, 90))


def _compare(q, k, v, cotangent, segs=None, causal=True, block_q=128, block_k=128, **kw):
  return assert_matches_reference(
      _tpu(segs, causal=causal, block_q=block_q, block_k=block_k, **kw), q, k, v, cotangent,
      segs=segs, causal=causal)


class PallasTpuAttentionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # T not a multiple of the block; GQA 2; D=64 padded to 128 lanes inside.
      dict(testcase_name="causal_T200_gqa2", t=200, s=200, hq=2, hkv=1, d=64, causal=True,
           interpret=SIMULATED),
      # Cross-attention, padded keys masked by position; D=128.
      dict(testcase_name="cross_noncausal_d128", t=200, s=300, hq=2, hkv=2, d=128,
           causal=False),
      # Decoding-style causal (S > T) with GQA 4 and block_q=64: the dk/dv kernel then
      # uses its own 128-row q blocks.
      dict(testcase_name="causal_S_gt_T_gqa4_bq64", t=72, s=300, hq=4, hkv=1, d=64,
           causal=True, block_q=64),
      # T > S causal: the first T - S queries see no key and must give zeros. D=256.
      dict(testcase_name="causal_T_gt_S_d256", t=200, s=72, hq=2, hkv=2, d=256, causal=True),
  )
  def test_shapes_f32(self, t, s, hq, hkv, d, causal, block_q=128, interpret=GENERIC):
    q, k, v, ct = inputs(1, t, s, hq, hkv, d, jnp.float32, seed=t + s)
    out, _ = _compare(q, k, v, ct, causal=causal, block_q=block_q, interpret=interpret)
    if t > s and causal:
      np.testing.assert_array_equal(np.asarray(out[:, :t - s]), 0.0)

  @parameterized.named_parameters(
      dict(testcase_name="gqa1_causal_d128", groups=1, causal=True, d=128, b=1),
      dict(testcase_name="gqa4_causal", groups=4, causal=True, d=64, b=1),
  )
  def test_packed_segments(self, groups, causal, d, b, interpret=GENERIC):
    # Random packed layouts with 1-token segments, spanning block boundaries.
    self._packed_segments(groups, causal, d, b, interpret)

  @pytest.mark.slow
  def test_packed_segments_gqa2_noncausal_batch2(self):
    # Two batch rows with different layouts: per-row block ranges in SMEM.
    self._packed_segments(groups=2, causal=False, d=64, b=2, interpret=SIMULATED)

  def _packed_segments(self, groups, causal, d, b, interpret):
    rng = np.random.default_rng(groups)
    ids = _packed_ids(rng, 300, b)
    q, k, v, ct = inputs(b, 300, 300, groups, 1, d, jnp.float32, seed=groups)
    _compare(q, k, v, ct, segs=(ids, ids), causal=causal, interpret=interpret)

  def test_bfloat16_causal_packed(self):
    ids = _packed_ids(np.random.default_rng(3), 256)
    q, k, v, ct = inputs(1, 256, 256, 4, 2, 128, jnp.bfloat16)
    _compare(q, k, v, ct, segs=(ids, ids), causal=True, interpret=GENERIC)

  def test_fully_masked_rows_are_zero_with_finite_grads(self):
    # Queries with id 7 or 9 have no key of their id; the id-9 rows fill a whole q block
    # (block_q=16), the id-7 rows share blocks with attending rows.
    t, s = 40, 150
    q_ids = np.asarray([[0] * 10 + [7] * 6 + [9] * 16 + [1] * 8], np.int32)
    kv_ids = np.asarray([[0] * 70 + [1] * 80], np.int32)
    q, k, v, ct = inputs(1, t, s, 2, 1, 64, jnp.float32)
    empty = np.asarray((q_ids[0] == 7) | (q_ids[0] == 9))
    out, (dq, _, _) = _compare(q, k, v, ct, segs=(q_ids, kv_ids), causal=False, block_q=16)
    np.testing.assert_array_equal(np.asarray(out[0, empty]), 0.0)
    np.testing.assert_array_equal(np.asarray(dq[0, empty]), 0.0)

  @pytest.mark.slow
  def test_default_blocks_odd_head_dim_shuffled_parallel_axes(self):
    # block_q / block_k None pick default_blocks; D=48 is padded inside to 128. A random
    # seed makes TPU interpret mode visit the "parallel" grid axes in a random order, and
    # its scratch starts as NaN, so the init/finalize logic must not depend on either.
    q, k, v, ct = inputs(1, 20, 20, 2, 1, 48, jnp.float32)
    _compare(q, k, v, ct, causal=True, block_q=None, block_k=None,
             interpret=pltpu.InterpretParams(random_seed=7))

  def test_default_blocks(self):
    self.assertEqual(default_blocks(4096, 4096, 128), (256, 256))
    self.assertEqual(default_blocks(4096, 4096, 256), (128, 128))
    self.assertEqual(default_blocks(20, 300, 64), (128, 256))

  def test_block_skipping(self):
    # Three packed segments of 128 in T=S=384, blocks of 128: each q block needs only its
    # own kv block (1 of 3), and each kv block only its own q block.
    ids = np.repeat(np.arange(3, dtype=np.int32), 128)[None]
    cfg = tpu_attn._plan(384, 384, 64, groups=2, block_q=128, block_k=128, causal=False,
                         scale=1.0, has_segments=True, interpret=True)
    kv_lo, kv_hi, q_lo, q_hi = (np.asarray(x).reshape(-1) for x in block_ranges(
        ids, ids, t=384, s=384, block_q=128, block_k=128, causal=False, batch=1))
    np.testing.assert_array_equal(kv_hi - kv_lo, [1, 1, 1])
    np.testing.assert_array_equal(q_hi - q_lo, [1, 1, 1])

    # No DMA for skipped blocks: along the innermost ("arbitrary") axis the index maps
    # name exactly the visited blocks, in order, and repeat one while steps are skipped;
    # the Mosaic pipeline copies a block only when its index changes.
    def fetched(index_map, outer, n, lo, hi):
      seq = [int(np.asarray(index_map(*outer, x, lo, hi)[2])) for x in range(n)]
      return [x for m, x in enumerate(seq) if m == 0 or x != seq[m - 1]]

    _, kv_spec, *_ = tpu_attn._fwd_specs(cfg, 128)
    q_spec, *_ = tpu_attn._dkv_specs(cfg, 128)
    causal_lo, causal_hi, _, _ = (np.asarray(x).reshape(-1) for x in block_ranges(
        None, None, t=384, s=384, block_q=128, block_k=128, causal=True, batch=1))
    for lo, hi in ((kv_lo, kv_hi), (causal_lo, causal_hi)):
      for i in range(3):
        self.assertEqual(fetched(kv_spec.index_map, (0, 1, i), 3, lo, hi),
                         list(range(lo[i], hi[i])))
    for j in range(3):  # dk/dv: q blocks of kv block j, for the second q head of the group
      self.assertEqual(fetched(q_spec.index_map, (0, 0, j, 1), 3, q_lo, q_hi),
                       list(range(q_lo[j], q_hi[j])))

    # No compute for skipped blocks: NaN in the last segment's q, k and v cannot reach
    # the other segments' outputs or grads unless their tiles were computed (0 * NaN).
    q, k, v, ct = inputs(1, 384, 384, 2, 1, 64, jnp.float32)
    poison = np.where(ids[0, :, None, None] == 2, np.nan, 0.0).astype(np.float32)
    out, (dq, dk, dv) = value_and_grads(
        _tpu((ids, ids), causal=False, block_q=128, block_k=128),
        q + poison, k + poison, v + poison, ct)
    ref_out, (ref_dq, ref_dk, ref_dv) = reference_value_and_grads(q, k, v, ct, (ids, ids),
                                                                  causal=False)
    for name, got, want in (("out", out, ref_out), ("dq", dq, ref_dq), ("dk", dk, ref_dk),
                            ("dv", dv, ref_dv)):
      np.testing.assert_allclose(got[:, :256], want[:, :256], rtol=1e-5, atol=1e-5,
                                 err_msg=name)
    self.assertTrue(np.isnan(np.asarray(out[:, 256:])).all())

  @parameterized.named_parameters(
      dict(testcase_name="bf16_packed_causal_bq64", dtype=jnp.bfloat16, d=64, packed=True,
           causal=True, block_q=64, block_k=256),
      # Causal without segments: masked (diagonal) and unmasked (interior) tile variants.
      dict(testcase_name="f32_causal_d128", dtype=jnp.float32, d=128, packed=False,
           causal=True, block_q=128, block_k=128),
      dict(testcase_name="bf16_noncausal_d256_default_blocks", dtype=jnp.bfloat16, d=256,
           packed=False, causal=False, block_q=None, block_k=None),
  )
  def test_lowers_to_mosaic(self, dtype, d, packed, causal, block_q, block_k):
    # interpret=False emits the Mosaic kernels; exporting for TPU from this CPU host runs
    # the whole Pallas -> Mosaic lowering of the forward and both backward kernels (block
    # shape rules, SMEM/VMEM placement, every op's lowering rule). Mosaic's own compiler
    # passes run only on a TPU.
    q = jax.ShapeDtypeStruct((2, 300, 4, d), dtype)
    kv = jax.ShapeDtypeStruct((2, 500, 2, d), dtype)
    q_ids = jax.ShapeDtypeStruct((2, 300), jnp.int32)
    kv_ids = jax.ShapeDtypeStruct((2, 500), jnp.int32)

    def value_and_grads(q, k, v, q_ids, kv_ids):
      def loss(q, k, v):
        segs = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids) if packed else {}
        out = pallas_tpu_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k,
                                   interpret=False, **segs)
        return jnp.sum(out.astype(jnp.float32))
      return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

    exported = jax.export.export(jax.jit(value_and_grads), platforms=["tpu"])(
        q, kv, kv, q_ids, kv_ids)
    text = exported.mlir_module()
    self.assertEqual(text.count("stablehlo.custom_call @tpu_custom_call"), 3)

  def test_bad_input(self):
    q, k, v, _ = inputs(1, 16, 16, 2, 1, 64, jnp.float32)
    for bad in (100, 0, -8, True, 8.0):
      with self.assertRaisesRegex(ValueError, "block_q"):
        pallas_tpu_attention(q, k, v, block_q=bad)
    for bad in (64, 192, 0):
      with self.assertRaisesRegex(ValueError, "block_k"):
        pallas_tpu_attention(q, k, v, block_k=bad)
    with self.assertRaisesRegex(ValueError, "kv_segment_ids"):
      pallas_tpu_attention(q, k, v, q_segment_ids=np.zeros((1, 16), np.int32))
    with self.assertRaisesRegex(ValueError, "q_segment_ids"):
      pallas_tpu_attention(q, k, v, q_segment_ids=np.zeros((1, 15), np.int32),
                           kv_segment_ids=np.zeros((1, 16), np.int32))
    with self.assertRaisesRegex(ValueError, "k.dtype"):
      pallas_tpu_attention(q, k.astype(jnp.bfloat16), v)
    with self.assertRaisesRegex(ValueError, "q.dtype"):
      pallas_tpu_attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))
    with self.assertRaisesRegex(ValueError, "heads"):
      pallas_tpu_attention(q[:, :, :1], k[:, :, :1].repeat(2, axis=2),
                           v[:, :, :1].repeat(2, axis=2))
    with self.assertRaisesRegex(ValueError, "interpret"):
      pallas_tpu_attention(q, k, v, interpret="yes")
    with self.assertRaisesRegex(ValueError, "sm_scale"):
      jax.jit(lambda s: pallas_tpu_attention(q, k, v, sm_scale=s))(0.5)


if __name__ == "__main__":
  absltest.main()
