"""qwix's PTQ of our transformer, as a baseline measured beside `quantize_params`.

qwix (`qwix.quantize_model` + `qwix.PtqProvider`) intercepts jnp.dot / dot_general
calls made inside flax modules, finds which module parameter the right operand is, and
swaps that parameter for a quantized one. Our `Transformer` keeps each weight stacked
[L, ...] and reaches the dot through a scan over layers and a reshape, so qwix cannot
trace the operand back to a parameter. Measured with qwix 0.1.8 on `Transformer`
(rule module_path="layers"): an int4 weight-only rule is silently a no-op (logits
identical to float, weights stay float Params); an int8 w8a8 rule quantizes the
weight on every call as if it were an activation (no stored codes). A rule matching
the top module swaps the LM head Param for qwix's WithAux, which the model then
cannot read.
`QwixTransformer` holds the same parameters one module per matmul, each a 2-D [K, N]
kernel multiplied by a plain jnp.dot in its own __call__, and runs the model's own
`transformer.block` (the modules are passed in place of the weights), `embed` and
`unembed`, so it computes exactly `transformer.apply` in float.

Example:
  model = quantize(cfg, params, "w4a16", tokens_BT)        # a qwix-quantized NNX model
  logits = model(tokens_BT, positions_BT, segment_ids_BT)
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.models import transformer
from jaxsys.quant.ptq import matrix

# Our scheme -> qwix (weight_qtype, act_qtype, whether K is tiled in groups of group_size).
SCHEMES = {
    "w8a8_int8": (jnp.int8, jnp.int8, None),
    "w8a8_fp8": (jnp.float8_e4m3fn, jnp.float8_e4m3fn, None),
    "w4a16": (jnp.int4, None, True),
}


class QwixDense(nnx.Module):
  """One matmul weight [K, N]; qwix replaces `kernel` with its quantized form."""

  def __init__(self, w_KN: jax.Array):
    self.kernel = nnx.Param(w_KN)

  def __call__(self, x_MK: jax.Array) -> jax.Array:
    # A Param before quantization; qwix's WithAux (unboxed by `.value`) after it.
    k = self.kernel
    return jnp.dot(x_MK, k.get_value() if isinstance(k, nnx.Variable) else k.value)


class QwixLayer(nnx.Module):
  """One decoder layer: norm scales and a QwixDense per matmul."""

  def __init__(self, p: dict[str, jax.Array]):
    self.attn_norm = nnx.Param(p["attn_norm"])
    self.mlp_norm = nnx.Param(p["mlp_norm"])
    for name in transformer.LAYER_MATMULS:
      setattr(self, name, QwixDense(matrix(name, p[name], stacked=False)))

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, cfg, attention_fn):
    p = {"attn_norm": self.attn_norm.get_value(), "mlp_norm": self.mlp_norm.get_value(),
         **{name: getattr(self, name) for name in transformer.LAYER_MATMULS}}
    return transformer.block(p, x_BTD, positions_BT, segment_ids_BT, cfg, attention_fn)


class QwixTransformer(nnx.Module):
  """Our transformer's parameters, one module per matmul (see the module docstring)."""

  def __init__(self, cfg: transformer.TransformerConfig, params: dict[str, Any]):
    self.cfg = cfg
    self.embedding = nnx.Param(params["embedding"])
    self.layers = nnx.List([QwixLayer(jax.tree.map(lambda a: a[i], params["layers"]))
                            for i in range(cfg.n_layers)])
    self.final_norm = nnx.Param(params["final_norm"])
    self.unembedding = None if cfg.tie_embeddings else nnx.Param(params["unembedding"])

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None):
    cfg = self.cfg
    positions_BT, attention_fn = transformer.default_inputs(cfg, tokens_BT, positions_BT, None)
    embedding = self.embedding.get_value()
    x_BTD = transformer.embed(cfg, embedding, tokens_BT)
    for layer in self.layers:
      x_BTD = layer(x_BTD, positions_BT, segment_ids_BT, cfg, attention_fn)
    unembedding = None if self.unembedding is None else self.unembedding.get_value()
    return transformer.unembed(cfg, x_BTD, self.final_norm.get_value(), embedding, unembedding)


def _import_qwix():
  """qwix is an optional peer baseline (the `experiments` extra), imported only when used."""
  try:
    import qwix  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError:
    raise ModuleNotFoundError("the qwix baseline needs qwix: pip install -e '.[experiments]'") from None
  return qwix


def qwix_rules(scheme: str, group_size: int = 128):
  """qwix rules quantizing every layer matmul like `rules.default_rules(scheme, group_size)`."""
  qwix = _import_qwix()
  if scheme not in SCHEMES:
    raise ValueError(f"qwix_rules: scheme={scheme!r} is not known; choose one of {sorted(SCHEMES)}")
  weight, act, tiled = SCHEMES[scheme]
  tile = group_size if tiled else None
  names = "|".join(transformer.LAYER_MATMULS)
  return [qwix.QtRule(module_path=rf"layers/\d+/({names})", weight_qtype=weight, act_qtype=act,
                      tile_size=tile)]


def quantize(cfg: transformer.TransformerConfig, params: dict[str, Any], scheme: str,
             tokens_BT, *, group_size: int = 128) -> QwixTransformer:
  """qwix PTQ of the float `params` for `scheme` (the model runs once on `tokens_BT`)."""
  qwix = _import_qwix()
  model = QwixTransformer(cfg, params)
  provider = qwix.PtqProvider(qwix_rules(scheme, group_size))
  return qwix.quantize_model(model, provider, tokens_BT)


def weight_bytes(model: nnx.Module) -> int:
  """Storage of the layer matmul weights: qwix's codes at their bit width plus scales."""
  total = 0
  for layer in model.layers:
    for name in transformer.LAYER_MATMULS:
      for leaf in jax.tree.leaves(getattr(layer, name).kernel):
        bits = jnp.iinfo(leaf.dtype).bits if jnp.issubdtype(leaf.dtype, jnp.integer) \
            else jnp.finfo(leaf.dtype).bits
        total += int(np.prod(leaf.shape)) * bits // 8
  return total
