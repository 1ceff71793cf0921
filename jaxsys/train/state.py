"""TrainState: everything a training run carries from step to step, as one pytree."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsys import mesh as mesh_lib
from jaxsys.models import transformer


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: dict[str, Any]
  opt_state: optax.OptState


def init_train_state(model_cfg: transformer.TransformerConfig, optimizer: optax.GradientTransformation,
                     seed: int) -> TrainState:
  """A fresh state; jit it with `state_shardings` as out_shardings to create it sharded."""
  # The split keeps the parameters of a seed what they were when the state also held a key.
  params_key, _ = jax.random.split(jax.random.key(seed))
  params = transformer.init_params(model_cfg, params_key)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def state_shardings(abstract_state: TrainState, model_cfg: transformer.TransformerConfig,
                    optimizer: optax.GradientTransformation, mesh: Mesh,
                    rules=mesh_lib.DEFAULT_RULES, axes=None) -> TrainState:
  """NamedShardings for every leaf: parameters (and their optimizer moments) by logical axes.

  `axes`: the parameters' logical axes when the state holds a view of the canonical
  parameters (default: the model's own, `transformer.param_axes`).
  """
  axes = transformer.param_axes(model_cfg) if axes is None else axes
  param_sh = mesh_lib.logical_to_sharding(axes, mesh, rules, shapes=abstract_state.params)
  replicated = NamedSharding(mesh, PartitionSpec())
  # Optimizer moments mirror the parameter tree; counts and other scalars are replicated.
  opt_sh = optax.tree_map_params(optimizer, lambda _, sh: sh, abstract_state.opt_state, param_sh,
                                 transform_non_params=lambda _: replicated,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))
  return TrainState(step=replicated, params=param_sh, opt_state=opt_sh)


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """Abstract leaves carrying `shardings`: what a restore reads into, or a jit's target."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def abstract_train_state(model_cfg, optimizer, seed: int = 0) -> TrainState:
  return jax.eval_shape(lambda: init_train_state(model_cfg, optimizer, seed))
