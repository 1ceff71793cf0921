"""Context parallelism: layouts, and ring attention against unsharded reference attention."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxsys.data import packing
from jaxsys.kernels import attention_xla
from jaxsys.kernels.attention import attention
from jaxsys.parallel import context
from tests.kernels.attention_testing import value_and_grads

AXIS = "context"


def _mesh(n):
  return jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,))


# Layouts.

@pytest.mark.parametrize("layout", context.LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_round_trip(layout, n):
  x = np.arange(2 * 3 * 16 * n).reshape(2, 16 * n, 3)
  laid = context.to_layout(x, n, layout)
  np.testing.assert_array_equal(context.from_layout(laid, n, layout), x)
  # Same along another axis, negative axes included.
  y = np.swapaxes(x, 1, 2)
  np.testing.assert_array_equal(
      context.from_layout(context.to_layout(y, n, layout, axis=-1), n, layout, axis=-1), y)
  np.testing.assert_array_equal(context.to_layout(y, n, layout, axis=-1), np.swapaxes(laid, 1, 2))


def test_zigzag_assignment():
  # T=8 over n=2: 4 chunks of 2; device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
  laid = np.asarray(context.to_layout(np.arange(8)[None], 2, "zigzag"))
  np.testing.assert_array_equal(laid[0], [0, 1, 6, 7, 2, 3, 4, 5])
  # n=4, T=16: device i holds chunks i and 7-i, each of 2 tokens.
  shards = np.asarray(context.to_layout(np.arange(16)[None], 4, "zigzag"))[0].reshape(4, 4)
  for i in range(4):
    np.testing.assert_array_equal(shards[i], [2 * i, 2 * i + 1, 2 * (7 - i), 2 * (7 - i) + 1])
  np.testing.assert_array_equal(context.to_layout(np.arange(8)[None], 2, "contiguous")[0],
                                np.arange(8))


@pytest.mark.parametrize("layout", context.LAYOUTS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_shard_positions_follow_layout(layout, n):
  t = 4 * n
  laid = np.asarray(context.to_layout(np.arange(t)[None], n, layout))[0]
  got = np.concatenate([np.asarray(context.shard_positions(i, n, t // n, layout))
                        for i in range(n)])
  np.testing.assert_array_equal(got, laid)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_work(n):
  """Unmasked causal (query, key) pairs per device: zigzag even, contiguous not."""
  t = 16 * n

  def work(layout):
    pos = np.asarray(context.to_layout(np.arange(t)[None], n, layout))[0].reshape(n, -1)
    return np.array([np.sum(p[:, None] >= np.arange(t)[None, :]) for p in pos])

  zig, cont = work("zigzag"), work("contiguous")
  assert zig.sum() == cont.sum() == t * (t + 1) // 2
  assert zig.max() == zig.min()
  assert cont.max() / cont.mean() > 1.4  # about 2 - 1/n


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_tiles_balanced_by_zigzag(n):
  """Score tiles the kernel visits per device under a causal mask (block_q x block_k =
  4 x 8 here): zigzag equal on every device, contiguous growing with the device index."""
  local, bq, bk = 32, 4, 8
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(attention_xla, "default_blocks", lambda rows: (bq, bk))
    zig, block = context.ring_tiles(n, local, "zigzag")
    cont, _ = context.ring_tiles(n, local, "contiguous")
    full, _ = context.ring_tiles(n, local, "zigzag", causal=False)
  assert block == (bq, bk)
  np.testing.assert_array_equal(full, np.full((n, n), (local // bq) * (local // bk)))
  zig, cont = zig.sum(1), cont.sum(1)
  # The same total (diagonal tiles hold the causal boundary: a little over half of all).
  assert zig.max() == zig.min() and zig.sum() == cont.sum()
  assert np.all(np.diff(cont) > 0) and cont.max() > 1.4 * zig.max()


@pytest.mark.parametrize("fn", [context.to_layout, context.from_layout])
def test_layout_errors(fn):
  x = np.zeros((1, 12))
  with pytest.raises(ValueError, match=r"unknown layout 'striped'; valid: contiguous, zigzag"):
    fn(x, 2, "striped")
  with pytest.raises(ValueError, match=r"length 12 is not divisible by 8 \(zigzag .*n=4"):
    fn(x, 4, "zigzag")
  with pytest.raises(ValueError, match=r"length 12 is not divisible by 5 \(contiguous .*n=5"):
    fn(x, 5, "contiguous")
  fn(x, 3, "zigzag")  # 12 = 2 * 3 * 2: fine


# Ring attention.

def _inputs(b, t, hq, hkv, d, seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
  return normal(b, t, hq, d), normal(b, t, hkv, d), normal(b, t, hkv, d), normal(b, t, hq, d), rng


def _ring_fn(n, layout, segs, check_vma=False, algorithm="ring", **kw):
  """(q, k, v) in original order -> the context-parallel attention's output in original
  order (`context.ALGORITHMS[algorithm]`)."""
  to = functools.partial(context.to_layout, n=n, layout=layout)
  seq = P(None, AXIS)

  def local(q, k, v, *ids):
    seg = None if not ids else (ids[0] if len(ids) == 1 else tuple(ids))
    return context.ALGORITHMS[algorithm](q, k, v, axis_name=AXIS, segment_ids=seg,
                                         layout=layout, **kw)

  ids = () if segs is None else tuple(to(jnp.asarray(s)) for s in segs)
  sharded = jax.shard_map(local, mesh=_mesh(n), in_specs=(seq,) * (3 + len(ids)),
                          out_specs=seq, check_vma=check_vma)
  return lambda q, k, v: context.from_layout(sharded(to(q), to(k), to(v), *ids), n, layout)


def _check(n, layout, causal, seg_kind, hq, hkv, b=2, t=32, d=8, check_vma=False, seed=0,
           dtype=np.float32, tol=1e-5, algorithm="ring"):
  q, k, v, cotangent, rng = _inputs(b, t, hq, hkv, d, seed)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  if seg_kind is None:
    segs = ref_segs = None
  else:
    # Documents of 1-17 tokens, so many cross shard (and zigzag chunk) boundaries.
    ids = packing.random_packed_batch(b, t, doc_lengths=(1, 3, 5, 9, 17), seed=rng)["segment_ids"]
    if seg_kind == "single":
      segs, ref_segs = (ids,), ids
    else:
      # A pair whose kv ids skip some documents: those queries have nothing to attend to.
      kv_ids = np.where(ids % 3 == 2, -1, ids).astype(ids.dtype)
      segs = ref_segs = (ids, kv_ids)
  ring = _ring_fn(n, layout, segs, check_vma=check_vma, causal=causal, algorithm=algorithm)
  ref = lambda q, k, v: attention(q, k, v, segment_ids=ref_segs, causal=causal, impl="reference")
  got = value_and_grads(ring, q, k, v, cotangent)
  # The truth is f32 reference attention, whatever the inputs' dtype.
  f32 = lambda x: np.asarray(x, np.float32)
  want = value_and_grads(ref, f32(q), f32(k), f32(v), cotangent)
  for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
    assert g.dtype == dtype, (name, g.dtype)
    g, w = f32(g), np.asarray(w)
    assert np.all(np.isfinite(g)), name
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(1.0, float(np.abs(w).max())),
                               err_msg=name)


CASES = [
    # n, layout, causal, segments, hq, hkv
    (2, "contiguous", True, None, 4, 4),
    (2, "zigzag", False, "single", 4, 2),
    (4, "zigzag", True, "single", 4, 2),
    (4, "contiguous", True, "single", 4, 4),
    (4, "contiguous", False, None, 4, 2),
    (4, "zigzag", True, "pair", 4, 2),
    (8, "zigzag", True, "single", 4, 2),
    (8, "contiguous", True, "pair", 4, 1),
    (8, "zigzag", False, None, 2, 2),
]


@pytest.mark.parametrize("n,layout,causal,seg_kind,hq,hkv", CASES)
def test_ring_matches_reference(n, layout, causal, seg_kind, hq, hkv):
  _check(n, layout, causal, seg_kind, hq, hkv, t=64 if n == 8 else 32)


# Every other case, and one under check_vma: the gather's kernel is the ring's, whole.
@pytest.mark.parametrize("n,layout,causal,seg_kind,hq,hkv", CASES[::2])
def test_all_gather_matches_reference(n, layout, causal, seg_kind, hq, hkv):
  _check(n, layout, causal, seg_kind, hq, hkv, t=64 if n == 8 else 32, algorithm="all_gather")


# Ulysses splits the heads over the devices: both head counts divide by n.
@pytest.mark.parametrize("n,layout,causal,seg_kind,hq,hkv", [
    (2, "contiguous", True, None, 4, 4), (2, "zigzag", True, "pair", 4, 2),
    (4, "zigzag", True, "single", 8, 4), (4, "contiguous", False, None, 4, 4)])
def test_ulysses_matches_reference(n, layout, causal, seg_kind, hq, hkv):
  _check(n, layout, causal, seg_kind, hq, hkv, algorithm="ulysses")


def test_ulysses_refuses_heads_that_do_not_divide():
  with pytest.raises(ValueError, match=r"ulysses_attention: query heads 4 and K/V heads 2 "
                                       r"must both divide by the context size 4"):
    _check(4, "zigzag", True, None, 4, 2, algorithm="ulysses")


def test_all_gather_under_check_vma_on_many_tiles(monkeypatch):
  monkeypatch.setattr(attention_xla, "default_blocks", lambda rows: (4, 8))
  _check(4, "zigzag", True, "pair", 4, 2, b=1, t=64, check_vma=True, algorithm="all_gather")


@pytest.mark.parametrize("algorithm,sent,absent", [
    ("ring", {"collective-permute"}, {"all-gather", "reduce-scatter", "all-to-all"}),
    ("all_gather", {"all-gather", "reduce-scatter"}, {"collective-permute", "all-to-all"}),
    ("ulysses", {"all-to-all", "all-gather"}, {"collective-permute", "reduce-scatter"})])
def test_each_algorithm_sends_what_it_says(algorithm, sent, absent):
  """In the compiled forward and backward: the ring's hops; one gather and one
  reduce-scatter of K/V; or Ulysses' all-to-alls (and its gathered causal keys)."""
  n = 4
  q, k, v, cotangent, _ = _inputs(1, 32, 4, 4, 8)
  fn = _ring_fn(n, "zigzag", None, algorithm=algorithm, causal=True)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  kinds = {kind for kind in sent | absent if f" {kind}(" in hlo or f" {kind}-start(" in hlo}
  assert kinds == sent, (algorithm, kinds)


@pytest.mark.parametrize("blocks", [(4, 8), (8, 4), (6, 6)])
def test_ring_steps_on_many_tiles(monkeypatch, blocks):
  """Each step's kernel runs on several tiles, skipping some by positions and segments;
  (6, 6) does not divide the 16-token shards, so q rows and keys are padded."""
  monkeypatch.setattr(attention_xla, "default_blocks", lambda rows: blocks)
  _check(4, "zigzag", True, "pair", 4, 2, b=1, t=64, check_vma=blocks == (4, 8))


def test_ring_under_check_vma():
  _check(4, "zigzag", True, "single", 4, 2, check_vma=True)


def test_ring_bfloat16():
  """bf16 in, bf16 out and grads; blocks are computed and merged in f32."""
  _check(4, "zigzag", True, "single", 4, 2, dtype=jnp.bfloat16, tol=2e-2)


@pytest.mark.slow
def test_explicit_positions_equal_derived():
  """Passing the layout's global positions is the same as letting the ring derive them."""
  n, t = 4, 32
  q, k, v, cotangent, _ = _inputs(1, t, 4, 2, 8)
  pos = context.to_layout(jnp.arange(t)[None], n, "zigzag")
  to = functools.partial(context.to_layout, n=n, layout="zigzag")

  def local(q, k, v, pos):
    return context.ring_attention(q, k, v, axis_name=AXIS, positions=pos)

  sharded = jax.shard_map(local, mesh=_mesh(n), in_specs=(P(None, AXIS),) * 4,
                          out_specs=P(None, AXIS), check_vma=False)
  got = context.from_layout(sharded(to(q), to(k), to(v), pos), n, "zigzag")
  want = attention(q, k, v, causal=True, impl="reference")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _doc_positions(ids):
  """Per-document positions of packed rows: 0, 1, ... restarting where the id changes."""
  t = ids.shape[1]
  starts = np.concatenate([np.ones((ids.shape[0], 1), bool), ids[:, 1:] != ids[:, :-1]], 1)
  first = np.maximum.accumulate(np.where(starts, np.arange(t), 0), axis=1)
  return (np.arange(t) - first).astype(np.int32)


def _gather(x, idx):
  """x [B, T, ...] reordered along T by idx [B, T]."""
  idx = jnp.asarray(idx).reshape(*idx.shape, *([1] * (x.ndim - 2)))
  return jnp.take_along_axis(jnp.asarray(x), idx, axis=1)


@pytest.mark.parametrize("n,layout,pair,blocks", [
    (2, "zigzag", False, None), (4, "contiguous", True, (4, 8)), (8, "zigzag", False, None)])
def test_arbitrary_positions(monkeypatch, n, layout, pair, blocks):
  """Per-document positions with segment ids, tokens in an arbitrary order on the ring
  (a shuffle per row: non-monotone causal keys, documents split over any devices, as a
  packer of zigzag shares and whole short documents produces) == reference attention on
  the packed rows in order. With `pair`, some documents have no keys (empty rows);
  `blocks` makes each step several kernel tiles, skipped by min/max keys."""
  if blocks:
    monkeypatch.setattr(attention_xla, "default_blocks", lambda rows: blocks)
  b, t = 2, 8 * n
  q, k, v, cotangent, rng = _inputs(b, t, 4, 2, 8, seed=n)
  ids = packing.random_packed_batch(b, t, doc_lengths=(1, 3, 5, 9, 17), seed=rng)["segment_ids"]
  kv_ids = np.where(ids % 3 == 2, -1, ids).astype(ids.dtype) if pair else ids
  perm = np.stack([rng.permutation(t) for _ in range(b)])
  inverse = np.argsort(perm, axis=1)
  shuffled = [_gather(x, perm) for x in (ids, kv_ids, _doc_positions(ids))]
  seq = P(None, AXIS)

  def local(q, k, v, q_ids, kv_ids, pos):
    return context.ring_attention(q, k, v, axis_name=AXIS, segment_ids=(q_ids, kv_ids),
                                  layout=layout, positions=pos)

  sharded = jax.shard_map(local, mesh=_mesh(n), in_specs=(seq,) * 6, out_specs=seq,
                          check_vma=False)
  ring = lambda q, k, v: _gather(
      sharded(_gather(q, perm), _gather(k, perm), _gather(v, perm), *shuffled), inverse)
  ref = lambda q, k, v: attention(q, k, v, segment_ids=(ids, kv_ids), causal=True,
                                  impl="reference")
  got, want = value_and_grads(ring, q, k, v, cotangent), value_and_grads(ref, q, k, v, cotangent)
  for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
    assert np.all(np.isfinite(g)), name
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(w).max())),
                               err_msg=name)
  if pair:
    empty = ~np.any(ids[:, :, None] == kv_ids[:, None, :], axis=-1)
    assert empty.any()
    np.testing.assert_array_equal(np.asarray(got[0])[empty], 0.0)
    np.testing.assert_array_equal(np.asarray(got[1][0])[empty], 0.0)  # dq of empty rows


def test_ring_errors():
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match=r"unknown layout 'striped'; valid: contiguous, zigzag"):
    context.ring_attention(q, q, q, axis_name=AXIS, layout="striped")
  with pytest.raises(ValueError, match=r"unknown impl 'cudnn'; valid: auto, xla"):
    context.ring_attention(q, q, q, axis_name=AXIS, impl="cudnn")
  with pytest.raises(ValueError, match=r"zigzag needs an even shard length; got T/n=3"):
    odd = jnp.zeros((1, 6, 2, 8))
    jax.shard_map(lambda x: context.ring_attention(x, x, x, axis_name=AXIS), mesh=_mesh(2),
                  in_specs=P(None, AXIS), out_specs=P(None, AXIS), check_vma=False)(odd)
