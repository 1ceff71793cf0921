"""Calibration: per-layer input statistics of every matmul, collected layer by layer.

For each layer the inputs of its matmuls are recorded on calibration batches (taps in
place of the weights inside `transformer.block`, so the block code is the model's own)
and reduced to `InputStats`: the Gram matrix X^T X (GPTQ's Hessian, up to a factor)
and each input channel's max |x| (SmoothQuant). `run_layers` goes through the stack
sequentially, as GPTQ does: layer l's statistics come from the outputs of layers
0..l-1 AFTER they were replaced (quantized), so later layers see the errors of
earlier ones.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp

from jaxsys.models import transformer

# The input each layer matmul reads: weights sharing an input share its statistics.
INPUT_OF = {"wq": "attn_in", "wk": "attn_in", "wv": "attn_in", "wo": "attn_out",
            "w_gate": "mlp_in", "w_up": "mlp_in", "w_down": "mlp_hidden"}


class InputStats(NamedTuple):
  """Statistics of one matmul input x [tokens, K] over all calibration tokens."""
  xtx: jax.Array     # [K, K] float32: sum over tokens of x x^T
  absmax: jax.Array  # [K] float32: max over tokens of |x_k|
  count: jax.Array   # scalar float32: tokens seen

  def merge(self, other: "InputStats") -> "InputStats":
    return InputStats(self.xtx + other.xtx, jnp.maximum(self.absmax, other.absmax),
                      self.count + other.count)


def input_stats(x_MK: jax.Array) -> InputStats:
  """InputStats of one batch of inputs [M, K] (float32, full-precision Gram matrix)."""
  x = x_MK.astype(jnp.float32)
  xtx = jnp.dot(x.T, x, precision=jax.lax.Precision.HIGHEST)
  return InputStats(xtx, jnp.max(jnp.abs(x), axis=0), jnp.asarray(x.shape[0], jnp.float32))


class _Tap:
  """Stands in for a float weight in `transformer.block`: records its input, then multiplies."""

  def __init__(self, w, key: str, seen: dict[str, jax.Array], dtype):
    self.w, self.key, self.seen, self.dtype = w, key, seen, dtype

  def __call__(self, x_MK):
    self.seen.setdefault(self.key, x_MK)
    return jnp.dot(x_MK, self.w.astype(self.dtype).reshape(x_MK.shape[1], -1))


def layer(params_layers: dict[str, Any], index: int) -> dict[str, Any]:
  """One layer's parameters (QWeights included) from the stacked [L, ...] dict."""
  return jax.tree.map(lambda a: a[index], params_layers)


def tapped_block(cfg: transformer.TransformerConfig, p: dict[str, Any], x_BTD, positions_BT,
                 segment_ids_BT, attention_fn) -> tuple[jax.Array, dict[str, InputStats]]:
  """One float layer's output and the InputStats of each of its matmul inputs."""
  seen: dict[str, jax.Array] = {}
  dt = jnp.dtype(cfg.dtype)
  taps = {name: _Tap(p[name], INPUT_OF[name], seen, dt) for name in INPUT_OF}
  y = transformer.block({**p, **taps}, x_BTD, positions_BT, segment_ids_BT, cfg, attention_fn)
  return y, {key: input_stats(x) for key, x in seen.items()}


def run_layers(cfg: transformer.TransformerConfig, params: dict[str, Any], batches: Iterable[dict],
               replace: Callable[[int, dict, dict[str, InputStats]], dict] | None = None
               ) -> tuple[list[dict[str, Any]], list[dict[str, InputStats]]]:
  """Calibrates the layers in order; `replace(l, float_layer, stats)` gives the layer to use.

  Returns (the layers `replace` returned, each layer's stats). With `replace=None` the
  layers stay float and the stats are those of the float model. `batches` hold
  `inputs`, `positions` and `segment_ids` [B, T] (a data loader's batches).
  """
  batches = [{k: jnp.asarray(b[k]) for k in ("inputs", "positions", "segment_ids")}
             for b in batches]
  if not batches:
    raise ValueError("run_layers: batches is empty; calibration needs at least one batch")
  xs = [_embed(cfg, params["embedding"], b["inputs"]) for b in batches]
  layers, all_stats = [], []
  for index in range(cfg.n_layers):
    p = layer(params["layers"], index)
    stats = None
    for i, b in enumerate(batches):
      _, s = _measure(cfg, p, xs[i], b)
      stats = s if stats is None else {k: stats[k].merge(s[k]) for k in stats}
    new_p = replace(index, p, stats) if replace is not None else p
    xs = [_forward(cfg, new_p, xs[i], b) for i, b in enumerate(batches)]
    layers.append(new_p)
    all_stats.append(stats)
  return layers, all_stats


# Jitted with the (hashable) model config static, so repeated calibrations reuse compilations.

@functools.partial(jax.jit, static_argnums=0)
def _embed(cfg, embedding, tokens_BT):
  return transformer.embed(cfg, embedding, tokens_BT)


@functools.partial(jax.jit, static_argnums=0)
def _measure(cfg, p, x_BTD, b):
  _, attention_fn = transformer.default_inputs(cfg, b["inputs"], None, None)
  return tapped_block(cfg, p, x_BTD, b["positions"], b["segment_ids"], attention_fn)


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, p, x_BTD, b):
  _, attention_fn = transformer.default_inputs(cfg, b["inputs"], None, None)
  return transformer.block(p, x_BTD, b["positions"], b["segment_ids"], cfg, attention_fn)


def stack_layers(layers: list[dict[str, Any]]) -> dict[str, Any]:
  """Per-layer dicts (arrays or QWeights) -> one dict stacked on a leading `layers` axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
