"""Outer optimizers over pipelined replicas: R replicas on `replica`, each a pipeline over `stage`.

The state is a `replicas.ReplicaTrainState` whose parameters, inner optimizer state and
outer state are each replica's stage view (`pipeline.to_stages`, a leading [R] dim on
`replica`), so neither a step nor a sync moves weights between stages. It is saved as an
unpipelined replica run saves it (canonical `[R, layers, ...]`), so a run resumes under
another schedule, stage count, replica count, or as one model (`checkpoint.layouts`).

A step runs `pipeline.replica_loss_and_grads` over both axes. With
`pipeline.routing="random"` the routes are `routing.draw_shifts(optimizer.outer_seed,
step, ...)`: new every step, the same on every device. Replica r's parameters get the
gradient of sum_r' loss_r' / tokens_r' (each replica's rows normalised by their own
token count), so with fixed routing each replica steps exactly as in the unpipelined
replica run, and with random routing the other replicas' rows that crossed its stages
count as they count on theirs. The outer optimizer's sync (`replicas.make_sync`) is
elementwise plus collectives over `replica`, so it runs on the stage view as it is.
Evaluation scores replica 0's parameters by the schedule's forwards, the batch split
over the other axes.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsys import mesh as mesh_lib
from jaxsys.kernels import sharded
from jaxsys.models import transformer
from jaxsys.optim import outer as outer_lib
from jaxsys.optim.inner import make_optimizer
from jaxsys.parallel import pipeline, routing
from jaxsys.train import pipelined
from jaxsys.train import replicas as replicas_lib
from jaxsys.train import state as state_lib
from jaxsys.train import step as step_lib
from jaxsys.train.replicas import ReplicaTrainState
from jaxsys.train.state import TrainState


def map_replica_state(layout_fn, layout: pipeline.Layout,
                      state: ReplicaTrainState) -> ReplicaTrainState:
  """`layout_fn` (`pipeline.to_stages` or `from_stages`) on every replica's parameters and
  on the inner and outer states' leaves of the same keys; counts and the step pass through."""
  view = jax.vmap(functools.partial(layout_fn, layout))
  return state.replace(params=view(state.params), opt_state=view(state.opt_state),
                       outer=view(state.outer))


def replica_pipeline_step(state: ReplicaTrainState, batch, *, model_cfg, optimizer,
                          schedule: pipeline.Schedule, layout: pipeline.Layout, mesh,
                          replicas: int, routing_seed: int | None, vocab_algorithm: int = 2):
  """One inner step of every replica's pipeline; `routing_seed` None routes each replica's
  rows through its own stages, else through replicas drawn from (seed, step)."""
  counts = jnp.sum(batch["loss_mask"].reshape(replicas, -1), axis=1)
  denom = jnp.maximum(counts, 1.0)
  shifts = None if routing_seed is None else routing.draw_shifts(
      routing_seed, state.step, replicas, schedule.microbatches, layout.chunks)
  losses, grads = pipeline.replica_loss_and_grads(
      model_cfg, schedule, layout, state.params, batch, mesh=mesh, shifts=shifts,
      weights=1.0 / denom, vocab_algorithm=vocab_algorithm)

  def update(params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)
  params, opt_state, norms = jax.vmap(update, spmd_axis_name=replicas_lib.AXIS)(
      state.params, state.opt_state, grads)
  tokens = jnp.sum(counts)
  metrics = {"loss": jnp.sum(losses) / jnp.maximum(tokens, 1.0),
             "grad_norm": jnp.sqrt(jnp.mean(jnp.square(norms))), "tokens": tokens}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def transfer_bytes(model_cfg, schedule: pipeline.Schedule, mesh: Mesh, batch_size: int,
                   seq_len: int, routed: bool) -> tuple[int, int]:
  """(bytes one device sends per tick, bytes it sends once a step) moving microbatches.

  Per tick the executor sends one activation and one gradient to the next and previous
  stage, and routed each goes through `routing.hops(R)` more collective-permutes over
  `replica`. Routed, every replica also gathers the others' batch rows (5 arrays of 4
  bytes a token; ring all-gather: R-1 times its own share).
  """
  shape = dict(mesh.shape)
  replicas = shape.get(replicas_lib.AXIS, 1)
  shards = math.prod(shape.get(a, 1) for a in ("data", "fsdp"))
  rows = batch_size // replicas // shards  # of one replica, on one device
  activation = (rows // schedule.microbatches * seq_len * model_cfg.d_model
                * jnp.dtype(model_cfg.dtype).itemsize)
  moves = 1 + (routing.hops(replicas) if routed else 0)
  gather = (replicas - 1) * rows * seq_len * 4 * 5 if routed else 0
  return 2 * moves * activation, gather


@dataclasses.dataclass(frozen=True)
class ReplicaPipelineSetup:
  """What the loop needs of a replica run (`replicas.ReplicaSetup`'s fields and methods), for
  pipelined replicas: the stage view in training, the canonical replica form when saved."""
  model_cfg: transformer.TransformerConfig
  optimizer: optax.GradientTransformation
  outer: outer_lib.OuterOptimizer
  replicas: int
  layout: pipeline.Layout
  schedule: pipeline.Schedule
  routing: str
  abstract: ReplicaTrainState  # the stage view
  state_sh: ReplicaTrainState
  canonical: ReplicaTrainState  # abstract, as saved
  canonical_sh: ReplicaTrainState
  batch_sh: NamedSharding
  param_sh: Any  # one model's canonical parameters (init_from reads into them)
  eval_param_sh: Any  # one replica's stage-view parameters, as eval reads them
  train_fn: Callable
  sync_fn: Callable
  sync_train_fn: Callable | None  # an outer optimizer that `overlaps`: sync + next step
  one: TrainState  # one replica's canonical state, abstract with shardings
  batch_size: int
  seq_len: int

  def device_batch(self, batch):
    return step_lib.global_batch(batch, self.batch_sh)

  @property
  def one_stage_params(self):
    """One replica's stage-view parameters, abstract: what a sync sends."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), self.abstract.params)

  @property
  def bytes_per_sync(self) -> int:
    return self.outer.bytes_per_sync(self.one_stage_params, self.replicas)

  def bytes_per_step(self) -> int:
    """Bytes one device sends per inner step: its stage's gradients all-reduced over the
    batch axes within its replica, and the microbatches moved (`transfer_bytes`)."""
    mesh = self.batch_sh.mesh
    stage_share = lambda sh: mesh.shape[pipeline.AXIS] if pipeline.AXIS in str(sh.spec) else 1
    grads = sum(math.prod(x.shape[1:]) * x.dtype.itemsize // stage_share(sh)
                for x, sh in zip(jax.tree.leaves(self.abstract.params),
                                 jax.tree.leaves(self.state_sh.params)))
    shards = math.prod(mesh.shape.get(a, 1) for a in ("data", "fsdp"))
    per_tick, once = transfer_bytes(self.model_cfg, self.schedule, mesh, self.batch_size,
                                    self.seq_len, self.routing == "random")
    return outer_lib.ring_allreduce_bytes(grads, shards) + self.schedule.ticks * per_tick + once

  def comm_bytes(self, steps: int) -> int:
    """Bytes one device has sent after `steps` inner steps: the steps' and the syncs'."""
    return steps * self.bytes_per_step() + self.outer.bytes_after(
        self.one_stage_params, self.replicas, steps)

  @functools.cached_property
  def eval_params(self) -> Callable:
    """state.params [R..] -> replica 0's stage-view parameters."""
    return jax.jit(lambda p: jax.tree.map(lambda x: x[0], p),
                   in_shardings=(self.state_sh.params,), out_shardings=self.eval_param_sh)

  def jit_eval_step(self, token_bytes) -> Callable:
    """Eval sums of one replica's stage-view parameters by the schedule's forwards."""
    table = jnp.asarray(token_bytes, jnp.float32)
    mesh = self.batch_sh.mesh

    def eval_step(params, batch):
      loss_sum = pipeline.pipeline_loss(self.model_cfg, self.schedule, self.layout, params, batch,
                                        mesh=mesh)
      return step_lib.eval_sums_of_loss(loss_sum, batch, table)
    return jax.jit(sharded.under_mesh(eval_step, mesh),
                   in_shardings=(self.eval_param_sh, self.batch_sh),
                   out_shardings=NamedSharding(mesh, PartitionSpec()),
                   compiler_options=step_lib.compiler_options(self.model_cfg, mesh))

  def init_state(self, seed: int) -> ReplicaTrainState:
    """Every replica at the canonical parameters of `seed`, in the stage view."""
    def init():
      state = replicas_lib.init_replica_state(self.model_cfg, self.optimizer, self.outer,
                                              self.replicas, seed)
      return map_replica_state(pipeline.to_stages, self.layout, state)
    return jax.jit(init, out_shardings=self.state_sh)()

  def start_from(self, state: ReplicaTrainState, params) -> ReplicaTrainState:
    """Every replica at one model's canonical `params`, fresh inner and outer states (init_from)."""
    def start(s, p):
      return replicas_lib.start_from_params(s.step, pipeline.to_stages(self.layout, p),
                                            self.optimizer, self.outer, self.replicas)
    return jax.jit(start, out_shardings=self.state_sh, donate_argnums=0)(state, params)

  def saved_target(self) -> ReplicaTrainState:
    return state_lib.with_shardings(self.canonical, self.canonical_sh)

  def one_target(self) -> TrainState:
    return self.one

  def assemble(self, step, params, opt_state) -> ReplicaTrainState:
    """The saved (canonical) form from converted parameters and inner states, outer fresh."""
    return replicas_lib.with_fresh_outer(self.outer, step, params, opt_state)

  @functools.cached_property
  def _to_canonical(self):
    return jax.jit(functools.partial(map_replica_state, pipeline.from_stages, self.layout),
                   out_shardings=self.canonical_sh)

  @functools.cached_property
  def _from_canonical(self):
    return jax.jit(functools.partial(map_replica_state, pipeline.to_stages, self.layout),
                   out_shardings=self.state_sh)

  def to_saved(self, state: ReplicaTrainState) -> ReplicaTrainState:
    return self._to_canonical(state)

  def from_saved(self, state: ReplicaTrainState) -> ReplicaTrainState:
    return self._from_canonical(state)


def make_replica_pipeline_setup(config, model_cfg: transformer.TransformerConfig, mesh: Mesh,
                                outer: outer_lib.OuterOptimizer) -> ReplicaPipelineSetup:
  """The jitted inner step, sync and eval of `config`: `outer` over pipelined replicas."""
  replicas = replicas_lib.num_replicas(mesh, outer.name)
  layout = pipelined.make_layout(config, model_cfg, mesh)
  schedule = pipeline.make_schedule(config.pipeline.schedule, stages=layout.stages,
                                    microbatches=config.pipeline.microbatches,
                                    virtual_stages=layout.virtual)
  optimizer = make_optimizer(config.optimizer, config.total_steps)
  canonical = jax.eval_shape(lambda: replicas_lib.init_replica_state(
      model_cfg, optimizer, outer, replicas, config.seed))
  canonical_sh = replicas_lib.replica_state_shardings(canonical, model_cfg, optimizer, mesh,
                                                      pipelined.CANONICAL_RULES)
  abstract = jax.eval_shape(functools.partial(map_replica_state, pipeline.to_stages, layout),
                            canonical)
  axes = layout.logical_axes(transformer.param_axes(model_cfg))
  state_sh = replicas_lib.replica_state_shardings(abstract, model_cfg, optimizer, mesh,
                                                  layout.rules(mesh_lib.DEFAULT_RULES), axes)
  batch_sh = mesh_lib.batch_sharding(mesh)
  opts = step_lib.compiler_options(model_cfg, mesh)
  routing_name = config.pipeline.routing
  inner_step = sharded.under_mesh(functools.partial(
      replica_pipeline_step, model_cfg=model_cfg, optimizer=optimizer, schedule=schedule,
      layout=layout, mesh=mesh, replicas=replicas,
      routing_seed=config.optimizer.outer_seed if routing_name == "random" else None,
      vocab_algorithm=config.pipeline.vocab_algorithm), mesh)
  train_fn, sync_fn, sync_train_fn = replicas_lib.jit_steps(inner_step, outer, mesh, state_sh,
                                                             batch_sh, opts)
  one_of = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)
  one = TrainState(step=canonical.step, params=one_of(canonical.params),
                   opt_state=one_of(canonical.opt_state))
  one_sh = state_lib.state_shardings(one, model_cfg, optimizer, mesh, pipelined.CANONICAL_RULES)
  one_stage = TrainState(step=abstract.step, params=one_of(abstract.params),
                         opt_state=one_of(abstract.opt_state))
  eval_param_sh = pipelined.stage_state_shardings(one_stage, model_cfg, optimizer, layout,
                                                  mesh).params
  return ReplicaPipelineSetup(
      model_cfg, optimizer, outer, replicas, layout, schedule, routing_name, abstract, state_sh,
      canonical, canonical_sh, batch_sh, one_sh.params, eval_param_sh, train_fn, sync_fn,
      sync_train_fn, state_lib.with_shardings(one, one_sh), config.data.batch_size,
      config.data.seq_len)
