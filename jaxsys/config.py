"""The typed run config: one frozen dataclass per group of fields, parsed once.

`jaxsys.train.config_check.check_config` validates an ml_collections config (every field
of configs/tiny_lm.py) and returns a `RunConfig`; library code takes its typed section
(`run.data`, `run.optimizer`, `run.outer`, ...) and trusts it. The config file's
`optimizer.outer` and `optimizer.outer_<name>` fields become `run.outer.name` and
`run.outer.<name>`: the outer optimizer is its own section.

Example::

  run = check_config(tiny_lm.get_config("test"))
  loader = make_loader(run.data, "val", batch_size=8, seed=run.seed)
  run = dataclasses.replace(run, optimizer=dataclasses.replace(run.optimizer, eps=1.0))
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxsys.models.transformer import TransformerConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str  # 'stdlib', a directory, or a file glob (text files, or JSONL: a record a document)
  tokenizer: str
  vocab_size: int
  seq_len: int
  batch_size: int  # global rows (packed) a step
  num_threads: int  # 0: load in the training thread
  variable_length: bool  # whole documents (HDP) instead of packed rows
  max_len: int  # longest whole document, in tokens
  truncate_long: bool  # cut a longer document instead of refusing it
  text_field: str = "text"  # a JSONL record's field that holds its text


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The inner optimizer and its learning-rate curve."""
  name: str
  learning_rate: float
  warmup_steps: int
  final_lr_fraction: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  grad_clip: float
  grad_accum_steps: int
  schedule_steps: int  # 0: decay over total_steps
  schedule_offset: int  # steps of the curve already taken
  accum_gather_once: bool = False  # accumulation: weights gathered once a step, not per microbatch


@dataclasses.dataclass(frozen=True)
class OuterConfig:
  """The outer optimizer over `replica` ('none': plain data parallelism); None fields take
  the algorithm's published default."""
  name: str
  sync_every: int
  lr: float | None
  momentum: float | None
  nesterov: bool
  compression: str
  error_feedback: bool
  gamma: float | None
  group_size: int
  seed: int
  staleness_penalty: float | None
  momentum_clip: float | None
  allow_unstable: bool
  comm_device: bool
  fragments: int
  overlap_steps: int
  mixing: float


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  context_layout: str
  context_algorithm: str
  context_gather_mib: int  # all_gather's budget for one layer's gathered K/V per device
  hdp: bool
  hdp_widen_rings: bool


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  schedule: str  # 'none': no pipeline
  microbatches: int
  virtual_stages: int
  vocab_parallel: bool
  vocab_algorithm: int
  vocab_overlap: bool  # VP's S and T passes on ticks of their own, beside the lanes (1f1b)
  routing: str
  gather_once: bool  # with fsdp: each stage's weights gathered once a step, not every tick


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  on_corrupt: str
  merge_replicas: str
  snapshot_every: int
  snapshot_dir: str


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  steps: str  # 'N,M': trace steps N to M; '': no profile


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole run, every field checked (see configs/tiny_lm.py for what each means)."""
  seed: int
  total_steps: int
  log_every: int
  eval_every: int
  eval_steps: int
  checkpoint_every: int
  keep_checkpoints: int
  mesh: str
  init_from: str
  allow_model_change: tuple[str, ...]  # model fields a resume or init_from may change
  model: TransformerConfig
  data: DataConfig
  optimizer: OptimizerConfig
  outer: OuterConfig
  parallel: ParallelConfig
  pipeline: PipelineConfig
  checkpoint: CheckpointConfig
  profile: ProfileConfig
  check_memory: bool = True  # refuse a run whose estimated memory exceeds the machine's

  def to_dict(self) -> dict[str, Any]:
    """The config file's nested form (what a checkpoint records as its config)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if dataclasses.is_dataclass(value):
        group, fields = _FILE_GROUP.get(field.name, field.name), dataclasses.asdict(value)
        out.setdefault(group, {}).update(
            {_file_name(field.name, k): v for k, v in fields.items()})
      else:
        out[field.name] = ",".join(value) if field.name == "allow_model_change" else value
    return out


_FILE_GROUP = {"outer": "optimizer"}  # a section the config file keeps inside another group


def _file_name(section: str, field: str) -> str:
  """The config file's name of a section's field: outer.lr is optimizer.outer_lr."""
  if section != "outer":
    return field
  return "outer" if field == "name" else f"outer_{field}"


def _section_of(path: str) -> tuple[str, str]:
  """('outer', 'lr') for 'optimizer.outer_lr'; ('data', 'seq_len') for 'data.seq_len'."""
  group, _, name = path.rpartition(".")
  if group == "optimizer" and (name == "outer" or name.startswith("outer_")):
    return "outer", name.partition("_")[2] or "name"
  return group, name


_TYPES = {"model": TransformerConfig, "data": DataConfig, "optimizer": OptimizerConfig,
          "outer": OuterConfig, "parallel": ParallelConfig, "pipeline": PipelineConfig,
          "checkpoint": CheckpointConfig, "profile": ProfileConfig}


def from_values(values: dict[str, Any]) -> RunConfig:
  """The run config of checked flat values {'data.seq_len': 64, 'seed': 0, ...}."""
  top: dict[str, Any] = {}
  sections: dict[str, dict[str, Any]] = {name: {} for name in _TYPES}
  for path, value in values.items():
    section, name = _section_of(path)
    (sections[section] if section else top)[name] = value
  top["allow_model_change"] = tuple(
      filter(None, map(str.strip, top["allow_model_change"].split(","))))
  return RunConfig(**top, **{name: _TYPES[name](**fields) for name, fields in sections.items()})
