"""Sliding-window attention (transformers' Mistral `sliding_window`): query i attends keys j
with i - window < j <= i. The reference against an explicit loop, every kernel (XLA, Pallas
GPU and TPU in interpret mode) against the reference in values and gradients with packed
segments, GQA and cached decoding (T < S), and the tiles each visits: only the band."""
import functools

import jax
import numpy as np
from absl.testing import absltest, parameterized

from attention_testing import assert_matches_reference, inputs, packed_ids, segment_kwargs
from jaxsys.kernels import attention as attention_lib
from jaxsys.kernels import attention_xla
from jaxsys.kernels.attention_blocks import block_ranges
from jaxsys.kernels.attention_pallas import pallas_attention
from jaxsys.kernels.attention_pallas_tpu import pallas_tpu_attention


def _band(t, s, window):
  """Bool [T, S]: the pairs transformers' sliding-window causal mask keeps (queries aligned
  to the end of the keys, as a cache's last T)."""
  q = np.arange(t)[:, None] + (s - t)
  k = np.arange(s)[None, :]
  return (k <= q) & (k > q - window)


def _band_tiles(t, s, window, bq, bk):
  """Tiles of a [T, S] mask of blocks bq x bk holding at least one kept pair."""
  band = _band(t, s, window)
  return sum(band[i:i + bq, j:j + bk].any() for i in range(0, t, bq) for j in range(0, s, bk))


class WindowTest(parameterized.TestCase):

  def test_reference_is_the_loop(self):
    """softmax over exactly the keys i - window < j <= i, written out row by row."""
    q, k, v, _ = inputs(1, 6, 9, 2, 1, 8)
    window = 3
    got = np.asarray(attention_lib.reference_attention(q, k, v, window=window))
    for i in range(6):
      keys = [j for j in range(9) if i + 3 - window < j <= i + 3]
      assert len(keys) == window
      for h in range(2):
        s = q[0, i, h] @ k[0, keys, 0].T / np.sqrt(8)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(got[0, i, h], (p / p.sum()) @ v[0, keys, 0], rtol=1e-5,
                                   atol=1e-6)

  @parameterized.parameters(("xla", 40, 2), ("xla", 24, 7), ("pallas", 40, 2), ("pallas", 40, 7),
                            ("pallas", 24, 7))
  def test_kernels_match_reference(self, impl, t, window):
    """Values and grads, packed segments, 4 q heads on 2 kv heads; t=24 is decoding
    against 40 keys; small blocks so the window spans several tiles (window 2 puts a kv
    block's last key exactly at the edge of the next q block's first window)."""
    q, k, v, ct = inputs(2, t, 40, 4, 2, 16, seed=window)
    rng = np.random.default_rng(0)
    segs = None if t != 40 else (packed_ids(rng, 2, 40, (9, 17, 30)),) * 2
    if impl == "xla":
      fn = lambda q, k, v: attention_xla.xla_attention(
          q, k, v, **segment_kwargs(segs), window=window, block_q=8, block_k=8)
    else:
      fn = lambda q, k, v: pallas_attention(q, k, v, **segment_kwargs(segs), window=window,
                                            block_q=16, block_k=16)
    assert_matches_reference(fn, q, k, v, ct, segs=segs, window=window)

  def test_tpu_kernel_matches_reference_and_skips(self):
    q, k, v, ct = inputs(1, 384, 384, 2, 1, 8)
    fn = lambda q, k, v: pallas_tpu_attention(q, k, v, window=100, block_q=128, block_k=128)
    assert_matches_reference(fn, q, k, v, ct, window=100)
    kv_lo, kv_hi, _, _ = block_ranges(None, None, t=384, s=384, block_q=128, block_k=128,
                                      causal=True, batch=1, window=100)
    # q block 2 (rows 256-383) sees keys from 157 on: kv block 0 is skipped.
    self.assertEqual(np.asarray(kv_lo).tolist(), [[0, 0, 1]])
    self.assertEqual(np.asarray(kv_hi).tolist(), [[1, 2, 3]])

  @parameterized.parameters((128, 128, 16, 16, 16), (128, 128, 2, 16, 16), (128, 128, 18, 16, 16),
                            (96, 128, 33, 16, 32))
  def test_flash_visits_only_the_band(self, t, s, window, bq, bk):
    """The Pallas loops' kv ranges (and the dk/dv kernel's q ranges) cover exactly the
    tiles the band touches; without a window they cover the causal triangle."""
    ranges = jax.jit(functools.partial(block_ranges, t=t, s=s, block_q=bq, block_k=bk,
                                       causal=True, batch=1, window=window),
                     static_argnums=())(None, None)
    kv_lo, kv_hi, q_lo, q_hi = map(np.asarray, ranges)
    want = _band_tiles(t, s, window, bq, bk)
    self.assertEqual(int((kv_hi - kv_lo).sum()), want)
    no_window = block_ranges(None, None, t=t, s=s, block_q=bq, block_k=bk, causal=True, batch=1)
    self.assertLess(want, int((no_window[1] - no_window[0]).sum()))
    ranges_dkv = block_ranges(None, None, t=t, s=s, block_q=bq, block_k=bk, causal=True,
                              batch=1, window=window)
    self.assertEqual(int((np.asarray(ranges_dkv[3]) - np.asarray(ranges_dkv[2])).sum()), want)

  def test_xla_visits_only_the_band(self):
    q = jax.ShapeDtypeStruct((1, 256, 2, 8), np.float32)
    tiles = lambda **kw: int(attention_xla.visited_tiles(q, q, block_q=32, block_k=32, **kw)[0])
    self.assertEqual(tiles(window=32), _band_tiles(256, 256, 32, 32, 32))  # 15 of 36 causal
    self.assertEqual(tiles(), 36)

  def test_xla_window_by_positions_in_any_order(self):
    """Per-token positions (the context-parallel layouts' tokens out of order): the window
    is by position, so shuffled tokens give the shuffled reference."""
    q, k, v, _ = inputs(1, 48, 48, 2, 1, 8)
    # Blocks of 16 out of order, tokens shuffled inside each: tiles are skipped by their
    # blocks' position ranges; window 18 needs exactly key 15, in the last block, for query 32.
    rng = np.random.default_rng(0)
    order = np.concatenate([rng.permutation(np.arange(16)) + 16 * b for b in (2, 1, 0)])
    pos = order[None].astype(np.int32)
    got, _ = attention_xla.forward_with_lse(q[:, order], k[:, order], v[:, order], q_positions=pos,
                                            kv_positions=pos, window=18, block_q=16, block_k=16)
    want = attention_lib.reference_attention(q, k, v, window=18)
    np.testing.assert_allclose(got, np.asarray(want)[:, order], rtol=1e-5, atol=1e-5)

  def test_bad_window(self):
    q, k, v, _ = inputs(1, 8, 8, 2, 2, 8)
    with self.assertRaisesRegex(ValueError, r"window must be an int >= 0 \(0: no window\); got window=-1"):
      attention_lib.attention(q, k, v, window=-1, impl="xla")
    with self.assertRaisesRegex(ValueError, "window=4 needs causal=True"):
      attention_lib.attention(q, k, v, window=4, causal=False, impl="pallas")


if __name__ == "__main__":
  absltest.main()
