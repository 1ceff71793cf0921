"""A run's memory estimated from its shapes, before anything is allocated or compiled.

`estimate(run, mesh)` adds up what one device holds at the train step's peak and what its
host holds besides:

  - the state, exact: each leaf of the trained view's abstract state (`make_setup`'s
    `jax.eval_shape`, no allocation) at its shard's shape: parameters, the inner
    optimizer's slots (Adam's two moments, in their dtypes), an outer optimizer's state;
  - gradients: the parameters' shards again (twice with accumulation: the running sum);
  - weights gathered for compute over `fsdp` (the scan keeps every layer's copy for the
    backward without remat, one layer's with it) and the embedding and output layer whole;
  - activations of one step: the tokens a device holds at once (rows of one microbatch
    over the batch axes, its `context` share of the sequence; a pipeline stage's
    `Schedule.peak_activations` microbatches, see PIPELINE_CARRY; HDP's `data.seq_len` a
    micro-step) x its layers x what `model.remat` keeps of a layer (below), plus one
    rematerialized layer's backward where it outgrows the logits (it runs after them);
  - the logits: every token's row of the vocabulary (its `tensor`, stage and
    `model.vocab_tiles` share), kept in the compute dtype with float32 probabilities;
  - the batch; and on the host, the loaders' batches in flight (prefetch buffers).

What a layer keeps, in elements a token (D model width, F the MLP's, Q = heads x head
dim, KV = K/V heads x head dim; heads and F split over `tensor`), by `model.remat`:
`none` 8 D + 3 Q + 2 KV + 5 F (every intermediate, as XLA:CPU's compiled steps keep them:
fitted to the tiny, small, GPT-2 and Llama-3-1B presets), `minimal` 2 D + 2 Q
+ 2 KV + 2 F, `dots` 3 D + Q + 2 KV + 2 F, `qkv` D + Q + 2 KV, `full` D. Measured on
XLA:CPU, two compiler habits the estimate follows there: a bfloat16 step's activations
take float32's room (its dots run in float32: tiny at bf16 64.6 MB of temporaries, at f32
70.9 MB), and remat saves nothing in an unrolled stack (<= `UNROLL_MAX_LAYERS` layers:
tiny, remat=full 66.1 MB against none's 70.9 MB), so there every policy counts as `none`.
The estimate against the compiled programs: docs/results/training.md, "Memory before
any work".

`check(run, mesh)` refuses, in one line, a run whose estimate exceeds `limit(mesh)`:
a GPU's or TPU's `bytes_limit` a device (and the host's available memory for the host's
part); on CPU, where the simulated devices are the host's own memory, the host's
available memory for all of its devices together.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxsys import mesh as mesh_lib
from jaxsys.config import RunConfig
from jaxsys.data.packing import FIELDS as BATCH_FIELDS
from jaxsys.models import transformer
from jaxsys.train import hdp_step
from jaxsys.train import setup as setup_lib

# Elements a token a layer keeps for its backward, by policy, as (D, Q, KV, F) multiples
# (see the module doc): Q, KV and F split over `tensor`.
KEPT = {"none": (8, 3, 2, 5), "minimal": (2, 2, 2, 2), "dots": (3, 1, 2, 2),
        "qkv": (1, 1, 2, 0), "full": (1, 0, 0, 0)}
# A pipeline stage's activations: its residual buffer (`Ticks.res_slots` microbatches,
# `Schedule.peak_activations`) is the executor's loop carry, and a tick's chunk works beside
# it: (times the buffer, times one microbatch's chunk), fitted to XLA:CPU's compiled GPipe
# and 1F1B steps of the tiny model (2 and 4 stages, 4 and 8 microbatches: 0.99-1.17x).
PIPELINE_CARRY = (1.5, 2)
_LOGITS_F32 = 4  # bytes a vocabulary entry a token in float32: the loss's probabilities
_BATCH_BYTES = 4 * len(BATCH_FIELDS)  # a token of the batch: inputs, targets, ..., 4 bytes each

# The fields that size each term (a refusal names those of its largest term); any other
# term (parameters, optimizer and outer states, gradients, gathered weights): the model's.
_MODEL = ("model.d_model", "model.d_ff", "model.n_layers", "model.vocab_size")
_ROWS = ("data.batch_size", "data.seq_len")
_FIELDS_OF = {
    "activations": (*_ROWS, *_MODEL[:3], "model.remat", "optimizer.grad_accum_steps"),
    "logits": (*_ROWS, "model.vocab_size", "model.vocab_tiles", "optimizer.grad_accum_steps"),
    "batch": _ROWS,
    "loader buffers": (*_ROWS, "data.num_threads"),
}


def fields_of(term: str) -> tuple[str, ...]:
  """The config fields that size `term`, the mesh last (it divides every term)."""
  return (*_FIELDS_OF.get(term, _MODEL), *(("mesh",) if term != "loader buffers" else ()))


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Bytes by term: `device` one device holds at the step's peak, `host` its host holds
  besides; `local`: the mesh's devices on this host, of `platform`."""
  device: dict[str, float]
  host: dict[str, float]
  local: int
  platform: str

  @property
  def device_bytes(self) -> float:
    return sum(self.device.values())

  @property
  def host_bytes(self) -> float:
    return sum(self.host.values())

  def largest(self) -> str:
    terms = {**self.device, **self.host}
    return max(terms, key=terms.get)


@dataclasses.dataclass(frozen=True)
class Limit:
  """The memory a run may use: `device` bytes a device (None: the devices are the host's
  memory, CPU), `host` bytes available on the host; `where` says where each came from."""
  device: float | None
  host: float
  where: str


def human(n: float) -> str:
  """Bytes in decimal units, 3 significant digits: '23.4 GB'."""
  for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
    if abs(n) < 1000:
      return f"{n:.3g} {unit}"
    n /= 1000
  return f"{n:.3g} EB"


def _shard_bytes(tree, shardings) -> float:
  """Bytes one device holds of `tree`'s abstract leaves laid out by `shardings`."""
  total = 0.0
  for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    total += math.prod(sh.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
  return total


def activation_itemsize(run: RunConfig, platform: str) -> int:
  """Bytes an activation element takes: the compute dtype's, float32's on XLA:CPU (which
  runs bfloat16 dots in float32 and keeps their operands so)."""
  size = jnp.dtype(run.model.dtype).itemsize
  return max(size, 4) if platform == "cpu" else size


def kept_per_token(run: RunConfig, policy: str, tensor: int) -> float:
  """Elements one layer keeps a token under `policy` (`KEPT`), with `tensor` shards."""
  m = run.model
  d, q, kv, f = KEPT[policy]
  # Fewer K/V heads than shards are replicated (mesh.REPLICATED_WHEN_INDIVISIBLE).
  kv_shards = tensor if m.n_kv_heads % tensor == 0 else 1
  return (d * m.d_model + (q * m.n_heads * m.hd + f * m.d_ff) / tensor
          + kv * m.n_kv_heads * m.hd / kv_shards)


def _tokens_and_layers(run: RunConfig, mesh: Mesh, schedule) -> tuple[float, float, float, int]:
  """(tokens whose activations a device holds at once, layers it runs, tokens of one
  microbatch on it (the logits' rows), layers of one unrolled-or-scanned stack)."""
  if run.parallel.hdp:  # one micro-step of data.seq_len tokens on each device
    return float(run.data.seq_len), run.model.n_layers, float(run.data.seq_len), \
        run.model.n_layers
  # One microbatch's rows and tokens on a device: the batch's sharding over the mesh.
  rows, seq = mesh_lib.batch_sharding(mesh).shard_shape(
      (run.data.batch_size // run.optimizer.grad_accum_steps, run.data.seq_len))
  if schedule is None:
    return rows * seq, run.model.n_layers, rows * seq, run.model.n_layers
  per_micro = rows / run.pipeline.microbatches * seq
  layers = run.model.n_layers / mesh_lib.degrees(mesh).stage
  return (per_micro * schedule.peak_activations, layers, per_micro,
          int(layers // schedule.virtual_stages))


def estimate(run: RunConfig, mesh: Mesh, setup: setup_lib.Setup | None = None) -> Estimate:
  """The run's memory from its shapes (see the module doc); `setup`: the run's, if built
  (else `make_setup`'s view and shardings are built here, nothing compiled)."""
  setup = setup_lib.make_setup(run, mesh) if setup is None else setup
  platform = mesh.devices.flat[0].platform
  abstract, sh, m = setup.abstract, setup.state_sh, run.model
  shape = dict(mesh.shape)
  tensor = shape.get("tensor", 1)
  act = activation_itemsize(run, platform)
  params = _shard_bytes(abstract.params, sh.params)
  device = {"parameters": params,
            f"{'Adam moments' if run.optimizer.name == 'adamw' else 'optimizer state'}":
                _shard_bytes(abstract.opt_state, sh.opt_state)}
  if abstract.outer is not None:
    device[f"{run.outer.name} state"] = _shard_bytes(abstract.outer, sh.outer)
  device["gradients"] = params * (2 if run.optimizer.grad_accum_steps > 1 else 1)

  tokens, layers, micro_tokens, stack = _tokens_and_layers(run, mesh, setup.schedule)
  unrolled = stack <= transformer.UNROLL_MAX_LAYERS and not m.remat_offload
  policy = "none" if platform == "cpu" and unrolled else m.remat
  one_layer = kept_per_token(run, "none", tensor)
  head = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) / tensor
  if shape.get("fsdp", 1) > 1 or run.pipeline.gather_once:
    per_layer = sum(x.size for x in jax.tree.leaves(setup.one.params["layers"])) / (
        m.n_layers * tensor)
    held = layers if policy == "none" else min(layers, 2)  # in use and the next, gathered
    device["weights gathered for compute"] = (held * per_layer + head) * act
  vocab_share = tensor * (shape.get("stage", 1) if run.pipeline.vocab_parallel else 1)
  logits = (micro_tokens * m.vocab_size / m.vocab_tiles / vocab_share
            * (2 * act + _LOGITS_F32))
  kept = kept_per_token(run, policy, tensor)
  working = one_layer if policy != "none" else 0  # a rematerialized layer's backward
  if setup.schedule is None:  # the backward's layers run after the logits are spent
    device["activations"] = (tokens * layers * kept * act
                             + max(0.0, tokens * working * act - logits))
  else:  # a stage's residual buffer, a loop carry (see PIPELINE_CARRY), and a tick's chunk
    chunk = micro_tokens * (layers / setup.schedule.virtual_stages * kept + working)
    device["activations"] = (PIPELINE_CARRY[0] * tokens * layers * kept
                             + PIPELINE_CARRY[1] * chunk) * act
  device["logits"] = logits
  device["batch"] = tokens_of_batch(run, mesh) * _BATCH_BYTES
  return Estimate(device, {"loader buffers": loader_bytes(run)},
                  local=len([d for d in mesh.devices.flat
                             if d.process_index == jax.process_index()]),
                  platform=platform)


def tokens_of_batch(run: RunConfig, mesh: Mesh) -> float:
  """Tokens of the step's batch one device holds."""
  if run.parallel.hdp:
    return hdp_step.micro_steps_per_step(run, mesh.devices.size) * run.data.seq_len
  return math.prod(mesh_lib.batch_sharding(mesh).shard_shape((run.data.batch_size,
                                                              run.data.seq_len)))


def loader_bytes(run: RunConfig) -> float:
  """Bytes a host's loaders hold: the train and val batches each loader's prefetch buffer
  keeps ahead (`make_loader`'s grain read options), the batch in use and its copy."""
  data, processes = run.data, jax.process_count()
  ahead = max(2, 2 * data.num_threads) if data.num_threads > 0 else 0
  train = data.batch_size / processes
  val = data.batch_size / run.optimizer.grad_accum_steps / processes
  return (train + val) * (ahead + 2) * data.seq_len * _BATCH_BYTES


def available_host_bytes() -> float:
  """This host's available memory: /proc/meminfo's MemAvailable (Linux), else free pages."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return float(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError, AttributeError):
    return math.inf


def limit(mesh: Mesh) -> Limit:
  """What `mesh`'s devices on this host may use (see the module doc)."""
  host = available_host_bytes()
  device = mesh.devices.flat[0]
  if device.platform == "cpu":
    return Limit(None, host, "MemAvailable, for all of its CPU devices")
  stats: dict[str, Any] = {}
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  (a backend without memory stats)
    pass
  if "bytes_limit" in stats:
    return Limit(float(stats["bytes_limit"]), host, f"{device.device_kind}'s bytes_limit")
  return Limit(math.inf, host, f"{device.device_kind} reports no bytes_limit")


def _terms(terms: dict[str, float]) -> str:
  return ", ".join(f"{k} {human(v)}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])
                   if v >= 0.005 * sum(terms.values()))


def _help(run: RunConfig) -> str:
  """What would need less memory, less what the run already does."""
  remat = "" if run.model.remat == "full" else "set model.remat=full, "
  return (f"shrink the model, data.batch_size or data.seq_len, raise "
          f"optimizer.grad_accum_steps or model.vocab_tiles, {remat}shard over more devices "
          "(mesh fsdp, tensor, stage), or set --config.check_memory=false to run anyway")


def refusal(run: RunConfig, est: Estimate, lim: Limit) -> str | None:
  """The one-line refusal of `est` against `lim`, None if it fits."""
  values = run.to_dict()

  def value(path):
    node = values
    for key in path.split("."):
      node = node[key]
    return node
  named = ", ".join(f"{f}={value(f)!r}" for f in fields_of(est.largest())) + ": "
  if lim.device is None:  # CPU: the devices' memory is the host's
    need = est.local * est.device_bytes + est.host_bytes
    if need <= lim.host:
      return None
    return (f"{named}the run needs about {human(need)} of this host's memory: "
            f"{est.local} CPU devices x {human(est.device_bytes)} ({_terms(est.device)}) + "
            f"{_terms(est.host)}, and this host has {human(lim.host)} ({lim.where}); "
            f"{_help(run)}")
  if est.device_bytes > lim.device:
    return (f"{named}the run needs about {human(est.device_bytes)} of device memory a device "
            f"({_terms(est.device)}) and this device has {human(lim.device)} ({lim.where}); "
            f"{_help(run)}")
  if est.host_bytes > lim.host:
    return (f"{named}the run needs about {human(est.host_bytes)} of host memory "
            f"({_terms(est.host)}) and this host has {human(lim.host)} available; {_help(run)}")
  return None


def check(run: RunConfig, mesh: Mesh) -> Estimate:
  """The run's estimate; a one-line ValueError when it cannot fit this machine."""
  est = estimate(run, mesh)
  error = refusal(run, est, limit(mesh))
  if error:
    raise ValueError(error)
  return est
