"""Decoding with a KV cache: prefill a batch of prompts, then one token a step in a jitted loop.

The cache holds each layer's keys and values, `[B, max_len, kv_heads, head_dim]` a layer,
written at each token's position: slot p of row b is the key of row b's token at position
p. Prompts of different lengths sit right-aligned or left-aligned in one [B, T] array
(`lengths` says how many tokens each row has; left-padded rows are moved to the left
first), so row b's prompt is at positions 0..L_b-1 and its n-th new token at L_b + n - 1.
The prefill runs the whole prompt block through `transformer.block` as `apply` does
(causal attention on the prompt itself) and fills slots 0..T-1; each decode step feeds
one token per row and attends over the slots up to that row's position (later slots hold
a right-padded prompt's padding, or nothing yet, and are masked). The model's layers,
quantized weights (any `quant` format, with the qmatmul `impl` asked for) and attention
kernel are the training model's own: `block` takes the cache through its attention
function.

The layers run one by one on weights and caches that are arrays of their own, sliced out of
the stacked `[layers, ...]` parameters once before the loop: a `scan` over the stack (as
training runs it) makes XLA:CPU copy every layer's weights out of the stack at every step,
39% of a 125M model's decode time, and rebuild the stacked cache (docs/results/generation.md).

Example:
  prompts, lengths = pad_prompts([tok.encode("def f("), tok.encode("import")])
  out = generate(cfg, params, prompts, lengths, jax.random.key(0), max_new_tokens=32,
                 sampling=Sampling(temperature=0.8, top_p=0.95), eos_id=None)
  out.tokens  # [B, 32] int32; out.lengths: tokens up to and including EOS
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsys import mesh as mesh_lib
from jaxsys.kernels import attention as attention_lib
from jaxsys.kernels import sharded
from jaxsys.kernels.backends import IMPLS
from jaxsys.kernels.qweight import QWeight
from jaxsys.models import transformer

PADDINGS = ("right", "left")
CACHE_AXES = ("batch", None, "kv_heads", "head_dim")  # logical axes of a layer's cache


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is drawn: temperature 0 is greedy (argmax); top_k 0 and top_p 1 are off."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    t, k, p = self.temperature, self.top_k, self.top_p
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
      raise ValueError(f"sampling: temperature={t!r} must be a number >= 0 (0: greedy)")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
      raise ValueError(f"sampling: top_k={k!r} must be an int >= 0 (0: off)")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
      raise ValueError(f"sampling: top_p={p!r} must be a number in (0, 1] (1: off)")


class KVCache(NamedTuple):
  """One layer's cache."""
  k: jax.Array  # [B, max_len, kv_heads, head_dim] in the compute dtype
  v: jax.Array


class Generation(NamedTuple):
  tokens: jax.Array   # [B, max_new_tokens] int32; after a row's EOS: eos_id again
  lengths: jax.Array  # [B] int32: new tokens up to and including the first EOS
  logits: jax.Array | None  # [B, max_new_tokens, vocab] f32 of each step (return_logits)


def init_cache(cfg: transformer.TransformerConfig, batch: int, max_len: int) -> list[KVCache]:
  """An empty cache for each layer."""
  zeros = jnp.zeros((batch, max_len, cfg.n_kv_heads, cfg.hd), jnp.dtype(cfg.dtype))
  return [KVCache(zeros, zeros) for _ in range(cfg.n_layers)]


def unstack_layers(cfg: transformer.TransformerConfig, stacked: dict[str, Any]) -> list[dict]:
  """The stacked layer parameters as one dict of arrays a layer (a QWeight sliced whole)."""
  return [jax.tree.map(lambda a: a[i], stacked) for i in range(cfg.n_layers)]


def pad_prompts(prompts: Sequence[Sequence[int]], padding: str = "right", pad_id: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
  """Token lists -> (int32 [B, longest] padded with pad_id, int32 lengths [B])."""
  _check_choice("padding", padding, PADDINGS)
  lengths = np.array([len(p) for p in prompts], np.int32)
  if not len(prompts) or lengths.min() < 1:
    raise ValueError("generate: every prompt needs at least one token; got lengths "
                     f"{lengths.tolist()}")
  out = np.full((len(prompts), lengths.max()), pad_id, np.int32)
  for row, (p, n) in enumerate(zip(prompts, lengths)):
    if padding == "right":
      out[row, :n] = p
    else:
      out[row, out.shape[1] - n:] = p
  return out, lengths


# ----------------------------------------------------------------------------- the model


def _write(cache_BSKD, positions_BT, new_BTKD):
  """Each row's new keys (or values) into its slots `positions` (a scatter per row)."""
  return jax.vmap(lambda c, p, x: c.at[p].set(x, mode="drop"))(cache_BSKD, positions_BT, new_BTKD)


def cached_attention(q, k, v, *, segment_ids, positions, causal, cache, impl: str = "auto",
                     window: int = 0):
  """`block`'s attention with this layer's cache (k [B, S, K, hd], v): writes the new keys
  at their positions, then attends. Several tokens a row (the prefill, from an empty
  cache) attend causally among themselves, as in `apply`; one token a row attends over
  the cache's slots up to its position (a key-validity mask as segment ids), with dense
  attention whatever `impl` says: one query row leaves a blockwise or flash kernel nothing
  to tile, and its scores are one row per head (dense was 18-24% faster at batch 16).
  window > 0 (`model.sliding_window`): a token sees only the slots within `window` of it."""
  del segment_ids, causal
  k_cache, v_cache = _write(cache[0], positions, k), _write(cache[1], positions, v)
  if q.shape[1] > 1:
    o = attention_lib.attention(q, k, v, causal=True, impl=impl, window=window)
  else:
    slots = jnp.arange(k_cache.shape[1])
    seen = slots[None, :] <= positions  # [B, S]: True = may attend
    if window:
      seen &= slots[None, :] > positions - window
    kv_seg = seen.astype(jnp.int32)
    q_seg = jnp.ones(positions.shape, jnp.int32)
    o = attention_lib.attention(q, k_cache, v_cache, segment_ids=(q_seg, kv_seg), causal=False,
                                impl="reference")
  return o, (k_cache, v_cache)


def forward(cfg: transformer.TransformerConfig, params: dict[str, Any], layers: Sequence[dict],
            tokens_BT, positions_BT, caches: Sequence[KVCache], last_BT=None
            ) -> tuple[jax.Array, list[KVCache]]:
  """Logits f32 [B, T', vocab] and the updated caches for tokens at `positions` (see module doc).

  `layers`: `unstack_layers(cfg, params["layers"])`. `last_BT`: optional int [B, T'] indices
  of the tokens whose logits are wanted (the output layer runs on those only); default all T.
  """
  attn = functools.partial(cached_attention, impl=cfg.attention_impl)
  x_BTD = transformer.embed(cfg, params["embedding"], tokens_BT)
  new_caches = []
  for p, cache in zip(layers, caches, strict=True):
    x_BTD = transformer.shard_residual(x_BTD)
    x_BTD, cache = transformer.block(p, x_BTD, positions_BT, None, cfg, attn, cache=cache)
    new_caches.append(KVCache(*cache))
  x_BTD = transformer.shard_residual(x_BTD)
  if last_BT is not None:
    x_BTD = jnp.take_along_axis(x_BTD, last_BT[:, :, None], axis=1)
  logits = transformer.unembed(cfg, x_BTD, params["final_norm"], params["embedding"],
                               params.get("unembedding"))
  return logits, new_caches


# ----------------------------------------------------------------------------- sampling


def sample(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """Next tokens int32 [B]: argmax at temperature 0, else a draw from the tempered logits
  restricted to the top_k most likely and then the smallest set holding top_p of the mass."""
  logits_BV = logits_BV.astype(jnp.float32)
  if sampling.temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / sampling.temperature
  if sampling.top_k:
    kth = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
  if sampling.top_p < 1:
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    probs = jax.nn.softmax(sorted_BV, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    # The most likely token is always kept (before = 0 < top_p).
    cutoff = jnp.min(jnp.where(before < sampling.top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- the loop


def _check_choice(field: str, value, valid) -> None:
  if value not in valid:
    raise ValueError(f"generate: {field}={value!r} is not known; choose one of {tuple(valid)}")


def _check_int(field: str, value, lo: int, hi: int | None = None) -> None:
  bad = isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo
  if bad or (hi is not None and value > hi):
    valid = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ValueError(f"generate: {field}={value!r} must be an int {valid}")


def _check(cfg, prompts, lengths, max_new_tokens, max_len, sampling, eos_id, padding,
           qmatmul_impl) -> tuple[np.ndarray, np.ndarray, int]:
  prompts, lengths = np.asarray(prompts), np.asarray(lengths)
  if prompts.ndim != 2 or not prompts.shape[0] or not prompts.shape[1] \
      or not np.issubdtype(prompts.dtype, np.integer):
    raise ValueError(f"generate: prompts must be an int array [B, T] with B, T >= 1; got "
                     f"{prompts.dtype}{tuple(prompts.shape)} (pad_prompts makes one)")
  b, t = prompts.shape
  if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"generate: lengths must be an int array [B={b}]; got "
                     f"{lengths.dtype}{tuple(lengths.shape)}")
  if lengths.min() < 1 or lengths.max() > t:
    raise ValueError(f"generate: lengths must be in [1, T={t}] (the prompts' width); got "
                     f"{lengths.tolist()}")
  if prompts.min() < 0 or prompts.max() >= cfg.vocab_size:
    raise ValueError(f"generate: prompt tokens must be in [0, {cfg.vocab_size}) (the model's "
                     f"vocab_size); got [{prompts.min()}, {prompts.max()}]")
  _check_int("max_new_tokens", max_new_tokens, 1)
  if max_len is None:
    max_len = t + max_new_tokens
  _check_int("max_len", max_len, 1)
  if t + max_new_tokens > max_len:
    raise ValueError(
        f"generate: the prompt ({t} tokens, the longest row's padded width) + max_new_tokens="
        f"{max_new_tokens} = {t + max_new_tokens} does not fit max_len={max_len} (the KV "
        f"cache's length); use max_len >= {t + max_new_tokens}, or a shorter prompt or "
        "fewer new tokens")
  if not isinstance(sampling, Sampling):
    raise ValueError(f"generate: sampling must be a Sampling(...); got {type(sampling).__name__}")
  if sampling.top_k > cfg.vocab_size:
    raise ValueError(f"generate: top_k={sampling.top_k} must be in [0, {cfg.vocab_size}] (the "
                     "model's vocab_size; 0: off)")
  if eos_id is not None:
    _check_int("eos_id", eos_id, 0, cfg.vocab_size - 1)
  _check_choice("padding", padding, PADDINGS)
  _check_choice("qmatmul_impl", qmatmul_impl, IMPLS)
  if padding == "left":  # move each row's tokens to the left: positions 0..L-1 everywhere
    shift = (np.arange(t)[None, :] + (t - lengths)[:, None]) % t
    prompts = np.take_along_axis(prompts, shift, axis=1)
  return prompts.astype(np.int32), lengths.astype(np.int32), max_len


def generate(cfg: transformer.TransformerConfig, params: dict[str, Any], prompts, lengths,
             key: jax.Array | None = None, *, max_new_tokens: int, max_len: int | None = None,
             sampling: Sampling = Sampling(), eos_id: int | None = None, padding: str = "right",
             qmatmul_impl: str = "auto", mesh: Mesh | None = None,
             return_logits: bool = False) -> Generation:
  """max_new_tokens continuations of a batch of prompts (see the module docstring).

  prompts: int [B, T], each row's `lengths[b]` tokens at its left (`padding="right"`) or
  right end. key: for sampling (temperature > 0); the same key gives the same tokens.
  max_len: the cache's length, >= T + max_new_tokens (default exactly that). A row stops
  at `eos_id` (its later tokens are eos_id); the loop stops when every row has.
  qmatmul_impl: the implementation quantized weights run with. mesh: the batch and the
  cache split over its batch axes (`data`) and the kv heads over `tensor`, as the
  parameters are placed (`shard_params`).
  """
  prompts, lengths, max_len = _check(cfg, prompts, lengths, max_new_tokens, max_len, sampling,
                                     eos_id, padding, qmatmul_impl)
  if key is None:
    if sampling.temperature:
      raise ValueError("generate: sampling with temperature > 0 needs a key (jax.random.key(seed))")
    key = jax.random.key(0)
  if mesh is not None:  # a batch or head count the mesh does not divide: one line, up front
    cache_shape = (prompts.shape[0], max_len, cfg.n_kv_heads, cfg.hd)
    mesh_lib.logical_to_partition_spec(CACHE_AXES, mesh, shape=cache_shape)
    spec = mesh_lib.logical_to_partition_spec(("batch", None), mesh, shape=prompts.shape)
    prompts = jax.device_put(prompts, NamedSharding(mesh, spec))
    lengths = jax.device_put(lengths, NamedSharding(mesh, PartitionSpec(spec[0])))
  fn = _compiled(cfg, max_new_tokens, max_len, sampling, eos_id, qmatmul_impl, return_logits, mesh)
  return fn(params, prompts, lengths, key)


def greedy_without_cache(cfg: transformer.TransformerConfig, params: dict[str, Any], prompts,
                         lengths, *, max_new_tokens: int, qmatmul_impl: str = "auto") -> Generation:
  """The baseline decoder: `transformer.apply` on the whole prefix at every step (greedy, no
  cache, no EOS); each step costs a full pass over T + max_new_tokens tokens."""
  prompts, lengths, _ = _check(cfg, prompts, lengths, max_new_tokens, None, Sampling(), None,
                               "right", qmatmul_impl)
  return _recompute(cfg, max_new_tokens, qmatmul_impl)(params, prompts, lengths)


@functools.lru_cache(maxsize=8)
def _recompute(cfg, n, qmatmul_impl):
  def run(params, prompts_BT, lengths_B):
    b, t = prompts_BT.shape
    rows = jnp.arange(b)

    def step(i, tokens_BW):
      with transformer.qmatmul_impl(qmatmul_impl):
        logits = transformer.apply(cfg, params, tokens_BW)  # causal: what follows is unseen
      new = jnp.argmax(logits[rows, lengths_B + i - 1], axis=-1).astype(jnp.int32)
      return tokens_BW.at[rows, lengths_B + i].set(new)

    tokens = jnp.pad(prompts_BT, ((0, 0), (0, n)))
    tokens = jax.lax.fori_loop(0, n, step, tokens)
    new_BN = jnp.take_along_axis(tokens, lengths_B[:, None] + jnp.arange(n), axis=1)
    return Generation(new_BN, jnp.full((b,), n, jnp.int32), None)
  return jax.jit(run)


def shard_params(cfg: transformer.TransformerConfig, params: dict[str, Any], mesh: Mesh):
  """params placed on `mesh` by their logical axes; a QWeight's [K, N] codes and scales split
  N as the weight's output dims are split (K stays whole)."""

  def place(path, w, logical):
    if not isinstance(w, QWeight):
      return jax.device_put(w, NamedSharding(
          mesh, mesh_lib.logical_to_partition_spec(logical, mesh, shape=w.shape)))
    name = path[-1].key
    lead = 1 if path[0].key == "layers" else 0
    out_axes = [a for a in logical[lead + transformer.LAYER_MATMULS.get(name, 1):]
                if a not in (None, "head_dim")]
    spec = mesh_lib.logical_to_partition_spec(
        (*logical[:lead], None, out_axes[0] if out_axes else None), mesh)
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), w)

  # The parameter tree sets the structure: each leaf (a QWeight whole) meets its axes tuple.
  return jax.tree_util.tree_map_with_path(place, params, transformer.param_axes(cfg),
                                          is_leaf=lambda x: isinstance(x, QWeight))


@functools.lru_cache(maxsize=32)
def _compiled(cfg, max_new_tokens, max_len, sampling, eos_id, qmatmul_impl, return_logits, mesh):
  def run(params, prompts_BT, lengths_B, key):
    with transformer.qmatmul_impl(qmatmul_impl):
      return _decode(cfg, params, prompts_BT, lengths_B, key, max_new_tokens=max_new_tokens,
                     max_len=max_len, sampling=sampling, eos_id=eos_id,
                     return_logits=return_logits, mesh=mesh)
  return jax.jit(run if mesh is None else sharded.under_mesh(run, mesh))


def _decode(cfg, params, prompts_BT, lengths_B, key, *, max_new_tokens, max_len, sampling,
            eos_id, return_logits, mesh):
  b, t = prompts_BT.shape
  n = max_new_tokens
  cache = init_cache(cfg, b, max_len)
  if mesh is not None:
    spec = mesh_lib.logical_to_partition_spec(CACHE_AXES, mesh, shape=cache[0].k.shape)
    constrain = lambda c: jax.lax.with_sharding_constraint(c, NamedSharding(mesh, spec))
  else:
    constrain = lambda c: c
  layers = unstack_layers(cfg, params["layers"])  # once: the loop reads each where it lies
  positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  logits, cache = forward(cfg, params, layers, prompts_BT, positions_BT,
                          jax.tree.map(constrain, cache), last_BT=(lengths_B - 1)[:, None])
  fill = 0 if eos_id is None else eos_id

  def emit(state, logits_BV):
    """Samples step i's tokens and records them (rows already done repeat eos_id)."""
    i, tokens, done, _, _, cache, all_logits = state
    new = sample(logits_BV, jax.random.fold_in(key, i), sampling)
    new = jnp.where(done, fill, new)
    tokens = tokens.at[:, i].set(new)
    if return_logits:
      all_logits = all_logits.at[:, i].set(logits_BV)
    if eos_id is not None:
      done = done | (new == eos_id)
    return (i + 1, tokens, done, new, lengths_B + i, cache, all_logits)

  all_logits = jnp.zeros((b, n, cfg.vocab_size), jnp.float32) if return_logits else None
  state = (jnp.int32(0), jnp.full((b, n), fill, jnp.int32), jnp.zeros((b,), bool),
           jnp.zeros((b,), jnp.int32), lengths_B, cache, all_logits)
  state = emit(state, logits[:, 0])

  def cond(state):
    i, _, done = state[:3]
    return (i < n) & ~jnp.all(done)

  def body(state):
    i, tokens, done, last, pos, cache, all_logits = state
    logits, cache = forward(cfg, params, layers, last[:, None], pos[:, None], cache)
    cache = jax.tree.map(constrain, cache)
    return emit((i, tokens, done, last, pos, cache, all_logits), logits[:, 0])

  _, tokens, _, _, _, _, all_logits = jax.lax.while_loop(cond, body, state)
  if eos_id is None:
    out_lengths = jnp.full((b,), n, jnp.int32)
  else:
    is_eos = tokens == eos_id
    out_lengths = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, n).astype(jnp.int32)
  return Generation(tokens, out_lengths, all_logits)
