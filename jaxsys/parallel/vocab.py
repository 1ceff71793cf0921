"""Vocabulary Parallelism (VP): the vocabulary layers split along the vocabulary over devices.

Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism" (arXiv
2411.05288; reference code sail-sg/VocabularyParallelism). With plain pipeline
parallelism the first stage holds the input embedding and the last the output layer
and cross-entropy, so with a large vocabulary those two stages carry more compute and
memory than the others. VP gives every stage a contiguous shard of Vs = V_pad / P
vocabulary rows (shard i holds ids [i * Vs, (i + 1) * Vs)) of the embedding and of the
output layer, and each stage works on the whole microbatch for its own shard.

Every function here runs INSIDE a `jax.shard_map` in which `axis` (default "stage"), the
axis or tuple of axes the vocabulary is split over, is manual; P below is the number of
shards, the product of their sizes, and shard i is the axes' linear index (the first
axis major: ("stage", "tensor") puts shard s * T + t on stage s, tensor rank t, as the
paper's reference code splits over pipeline x tensor ranks). Padding rows (ids >=
vocab_size, up to `padded_vocab`) get logit -inf, so they never change the loss and get
exactly zero gradient.

The output layer is written out forward AND backward (`output_layer`), no autodiff
through collectives, because its passes are what a pipeline schedule places:

- broadcast (the paper's C0): the last stage's final-normed hidden state goes to every
  stage (`broadcast_from`, one psum);
- S pass: logits h @ w_shard, the shard's online-softmax statistics per token (local
  max m_i, local sum s_i = sum exp(y - m_i), the target's logit where the shard owns
  the target) and, in Algorithm 2, the shard's partial input gradient;
- barrier(s): collectives over `axis`;
- T pass: the weight gradient dw_shard = h^T dY, which needs no communication.

`output_s_pass` is the S pass up to barrier C1 and `output_t_pass` the rest (the softmax
combined, dh and its collective, dw); `output_layer` runs them back to back, the pipeline
executor on consecutive ticks, carrying C1's result from one to the next.

Collectives per microbatch (counted in the compiled HLO by tests/parallel/test_vocab.py;
the paper counts communication BARRIERS, i.e. points where a pass waits on all stages):

- algorithm=1 (the paper's Algorithm 1, forward-phase optimisation): barrier C1 = ONE
  all-reduce that gathers the 3 statistics per token from every stage (P slots, each
  stage fills its own; online softmax: each stage then combines the P (max, sum) pairs
  itself, exactly); the T pass computes dY with the global softmax, dw and the partial
  dh = dY @ w^T; barrier C2 = ONE all-reduce of dh (D floats per token).
  2 collectives, 2 barriers, with the T pass's matmuls between them.
- algorithm=2 (the paper's Algorithm 2, backward-phase optimisation): the S pass also
  computes the partial input gradient with the LOCAL softmax, exp(y - m_i) @ w^T, and
  the target row of w^T; barrier C1 = the same gather of statistics, a per-token
  rescale by exp(m_i - logsumexp), then ONE all-reduce of dh. 2 collectives, 1 barrier:
  no matmul between them, so dh is ready right after the S pass and the T pass (dw)
  can run any time later.

So "one all-reduce-like collective for Algorithm 2, two for Algorithm 1" holds for
barriers, not for HLO ops (2 and 2). Algorithm 2 cannot be one op at all-reduce cost:
stage i's partial dh is weighted by exp(m_i - logsumexp), which needs every stage's
statistics first, so one sum cannot carry both; the one-op form would all-gather all P
partial gradients, at least P/2 times an all-reduce's traffic. The paper's own code
issues four dependent all-reduces in Algorithm 2's barrier (max; target logit; sum;
gradient) and 3 + 1 in Algorithm 1; gathering the statistics in one all-reduce is
what takes ours to two.

Tied embeddings: the model's tied output weight is embedding_VD.T * d_model**-0.5
(`transformer.unembed`), so the embedding shard IS the output shard, transposed and
scaled; `output_layer_tied` returns the gradient for the embedding shard, to which the
caller adds `embed_grad` of the input side.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxsys import mesh as mesh_lib

# A mesh axis name, or a tuple of them (lax.psum and axis_index take either).
Axes = str | tuple[str, ...]


def bytes_per_microbatch(tokens: int, d_model: int, stages: int, itemsize: int,
                         train: bool = True, tensor: int = 1) -> int:
  """Bytes one device sends for one microbatch of `tokens` tokens (its share on this
  device), each psum a ring all-reduce, the vocabulary split over stages x `tensor`
  (N shards): the embedding's gather and, in training, dh over all N shards; the softmax
  statistics (3 float32 per token from each of the N shards) too; the last stage's hidden
  state to every stage (`broadcast_from`) and, in training, the embedding gradient's
  broadcast of dx over `stage` only. Activations are `itemsize` bytes per value."""
  ring = lambda n, over: 2 * (over - 1) * n // over
  shards, activation = stages * tensor, tokens * d_model * itemsize
  activations = 2 if train else 1  # over all shards, and over stage alone: each
  return (activations * (ring(activation, shards) + ring(activation, stages))
          + ring(shards * tokens * 3 * 4, shards))


def padded_vocab(vocab_size: int, shards: int) -> int:
  """`vocab_size` rounded up to a multiple of `shards` (so every shard holds Vs rows)."""
  if vocab_size < 1 or shards < 1:
    raise ValueError(f"padded_vocab: vocab_size={vocab_size} and shards={shards} must be >= 1")
  return -(-vocab_size // shards) * shards


def _local_ids(tokens_BT, vocab_shard_size: int, axis: Axes):
  """Token ids relative to this shard's first row, and whether this shard holds them."""
  local = tokens_BT - lax.axis_index(axis) * vocab_shard_size
  inside = (local >= 0) & (local < vocab_shard_size)
  return jnp.where(inside, local, 0), inside


def _psum_one_source(x, axis: Axes):
  """psum of values that are zero on all shards but one: exact, in x's own bytes.

  Summed as unsigned integers of the same width (zero bits plus one value's bits is that
  value's bits): no rounding, no wider wire format, and it sidesteps an XLA:CPU crash on
  16-bit float all-reduces inside a partially manual shard_map (jax 0.10.2).
  """
  bits = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}.get(x.dtype.itemsize)
  if bits is None or not jnp.issubdtype(x.dtype, jnp.floating):
    return lax.psum(x, axis)
  return lax.bitcast_convert_type(lax.psum(lax.bitcast_convert_type(x, bits), axis), x.dtype)


def broadcast_from(x, source_index: int, *, axis: Axes = mesh_lib.STAGE):
  """`x` of stage `source_index`, on every stage (one psum of the masked value)."""
  # where, not multiply: a non-source stage's x may hold inf or nan.
  return _psum_one_source(jnp.where(lax.axis_index(axis) == source_index, x, jnp.zeros_like(x)),
                          axis)


def embed(embedding_shard_VsD, tokens_BT, *, axis: Axes = mesh_lib.STAGE, dtype=jnp.float32):
  """Token embeddings [B, T, D] in `dtype` on every shard, from each one's vocabulary rows."""
  local, inside = _local_ids(tokens_BT, embedding_shard_VsD.shape[0], axis)
  rows = jnp.take(embedding_shard_VsD, local, axis=0).astype(dtype)
  # Exactly one shard contributes a non-zero row per token, so the sum is exact in any dtype.
  return _psum_one_source(jnp.where(inside[..., None], rows, jnp.zeros_like(rows)), axis)


def embed_grad(dx_BTD, tokens_BT, *, vocab_shard_size: int, axis: Axes = mesh_lib.STAGE):
  """Gradient [Vs, D] (float32) of this embedding shard; dx is the same on all shards."""
  local, inside = _local_ids(tokens_BT, vocab_shard_size, axis)
  dx = jnp.where(inside[..., None], dx_BTD.astype(jnp.float32), 0.0)
  d = dx.shape[-1]
  return jnp.zeros((vocab_shard_size, d), jnp.float32).at[local.reshape(-1)].add(dx.reshape(-1, d))


def _gather_by_psum(x, axis: Axes):
  """[P, ...]: every shard's `x`, by ONE psum of x placed in this shard's slot.

  Not `lax.all_gather`: its result is typed as varying over `axis`, so the loss built
  from it could not leave shard_map as replicated; the psum's result is invariant. The
  payload is a few floats per token, so the zero slots cost nothing that matters.
  """
  slots = jnp.arange(lax.axis_size(axis)) == lax.axis_index(axis)
  return lax.psum(jnp.where(slots.reshape(-1, *([1] * x.ndim)), x[None], 0), axis)


def _shard_inputs(h_BTD, w_shard_DVs, targets_BT, vocab_size: int, axis: Axes, dtype):
  """h as [M, D], w, and this shard's target one-hot [M, Vs] (zero rows where another owns
  the target), after checking w's shard width."""
  p = lax.axis_size(axis)
  d, vs = w_shard_DVs.shape
  if vs * p != padded_vocab(vocab_size, p):
    raise ValueError(f"output_layer: w_shard_DVs has {vs} columns on {p} shards of axis {axis!r}; "
                     f"vocab_size={vocab_size} needs {padded_vocab(vocab_size, p) // p} "
                     f"(padded_vocab={padded_vocab(vocab_size, p)})")
  local, owns = _local_ids(targets_BT.reshape(-1), vs, axis)
  onehot = jax.nn.one_hot(local, vs, dtype=jnp.float32) * owns[:, None]
  return h_BTD.reshape(-1, d).astype(dtype), w_shard_DVs.astype(dtype), onehot, local, owns


def output_s_pass(h_BTD, w_shard_DVs, targets_BT, *, vocab_size: int, axis: Axes = mesh_lib.STAGE,
                  algorithm: int = 2, dtype=jnp.float32):
  """The S pass and barrier C1: (stats [P, M, 3], the values this shard keeps for the T pass).

  stats is every shard's (max, sum, target logit) per token, the result of the one
  collective; `kept` holds the local softmax numerator e [M, Vs], the local max m [M] and,
  in Algorithm 2, the partial input gradient a [M, D] and the target rows g [M, D]. The T
  pass (`output_t_pass`) may run later: a pipeline carries both to another tick.
  """
  if algorithm not in (1, 2):
    raise ValueError(f"output_layer: algorithm={algorithm!r}; valid: 1, 2")
  h_MD, w, onehot, local, owns = _shard_inputs(h_BTD, w_shard_DVs, targets_BT, vocab_size, axis,
                                               dtype)
  vs = w.shape[1]
  y = jnp.dot(h_MD, w, preferred_element_type=jnp.float32)  # [M, Vs]
  col = lax.axis_index(axis) * vs + jnp.arange(vs)
  y = jnp.where(col < vocab_size, y, -jnp.inf)
  m_local = jnp.max(y, axis=-1)
  # A shard made only of padding has m = -inf; 0 keeps exp(y - m) at 0 instead of nan.
  m_safe = jnp.where(jnp.isfinite(m_local), m_local, 0.0)
  e = jnp.exp(y - m_safe[:, None])  # local softmax numerator, 0 on padding
  y_target = jnp.sum(jnp.where(onehot > 0, y, 0.0), axis=-1)  # 0 unless this shard owns it
  kept = {"e": e, "m": m_local}
  if algorithm == 2:
    # The paper's backward-phase optimisation: the input gradient with the LOCAL
    # softmax, rescaled after the barrier, so no matmul waits on the statistics.
    kept["a"] = jnp.dot(e.astype(dtype), w.T, preferred_element_type=jnp.float32)
    kept["g"] = jnp.where(owns[:, None], jnp.take(w.T, local, axis=0), 0).astype(jnp.float32)
  # Barrier C1: every shard's statistics, combined by each shard in the T pass.
  # m_local, not m_safe: an all-padding shard's -inf must not raise the global max.
  stats = _gather_by_psum(jnp.stack([m_local, jnp.sum(e, axis=-1), y_target], axis=-1), axis)
  return stats, kept


def output_t_pass(h_BTD, w_shard_DVs, targets_BT, mask_BT, stats, kept, *, vocab_size: int,
                  axis: Axes = mesh_lib.STAGE, algorithm: int = 2, dtype=jnp.float32):
  """The T pass of `output_s_pass`'s results: (loss_sum, dh_BTD, dw_shard_DVs), with
  Algorithm 1's T-pass matmul before and Algorithm 2's rescale before barrier C2 (dh)."""
  b, t, d = h_BTD.shape
  h_MD, w, onehot, _, _ = _shard_inputs(h_BTD, w_shard_DVs, targets_BT, vocab_size, axis, dtype)
  mask = mask_BT.reshape(-1).astype(jnp.float32)
  m_all, s_all, yt_all = stats[..., 0], stats[..., 1], stats[..., 2]  # online softmax
  m_glob = jnp.max(m_all, axis=0)
  lse = m_glob + jnp.log(jnp.sum(s_all * jnp.exp(m_all - m_glob), axis=0))  # [M]
  # where: a masked token may carry any target id, even a padding one (logit -inf).
  loss_sum = jnp.sum(jnp.where(mask > 0, (lse - jnp.sum(yt_all, axis=0)) * mask, 0.0))

  # Local softmax numerator -> global softmax, per token; 0 for an all-padding shard
  # (exp(m_safe - lse) would overflow there when every real logit is far below 0).
  scale = jnp.exp(kept["m"] - lse)
  dy = (kept["e"] * scale[:, None] - onehot) * mask[:, None]  # d loss_sum / d logits, [M, Vs]
  if algorithm == 1:
    # The input gradient needs the global softmax; then barrier C2.
    dh_part = jnp.dot(dy.astype(dtype), w.T, preferred_element_type=jnp.float32)
  else:
    dh_part = (kept["a"] * scale[:, None] - kept["g"]) * mask[:, None]
  dh = lax.psum(dh_part, axis)  # the last collective of either algorithm

  # This shard's weight gradient, no communication.
  dw = jnp.dot(h_MD.T, dy.astype(dtype), preferred_element_type=jnp.float32)
  return (loss_sum, dh.reshape(b, t, d).astype(h_BTD.dtype), dw.astype(w_shard_DVs.dtype))


def output_layer(h_BTD, w_shard_DVs, targets_BT, mask_BT, *, vocab_size: int,
                 axis: Axes = mesh_lib.STAGE, algorithm: int = 2, dtype=jnp.float32):
  """Output projection + cross-entropy, forward and backward: (loss_sum, dh_BTD, dw_shard_DVs).

  h is the final-normed hidden state (identical on every stage), w_shard this stage's
  [D, Vs] columns. loss_sum = sum of cross-entropy * mask (float32, identical on every
  stage), dh = d loss_sum / d h (identical on every stage), dw_shard = d loss_sum /
  d w_shard (this stage's). algorithm 1 or 2: see the module docstring. The S and T
  passes back to back; a pipeline runs them on different ticks.
  """
  kw = dict(vocab_size=vocab_size, axis=axis, algorithm=algorithm, dtype=dtype)
  stats, kept = output_s_pass(h_BTD, w_shard_DVs, targets_BT, **kw)
  return output_t_pass(h_BTD, w_shard_DVs, targets_BT, mask_BT, stats, kept, **kw)


def output_layer_tied(h_BTD, embedding_shard_VsD, targets_BT, mask_BT, *, vocab_size: int,
                      axis: Axes = mesh_lib.STAGE, algorithm: int = 2, dtype=jnp.float32):
  """`output_layer` with the tied weight embedding.T * d_model**-0.5.

  Returns (loss_sum, dh_BTD, d_embedding_shard_VsD); add `embed_grad` of the input side
  to d_embedding_shard for the full tied gradient.
  """
  scale = embedding_shard_VsD.shape[1] ** -0.5
  loss_sum, dh, dw = output_layer(h_BTD, embedding_shard_VsD.T * scale, targets_BT, mask_BT,
                                  vocab_size=vocab_size, axis=axis, algorithm=algorithm,
                                  dtype=dtype)
  return loss_sum, dh, (dw.T * scale).astype(embedding_shard_VsD.dtype)
