"""Quantization rules: a regex on a parameter's path picks its scheme (or leaves it float).

Paths join the parameter dict's keys with "/": "layers/wq", "layers/w_down", "embedding",
"unembedding". The first rule whose `path` regex fully matches wins; no match keeps the
weight float. Only matmul weights are ever quantized (norm scales never are).

Example:
  rules = (Rule(r"layers/w_down", None), Rule(r"layers/.*", "w4a16", group_size=128))
  scheme_for("layers/wq", rules)  # -> Rule(path='layers/.*', scheme='w4a16', ...)
"""
from __future__ import annotations

import dataclasses
import re

from jaxsys.kernels import quant_matmul
from jaxsys.models.transformer import LAYER_MATMULS
# Weights outside the layer stack that a rule may quantize (left float by default).
OTHER_WEIGHTS = ("embedding", "unembedding")


@dataclasses.dataclass(frozen=True)
class Rule:
  """Weights whose path fully matches `path` get `scheme` (None: stay float)."""
  path: str
  scheme: str | None
  group_size: int = 128  # w4a16 only: rows of K sharing one scale

  def __post_init__(self):
    if self.scheme is not None and self.scheme not in quant_matmul.SCHEMES:
      raise ValueError(f"Rule(path={self.path!r}): scheme={self.scheme!r} is not known; choose "
                       f"one of {quant_matmul.SCHEMES} or None (float)")
    try:
      re.compile(self.path)
    except re.error as e:
      raise ValueError(f"Rule: path={self.path!r} is not a valid regex ({e})") from None
    if not isinstance(self.group_size, int) or self.group_size <= 0:
      raise ValueError(f"Rule(path={self.path!r}): group_size={self.group_size!r} must be a "
                       "positive int")


def scheme_for(path: str, rules) -> Rule | None:
  """The first rule whose regex fully matches `path`, or None (the weight stays float)."""
  for rule in rules:
    if re.fullmatch(rule.path, path):
      return rule if rule.scheme is not None else None
  return None


def default_rules(scheme: str, *, group_size: int = 128, head: bool = False) -> tuple[Rule, ...]:
  """Every layer matmul in `scheme`; embedding and LM head float unless `head`."""
  names = "|".join(LAYER_MATMULS)
  rules = [Rule(rf"layers/({names})", scheme, group_size)]
  if head:
    rules.append(Rule("unembedding", scheme, group_size))
  return tuple(rules)


def quantizable_paths(params) -> list[str]:
  """Paths of the matmul weights present in a transformer parameter dict."""
  paths = [f"layers/{n}" for n in LAYER_MATMULS if n in params.get("layers", {})]
  return paths + [n for n in OTHER_WEIGHTS if n in params]


def assign(params, rules) -> dict[str, Rule]:
  """{path: rule} for every quantizable weight some rule quantizes."""
  out = {}
  for path in quantizable_paths(params):
    rule = scheme_for(path, rules)
    if rule is not None:
      out[path] = rule
  return out
