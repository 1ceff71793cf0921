"""Pipeline schedules as static tables: which stage does what at each tick, and where data lives.

Time is counted in ticks; at each tick every stage does one action: IDLE, FORWARD or
BACKWARD of one (microbatch, virtual) chunk, forward and backward costing the same. There
are G = stages * virtual_stages global chunks; chunk g runs on stage g % stages with virtual
index g // stages. Activations flow chunk 0 -> G-1, gradients G-1 -> 0; what a stage sends
at tick t reaches stage (s +- 1) % stages at tick t + 1. The loss head runs at the end of
the tick of FORWARD(mb, G-1), so BACKWARD(mb, G-1) can run one tick later.

A schedule is a per-stage program order (the op sequence of GPipe, 1F1B or Megatron's
interleaved 1F1B) turned into ticks by an as-soon-as-possible simulation, plus the buffer
slots an executor needs: residuals kept for the backward, and the activation and gradient
inboxes. This module is pure numpy so it imports anywhere, fast; the executor only reads
the tables.

Ticks assume forward and backward cost the same; `timed(schedule, Costs(...))` gives the
time they take when they do not, run asynchronously (each stage starts an op as soon as
its inputs arrive) or in lock step (the executor: a tick lasts its slowest action).

Example:
  sched = make_schedule("1f1b", stages=4, microbatches=8)
  sched.ticks, sched.bubble_fraction, sched.max_in_flight   # 22, 3/11, 4
  print(sched.chart())
  timed(sched, Costs(forward=1, backward=2)).lockstep   # 40.0 (GPipe: 33.0)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

IDLE, FORWARD, BACKWARD = 0, 1, 2
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")

# An op in a stage's program: (kind, microbatch, global chunk).
_Op = tuple[int, int, int]


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """A pipeline schedule: int32 tables [ticks, stages] (-1 where unused) and per-tick vectors.

  kind, microbatch, virtual: the action of each stage at each tick.
  res_slot: residual-buffer slot a FORWARD writes and its BACKWARD reads (then frees).
  act_recv / act_in: activation-inbox slot written by the arrival at the start of the tick /
    read by a FORWARD of chunk > 0 (freed after the tick).
  grad_recv / grad_in: the same for the gradient inbox; BACKWARD reads its output gradient
    from grad_in. head_slot[t]: the slot on stage (G-1) % stages that the loss head writes at
    the end of tick t (-1: no head that tick).
  head_microbatch, embed_microbatch, embed_grad_microbatch [ticks]: microbatch of the
    FORWARD of chunk G-1 / FORWARD of chunk 0 / BACKWARD of chunk 0 at each tick, -1 none.
  res_slots, act_slots, grad_slots: buffer sizes per stage.
  """
  name: str
  stages: int
  microbatches: int
  virtual_stages: int
  kind: np.ndarray
  microbatch: np.ndarray
  virtual: np.ndarray
  res_slot: np.ndarray
  act_recv: np.ndarray
  act_in: np.ndarray
  grad_recv: np.ndarray
  grad_in: np.ndarray
  head_slot: np.ndarray
  head_microbatch: np.ndarray
  embed_microbatch: np.ndarray
  embed_grad_microbatch: np.ndarray
  res_slots: int
  act_slots: int
  grad_slots: int
  # Per-stage program order, kept so forward_only() can re-simulate the same order.
  programs: tuple[tuple[_Op, ...], ...] = dataclasses.field(repr=False, default=())

  @property
  def ticks(self) -> int:
    return int(self.kind.shape[0])

  @property
  def chunks(self) -> int:
    """G, the number of global chunks."""
    return self.stages * self.virtual_stages

  @property
  def chunk(self) -> np.ndarray:
    """Global chunk index of each action [ticks, stages], -1 when idle."""
    stage = np.arange(self.stages, dtype=np.int32)[None, :]
    return np.where(self.kind == IDLE, -1, self.virtual * self.stages + stage).astype(np.int32)

  @property
  def bubble_fraction(self) -> float:
    """Idle stage-ticks over all stage-ticks."""
    return float(np.sum(self.kind == IDLE)) / float(self.kind.size)

  @property
  def useful_fraction(self) -> float:
    return 1.0 - self.bubble_fraction

  @property
  def max_in_flight(self) -> int:
    """Most (microbatch, virtual) chunks one stage holds between FORWARD and BACKWARD.

    0 for a forward-only schedule, which keeps nothing for a backward.
    """
    if not np.any(self.kind == BACKWARD):
      return 0
    held = np.cumsum(self.kind == FORWARD, axis=0) - np.cumsum(self.kind == BACKWARD, axis=0)
    return int(held.max())

  def forward_only(self) -> Schedule:
    """The FORWARD actions alone, in the same per-stage order, re-timed (for evaluation)."""
    programs = [[op for op in prog if op[0] == FORWARD] for prog in self.programs]
    return _build(self.name, self.stages, self.microbatches, self.virtual_stages, programs)

  def summary(self) -> str:
    return (f"schedule={self.name} stages={self.stages} microbatches={self.microbatches} "
            f"virtual={self.virtual_stages} ticks={self.ticks} "
            f"bubble={self.bubble_fraction:.3f} max_in_flight={self.max_in_flight}")

  def chart(self) -> str:
    """One row per stage, one cell per tick: F<mb> forward, b<mb> backward, '.' idle.

    With virtual stages a letter names the virtual index (F3a = microbatch 3, virtual 0).
    """
    def cell(k: int, mb: int, v: int) -> str:
      if k == IDLE:
        return "."
      tag = ""
      if self.virtual_stages > 1:
        tag = chr(ord("a") + v) if self.virtual_stages <= 26 else f":{v}"
      return ("F" if k == FORWARD else "b") + f"{mb}{tag}"

    cells = [[cell(int(self.kind[t, s]), int(self.microbatch[t, s]), int(self.virtual[t, s]))
              for t in range(self.ticks)] for s in range(self.stages)]
    width = max(len(c) for row in cells for c in row) if self.ticks else 1
    label = len(str(self.stages - 1))
    lines = [self.summary()]
    for s, row in enumerate(cells):
      lines.append((f"stage {s:>{label}} | " + " ".join(c.ljust(width) for c in row)).rstrip())
    return "\n".join(lines)


def make_schedule(name: str, *, stages: int, microbatches: int,
                  virtual_stages: int = 1) -> Schedule:
  """The schedule `name` (gpipe, 1f1b or interleaved_1f1b) for the given sizes."""
  check(name, stages=stages, microbatches=microbatches, virtual_stages=virtual_stages)
  p, m, v = int(stages), int(microbatches), int(virtual_stages)
  if name == "gpipe":
    programs = [_gpipe_program(s, p, m) for s in range(p)]
  elif name == "1f1b":
    programs = [_interleaved_program(s, p, m, 1) for s in range(p)]
  else:
    programs = [_interleaved_program(s, p, m, v) for s in range(p)]
  return _build(name, p, m, v, programs)


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check(name: Any, *, stages: Any, microbatches: Any, virtual_stages: Any = 1) -> None:
  """Raises ValueError (one line naming the field) unless the schedule can be built."""
  if name not in SCHEDULES:
    raise ValueError(f"pipeline.schedule={name!r} is unknown; valid: {', '.join(SCHEDULES)}")
  if not _is_int(stages) or stages < 1:
    raise ValueError(f"mesh axis stage has size {stages!r}; valid: an int >= 1")
  if not _is_int(microbatches) or microbatches < 1:
    raise ValueError(f"pipeline.microbatches={microbatches!r} is invalid; valid: an int >= 1")
  if not _is_int(virtual_stages) or virtual_stages < 1:
    raise ValueError(f"pipeline.virtual_stages={virtual_stages!r} is invalid; valid: an int "
                     f">= 1")
  if name != "interleaved_1f1b" and virtual_stages != 1:
    raise ValueError(f"pipeline.virtual_stages={virtual_stages} needs "
                     f"pipeline.schedule=interleaved_1f1b (got {name}, which needs 1)")
  if name != "gpipe" and microbatches < stages:
    raise ValueError(f"pipeline.microbatches={microbatches} is fewer than the {stages} stages; "
                     f"{name} needs microbatches >= stages")
  if name == "interleaved_1f1b" and microbatches % stages:
    raise ValueError(f"pipeline.microbatches={microbatches} is not a multiple of the {stages} "
                     f"stages; interleaved_1f1b needs microbatches % stages == 0")


# ---------------------------------------------------------------------------
# Program orders
# ---------------------------------------------------------------------------


def _gpipe_program(s: int, p: int, m: int) -> list[_Op]:
  return [(FORWARD, mb, s) for mb in range(m)] + [(BACKWARD, mb, s) for mb in range(m)]


def _interleaved_program(s: int, p: int, m: int, v: int) -> list[_Op]:
  """Megatron's (interleaved) 1F1B order for stage s; v=1 is plain non-interleaved 1F1B.

  The k-th forward walks microbatches in groups of p: k -> microbatch (k // (p*v)) * p + k % p,
  virtual (k % (p*v)) // p; the k-th backward the same with the virtual index reversed.
  Warmup forwards: Megatron's (p - s - 1) * 2 + (v - 1) * p for v > 1, capped at m*v; for
  v = 1 the non-interleaved p - s - 1 (the same ticks, fewer chunks in flight). Then one
  forward, one backward until the forwards run out, then the remaining backwards. Megatron's
  special case m == p (all forwards first) is not copied: the general order already reaches
  2 * (v*m + p - 1) ticks under ASAP timing, for every shape the tests check, with fewer
  chunks in flight.
  """
  total = m * v

  def op(kind: int, k: int) -> _Op:
    group, within = divmod(k, p * v)
    virt = within // p
    if kind == BACKWARD:
      virt = v - 1 - virt
    return (kind, group * p + within % p, virt * p + s)

  warmup = p - s - 1 if v == 1 else (p - s - 1) * 2 + (v - 1) * p
  warmup = min(warmup, total)
  prog = [op(FORWARD, k) for k in range(warmup)]
  for i in range(total - warmup):
    prog += [op(FORWARD, warmup + i), op(BACKWARD, i)]
  prog += [op(BACKWARD, k) for k in range(total - warmup, total)]
  return prog


# ---------------------------------------------------------------------------
# Timing and buffer slots
# ---------------------------------------------------------------------------


def _needs(op: _Op, num_chunks: int) -> list[_Op]:
  """The ops whose results `op` reads: a forward its previous chunk's; a backward its own
  forward's residuals and the next chunk's gradient (the last chunk's comes from the head,
  right after its forward)."""
  kind, mb, g = op
  if kind == FORWARD:
    return [(FORWARD, mb, g - 1)] if g > 0 else []
  return [(FORWARD, mb, g)] + ([(BACKWARD, mb, g + 1)] if g < num_chunks - 1 else [])


def _simulate(programs: list[list[_Op]], p: int, num_chunks: int) -> list[list[_Op | None]]:
  """ASAP timing: each tick each stage runs its next op if its inputs have arrived, else idles."""
  done: dict[_Op, int] = {}  # op -> tick it ran
  pos = [0] * p
  rows: list[list[_Op | None]] = []
  remaining = sum(len(prog) for prog in programs)
  while remaining:
    t = len(rows)
    row: list[_Op | None] = [None] * p
    for s in range(p):
      if pos[s] == len(programs[s]):
        continue
      kind, mb, g = programs[s][pos[s]]
      # Everything finished at a tick < t has arrived by t (the head too: end of its tick).
      if all(done.get(n, t) < t for n in _needs((kind, mb, g), num_chunks)):
        row[s] = (kind, mb, g)
    for s, op in enumerate(row):
      if op is not None:
        done[op] = t
        pos[s] += 1
        remaining -= 1
    if all(op is None for op in row):
      raise AssertionError(f"schedule deadlocks at tick {t}; stage positions {pos}")
    rows.append(row)
  return rows


class _Slots:
  """Lowest-free slot allocator for one buffer on one stage."""

  def __init__(self):
    self.used: set[int] = set()
    self.peak = 0

  def take(self) -> int:
    slot = 0
    while slot in self.used:
      slot += 1
    self.used.add(slot)
    self.peak = max(self.peak, slot + 1)
    return slot


def _build(name: str, p: int, m: int, v: int, programs: list[list[_Op]]) -> Schedule:
  """Times the programs and assigns every buffer slot."""
  num_chunks = p * v
  rows = _simulate(programs, p, num_chunks)
  ticks = len(rows)
  table = lambda: np.full((ticks, p), -1, np.int32)
  vector = lambda: np.full((ticks,), -1, np.int32)
  kind = np.zeros((ticks, p), np.int32)
  microbatch, virtual, res_slot = table(), table(), table()
  act_recv, act_in, grad_recv, grad_in = table(), table(), table(), table()
  head_slot, head_mb, embed_mb, embed_grad_mb = vector(), vector(), vector(), vector()
  res = [_Slots() for _ in range(p)]
  act = [_Slots() for _ in range(p)]
  grad = [_Slots() for _ in range(p)]
  res_of: dict[tuple[int, int], int] = {}   # (mb, g) -> residual slot
  act_of: dict[tuple[int, int], int] = {}   # (mb, g) -> inbox slot holding g's input
  grad_of: dict[tuple[int, int], int] = {}  # (mb, g) -> inbox slot holding g's output grad
  has_backward = any(op[0] == BACKWARD for prog in programs for op in prog)
  last = num_chunks - 1

  for t in range(ticks):
    # Arrivals at the start of tick t: what tick t-1 sent.
    if t > 0:
      for op in rows[t - 1]:
        if op is None:
          continue
        k, mb, g = op
        if k == FORWARD and g < last:
          dst = (g + 1) % p
          act_of[(mb, g + 1)] = act_recv[t, dst] = act[dst].take()
        elif k == BACKWARD and g > 0:
          dst = (g - 1) % p
          grad_of[(mb, g - 1)] = grad_recv[t, dst] = grad[dst].take()
    freed = []  # (allocator, slot) read this tick, free only after the tick
    for s, op in enumerate(rows[t]):
      if op is None:
        continue
      k, mb, g = op
      kind[t, s], microbatch[t, s], virtual[t, s] = k, mb, g // p
      if k == FORWARD:
        if g > 0:
          act_in[t, s] = act_of.pop((mb, g))
          freed.append((act[s], act_in[t, s]))
        else:
          embed_mb[t] = mb
        if has_backward:
          res_of[(mb, g)] = res_slot[t, s] = res[s].take()
      else:
        res_slot[t, s] = res_of.pop((mb, g))
        freed.append((res[s], res_slot[t, s]))
        grad_in[t, s] = grad_of.pop((mb, g))
        freed.append((grad[s], grad_in[t, s]))
        if g == 0:
          embed_grad_mb[t] = mb
    # The head writes at the end of the tick, before this tick's reads are freed.
    for op in rows[t]:
      if op is not None and op[0] == FORWARD and op[2] == last:
        head_mb[t] = op[1]
        if has_backward:
          grad_of[(op[1], last)] = head_slot[t] = grad[last % p].take()
    for alloc, slot in freed:
      alloc.used.discard(int(slot))

  for arr in (kind, microbatch, virtual, res_slot, act_recv, act_in, grad_recv, grad_in,
              head_slot, head_mb, embed_mb, embed_grad_mb):
    arr.setflags(write=False)
  return Schedule(
      name=name, stages=p, microbatches=m, virtual_stages=v,
      kind=kind, microbatch=microbatch, virtual=virtual, res_slot=res_slot,
      act_recv=act_recv, act_in=act_in, grad_recv=grad_recv, grad_in=grad_in,
      head_slot=head_slot, head_microbatch=head_mb, embed_microbatch=embed_mb,
      embed_grad_microbatch=embed_grad_mb,
      res_slots=max(a.peak for a in res),
      act_slots=max(1, max(a.peak for a in act)),
      grad_slots=max(1, max(a.peak for a in grad)) if has_backward else 0,
      programs=tuple(tuple(prog) for prog in programs))


# ---------------------------------------------------------------------------
# Time with unequal forward and backward costs
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Costs:
  """Time of one microbatch's forward / backward through ALL the layers one stage holds.

  An interleaved chunk holds 1/v of them and costs 1/v, so makespans compare across
  schedules of the same model and stages. comm: time to send an activation or gradient to
  the next stage (asynchronous: per message between stages; lock step: per tick).
  """
  forward: float
  backward: float
  comm: float = 0.0

  def __post_init__(self):
    for field, low in (("forward", "> 0"), ("backward", "> 0"), ("comm", ">= 0")):
      x = getattr(self, field)
      ok = (isinstance(x, (int, float, np.integer, np.floating))
            and not isinstance(x, (bool, np.bool_)) and math.isfinite(x))
      if not ok or (x <= 0 if field != "comm" else x < 0):
        raise ValueError(f"Costs.{field}={x!r} is invalid; valid: a finite number {low}")


@dataclasses.dataclass(frozen=True)
class Timing:
  """Makespans and timed bubbles (idle time / (stages x makespan)) in the units of Costs.

  asynchronous: each stage runs its program order, every op as soon as the stage is free
    and its inputs have arrived (Megatron-style). lockstep: the executor's ticks, each as
    long as its slowest action plus comm. busy: compute time per stage (the same for both);
    time spent in comm counts as idle.
  """
  asynchronous: float
  lockstep: float
  busy: tuple[float, ...]

  def _bubble(self, makespan: float) -> float:
    return 1.0 - sum(self.busy) / (len(self.busy) * makespan) if makespan else 0.0

  @property
  def asynchronous_bubble(self) -> float:
    return self._bubble(self.asynchronous)

  @property
  def lockstep_bubble(self) -> float:
    return self._bubble(self.lockstep)


def timed(schedule: Schedule, costs: Costs) -> Timing:
  """The schedule's time under `costs`, asynchronous and in lock step (see Timing)."""
  p, v = schedule.stages, schedule.virtual_stages
  cost = np.array([0.0, costs.forward / v, costs.backward / v])
  action = cost[schedule.kind]  # [ticks, stages]
  # Lock step: every tick waits for its slowest stage, then its two ppermutes.
  lockstep = float(np.sum(action.max(axis=1, initial=0.0)) + costs.comm * schedule.ticks)
  # Asynchronous: the table's per-stage order is the program order, and everything an op
  # needs ran at an earlier tick, so walking the ticks visits producers first.
  end: dict[_Op, float] = {}
  free = [0.0] * p
  for t in range(schedule.ticks):
    for s in range(p):
      k = int(schedule.kind[t, s])
      if k == IDLE:
        continue
      mb, g = int(schedule.microbatch[t, s]), int(schedule.virtual[t, s]) * p + s
      start = free[s]
      for n in _needs((k, mb, g), schedule.chunks):
        sent = n[2] % p != s  # only a message to another stage pays comm
        start = max(start, end[n] + (costs.comm if sent else 0.0))
      end[(k, mb, g)] = free[s] = start + cost[k]
  asynchronous = max(free) if end else 0.0
  return Timing(asynchronous=float(asynchronous), lockstep=lockstep,
                busy=tuple(float(x) for x in action.sum(axis=0)))
