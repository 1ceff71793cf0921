"""Checks a training config up front: every field, the relations between fields, the workdir.

One table gives each field of configs/tiny_lm.py its valid values, a second the relations
between fields (and the mesh they build). `check_config` runs both before any data or
model work, so a bad value is one line naming the field, the value and what is valid.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from typing import Any, Callable

import jax

from jaxsys import config as config_lib
from jaxsys.fields import Rule
from jaxsys import mesh as mesh_lib
from jaxsys.checkpoint import hf
from jaxsys.data import corpus
from jaxsys.data.tokenizer import MIN_BPE_VOCAB
from jaxsys.optim.co2 import DEFAULTS as CO2_DEFAULTS, stable as co2_stable
from jaxsys.optim.noloco import check_group_size
from jaxsys.parallel import pipeline
from jaxsys.train import comm_device
from jaxsys.train import hdp_step
from jaxsys.train import memory_estimate
from jaxsys.train import replicas as replicas_lib


# Every field's rule, declared with the field (jaxsys/config.py, models/transformer.py).
FIELDS: dict[str, Rule] = config_lib.field_rules()


@dataclasses.dataclass(frozen=True)
class Relation:
  """`holds(*values of fields)` must be true; the first field is the one reported."""
  fields: tuple[str, ...]
  holds: Callable[..., bool]
  valid: str

  def error(self, values: dict[str, Any]) -> str | None:
    args = [values[f] for f in self.fields]
    if self.holds(*args):
      return None
    others = ", ".join(f"{f}={v!r}" for f, v in zip(self.fields[1:], args[1:]))
    return f"{self.fields[0]}={args[0]!r} is invalid with {others}; it must {self.valid}"


def _groups_replicas(group_size: int, replicas: int) -> bool:
  try:  # NoLoCo's own rule, so the two never disagree
    check_group_size(group_size, replicas)
  except ValueError:
    return False
  return True


def _profile_range_ok(steps: str, total: int) -> bool:
  if not steps:
    return True
  first, last = map(int, steps.split(","))
  return 1 <= first <= last <= total


# Model sizes whose parameter dims are sharded by a logical axis.
_SHARDED_FIELDS = {"model.d_model": "embed", "model.n_heads": "heads",
                   "model.n_kv_heads": "kv_heads", "model.d_ff": "mlp", "model.vocab_size": "vocab"}

# Relations; "mesh ..." and "processes" are derived from the built mesh (see _derived).
RELATIONS: tuple[Relation, ...] = (
    Relation(("model.n_heads", "model.n_kv_heads"), lambda h, kv: h % kv == 0,
             "be a multiple of model.n_kv_heads"),
    Relation(("model.d_model", "model.n_heads", "model.head_dim"),
             lambda d, h, hd: hd is not None or d % h == 0,
             "divide by model.n_heads (or set model.head_dim)"),
    Relation(("model.head_dim", "model.d_model", "model.n_heads"),
             lambda hd, d, h: (hd or d // h) % 2 == 0,
             "give an even head dim (RoPE rotates pairs of dims; None means d_model // n_heads)"),
    Relation(("data.vocab_size", "data.tokenizer"),
             lambda v, tok: v == 256 if tok == "byte" else v >= MIN_BPE_VOCAB if tok == "bpe"
             else True,  # hf: data.vocab_size is its tokenizer's (hf.run_values)
             f"be 256 for the byte tokenizer, >= {MIN_BPE_VOCAB} for bpe (256 bytes + merges)"),
    Relation(("model.vocab_tiles", "model.vocab_size"), lambda n, v: v % n == 0,
             "divide model.vocab_size (equal tiles of the vocabulary)"),
    Relation(("model.remat_offload", "model.remat"),
             lambda offload, policy: not offload or policy in ("full", "minimal", "qkv"),
             "be '' unless model.remat names what it keeps (full, minimal or qkv)"),
    Relation(("model.remat_offload", "the devices' host memory"),
             lambda offload, host: not offload or host != "none",
             "be '' on devices without a host memory of their own to offload to (TPU, GPU)"),
    Relation(("model.vocab_size", "data.vocab_size"), lambda m, d: m >= d,
             "be >= data.vocab_size (every token needs an embedding row)"),
    Relation(("optimizer.warmup_steps", "total_steps", "optimizer.schedule_steps"),
             lambda w, total, sched: w <= (sched or total),
             "be <= the schedule's length (optimizer.schedule_steps, or total_steps when 0)"),
    Relation(("data.batch_size", "optimizer.grad_accum_steps"), lambda b, a: b % a == 0,
             "divide into optimizer.grad_accum_steps equal microbatches"),
    Relation(("data.batch_size", "optimizer.grad_accum_steps", "mesh shards of 'batch'"),
             lambda b, a, shards: (b // a) % shards == 0,
             "give microbatches (data.batch_size / optimizer.grad_accum_steps) that divide over "
             "the mesh axes that shard the batch"),
    Relation(("data.batch_size", "processes"), lambda b, p: b % p == 0,
             "divide over the processes"),
    Relation(("mesh axis replica", "outer.name"), lambda r, outer: r == 1 or outer != "none",
             "be 1 without an outer optimizer (outer.name=diloco, streaming_diloco, noloco or "
             "co2); for data parallelism use a data axis"),
    Relation(("mesh axis stage", "pipeline.schedule"), lambda p, sched: p == 1 or sched != "none",
             "be 1 without a pipeline (pipeline.schedule=gpipe, 1f1b, eager_1f1b, interleaved_1f1b, "
             "zb_h1 or zbv)"),
    Relation(("pipeline.vocab_parallel", "mesh axis stage", "pipeline.schedule"),
             lambda vp, p, sched: not vp or (p > 1 and sched != "none"),
             "be False without a pipeline over a stage axis larger than 1"),
    Relation(("pipeline.vocab_overlap", "pipeline.vocab_parallel"), lambda ov, vp: not ov or vp,
             "be False without pipeline.vocab_parallel=True (it places vocabulary "
             "parallelism's S and T passes)"),
    Relation(("pipeline.gather_once", "mesh axis fsdp", "pipeline.schedule"),
             lambda once, f, sched: not once or (f > 1 and sched != "none"),
             "be False without a pipeline over a mesh whose fsdp axis is larger than 1 (it "
             "gathers each stage's fsdp-split weights once a step)"),
    Relation(("model.n_layers", "mesh axis stage", "pipeline.virtual_stages", "pipeline.schedule"),
             lambda n, p, v, sched: sched == "none" or n % (p * v) == 0,
             "split evenly into (mesh axis stage) x pipeline.virtual_stages chunks"),
    Relation(("data.batch_size", "pipeline.microbatches", "optimizer.grad_accum_steps",
              "mesh shards of 'batch'", "pipeline.schedule"),
             lambda b, m, a, shards, sched: sched == "none" or (
                 b % (a * m) == 0 and (b // (a * m)) % shards == 0),
             "split into optimizer.grad_accum_steps x pipeline.microbatches equal microbatches "
             "that divide over the mesh axes that shard the batch"),
    Relation(("pipeline.routing", "mesh axis replica", "mesh axis stage"),
             lambda routing, r, p: routing == "fixed" or (r > 1 and p > 1),
             "be fixed unless the mesh has both a replica and a stage axis larger than 1 "
             "(random routing sends microbatches between the replicas' pipelines)"),
    Relation(("data.seq_len", "mesh axis context", "parallel.context_layout"),
             lambda t, n, layout: t % (2 * n if layout == "zigzag" else n) == 0,
             "divide into the layout's chunks: 2 x (mesh axis context) for zigzag, "
             "(mesh axis context) for contiguous"),
    Relation(("parallel.context_algorithm", "parallel.context_gather_mib",
              "MiB of K/V gathered per device"),
             lambda algorithm, budget, need: algorithm != "all_gather" or need <= budget,
             "hold the K/V it gathers within parallel.context_gather_mib (one layer's keys and "
             "values of whole sequences: the device's rows of a microbatch x data.seq_len x "
             "its K/V heads x head dim x 2, in model.dtype); raise it, or use ring"),
    Relation(("parallel.context_algorithm", "model.n_heads", "mesh shards of 'heads'",
              "model.n_kv_heads", "mesh shards of 'kv_heads'", "mesh axis context"),
             lambda algorithm, h, h_shards, kv, kv_shards, c: algorithm != "ulysses" or (
                 (h // h_shards) % c == 0 and (kv // kv_shards) % c == 0),
             "be ring or all_gather unless each device's query and K/V heads (each count "
             "over its mesh shards) divide by the mesh axis context: ulysses splits them "
             "over it"),
    Relation(("model.sliding_window", "mesh axis context"), lambda w, c: w == 0 or c == 1,
             "be 0 with a context axis larger than 1: the context-parallel kernels (ring, "
             "all_gather, ulysses) have no sliding window"),
    Relation(("model.sliding_window", "parallel.hdp"), lambda w, hdp: w == 0 or not hdp,
             "be 0 with HDP: its context rings have no sliding window"),
    Relation(("data.variable_length", "data.source"),
             lambda var, source: not var or (len(corpus.mixture(source)) == 1
                                             and not corpus.is_record_source(source)),
             "be False for a JSONL source or a mixture: whole documents are read a file a "
             "document from one source (packed rows read both)"),
    Relation(("parallel.hdp", "data.variable_length"), lambda hdp, var: hdp == var,
             "equal data.variable_length (HDP trains whole documents; whole documents train "
             "only with HDP)"),
    Relation(("parallel.hdp", "mesh axis context"), lambda hdp, c: not hdp or c == 1,
             "be False with a context axis: HDP makes its own context rings, as long as each "
             "document needs (data=S/c,context=c views of its pool), so a fixed one has "
             "nothing to split"),
    Relation(("data.max_len", "data.seq_len", "mesh axes data x fsdp", "parallel.hdp"),
             lambda m, t, n, hdp: not hdp or m <= n * t,
             "fit a replica's device pool: at most (data x fsdp) x data.seq_len tokens "
             "(data.seq_len is each slot's share in a micro-step)"),
    Relation(("optimizer.accum_gather_once", "mesh axis replica", "mesh axis stage"),
             lambda once, r, p: not once or (r == 1 and p == 1),
             "be False with replicas or a pipeline (pipeline.gather_once gathers a stage's "
             "weights once)"),
    Relation(("optimizer.grad_accum_steps", "parallel.hdp"), lambda a, hdp: a == 1 or not hdp,
             "be 1 with HDP (its micro-steps already accumulate gradients)"),
    Relation(("profile.steps", "total_steps"), lambda steps, total: _profile_range_ok(steps, total),
             "be 'N,M' with 1 <= N <= M <= total_steps (the first and last step traced), or ''"),
    Relation(("outer.fragments", "model.n_layers", "outer.name"),
             lambda f, n, outer: outer != "streaming_diloco" or n % f == 0,
             "divide model.n_layers (fragment p syncs layers p, p + fragments, ...)"),
    Relation(("outer.sync_every", "outer.fragments", "outer.name"),
             lambda h, f, outer: outer != "streaming_diloco" or h >= f,
             "be >= outer.fragments (the fragments sync at staggered offsets, one "
             "every outer_sync_every / outer_fragments steps)"),
    Relation(("outer.overlap_steps", "outer.sync_every", "outer.name"),
             lambda tau, h, outer: outer != "streaming_diloco" or tau < h,
             "be < outer.sync_every (a fragment's result lands before it syncs again)"),
    Relation(("outer.staleness_penalty", "outer.lr", "outer.momentum", "outer.allow_unstable",
              "outer.name"),
             lambda penalty, lr, momentum, unstable, outer: (
                 outer != "co2" or unstable or co2_stable(lr, momentum, penalty)),
             "keep outer.lr / outer.staleness_penalty < 1 - outer.momentum, CO2's stability "
             f"bound (None: CO2's default, {CO2_DEFAULTS}), or outer.allow_unstable be True"),
    Relation(("outer.comm_device", "outer.name"),
             lambda twins, outer: not twins or outer == "co2",
             "be False unless outer.name=co2 (the one whose sync's result waits H steps)"),
    Relation(("outer.group_size", "outer.name", "mesh axis replica"),
             lambda g, outer, r: outer != "noloco" or _groups_replicas(g, r),
             "be 2 (random pairs, for an even replica count) or the replica count (one group)"),
) + tuple(
    Relation((field, f"mesh shards of {logical!r}"), lambda size, shards: size % shards == 0,
             f"divide over the mesh axes that shard {logical!r} (jaxsys/mesh.py DEFAULT_RULES)")
    for field, logical in _SHARDED_FIELDS.items())


# Fields moved since checkpoints were first written: {old path: new path}. A saved config
# (a checkpoint's meta) with the old names still parses; a field it lacks takes its default,
# what an older config meant.
MOVED: dict[str, str] = {"optimizer.outer": "outer.name", **{
    f"optimizer.outer_{name}": f"outer.{name}" for name in (
        "sync_every", "lr", "momentum", "nesterov", "compression", "error_feedback", "gamma",
        "group_size", "seed", "staleness_penalty", "momentum_clip", "allow_unstable",
        "comm_device", "fragments", "overlap_steps", "mixing")}}


# Fields removed since checkpoints were first written: {field: (the value that still means
# what runs now, why the others went)}. A saved config with that value parses.
REMOVED: dict[str, tuple[Any, str]] = {
    "parallel.hdp_schedule": ("per_rank", "lock-step HDP was removed: per-rank HDP was "
                              "faster in every measurement (docs/results/context_and_hdp.md)"),
}


def _current(values: dict[str, Any]) -> dict[str, Any]:
  """An older config's `values` under today's names: moved fields renamed, removed ones
  dropped where their value still means what runs (another is refused)."""
  values = {MOVED.get(path, path): v for path, v in values.items()}
  for path, (kept, why) in REMOVED.items():
    if path in values and values[path] != kept:
      raise ValueError(f"{path}={values[path]!r}: {why}; remove the field (its value "
                       f"{kept!r} is what runs)")
  return {path: v for path, v in values.items() if path not in REMOVED}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    out.update(_flatten(value, path + ".") if isinstance(value, dict) else {path: value})
  return out


def _check_names(values: dict[str, Any]) -> None:
  """An unknown field would be silently ignored, a missing one fail mid-run: both are refused."""
  for path in values:
    if path not in FIELDS:
      parent = path.rpartition(".")[0]
      siblings = [f for f in FIELDS if f.rpartition(".")[0] == parent]
      raise ValueError(f"config field {path!r} is unknown; fields of {parent or 'config'}: "
                       f"{', '.join(f.rpartition('.')[2] for f in siblings)}")


def _shards(mesh, logical: str, size: int | None = None) -> int:
  """How many parts the mesh splits a dim of logical axis `logical` (of `size`, for an axis
  replicated where the mesh does not divide it) into, by the default rules."""
  shape = None if size is None else (size,)
  entry = mesh_lib.logical_to_partition_spec((logical,), mesh, shape=shape)[0]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return math.prod(mesh.shape[a] for a in axes)


def _gathered_kv_mib(values: dict[str, Any], shards: dict[str, int]) -> float:
  """MiB of one layer's K/V that all-gather context attention holds per device."""
  rows = values["data.batch_size"] // values["optimizer.grad_accum_steps"]
  if values["pipeline.schedule"] != "none":
    rows //= values["pipeline.microbatches"]
  rows = max(1, rows // shards["mesh shards of 'batch'"])
  heads = max(1, values["model.n_kv_heads"] // shards["mesh shards of 'kv_heads'"])
  head_dim = values["model.head_dim"] or values["model.d_model"] // values["model.n_heads"]
  itemsize = jax.numpy.dtype(values["model.dtype"]).itemsize
  return 2 * rows * values["data.seq_len"] * heads * head_dim * itemsize / 2**20


def _derived(mesh, values: dict[str, Any]) -> dict[str, Any]:
  sizes = {logical: values[field] for field, logical in _SHARDED_FIELDS.items()
           if logical in mesh_lib.REPLICATED_WHEN_INDIVISIBLE}
  shards = {f"mesh shards of {name!r}": _shards(mesh, name, sizes.get(name))
            for name in ("batch", *_SHARDED_FIELDS.values())}
  return {**shards, "MiB of K/V gathered per device": _gathered_kv_mib(values, shards),
          **{f"mesh axis {axis}": dict(mesh.shape).get(axis, 1)
             for axis in ("replica", "stage", "fsdp", "context")},
          "mesh axes data x fsdp": math.prod(dict(mesh.shape).get(a, 1)
                                             for a in hdp_step.SLOT_AXES),
          "processes": jax.process_count(),
          "the devices' host memory": _host_memory(mesh.devices.flat[0])}


def _host_memory(device) -> str:
  """'pinned_host' where `device` has a memory to offload to apart from its own, else
  'none' (a CPU's device memory is already the host's: jax drops the offload there)."""
  kinds = {m.kind for m in device.addressable_memories()}
  return "pinned_host" if device.platform != "cpu" and "pinned_host" in kinds else "none"


def check_workdir(workdir: Any) -> None:
  """The workdir must be a directory this process can create or write."""
  if not isinstance(workdir, (str, os.PathLike)) or not str(workdir).strip():
    raise ValueError(f"workdir={workdir!r} is invalid; it must be a directory path "
                     "(for checkpoints and metrics)")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"workdir={str(workdir)!r} is a file; it must be a directory, new or existing")
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir):
      pass
  except OSError as e:
    raise ValueError(f"workdir={str(workdir)!r} is not writable ({e.strerror}); it must be a "
                     "directory this process can create and write") from None


def field_error(path: str, value: Any) -> str | None:
  """The one-line error for `path=value` by its field's rule; None if valid or not a field."""
  rule = FIELDS.get(path)
  return None if rule is None else rule.error(path, value)


def parse(config) -> config_lib.RunConfig:
  """The typed run config of `config` (a ConfigDict or nested dict), each field checked
  alone: no mesh is built and no relation between fields is checked (see `check_config`)."""
  return config_lib.from_values(_field_values(config))


def _field_values(config) -> dict[str, Any]:
  """{'data.seq_len': 64, ...} of `config`, every name known and every value valid alone."""
  values = _current(_flatten(config.to_dict() if hasattr(config, "to_dict") else dict(config)))
  _check_names(values)
  values = {**config_lib.default_values(), **values}
  for path, value in values.items():
    error = field_error(path, value)
    if error:
      raise ValueError(error)
  return values


def check_config(config, workdir: Any = None, devices=None) -> config_lib.RunConfig:
  """The typed run config of `config`, or a one-line ValueError for the first invalid field,
  relation, mesh axis or workdir.

  Builds the config's mesh (cheap: no compilation) over `devices` (default: all of jax's;
  a TPU slice's to compile for it) to check what depends on it. With `check_memory` and
  this machine's devices, refuses a run whose memory estimate (`memory_estimate`) cannot
  fit them. `workdir=None` skips the workdir check.
  """
  values = hf.run_values(_field_values(config))  # init_from=hf:<dir>: its model and tokenizer
  twins = values["outer.comm_device"] and values["outer.name"] == "co2"
  mesh = mesh_lib.make_mesh(values["mesh"], comm_device.training_devices(twins, devices))
  related = {**values, **_derived(mesh, values)}
  for relation in RELATIONS:
    error = relation.error(related)
    if error:
      raise ValueError(error)
  run = config_lib.from_values(values)
  # The outer algorithm's own checks (e.g. CO2's stability bound), before any work.
  replicas_lib.make_outer_optimizer(run.outer)
  if run.outer.name != "none":
    replicas_lib.num_replicas(mesh, run.outer.name)
  if run.parallel.hdp:  # the pools' own checks (the order of their axes)
    hdp_step.slots(mesh)
  if run.pipeline.schedule != "none":  # the schedule's own checks (e.g. 1f1b's m >= p)
    pipeline.make_schedule(run.pipeline.schedule, stages=mesh_lib.degrees(mesh).stage,
                           microbatches=run.pipeline.microbatches,
                           virtual_stages=run.pipeline.virtual_stages,
                           vocab_overlap=run.pipeline.vocab_overlap)
  # The run's memory from its shapes, against this machine's (not when compiling for
  # another's devices: the compile report says whether it fits there).
  if run.check_memory and devices is None:
    memory_estimate.check(run, mesh)
  if workdir is not None:
    check_workdir(workdir)
  return run
