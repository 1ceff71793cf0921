"""Training with an outer optimizer: R replicas on the `replica` mesh axis, each its own inner run.

The run's arrays get a leading [R] dim sharded on `replica` (one model, many
layouts: the DiLoCo view `[replica, ...]` of the same parameters); each replica may itself be
sharded over data/fsdp/tensor. The inner step is the plain `train_step`, vmapped
over replicas (replica r takes rows r*B/R.. of the global batch), so inner optimizer
states stay per replica and are never averaged. After each step the outer optimizer
says is due (every `sync_every` steps; Streaming DiLoCo's fragments in between) the loop
calls `sync_fn`: the outer optimizer's `sync` under `jax.shard_map` over `replica`
only (the other axes stay automatic), so its collectives are explicit in the HLO.
For an outer optimizer that `overlaps` (CO2; Streaming DiLoCo with overlap_steps > 0) the
loop instead runs `sync_train_fn`, the sync and the next inner step as one program: the
step does not wait for the collective the sync launches, so the two can overlap.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsys import mesh as mesh_lib
from jaxsys.checkpoint import layouts
from jaxsys.kernels import sharded
from jaxsys.models import transformer
from jaxsys.optim import outer as outer_lib
from jaxsys.optim.co2 import co2
from jaxsys.optim.diloco import diloco
from jaxsys.optim.noloco import noloco
from jaxsys.optim.inner import make_optimizer
from jaxsys.optim.streaming import streaming_diloco
from jaxsys.train import state as state_lib
from jaxsys.train import step as step_lib
from jaxsys.train.state import TrainState

OUTERS = ("none", "diloco", "noloco", "co2", "streaming_diloco")
AXIS = "replica"


@struct.dataclass
class ReplicaTrainState:
  step: jax.Array  # int32 scalar: inner steps taken (the same on every replica)
  params: Any  # [R, ...]
  opt_state: Any  # [R, ...] inner optimizer state, per replica
  outer: Any  # [R, ...] outer optimizer state


def _field(cfg, name: str, default=None):
  return cfg[name] if name in cfg and cfg[name] is not None else default


def make_outer_optimizer(cfg) -> outer_lib.OuterOptimizer | None:
  """The outer optimizer named by `cfg.outer` (config.optimizer), None for 'none' (plain DP).

  Unset (None) fields take the algorithm's own default.
  """
  name = _field(cfg, "outer", "none")
  if name not in OUTERS:
    raise ValueError(f"optimizer.outer={name!r} is unknown; valid: {', '.join(OUTERS)}")
  if name == "none":
    return None
  fields = {"diloco": ("lr", "momentum", "nesterov", "compression", "error_feedback"),
            "noloco": ("lr", "momentum", "gamma", "group_size", "seed"),
            "co2": ("lr", "momentum", "staleness_penalty", "momentum_clip", "allow_unstable"),
            "streaming_diloco": ("lr", "momentum", "nesterov", "compression", "fragments",
                                 "overlap_steps", "mixing")}[name]
  kw = {}
  for key in fields:  # optimizer.outer_<key>: the library's `outer_lr`, `gamma`, ...
    value = _field(cfg, f"outer_{key}")
    if value is not None:
      kw[key if key not in ("lr", "momentum") else f"outer_{key}"] = value
  try:
    return {"diloco": diloco, "noloco": noloco, "co2": co2, "streaming_diloco": streaming_diloco}[name](
        sync_every=cfg.outer_sync_every, **kw)
  except ValueError as e:  # name the config fields: sync_every=0 -> optimizer.outer_sync_every=0
    raise ValueError(_OUTER_ARG.sub(r"optimizer.outer_\1", str(e))) from None


# Library argument names in an outer optimizer's error, longest first (momentum_clip
# before momentum); each is the config field optimizer.outer_<name>.
_OUTER_ARG = re.compile(r"\b(?:outer_)?(sync_every|lr|momentum_clip|momentum|nesterov|compression|"
                        r"error_feedback|gamma|group_size|seed|staleness_penalty|"
                        r"allow_unstable|fragments|overlap_steps|mixing)(?==)")


def num_replicas(mesh: Mesh, outer_name: str) -> int:
  """Size of the mesh's `replica` axis; an outer optimizer needs one of size >= 2."""
  size = dict(mesh.shape).get(AXIS, 0)
  if size < 2:
    raise ValueError(
        f"optimizer.outer={outer_name!r} needs a mesh with a 'replica' axis of size >= 2, but "
        f"the mesh is {mesh_lib.describe(mesh)}; e.g. mesh='replica=4,data=-1'")
  return size


def _one_replica(tree):
  """Abstract [R, ...] leaves -> one replica's [...] leaves."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)


def _with_replica(sharding: NamedSharding) -> NamedSharding:
  return NamedSharding(sharding.mesh, PartitionSpec(AXIS, *sharding.spec))


def init_replica_state(model_cfg, optimizer, outer: outer_lib.OuterOptimizer, replicas: int,
                       seed: int) -> ReplicaTrainState:
  """Every replica starts from the same parameters and a fresh inner state."""
  base = state_lib.init_train_state(model_cfg, optimizer, seed)
  return start_from_params(base.step, base.params, optimizer, outer, replicas)


def start_from_params(step, params, optimizer, outer: outer_lib.OuterOptimizer,
                      replicas: int) -> ReplicaTrainState:
  """Every replica and the outer state at `params` (one replica's), fresh inner and outer states."""
  return with_fresh_outer(outer, step, layouts.stack_replicas(params, replicas),
                          layouts.stack_replicas(optimizer.init(params), replicas))


def with_fresh_outer(outer: outer_lib.OuterOptimizer, step, params, opt_state) -> ReplicaTrainState:
  """Replicas at `params` [R, ...] and inner states, the outer state fresh at them."""
  return ReplicaTrainState(step=step, params=params, opt_state=opt_state,
                           outer=jax.vmap(outer.init)(params))


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


def replica_state_shardings(abstract: ReplicaTrainState, model_cfg, optimizer, mesh: Mesh,
                            rules=mesh_lib.DEFAULT_RULES, axes=None) -> ReplicaTrainState:
  """Per-replica shardings by logical axes, with `replica` prepended on the leading [R] dim.

  `rules`, `axes`: as `state.state_shardings` takes them (a pipeline's stage view).
  """
  one = _one_replica((abstract.params, abstract.opt_state, abstract.outer))
  base = state_lib.state_shardings(
      TrainState(step=abstract.step, params=one[0], opt_state=one[1]),
      model_cfg, optimizer, mesh, rules, axes)
  replicated = NamedSharding(mesh, PartitionSpec())
  outer_sh = _path_suffix_shardings(one[2], one[0], base.params, replicated)
  add = lambda tree: jax.tree.map(_with_replica, tree)
  return ReplicaTrainState(step=replicated, params=add(base.params), opt_state=add(base.opt_state),
                           outer=add(outer_sh))


def replica_train_step(state: ReplicaTrainState, batch, *, model_cfg, optimizer, replicas: int,
                       accum_steps: int = 1
                       ) -> tuple[ReplicaTrainState, dict[str, jax.Array]]:
  """One inner step on every replica; replica r takes rows [r*B/R, (r+1)*B/R) of the batch.

  The loader gives each process a contiguous block of the global batch, so these rows
  are the same on any number of processes and no row moves between hosts.
  """
  batch_R = jax.tree.map(lambda x: x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:]),
                         batch)

  def one(params, opt_state, b):
    inner = TrainState(step=state.step, params=params, opt_state=opt_state)
    inner, m = step_lib.train_step(inner, b, model_cfg=model_cfg, optimizer=optimizer,
                                   accum_steps=accum_steps)
    return inner.params, inner.opt_state, m

  params, opt_state, m = jax.vmap(one, spmd_axis_name=AXIS)(state.params, state.opt_state,
                                                            batch_R)
  tokens = jnp.sum(m["tokens"])
  metrics = {"loss": jnp.sum(m["loss"] * m["tokens"]) / jnp.maximum(tokens, 1.0),
             "grad_norm": jnp.sqrt(jnp.mean(jnp.square(m["grad_norm"]))), "tokens": tokens}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_sync(outer: outer_lib.OuterOptimizer, mesh: Mesh) -> Callable:
  """(params [R..], outer state [R..]) -> same, by `outer.sync` under shard_map over `replica`."""
  def per_replica(params, state):
    squeeze = lambda t: jax.tree.map(lambda x: x[0], t)
    params, state = outer.sync(squeeze(params), squeeze(state), axis_name=AXIS)
    return jax.tree.map(lambda x: x[None], (params, state))

  spec = PartitionSpec(AXIS)
  return jax.shard_map(per_replica, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
                       axis_names={AXIS})


def dp_bytes_per_step(params, mesh: Mesh) -> int:
  """Gradient bytes one data-parallel worker sends per step (ring all-reduce over batch shards).

  fsdp's reduce-scatter of gradients plus all-gather of parameters moves the same
  2(N-1)/N bytes; tensor/context-parallel activation traffic is not counted.
  """
  n = math.prod(mesh.shape[a] for a in ("replica", "data", "fsdp") if a in mesh.shape)
  return outer_lib.ring_allreduce_bytes(outer_lib.tree_bytes(params), n) if n > 1 else 0


def jit_steps(inner_step: Callable, outer: outer_lib.OuterOptimizer, mesh: Mesh, state_sh,
              batch_sh, compiler_options) -> tuple[Callable, Callable, Callable | None]:
  """(train_fn, sync_fn, sync_train_fn) of a replica run, jitted with donation: the inner
  step, the outer sync and, for an outer optimizer that `overlaps`, the two as one program
  (None otherwise)."""
  replicated = NamedSharding(mesh, PartitionSpec())
  sync = make_sync(outer, mesh)

  def sync_state(state: ReplicaTrainState) -> ReplicaTrainState:
    params, outer_state = sync(state.params, state.outer)
    return state.replace(params=params, outer=outer_state)

  def jit(fn, ins, outs):
    return jax.jit(fn, in_shardings=ins, out_shardings=outs, donate_argnums=0,
                   compiler_options=compiler_options)
  step_out = (state_sh, replicated)
  return (jit(inner_step, (state_sh, batch_sh), step_out), jit(sync_state, (state_sh,), state_sh),
          jit(lambda s, b: inner_step(sync_state(s), b), (state_sh, batch_sh), step_out)
          if outer.overlaps else None)


@dataclasses.dataclass(frozen=True)
class ReplicaSetup:
  """Like `step.TrainSetup`, plus the outer optimizer, its jitted sync and eval's parameter view."""
  model_cfg: transformer.TransformerConfig
  optimizer: optax.GradientTransformation
  outer: outer_lib.OuterOptimizer
  replicas: int
  abstract: ReplicaTrainState
  state_sh: ReplicaTrainState
  batch_sh: NamedSharding
  param_sh: Any  # one replica's parameters, as eval reads them
  train_fn: Callable
  sync_fn: Callable
  # An outer optimizer that `overlaps` (CO2, Streaming DiLoCo with overlap_steps): the sync
  # fused into the next inner step, one program, so its collective (whose result that step
  # does not need) can overlap the step's compute.
  sync_train_fn: Callable | None
  eval_params: Callable  # state.params [R..] -> replica 0's parameters
  bytes_per_sync: int
  one: TrainState  # one replica's state, abstract with shardings

  def device_batch(self, batch):
    """The loader's batch as train_fn takes it."""
    return step_lib.global_batch(batch, self.batch_sh)

  def init_state(self, seed: int) -> ReplicaTrainState:
    return jax.jit(lambda: init_replica_state(self.model_cfg, self.optimizer, self.outer,
                                              self.replicas, seed),
                   out_shardings=self.state_sh)()

  def start_from(self, state: ReplicaTrainState, params) -> ReplicaTrainState:
    """Every replica at one model's `params`, fresh inner and outer states (init_from)."""
    start = lambda s, p: start_from_params(s.step, p, self.optimizer, self.outer, self.replicas)
    return jax.jit(start, out_shardings=self.state_sh, donate_argnums=0)(state, params)

  # The replica-stacked state is its own saved form (`checkpoint.layouts`).

  def saved_target(self) -> ReplicaTrainState:
    return state_lib.with_shardings(self.abstract, self.state_sh)

  def one_target(self) -> TrainState:
    """One replica's state, abstract with shardings (see `step.TrainSetup.one_target`)."""
    return self.one

  def assemble(self, step, params, opt_state) -> ReplicaTrainState:
    """Replicas at converted parameters and inner states, the outer state fresh at them."""
    return with_fresh_outer(self.outer, step, params, opt_state)

  def to_saved(self, state: ReplicaTrainState) -> ReplicaTrainState:
    return state

  def from_saved(self, state: ReplicaTrainState) -> ReplicaTrainState:
    return state


def make_replica_setup(config, model_cfg: transformer.TransformerConfig, mesh: Mesh,
                       outer: outer_lib.OuterOptimizer) -> ReplicaSetup:
  """The jitted inner step, sync and eval view of `config` with `outer` on `mesh`."""
  replicas = num_replicas(mesh, outer.name)
  optimizer = make_optimizer(config.optimizer, config.total_steps)
  abstract = jax.eval_shape(lambda: init_replica_state(model_cfg, optimizer, outer, replicas,
                                                       config.seed))
  state_sh = replica_state_shardings(abstract, model_cfg, optimizer, mesh)
  batch_sh = mesh_lib.batch_sharding(mesh)
  opts = step_lib.compiler_options(model_cfg, mesh)
  inner_step = sharded.under_mesh(  # Pallas kernels split over the mesh inside the vmap
      lambda s, b: replica_train_step(s, b, model_cfg=model_cfg, optimizer=optimizer,
                                      replicas=replicas,
                                      accum_steps=config.optimizer.grad_accum_steps), mesh)
  train_fn, sync_fn, sync_train_fn = jit_steps(inner_step, outer, mesh, state_sh, batch_sh, opts)
  one_params, one_opt = _one_replica((abstract.params, abstract.opt_state))
  one = TrainState(step=abstract.step, params=one_params, opt_state=one_opt)
  one_sh = state_lib.state_shardings(one, model_cfg, optimizer, mesh)
  eval_params = jax.jit(lambda p: jax.tree.map(lambda x: x[0], p),
                        in_shardings=(state_sh.params,), out_shardings=one_sh.params)
  return ReplicaSetup(model_cfg, optimizer, outer, replicas, abstract, state_sh, batch_sh,
                      one_sh.params, train_fn, sync_fn, sync_train_fn, eval_params,
                      outer.bytes_per_sync(one_params, replicas),
                      state_lib.with_shardings(one, one_sh))
