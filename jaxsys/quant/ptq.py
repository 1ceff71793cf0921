"""Post-training quantization of a transformer parameter dict: RTN, GPTQ or SmoothQuant.

`quantize_params(cfg, params, rules, method, calib_batches)` returns the same dict with
each weight a rule quantizes replaced by a `QWeight` holding its 2-D [K, N] view
(stacked layers: [L, K, N]); `transformer.apply` runs it as it is.

  rtn          round to nearest, every scheme; no calibration data.
  gptq         GPTQ on the layer matmuls (any scheme), layer by layer on calibration
               batches; weights outside the layer stack (LM head) use RTN.
  smoothquant  SmoothQuant folding (alpha) for the inputs whose quantized consumers
               all quantize activations (w8a8 schemes), then RTN.

Example:
  q = quantize_params(cfg, params, rules.default_rules("w4a16"), "gptq", calib_batches)
  logits = transformer.apply(cfg, q, tokens)
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterable

import jax
import jax.numpy as jnp

from jaxsys.kernels import quant_matmul as qm
from jaxsys.models import transformer
from jaxsys.quant import calibrate, gptq, smoothquant
from jaxsys.quant import rules as rules_lib

METHODS = ("rtn", "gptq", "smoothquant")
_ACT_SCHEMES = ("w8a8_int8", "w8a8_fp8")  # schemes that quantize their input activations


def matrix(name: str, w: jax.Array, stacked: bool) -> jax.Array:
  """The [..., K, N] view of a weight: its input dims flattened into K, output dims into N."""
  lead = 1 if stacked else 0
  n_in = transformer.LAYER_MATMULS.get(name, 1)
  k = math.prod(w.shape[lead:lead + n_in])
  return w.reshape(*w.shape[:lead], k, -1)


def rtn(w_KN: jax.Array, rule: rules_lib.Rule) -> qm.QWeight:
  """Round-to-nearest QWeight of w [..., K, N] (leading dims quantized independently)."""
  return _rtn(w_KN, rule.scheme, rule.group_size)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _rtn(w_KN, scheme, group_size):
  fn = functools.partial(qm.quantize_weight, scheme=scheme, group_size=group_size)
  for _ in range(w_KN.ndim - 2):
    fn = jax.vmap(fn)
  return fn(w_KN)


def _layer_rules(assigned: dict[str, rules_lib.Rule]) -> dict[str, rules_lib.Rule]:
  return {path.split("/", 1)[1]: r for path, r in assigned.items() if path.startswith("layers/")}


def smooth_groups(layer_rules: dict[str, rules_lib.Rule]) -> tuple[str, ...]:
  """Inputs worth smoothing: read by quantized weights, all of which quantize activations."""
  out = []
  for group in smoothquant.GROUPS:
    consumers = [n for n, g in calibrate.INPUT_OF.items() if g == group and n in layer_rules]
    if consumers and all(layer_rules[n].scheme in _ACT_SCHEMES for n in consumers):
      out.append(group)
  return tuple(out)


def _check(cfg, params, rules, method, calib_batches) -> None:
  if method not in METHODS:
    raise ValueError(f"quantize_params: method={method!r} is not known; choose one of {METHODS}")
  if method != "rtn" and calib_batches is None:
    raise ValueError(f"quantize_params: method={method!r} needs calib_batches (training batches)")
  for path in rules_lib.quantizable_paths(params):
    w = params[path] if "/" not in path else params["layers"][path.split("/")[1]]
    # numpy arrays (e.g. from jax.device_get) are fine; QWeights mean it was quantized already.
    if not hasattr(w, "dtype") or not jnp.issubdtype(w.dtype, jnp.floating):
      raise ValueError(f"quantize_params: params[{path!r}] is a {type(w).__name__}, not a float "
                       "array; quantize the float parameters")
  if "layers" not in params or len(params["layers"]["wq"]) != cfg.n_layers:
    raise ValueError(f"quantize_params: params do not hold the {cfg.n_layers} stacked layers "
                     "of the model config")


def quantize_params(cfg: transformer.TransformerConfig, params: dict[str, Any], rules,
                    method: str = "rtn", calib_batches: Iterable[dict] | None = None, *,
                    alpha: float = 0.5, act_order: bool = False, damp: float = 0.01
                    ) -> dict[str, Any]:
  """params with every weight a rule quantizes replaced by its QWeight (see module doc)."""
  _check(cfg, params, rules, method, calib_batches)
  assigned = rules_lib.assign(params, rules)
  layer_rules = _layer_rules(assigned)
  out = dict(params)
  for path, rule in assigned.items():  # outside the layer stack: always RTN
    if "/" not in path:
      out[path] = rtn(matrix(path, params[path], stacked=False), rule)

  def quantize_layer(p: dict[str, Any], weights: dict[str, jax.Array] | None = None):
    p = dict(p)
    for name, rule in layer_rules.items():
      p[name] = weights[name] if weights else rtn(matrix(name, p[name], False), rule)
    return p

  if method == "rtn":
    layers = dict(params["layers"])
    for name, rule in layer_rules.items():
      layers[name] = rtn(matrix(name, layers[name], stacked=True), rule)
    out["layers"] = layers
    return out

  if method == "smoothquant":
    groups = smooth_groups(layer_rules)
    replace = lambda l, p, stats: quantize_layer(
        smoothquant.smooth_layer(cfg, p, stats, alpha, groups))
  else:
    def replace(l, p, stats):
      return quantize_layer(p, {
          name: gptq.gptq_quantize(matrix(name, p[name], False),
                                   stats[calibrate.INPUT_OF[name]].xtx, rule.scheme,
                                   group_size=rule.group_size, damp=damp, act_order=act_order)
          for name, rule in layer_rules.items()})
  layers, _ = calibrate.run_layers(cfg, params, calib_batches, replace)
  out["layers"] = calibrate.stack_layers(layers)
  return out


def weight_bytes(params: dict[str, Any], paths=None) -> int:
  """Storage of the given (default: the layer matmul) weights: codes + scales, or float bytes."""
  paths = [p for p in rules_lib.quantizable_paths(params) if p.startswith("layers/")] \
      if paths is None else paths
  total = 0
  for path in paths:
    w = params[path] if "/" not in path else params["layers"][path.split("/")[1]]
    total += w.nbytes if isinstance(w, qm.QWeight) else w.size * w.dtype.itemsize
  return int(total)
