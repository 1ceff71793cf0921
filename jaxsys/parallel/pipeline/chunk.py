"""A chunk of layers as the executor runs it: the forward with its vjp residuals split off,
the backward that consumes them, and the zero-bubble split of that backward into an
input-gradient pass B and a weight-gradient pass W."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jax_core

from jaxsys.models import transformer
from jaxsys.parallel import dependence
from jaxsys.parallel.pipeline.layout import Batch


class Chunk:
  """A chunk's forward with its vjp residuals split off, and the backward that consumes them.

  Only residuals that depend on the microbatch are stored; those that are functions of
  the weights alone (the weights themselves, reshaped or transposed weights) are
  recomputed by the backward from the live weights, so a residual slot never holds a
  copy of the stage's weights.

  Each pass is traced once per argument types and re-run from its jaxpr: the executor
  runs a chunk's forward and backward in every branch that holds them, and tracing their
  vjps again each time dominated its tracing.
  """

  def __init__(self, cfg: transformer.TransformerConfig, attention_fn: Callable):
    self.cfg, self.attention_fn = cfg, attention_fn
    self._traces: dict[Any, Any] = {}

  def _traced(self, kind, args, build: Callable, key: Callable | None = None):
    """build(flat args, their tree), once per pass `kind` and argument types (`key` of each
    leaf, default `_type_key`)."""
    flat, tree = jax.tree.flatten(args)
    cache_key = (kind, tree, tuple(map(key or _type_key, flat)))
    if cache_key not in self._traces:
      self._traces[cache_key] = build(flat, tree)
    return self._traces[cache_key]

  def _once(self, fn: Callable, *args):
    """fn(*args) from fn's jaxpr for these argument types, traced on the first call."""
    def build(flat, tree):
      closed, shape = jax.make_jaxpr(lambda *f: fn(*jax.tree.unflatten(tree, f)),
                                     return_shape=True)(*flat)
      return closed, jax.tree.structure(shape)
    closed, out_tree = self._traced(fn, args, build)
    return jax.tree.unflatten(out_tree, jax_core.jaxpr_as_fun(closed)(*jax.tree.leaves(args)))

  def apply(self, params, x, mb: Batch):
    return self._once(self._apply, params, x, mb)

  def _apply(self, params, x, mb: Batch):
    return transformer.apply_layers(self.cfg, params, x, mb["positions"], mb["segment_ids"],
                                    self.attention_fn)

  def _vjp(self, params, x, mb: Batch):
    y, vjp_fn = jax.vjp(lambda params, x: self._apply(params, x, mb), params, x)
    leaves, treedef = jax.tree.flatten(vjp_fn)
    return y, leaves, treedef

  def _forward_pass(self, params, x, mb: Batch) -> "_Forward":
    """The forward for these argument types, traced once: a jaxpr of y and the residuals
    that depend on the microbatch (the stored ones)."""
    n_params = len(jax.tree.leaves(params))

    def build(flat, tree):
      vjp_tree = []

      def flat_forward(*flat):
        y, leaves, treedef = self._vjp(*jax.tree.unflatten(tree, flat))
        vjp_tree.append(treedef)
        return [y, *leaves]
      closed = jax.make_jaxpr(flat_forward)(*flat)
      data = dependence.outputs_depend_on(closed.jaxpr,
                                          [i >= n_params for i in range(len(flat))])[1:]
      part = lambda used: jax_core.ClosedJaxpr(
          pe.dce_jaxpr(closed.jaxpr, used, instantiate=True)[0], closed.consts)
      return _Forward(part([True, *data]), part([False, *(not d for d in data)]), data,
                      vjp_tree[0])
    return self._traced("forward", (params, x, mb), build)

  def residual_shapes(self, params, x, mb: Batch):
    """Shapes of the residuals a forward stores."""
    return _shapes(self._forward_pass(params, x, mb).jaxpr.out_avals[1:])

  def forward(self, params, x, mb: Batch):
    """(y, the residuals the backward reads from storage)."""
    outs = jax_core.jaxpr_as_fun(self._forward_pass(params, x, mb).jaxpr)(
        *jax.tree.leaves((params, x, mb)))
    return outs[0], list(outs[1:])

  def backward(self, params, residuals, dy, mb: Batch):
    """(d params, d x) from the stored residuals."""
    return self._once(self._backward, params, residuals, dy, mb)

  def _backward(self, params, residuals, dy, mb: Batch):
    # The vjp's structure and the residuals of the weights alone come from the forward's
    # trace, those recomputed here from the live weights: only the transpose is traced.
    x = jnp.zeros_like(dy)  # read by no residual of the weights alone
    forward = self._forward_pass(params, x, mb)
    weights_only = iter(jax_core.jaxpr_as_fun(forward.weights_only)(
        *jax.tree.leaves((params, x, mb))))
    stored = iter(residuals)
    leaves = [next(stored) if d else next(weights_only) for d in forward.stored]
    return jax.tree.unflatten(forward.vjp_tree, leaves)(dy)

  def _split(self, params, residuals, dy, mb: Batch) -> "_Split":
    """The backward unzipped in two by data dependence (jax's partial evaluation, as
    `jax.linearize` splits a function): the residuals the input gradient does not read
    (the matmul inputs only weight gradients need) are 'unknown', so every operation that
    reads them, each weight gradient's matmul, goes to W, and the rest, the input
    gradient and the whole cotangent chain, to B, which hands W the cotangents it needs
    (the stash). B + W does the backward's work once: no op runs in both."""
    n_params, n_res = len(jax.tree.leaves(params)), len(residuals)

    def build(flat, tree):
      def flat_backward(*flat):
        p, r, d, m = jax.tree.unflatten(tree, flat)
        dparams, dx = self._backward(p, r, d, m)
        return [dx, *jax.tree.leaves(dparams)]
      closed = jax.make_jaxpr(flat_backward)(*_shapes(flat))
      n_out = len(closed.out_avals)
      # What no output reads (the zeros standing in for x) is dead code: drop it first.
      jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * n_out, instantiate=True)
      _, for_dx = pe.dce_jaxpr(jaxpr, [True] + [False] * (n_out - 1))
      weight_only = [n_params <= i < n_params + n_res and not used
                     for i, used in enumerate(for_dx)]
      known, unknown, out_unknown, _ = pe.partial_eval_jaxpr_nounits(
          jax_core.ClosedJaxpr(jaxpr, closed.consts), weight_only, False)
      assert not out_unknown[0], "the input gradient reads no weight-only residual"
      return _Split(weight_only, out_unknown, known, unknown)
    # Traced from shapes alone: the stash's shapes are asked with the residuals'
    # ShapeDtypeStructs before the ticks, and that one trace serves every B and W.
    return self._traced("split", (params, residuals, dy, mb), build,
                        key=lambda a: (a.shape, a.dtype))

  def stash_shapes(self, params, residuals, dy, mb: Batch):
    """Shapes of what B hands W (held from B to W, one entry per held output gradient)."""
    split = self._split(params, residuals, dy, mb)
    return _shapes(split.known.out_avals[split.out_unknown.count(False):])

  def backward_input(self, params, residuals, dy, mb: Batch):
    """Zero-bubble B: (input gradient, the weight gradients B computes (zeros where W
    does), the stash for W)."""
    split = self._split(params, residuals, dy, mb)
    flat = jax.tree.leaves((params, residuals, dy, mb))
    outs = jax_core.jaxpr_as_fun(split.known)(
        *[x for x, w in zip(flat, split.weight_only) if not w])
    n_known = split.out_unknown.count(False)
    known, stash = iter(outs[:n_known]), list(outs[n_known:])
    values = [None if u else next(known) for u in split.out_unknown]
    return values[0], split.dparams(params, values[1:]), stash

  def backward_weight(self, params, residuals, dy, stash, mb: Batch):
    """Zero-bubble W: the weight gradients B left, from B's stash and the residuals only
    they read (zeros where B computed them). `dy` only names the split (W never reads it)."""
    split = self._split(params, residuals, dy, mb)
    flat = jax.tree.leaves((params, residuals, dy, mb))
    outs = iter(jax_core.jaxpr_as_fun(split.unknown)(
        *stash, *[x for x, w in zip(flat, split.weight_only) if w]))
    values = [next(outs) if u else None for u in split.out_unknown]
    return split.dparams(params, values[1:])


def _type_key(value):
  """Shape, dtype and varying manual axes: the stored residuals' shapes are asked with a
  ShapeDtypeStruct, whose type has no sharding, and the same trace serves the forward
  (jax 0.10 keeps the varying axes in `manual_axis_type`, later versions in `vma`)."""
  t = jax.typeof(value)
  return t.shape, t.dtype, t.weak_type, getattr(getattr(t, "manual_axis_type", None),
                                                "varying", getattr(t, "vma", None))


def _shapes(avals) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


@dataclasses.dataclass(frozen=True)
class _Forward:
  """A chunk forward's vjp as jaxprs of the (params, x, mb) leaves."""
  jaxpr: Any  # -> y and the stored residuals
  weights_only: Any  # -> the residuals of the weights alone, which the backward recomputes
  stored: list[bool]  # per vjp residual leaf: stored (it depends on the microbatch)
  vjp_tree: Any  # the vjp function's treedef, over its residual leaves


@dataclasses.dataclass(frozen=True)
class _Split:
  """A chunk backward unzipped into B (`known`) and W (`unknown`) jaxprs (see Chunk._split)."""
  weight_only: list[bool]  # per flat (params, residuals, dy, mb) input: read by W alone
  out_unknown: list[bool]  # per output (dx, *dparams leaves): computed by W
  known: Any  # -> the outputs B computes, then the stash
  unknown: Any

  def dparams(self, params, leaves):
    """The params-shaped gradient from its leaves, zeros where None."""
    like = jax.tree.leaves(params)
    return jax.tree.unflatten(jax.tree.structure(params), [
        jnp.zeros(p.shape, p.dtype) if x is None else x for p, x in zip(like, leaves)])
