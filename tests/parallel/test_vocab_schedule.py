"""Vocabulary parallelism's S and T passes as schedule phases: where the schedule puts them,
and that the compiled loop carries the S pass's statistics all-reduce to the next tick."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import mesh as mesh_lib
from jaxsys.data import packing
from jaxsys.models import transformer
from jaxsys.optim import outer
from jaxsys.parallel import pipeline, schedules

SHAPES = [("gpipe", 2, 2, 1), ("1f1b", 4, 8, 1), ("eager_1f1b", 4, 8, 1),
          ("interleaved_1f1b", 2, 4, 2), ("zb_h1", 4, 8, 1), ("zbv", 2, 4, 2)]


@pytest.mark.parametrize("name,p,m,v", SHAPES)
def test_s_and_t_passes_in_the_ticks(name, p, m, v):
  """Each microbatch's S pass runs on its last chunk's forward tick, its T pass on the next
  tick, before the head stage's backward of that chunk, into the head's gradient slot."""
  sched = schedules.make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
  for ticks in (sched.fused, sched.unfused):
    s_tick = {int(mb): t for t, mb in enumerate(ticks.vocab_s_microbatch) if mb >= 0}
    t_tick = {int(mb): t for t, mb in enumerate(ticks.vocab_t_microbatch) if mb >= 0}
    head = {int(mb): t for t, mb in enumerate(ticks.head_microbatch) if mb >= 0}
    assert s_tick == head and sorted(t_tick) == list(range(m))
    s = sched.head_stage
    last = np.asarray(sched.chunk_of)[:, s] == sched.chunks - 1
    for mb in range(m):
      assert t_tick[mb] == s_tick[mb] + 1
      assert ticks.vocab_t_slot[t_tick[mb]] == ticks.head_slot[s_tick[mb]] >= 0
      backward, = np.nonzero(np.any(
          np.isin(ticks.kind[:, :, s], (schedules.BACKWARD, schedules.BACKWARD_INPUT))
          & (ticks.microbatch[:, :, s] == mb) & last[np.maximum(ticks.virtual[:, :, s], 0)],
          axis=1))
      assert len(backward) == 1 and backward[0] >= t_tick[mb], (mb, backward, t_tick[mb])
  rows = sched.chart(vocab_passes=True).splitlines()
  assert len(rows) == p + 3 and rows[-2].startswith("vocab S |") and "T0" in rows[-1]


_DEF = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(\([^()]*\)|\S+)\s+([\w\-]+)\((.*)$")
_CALLED = re.compile(r"(?:calls|body|true_computation|false_computation)=%([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")


def _graph(hlo: str):
  """{computation: {instruction: (is ROOT, opcode, operands, called computations, type)}},
  and the entry computation's name."""
  comps, entry = outer._computations(hlo)
  graph = {}
  for comp, lines in comps.items():
    parsed = [m.groups() for m in map(_DEF.match, lines) if m]
    names = {name for _, name, _, _, _ in parsed}
    graph[comp] = {name: (bool(root), op, [t for t in re.findall(r"%([\w.\-]+)", rest)
                                           if t in names and t != name],
                          [x.strip().lstrip("%") for a, b in _CALLED.findall(rest)
                           for x in ([a] if a else b.split(","))], shape)
                   for root, name, shape, op, rest in parsed}
  return graph, entry


def _same_tick_uses(hlo: str, stages: int):
  """The opcodes the S pass's statistics all-reduce (f32[stages, tokens, 3]) feeds within
  one iteration of the step's loop, into called computations and out of conditionals'
  branches, and whether it reaches the loop body's ROOT (the carry to the next tick)."""
  graph, entry = _graph(hlo)
  loop = next(i for i in graph[entry].values() if i[1] == "while")
  body, = loop[3]
  callers = {sub: (c, n) for c, instrs in graph.items() for n, i in instrs.items()
             for sub in i[3] if i[1] != "fusion"}
  stats = [(c, n) for c, instrs in graph.items() for n, i in instrs.items()
           if i[1] == "all-reduce" and re.match(rf"f32\[{stages},\d+,3\]", i[4])]
  assert len(stats) == 1, stats
  seen, todo, carried = set(), [stats[0]], False
  while todo:
    c, n = todo.pop()
    if (c, n) in seen:
      continue
    seen.add((c, n))
    if graph[c][n][0]:  # a ROOT: the loop's carry, or out to the caller of this branch
      carried |= c == body
      if c != body and c in callers:
        todo.append(callers[c])
      continue
    for user, (_, _, operands, called, _) in graph[c].items():
      if n in operands:
        todo.append((c, user))
        todo += [(sub, x) for sub in called for x, i in graph[sub].items() if i[1] == "parameter"]
  ops = {graph[c][n][1] for c, n in seen - {stats[0]}}
  ops |= {i[1] for c, n in seen for sub in graph[c][n][3] if graph[c][n][1] == "fusion"
          for i in graph[sub].values()}
  return ops, carried


@pytest.mark.parametrize("algorithm", [1, 2])
def test_statistics_all_reduce_is_carried_to_the_next_tick(algorithm):
  """In the compiled step, the S pass's all-reduce only reaches the loop's carried tuple
  (through its conditional's results): no compute of its own tick reads it; the T pass
  reads it in the next iteration. (Put the T pass back in the S pass's tick and the same
  iteration computes log-sum-exp, dh and its all-reduce from it.)"""
  cfg = transformer.TransformerConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4,
                                      n_kv_heads=2, d_ff=64, attention_impl="xla")
  batch = {k: jnp.asarray(v) for k, v in packing.random_packed_batch(
      8, 16, docs_per_row=2, vocab_size=cfg.vocab_size, seed=0).items()}
  mesh = mesh_lib.make_mesh("stage=2,data=4")
  layout = pipeline.Layout(stages=2, virtual=1, vocab_size=cfg.vocab_size, vocab_parallel=True)
  schedule = pipeline.make_schedule("1f1b", stages=2, microbatches=2)
  params = pipeline.to_stages(layout, transformer.init_params(cfg, jax.random.key(1)))
  hlo = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(
      cfg, schedule, layout, p, b, mesh=mesh, vocab_algorithm=algorithm)).lower(
          params, batch).compile().as_text()
  ops, carried = _same_tick_uses(hlo, stages=2)
  assert carried
  assert ops <= {"conditional", "get-tuple-element", "tuple", "bitcast", "copy"}, sorted(ops)
