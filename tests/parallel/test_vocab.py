"""Vocabulary parallelism on 4 stages equals the unsharded layers: values, grads, collectives."""
import functools
import re

import chex
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from jax.sharding import Mesh, PartitionSpec as P

from jaxsys import comm_bytes
from jaxsys.parallel import vocab

B, T, D, V, STAGES = 2, 8, 16, 250, 4
RTOL = 1e-5
COLLECTIVE_RE = re.compile(
    r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")
COLLECTIVE_PRIMS = {"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
                    "reduce_scatter", "psum_scatter", "ppermute", "all_to_all"}


def _mesh():
  return Mesh(np.array(jax.devices()[:STAGES]), ("stage",))


def _inputs(vocab_size=V, seed=0):
  """h, padded w [D, V_pad] (junk in the padding columns), targets hitting every shard, mask."""
  kh, kw, kt, km = jax.random.split(jax.random.key(seed), 4)
  v_pad = vocab.padded_vocab(vocab_size, STAGES)
  h = jax.random.normal(kh, (B, T, D))
  w = jax.random.normal(kw, (D, v_pad)) * 3.0  # wide logits: the max matters
  targets = jax.random.randint(kt, (B, T), 0, vocab_size)
  targets = targets.at[0, :2].set(jnp.array([0, vocab_size - 1]))  # both ends of the vocab
  mask = (jax.random.uniform(km, (B, T)) > 0.3).astype(jnp.float32).at[0, :2].set(1.0)
  return h, w, targets, mask


def _reference_loss(h, w_DV, targets, mask):
  logits = jnp.dot(h.reshape(-1, D), w_DV).reshape(B, T, -1)
  return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * mask)


def _sharded_output_layer(vocab_size, algorithm, per_stage=False):
  """output_layer under shard_map; per_stage=True returns each stage's loss and dh, stacked."""
  def f(h, w, targets, mask):
    loss, dh, dw = vocab.output_layer(h, w, targets, mask, vocab_size=vocab_size,
                                      algorithm=algorithm)
    return (loss[None], dh[None], dw) if per_stage else (loss, dh, dw)
  out = (P("stage"), P("stage"), P(None, "stage")) if per_stage else (P(), P(), P(None, "stage"))
  return jax.shard_map(f, mesh=_mesh(), in_specs=(P(), P(None, "stage"), P(), P()),
                       out_specs=out)


def _collectives(fn, *args) -> list[str]:
  return COLLECTIVE_RE.findall(jax.jit(fn).lower(*args).compile().as_text())


def _barriers(fn, *args) -> int:
  """Communication barriers: groups of collectives with a matmul between consecutive groups.

  Each value carries (barriers it depends on, whether a dot_general ran since the last);
  a collective starts a new barrier only if matmul work separates it from the previous.
  """
  def run(jaxpr, in_states):
    env = dict(zip(jaxpr.invars, in_states))
    read = lambda v: (0, False) if isinstance(v, jax_core.Literal) else env.get(v, (0, False))
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars] or [(0, False)]
      b = max(s[0] for s in ins)
      dirty = any(s[1] for s in ins if s[0] == b)
      sub = eqn.params.get("jaxpr")
      if sub is not None:
        outs = run(getattr(sub, "jaxpr", sub), ins)
      elif eqn.primitive.name in COLLECTIVE_PRIMS:
        outs = [(b + 1 if (b == 0 or dirty) else b, False)] * len(eqn.outvars)
      else:
        outs = [(b, dirty or eqn.primitive.name == "dot_general")] * len(eqn.outvars)
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  closed = jax.make_jaxpr(fn)(*args)
  return max(s[0] for s in run(closed.jaxpr, [(0, False)] * len(closed.jaxpr.invars)))


class PaddedVocabTest(parameterized.TestCase):

  @parameterized.parameters((250, 4, 252), (252, 4, 252), (3, 4, 4), (7, 1, 7))
  def test_rounds_up(self, v, shards, want):
    self.assertEqual(vocab.padded_vocab(v, shards), want)

  def test_refuses_empty(self):
    with self.assertRaisesRegex(ValueError, "vocab_size=0"):
      vocab.padded_vocab(0, 4)


class OutputLayerTest(parameterized.TestCase):

  @parameterized.product(algorithm=[1, 2], vocab_size=[V, 252, 3])
  def test_matches_unsharded_values_and_grads(self, algorithm, vocab_size):
    # 250: padded to 252; 252: no padding; 3: the last stage's shard is all padding.
    h, w, targets, mask = _inputs(vocab_size)
    loss, dh, dw = jax.jit(_sharded_output_layer(vocab_size, algorithm))(h, w, targets, mask)
    want_loss, (want_dh, want_dw) = jax.value_and_grad(_reference_loss, argnums=(0, 1))(
        h, w[:, :vocab_size], targets, mask)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    np.testing.assert_allclose(dh, want_dh, rtol=RTOL, atol=RTOL * np.abs(want_dh).max())
    np.testing.assert_allclose(dw[:, :vocab_size], want_dw, rtol=RTOL,
                               atol=RTOL * np.abs(want_dw).max())
    # Padding columns hold junk weights, yet get exactly zero gradient.
    np.testing.assert_array_equal(dw[:, vocab_size:], 0.0)

  @parameterized.parameters(1, 2)
  def test_loss_and_dh_identical_on_every_stage(self, algorithm):
    h, w, targets, mask = _inputs()
    loss, dh, _ = jax.jit(_sharded_output_layer(V, algorithm, per_stage=True))(h, w, targets, mask)
    for i in range(1, STAGES):
      np.testing.assert_array_equal(loss[i], loss[0])
      np.testing.assert_array_equal(dh[i], dh[0])

  def test_padding_never_changes_the_loss(self):
    # The same first 250 columns with two different paddings give the same outputs.
    h, w, targets, mask = _inputs()
    fn = jax.jit(_sharded_output_layer(V, 2))
    a = fn(h, w, targets, mask)
    b = fn(h, w.at[:, V:].set(1e4), targets, mask)
    chex.assert_trees_all_equal(a, b)

  @parameterized.parameters(1, 2)
  def test_all_padding_shard_with_very_negative_logits(self, algorithm):
    # V=3 on 4 stages: stage 3 holds only padding; every real logit is far below 0,
    # so a padding shard's statistics must not be taken as max 0.
    h, w, targets, mask = _inputs(3)
    h, w = jnp.abs(h), -20.0 * jnp.abs(w)
    loss, dh, dw = jax.jit(_sharded_output_layer(3, algorithm))(h, w, targets, mask)
    want_loss, (want_dh, want_dw) = jax.value_and_grad(_reference_loss, argnums=(0, 1))(
        h, w[:, :3], targets, mask)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    np.testing.assert_allclose(dh, want_dh, rtol=RTOL, atol=RTOL * np.abs(want_dh).max())
    np.testing.assert_allclose(dw[:, :3], want_dw, rtol=RTOL, atol=RTOL * np.abs(want_dw).max())
    np.testing.assert_array_equal(dw[:, 3:], 0.0)

  def test_masked_token_with_a_padding_target(self):
    h, w, targets, mask = _inputs()
    fn = jax.jit(_sharded_output_layer(V, 2))
    a = fn(h, w, targets, mask.at[1, 3].set(0.0))
    b = fn(h, w, targets.at[1, 3].set(V + 1), mask.at[1, 3].set(0.0))
    chex.assert_trees_all_equal(a, b)

  @parameterized.parameters(1, 2)
  def test_algorithms_agree(self, algorithm):
    h, w, targets, mask = _inputs(seed=1)
    got = jax.jit(_sharded_output_layer(V, algorithm))(h, w, targets, mask)
    other = jax.jit(_sharded_output_layer(V, 3 - algorithm))(h, w, targets, mask)
    chex.assert_trees_all_close(got, other, rtol=RTOL, atol=1e-6)

  @parameterized.parameters((1, 2), (2, 1))
  def test_hlo_collectives_and_barriers(self, algorithm, barriers):
    # Both: one all-reduce gathering (max, sum, target logit) per token and stage, and one
    # all-reduce of dh. Algorithm 1 has the T-pass matmul between them (two barriers);
    # Algorithm 2 only a per-token rescale (one barrier).
    args = _inputs()
    fn = _sharded_output_layer(V, algorithm)
    self.assertEqual(_collectives(fn, *args), ["all-reduce", "all-reduce"])
    self.assertEqual(_barriers(fn, *args), barriers)

  def test_refuses_bad_input(self):
    h, w, targets, mask = _inputs()
    with self.assertRaisesRegex(ValueError, "vocab_size=300 needs 75"):
      jax.jit(_sharded_output_layer(300, 2))(h, w, targets, mask)
    with self.assertRaisesRegex(ValueError, "algorithm=3"):
      jax.jit(_sharded_output_layer(V, 3))(h, w, targets, mask)


class BytesTest(parameterized.TestCase):

  @parameterized.product(train=[True, False], tensor=[1, 2])
  def test_bytes_per_microbatch_are_the_compiled_collectives(self, train, tensor):
    """What a pipeline's microbatch runs of VP (the embedding, the broadcast of the last
    stage's hidden state, the output layer and, in training, the broadcast of dx for the
    embedding's gradient), compiled: the bytes its collectives send, by the ring rule. With
    tensor=2 the vocabulary splits over stage x tensor (8 shards), the broadcasts over stage."""
    h, _, targets, mask = _inputs()
    mesh = Mesh(np.array(jax.devices()[:STAGES * tensor]).reshape(STAGES, tensor),
                ("stage", "tensor"))
    axes = ("stage", "tensor") if tensor > 1 else "stage"
    v_pad = vocab.padded_vocab(V, STAGES * tensor)
    emb = jax.random.normal(jax.random.key(4), (v_pad, D))
    w = jax.random.normal(jax.random.key(5), (D, v_pad))

    def microbatch(emb_shard, w_shard, tokens, targets, mask, dx):
      x = vocab.embed(emb_shard, tokens, axis=axes)
      y = vocab.broadcast_from(x * 2.0, STAGES - 1)  # stands in for the stages' layers
      loss, dh, dw = vocab.output_layer(y, w_shard, targets, mask, vocab_size=V, algorithm=1,
                                        axis=axes)
      if not train:
        return loss, dh[:0], dw[:0], emb_shard[:0]
      demb = vocab.embed_grad(vocab.broadcast_from(dx + dh, 0), tokens,
                              vocab_shard_size=emb_shard.shape[0], axis=axes)
      return loss, dh, dw, demb
    fn = jax.shard_map(microbatch, mesh=mesh,
                       in_specs=(P(axes), P(None, axes), P(), P(), P(), P()),
                       out_specs=(P(), P(), P(None, axes), P(axes)))
    hlo = jax.jit(fn).lower(emb, w, targets, targets, mask, h).compile().as_text()
    self.assertEqual(comm_bytes.collective_bytes_from_hlo(hlo, STAGES),
                     vocab.bytes_per_microbatch(B * T, D, STAGES, itemsize=4, train=train,
                                                tensor=tensor))


class EmbeddingTest(parameterized.TestCase):

  def _tokens(self):
    tokens = jax.random.randint(jax.random.key(5), (B, T), 0, V)
    return tokens.at[0, :4].set(jnp.array([0, V - 1, 7, 7]))  # ends of the vocab, a repeat

  def test_embed_and_grad_match_take(self):
    v_pad = vocab.padded_vocab(V, STAGES)
    emb = jax.random.normal(jax.random.key(4), (v_pad, D))
    tokens = self._tokens()
    dx = jax.random.normal(jax.random.key(6), (B, T, D))

    def f(emb_shard, tokens, dx):
      x = vocab.embed(emb_shard, tokens, dtype=jnp.float32)
      return x, vocab.embed_grad(dx, tokens, vocab_shard_size=emb_shard.shape[0])
    fn = jax.shard_map(f, mesh=_mesh(), in_specs=(P("stage"), P(), P()),
                       out_specs=(P(), P("stage")))
    x, demb = jax.jit(fn)(emb, tokens, dx)
    np.testing.assert_array_equal(x, jnp.take(emb[:V], tokens, axis=0))
    want = jax.grad(lambda e: jnp.sum(dx * jnp.take(e, tokens, axis=0)))(emb[:V])
    np.testing.assert_allclose(demb[:V], want, rtol=RTOL, atol=1e-6)
    np.testing.assert_array_equal(demb[V:], 0.0)
    self.assertEqual(_collectives(fn, emb, tokens, dx), ["all-reduce"])

  def test_embed_casts_to_dtype(self):
    emb = jax.random.normal(jax.random.key(4), (vocab.padded_vocab(V, STAGES), D))
    fn = jax.shard_map(functools.partial(vocab.embed, dtype=jnp.bfloat16), mesh=_mesh(),
                       in_specs=(P("stage"), P()), out_specs=P())
    x = jax.jit(fn)(emb, self._tokens())
    self.assertEqual(x.dtype, jnp.bfloat16)
    np.testing.assert_array_equal(x, jnp.take(emb, self._tokens(), axis=0).astype(jnp.bfloat16))

  @parameterized.parameters(1, 2)
  def test_tied_embedding_chain_rule(self, algorithm):
    # Tied model slice: x = take(E, inputs); h = tanh(x); logits = h @ (E.T * D**-0.5).
    v_pad = vocab.padded_vocab(V, STAGES)
    emb = jax.random.normal(jax.random.key(7), (v_pad, D))
    inputs = self._tokens()
    _, _, targets, mask = _inputs()

    def reference(e):
      h = jnp.tanh(jnp.take(e, inputs, axis=0))
      return _reference_loss(h, e.T * D ** -0.5, targets, mask)
    want_loss, want_demb = jax.value_and_grad(reference)(emb[:V])

    def f(emb_shard, inputs, targets, mask):
      x = vocab.embed(emb_shard, inputs)
      h = jnp.tanh(x)
      loss, dh, demb_out = vocab.output_layer_tied(h, emb_shard, targets, mask, vocab_size=V,
                                                   algorithm=algorithm)
      dx = dh * (1.0 - h * h)
      return loss, demb_out + vocab.embed_grad(dx, inputs, vocab_shard_size=emb_shard.shape[0])
    fn = jax.shard_map(f, mesh=_mesh(), in_specs=(P("stage"), P(), P(), P()),
                       out_specs=(P(), P("stage")))
    loss, demb = jax.jit(fn)(emb, inputs, targets, mask)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    np.testing.assert_allclose(demb[:V], want_demb, rtol=RTOL, atol=RTOL * np.abs(want_demb).max())
    np.testing.assert_array_equal(demb[V:], 0.0)


class BroadcastFromTest(absltest.TestCase):

  def test_every_stage_gets_the_source_value(self):
    x = jax.random.normal(jax.random.key(8), (STAGES, B, T, D))
    x = x.at[0].set(jnp.nan).at[1].set(jnp.inf)  # other stages' junk must not leak
    fn = jax.shard_map(lambda x: vocab.broadcast_from(x[0], STAGES - 1)[None], mesh=_mesh(),
                       in_specs=P("stage"), out_specs=P("stage"))
    got = jax.jit(fn)(x)
    for i in range(STAGES):
      np.testing.assert_array_equal(got[i], x[STAGES - 1])
    self.assertEqual(_collectives(fn, x), ["all-reduce"])


if __name__ == "__main__":
  absltest.main()
