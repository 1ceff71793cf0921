"""Config fields: each with its default, its rule of valid values and a one-line doc, together.

A config section is a frozen dataclass whose fields are declared with `field(default, doc,
rule)`; a `Literal[...]` or `bool` field needs no rule (its type is one). `rules(cls)`
gives every field's rule, which the config check applies to a user's value, so a bad
value is one line naming the field, the value and what is valid. Example::

  @dataclasses.dataclass(frozen=True)
  class PipelineConfig:
    schedule: Literal["none", "gpipe", "1f1b"] = field("none", "'none': no pipeline")
    microbatches: int = field(4, "microbatches a step", integer(1))
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rule:
  """A field's valid values: a predicate, the words that describe them, or a list of choices."""
  ok: Callable[[Any], bool]
  valid: str = ""
  choices: tuple[Any, ...] = ()

  def error(self, path: str, value: Any) -> str | None:
    """The one-line error for `path=value`, None when the value is valid."""
    if self.ok(value):
      return None
    if self.choices:
      return f"{path}={value!r} is unknown; valid: {', '.join(map(str, self.choices))}"
    return f"{path}={value!r} is invalid; it must be {self.valid}"


def is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v) -> bool:
  return (is_int(v) or isinstance(v, (float, np.floating))) and math.isfinite(v)


# Rule builders; `meaning` says what a special value (e.g. 0) means.
def integer(lo: int, hi: int | None = None, meaning: str = "") -> Rule:
  valid = f"an int >= {lo}" + ("" if hi is None else f" and <= {hi}")
  return Rule(lambda v: is_int(v) and lo <= v and (hi is None or v <= hi),
              valid + (f" ({meaning})" if meaning else ""))


def number(lo: float, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False) -> Rule:
  def ok(v):
    return (_is_number(v) and (v > lo if lo_open else v >= lo)
            and (hi is None or (v < hi if hi_open else v <= hi)))
  upper = "" if hi is None else f" and {'<' if hi_open else '<='} {hi}"
  return Rule(ok, f"a number {'>' if lo_open else '>='} {lo}{upper}")


def one_of(*choices) -> Rule:
  return Rule(lambda v: isinstance(v, str) and v in choices, choices=choices)


def optional(rule: Rule, meaning: str) -> Rule:
  return Rule(lambda v: v is None or rule.ok(v), f"{rule.valid}, or None ({meaning})")


def text(valid: str, ok: Callable[[str], bool] = lambda v: True) -> Rule:
  """A string field; `ok` its further condition, `valid` the words for what passes."""
  return Rule(lambda v: isinstance(v, str) and bool(ok(v)), valid)


BOOL = Rule(lambda v: isinstance(v, (bool, np.bool_)), "True or False")


def field(default: Any, doc: str, rule: Rule | None = None) -> Any:
  """A config field: its default, a one-line doc and its rule (None: from its type)."""
  return dataclasses.field(default=default, metadata={"doc": doc, "rule": rule})


def rules(cls) -> dict[str, Rule]:
  """{field name: its rule} of a section: declared, or from its Literal or bool type."""
  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    rule, kind = f.metadata.get("rule"), hints[f.name]
    if dataclasses.is_dataclass(kind):  # a section of its own
      continue
    if rule is None:
      if kind is bool:
        rule = BOOL
      elif typing.get_origin(kind) is typing.Literal:
        rule = one_of(*typing.get_args(kind))
      else:
        raise TypeError(f"{cls.__name__}.{f.name}: a {kind} field needs a rule")
    out[f.name] = rule
  return out


def docs(cls) -> dict[str, str]:
  """{field name: its one-line doc} of a section."""
  return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def scalar_type(cls, name: str) -> type:
  """The type a None-default field takes when set (int for `int | None`)."""
  kind = typing.get_type_hints(cls)[name]
  return next(t for t in typing.get_args(kind) if t is not type(None))
