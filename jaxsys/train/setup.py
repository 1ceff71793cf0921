"""One setup for every composition of strategies: a view, a gradient function, a step, wrappers.

`make_setup(run, mesh)` builds, from the checked config (`jaxsys.config.RunConfig`), in one
place and for any mesh:

  - the `layouts.View` the run trains (replicas stacked `[R, ...]` with an outer optimizer;
    within each replica the pipeline's stage view with a `stage` axis), and the shardings of
    the state in that view, in its saved form and as one canonical model;
  - the gradient function (`grads`): autodiff, the pipeline executor, or the routed pipeline
    of the replicas; ring attention over `context` and gradient accumulation for any of them;
  - the step: the inner optimizer on one model, or on every replica (`grads.replica_step`),
    wrapped by the outer optimizer's sync (`replicas.jit_steps`) when there is one;
  - evaluation of the model the run reports (replica 0's), by the same view's forward;
  - the bytes one device sends (`Comm`): gradients all-reduced within a replica, a
    pipeline's transfers, the outer optimizer's syncs.

HDP (whole documents, `run.parallel.hdp`) plans each batch itself: its executor is the
step and its planner turns the loader's documents into the step's batch.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsys import comm_bytes
from jaxsys import mesh as mesh_lib
from jaxsys.checkpoint import layouts
from jaxsys.config import RunConfig
from jaxsys.kernels import sharded
from jaxsys.models import transformer
from jaxsys.optim import outer as outer_lib
from jaxsys.optim.inner import make_optimizer
from jaxsys.parallel import pipeline, routing, vocab
from jaxsys.train import comm_device, grads, hdp_step
from jaxsys.train import replicas as replicas_lib
from jaxsys.train import state as state_lib
from jaxsys.train import step as step_lib
from jaxsys.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Comm:
  """Bytes one device sends: per step (its gradients' all-reduce within its replica, a
  pipeline's activations and gradients, a routed pipeline's hops and row gather) and the
  outer optimizer's syncs (of `synced`, what one device of a replica holds of the
  parameters the sync sends)."""
  grads_per_step: int = 0
  pipeline_per_step: int = 0
  outer: outer_lib.OuterOptimizer | None = None
  synced: Any = None
  replicas: int = 0

  def outer_after(self, steps: int) -> int:
    return self.outer.bytes_after(self.synced, self.replicas, steps) if self.outer else 0

  def after(self, steps: int, reductions_per_step: float = 1.0) -> float:
    """Bytes sent after `steps` steps, every collective counted; `reductions_per_step`:
    gradient all-reduces a step, on average (HDP's `grad_reductions` metric: one over the
    pool plus each ring's share of one; with fsdp an upper bound, each a reduce-scatter
    plus one gather of the parameters)."""
    inner = self.grads_per_step * reductions_per_step + self.pipeline_per_step
    return steps * inner + self.outer_after(steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
  """What a run steps, evaluates and saves, whatever it composes."""
  model_cfg: transformer.TransformerConfig
  optimizer: optax.GradientTransformation
  outer: outer_lib.OuterOptimizer | None
  view: layouts.View
  mesh: Mesh
  abstract: TrainState  # the trained view, abstract
  state_sh: TrainState  # its shardings
  saved: TrainState  # the saved form, abstract with shardings: what a checkpoint restores into
  # One canonical model's state, abstract with shardings: what another run's checkpoint
  # converts through.
  one: TrainState
  batch_sh: NamedSharding
  train_fn: Callable  # (state, batch) -> (state, metrics)
  sync_fn: Callable | None  # state -> state: the outer sync
  sync_train_fn: Callable | None  # the sync fused into the next step (an outer that overlaps)
  eval_fn: Callable  # (token_bytes) -> jitted (eval params, batch) -> eval sums
  eval_params: Callable  # state.params -> the parameters eval scores (replica 0's)
  batch_fn: Callable  # the loader's batch -> train_fn's
  comm: Comm
  run_view: dict  # the run's view beyond its saved form (recorded in each checkpoint)
  schedule: pipeline.Schedule | None = None
  routing: str = "fixed"
  # The sync with its all-reduce on communication twins (outer.comm_device)
  off_device_sync: comm_device.OffDeviceSync | None = None

  @property
  def param_sh(self):
    """Shardings of one canonical model's parameters (init_from reads into them)."""
    return _shardings(self.one.params)

  @functools.cached_property
  def _to_view(self):
    return jax.jit(self.view.to_view, out_shardings=self.state_sh)

  @functools.cached_property
  def _to_saved(self):
    return jax.jit(self.view.to_saved, out_shardings=_shardings(self.saved))

  def to_saved(self, state: TrainState) -> TrainState:
    return self._to_saved(state)

  def from_saved(self, state: TrainState) -> TrainState:
    return self._to_view(state)

  def assemble(self, step, params, opt_state) -> TrainState:
    """The saved form from converted canonical parts (inside a jit); an outer state fresh."""
    if self.outer is None:
      return TrainState(step=step, params=params, opt_state=opt_state)
    return replicas_lib.with_fresh_outer(self.outer, step, params, opt_state)

  def _from_one(self, step, params) -> TrainState:
    """The trained view of one canonical model's `params` with fresh optimizer states."""
    return self.view.to_view(_saved_of_one(step, params, self.optimizer, self.outer,
                                           self.view.replicas))

  def init_state(self, seed: int) -> TrainState:
    """The canonical fresh state of `seed` in the run's view: the same numbers on any layout."""
    def init():
      state = state_lib.init_train_state(self.model_cfg, self.optimizer, seed)
      return self._from_one(state.step, state.params)
    return jax.jit(init, out_shardings=self.state_sh)()

  def start_from(self, state: TrainState, params) -> TrainState:
    """`state` restarted at one canonical model's `params`, fresh optimizer states (init_from)."""
    return jax.jit(lambda s, p: self._from_one(s.step, p), out_shardings=self.state_sh,
                   donate_argnums=0)(state, params)


def _shardings(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def make_layout(run: RunConfig, mesh) -> pipeline.Layout | None:
  """The pipeline's stage layout of `run` on `mesh`; None without a pipeline."""
  if run.pipeline.schedule == "none":
    return None
  stages = mesh_lib.degrees(mesh).stage
  virtual = run.pipeline.virtual_stages
  pipeline.check_layout(stages, virtual, run.model.n_layers)
  return pipeline.Layout(stages=stages, virtual=virtual, vocab_size=run.model.vocab_size,
                         vocab_parallel=run.pipeline.vocab_parallel,
                         tensor=mesh_lib.degrees(mesh).tensor)


def _gradient_fn(run: RunConfig, mesh, view: layouts.View, schedule, context_split, param_sh):
  """The run's gradient function: one model's, or the replicas' (`grads`)."""
  model_cfg, accum = run.model, run.optimizer.grad_accum_steps
  vocab_algorithm, gather_once = run.pipeline.vocab_algorithm, run.pipeline.gather_once
  if view.stages is None:
    once = grads.GatherOnce.of(model_cfg, param_sh) if run.optimizer.accum_gather_once else None
    fn = grads.accumulate(grads.autodiff(model_cfg, context_split), accum, once)
  elif view.replicas and run.pipeline.routing == "random":  # microbatches cross replicas
    return grads.routed_pipeline(model_cfg, schedule, view.stages, mesh, view.replicas,
                                 routing_seed=run.outer.seed, vocab_algorithm=vocab_algorithm,
                                 accum_steps=accum, context_split=context_split,
                                 gather_once=gather_once)
  else:
    fn = grads.accumulate(grads.pipelined(
        model_cfg, schedule, view.stages, mesh, vocab_algorithm=vocab_algorithm,
        context_split=context_split, gather_once=gather_once), accum)
  return grads.over_replicas(fn, view.replicas) if view.replicas else fn


def _eval_fn(model_cfg, mesh, view: layouts.View, schedule, param_sh, batch_sh,
             context_split, gather_once: bool) -> Callable:
  """token_bytes -> the jitted eval step of one replica's parameters in the view."""
  def make(token_bytes):
    table = jnp.asarray(token_bytes, jnp.float32)

    def eval_step(params, batch):
      if view.stages is None:
        return step_lib.eval_step(params, batch, model_cfg=model_cfg, token_bytes=table,
                                  context_split=context_split)
      laid, attention_fn = grads.with_attention(batch, context_split)
      loss_sum = pipeline.pipeline_loss(model_cfg, schedule, view.stages, params, laid,
                                        mesh=mesh, attention_fn=attention_fn,
                                        gather_once=gather_once)
      return step_lib.eval_sums_of_loss(loss_sum, batch, table)
    return jax.jit(sharded.under_mesh(eval_step, mesh), in_shardings=(param_sh, batch_sh),
                   out_shardings=NamedSharding(mesh, PartitionSpec()),
                   compiler_options=step_lib.compiler_options(model_cfg, mesh))
  return make


def _staged(sharding) -> tuple[int, ...]:
  """The dims a sharding splits over `stage` (a pipeline's stages)."""
  # pylint: disable-next=protected-access
  return tuple(i for i, e in enumerate(sharding.spec) if pipeline.AXIS in sharded._names(e))


def _stage_share(params, param_sh, mesh):
  """One device's share of `params` along `stage`: what it holds of a pipeline's leaves."""
  stages = mesh_lib.degrees(mesh).stage

  def share(x, sh):
    shape = [n // stages if i in _staged(sh) else n for i, n in enumerate(x.shape)]
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
  return jax.tree.map(share, params, param_sh)


def _grads_bytes(params, param_sh, mesh) -> int:
  """Bytes one device sends all-reducing its gradients over the batch axes within a replica
  (ring; fsdp's reduce-scatter plus all-gather moves the same): its share of a stage; in a
  pipeline, also summing over `stage` the gradients of the leaves every stage holds whole
  (the final norm; the embedding and head without vocabulary parallelism)."""
  shards = mesh_lib.degrees(mesh).batch_shards
  stages = mesh_lib.degrees(mesh).stage
  whole = [x for x, sh in zip(jax.tree.leaves(params), jax.tree.leaves(param_sh))
           if not _staged(sh)]
  return ((comm_bytes.ring_allreduce_bytes(comm_bytes.tree_bytes(
      _stage_share(params, param_sh, mesh)), shards) if shards > 1 else 0)
          + (comm_bytes.ring_allreduce_bytes(comm_bytes.tree_bytes(whole), stages)
             if stages > 1 and whole else 0))


def transfer_bytes(model_cfg, schedule: pipeline.Schedule, mesh: Mesh, batch_size: int,
                   seq_len: int, routed: bool, vocab_parallel: bool = False
                   ) -> tuple[int, int]:
  """(bytes one device sends per tick, bytes it sends once a step) moving microbatches.

  Per tick the executor sends one activation (its share of the sequence) and one gradient to
  the next and previous stage, idle or not; routed, each goes through `routing.hops(R)` more
  collective-permutes over `replica`, and every replica gathers the others' batch rows
  once (5 arrays of 4 bytes a token; ring all-gather: R-1 times its own share). With
  vocabulary parallelism every microbatch's embedding and output layer also communicate
  over `stage` and `tensor` (`vocab.bytes_per_microbatch`).
  """
  degrees = mesh_lib.degrees(mesh)
  replicas = degrees.replica
  rows = batch_size // replicas // degrees.batch_shards  # of one replica, on one device
  tokens = seq_len // degrees.context
  activation = (rows // schedule.microbatches * tokens * model_cfg.d_model
                * jnp.dtype(model_cfg.dtype).itemsize)
  moves = 1 + (routing.hops(replicas) if routed else 0)
  gather = (replicas - 1) * rows * tokens * 4 * 5 if routed else 0
  head = (schedule.microbatches * vocab.bytes_per_microbatch(
      rows // schedule.microbatches * tokens, model_cfg.d_model, degrees.stage,
      jnp.dtype(model_cfg.dtype).itemsize, tensor=degrees.tensor)
          if vocab_parallel else 0)
  return 2 * moves * activation, gather + head


def pipeline_bytes(model_cfg, schedule: pipeline.Schedule, mesh: Mesh, batch_size: int,
                   seq_len: int, accum_steps: int = 1, routed: bool = False,
                   vocab_parallel: bool = False) -> int:
  """Bytes one device sends per step moving microbatches: `transfer_bytes` every tick the
  executor runs (`schedule.executed`, fused or the table's) of each accumulation step."""
  tick, once = transfer_bytes(model_cfg, schedule, mesh, batch_size // accum_steps, seq_len,
                              routed, vocab_parallel)
  return accum_steps * (schedule.executed.ticks * tick + once)


def make_setup(run: RunConfig, mesh: Mesh, loader=None) -> Setup:
  """The run `run` on `mesh`: its view, shardings, jitted steps, eval and bytes.

  `loader`: the whole-document loader an HDP run gives its unused documents back to.
  """
  model_cfg = run.model
  outer = replicas_lib.make_outer_optimizer(run.outer)
  replicas = replicas_lib.num_replicas(mesh, outer.name) if outer else 0
  layout = make_layout(run, mesh)
  view = layouts.View(layouts.Form(replicas, outer.name if outer else None), layout)
  schedule = None if layout is None else pipeline.make_schedule(
      run.pipeline.schedule, stages=layout.stages, microbatches=run.pipeline.microbatches,
      virtual_stages=layout.virtual, vocab_overlap=run.pipeline.vocab_overlap)
  optimizer = make_optimizer(run.optimizer, run.total_steps)
  param_axes = transformer.param_axes(model_cfg)

  one = state_lib.abstract_train_state(model_cfg, optimizer, run.seed)
  saved = jax.eval_shape(lambda s: _saved_of_one(s.step, s.params, optimizer, outer, replicas),
                         one)
  abstract = jax.eval_shape(view.to_view, saved)
  rules = mesh_lib.DEFAULT_RULES
  shard = functools.partial(state_lib.state_shardings, model_cfg=model_cfg, optimizer=optimizer,
                            mesh=mesh)
  state_sh = shard(abstract, rules=view.rules(rules), axes=view.param_axes(param_axes),
                   replicas=bool(replicas))
  saved_sh = shard(saved, rules=view.saved_rules(rules), replicas=bool(replicas))
  one_sh = shard(one, rules=view.saved_rules(rules))
  batch_sh = mesh_lib.batch_sharding(mesh)
  context_split = step_lib.context_split_of(mesh, run.parallel.context_layout,
                                            run.parallel.context_algorithm)
  opts = step_lib.compiler_options(model_cfg, mesh)

  # One replica's parameters in the view: what eval scores and an elementwise sync sends.
  view_params = state_lib.one_replica(abstract.params) if replicas else abstract.params
  view_param_sh = (shard(jax.eval_shape(lambda s: dataclasses.replace(
      view, form=layouts.Form()).to_view(s), one), rules=view.rules(rules),
      axes=view.param_axes(param_axes)).params if replicas else state_sh.params)
  grad_fn = _gradient_fn(run, mesh, view, schedule, context_split, state_sh.params)
  routed = bool(replicas) and layout is not None and run.pipeline.routing == "random"
  comm = Comm(
      grads_per_step=_grads_bytes(view_params, view_param_sh, mesh),
      pipeline_per_step=0 if schedule is None else pipeline_bytes(
          model_cfg, schedule, mesh, run.data.batch_size, run.data.seq_len,
          run.optimizer.grad_accum_steps, routed, layout.vocab_parallel),
      outer=outer, replicas=replicas,
      # An elementwise sync sends each device's own share (its stage's layers in a pipeline).
      synced=None if outer is None else (_stage_share(view_params, view_param_sh, mesh)
                                         if outer.elementwise else one.params))

  replicated = NamedSharding(mesh, PartitionSpec())
  batch_fn = lambda batch: step_lib.global_batch(batch, batch_sh)
  sync_fn = sync_train_fn = None
  if run.parallel.hdp:
    train_fn = hdp_step.make_executor(run, optimizer, mesh, state_sh, schedule, layout)
    batch_fn = hdp_step.BatchPlanner(train_fn, loader, hdp_step.micro_steps_per_step(
        run, hdp_step.slots(mesh)))
    if outer is not None:  # its micro-steps are many programs: the sync runs on its own
      sync_fn = replicas_lib.jit_sync(outer, mesh, view, state_sh, opts)
  elif outer is None:
    step = sharded.under_mesh(grads.model_step(grad_fn, optimizer), mesh)
    train_fn = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                       donate_argnums=0, compiler_options=opts)
  else:
    step = sharded.under_mesh(grads.replica_step(grad_fn, optimizer), mesh)
    train_fn, sync_fn, sync_train_fn = replicas_lib.jit_steps(step, outer, mesh, view, state_sh,
                                                              batch_sh, opts)
  off_device_sync = None
  if run.outer.comm_device:
    off_device_sync = comm_device.OffDeviceSync(
        outer, mesh, replicas_lib.jit_sync(outer, mesh, view, state_sh, opts, average=False))
  eval_params = (jax.jit(lambda p: jax.tree.map(lambda x: x[0], p),
                         in_shardings=(state_sh.params,), out_shardings=view_param_sh)
                 if replicas else (lambda p: p))
  eval_fn = _eval_fn(model_cfg, mesh, view, schedule, view_param_sh, batch_sh, context_split,
                     run.pipeline.gather_once)
  run_view = {"mesh": run.mesh, "devices": mesh_lib.describe(mesh)}
  if layout is not None:
    run_view["pipeline"] = {"schedule": run.pipeline.schedule, "stages": layout.stages,
                            "virtual": layout.virtual, "padded_vocab": layout.padded_vocab,
                            "saved": "canonical: stage view and vocabulary padding undone"}
  return Setup(model_cfg=model_cfg, optimizer=optimizer, outer=outer, view=view, mesh=mesh,
               abstract=abstract, state_sh=state_sh,
               saved=state_lib.with_shardings(saved, saved_sh),
               one=state_lib.with_shardings(one, one_sh), batch_sh=batch_sh, train_fn=train_fn,
               sync_fn=sync_fn, sync_train_fn=sync_train_fn, eval_fn=eval_fn,
               eval_params=eval_params, batch_fn=batch_fn, comm=comm, run_view=run_view,
               schedule=schedule, routing=run.pipeline.routing, off_device_sync=off_device_sync)


def _saved_of_one(step, params, optimizer, outer, replicas: int) -> TrainState:
  """The saved form of a run starting at one model's `params`, fresh optimizer states."""
  if outer is None:
    return TrainState(step=step, params=params, opt_state=optimizer.init(params))
  return replicas_lib.start_from_params(step, params, optimizer, outer, replicas)
