"""Decoder-only transformer LM (Flax NNX): RMSNorm, RoPE, SwiGLU, grouped-query attention.

The transformer layers are STACKED: every layer parameter has a leading `layers`
axis and the stack is applied with `jax.lax.scan`, so a parallel strategy is just
another view of the same arrays (pipeline: [stage, layers/stage, ...]). Every
parameter carries `logical_axes` metadata, mapped to mesh axes by `jaxsys.mesh`.

Example:
  cfg = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  logits = model(tokens_BT, positions_BT, segment_ids_BT)   # [B, T, vocab] float32
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxsys import flops as flops_lib
from jaxsys import mesh as mesh_lib
from jaxsys.fields import field, integer, number, optional, text
from jaxsys.kernels import attention as attention_lib
from jaxsys.kernels.backends import IMPLS
from jaxsys.models import output_layer, remat
from jaxsys.models.matmul import matmul

# Stacks of at most this many layers are unrolled: the scan's stacked residuals cost a
# zero-fill plus a dynamic-slice copy per layer and step (about 8% of a CPU step of the
# tiny config); deeper stacks keep the loop so compile time stays flat in depth.
UNROLL_MAX_LAYERS = 8
# The layer's matmul weights and how many leading (input) dims each one contracts.
LAYER_MATMULS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}

# remat's, by names the config's own `remat` field does not shadow.
_OFFLOADABLE, _parse_offload = remat.OFFLOADABLE, remat.parse_offload

@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A Llama-style decoder's shape and numerics (the run config's `model` section)."""
  vocab_size: int = field(256, "embedding and output rows", integer(1))
  d_model: int = field(256, "the residual width", integer(1))
  n_layers: int = field(4, "decoder layers", integer(1))
  n_heads: int = field(4, "query heads", integer(1))
  n_kv_heads: int = field(4, "K/V heads (GQA: fewer than n_heads)", integer(1))
  head_dim: int | None = field(None, "a head's width",
                               optional(integer(2), "model.d_model // model.n_heads"))
  d_ff: int = field(1024, "the SwiGLU MLP's width", integer(1))
  rope_theta: float = field(10_000.0, "RoPE's base", number(0, lo_open=True))
  # parse_rope_scaling raises its own line for a malformed spec.
  rope_scaling: str = field(
      "", "transformers' rope_scaling as one string, e.g. 'linear:factor=4', Llama 3.1's "
      "'llama3:factor=8,...' or Qwen2.5's 'yarn:factor=4,...'; '': plain RoPE",
      text("'' (plain RoPE) or transformers' rope_scaling as '<rope_type>:<key>=<value>,...'",
           lambda v: parse_rope_scaling(v) is not None))
  norm_eps: float = field(1e-6, "RMSNorm's epsilon", number(0, lo_open=True))
  tie_embeddings: bool = field(False, "the output layer is the embedding's transpose")
  qkv_bias: bool = field(False, "q, k and v projections with biases (Qwen2)")
  qk_norm: bool = field(False, "q and k RMS-normed per head before RoPE (Qwen3)")
  sliding_window: int = field(
      0, "each token attends to itself and the sliding_window - 1 tokens before it (Mistral's "
      "sliding_window)", integer(0, meaning="0: no window, every earlier token"))
  dtype: Literal["float32", "bfloat16", "float16"] = field("float32", "the compute dtype")
  param_dtype: Literal["float32", "bfloat16", "float16"] = field("float32", "the parameters'")
  attention_impl: Literal[IMPLS] = field("auto", "the attention kernels (kernels/backends.py)")
  remat: Literal[remat.POLICIES] = field(
      "none", "what a layer keeps for its backward (models/remat.py): none, minimal (no matmul "
      "recomputed), dots, qkv or full")
  remat_offload: str = field(
      "", "comma-separated names a layer keeps in host memory instead, e.g. 'layer_input,q'",
      text(f"'' or a comma-separated subset of {', '.join(_OFFLOADABLE)} (kept in host "
           "memory)", lambda v: set(_parse_offload(v)) <= set(_OFFLOADABLE)))
  vocab_tiles: int = field(1, "the loss's output layer in this many vocabulary tiles: no "
                           "[B, T, vocab] logits whole (output_layer.py)",
                           integer(1, meaning="1: the output layer untiled"))

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}")
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
          f"model.d_model={self.d_model} must divide by model.n_heads={self.n_heads} "
          "(or set model.head_dim)")
    remat.check(self.remat, self.remat_offload)
    parse_rope_scaling(self.rope_scaling)
    if self.vocab_tiles < 1 or self.vocab_size % self.vocab_tiles:
      raise ValueError(f"model.vocab_tiles={self.vocab_tiles} must be >= 1 and divide "
                       f"model.vocab_size={self.vocab_size}")
    for name in ("dtype", "param_dtype"):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError:
        raise ValueError(f"model.{name}={getattr(self, name)!r} is not a dtype name "
                         "such as 'float32' or 'bfloat16'") from None

  @property
  def hd(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @classmethod
  def from_config(cls, cfg) -> "TransformerConfig":
    """Builds from a mapping or ConfigDict with the same field names."""
    d = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
    return cls(**d)

def _param(rngs: nnx.Rngs, init, shape, axes: tuple[str, ...], dtype) -> nnx.Param:
  assert len(shape) == len(axes), (shape, axes)
  return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)

def _dense_init(in_axis, out_axis, scale=1.0):
  # Stacked weights: axis 0 is `layers`, a batch axis for fan computation.
  return jax.nn.initializers.variance_scaling(
      scale, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=0)

def rms_norm(x, scale, eps):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)

# transformers' rope types with frequency scaling that jaxsys computes: the keys each must
# set, then those it may (transformers' defaults when absent; truncate is 0 or 1).
ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
ROPE_SCALING_OPTIONAL = {
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "truncate"),
}
# Why the others are not computed (hf.py names it when a checkpoint asks for one).
ROPE_NOT_COMPUTED = {
    "dynamic": "transformers recomputes dynamic NTK frequencies from the longest sequence the "
               "model instance has run so far (state kept across calls), so a token's logits "
               "depend on earlier calls; jaxsys's RoPE is a function of the positions only",
    "longrope": "its per-dimension factors switch with the sequence length",
}


def _rope_error(spec: str, what: str) -> ValueError:
  valid = " or ".join(
      f"'{k}:" + ",".join(f"{key}=<number>" for key in keys) + "'"
      + (f" (optional: {', '.join(ROPE_SCALING_OPTIONAL[k])})" if k in ROPE_SCALING_OPTIONAL
         else "") for k, keys in ROPE_SCALING_KEYS.items())
  return ValueError(f"model.rope_scaling={spec!r}: {what}; valid: '' or {valid}")


def parse_rope_scaling(spec: str) -> tuple[str, dict[str, float]]:
  """`model.rope_scaling` -> (rope type, its parameters): '' is plain RoPE; else
  transformers' rope_scaling as '<rope_type>:<key>=<value>,...', e.g. Llama 3.1's
  'llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192',
  'linear:factor=4' or Qwen2.5's 'yarn:factor=4,original_max_position_embeddings=32768'.
  A bad spec is one error naming what is valid."""
  if not spec:
    return "default", {}
  kind, _, rest = spec.partition(":")
  if kind not in ROPE_SCALING_KEYS:
    why = f" ({ROPE_NOT_COMPUTED[kind]})" if kind in ROPE_NOT_COMPUTED else ""
    raise _rope_error(spec, f"rope type {kind!r} is not supported{why}")
  values = {}
  for item in rest.split(",") if rest else []:
    key, _, value = item.partition("=")
    try:
      values[key.strip()] = float(value)
    except ValueError:
      raise _rope_error(spec, f"{item!r} is not <key>=<number>") from None
  required, optional = set(ROPE_SCALING_KEYS[kind]), set(ROPE_SCALING_OPTIONAL.get(kind, ()))
  if not required <= set(values) <= required | optional:
    raise _rope_error(spec, f"{kind} must set the keys {', '.join(ROPE_SCALING_KEYS[kind])}"
                      + (f" and may set {', '.join(sorted(optional))}" if optional else ""))
  _check_rope_values(spec, kind, values)
  return kind, values


def _check_rope_values(spec: str, kind: str, v: dict[str, float]) -> None:
  if v["factor"] <= 0 or v.get("original_max_position_embeddings", 1) <= 0 or (
      kind == "llama3" and not 0 < v["low_freq_factor"] < v["high_freq_factor"]):
    raise _rope_error(spec, "factor and original_max_position_embeddings must be > 0 and 0 < "
                      "low_freq_factor < high_freq_factor")
  if kind == "yarn" and (v.get("truncate", 1) not in (0, 1) or v.get("attention_factor", 1) <= 0
                         or v.get("beta_fast", 32) <= 0 or v.get("beta_slow", 1) <= 0):
    raise _rope_error(spec, "yarn's truncate must be 0 or 1, and attention_factor, beta_fast "
                      "and beta_slow > 0")


def _yarn(powers: np.ndarray, d: int, theta: float, p: dict[str, float]) -> np.ndarray:
  """YaRN's blend (transformers' `_compute_yarn_parameters`, in its float32 steps): slow
  dims interpolated (divided by factor), fast ones kept, a linear ramp between the dims
  that turn beta_slow and beta_fast times over the original context."""
  factor, old_len = p["factor"], p["original_max_position_embeddings"]
  beta_fast, beta_slow = p.get("beta_fast", 32.0), p.get("beta_slow", 1.0)

  def correction_dim(rotations):
    return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if p.get("truncate", 1):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, d - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp
  ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low))
                 / np.float32(high - low), 0, 1).astype(np.float32)
  keep = np.float32(1) - ramp  # 1: the dim's own frequency (extrapolated)
  kept, interpolated = np.float32(1) / powers, np.float32(1) / (np.float32(factor) * powers)
  return (interpolated * (np.float32(1) - keep) + kept * keep).astype(np.float32)


def rope_attention_factor(scaling: str = "") -> float:
  """The factor transformers multiplies cos and sin by (so q.k by its square): YaRN's
  attention_factor, or 0.1 ln(factor) + 1 (with mscale and mscale_all_dim: their ratio);
  1 for every other rope type."""
  kind, p = parse_rope_scaling(scaling)
  if kind != "yarn":
    return 1.0
  if "attention_factor" in p:
    return p["attention_factor"]
  scale = lambda m=1.0: 1.0 if p["factor"] <= 1 else 0.1 * m * math.log(p["factor"]) + 1.0
  if p.get("mscale") and p.get("mscale_all_dim"):
    return float(scale(p["mscale"]) / scale(p["mscale_all_dim"]))
  return scale()


def rope_frequencies(d: int, theta: float, scaling: str = "") -> np.ndarray:
  """The D/2 rotation frequencies of a head dim `d`, in float32 as transformers computes
  them (`modeling_rope_utils`: the default, then linear, llama3 or yarn scaling)."""
  kind, p = parse_rope_scaling(scaling)
  powers = np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
  freqs = 1.0 / powers
  if kind == "linear":
    return freqs / np.float32(p["factor"])
  if kind == "yarn":
    return _yarn(powers, d, theta, p)
  if kind == "llama3":  # low frequencies slowed by `factor`, high kept, a ramp between
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = np.float32(2 * math.pi) / freqs
    scaled = np.where(wavelen > old_len / low, freqs / np.float32(factor), freqs)
    smooth = (np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)
  return freqs


def rope(x_BTHD, positions_BT, theta: float, scaling: str = ""):
  """Rotary embedding (rotate-half form) at arbitrary per-token positions; `scaling`: a
  `model.rope_scaling` spec (its frequencies and YaRN's cos/sin factor are constants of
  the program)."""
  d = x_BTHD.shape[-1]
  if scaling:
    freqs = jnp.asarray(rope_frequencies(d, theta, scaling))
  else:
    freqs = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
  angles = positions_BT.astype(jnp.float32)[:, :, None, None] * freqs  # [B, T, 1, D/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  factor = rope_attention_factor(scaling) if scaling else 1.0
  if factor != 1.0:
    sin, cos = sin * np.float32(factor), cos * np.float32(factor)
  x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHD.dtype)

def _dense(x, w, n_in: int = 1, *, out_shape: tuple[int, ...] | None = None, dtype=None):
  """x [..., *in] @ w [*in, *out] as one matmul [..., K] x [K, N] (`matmul.matmul`).

  `w` is a float array (cast to `dtype`), a `QWeight` holding the 2-D [K, N] view
  (run by `qmatmul`), or any callable [M, K] -> [M, N] (a calibration tap, a qwix
  layer). The last two do not know the output dims, so `out_shape` gives them.
  """
  lead, k_shape = x.shape[:x.ndim - n_in], x.shape[x.ndim - n_in:]
  k = math.prod(k_shape)
  if isinstance(w, (jax.Array, np.ndarray)):
    n_shape = w.shape[n_in:]
    if dtype is not None:
      w = w.astype(dtype)
    y = matmul(x.reshape(*lead, k), w.reshape(k, math.prod(n_shape)))
    out_shape = n_shape if out_shape is None else out_shape
  elif _is_qweight(w):
    y = _qmatmul(x.reshape(-1, k), w)
  elif callable(w):
    y = w(x.reshape(-1, k))
  else:
    raise TypeError(f"_dense: weight of type {type(w).__name__}; valid: a jax array, a QWeight "
                    "or a callable [M, K] -> [M, N]")
  if out_shape is None:
    raise ValueError(f"_dense: out_shape is required for a weight of type {type(w).__name__}")
  return y.reshape(*lead, *out_shape)

def _quant_matmul():
  # Imported on first use: float models never load the quantized-matmul kernels.
  from jaxsys.kernels import quant_matmul
  return quant_matmul

# The qmatmul implementation quantized weights run with while a model is traced.
_QMATMUL_IMPL = contextvars.ContextVar("jaxsys_qmatmul_impl", default="auto")

@contextlib.contextmanager
def qmatmul_impl(impl: str):
  """Quantized weights traced inside the block run `qmatmul(..., impl=impl)` ("auto" outside).

  jit's cache does not see the context: a jitted caller enters it inside the traced
  function and takes `impl` as a static argument (as `generate.generate` does).
  """
  _quant_matmul().resolve_impl(impl)  # an unknown impl is refused here, not at trace time
  token = _QMATMUL_IMPL.set(impl)
  try:
    yield
  finally:
    _QMATMUL_IMPL.reset(token)

def _qmatmul(x_MK, w):
  return _quant_matmul().qmatmul(x_MK, w, impl=_QMATMUL_IMPL.get())

def _is_qweight(w) -> bool:
  return not isinstance(w, (jax.Array, np.ndarray)) and isinstance(w, _quant_matmul().QWeight)

def block(p: dict[str, jax.Array], x_BTD, positions_BT, segment_ids_BT, cfg: TransformerConfig,
          attention_fn: Callable, cache: Any = None):
  """One pre-norm decoder layer on ONE layer's parameters (no leading `layers` axis).

  `attention_fn(q, k, v, *, segment_ids, positions, causal)`: the tokens' positions go with
  them, so an injected attention (a ring over `context`) masks right in any token order;
  with `model.sliding_window` set it also takes `window=`.
  With `cache` (this layer's, e.g. a decoder's keys and values) attention_fn also takes
  `cache=` and returns (o, new cache), and block returns (x, new cache).
  """
  dt = jnp.dtype(cfg.dtype)
  H, K, hd, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.hd, cfg.d_model, cfg.d_ff
  p = _compute_layout(cfg, p)
  name = checkpoint_name  # tags for the remat policies (remat.NAMES)
  x_BTD = name(x_BTD, remat.LAYER_INPUT)
  h = rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps)
  q = _dense(h, p["wq"], out_shape=(H, hd), dtype=dt)  # [B, T, H, hd]
  k = _dense(h, p["wk"], out_shape=(K, hd), dtype=dt)
  v = _dense(h, p["wv"], out_shape=(K, hd), dtype=dt)
  if cfg.qkv_bias:
    q, k, v = (x + p[b].astype(dt) for x, b in ((q, "bq"), (k, "bk"), (v, "bv")))
  if cfg.qk_norm:
    q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
  v = name(v, "v")
  q = name(rope(q, positions_BT, cfg.rope_theta, cfg.rope_scaling), "q")
  k = name(rope(k, positions_BT, cfg.rope_theta, cfg.rope_scaling), "k")
  kw = dict(segment_ids=segment_ids_BT, positions=positions_BT, causal=True)
  if cfg.sliding_window:  # only when set: attention functions without windows keep working
    kw["window"] = cfg.sliding_window
  if cache is None:
    o = attention_fn(q, k, v, **kw)
  else:
    o, cache = attention_fn(q, k, v, cache=cache, **kw)
  o = name(o, "attention")  # the flash kernels tag their own residual copy too
  x_BTD = x_BTD + name(_dense(o, p["wo"], n_in=2, out_shape=(D,), dtype=dt), "attention_proj")
  h = rms_norm(x_BTD, p["mlp_norm"], cfg.norm_eps)
  gate = name(_dense(h, p["w_gate"], out_shape=(F,), dtype=dt), "mlp_gate")
  up = name(_dense(h, p["w_up"], out_shape=(F,), dtype=dt), "mlp_up")
  x_BTD = x_BTD + _dense(jax.nn.silu(gate) * up, p["w_down"], out_shape=(D,), dtype=dt)
  return x_BTD if cache is None else (x_BTD, cache)

def _compute_layout(cfg: TransformerConfig, p: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """One layer's matmul weights in the compute dtype, constrained whole over `fsdp` (still
  split over `tensor`): each is gathered once where the layer runs, and the backward's
  matmuls read the copy its (rerun) forward gathered. Left to the partitioner, a weight
  read as [H, hd, D] by one matmul and as [H * hd, D] by another was gathered once for each
  (wo, wk, wv at `fsdp=64`: 1 GiB more a step for Llama-3-8B than MaxText's 2 passes).
  Unchanged without a mesh or inside `shard_map` (see `shard_residual`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.manual_axes or mesh_lib.degrees(mesh).fsdp == 1:
    return p
  axes = param_axes(cfg)["layers"]
  whole = (("embed", None),) + mesh_lib.DEFAULT_RULES  # the first rule of a name wins
  out = dict(p)
  for key, w in p.items():
    if key.endswith("norm") or not isinstance(w, jax.Array):
      continue
    spec = mesh_lib.logical_to_partition_spec(axes[key][1:], mesh, whole, shape=w.shape)
    out[key] = jax.lax.with_sharding_constraint(w.astype(cfg.dtype), spec)
  return out

class DecoderLayers(nnx.Module):
  """All transformer layers, each parameter stacked on a leading `layers` axis."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    L, D, F, H, K, hd = (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.hd)
    pdt = jnp.dtype(cfg.param_dtype)
    ones = lambda key, shape, dtype: jnp.ones(shape, dtype)
    self.attn_norm = _param(rngs, ones, (L, D), ("layers", "embed"), pdt)
    self.wq = _param(rngs, _dense_init(1, (2, 3)), (L, D, H, hd),
                     ("layers", "embed", "heads", "head_dim"), pdt)
    self.wk = _param(rngs, _dense_init(1, (2, 3)), (L, D, K, hd),
                     ("layers", "embed", "kv_heads", "head_dim"), pdt)
    self.wv = _param(rngs, _dense_init(1, (2, 3)), (L, D, K, hd),
                     ("layers", "embed", "kv_heads", "head_dim"), pdt)
    self.wo = _param(rngs, _dense_init((1, 2), 3), (L, H, hd, D),
                     ("layers", "heads", "head_dim", "embed"), pdt)
    self.mlp_norm = _param(rngs, ones, (L, D), ("layers", "embed"), pdt)
    self.w_gate = _param(rngs, _dense_init(1, 2), (L, D, F), ("layers", "embed", "mlp"), pdt)
    self.w_up = _param(rngs, _dense_init(1, 2), (L, D, F), ("layers", "embed", "mlp"), pdt)
    self.w_down = _param(rngs, _dense_init(1, 2), (L, F, D), ("layers", "mlp", "embed"), pdt)
    if cfg.qkv_bias:
      zeros = lambda key, shape, dtype: jnp.zeros(shape, dtype)
      self.bq = _param(rngs, zeros, (L, H, hd), ("layers", "heads", "head_dim"), pdt)
      self.bk = _param(rngs, zeros, (L, K, hd), ("layers", "kv_heads", "head_dim"), pdt)
      self.bv = _param(rngs, zeros, (L, K, hd), ("layers", "kv_heads", "head_dim"), pdt)
    if cfg.qk_norm:
      self.q_norm = _param(rngs, ones, (L, hd), ("layers", "head_dim"), pdt)
      self.k_norm = _param(rngs, ones, (L, hd), ("layers", "head_dim"), pdt)

  def stacked(self) -> dict[str, jax.Array]:
    # get_value, not v[...]: a quantized weight is a QWeight pytree, not an array.
    return {name: v.get_value() for name, v in vars(self).items() if isinstance(v, nnx.Param)}

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, cfg: TransformerConfig,
               attention_fn: Callable):
    return apply_layers(cfg, self.stacked(), x_BTD, positions_BT, segment_ids_BT, attention_fn)

# The residual stream's sharding between layers: rows over these mesh axes, tokens over
# `context`. (`replica` is left to vmap: a replica run's layers see one replica's rows.)
RESIDUAL_AXES = ((mesh_lib.DATA, mesh_lib.FSDP), (mesh_lib.CONTEXT,), ())

def shard_residual(x_BTD):
  """`x_BTD` constrained to RESIDUAL_AXES over the mesh being traced for (its axes of size
  > 1), unchanged without a mesh or inside `shard_map` (a pipeline's stages, HDP's rings:
  there a layer may run in a branch only some devices take, and a resharding collective
  in it deadlocks). Without it the partitioner may keep a layer's weights sharded over
  `fsdp` and move activations instead, all-gathering and all-reducing [B, T, F] tensors;
  with it, FSDP gathers each layer's weights (docs/results/tpu_compile.md)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.manual_axes:
    return x_BTD
  sizes = dict(mesh.shape)
  entries = []
  for axes in RESIDUAL_AXES:
    kept = tuple(a for a in axes if sizes.get(a, 1) > 1)
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  if all(e is None for e in entries):
    return x_BTD
  return jax.lax.with_sharding_constraint(x_BTD, jax.sharding.PartitionSpec(*entries))

def apply_layers(cfg: TransformerConfig, stacked: dict[str, jax.Array], x_BTD, positions_BT,
                 segment_ids_BT, attention_fn: Callable, caches: Any = None):
  """`block` over a stack of layers (leading axis of every `stacked` leaf): all of the
  model's, or one pipeline stage's chunk of them. With `caches` (every leaf stacked on a
  leading `layers` axis) each layer gets its own and this returns (x, new caches)."""
  layer = remat.checkpointed(functools.partial(block, cfg=cfg, attention_fn=attention_fn),
                             cfg.remat, cfg.remat_offload)

  def body(x, p_and_cache):
    p, cache = p_and_cache
    x = shard_residual(x)
    if cache is None:
      return shard_residual(layer(p, x, positions_BT, segment_ids_BT)), None
    x, cache = layer(p, x, positions_BT, segment_ids_BT, cache=cache)
    return shard_residual(x), cache

  depth = jax.tree.leaves(stacked)[0].shape[0]
  # Offloading pays only in a loop: XLA:TPU keeps device copies of an unrolled stack's
  # offloaded values (v5e, 4 layers: 6.7x the device temporaries; 16 scanned: 0.51x).
  unroll = depth <= UNROLL_MAX_LAYERS and not cfg.remat_offload
  x_BTD, caches = jax.lax.scan(body, x_BTD, (stacked, caches), unroll=unroll)
  return x_BTD if caches is None else (x_BTD, caches)

class Transformer(nnx.Module):
  """Decoder-only LM: tokens [B, T] -> logits [B, T, vocab] (float32)."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdt = jnp.dtype(cfg.param_dtype)
    V, D = cfg.vocab_size, cfg.d_model
    self.embedding = _param(rngs, jax.nn.initializers.normal(1.0), (V, D), ("vocab", "embed"), pdt)
    self.layers = DecoderLayers(cfg, rngs)
    self.final_norm = _param(rngs, lambda k, s, d: jnp.ones(s, d), (D,), ("embed",), pdt)
    if not cfg.tie_embeddings:
      self.unembedding = _param(rngs, jax.nn.initializers.normal(D ** -0.5), (D, V),
                                ("embed", "vocab"), pdt)

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None,
               attention_fn: Callable | None = None):
    x_BTD = self.hidden(tokens_BT, positions_BT, segment_ids_BT, attention_fn)
    return unembed(self.cfg, x_BTD, *self._head())

  def losses(self, tokens_BT, targets_BT, positions_BT=None, segment_ids_BT=None,
             attention_fn: Callable | None = None):
    """Per-token cross-entropy [B, T] against `targets_BT` (`head_losses`)."""
    x_BTD = self.hidden(tokens_BT, positions_BT, segment_ids_BT, attention_fn)
    return head_losses(self.cfg, x_BTD, *self._head(), targets_BT)

  def hidden(self, tokens_BT, positions_BT=None, segment_ids_BT=None,
             attention_fn: Callable | None = None):
    """The last layer's output [B, T, D], before the final norm."""
    cfg = self.cfg
    positions_BT, attention_fn = default_inputs(cfg, tokens_BT, positions_BT, attention_fn)
    x_BTD = embed(cfg, self.embedding.get_value(), tokens_BT)
    return self.layers(x_BTD, positions_BT, segment_ids_BT, cfg, attention_fn)

  def _head(self):
    """(final norm, embedding, unembedding): arrays, or QWeights if quantized."""
    unembedding = None if self.cfg.tie_embeddings else self.unembedding.get_value()
    return self.final_norm[...], self.embedding.get_value(), unembedding

def default_inputs(cfg: TransformerConfig, tokens_BT, positions_BT, attention_fn):
  """Positions 0..T-1 and the configured attention kernel where the caller gives none."""
  if positions_BT is None:
    positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
  if attention_fn is None:
    attention_fn = functools.partial(local_attention, impl=cfg.attention_impl)
  return positions_BT, attention_fn

def local_attention(q, k, v, *, segment_ids=None, positions=None, causal=True, impl="auto",
                    window: int = 0):
  """The attention kernel on the tokens in their own order (positions are not needed)."""
  del positions
  return attention_lib.attention(q, k, v, segment_ids=segment_ids, causal=causal, impl=impl,
                                 window=window)

def embed(cfg: TransformerConfig, embedding_VD, tokens_BT) -> jax.Array:
  """Token embeddings [B, T, D] in the compute dtype."""
  if _is_qweight(embedding_VD):  # weight-only storage: rows are gathered, not multiplied
    embedding_VD = _quant_matmul().dequantize(embedding_VD)
  return jnp.take(embedding_VD, tokens_BT, axis=0).astype(jnp.dtype(cfg.dtype))

def _output_weight(cfg: TransformerConfig, embedding_VD, unembedding_DV):
  """The output layer's weight [D, V] in the compute dtype, or its QWeight (untied,
  quantized: run by qmatmul)."""
  if not cfg.tie_embeddings:
    return unembedding_DV if _is_qweight(unembedding_DV) else unembedding_DV.astype(cfg.dtype)
  if _is_qweight(embedding_VD):
    embedding_VD = _quant_matmul().dequantize(embedding_VD)
  # N(0, 1) embeddings: scale so tied logits start at unit variance like untied ones.
  return (embedding_VD.T * (cfg.d_model ** -0.5)).astype(cfg.dtype)

def unembed(cfg: TransformerConfig, x_BTD, final_norm_D, embedding_VD, unembedding_DV) -> jax.Array:
  """Final RMSNorm and output projection: logits [B, T, vocab] float32."""
  x_BTD = rms_norm(x_BTD, final_norm_D, cfg.norm_eps)
  w_DV = _output_weight(cfg, embedding_VD, unembedding_DV)
  if _is_qweight(w_DV):
    b, t, d = x_BTD.shape
    return _qmatmul(x_BTD.reshape(b * t, d), w_DV).astype(jnp.float32).reshape(b, t, -1)
  return matmul(x_BTD, w_DV, preferred_element_type=jnp.float32)

def head_losses(cfg: TransformerConfig, x_BTD, final_norm_D, embedding_VD, unembedding_DV,
                targets_BT) -> jax.Array:
  """Final RMSNorm, output projection and cross-entropy: per-token losses [B, T] float32,
  the logits in the compute dtype and never kept in float32 (`output_layer`), in
  `cfg.vocab_tiles` tiles of the vocabulary."""
  w_DV = _output_weight(cfg, embedding_VD, unembedding_DV)
  if _is_qweight(w_DV):  # weight-only serving formats: the logits as `unembed` makes them
    logits = unembed(cfg, x_BTD, final_norm_D, embedding_VD, unembedding_DV)
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
        logits, targets_BT[..., None], -1)[..., 0]
  h_BTD = rms_norm(x_BTD, final_norm_D, cfg.norm_eps)
  return output_layer.token_losses(h_BTD, w_DV, targets_BT, cfg.vocab_tiles)

def logical_axes(model: nnx.Module) -> dict[str, Any]:
  """Pure-dict tree of each parameter's logical axis names, matching `param_dict(model)`."""
  state = nnx.state(model, nnx.Param)
  axes = jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(axes) if hasattr(nnx, "to_pure_dict") else axes.to_pure_dict()

def _matmul_params_per_layer(cfg: TransformerConfig) -> int:
  D, F, H, K, hd = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.hd
  return D * H * hd + 2 * D * K * hd + H * hd * D + 3 * D * F  # wq, wk + wv, wo, SwiGLU

def param_count(cfg: TransformerConfig, *, include_embedding: bool = True) -> int:
  L, D, V = cfg.n_layers, cfg.d_model, cfg.vocab_size
  n = L * (2 * D + _matmul_params_per_layer(cfg)) + D + (0 if cfg.tie_embeddings else D * V)
  return n + (V * D if include_embedding else 0)

def train_flops_per_token(cfg: TransformerConfig, seq_len: int, *,
                          pairs_per_row: float | None = None) -> float:
  """Matmul FLOPs of one training token (forward + backward = 3x forward).

  Counts every matmul weight once (the embedding lookup is not a matmul, the output
  projection is) plus attention's QK^T and PV over `pairs_per_row` (query, key) pairs
  per row, by default the full [T, T] square (PaLM's convention); pass
  `flops.attention_pairs(...) / batch` to count only the pairs the mask leaves.
  """
  pairs = seq_len * seq_len if pairs_per_row is None else pairs_per_row
  matmul_params = cfg.n_layers * _matmul_params_per_layer(cfg) + cfg.d_model * cfg.vocab_size
  attention = cfg.n_layers * flops_lib.attention_flops(pairs, cfg.n_heads, cfg.hd) / seq_len
  return 6.0 * matmul_params + 3.0 * attention

# Pure-function view of the model, used by the trainer and parallel strategies:
# parameters are a plain nested dict of arrays, the NNX graph is rebuilt per trace.

@functools.lru_cache(maxsize=None)
def _abstract_model(cfg: TransformerConfig):
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))

def init_params(cfg: TransformerConfig, key: jax.Array) -> dict[str, Any]:
  """Fresh parameters as a nested dict of arrays (jit it with out_shardings to init sharded)."""
  return nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=key)), nnx.Param).to_pure_dict()

def param_axes(cfg: TransformerConfig) -> dict[str, Any]:
  """Logical axis names of every parameter, a dict matching `init_params`."""
  return logical_axes(_abstract_model(cfg))

def apply(cfg: TransformerConfig, params: dict[str, Any], tokens_BT, positions_BT=None,
          segment_ids_BT=None, attention_fn: Callable | None = None) -> jax.Array:
  """Logits [B, T, vocab] float32 from a parameter dict; see `Transformer.__call__`."""
  return _model(cfg, params)(tokens_BT, positions_BT, segment_ids_BT, attention_fn)

def losses(cfg: TransformerConfig, params: dict[str, Any], tokens_BT, targets_BT,
           positions_BT=None, segment_ids_BT=None, attention_fn: Callable | None = None
           ) -> jax.Array:
  """Per-token cross-entropy [B, T] float32 from a parameter dict; see `head_losses`."""
  return _model(cfg, params).losses(tokens_BT, targets_BT, positions_BT, segment_ids_BT,
                                    attention_fn)

def compute_view(cfg: TransformerConfig, params: dict[str, Any]) -> dict[str, Any]:
  """The parameters as the model computes with them: every matmul weight in the compute
  dtype; the norm scales and the embedding as they are (its rows are cast after the lookup,
  and the lookup's gradient is summed in the parameter's dtype). The model computes the
  same function, and the same gradients, of either."""
  keep = {"attn_norm", "mlp_norm", "final_norm", "embedding"}
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x if path[-1].key in keep else x.astype(cfg.dtype), params)

def _model(cfg: TransformerConfig, params: dict[str, Any]) -> "Transformer":
  return nnx.merge(nnx.graphdef(_abstract_model(cfg)), params)
