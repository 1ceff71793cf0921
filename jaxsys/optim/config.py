"""The run config's `optimizer` and `outer` sections (jaxsys.config has the whole run)."""
from __future__ import annotations

import dataclasses
from typing import Literal

from jaxsys.fields import field, integer, number, optional

Optimizer = Literal["adamw"]
Outer = Literal["none", "diloco", "noloco", "co2", "streaming_diloco"]
_ALGORITHM_DEFAULT = "the algorithm's published default"


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The inner optimizer and its learning-rate curve."""
  name: Optimizer = field("adamw", "the inner optimizer")
  learning_rate: float = field(3e-3, "the peak learning rate", number(0, lo_open=True))
  warmup_steps: int = field(15, "linear warm-up steps (configs follow total_steps: 5%)",
                            integer(0))
  final_lr_fraction: float = field(0.1, "the cosine decay's end, a fraction of the peak",
                                   number(0, 1))
  b1: float = field(0.9, "Adam's beta1", number(0, 1, hi_open=True))
  b2: float = field(0.95, "Adam's beta2", number(0, 1, hi_open=True))
  eps: float = field(1e-8, "Adam's epsilon", number(0, lo_open=True))
  weight_decay: float = field(0.1, "decoupled weight decay", number(0))
  grad_clip: float = field(1.0, "the global gradient norm clipped to", number(0, lo_open=True))
  grad_accum_steps: int = field(1, "microbatches a step accumulates", integer(1))
  schedule_steps: int = field(0, "the curve's length",
                              integer(0, meaning="0: decay over total_steps"))
  schedule_offset: int = field(0, "steps of the curve already taken (e.g. by init_from's run)",
                               integer(0))
  accum_gather_once: bool = field(
      False, "accumulation over fsdp: weights gathered once a step, not per microbatch")


@dataclasses.dataclass(frozen=True)
class OuterConfig:
  """The outer (low-communication) optimizer over the mesh's `replica` axis ('none': plain
  data parallelism); None fields take the algorithm's published default
  (jaxsys/optim/diloco.py, noloco.py, co2.py, streaming.py)."""
  name: Outer = field("none", "e.g. --config.outer.name=diloco --config.mesh=replica=4,data=-1")
  sync_every: int = field(50, "inner steps between outer syncs", integer(1))
  lr: float | None = field(None, "the outer learning rate",
                           optional(number(0, lo_open=True), _ALGORITHM_DEFAULT))
  momentum: float | None = field(None, "the outer momentum",
                                 optional(number(0, 1), _ALGORITHM_DEFAULT))
  nesterov: bool = field(True, "diloco: Nesterov momentum")
  compression: Literal["none", "bf16", "int8", "fp8"] = field(
      "none", "diloco: what the outer gradients are sent as")
  error_feedback: bool = field(False, "diloco: carry the compression's error to the next sync")
  gamma: float | None = field(None, "noloco: the pull toward the group's mean",
                              optional(number(0), _ALGORITHM_DEFAULT))
  group_size: int = field(2, "noloco: 2 (random pairs) or the replica count", integer(2))
  seed: int = field(0, "noloco's pairing and random routing's draws", integer(0))
  staleness_penalty: float | None = field(
      None, "co2: its staleness penalty",
      optional(number(0, lo_open=True), _ALGORITHM_DEFAULT))
  momentum_clip: float | None = field(None, "co2: the outer momentum's clip",
                                      optional(number(0, lo_open=True), "no clipping"))
  allow_unstable: bool = field(
      False, "co2: a setting outside its stability bound warns instead of being refused")
  comm_device: bool = field(
      False, "co2: its all-reduce on each process's second half of CPU devices, overlapping "
      "the next sync_every steps (XLA:CPU; jaxsys/train/comm_device.py)")
  fragments: int = field(1, "streaming_diloco: layers synced in this many fragments in turn",
                         integer(1, meaning="fragments of layers synced in turn"))
  overlap_steps: int = field(0, "streaming_diloco: inner steps a sync's collective overlaps",
                             integer(0, meaning="inner steps a sync overlaps"))
  mixing: float = field(0.0, "streaming_diloco: the outer result as (1 - mixing) global + "
                        "mixing local", number(0, 1))
