"""Vocabulary parallelism's S and T passes as schedule phases: where the schedule puts them,
and that the compiled loop carries the S pass's statistics all-reduce to the next tick."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import hlo_flops
from jaxsys import mesh as mesh_lib
from jaxsys.data import packing
from jaxsys.models import transformer
from jaxsys.parallel import pipeline, schedules

CFG = transformer.TransformerConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4,
                                    n_kv_heads=2, d_ff=64, attention_impl="xla")
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
  """{computation: {instruction: (is ROOT, opcode, operands, called computations, type,
  tuple index or None)}}, and the entry computation's name."""
  comps, entry = hlo_flops.computations(hlo)
  graph = {}
  for comp, lines in comps.items():
    parsed = [m.groups() for m in map(_DEF.match, lines) if m]
    names = {name for _, name, _, _, _ in parsed}
    graph[comp] = {name: (bool(root), op, [t for t in re.findall(r"%([\w.\-]+)", rest)
                                           if t in names and t != name],
                          [x.strip().lstrip("%") for a, b in _CALLED.findall(rest)
                           for x in ([a] if a else b.split(","))], shape,
                          int(m[1]) if (m := re.search(r"\bindex=(\d+)", rest)) else None)
                   for root, name, shape, op, rest in parsed}
  return graph, entry


def _same_tick_uses(hlo: str, stages: int, shape: str = r"f32\[{stages},\d+,3\]"):
  """The opcodes an all-reduce of `shape` (a regex; default the S pass's statistics,
  f32[stages, tokens, 3]) feeds within one iteration of the step's loop, into called
  computations and out of conditionals' branches, and whether it reaches the loop body's
  ROOT (the carry to the next tick)."""
  graph, entry = _graph(hlo)
  loop = next(i for i in graph[entry].values() if i[1] == "while")
  body, = loop[3]
  callers = {sub: (c, n) for c, instrs in graph.items() for n, i in instrs.items()
             for sub in i[3] if i[1] != "fusion"}
  stats = [(c, n) for c, instrs in graph.items() for n, i in instrs.items()
           if i[1] == "all-reduce" and re.match(shape.format(stages=stages), i[4])]
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
    for user, (root, op, operands, called, _, _) in graph[c].items():
      if n in operands and root and op == "tuple" and c != body and c in callers:
        # Out of a branch as element k of its conditional's result: that element's readers.
        cc, cn = callers[c]
        ks = {k for k, o in enumerate(operands) if o == n}
        todo += [(cc, x) for x, i in graph[cc].items()
                 if i[1] == "get-tuple-element" and i[2] == [cn] and i[5] in ks]
      elif n in operands:
        todo.append((c, user))
        todo += [(sub, x) for sub in called for x, i in graph[sub].items() if i[1] == "parameter"]
  ops = {graph[c][n][1] for c, n in seen - {stats[0]}}
  ops |= {i[1] for c, n in seen for sub in graph[c][n][3] if graph[c][n][1] == "fusion"
          for i in graph[sub].values()}
  return ops, carried


@pytest.mark.parametrize("algorithm", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_statistics_all_reduce_is_carried_to_the_next_tick(algorithm):
  """In the compiled step, the S pass's all-reduce only reaches the loop's carried tuple
  (through its conditional's results): no compute of its own tick reads it; the T pass
  reads it in the next iteration. (Put the T pass back in the S pass's tick and the same
  iteration computes log-sum-exp, dh and its all-reduce from it.)"""
  ops, carried = _same_tick_uses(_step_hlo(algorithm, vocab_overlap=False), stages=2)
  assert carried
  assert ops <= _CARRY_OPS, sorted(ops)


def _batch():
  """8 rows of 16 tokens, two documents a row."""
  return {k: jnp.asarray(v) for k, v in packing.random_packed_batch(
      8, 16, docs_per_row=2, vocab_size=CFG.vocab_size, seed=0).items()}


# What a value that only crosses to the next loop iteration passes through.
_CARRY_OPS = {"conditional", "get-tuple-element", "tuple", "bitcast", "copy"}


def _step_hlo(algorithm: int, vocab_overlap: bool) -> str:
  """The compiled VP step of a 1F1B pipeline at p=2, m=2 (tokens a microbatch a device: 16,
  d_model 32)."""
  step, layout = _step("stage=2,data=4", algorithm, 2, vocab_overlap=vocab_overlap)
  params = pipeline.to_stages(layout, transformer.init_params(CFG, jax.random.key(1)))
  return step.lower(params, _batch()).compile().as_text()


# vocab_overlap: each pass on a tick of its own, beside the lanes.


@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (8, 32)])
def test_overlapped_passes_in_the_ticks(p, m):
  """With vocab_overlap, microbatch mb's S pass runs the tick after its head forward, its T
  pass the tick after that, its dy arrives one tick later still, where the head stage's
  backward of it runs at the earliest; 1F1B keeps its tick count (two more warmup forwards
  a stage, two more microbatches in flight)."""
  plain = schedules.make_schedule("1f1b", stages=p, microbatches=m)
  sched = schedules.make_schedule("1f1b", stages=p, microbatches=m, vocab_overlap=True)
  assert sched.ticks == plain.ticks and sched.forward_only().vocab_overlap is False
  assert sched.max_in_flight == min(m, plain.max_in_flight + schedules.VOCAB_OVERLAP_TICKS)
  for ticks in (sched.fused, sched.unfused):
    assert np.all(ticks.head_slot < 0) and np.all(ticks.vocab_t_slot < 0)
    head = {int(mb): t for t, mb in enumerate(ticks.head_microbatch) if mb >= 0}
    s_tick = {int(mb): t for t, mb in enumerate(ticks.vocab_s_microbatch) if mb >= 0}
    t_tick = {int(mb): t for t, mb in enumerate(ticks.vocab_t_microbatch) if mb >= 0}
    assert sorted(head) == list(range(m))
    s = sched.head_stage
    for mb in range(m):
      assert s_tick[mb] == head[mb] + 1 and t_tick[mb] == head[mb] + 2
      arrival = head[mb] + 3
      slot = ticks.vocab_dy_slot[arrival]
      backward, lane = np.nonzero((ticks.kind[:, :, s] == schedules.BACKWARD)
                                  & (ticks.microbatch[:, :, s] == mb))
      assert len(backward) == 1 and backward[0] >= arrival
      assert slot >= 0 and ticks.grad_in[backward[0], lane[0], s] == slot


def test_overlap_is_refused_beyond_1f1b():
  with pytest.raises(ValueError, match=r"^pipeline.vocab_overlap=True is invalid with "
                                       r"pipeline.schedule=gpipe; valid: 1f1b"):
    schedules.make_schedule("gpipe", stages=2, microbatches=2, vocab_overlap=True)


def _step(mesh_spec, algorithm, microbatches, vocab_overlap=True, cfg=None,
          vocab_parallel=True):
  """The jitted (loss, grads) of VP 1F1B (with vocab_overlap unless told) on `mesh_spec`,
  and its layout."""
  cfg = cfg or CFG
  mesh = mesh_lib.make_mesh(mesh_spec)
  stages = dict(mesh.shape)["stage"]
  layout = pipeline.Layout(stages=stages, virtual=1, vocab_size=cfg.vocab_size,
                           vocab_parallel=vocab_parallel, tensor=dict(mesh.shape).get("tensor", 1))
  schedule = pipeline.make_schedule("1f1b", stages=stages, microbatches=microbatches,
                                    vocab_overlap=vocab_overlap)
  return jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(
      cfg, schedule, layout, p, b, mesh=mesh, vocab_algorithm=algorithm)), layout


@pytest.mark.parametrize("mesh_spec,algorithm", [
    pytest.param("stage=2,data=4", 1, marks=pytest.mark.slow), ("stage=2,data=4", 2),
    pytest.param("stage=2,tensor=2,data=2", 1, marks=pytest.mark.slow),
    ("stage=2,tensor=2,data=2", 2)])
def test_overlap_matches_unpipelined(mesh_spec, algorithm):
  """1F1B with vocab_overlap: loss and gradients of the unpipelined model, Algorithms 1
  and 2, over stage and stage x tensor."""
  from tests.parallel.test_pipeline import _reference, assert_close
  cfg, params, batch, ref_loss, ref_grads = _reference(False, n_layers=2)
  step, layout = _step(mesh_spec, algorithm, 4, cfg=cfg)
  loss, grads = step(pipeline.to_stages(layout, params), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_close(pipeline.from_stages(layout, grads), ref_grads)


def test_overlap_without_vocab_parallelism_is_refused():
  step, layout = _step("stage=2,data=4", 2, 2, vocab_parallel=False)
  params = pipeline.to_stages(layout, transformer.init_params(CFG, jax.random.key(1)))
  with pytest.raises(ValueError, match=r"^pipeline.vocab_overlap=True is invalid with "
                                       r"pipeline.vocab_parallel=False"):
    step(params, _batch())


@pytest.mark.parametrize("algorithm", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_overlapped_all_reduces_are_carried(algorithm):
  """With vocab_overlap, the S pass's statistics all-reduce and the T pass's dh all-reduce
  (f32[16 tokens, 32]) each reach only the loop's carried tuple: nothing of their own tick
  computes from them, so both can overlap that tick's lanes. (Write dy into the gradient
  inbox on the T pass's tick, and the dh all-reduce feeds the norm's backward there.)"""
  hlo = _step_hlo(algorithm, vocab_overlap=True)
  for shape in (r"f32\[{stages},\d+,3\]", r"f32\[16,32\]"):
    ops, carried = _same_tick_uses(hlo, stages=2, shape=shape)
    assert carried, shape
    assert ops <= _CARRY_OPS, (shape, sorted(ops))


# Each tick's vocabulary conditionals hold shard_map collectives, which all get channel 1.

_CHANNEL_1 = re.compile(r"\b(all-reduce|collective-permute|all-gather|reduce-scatter|all-to-all)"
                        r"\(.*\bchannel_id=1\b")


def _channel_1_conditionals(hlo: str):
  """The loop body's conditionals holding a channel-1 collective (in any computation they
  call), and for each its ancestors in the body: what it reads, through any chain."""
  comps, _ = hlo_flops.computations(hlo)
  graph, entry = _graph(hlo)
  body, = next(i for i in graph[entry].values() if i[1] == "while")[3]

  def holds(comp, seen=()):
    return comp not in seen and (any(_CHANNEL_1.search(line) for line in comps[comp]) or any(
        holds(sub, (*seen, comp)) for i in graph[comp].values() for sub in i[3]))

  def ancestors(name):
    found, todo = set(), list(graph[body][name][2])
    while todo:
      if (n := todo.pop()) not in found:
        found.add(n)
        todo += graph[body][n][2]
    return found
  return {n: ancestors(n) for n, i in graph[body].items()
          if i[1] == "conditional" and any(holds(b) for b in i[3])}


@pytest.mark.parametrize("vocab_overlap", [False, True])
def test_vocabulary_conditionals_run_one_at_a_time_on_cpu(vocab_overlap):
  """XLA:CPU starts a device's independent conditionals at once; with every shard_map
  collective on channel 1, devices could then meet in different ones' all-reduces (a
  rendezvous abort in CI; or wrong sums). In the compiled step each conditional holding
  one reads, through some chain, what every earlier one gives. (Give each its predicate
  alone, and the embedding's conditional no longer waits for the T pass's.)"""
  conds = _channel_1_conditionals(_step_hlo(2, vocab_overlap=vocab_overlap))
  assert len(conds) >= 4, sorted(conds)
  unordered = [(a, b) for a in conds for b in conds
               if a < b and a not in conds[b] and b not in conds[a]]
  assert not unordered, unordered
