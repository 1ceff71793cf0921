"""Which outputs of a function depend on which of its inputs, read off its jaxpr.

The pipeline stores a chunk's vjp residuals between its forward and its backward. Some
residuals are functions of the weights alone (a reshaped or transposed weight, a norm
scale broadcast per layer); storing them would keep a copy of the stage's weights per
microbatch in flight. `depends_on` finds them so the backward recomputes them from the
live weights instead. The walk is conservative: an equation it does not look inside
makes every output depend on every input, which only means storing more.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.extend import core


def depends_on(fn: Callable, args: Sequence, data: Sequence[bool]) -> list[bool]:
  """For each leaf of fn(*args)'s output: does it depend on the args flagged in `data`?"""
  leaves = [jax.tree.leaves(a) for a in args]
  flags = [flag for arg, flag in zip(leaves, data) for _ in arg]
  return outputs_depend_on(jax.make_jaxpr(fn)(*args).jaxpr, flags)


def outputs_depend_on(jaxpr: core.Jaxpr, inputs: Sequence[bool]) -> list[bool]:
  """For each output of `jaxpr`: does it depend on the inputs flagged in `inputs`?"""
  return _walk(jaxpr, inputs)


def _walk(jaxpr, inputs: Sequence[bool]) -> list[bool]:
  dep = dict(zip(jaxpr.invars, inputs))

  def of(atom) -> bool:
    return not isinstance(atom, core.Literal) and dep.get(atom, False)

  for eqn in jaxpr.eqns:
    ins = [of(a) for a in eqn.invars]
    if not any(ins):
      outs = [False] * len(eqn.outvars)
    elif eqn.primitive.name == "scan":
      outs = _scan(eqn, ins)
    else:
      inner = _inner_jaxpr(eqn)
      outs = _walk(inner, ins) if inner is not None else [True] * len(eqn.outvars)
    dep.update(zip(eqn.outvars, outs))
  return [of(v) for v in jaxpr.outvars]


def _inner_jaxpr(eqn):
  """The one sub-jaxpr whose inputs and outputs are the equation's own (pjit, remat, custom
  derivatives), or None."""
  found = []
  for value in eqn.params.values():
    jaxpr = value.jaxpr if isinstance(value, core.ClosedJaxpr) else value
    if (isinstance(jaxpr, core.Jaxpr) and len(jaxpr.invars) == len(eqn.invars)
        and len(jaxpr.outvars) == len(eqn.outvars)):
      found.append(jaxpr)
  return found[0] if len(found) == 1 else None


def _scan(eqn, ins: list[bool]) -> list[bool]:
  """A scan's carries depend on data once any iteration feeds data into them (a fixpoint)."""
  n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
  body = eqn.params["jaxpr"].jaxpr
  consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
  while True:
    outs = _walk(body, consts + carry + xs)
    new = [a or b for a, b in zip(carry, outs[:n_carry])]
    if new == carry:
      return new + outs[n_carry:]
    carry = new
