"""Gradient functions, and the steps built from them.

A gradient function maps `(params, batch, step)` to `(summed token loss, token count,
gradients of the summed loss)`; `step` (the state's) only matters to a routed pipeline,
whose routes change every step. Three implement it:

  - `autodiff`: `jax.value_and_grad` of the model, any mesh of data/fsdp/tensor/context;
  - `pipelined`: the pipeline executor over `stage` (any schedule, with or without
    vocabulary parallelism);
  - `routed_pipeline`: R pipelines over `replica` x `stage` whose microbatches cross
    replicas at chunk boundaries (NoLoCo's random routing). With fixed routing each
    replica runs its own pipeline: `over_replicas` of `pipelined`, like any other.

Attention is injected, not owned: with a `context_split` every one of them lays the batch
out over the `context` axis and runs the model with its context-parallel attention (the
ring, all-gathered K/V or Ulysses), so each runs with context parallelism without code of
its own. `accumulate` adds exact gradient
accumulation to any of them.

A replica gradient function maps `[R, ...]` parameters to per-replica `(loss sums [R],
token counts [R], gradients [R, ...])` whose gradients are already each replica's mean
(routed rows count on every replica they visit, so no later division could give them).
`model_step` and `replica_step` turn the two kinds into steps with the inner optimizer.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsys import mesh as mesh_lib
from jaxsys.kernels import sharded
from jaxsys.models import transformer
from jaxsys.parallel import pipeline, routing
from jaxsys.train import step as step_lib
from jaxsys.train.state import REPLICA_AXIS, TrainState

Batch = step_lib.Batch
GradFn = Callable  # (params, batch, step) -> (loss sum, token count, grads of the sum)
ReplicaGradFn = Callable  # (params [R..], batch, step) -> (loss [R], count [R], mean grads [R..])


def with_attention(batch: Batch, context_split: step_lib.ContextSplit | None):
  """The batch and the attention the model runs it with: laid out over `context` with its
  context-parallel attention when `context_split` is set, else as it is with the configured
  kernel (None)."""
  if context_split is None:
    return batch, None
  return step_lib.context_parallel(batch, context_split)


def autodiff(model_cfg: transformer.TransformerConfig,
             context_split: step_lib.ContextSplit | None = None) -> GradFn:
  """The model's gradients by `jax.value_and_grad`."""
  def loss_sum(params, batch):
    losses = step_lib.token_losses(model_cfg, params, batch, context_split)
    return jnp.sum(losses), jnp.sum(batch["loss_mask"])

  def grad_fn(params, batch, step=None):
    (total, count), grads = jax.value_and_grad(loss_sum, has_aux=True)(params, batch)
    return total, count, grads
  return grad_fn


def pipelined(model_cfg: transformer.TransformerConfig, schedule: pipeline.Schedule,
              layout: pipeline.Layout, mesh, *, vocab_algorithm: int = 2,
              context_split: step_lib.ContextSplit | None = None,
              gather_once: bool = False) -> GradFn:
  """Gradients of the stage-view parameters by the pipeline executor running `schedule`
  (`gather_once`: `pipeline.pipeline_loss_and_grads`').

  Vmapped over `replica` (`over_replicas`), it runs every replica's pipeline in one
  program, the executor's `replica` x `stage` (jax 0.10 cannot vmap the executor's
  `shard_map` itself: the replica axis is left automatic, and the kernels' own shard_maps
  inside divide the vmapped size a second time).
  """
  options = dict(mesh=mesh, vocab_algorithm=vocab_algorithm, gather_once=gather_once)

  @jax.custom_batching.custom_vmap
  def loss_and_grads(params, batch):
    batch, attention_fn = with_attention(batch, context_split)
    return pipeline.pipeline_loss_and_grads(model_cfg, schedule, layout, params, batch,
                                            attention_fn=attention_fn, **options)

  @loss_and_grads.def_vmap
  def replicas_loss_and_grads(replicas, in_batched, params, batch):
    params, batch = (jax.tree.map(
        lambda x, batched: x if batched else jnp.broadcast_to(x, (replicas, *x.shape)),
        tree, batched) for tree, batched in zip((params, batch), in_batched))
    rows = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)  # replica r's block r
    rows, attention_fn = with_attention(rows, context_split)
    out = pipeline.replica_loss_and_grads(model_cfg, schedule, layout, params, rows,
                                          attention_fn=attention_fn, **options)
    return out, jax.tree.map(lambda _: True, out)

  def grad_fn(params, batch, step=None):
    total, grads = loss_and_grads(params, batch)
    return total, jnp.sum(batch["loss_mask"]), grads
  return grad_fn


@dataclasses.dataclass(frozen=True)
class GatherOnce:
  """Accumulation's weights gathered once a step instead of in every microbatch: the
  parameters' compute view (`transformer.compute_view`) laid out as `gathered` (their
  shardings without `fsdp`) before the microbatches, each microbatch's gradients summed
  into `sharded` (the parameters' own shardings) in the parameters' dtypes."""
  model_cfg: transformer.TransformerConfig
  gathered: Any
  sharded: Any

  @classmethod
  def of(cls, model_cfg: transformer.TransformerConfig, param_sh) -> "GatherOnce":
    """For parameters laid out as `param_sh` (NamedShardings)."""
    def whole(sharding):
      def drop(entry):
        names = sharded._names(entry)  # pylint: disable=protected-access
        names = tuple(n for n in names if n != mesh_lib.FSDP)
        return None if not names else names[0] if len(names) == 1 else names
      return jax.sharding.NamedSharding(sharding.mesh,
                                        jax.sharding.PartitionSpec(*map(drop, sharding.spec)))
    return cls(model_cfg, jax.tree.map(whole, param_sh), param_sh)

  def weights(self, params):
    return jax.tree.map(jax.lax.with_sharding_constraint,
                        transformer.compute_view(self.model_cfg, params), self.gathered)

  def add(self, total, grads):
    return jax.tree.map(lambda t, g, s: jax.lax.with_sharding_constraint(t + g.astype(t.dtype), s),
                        total, grads, self.sharded)


def accumulate(grad_fn: GradFn, steps: int, gather_once: GatherOnce | None = None) -> GradFn:
  """`grad_fn` over `steps` microbatches of the batch (rows i, i+steps, ...), summed: exactly
  the whole batch's sums, with the activations of one microbatch live at a time (and with
  `gather_once`, the weights gathered once for all of them)."""
  if steps == 1:
    return grad_fn

  def accumulated(params, batch, step=None):
    weights = params if gather_once is None else gather_once.weights(params)
    add = (lambda t, g: jax.tree.map(jnp.add, t, g)) if gather_once is None else gather_once.add

    def body(carry, mb):
      total, count, grads = grad_fn(weights, mb, step)
      return (carry[0] + total, carry[1] + count, add(carry[2], grads)), None
    zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    sums, _ = jax.lax.scan(body, zeros, pipeline.split_microbatches(batch, steps))
    return sums
  return accumulated


def _mean_grads(total, count, grads):
  denom = jnp.maximum(count, 1.0)
  return total, count, jax.tree.map(lambda g: g / denom, grads)


def over_replicas(grad_fn: GradFn, replicas: int) -> ReplicaGradFn:
  """R independent copies of `grad_fn`, vmapped over `replica`: replica r takes rows
  [r*B/R, (r+1)*B/R) of the global batch (the loader gives each process a contiguous block,
  so those rows are the same on any number of processes)."""
  def replica_grad_fn(params, batch, step=None):
    by_replica = jax.tree.map(
        lambda x: x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:]), batch)
    per_replica = lambda p, b: _mean_grads(*grad_fn(p, b, step))
    return jax.vmap(per_replica, spmd_axis_name=REPLICA_AXIS)(params, by_replica)
  return replica_grad_fn


def routed_pipeline(model_cfg: transformer.TransformerConfig, schedule: pipeline.Schedule,
                    layout: pipeline.Layout, mesh, replicas: int, *, routing_seed: int,
                    vocab_algorithm: int = 2, accum_steps: int = 1,
                    context_split: step_lib.ContextSplit | None = None,
                    gather_once: bool = False) -> ReplicaGradFn:
  """R pipelines over `replica` x `stage`, each microbatch routed through replicas drawn
  from (`routing_seed`, step, accumulation step).

  Replica r's parameters get the gradient of sum_r' loss_r' / tokens_r' (each replica's
  rows normalised by their own token count over the whole batch): with every route fixed
  to its own replica, exactly the step of `over_replicas`.
  """
  def replica_grad_fn(params, batch, step):
    counts = jnp.sum(batch["loss_mask"].reshape(replicas, -1), axis=1)
    weights = 1.0 / jnp.maximum(counts, 1.0)

    def one(a, mb):
      shifts = routing.draw_shifts(
          routing_seed, step * accum_steps + a, replicas, schedule.microbatches, layout.chunks)
      mb, attention_fn = with_attention(mb, context_split)
      return pipeline.replica_loss_and_grads(
          model_cfg, schedule, layout, params, mb, mesh=mesh, shifts=shifts, weights=weights,
          vocab_algorithm=vocab_algorithm, attention_fn=attention_fn, gather_once=gather_once)

    if accum_steps == 1:
      losses, grads = one(0, batch)
    else:
      def body(carry, a_mb):
        return jax.tree.map(jnp.add, carry, one(*a_mb)), None
      zeros = (jnp.zeros((replicas,)), jax.tree.map(jnp.zeros_like, params))
      mbs = _microbatches_keeping_replicas(batch, replicas, accum_steps)
      (losses, grads), _ = jax.lax.scan(body, zeros, (jnp.arange(accum_steps), mbs))
    return losses, counts, grads
  return replica_grad_fn


def _microbatches_keeping_replicas(batch: Batch, replicas: int, n: int) -> Batch:
  """[B, ...] -> [n, B/n, ...] where microbatch i holds rows i, i+n, ... of every replica's
  block, so replica r's rows stay its own in every microbatch."""
  def split(x):
    x = x.reshape(replicas, x.shape[0] // (replicas * n), n, *x.shape[1:])
    return x.swapaxes(0, 2).swapaxes(1, 2).reshape(n, -1, *x.shape[3:])
  return jax.tree.map(split, batch)


def model_step(grad_fn: GradFn, optimizer: optax.GradientTransformation) -> Callable:
  """(state, batch) -> (state, metrics): one optimizer step of one model on `batch`.

  Gradients are of the summed token loss, divided once by the whole batch's token count,
  so however `grad_fn` splits the work the step equals a single-device step.
  """
  def train_step(state: TrainState, batch: Batch):
    total, count, grads = grad_fn(state.params, batch, state.step)
    return step_lib.apply_gradients(state, optimizer, total, count, grads)
  return train_step


def replica_step(grad_fn: ReplicaGradFn, optimizer: optax.GradientTransformation) -> Callable:
  """(state, batch) -> (state, metrics [R]): one inner step of every replica, each with its
  own inner optimizer state (never averaged) and its own metrics, which `replica_totals`
  combines on the host: between syncs a replica never waits on another, not even to log."""
  def train_step(state: TrainState, batch: Batch):
    losses, counts, grads = grad_fn(state.params, batch, state.step)
    update = lambda p, o, g: step_lib.update(optimizer, p, o, g)
    params, opt_state, norms = jax.vmap(update, spmd_axis_name=REPLICA_AXIS)(
        state.params, state.opt_state, grads)
    metrics = {"loss": losses / jnp.maximum(counts, 1.0), "grad_norm": norms, "tokens": counts}
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics
  return train_step


def replica_totals(metrics: dict) -> dict:
  """The run's metrics from `replica_step`'s per-replica ones (fetched to the host): the
  token-weighted loss, the root mean square of the replicas' gradient norms, all tokens.
  Metrics already combined (one number each) pass through."""
  if np.ndim(metrics["loss"]) == 0:
    return metrics
  tokens = np.asarray(metrics["tokens"], np.float64)
  loss = np.sum(np.asarray(metrics["loss"], np.float64) * tokens) / max(tokens.sum(), 1.0)
  norm = np.sqrt(np.mean(np.square(np.asarray(metrics["grad_norm"], np.float64))))
  return {**metrics, "loss": np.float32(loss), "grad_norm": np.float32(norm),
          "tokens": np.float32(tokens.sum())}


def jit_autodiff_step(model_cfg: transformer.TransformerConfig,
                      optimizer: optax.GradientTransformation, state_sh: TrainState,
                      batch_sh, accum_steps: int = 1, context_layout: str = "zigzag",
                      context_algorithm: str = "ring", gather_once: bool = False) -> Callable:
  """One model's autodiff step, jitted with explicit shardings and the state donated;
  `context_algorithm` attention over `context_layout` where the mesh has a `context` axis;
  `gather_once`: `GatherOnce` over the accumulation steps. What `make_setup` builds for a
  plain run, for callers that hold their own state (tests, benchmarks, notebooks)."""
  mesh = batch_sh.mesh
  split = step_lib.context_split_of(mesh, context_layout, context_algorithm)
  once = GatherOnce.of(model_cfg, state_sh.params) if gather_once else None
  grad_fn = accumulate(autodiff(model_cfg, split), accum_steps, once)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.jit(sharded.under_mesh(model_step(grad_fn, optimizer), mesh),
                 in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                 donate_argnums=0, compiler_options=step_lib.compiler_options(model_cfg, mesh))
