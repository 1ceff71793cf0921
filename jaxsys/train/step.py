"""Pure training and evaluation steps, and their jitted, sharded forms."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxsys import mesh as mesh_lib
from jaxsys.kernels import sharded
from jaxsys.kernels.attention_inputs import segment_pair
from jaxsys.models import transformer
from jaxsys.parallel import context, pipeline
from jaxsys.optim.inner import make_optimizer
from jaxsys.train import state as state_lib
from jaxsys.train.state import TrainState

Batch = dict[str, jax.Array]  # inputs, targets, segment_ids, positions, loss_mask: [B, T]


def cross_entropy(logits: jax.Array, batch: Batch) -> jax.Array:
  """Per-token cross-entropy [B, T] of `logits` [B, T, V] (float32), zero where loss_mask is 0."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           batch["targets"])
  return losses * batch["loss_mask"]


def token_losses(cfg: transformer.TransformerConfig, params, batch: Batch,
                 context_layout: str | None = None, attention_fn: Callable | None = None
                 ) -> jax.Array:
  """`cross_entropy` of the model's logits; with a `context_layout`, the sequence is split
  over the mesh's `context` axis in that layout (see `context_parallel`); `attention_fn`
  replaces the model's attention for a batch already laid out (an HDP micro-step)."""
  if context_layout is not None:
    batch, attention_fn = context_parallel(batch, context_layout)
  logits = transformer.apply(cfg, params, batch["inputs"], batch["positions"],
                             batch["segment_ids"], attention_fn)
  return cross_entropy(logits, batch)


def context_parallel(batch: Batch, layout: str, axis: str = "context"
                     ) -> tuple[Batch, Callable]:
  """The batch reordered into `layout` over mesh axis `axis`, and its ring attention_fn.

  Every field moves with its token, so per-token losses (summed) are unchanged; the
  layout only decides how the causal work is balanced over the ring.
  Called while tracing under a mesh (`sharded.under_mesh`).
  """
  n = jax.sharding.get_abstract_mesh().shape[axis]
  laid = {k: context.to_layout(x, n, layout, axis=1) for k, x in batch.items()}
  return laid, ring_attention_fn(laid["positions"], layout, axis)


def ring_attention_fn(positions, layout: str = "zigzag", axis: str = "context") -> Callable:
  """An attention_fn for the model: ring attention over mesh axis `axis`.

  The documents' positions [B, T] go round the ring with the keys as causal keys, so
  masking (with the segment ids) is exact whatever order the tokens are in.
  """
  def attention_fn(q, k, v, *, segment_ids=None, causal=True):
    q_seg, kv_seg = segment_pair(segment_ids)
    return sharded.sharded_context_attention(context.ring_attention, q, k, v, q_seg, kv_seg,
                                             positions, axis=axis, causal=causal, layout=layout)
  return attention_fn


def train_step(state: TrainState, batch: Batch, *, model_cfg: transformer.TransformerConfig,
               optimizer: optax.GradientTransformation, accum_steps: int = 1,
               context_layout: str | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step on `batch`, split into `accum_steps` microbatches.

  Gradients are of the summed token loss and divided by the total token count at
  the end, so accumulation gives exactly the gradient of the whole batch.
  """
  def loss_sum(params, mb):
    losses = token_losses(model_cfg, params, mb, context_layout)
    return jnp.sum(losses), jnp.sum(mb["loss_mask"])

  grad_fn = jax.value_and_grad(loss_sum, has_aux=True)
  if accum_steps == 1:
    (total, count), grads = grad_fn(state.params, batch)
  else:
    def body(carry, mb):
      (l, n), g = grad_fn(state.params, mb)
      return jax.tree.map(jnp.add, carry, (l, n, g)), None
    zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
    (total, count, grads), _ = jax.lax.scan(body, zeros, pipeline.split_microbatches(batch, accum_steps))
  return apply_gradients(state, optimizer, total, count, grads)


def apply_gradients(state: TrainState, optimizer: optax.GradientTransformation, total, count,
                    grads) -> tuple[TrainState, dict[str, jax.Array]]:
  """The optimizer step from gradients of the summed token loss `total` over `count` tokens."""
  denom = jnp.maximum(count, 1.0)
  grads = jax.tree.map(lambda g: g / denom, grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {"loss": total / denom, "grad_norm": optax.tree.norm(grads), "tokens": count}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch: Batch, *, model_cfg: transformer.TransformerConfig,
              token_bytes: jax.Array, context_layout: str | None = None) -> dict[str, jax.Array]:
  """`eval_sums` of the model's per-token losses."""
  losses = token_losses(model_cfg, params, batch, context_layout)
  return eval_sums_of_loss(jnp.sum(losses), batch, token_bytes)


def eval_sums(logits: jax.Array, batch: Batch, token_bytes: jax.Array) -> dict[str, jax.Array]:
  """Sums over a batch: loss (nats), scored tokens, and the UTF-8 bytes those tokens stand for."""
  return eval_sums_of_loss(jnp.sum(cross_entropy(logits, batch)), batch, token_bytes)


def eval_sums_of_loss(loss_sum: jax.Array, batch: Batch, token_bytes: jax.Array
                      ) -> dict[str, jax.Array]:
  """`eval_sums` from the batch's summed loss, however it was computed."""
  mask = batch["loss_mask"]
  return {"loss_sum": loss_sum, "tokens": jnp.sum(mask),
          "bytes": jnp.sum(token_bytes[batch["targets"]] * mask)}


def summarize_eval(sums: dict[str, float]) -> dict[str, float]:
  """Mean loss per token and bits per byte from accumulated `eval_step` sums."""
  return {"val_loss": sums["loss_sum"] / max(sums["tokens"], 1.0),
          "val_bpb": sums["loss_sum"] / math.log(2) / max(sums["bytes"], 1.0)}


def compiler_options(model_cfg: transformer.TransformerConfig, mesh) -> dict[str, Any] | None:
  """XLA options for the steps on `mesh`: on CPU with float32 compute, Eigen dots, not YNNPACK.

  Measured with experiments/bench_train.py on a 2-core AMD EPYC (jax 0.10.2): the
  tiny config's step is about 5% faster, because YNNPACK's float32 dots at the
  model's [B*T, 256] x [256, N] shapes run below Eigen's. Other backends and
  dtypes keep XLA's defaults.
  """
  platforms = {d.platform for d in mesh.devices.flat}
  if platforms == {"cpu"} and jnp.dtype(model_cfg.dtype) == jnp.float32:
    return {"xla_cpu_experimental_ynn_fusion_type": ""}
  return None


def context_layout_of(mesh, layout: str) -> str | None:
  """`layout` where the mesh has a `context` axis larger than 1, else None (no ring)."""
  return layout if dict(mesh.shape).get("context", 1) > 1 else None


def jit_train_step(model_cfg, optimizer, state_sh: TrainState, batch_sh: NamedSharding,
                   accum_steps: int = 1, context_layout: str = "zigzag") -> Callable:
  """`train_step` jitted with explicit shardings; the input state's buffers are donated."""
  replicated = NamedSharding(batch_sh.mesh, PartitionSpec())
  fn = functools.partial(train_step, model_cfg=model_cfg, optimizer=optimizer, accum_steps=accum_steps,
                         context_layout=context_layout_of(batch_sh.mesh, context_layout))
  fn = sharded.under_mesh(fn, batch_sh.mesh)  # Pallas kernels split over the mesh
  return jax.jit(fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                 donate_argnums=0, compiler_options=compiler_options(model_cfg, batch_sh.mesh))


def jit_eval_step(model_cfg, param_sh: Any, batch_sh: NamedSharding, token_bytes,
                  context_layout: str = "zigzag") -> Callable:
  replicated = NamedSharding(batch_sh.mesh, PartitionSpec())
  table = jnp.asarray(token_bytes, jnp.float32)
  fn = functools.partial(eval_step, model_cfg=model_cfg, token_bytes=table,
                         context_layout=context_layout_of(batch_sh.mesh, context_layout))
  fn = sharded.under_mesh(fn, batch_sh.mesh)
  return jax.jit(fn, in_shardings=(param_sh, batch_sh), out_shardings=replicated,
                 compiler_options=compiler_options(model_cfg, batch_sh.mesh))


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> Batch:
  """A process's block of the global batch (what its loader reads) as global arrays."""
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


@dataclasses.dataclass(frozen=True)
class TrainSetup:
  """Everything a run needs to step: optimizer, state layout and the jitted step."""
  model_cfg: transformer.TransformerConfig
  optimizer: optax.GradientTransformation
  abstract: TrainState
  state_sh: TrainState
  batch_sh: NamedSharding
  train_fn: Callable
  context_layout: str = "zigzag"  # the sequence order over a `context` axis, if any

  @property
  def param_sh(self) -> Any:
    """Shardings of the canonical parameters."""
    return self.state_sh.params

  def device_batch(self, batch: dict[str, np.ndarray]) -> Batch:
    """The loader's batch as train_fn takes it."""
    return global_batch(batch, self.batch_sh)

  def jit_eval_step(self, token_bytes) -> Callable:
    """(state.params, batch) -> eval sums, jitted."""
    return jit_eval_step(self.model_cfg, self.param_sh, self.batch_sh, token_bytes,
                         self.context_layout)

  def init_state(self, seed: int) -> TrainState:
    """A fresh state created directly in its shardings."""
    return jax.jit(lambda: state_lib.init_train_state(self.model_cfg, self.optimizer, seed),
                   out_shardings=self.state_sh)()

  # A run's state may be a view of the canonical arrays (a pipeline's stages); checkpoints
  # and evals always see the canonical form. Here the two are the same.

  def saved_target(self) -> TrainState:
    """The canonical state's abstract leaves with shardings: what a checkpoint restores into."""
    return state_lib.with_shardings(self.abstract, self.state_sh)

  def one_target(self) -> TrainState:
    """One model's canonical state, abstract with shardings: what another run's checkpoint
    converts through (`checkpoint.layouts.convert`)."""
    return self.saved_target()

  def assemble(self, step, params, opt_state) -> TrainState:
    """The saved form of a state from its converted parts (inside a jit)."""
    return TrainState(step=step, params=params, opt_state=opt_state)

  def to_saved(self, state: TrainState) -> TrainState:
    return state

  def from_saved(self, state: TrainState) -> TrainState:
    return state

  def start_from(self, state: TrainState, params) -> TrainState:
    """`state` restarted at canonical `params` with a fresh optimizer state (init_from)."""
    start = lambda s, p: s.replace(params=p, opt_state=self.optimizer.init(p))
    return jax.jit(start, out_shardings=self.state_sh, donate_argnums=0)(state, params)


def make_train_setup(config, model_cfg: transformer.TransformerConfig, mesh) -> TrainSetup:
  """The train step of `config` on `mesh`, built as the loop and the benchmarks use it."""
  optimizer = make_optimizer(config.optimizer, config.total_steps)
  abstract = state_lib.abstract_train_state(model_cfg, optimizer, config.seed)
  state_sh = state_lib.state_shardings(abstract, model_cfg, optimizer, mesh)
  batch_sh = mesh_lib.batch_sharding(mesh)
  layout = config.parallel.context_layout
  train_fn = jit_train_step(model_cfg, optimizer, state_sh, batch_sh,
                            config.optimizer.grad_accum_steps, layout)
  return TrainSetup(model_cfg, optimizer, abstract, state_sh, batch_sh, train_fn, layout)
