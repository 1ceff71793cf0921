"""The strategies a run composes, the config that switches each on, and which combine.

Each strategy is a set of config overrides for an instance of size 2 (a mesh axis of 2,
two microbatches, two accumulation steps); `OPTIONS` lists each one's variants (schedules,
context layouts, outer optimizers, routing). `compose` merges strategies into one run's
overrides on a number of devices (the devices no strategy claims go to `data`), and
`refusal` asks `config_check` whether that run can be served: None, or its one-line
reason. The combination tests, the support matrix in the README and `docs/design.md` are
all generated from these, so they cannot drift from what the code accepts.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import ml_collections

from jaxsys.train import config_check


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A strategy at size 2: the mesh axes it adds and the config fields it sets."""
  axes: tuple[tuple[str, int], ...] = ()
  fields: tuple[tuple[str, Any], ...] = ()


STRATEGIES: dict[str, Strategy] = {
    "data": Strategy(),  # the data axis: the devices no other strategy claims
    "fsdp": Strategy(axes=(("fsdp", 2),)),
    "tensor": Strategy(axes=(("tensor", 2),)),
    "context": Strategy(axes=(("context", 2),)),
    "pipeline": Strategy(axes=(("stage", 2),), fields=(("pipeline.schedule", "1f1b"),
                                                       ("pipeline.microbatches", 2))),
    "outer": Strategy(axes=(("replica", 2),), fields=(("outer.name", "diloco"),)),
    "accumulation": Strategy(fields=(("optimizer.grad_accum_steps", 2),)),
    "hdp": Strategy(fields=(("parallel.hdp", True), ("data.variable_length", True))),
}

# Each strategy's variants: field -> values (the first is the one `STRATEGIES` sets).
OPTIONS: dict[str, dict[str, tuple]] = {
    "pipeline": {"pipeline.schedule": ("1f1b", "gpipe", "interleaved_1f1b"),
                 "pipeline.vocab_parallel": (False, True)},
    "context": {"parallel.context_layout": ("zigzag", "contiguous"),
                "parallel.context_algorithm": ("ring", "all_gather", "ulysses")},
    "outer": {"outer.name": ("diloco", "streaming_diloco", "noloco", "co2"),
              "pipeline.routing": ("fixed", "random")},
    "hdp": {"parallel.hdp_widen_rings": (False, True)},
}


def compose(names, devices: int = 8, **options) -> dict[str, Any]:
  """Dotted config overrides for the strategies `names` on `devices` devices.

  `options`: variants by field with dots as '__' (`pipeline__schedule="gpipe"`); an
  interleaved schedule gets 2 virtual stages and 4 microbatches. `data` takes the devices
  the others leave."""
  axes: dict[str, int] = {}
  fields: dict[str, Any] = {}
  for name in names:
    strategy = STRATEGIES[name]
    axes.update(strategy.axes)
    fields.update(strategy.fields)
  fields.update({k.replace("__", "."): v for k, v in options.items()})
  if fields.get("pipeline.schedule") == "interleaved_1f1b":
    fields.update({"pipeline.virtual_stages": 2, "pipeline.microbatches": 4})
  claimed = math.prod(axes.values())
  if devices % claimed == 0 and devices > claimed:
    axes["data"] = devices // claimed
  order = ("replica", "data", "stage", "fsdp", "context", "tensor")
  fields["mesh"] = ",".join(f"{a}={axes[a]}" for a in order if a in axes) or "data=-1"
  return fields


def pairs() -> list[tuple[str, str]]:
  """Every pair of strategies."""
  return list(itertools.combinations(STRATEGIES, 2))


def set_fields(config: ml_collections.ConfigDict, overrides: dict[str, Any],
               sep: str = ".") -> ml_collections.ConfigDict:
  """`config` with `overrides` set in place, each name a path of fields joined by `sep`."""
  for path, value in overrides.items():
    *parents, leaf = path.split(sep)
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def apply(config: ml_collections.ConfigDict, overrides: dict[str, Any]
          ) -> ml_collections.ConfigDict:
  """A copy of `config` with dotted `overrides` set."""
  return set_fields(ml_collections.ConfigDict(config.to_dict()), overrides)


def refusal(config: ml_collections.ConfigDict) -> str | None:
  """config_check's one-line reason this run cannot be served, or None."""
  try:
    config_check.check_config(config)
  except ValueError as e:
    return str(e)
  return None


def variants(names) -> list[dict[str, Any]]:
  """Each non-default variant of the strategies `names`, as one field's override."""
  return [{field: value} for name in names for field, values in OPTIONS.get(name, {}).items()
          for value in values[1:]]


def support_matrix(base: ml_collections.ConfigDict, devices: int = 8) -> dict:
  """{(a, b): (variant, refusal)} for every pair: (None, None) if strategies a and b combine
  on `base` as `STRATEGIES` sets them; else ({field: value}, None) for the first variant of
  theirs (`OPTIONS`) with which they combine, or (None, the defaults' refusal)."""
  out = {}
  for a, b in pairs():
    why = refusal(apply(base, compose((a, b), devices)))
    works = (next((v for v in variants((a, b))
                   if refusal(apply(base, compose((a, b), devices, **{
                       k.replace(".", "__"): x for k, x in v.items()}))) is None), None)
             if why else None)
    out[a, b] = (works, None) if works else (None, why)
  return out


def matrix_markdown(matrix: dict) -> str:
  """The matrix as a markdown table: strategies as rows and columns, each cell 'yes', 'yes'
  with a numbered note naming the variant it needs, or a numbered refusal, listed below."""
  names = list(STRATEGIES)
  notes: list[str] = []
  cell = {}
  for (a, b), (variant, why) in matrix.items():
    if variant is None and why is None:
      mark = "yes"
    else:
      note = (_reason(why) if why else "with " + ", ".join(
          f"{field}={value}" for field, value in variant.items()))
      if note not in notes:
        notes.append(note)
      mark = f"{'no' if why else 'yes'} ({notes.index(note) + 1})"
    cell[a, b] = cell[b, a] = mark
  rows = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  for a in names:
    rows.append(f"| {a} | " + " | ".join("-" if a == b else cell[a, b] for b in names) + " |")
  return "\n".join(rows + [""] + [f"({i + 1}) {note}" for i, note in enumerate(notes)])


def _reason(refusal: str) -> str:
  """A refusal without the values of one config: 'field must ...' (relations' wording)."""
  if "; it must " not in refusal:
    return refusal
  return f"{refusal.split('=')[0]} must {refusal.split('; it must ', 1)[1]}"
