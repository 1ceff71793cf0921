"""The typed run config: one frozen dataclass per section, each field with its default, type,
one-line doc and rule of valid values together (`jaxsys.fields`). A section the library
below owns lives beside it (`models.transformer.TransformerConfig`, `data.config`,
`optim.config`); the rest are here, with the `RunConfig` that gathers them.

A config file (configs/tiny_lm.py) starts from `defaults()` and overrides what differs;
`jaxsys.train.config_check.check_config` checks every field by its rule and the relations
between fields, and returns a `RunConfig`. Library code takes its typed section
(`run.data`, `run.optimizer`, `run.outer`, ...) and trusts it. The sections are named as
in the code, in the config file too (`--config.outer.name=diloco`).

Example::

  run = check_config(tiny_lm.get_config("test"))
  loader = make_loader(run.data, "val", batch_size=8, seed=run.seed)
  run = dataclasses.replace(run, optimizer=dataclasses.replace(run.optimizer, eps=1.0))
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

import ml_collections

from jaxsys import fields
from jaxsys import mesh as mesh_lib
from jaxsys.checkpoint import layouts
from jaxsys.checkpoint.manager import NUMERIC_FIELDS
from jaxsys.data.config import DataConfig
from jaxsys.fields import field, integer, text
from jaxsys.models.transformer import TransformerConfig
from jaxsys.optim.config import OptimizerConfig, OuterConfig
from jaxsys.parallel import context, pipeline

# Choices whose names the library owns, as types (a Literal of the library's tuple).
ContextLayout = Literal[context.LAYOUTS]
ContextAlgorithm = Literal[tuple(context.ALGORITHMS)]
Schedule = Literal[pipeline.SCHEDULES]
Merge = Literal[layouts.MERGES]


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """Context parallelism over a `context` axis, and HDP (ByteScale) over the batch axes."""
  context_layout: ContextLayout = field(
      "zigzag", "zigzag evens the causal work over the ring; contiguous is the naive order")
  context_algorithm: ContextAlgorithm = field(
      "ring", "ring passes K/V blocks round; all_gather gathers them all (Llama 3's); "
      "ulysses splits the heads by all-to-all")
  context_gather_mib: int = field(1024, "all_gather's budget for one layer's K/V per device",
                                  integer(1))
  hdp: bool = field(False, "Hybrid Data Parallelism over data, fsdp and tensor "
                    "(data.variable_length=true): each document on the devices it needs")
  hdp_widen_rings: bool = field(
      False, "a ring may take up to twice the devices it needs where that ends sooner by "
      "FLOPs (better balance, more padding)")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """Pipeline parallelism over the mesh's `stage` axis (jaxsys/parallel/pipeline/)."""
  schedule: Schedule = field("none", "'none': no pipeline; e.g. 1f1b with mesh stage=4,data=2")
  microbatches: int = field(4, "microbatches a step", integer(1))
  virtual_stages: int = field(1, "chunks a stage (interleaved schedules)", integer(1))
  vocab_parallel: bool = field(False, "embedding and output layer split over stage x tensor")
  vocab_algorithm: int = field(
      2, "2 syncs once a microbatch; 1 is the paper's naive baseline",
      fields.Rule(lambda v: fields.is_int(v) and v in (1, 2),
                  "1 or 2 (the Vocabulary Parallelism paper's algorithms)"))
  vocab_overlap: bool = field(False, "1f1b: a microbatch's S and T passes beside the next two "
                              "ticks' compute, at two more microbatches in flight")
  routing: Literal["fixed", "random"] = field(
      "fixed", "replica x stage: each microbatch to its own replica's next stage, or (random, "
      "NoLoCo) to a replica drawn per step, microbatch and boundary (seed: outer.seed)")
  gather_once: bool = field(False, "with fsdp: each stage's weights gathered once a step, not "
                            "every tick (always so beside tensor)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Checkpoints beyond their cadence: corruption, replica merges, snapshots in RAM."""
  on_corrupt: Literal["error", "previous"] = field(
      "error", "a step failing its checksums: stop naming it, or resume from the newest that "
      "verifies")
  merge_replicas: Merge = field("mean", "a replica run resumed as fewer replicas or one model: "
                                "the replicas' mean or replica 0")
  snapshot_every: int = field(0, "also snapshot the state into RAM every N steps (one process)",
                              integer(0, meaning="0: no snapshots in RAM"))
  snapshot_dir: str = field("", "the snapshots' directory in RAM",
                            text("a directory in RAM, or '' (one on /dev/shm for the workdir)"))


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  steps: str = field("", "'N,M': a jax.profiler trace of steps N to M into <workdir>/profile",
                     text("'N,M' (trace steps N to M, e.g. '3,5') or '' (no profile)",
                          lambda v: re.fullmatch(r"(\d+,\d+)?", v)))


_SECTIONS = {"model": TransformerConfig, "data": DataConfig, "optimizer": OptimizerConfig,
             "outer": OuterConfig, "parallel": ParallelConfig, "pipeline": PipelineConfig,
             "checkpoint": CheckpointConfig, "profile": ProfileConfig}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole run, every field checked."""
  seed: int = field(0, "parameters' and data order's seed", integer(0, 2**32 - 1))
  total_steps: int = field(300, "optimizer steps", integer(1))
  log_every: int = field(10, "steps between metric rows", integer(1))
  eval_every: int = field(100, "steps between evaluations",
                          integer(0, meaning="0: never evaluate"))
  eval_steps: int = field(8, "val batches an evaluation", integer(1))
  checkpoint_every: int = field(100, "steps between checkpoints",
                                integer(0, meaning="0: save only at the end"))
  keep_checkpoints: int = field(3, "checkpoints kept", integer(1))
  # parse_mesh_spec raises its own line for a malformed spec.
  mesh: str = field("data=-1", "the device mesh, e.g. 'fsdp=8' or 'data=2,tensor=4'",
                    text(f"a mesh spec such as 'data=-1' or 'data=2,tensor=4' over axes "
                         f"{', '.join(mesh_lib.AXIS_NAMES)}", mesh_lib.parse_mesh_spec))
  init_from: str = field(
      "", "a fresh run's start: another run's workdir, 'hf:<dir>' (a Hugging Face "
      "checkpoint, whose config.json sets the model's shape), or '' (random)",
      text("a run's workdir, 'hf:<dir>' (a Hugging Face Llama checkpoint), or '' (random "
           "init)"))
  allow_model_change: str = field(
      "", "comma-separated model fields a resume or init_from may change",
      text(f"'' or a comma-separated subset of {', '.join(NUMERIC_FIELDS)}",
           lambda v: set(_names(v)) <= set(NUMERIC_FIELDS)))
  check_memory: bool = field(True, "refuse a run whose estimated memory exceeds the machine's")
  model: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  outer: OuterConfig = dataclasses.field(default_factory=OuterConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
  pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)

  @property
  def model_changes(self) -> tuple[str, ...]:
    """`allow_model_change` as field names."""
    return _names(self.allow_model_change)

  def to_dict(self) -> dict[str, Any]:
    """The config file's nested form (what a checkpoint records as its config)."""
    return dataclasses.asdict(self)


def _names(value: str) -> tuple[str, ...]:
  return tuple(filter(None, map(str.strip, value.split(","))))


def _top_fields() -> list[dataclasses.Field]:
  return [f for f in dataclasses.fields(RunConfig) if f.name not in _SECTIONS]


def field_rules() -> dict[str, fields.Rule]:
  """{'data.seq_len': its rule, 'seed': ..., ...}: every field of a run."""
  out = fields.rules(RunConfig)
  for section, cls in _SECTIONS.items():
    out.update({f"{section}.{name}": rule for name, rule in fields.rules(cls).items()})
  return out


def default_values() -> dict[str, Any]:
  """{'data.seq_len': 256, ...}: every field's default."""
  out = {f.name: f.default for f in _top_fields()}
  for section, cls in _SECTIONS.items():
    out.update({f"{section}.{f.name}": f.default for f in dataclasses.fields(cls)})
  return out


def defaults() -> ml_collections.ConfigDict:
  """Every field at its default as a config file's ConfigDict (a None default is a typed
  placeholder, so a command line can set it)."""
  c = ml_collections.ConfigDict({f.name: f.default for f in _top_fields()})
  for section, cls in _SECTIONS.items():
    c[section] = ml_collections.ConfigDict(
        {f.name: f.default if f.default is not None else ml_collections.config_dict.placeholder(
            fields.scalar_type(cls, f.name)) for f in dataclasses.fields(cls)})
  return c


def from_values(values: dict[str, Any]) -> RunConfig:
  """The run config of checked flat values {'data.seq_len': 64, 'seed': 0, ...}."""
  top: dict[str, Any] = {}
  sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
  for path, value in values.items():
    section, _, name = path.rpartition(".")
    (sections[section] if section else top)[name] = value
  return RunConfig(**top, **{name: _SECTIONS[name](**kw) for name, kw in sections.items()})
