"""TrainState: everything a training run carries from step to step, as one pytree."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsys import mesh as mesh_lib
from jaxsys.models import transformer


@dataclasses.dataclass(frozen=True)
class TrainState:
  """The state of any layout: one model, or R replicas stacked `[R, ...]` with an outer state.

  A pytree of `step`, `params`, `opt_state` and, only when there is one, `outer`: a
  one-model checkpoint holds exactly the first three.
  """
  step: jax.Array  # int32 scalar: optimizer steps taken (the same on every replica)
  params: dict[str, Any]
  opt_state: optax.OptState  # the inner optimizer's, per replica when stacked
  outer: Any = None  # the outer optimizer's state [R, ...]; None without one

  def replace(self, **fields) -> "TrainState":
    return dataclasses.replace(self, **fields)


def _flatten_state(state: TrainState):
  names = ("step", "params", "opt_state") + ("outer",) * (state.outer is not None)
  return [(jax.tree_util.GetAttrKey(n), getattr(state, n)) for n in names], len(names)


jax.tree_util.register_pytree_with_keys(
    TrainState, _flatten_state, lambda n, children: TrainState(*children),
    flatten_func=lambda s: ([c for _, c in _flatten_state(s)[0]], _flatten_state(s)[1]))


def init_train_state(model_cfg: transformer.TransformerConfig, optimizer: optax.GradientTransformation,
                     seed: int) -> TrainState:
  """A fresh state; jit it with `state_shardings` as out_shardings to create it sharded."""
  # The split keeps the parameters of a seed what they were when the state also held a key.
  params_key, _ = jax.random.split(jax.random.key(seed))
  params = transformer.init_params(model_cfg, params_key)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


REPLICA_AXIS = mesh_lib.REPLICA


def state_shardings(abstract_state: TrainState, model_cfg: transformer.TransformerConfig,
                    optimizer: optax.GradientTransformation, mesh: Mesh,
                    rules=mesh_lib.DEFAULT_RULES, axes=None, replicas: bool = False) -> TrainState:
  """NamedShardings for every leaf: parameters (and their optimizer moments) by logical axes.

  `axes`: the parameters' logical axes when the state holds a view of the canonical
  parameters (default: the model's own, `transformer.param_axes`). `replicas`: params,
  inner and outer states carry a leading [R] dim, split over the `replica` mesh axis; an
  outer state's leaf shards like the parameter whose path its own path ends with.
  """
  axes = transformer.param_axes(model_cfg) if axes is None else axes
  one = (abstract_state.replace(params=one_replica(abstract_state.params),
                                opt_state=one_replica(abstract_state.opt_state),
                                outer=one_replica(abstract_state.outer))
         if replicas else abstract_state)
  param_sh = mesh_lib.logical_to_sharding(axes, mesh, rules, shapes=one.params)
  replicated = NamedSharding(mesh, PartitionSpec())
  # Optimizer moments mirror the parameter tree; counts and other scalars are replicated.
  opt_sh = optax.tree_map_params(optimizer, lambda _, sh: sh, one.opt_state, param_sh,
                                 transform_non_params=lambda _: replicated,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))
  outer_sh = (None if one.outer is None
              else _path_suffix_shardings(one.outer, one.params, param_sh, replicated))
  if replicas:
    lead = lambda tree: jax.tree.map(
        lambda sh: NamedSharding(mesh, PartitionSpec(REPLICA_AXIS, *sh.spec)), tree)
    param_sh, opt_sh, outer_sh = lead(param_sh), lead(opt_sh), lead(outer_sh)
  return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, outer=outer_sh)


def one_replica(tree):
  """Abstract leaves [R, ...] -> one replica's [...]."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)


def _path_suffix_shardings(tree, params, param_sh, replicated):
  """Shardings for an outer state: a leaf whose path ends with a parameter's path shards like it."""
  by_path = {jax.tree_util.keystr(p): (x.shape, s) for (p, x), s in zip(
      jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(param_sh))}

  def one(path, leaf):
    key = jax.tree_util.keystr(path)
    for ppath, (shape, sh) in by_path.items():
      if key.endswith(ppath) and tuple(leaf.shape) == tuple(shape):
        return sh
    return replicated
  return jax.tree_util.tree_map_with_path(one, tree)


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """Abstract leaves carrying `shardings`: what a restore reads into, or a jit's target."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def abstract_train_state(model_cfg, optimizer, seed: int = 0) -> TrainState:
  return jax.eval_shape(lambda: init_train_state(model_cfg, optimizer, seed))
