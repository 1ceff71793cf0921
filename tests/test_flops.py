"""FLOP counting: attention pairs against a brute-force mask count, attention FLOPs."""
import numpy as np
import pytest

from jaxsys import flops
from jaxsys.data import packing


def _mask_pairs(segment_ids, causal=True):
  """(query, key) pairs the attention mask allows, counted from the [B, T, T] mask itself."""
  seg = np.asarray(segment_ids)
  t = seg.shape[1]
  mask = seg[:, :, None] == seg[:, None, :]
  if causal:
    mask &= np.tril(np.ones((t, t), bool))
  return int(mask.sum())


@pytest.mark.parametrize("kw", [dict(docs_per_row=1), dict(docs_per_row=6), dict(doc_lengths=5),
                                dict(doc_lengths=(1, 1, 2, 13))])
def test_attention_pairs_count_the_mask(kw):
  b, t = 3, 40
  seg = packing.random_packed_batch(b, t, seed=2, **kw)["segment_ids"]
  assert flops.attention_pairs(t, b, segment_ids=seg) == _mask_pairs(seg)
  assert flops.attention_pairs(t, b) == _mask_pairs(np.ones((b, t))) == b * t * (t + 1) // 2
  assert flops.attention_pairs(t, b, convention="full") == b * t * t
  # Equal ids in two rows are two documents: each row starts its own.
  same = np.ones((2, t), np.int32)
  assert flops.attention_pairs(t, 2, segment_ids=same) == t * (t + 1)


def test_attention_flops():
  assert flops.attention_flops(10, heads=3, head_dim=8) == 4 * 8 * 3 * 10
  assert flops.attention_flops(10, 3, 8, "fwd_bwd") == 3.5 * 4 * 8 * 3 * 10


@pytest.mark.parametrize("call, match", [
    (lambda: flops.attention_pairs(8, convention="palm"),
     r"convention='palm' is not known; choose one of \('full', 'causal'\)"),
    (lambda: flops.attention_pairs(8, 2, segment_ids=np.ones((1, 8))),
     r"segment_ids shape \(1, 8\) must be \(batch, seq_len\) = \(2, 8\)"),
    (lambda: flops.attention_flops(1, 1, 1, "bwd"), r"pass_='bwd' is not known"),
])
def test_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_hlo_dot_flops_count_every_loop_trip_and_the_dearest_branch():
  import jax
  import jax.numpy as jnp

  from jaxsys import hlo_flops

  x, w = jnp.ones((16, 32)), jnp.ones((32, 32))
  one = 2 * 16 * 32 * 32

  def looped(x, w):
    return jax.lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ w), x)

  def branched(x, w, p):
    return jax.lax.cond(p, lambda h: (h @ w) @ w @ w, lambda h: h @ w, x)

  looped_hlo = jax.jit(looped).lower(x, w).compile().as_text()
  assert hlo_flops.dot_flops(looped_hlo) == 5 * one
  branched_hlo = jax.jit(branched).lower(x, w, True).compile().as_text()
  assert hlo_flops.dot_flops(branched_hlo) == 3 * one
  with pytest.raises(ValueError, match="no ENTRY"):
    hlo_flops.dot_flops("HloModule m")


def test_loops_of_unknown_length_are_named():
  """A loop whose bound is a value (a causal block range) is counted once and said to be:
  the count is then a lower bound; a loop of fixed length is not."""
  import jax
  import jax.numpy as jnp

  from jaxsys import hlo_flops

  x, w = jnp.ones((16, 32)), jnp.ones((32, 32))
  one = 2 * 16 * 32 * 32

  def looped(x, w, n):
    return jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ w), x)

  fixed = jax.jit(looped, static_argnums=2).lower(x, w, 5).compile().as_text()
  assert hlo_flops.loops_of_unknown_length(fixed) == 0
  dynamic = jax.jit(looped).lower(x, w, 5).compile().as_text()
  assert hlo_flops.dot_flops(dynamic) == one  # the body once: all the HLO can say
  assert hlo_flops.loops_of_unknown_length(dynamic) == 1
  without_flops = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(h), x)
                          ).lower(x, 5).compile().as_text()
  assert hlo_flops.loops_of_unknown_length(without_flops) == 0
