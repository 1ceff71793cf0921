"""Pure training and evaluation steps, and their jitted, sharded forms."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxsys import mesh as mesh_lib
from jaxsys.kernels import sharded
from jaxsys.kernels.attention_inputs import segment_pair
from jaxsys.models import transformer
from jaxsys.parallel import context
from jaxsys.train.state import TrainState

Batch = dict[str, jax.Array]  # inputs, targets, segment_ids, positions, loss_mask: [B, T]


def cross_entropy(logits: jax.Array, batch: Batch) -> jax.Array:
  """Per-token cross-entropy [B, T] of `logits` [B, T, V] (float32), zero where loss_mask is 0."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           batch["targets"])
  return losses * batch["loss_mask"]


class ContextSplit(NamedTuple):
  """How a `context` mesh axis splits the sequence: the batch's layout over it ("zigzag",
  "contiguous", or `LAID_OUT`) and the attention algorithm (`context.ALGORITHMS`: "ring"
  passes K/V blocks round a ring, "all_gather" gathers them on every device, "ulysses"
  trades the sequence split for a head split)."""
  layout: str
  algorithm: str = "ring"


def token_losses(cfg: transformer.TransformerConfig, params, batch: Batch,
                 context_split: ContextSplit | None = None) -> jax.Array:
  """The model's per-token cross-entropy [B, T] (`transformer.losses`), zero where
  loss_mask is 0; with a `context_split`, the sequence is split over the mesh's `context`
  axis as it says (see `context_parallel`)."""
  attention_fn = None
  if context_split is not None:
    batch, attention_fn = context_parallel(batch, context_split)
  losses = transformer.losses(cfg, params, batch["inputs"], batch["targets"], batch["positions"],
                              batch["segment_ids"], attention_fn)
  return losses * batch["loss_mask"]


# The context layout of a batch its maker already laid out over `context` (an HDP
# micro-step: whole documents in zigzag shares, each token with its document position):
# the attention runs on it as it is.
LAID_OUT = "laid_out"


def context_parallel(batch: Batch, split: ContextSplit, axis: str = mesh_lib.CONTEXT
                     ) -> tuple[Batch, Callable]:
  """The batch reordered into `split.layout` over mesh axis `axis`, and its attention_fn.

  Every field moves with its token, so per-token losses (summed) are unchanged; the
  layout only decides how the causal work is balanced over the devices.
  Called while tracing under a mesh (`sharded.under_mesh`).
  """
  if split.layout == LAID_OUT:
    return batch, context_attention_fn(split._replace(layout="zigzag"), axis)
  n = jax.sharding.get_abstract_mesh().shape[axis]
  laid = {k: context.to_layout(x, n, split.layout, axis=1) for k, x in batch.items()}
  return laid, context_attention_fn(split, axis)


def context_attention_fn(split: ContextSplit = ContextSplit("zigzag"), axis: str = mesh_lib.CONTEXT
                         ) -> Callable:
  """An attention_fn for the model: `split.algorithm` over mesh axis `axis`.

  The tokens' positions [B, T] go with the keys as causal keys, so masking (with the
  segment ids) is exact whatever order the tokens are in.
  """
  kernel = context.ALGORITHMS[split.algorithm]

  def attention_fn(q, k, v, *, segment_ids=None, positions, causal=True):
    q_seg, kv_seg = segment_pair(segment_ids)
    return sharded.sharded_context_attention(kernel, q, k, v, q_seg, kv_seg, positions,
                                             axis=axis, causal=causal, layout=split.layout)
  return attention_fn


def apply_gradients(state: TrainState, optimizer: optax.GradientTransformation, total, count,
                    grads) -> tuple[TrainState, dict[str, jax.Array]]:
  """The optimizer step from gradients of the summed token loss `total` over `count` tokens."""
  denom = jnp.maximum(count, 1.0)
  grads = jax.tree.map(lambda g: g / denom, grads)
  params, opt_state, norm = update(optimizer, state.params, state.opt_state, grads)
  metrics = {"loss": total / denom, "grad_norm": norm, "tokens": count}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def update(optimizer: optax.GradientTransformation, params, opt_state, grads):
  """(params, opt_state, gradient norm) after one optimizer update with `grads`."""
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)


def eval_step(params, batch: Batch, *, model_cfg: transformer.TransformerConfig,
              token_bytes: jax.Array, context_split: ContextSplit | None = None
              ) -> dict[str, jax.Array]:
  """`eval_sums` of the model's per-token losses (its summed loss, scored tokens and bytes)."""
  losses = token_losses(model_cfg, params, batch, context_split)
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


def context_split_of(mesh, layout: str, algorithm: str = "ring") -> ContextSplit | None:
  """The split of a mesh with a `context` axis larger than 1, else None (no split)."""
  return ContextSplit(layout, algorithm) if mesh_lib.degrees(mesh).context > 1 else None


def jit_eval_step(model_cfg, param_sh: Any, batch_sh: NamedSharding, token_bytes,
                  context_layout: str = "zigzag") -> Callable:
  replicated = NamedSharding(batch_sh.mesh, PartitionSpec())
  table = jnp.asarray(token_bytes, jnp.float32)
  fn = functools.partial(eval_step, model_cfg=model_cfg, token_bytes=table,
                         context_split=context_split_of(batch_sh.mesh, context_layout))
  fn = sharded.under_mesh(fn, batch_sh.mesh)
  return jax.jit(fn, in_shardings=(param_sh, batch_sh), out_shardings=replicated,
                 compiler_options=compiler_options(model_cfg, batch_sh.mesh))


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> Batch:
  """A process's block of the global batch (what its loader reads: its rows, each whole) as
  global arrays. The rows are this process's block of them; along the sequence each device
  takes its slice of the whole rows, so a `context` axis may span processes (left to jax's
  inference, each process's rows would be taken for its part of longer ones)."""
  rows = len(next(iter(local.values())))
  probe = (sharding.mesh.size * rows, sharding.mesh.size)  # sizes every split divides
  blocks = lambda index_map: len({(i[0].start, i[0].stop) for i in index_map.values()})
  global_rows = rows * blocks(sharding.devices_indices_map(probe)) // blocks(
      sharding.addressable_devices_indices_map(probe))
  return {k: jax.make_array_from_process_local_data(sharding, v, (global_rows, *v.shape[1:]))
          for k, v in local.items()}
