"""The embedding and the head (final norm, output layer, cross-entropy) as the executor's
phases run them: on the first and last stage (replicated), or split over the stages
(vocabulary parallelism, `vocab.py`), the head then as S and T passes."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxsys import mesh as mesh_lib
from jaxsys.models import transformer
from jaxsys.parallel import vocab
from jaxsys.parallel.pipeline.layout import AXIS, TENSOR_AXIS, Batch, Layout


class VocabLayers:
  """Input embedding and head (final norm, output layer, summed cross-entropy) per microbatch.

  Replicated: stage 0 embeds, the head's stage (the last chunk's: the last stage, or
  stage 0 in a V) runs the head; others skip (per-device branch). Vocabulary-parallel:
  every stage runs its vocab shard and one collective joins them. Over stage x tensor,
  `tensor` (automatic in the executor) is taken by hand around the vocab functions, so
  each device runs its own 1 / (stages x tensor) of the vocabulary and their collectives
  span both axes; the broadcasts of hidden states stay over `stage`.
  """

  def __init__(self, cfg, layout: Layout, algorithm: int, mesh, head_stage: int):
    self.cfg, self.layout, self.algorithm = cfg, layout, algorithm
    self.last = head_stage
    tensor = mesh_lib.degrees(mesh).tensor
    if layout.vocab_parallel and layout.tensor not in (1, tensor):
      raise ValueError(f"the layout splits the vocabulary over tensor={layout.tensor}, the mesh "
                       f"has tensor={tensor}: build the Layout with tensor={tensor} (or 1, over "
                       f"stage alone)")
    self.axes = layout.vocab_axes
    self.shard_size = layout.padded_vocab // (layout.stages * layout.tensor)

  def _by_hand(self, fn, in_specs, out_specs):
    """`fn` (vocab.py's, over `self.axes`) where every one of those axes is manual: with
    `tensor` among them, in a shard_map over `tensor` (specs name it alone; `stage` and the
    executor's other manual axes stay manual inside)."""
    if TENSOR_AXIS not in self.axes:
      return fn
    # check_vma=False as the executor's: its values carry no varying-axes types to check.
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names={TENSOR_AXIS},
                         check_vma=False)

  @staticmethod
  def _split(name: str) -> P:
    """The `tensor` spec of a vocab weight: its vocabulary dim split."""
    return P(TENSOR_AXIS) if name == "embedding" else P(None, TENSOR_AXIS)

  def embed(self, params, tokens, stage):
    cfg = self.cfg
    if self.layout.vocab_parallel:
      fn = self._by_hand(
          functools.partial(vocab.embed, axis=self.axes, dtype=jnp.dtype(cfg.dtype)),
          (self._split("embedding"), P()), P())
      return fn(params["embedding"], tokens)
    return jax.lax.cond(stage == 0, lambda: transformer.embed(cfg, params["embedding"], tokens),
                        lambda: jnp.zeros(tokens.shape + (cfg.d_model,), cfg.dtype))

  def embed_grad(self, params, dx, tokens, stage):
    """Gradient of the embedding (replicated: on stage 0 only; else the local shard)."""
    if self.layout.vocab_parallel:
      dx = vocab.broadcast_from(dx, 0, axis=AXIS)
      fn = self._by_hand(functools.partial(vocab.embed_grad, vocab_shard_size=self.shard_size,
                                           axis=self.axes),
                         (P(), P()), self._split("embedding"))
      return fn(dx, tokens)
    _, vjp = jax.vjp(lambda e: transformer.embed(self.cfg, e, tokens), params["embedding"])
    return jax.lax.cond(stage == 0, lambda: vjp(dx)[0],
                        lambda: jnp.zeros_like(params["embedding"]))

  def _head_params(self, params):
    names = ("final_norm", "embedding" if self.cfg.tie_embeddings else "unembedding")
    return {k: params[k] for k in names}

  def loss(self, params, y, mb: Batch, stage):
    """The head's loss sum alone (evaluation)."""
    cfg = self.cfg
    head_params = self._head_params(params)
    if not self.layout.vocab_parallel:
      return jax.lax.cond(stage == self.last,
                          lambda: self._loss_sum(head_params, y, mb),
                          lambda: jnp.zeros((), jnp.float32))
    h = transformer.rms_norm(vocab.broadcast_from(y, self.last, axis=AXIS),
                             head_params["final_norm"], cfg.norm_eps)
    # Algorithm 1 computes the input gradient after the loss; unused here, XLA drops it.
    return self._output_layer(head_params, h, mb, algorithm=1)[1]

  def _output_layer(self, head_params, h, mb: Batch, algorithm: int):
    """(output weight's name, loss sum, dh, d weight shard) of the vocab-parallel output layer."""
    cfg = self.cfg
    name = "embedding" if cfg.tie_embeddings else "unembedding"
    output_layer = vocab.output_layer_tied if cfg.tie_embeddings else vocab.output_layer
    fn = self._by_hand(functools.partial(output_layer, vocab_size=cfg.vocab_size, axis=self.axes,
                                         algorithm=algorithm, dtype=jnp.dtype(cfg.dtype)),
                       (P(), self._split(name), P(), P()), (P(), P(), self._split(name)))
    return name, *fn(h, head_params[name], mb["targets"], mb["loss_mask"])

  def _loss_sum(self, head_params, y, mb: Batch):
    """The head's summed cross-entropy (`transformer.head_losses`, as the unpipelined loss)."""
    losses = transformer.head_losses(self.cfg, y, head_params["final_norm"],
                                     head_params.get("embedding"), head_params.get("unembedding"),
                                     mb["targets"])
    return jnp.sum(losses * mb["loss_mask"])

  def head(self, params, y, mb: Batch, stage):
    """Replicated: (loss sum, d loss / d y, gradients of the head's parameters) for one
    microbatch, on the head's stage (zeros elsewhere)."""
    head_params = self._head_params(params)

    def loss(hp, y):
      return self._loss_sum(hp, y, mb)

    def run():
      value, (dhp, dy) = jax.value_and_grad(loss, argnums=(0, 1))(head_params, y)
      return value, dy, dhp
    skip = lambda: jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), y, head_params))
    return jax.lax.cond(stage == self.last, run, skip)

  def _output_weight(self):
    """The name of the output layer's weight, and the output weight [D, Vs] of its shard
    (tied: the embedding shard transposed and scaled, `transformer.unembed`)."""
    if not self.cfg.tie_embeddings:
      return "unembedding", lambda weight: weight
    return "embedding", lambda weight: weight.T * weight.shape[1] ** -0.5

  def _pass_kw(self) -> dict[str, Any]:
    return dict(vocab_size=self.cfg.vocab_size, axis=self.axes, algorithm=self.algorithm,
                dtype=jnp.dtype(self.cfg.dtype))

  def head_s(self, params, y, mb: Batch):
    """Vocabulary-parallel S pass of one microbatch on every stage: the head stage's hidden
    state broadcast and normed, the shard's statistics all-reduced. Returns what its T pass
    reads (`head_t`), which a later tick runs: the collective's result is carried to it."""
    name, as_output = self._output_weight()
    y = vocab.broadcast_from(y, self.last, axis=AXIS)
    h = transformer.rms_norm(y, params["final_norm"], self.cfg.norm_eps)

    def s_pass(h, weight, targets):
      stats, kept = vocab.output_s_pass(h, as_output(weight), targets, **self._pass_kw())
      return stats, jax.tree.map(lambda x: x[None], kept)  # one row per tensor shard
    fn = self._by_hand(s_pass, (P(), self._split(name), P()), (P(), P(TENSOR_AXIS)))
    stats, kept = fn(h, params[name], mb["targets"])
    return {"y": y, "stats": stats, "kept": kept}

  def head_t(self, params, carried, mb: Batch, stage):
    """Vocabulary-parallel T pass of `head_s`'s results: (loss sum, d loss / d y, gradients
    of the head's parameters), as `head`."""
    value, dh, dw = self.head_t_pass(params, carried, mb)
    dy, dnorm = self.head_dy(params, carried["y"], dh, stage)
    return value, dy, {**dw, **dnorm}

  def head_t_pass(self, params, carried, mb: Batch):
    """The T pass up to its last all-reduce: (loss sum, d loss / d h, {output weight's
    name: its shard's gradient}); `head_dy` turns d loss / d h into d loss / d y."""
    cfg = self.cfg
    name, as_output = self._output_weight()
    h = transformer.rms_norm(carried["y"], params["final_norm"], cfg.norm_eps)

    def t_pass(h, weight, targets, mask, stats, kept):
      value, dh, dw = vocab.output_t_pass(h, as_output(weight), targets, mask, stats,
                                          jax.tree.map(lambda x: x[0], kept), **self._pass_kw())
      if cfg.tie_embeddings:  # the output weight's gradient as the embedding's
        dw = (dw.T * weight.shape[1] ** -0.5).astype(weight.dtype)
      return value, dh, dw
    split = self._split(name)
    fn = self._by_hand(t_pass, (P(), split, P(), P(), P(), P(TENSOR_AXIS)), (P(), P(), split))
    value, dh, dw = fn(h, params[name], mb["targets"], mb["loss_mask"], carried["stats"],
                       carried["kept"])
    return value, dh, {name: dw}

  def head_dy(self, params, y, dh, stage):
    """(d loss / d y, {"final_norm": its gradient}) from the T pass's d loss / d h."""
    h, norm_vjp = jax.vjp(lambda y, s: transformer.rms_norm(y, s, self.cfg.norm_eps), y,
                          params["final_norm"])
    dy, dnorm = norm_vjp(dh.astype(h.dtype))
    # Every stage computed the same norm gradient: keep one copy, the sum over stages adds them.
    return dy, {"final_norm": jnp.where(stage == self.last, dnorm, 0.0)}
