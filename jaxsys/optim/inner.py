"""Inner (per-worker) optimizer: AdamW with linear warmup, cosine decay and clipping."""
from __future__ import annotations

import jax
import optax

from jaxsys.optim.config import OptimizerConfig


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup to `learning_rate`, cosine decay to `learning_rate * final_lr_fraction`.

  The decay spans `cfg.schedule_steps` when set, else `total_steps`: set it to train a
  run in several legs (or to extend one) without changing its learning-rate curve.
  `cfg.schedule_offset` steps of the curve are skipped: a run started from another's
  parameters (`init_from`) continues that run's curve instead of warming up again.
  """
  total_steps = cfg.schedule_steps or total_steps
  offset = cfg.schedule_offset
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=cfg.learning_rate * cfg.final_lr_fraction)
  return (lambda count: schedule(count + offset)) if offset else schedule


BIASES = ("bq", "bk", "bv")


def decay_mask(params):
  """Weight decay on weight matrices only; norm scales (named `*norm*`) and biases (`bq`,
  `bk`, `bv`) are exempt.

  Decided by name, not ndim, because stacked norm scales are [layers, D] matrices.
  """
  def decays(path, _):
    names = [str(getattr(k, "key", k)) for k in path]
    return not any("norm" in n or n in BIASES for n in names)
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
  """The optimizer named by `cfg.name` (adamw, the only one) with `make_schedule`'s curve."""
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay, mask=decay_mask),
  )
