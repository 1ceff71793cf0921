"""Hugging Face Llama checkpoints in and out: config.json + safetensors <-> model config + params.

Llama 2 and 3.x (`llama3` rope scaling; `linear` and `yarn`, Qwen2.5's long context, too),
Mistral (`sliding_window`: model.sliding_window, the attention kernels' window), Qwen2/2.5
(q/k/v biases) and Qwen3 (q/k norms; either with `use_sliding_window` when every layer
slides) are one block here (`ARCHITECTURES`). `load` reads such a directory (`config.json`,
`model.safetensors` or sharded `model-0000x-of-0000y.safetensors` with
`model.safetensors.index.json`) into `jaxsys.models.transformer`'s parameters. Each tensor
file is memory-mapped and every device's block of every parameter is read straight from it
into its sharding (`jax.make_array_from_callback`), so a sharded target never holds a full
host copy.
`save` writes a model (float, or quantized: its QWeights are dequantized) as a checkpoint
`transformers.AutoModelForCausalLM.from_pretrained` loads unchanged, with its tokenizer.

The weight layouts agree without permuting q/k: HF Llama checkpoints hold q_proj/k_proj in
the rotate-half RoPE order (split halves), the order `transformer.rope` uses.

Tied embeddings: jaxsys's tied output layer is `embedding.T * d_model**-0.5` (so N(0, 1)
embeddings start at unit-variance logits), HF's is `embed_tokens.T`. No one tied matrix is
both, so a tied HF checkpoint imports as an untied model (`unembedding` = the embedding's
transpose, exact logits) and a tied jaxsys model exports untied (`lm_head` = the scaled
embedding).

Example::

  cfg, params = hf.load("/ckpt/SmolLM-135M", mesh=mesh_lib.make_mesh("fsdp=8"))
  hf.save("/tmp/export", cfg, params, tokenizer=tok)
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import logging
from jax.sharding import Mesh, SingleDeviceSharding

from jaxsys import mesh as mesh_lib
from jaxsys.models import transformer

PREFIX = "hf:"  # init_from=hf:<dir>, data.tokenizer=hf:<dir>
# Llama's block with what each adds: Mistral a sliding window where `sliding_window` is set
# (7B v0.1: 4096; v0.2 and v0.3: null); Qwen2 (and 2.5) q/k/v biases; Qwen3 q/k norms.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
MODEL_TYPES = tuple(ARCHITECTURES.values())
# Fields of the model config the checkpoint decides; the run keeps dtype, param_dtype,
# attention_impl, remat and vocab_tiles.
ARCH_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
               "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings", "qkv_bias", "qk_norm",
               "sliding_window")
# The model types whose transformers classes read `sliding_window` (Qwen's only with
# use_sliding_window, on the layers its layer_types call sliding_attention).
_WINDOWED = ("mistral", "qwen2", "qwen3")
# What jaxsys's block lacks for the architectures people ask for most.
_GEMMA = "(1 + w) RMSNorm, scaled embeddings and GeGLU differ from Llama's block"
_MOE = "a mixture of experts: jaxsys.models.transformer has no expert layers"
_WHY_NOT = {
    "GemmaForCausalLM": f"Gemma's {_GEMMA}",
    "Gemma2ForCausalLM": f"Gemma 2's {_GEMMA}; it also soft-caps its logits and alternates "
                         "local (sliding-window) and global attention",
    "Gemma3ForCausalLM": f"Gemma 3's {_GEMMA}; it also alternates local (sliding-window) and "
                         "global attention with q/k norms",
    "MixtralForCausalLM": _MOE,
    "Qwen2MoeForCausalLM": _MOE,
    "Qwen3MoeForCausalLM": _MOE,
    "Phi3ForCausalLM": "its fused qkv_proj and gate_up_proj tensors are not mapped",
}

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}


def parse_spec(value: str) -> str | None:
  """'hf:<dir>' -> '<dir>'; anything else -> None."""
  return value[len(PREFIX):] if isinstance(value, str) and value.startswith(PREFIX) else None


# ----------------------------------------------------------------------------- config.json


def read_config(directory: str) -> dict[str, Any]:
  """The checkpoint's config.json as a dict, or a one-line error naming the file."""
  path = os.path.join(directory, "config.json")
  if not os.path.isdir(directory):
    raise ValueError(f"hf checkpoint {directory!r} is not a directory; it must hold config.json "
                     "and model.safetensors (or its shards and index)")
  if not os.path.isfile(path):
    raise ValueError(f"{path} is missing; an hf checkpoint directory holds config.json and "
                     "model.safetensors (or its shards and index)")
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None


def _rope(hf: dict[str, Any], where: str) -> tuple[float, str]:
  """(rope_theta, model.rope_scaling) of transformers 4's rope_scaling + rope_theta or 5's
  rope_parameters; a frequency scaling jaxsys does not compute is refused in one line."""
  params = hf.get("rope_parameters") or {}
  spec = ""
  for field, d in (("rope_parameters", params), ("rope_scaling", hf.get("rope_scaling") or {})):
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in (None, "default"):
      continue
    d = _rope_defaults(hf, kind, d)
    keys = transformer.ROPE_SCALING_KEYS.get(kind)
    if keys is None or any(d.get(k) is None for k in keys):
      why = transformer.ROPE_NOT_COMPUTED.get(kind)
      raise ValueError(f"{where} {field}.rope_type={kind!r} is not supported"
                       + (f" ({why})" if why else "") + "; valid: 'default', "
                       + ", ".join(f"{k!r} (with {', '.join(v)})"
                                   for k, v in transformer.ROPE_SCALING_KEYS.items()))
    keys += tuple(k for k in transformer.ROPE_SCALING_OPTIONAL.get(kind, ())
                  if d.get(k) is not None)
    spec = f"{kind}:" + ",".join(f"{k}={_number(d[k])}" for k in keys)
    try:
      transformer.parse_rope_scaling(spec)
    except ValueError as e:
      raise ValueError(f"{where} {field}: {e}") from None
  factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if factor != 1.0:
    raise ValueError(f"{where} partial_rotary_factor={factor!r} is not supported; valid: 1.0 "
                     "(rope rotates every head dim)")
  return float(params.get("rope_theta", hf.get("rope_theta", 10_000.0))), spec


def _rope_defaults(hf: dict[str, Any], kind: str, d: dict[str, Any]) -> dict[str, Any]:
  """The values transformers fills in: llama3's and yarn's original context from the config
  (top-level original_max_position_embeddings, else max_position_embeddings), yarn's factor
  from max_position_embeddings / that when null (DeepSeek's way)."""
  d = dict(d)
  if kind in ("llama3", "yarn") and d.get("original_max_position_embeddings") is None:
    d["original_max_position_embeddings"] = hf.get("original_max_position_embeddings",
                                                   hf.get("max_position_embeddings"))
  old = d.get("original_max_position_embeddings")
  if kind == "yarn" and d.get("factor") is None and old and hf.get("max_position_embeddings"):
    d["factor"] = hf["max_position_embeddings"] / old
  if kind == "yarn":  # transformers reads `beta_fast or 32`: a 0 is the default too
    d = {k: v for k, v in d.items() if not (k in ("beta_fast", "beta_slow") and not v)}
  return d


def _number(value) -> str:
  """A config.json number as model.rope_scaling writes it (8192, not 8192.0)."""
  return str(int(value)) if float(value).is_integer() else repr(float(value))


def _window(hf: dict[str, Any], model_type: str, where: str) -> int | None:
  """The attention window transformers applies to every layer (None: none), or a one-line
  error naming the field when it is malformed or differs between layers."""
  window = hf.get("sliding_window")
  n = int(hf.get("num_hidden_layers") or 0)
  if model_type.startswith("qwen"):  # the window only with use_sliding_window, from layer
    # max_window_layers on, as transformers' Qwen2Config/Qwen3Config compute layer_types
    if not hf.get("use_sliding_window", False):
      window = None
    first = int(hf.get("max_window_layers", 28)) if window is not None else n  # their default
    default = ["full_attention"] * min(first, n) + ["sliding_attention"] * max(n - first, 0)
  else:
    default = ["full_attention" if window is None else "sliding_attention"] * n
  kinds = set(hf.get("layer_types") or default)
  if not model_type.startswith("qwen"):  # their classes window every layer whatever it says
    kinds |= set(default)
  if len(kinds) > 1:
    raise ValueError(f"{where} layer_types={sorted(kinds)!r} (max_window_layers="
                     f"{hf.get('max_window_layers')!r}) is not supported; valid: every layer "
                     "full_attention, or every layer sliding_attention with sliding_window set "
                     "(jaxsys's layers share one attention)")
  if kinds != {"sliding_attention"}:
    if kinds - {"full_attention"}:
      raise ValueError(f"{where} layer_types={sorted(kinds)!r} is not supported; valid: "
                       "full_attention, or sliding_attention with sliding_window set")
    return None
  if model_type not in _WINDOWED:
    raise ValueError(f"{where} sliding_window={window!r} is not supported for model_type "
                     f"{model_type!r}; valid: null (a window is read for "
                     f"{', '.join(_WINDOWED)})")
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise ValueError(f"{where} sliding_window={window!r} is not supported; valid: null or an "
                     "int >= 1 (the keys each token attends to, itself included)")
  return window


def model_fields(directory: str) -> dict[str, Any]:
  """The model config fields (`ARCH_FIELDS`) a checkpoint's config.json gives, or a one-line
  error naming the field that jaxsys's model cannot run."""
  hf = read_config(directory)
  where = os.path.join(directory, "config.json")
  archs = hf.get("architectures") or []
  if archs and not set(archs) <= set(ARCHITECTURES):
    bad = next(a for a in archs if a not in ARCHITECTURES)
    why = _WHY_NOT.get(bad, "not a Llama-architecture model")
    raise ValueError(f"{where} architectures={archs!r} is not supported ({why}); valid: "
                     f"{', '.join(ARCHITECTURES)}")
  model_type = ARCHITECTURES[archs[0]] if archs else hf.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"{where} model_type={hf.get('model_type')!r} (and no architectures) is not "
                     f"supported; valid: {', '.join(map(repr, MODEL_TYPES))}")
  window = _window(hf, model_type, where)
  checks = (("hidden_act", hf.get("hidden_act"), "silu", "SwiGLU"),
            ("attention_bias", hf.get("attention_bias"), False,
             "q/k/v biases only as Qwen2's, no o_proj bias"),
            ("mlp_bias", hf.get("mlp_bias"), False, "no MLP biases"),
            ("quantization_config", hf.get("quantization_config"), None, "float weights"))
  for field, value, ok, why in checks:
    if value is not None and value != ok:
      raise ValueError(f"{where} {field}={hf[field]!r} is not supported; valid: {ok!r} "
                       f"(jaxsys.models.transformer's attention and MLP: {why})")

  def need(field):
    if field not in hf:
      raise ValueError(f"{where} has no {field!r}; a Llama config.json must set it")
    return hf[field]

  d, heads = int(need("hidden_size")), int(need("num_attention_heads"))
  head_dim = int(hf.get("head_dim") or d // heads)
  theta, scaling = _rope(hf, where)
  return dict(
      vocab_size=int(need("vocab_size")), d_model=d, n_layers=int(need("num_hidden_layers")),
      n_heads=heads, n_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=None if head_dim * heads == d else head_dim,
      d_ff=int(need("intermediate_size")), rope_theta=theta, rope_scaling=scaling,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
      sliding_window=window or 0,
      tie_embeddings=False)  # a tied checkpoint imports untied: see the module docstring


def run_values(values: dict[str, Any]) -> dict[str, Any]:
  """A run's flat config values ({'model.d_model': 64, ...}) as `init_from='hf:<dir>'` makes
  them: the checkpoint's architecture fields (`ARCH_FIELDS`) replace the run's, its
  tokenizer.json becomes data.tokenizer (unless that already names an 'hf:' tokenizer), and
  an hf tokenizer sets data.vocab_size. The replaced values are logged."""
  from jaxsys.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  new = dict(values)
  directory = parse_spec(values.get("init_from", ""))
  if directory is not None:
    new.update({f"model.{k}": v for k, v in model_fields(directory).items()})
    if parse_spec(values["data.tokenizer"]) is None:
      new["data.tokenizer"] = PREFIX + directory
  tokenizer_dir = parse_spec(new["data.tokenizer"])
  if tokenizer_dir is not None:
    new["data.vocab_size"] = tokenizer_lib.HFTokenizer.load(tokenizer_dir).vocab_size
  changed = [f"{k}={new[k]!r} (config: {values[k]!r})" for k in new if new[k] != values[k]]
  if changed:
    logging.info("from the Hugging Face checkpoint: %s", ", ".join(changed))
  return new


def tied(directory: str) -> bool:
  """Whether the checkpoint ties its output layer to its embedding (no lm_head tensor)."""
  return bool(read_config(directory).get("tie_word_embeddings", False))


def model_config(directory: str, base: transformer.TransformerConfig | None = None
                 ) -> transformer.TransformerConfig:
  """The checkpoint's model config; dtype, param_dtype, attention_impl, remat and vocab_tiles
  from `base`."""
  fields = model_fields(directory)
  if base is None:
    return transformer.TransformerConfig(**fields)
  return dataclasses.replace(base, **fields)


# ----------------------------------------------------------------------------- tensors


class _Tensors:
  """Every tensor of a checkpoint by name, each a read-only memory map of its file."""

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index):
      with open(index) as f:
        self.file_of = dict(json.load(f)["weight_map"])
    elif os.path.isfile(single):
      self.file_of = {name: "model.safetensors" for name in self._header(single)}
    else:
      raise ValueError(f"{directory} has no model.safetensors nor model.safetensors.index.json; "
                       "save the model with safe_serialization (pytorch_model.bin is not read)")
    self._headers: dict[str, dict] = {}

  @staticmethod
  def _header(path: str) -> dict[str, Any]:
    """The safetensors header of `path`, each tensor's data checked to lie in the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
      if n is None or 8 + n > size:
        raise ValueError(f"{path}: not a safetensors file (its {size} bytes hold no header "
                         "it announces); the file is truncated or not safetensors: save it again")
      try:
        header = json.loads(f.read(n))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: its safetensors header is not valid JSON ({e}); the file is "
                         "corrupt: save it again") from None
    header.pop("__metadata__", None)
    for name, info in header.items():
      end = 8 + n + info["data_offsets"][1]
      if end > size:
        raise ValueError(f"{path}: tensor {name!r} ends at byte {end}, past the file's {size} "
                         "bytes; the file is truncated: copy or save it again")
    return {k: dict(v, base=8 + n) for k, v in header.items()}

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor `name` (memory-mapped: nothing read until sliced), checked to be `shape`."""
    if name not in self.file_of:
      raise ValueError(f"{self.directory} has no tensor {name!r}; its config.json says the "
                       "model has it")
    fname = self.file_of[name]
    path = os.path.join(self.directory, fname)
    if fname not in self._headers:
      if not os.path.isfile(path):
        raise ValueError(f"{path} is missing; model.safetensors.index.json maps {name!r} to it")
      self._headers[fname] = self._header(path)
    info = self._headers[fname].get(name)
    if info is None:
      raise ValueError(f"{path} has no tensor {name!r}, though model.safetensors.index.json "
                       "maps it there; the index does not match the shards: save it again")
    if tuple(info["shape"]) != tuple(shape):
      raise ValueError(f"{path}: tensor {name!r} has shape {tuple(info['shape'])} but "
                       f"config.json gives {tuple(shape)}")
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}; valid: "
                       f"{', '.join(_DTYPES)}")
    begin, _ = info["data_offsets"]
    return np.memmap(path, dtype=_DTYPES[info["dtype"]], mode="r", offset=info["base"] + begin,
                     shape=tuple(shape))


@dataclasses.dataclass(frozen=True)
class _Map:
  """A jaxsys parameter (one layer's, for stacked ones) as an HF tensor viewed as `view`
  and transposed by `perm`: jaxsys[i0, i1, ...] = hf.reshape(view)[...].transpose(perm)."""
  name: str  # HF tensor name; {l} is the layer
  view: tuple[int, ...]
  perm: tuple[int, ...]
  hf_shape: tuple[int, int] | tuple[int]


def _maps(cfg: transformer.TransformerConfig, tied_hf: bool) -> dict[str, Any]:
  D, F, H, K, hd, V = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.hd, cfg.vocab_size
  layer = "model.layers.{l}."
  out = {
      "embedding": _Map("model.embed_tokens.weight", (V, D), (0, 1), (V, D)),
      "final_norm": _Map("model.norm.weight", (D,), (0,), (D,)),
      "layers": {
          "attn_norm": _Map(layer + "input_layernorm.weight", (D,), (0,), (D,)),
          "mlp_norm": _Map(layer + "post_attention_layernorm.weight", (D,), (0,), (D,)),
          "wq": _Map(layer + "self_attn.q_proj.weight", (H, hd, D), (2, 0, 1), (H * hd, D)),
          "wk": _Map(layer + "self_attn.k_proj.weight", (K, hd, D), (2, 0, 1), (K * hd, D)),
          "wv": _Map(layer + "self_attn.v_proj.weight", (K, hd, D), (2, 0, 1), (K * hd, D)),
          "wo": _Map(layer + "self_attn.o_proj.weight", (D, H, hd), (1, 2, 0), (D, H * hd)),
          "w_gate": _Map(layer + "mlp.gate_proj.weight", (F, D), (1, 0), (F, D)),
          "w_up": _Map(layer + "mlp.up_proj.weight", (F, D), (1, 0), (F, D)),
          "w_down": _Map(layer + "mlp.down_proj.weight", (D, F), (1, 0), (D, F)),
      },
  }
  if cfg.qkv_bias:
    for key, proj, n in (("bq", "q", H), ("bk", "k", K), ("bv", "v", K)):
      out["layers"][key] = _Map(layer + f"self_attn.{proj}_proj.bias", (n, hd), (0, 1), (n * hd,))
  if cfg.qk_norm:
    for key in ("q_norm", "k_norm"):
      out["layers"][key] = _Map(layer + f"self_attn.{key}.weight", (hd,), (0,), (hd,))
  if not cfg.tie_embeddings:
    out["unembedding"] = _Map("model.embed_tokens.weight" if tied_hf else "lm_head.weight",
                              (V, D), (1, 0), (V, D))
  return out


def _block(tensors: _Tensors, m: _Map, layer: int | None, index: tuple[slice, ...], dtype):
  """The block `index` of one layer's (or an unstacked) jaxsys parameter, read from `m`."""
  name = m.name.format(l=layer) if layer is not None else m.name
  view = tensors.get(name, m.hf_shape).reshape(m.view)
  view_index = [slice(None)] * len(m.view)
  for i, s in enumerate(index):  # jaxsys dim i is view dim perm[i]
    view_index[m.perm[i]] = s
  return np.asarray(view[tuple(view_index)], dtype=dtype).transpose(m.perm)


def _reader(tensors: _Tensors, m: _Map, shape, dtype, stacked: bool):
  def read(index):
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
    if not stacked:
      return np.ascontiguousarray(_block(tensors, m, None, index, dtype))
    layers = range(*index[0].indices(shape[0]))
    return np.ascontiguousarray(np.stack([_block(tensors, m, l, index[1:], dtype)
                                          for l in layers]))
  return read


def _target_shardings(cfg, abstract, mesh: Mesh | None, shardings):
  if shardings is not None:
    return shardings
  if mesh is not None:
    return mesh_lib.logical_to_sharding(transformer.param_axes(cfg), mesh, shapes=abstract)
  return jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)


def load(directory: str, cfg: transformer.TransformerConfig | None = None, *,
         mesh: Mesh | None = None, shardings: Any = None
         ) -> tuple[transformer.TransformerConfig, dict[str, Any]]:
  """(model config, params) of the HF checkpoint in `directory`.

  `cfg` None: the checkpoint's config (float32); else its architecture fields must equal the
  checkpoint's (one-line error naming the first that differs) and its dtypes are used.
  Params land in `shardings` (a tree matching the params), or sharded over `mesh` by the
  logical rules, or on the first device; each device reads only its own block.
  """
  got = model_config(directory, cfg)
  if cfg is not None and got != cfg:
    field = next(f for f in ARCH_FIELDS if getattr(got, f) != getattr(cfg, f))
    raise ValueError(f"{os.path.join(directory, 'config.json')} gives model.{field}="
                     f"{getattr(got, field)!r} but the run has model.{field}="
                     f"{getattr(cfg, field)!r}; start from the checkpoint's model config")
  cfg = got
  abstract = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  target = _target_shardings(cfg, abstract, mesh, shardings)
  tensors = _Tensors(directory)
  maps = _maps(cfg, tied(directory))
  dtype = jnp.dtype(cfg.param_dtype)

  def place(path, m, a, sh):
    stacked = path[0].key == "layers"
    return jax.make_array_from_callback(a.shape, sh, _reader(tensors, m, a.shape, dtype, stacked))

  params = jax.tree_util.tree_map_with_path(place, maps, abstract, target,
                                            is_leaf=lambda x: isinstance(x, _Map))
  return cfg, params


# ----------------------------------------------------------------------------- export


def _host(x, shape) -> np.ndarray:
  """A parameter on the host in its float shape (a QWeight dequantized)."""
  from jaxsys.kernels import quant_matmul  # pylint: disable=import-outside-toplevel
  if isinstance(x, quant_matmul.QWeight):
    x = quant_matmul.dequantize(x)
  return np.asarray(jax.device_get(x)).reshape(shape)


def hf_tensors(cfg: transformer.TransformerConfig, params: dict[str, Any],
               dtype: str | None = None) -> dict[str, np.ndarray]:
  """{HF tensor name: array} of `params` (float, or with QWeights) in `dtype` (default the
  model's param_dtype)."""
  dt = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
  abstract = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  out = {}

  def put(name, m, layer_value):
    # layer_value: jaxsys [*jaxsys dims] -> HF: transpose by the inverse perm, then reshape.
    out[name] = np.ascontiguousarray(
        layer_value.transpose(np.argsort(m.perm)).reshape(m.hf_shape).astype(dt))

  maps = _maps(cfg, tied_hf=False)
  for key in ("embedding", "final_norm"):
    put(maps[key].name, maps[key], _host(params[key], abstract[key].shape))
  if cfg.tie_embeddings:  # HF's tied head has no d_model**-0.5: export it untied, scaled
    emb = _host(params["embedding"], abstract["embedding"].shape).astype(np.float32)
    out["lm_head.weight"] = np.ascontiguousarray((emb * cfg.d_model ** -0.5).astype(dt))
  else:
    put("lm_head.weight", maps["unembedding"],
        _host(params["unembedding"], abstract["unembedding"].shape))
  for key, m in maps["layers"].items():
    value = _host(params["layers"][key], abstract["layers"][key].shape)
    for l in range(cfg.n_layers):
      put(m.name.format(l=l), m, value[l])
  return out


def hf_config(cfg: transformer.TransformerConfig, *, dtype: str | None = None,
              bos_token_id: int | None = None, eos_token_id: int | None = None,
              max_position_embeddings: int = 4096) -> dict[str, Any]:
  """config.json of `cfg` for `LlamaForCausalLM`, or `Qwen2ForCausalLM` with q/k/v biases,
  `Qwen3ForCausalLM` with q/k norms, else `MistralForCausalLM` with a sliding window (a Qwen
  with one slides on every layer: max_window_layers 0); transformers 4 and 5 read it."""
  if cfg.qkv_bias and cfg.qk_norm:
    raise ValueError("model.qkv_bias=True with model.qk_norm=True has no transformers class to "
                     "export to; valid: at most one of them (Qwen2: qkv_bias, Qwen3: qk_norm)")
  arch = ("Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM" if cfg.qkv_bias
          else "MistralForCausalLM" if cfg.sliding_window else "LlamaForCausalLM")
  window = {}
  if cfg.sliding_window:
    window = {"sliding_window": cfg.sliding_window}
    if arch.startswith("Qwen"):
      window.update(use_sliding_window=True, max_window_layers=0)
  theta = float(cfg.rope_theta)
  kind, scaling = transformer.parse_rope_scaling(cfg.rope_scaling)
  as_type = {"original_max_position_embeddings": int, "truncate": bool}
  scaling = {k: as_type.get(k, float)(v) for k, v in scaling.items()}
  return {
      "architectures": [arch], "model_type": ARCHITECTURES[arch],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.hd, "hidden_act": "silu", "rms_norm_eps": float(cfg.norm_eps),
      "rope_theta": theta,
      "rope_scaling": {"rope_type": kind, **scaling} if scaling else None,
      "rope_parameters": {"rope_type": kind, "rope_theta": theta, **scaling},
      "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
      "max_position_embeddings": int(max_position_embeddings),
      "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
      "torch_dtype": str(jnp.dtype(dtype or cfg.param_dtype)), **window,
  }


def save(directory: str, cfg: transformer.TransformerConfig, params: dict[str, Any],
         tokenizer=None, *, dtype: str | None = None, max_shard_bytes: int | None = None,
         max_position_embeddings: int = 4096) -> list[str]:
  """Writes `params` as an HF Llama checkpoint; returns the files written.

  `tokenizer`: a jaxsys tokenizer (byte, bpe or hf) or a `tokenizers.Tokenizer`, written as
  tokenizer.json (+ tokenizer_config.json). `max_shard_bytes` splits the weights into
  model-0000x-of-0000y.safetensors files with their index.
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  tensors = hf_tensors(cfg, params, dtype)
  shards: list[dict[str, np.ndarray]] = [{}]
  for name, value in tensors.items():
    size = sum(v.nbytes for v in shards[-1].values())
    if max_shard_bytes and shards[-1] and size + value.nbytes > max_shard_bytes:
      shards.append({})
    shards[-1][name] = value
  written = []
  if len(shards) == 1:
    names = ["model.safetensors"]
  else:
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
             "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
    written.append(_write_json(directory, "model.safetensors.index.json", index))
  for name, shard in zip(names, shards):
    save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
    written.append(os.path.join(directory, name))
  special = _special_ids(tokenizer)
  written.append(_write_json(directory, "config.json", hf_config(
      cfg, dtype=dtype, max_position_embeddings=max_position_embeddings, **special)))
  if tokenizer is not None:
    written += _save_tokenizer(directory, tokenizer)
  return written


def _write_json(directory: str, name: str, obj) -> str:
  path = os.path.join(directory, name)
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)
  return path


def _special_ids(tokenizer) -> dict[str, int | None]:
  out = {"bos_token_id": None, "eos_token_id": None}
  for key in ("bos", "eos"):
    token = getattr(tokenizer, f"{key}_token", None)
    tok = _hf_tokenizer(tokenizer) if tokenizer is not None else None
    if token is not None and tok is not None:
      out[f"{key}_token_id"] = tok.token_to_id(token)
  return out


def _hf_tokenizer(tokenizer):
  import tokenizers  # pylint: disable=import-outside-toplevel
  if isinstance(tokenizer, tokenizers.Tokenizer):
    return tokenizer
  return tokenizer.hf_tokenizer


def _save_tokenizer(directory: str, tokenizer) -> list[str]:
  tok = _hf_tokenizer(tokenizer)
  path = os.path.join(directory, "tokenizer.json")
  tok.save(path)
  source = getattr(tokenizer, "directory", None)
  config = os.path.join(source, "tokenizer_config.json") if source else None
  if config and os.path.isfile(config) and os.path.abspath(source) != os.path.abspath(directory):
    shutil.copyfile(config, os.path.join(directory, "tokenizer_config.json"))
    return [path, os.path.join(directory, "tokenizer_config.json")]
  special = {f"{k}_token": getattr(tokenizer, f"{k}_token", None) for k in ("bos", "eos")}
  return [path, _write_json(directory, "tokenizer_config.json", {
      "tokenizer_class": "PreTrainedTokenizerFast",
      **{k: v for k, v in special.items() if v is not None}})]
