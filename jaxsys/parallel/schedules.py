"""Pipeline schedules as static tables: which stage does what at each tick, and where data lives.

Time is counted in ticks; at each tick every stage does one action: IDLE, FORWARD,
BACKWARD (input and weight gradients at once), or the two halves zero-bubble schedules
split it into, BACKWARD_INPUT ("B": the input gradient, sent on) and BACKWARD_WEIGHT ("W":
the weight gradient, deferrable), of one (microbatch, virtual) chunk, each costing one
tick. There are G = stages * virtual_stages global chunks; `chunk_of[virtual, stage]`
places them: chunk g = virtual * stages + stage for GPipe, 1F1B and interleaved 1F1B (a
loop: chunk g on stage g % stages), and the V of ZBV (chunk s and 2*stages-1-s on stage s:
down the stages and back up). Activations flow chunk 0 -> G-1, gradients G-1 -> 0; what a
stage sends at tick t reaches the next chunk's stage (s + 1, s - 1 or s itself) at tick
t + 1. The loss head runs at the end of the tick of FORWARD(mb, G-1), on that chunk's
stage, so the backward of (mb, G-1) can run one tick later. Vocabulary parallelism splits
that head in two passes on every stage (`vocab.py`): the S pass at the end of the head's
tick, whose statistics all-reduce the next tick reads, and the T pass at the start of the
next tick, before the lanes, so the backward of (mb, G-1) still runs on it. With
`vocab_overlap` (1F1B only) each pass gets a tick of its own beside the lanes' compute, its
all-reduce's result carried to the next tick: the S pass at tick a + 1 after the head's
forward at a, the T pass at a + 2, its input gradient arriving at the head stage at a + 3,
where the backward of (mb, G-1) runs at the earliest; two more warmup forwards a stage keep
1F1B's tick count, at two more microbatches in flight (VOCAB_OVERLAP_TICKS).

A schedule is a per-stage program order (the op sequence of GPipe, 1F1B, Megatron's
interleaved 1F1B, ZB-H1 or ZBV) turned into ticks by an as-soon-as-possible simulation,
plus the buffer slots an executor needs: residuals kept for the backward (until the
weight gradient, where it is split off), and the activation and gradient inboxes (a
gradient stays until its weight gradient too). This module is pure numpy so it imports
anywhere, fast; the executor only reads the tables.

The same program orders are also timed as fused ticks (`Schedule.fused`, a `Ticks`): two
lanes a tick, each stage running at most one backward-type action (lane 0) and then one
forward (lane 1), every input sent by an earlier tick. In a steady state where every stage
runs a forward and a backward each tick, a fused tick lasts F + B on every stage instead of
mixing F- and B-long actions across stages (the table's lock step pays B + B). But a
message then moves one stage per F + B, so a stage needs 2(stages - s) - 1 microbatches in
flight for that steady state: interleaved 1F1B's program (Megatron's warmup) has them, and
its fused lock step equals its asynchronous makespan; plain 1F1B and ZB-H1 keep
stages - s, and fused they idle more than in the table. `eager_1f1b` is 1F1B with that
warmup (2(stages - s - 1) forwards): fused, its lock step takes GPipe's time, holding
min(m, 2 stages - 1) microbatches of residuals on stage 0 where 1F1B holds stages.
`Schedule.unfused` is the table as one-lane ticks; `Schedule.executed` is the one of the
two the executor runs, the shorter in lock step at EXECUTOR_COSTS (backward = 2 forwards),
and the one `Schedule.chart` draws.

Ticks assume every action costs the same; `timed(schedule, Costs(...))` gives the time
they take when they do not (forward, backward, and its input and weight halves), run
asynchronously (each stage starts an op as soon as its inputs arrive) or in lock step
(fused ticks: each as long as its slowest stage's lanes together; the table's ticks: each
as long as its slowest action).

Example:
  sched = make_schedule("1f1b", stages=4, microbatches=8)
  sched.ticks, sched.bubble_fraction, sched.max_in_flight   # 22, 3/11, 4
  print(sched.chart())   # the summary, then the ticks the executor runs
  t = timed(sched, Costs(forward=1, backward=2))
  t.asynchronous, t.lockstep_unfused, t.lockstep_fused   # 33.0, 40.0, 46.0 (runs: 40.0)
  t = timed(make_schedule("interleaved_1f1b", stages=4, microbatches=8, virtual_stages=2),
            Costs(forward=1, backward=2))
  t.asynchronous, t.lockstep_unfused, t.lockstep_fused   # 28.5, 34.0, 28.5 (runs: 28.5)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

IDLE, FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = 0, 1, 2, 3, 4
KINDS = 5
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "zb_h1", "zbv")
# The backward kinds that send an input gradient on, and those that end a chunk's hold on
# its residuals and output gradient.
_SENDS_GRAD = (BACKWARD, BACKWARD_INPUT)
_FREES = (BACKWARD, BACKWARD_WEIGHT)

# An op in a stage's program: (kind, microbatch, global chunk).
_Op = tuple[int, int, int]


# Ticks' per-lane tables, per-stage arrival tables, and per-tick vectors.
LANE_FIELDS = ("kind", "microbatch", "virtual", "res_slot", "act_in", "grad_in")
ARRIVAL_FIELDS = ("act_recv", "act_recv_back", "act_recv_self", "grad_recv", "grad_recv_back",
                  "grad_recv_self")
TICK_FIELDS = ("head_slot", "head_microbatch", "embed_microbatch", "embed_grad_microbatch",
               "vocab_s_microbatch", "vocab_t_microbatch", "vocab_t_slot", "vocab_dy_slot")
# With vocab_overlap, the ticks between the head's forward of a microbatch and the earliest
# backward of its last chunk beyond the usual one (S pass, T pass), and 1F1B's extra warmup.
VOCAB_OVERLAP_TICKS = 2
VOCAB_OVERLAP_SCHEDULES = ("1f1b",)


@dataclasses.dataclass(frozen=True, eq=False)
class Ticks:
  """What an executor runs: each tick, each stage runs its lanes in order (at most one
  action each), then every message goes out. int32 tables, -1 where unused: LANE_FIELDS
  [ticks, lanes, stages], ARRIVAL_FIELDS [ticks, stages], TICK_FIELDS [ticks].

  kind, microbatch, virtual: the action of each lane of each stage at each tick.
  res_slot: residual-buffer slot a FORWARD writes and its BACKWARD reads (then frees); a
    BACKWARD_INPUT reads it and its BACKWARD_WEIGHT reads it again, then frees it. A slot
    a lane frees is free for a later lane of the same tick, which runs after the read.
  act_recv / act_in: activation-inbox slot written by the arrival from stage s - 1 at the
    start of the tick / read by a FORWARD of chunk > 0 (freed after the tick).
    act_recv_back, act_recv_self: slots written by the arrivals from stage s + 1 and from
    the stage itself (the V's turn); -1 where nothing comes that way.
  grad_recv / grad_in: the same for the gradient inbox (grad_recv from stage s + 1,
    grad_recv_back from s - 1, grad_recv_self from s); the backward kinds read their output
    gradient from grad_in, a BACKWARD_INPUT leaving it for its BACKWARD_WEIGHT.
  head_slot[t]: the slot on the head stage that the loss head writes at the end of tick t
    (-1: no head that tick).
  head_microbatch, embed_microbatch, embed_grad_microbatch [ticks]: microbatch of the
    FORWARD of chunk G-1 / FORWARD of chunk 0 / BACKWARD of chunk 0 at each tick, -1 none.
  vocab_s_microbatch, vocab_t_microbatch [ticks]: the microbatch whose vocabulary S pass
    runs at the end of the tick (the head's, with a backward) / whose T pass runs at its
    start, before the lanes (the next tick); vocab_t_slot: the head stage's gradient-inbox
    slot the T pass writes (head_slot of the tick before). -1: none.
    With `vocab_overlap`: the S pass runs alongside the tick after the head's, the T pass
    alongside the tick after that, neither writes a slot (head_slot and vocab_t_slot -1);
    vocab_dy_slot: the head stage's gradient-inbox slot the T pass's input gradient
    arrives in at the start of the tick after the T pass's (-1 otherwise).
  res_slots, act_slots, grad_slots: buffer sizes per stage.
  """
  kind: np.ndarray
  microbatch: np.ndarray
  virtual: np.ndarray
  res_slot: np.ndarray
  act_in: np.ndarray
  grad_in: np.ndarray
  act_recv: np.ndarray
  act_recv_back: np.ndarray
  act_recv_self: np.ndarray
  grad_recv: np.ndarray
  grad_recv_back: np.ndarray
  grad_recv_self: np.ndarray
  head_slot: np.ndarray
  head_microbatch: np.ndarray
  embed_microbatch: np.ndarray
  embed_grad_microbatch: np.ndarray
  vocab_s_microbatch: np.ndarray
  vocab_t_microbatch: np.ndarray
  vocab_t_slot: np.ndarray
  vocab_dy_slot: np.ndarray
  res_slots: int
  act_slots: int
  grad_slots: int

  @property
  def ticks(self) -> int:
    return int(self.kind.shape[0])

  @property
  def lanes(self) -> int:
    return int(self.kind.shape[1])

  def lane_kinds(self, lane: int) -> tuple[int, ...]:
    """The action kinds (not IDLE) lane `lane` ever runs."""
    return tuple(int(k) for k in np.unique(self.kind[:, lane]) if k != IDLE)

  def counts(self) -> np.ndarray:
    """[stages, KINDS]: ticks each stage runs nothing (IDLE) and actions of each kind."""
    stages = self.kind.shape[2]
    counts = np.stack([np.bincount(self.kind[:, :, s].ravel(), minlength=KINDS)
                       for s in range(stages)])
    counts[:, IDLE] = np.sum(np.all(self.kind == IDLE, axis=1), axis=0)
    return counts


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """A pipeline schedule: its table, the same program order in fused ticks, and where
  chunks run.

  unfused: the table, one-lane Ticks: one action a stage a tick (`unfused.kind[:, 0]` is
    [ticks, stages]). fused: the same program order in two-lane ticks (module docstring).
    `executed` is the one of the two the executor runs.
  chunk_of [virtual_stages, stages]: the global chunk each (virtual, stage) runs.
  """
  name: str
  stages: int
  microbatches: int
  virtual_stages: int
  chunk_of: np.ndarray = dataclasses.field(repr=False)
  unfused: Ticks = dataclasses.field(repr=False)
  fused: Ticks = dataclasses.field(repr=False)
  # Per-stage program order, kept so forward_only() can re-simulate the same order.
  programs: tuple[tuple[_Op, ...], ...] = dataclasses.field(repr=False, default=())
  # VP's S and T passes on ticks of their own, beside the lanes (module docstring).
  vocab_overlap: bool = False

  @property
  def ticks(self) -> int:
    return self.unfused.ticks

  @functools.cached_property  # timed once: the summary, the chart and the executor read it
  def executed(self) -> Ticks:
    """The ticks the executor runs: the fused ones or the table's, the shorter in lock step
    at EXECUTOR_COSTS (a tie: the fewer ticks). Fusing shortens a step only where the
    program keeps enough microbatches in flight (module docstring)."""
    cost = EXECUTOR_COSTS.of_kind() / self.virtual_stages
    # Rounded: chunk costs of 1/v add up to makespans that differ in the last bits.
    return min((self.fused, self.unfused),
               key=lambda t: (round(_lockstep(t, cost, 0.0), 9), t.ticks))

  @property
  def chunks(self) -> int:
    """G, the number of global chunks."""
    return self.stages * self.virtual_stages

  @property
  def chunk(self) -> np.ndarray:
    """Global chunk index of each action [ticks, stages], -1 when idle."""
    stage = np.arange(self.stages, dtype=np.int32)[None, :]
    virtual = np.maximum(self.unfused.virtual[:, 0], 0)
    return np.where(self.unfused.kind[:, 0] == IDLE, -1,
                    self.chunk_of[virtual, stage]).astype(np.int32)

  @property
  def stage_of(self) -> np.ndarray:
    """The stage each global chunk runs on [chunks]."""
    return _stage_of(self.chunk_of)

  @property
  def head_stage(self) -> int:
    """The stage of the last chunk, where the loss head's gradient starts the backward."""
    return int(self.stage_of[-1])

  @property
  def split_backward(self) -> bool:
    """Whether the backward runs as input- and weight-gradient passes (zero-bubble)."""
    return bool(np.any(self.unfused.kind == BACKWARD_WEIGHT))

  @property
  def bubble_fraction(self) -> float:
    """Idle stage-ticks over all stage-ticks."""
    kind = self.unfused.kind
    return float(np.sum(kind == IDLE)) / float(kind.size)

  @property
  def useful_fraction(self) -> float:
    return 1.0 - self.bubble_fraction

  def _held(self) -> np.ndarray:
    """Chunks each stage holds residuals of after each tick [ticks, stages]."""
    kind = self.unfused.kind[:, 0]
    return np.cumsum(kind == FORWARD, axis=0) - np.cumsum(np.isin(kind, _FREES), axis=0)

  @property
  def max_in_flight(self) -> int:
    """Most (microbatch, virtual) chunks one stage holds residuals of, from FORWARD to
    BACKWARD (or to BACKWARD_WEIGHT, which still reads them).

    0 for a forward-only schedule, which keeps nothing for a backward.
    """
    if not np.any(np.isin(self.unfused.kind, _FREES)):
      return 0
    return int(self._held().max())

  @property
  def peak_activations(self) -> float:
    """The most residuals one stage holds, in microbatches of a whole stage's layers: a
    chunk is 1/virtual_stages of them (1F1B and ZB-H1: stages; GPipe: microbatches)."""
    if not np.any(np.isin(self.unfused.kind, _FREES)):
      return 0.0
    return float(self._held().max()) / self.virtual_stages

  def forward_only(self) -> Schedule:
    """The FORWARD actions alone, in the same per-stage order, re-timed (for evaluation;
    no backward, so no vocab_overlap)."""
    programs = [[op for op in prog if op[0] == FORWARD] for prog in self.programs]
    return _build(self.name, self.stages, self.microbatches, self.virtual_stages, programs,
                  self.chunk_of)

  def summary(self) -> str:
    """One line: the table's shape and bubble, and the ticks the executor runs (`executed`:
    the table's, or fewer fused ones)."""
    executed = self.executed
    shape = "fused" if executed is self.fused else "table"
    return (f"schedule={self.name} stages={self.stages} microbatches={self.microbatches} "
            f"virtual={self.virtual_stages} ticks={self.ticks} "
            f"bubble={self.bubble_fraction:.3f} max_in_flight={self.max_in_flight} "
            f"runs={executed.ticks} {shape} ticks" + (" vocab_overlap" if self.vocab_overlap
                                                        else ""))

  def chart(self, vocab_passes: bool = False) -> str:
    """The summary, then one row per stage, one cell per tick the executor runs (`executed`):
    F<mb> forward, b<mb> backward, B<mb> its input gradient, W<mb> its weight gradient, '.'
    idle; a fused tick's cell holds its lanes' actions in order (b3F5: backward of 3, then
    forward of 5).

    With virtual stages a letter names the virtual index (F3a = microbatch 3, virtual 0).
    `vocab_passes`: two more rows, the vocabulary-parallel S and T passes every stage runs
    (S<mb> at the end of its tick, T<mb> at the start of its tick).
    """
    def action(k: int, mb: int, v: int) -> str:
      if k == IDLE:
        return ""
      tag = ""
      if self.virtual_stages > 1:
        tag = chr(ord("a") + v) if self.virtual_stages <= 26 else f":{v}"
      return "?FbBW"[k] + f"{mb}{tag}"

    ticks = self.executed
    cells = [["".join(action(*(int(x[t, lane, s]) for x in (ticks.kind, ticks.microbatch,
                                                            ticks.virtual)))
                      for lane in range(ticks.lanes)) or "."
              for t in range(ticks.ticks)] for s in range(self.stages)]
    labels = [f"stage {s:>{len(str(self.stages - 1))}}" for s in range(self.stages)]
    if vocab_passes:
      for name, mbs in (("S", ticks.vocab_s_microbatch), ("T", ticks.vocab_t_microbatch)):
        cells.append([f"{name}{mb}" if mb >= 0 else "." for mb in mbs])
        labels.append(f"vocab {name}")
    width = max(len(c) for row in cells for c in row) if ticks.ticks else 1
    label = max(len(x) for x in labels)
    lines = [self.summary()]
    for name, row in zip(labels, cells):
      lines.append((f"{name:<{label}} | " + " ".join(c.ljust(width) for c in row)).rstrip())
    return "\n".join(lines)


def make_schedule(name: str, *, stages: int, microbatches: int, virtual_stages: int = 1,
                  vocab_overlap: bool = False) -> Schedule:
  """The schedule `name` (one of SCHEDULES) for the given sizes (zbv: virtual_stages=2).

  `vocab_overlap` (VOCAB_OVERLAP_SCHEDULES): vocabulary parallelism's S and T passes on
  ticks of their own, beside the lanes (module docstring)."""
  check(name, stages=stages, microbatches=microbatches, virtual_stages=virtual_stages,
        vocab_overlap=vocab_overlap)
  p, m, v = int(stages), int(microbatches), int(virtual_stages)
  chunk_of = _loop_placement(p, v)
  if name == "gpipe":
    programs = [_gpipe_program(s, p, m) for s in range(p)]
  elif name in ("1f1b", "eager_1f1b"):
    extra = VOCAB_OVERLAP_TICKS if vocab_overlap else 0
    programs = [_interleaved_program(s, p, m, 1, eager=name == "eager_1f1b", extra_warmup=extra)
                for s in range(p)]
  elif name == "interleaved_1f1b":
    programs = [_interleaved_program(s, p, m, v) for s in range(p)]
  elif name == "zb_h1":
    programs = [_zb_h1_program(s, p, m) for s in range(p)]
  else:
    chunk_of = _v_placement(p)
    programs = [_zbv_program(s, p, m) for s in range(p)]
  return _build(name, p, m, v, programs, chunk_of, vocab_overlap=vocab_overlap)


def min_microbatches(name: str, stages: int) -> int:
  """The fewest microbatches the schedule `name` takes on `stages` stages: GPipe 1, the
  others one per stage (1F1B's steady state; ZB-H1 and ZBV hold up to `stages`
  microbatches' residuals on a stage, so fewer only shorten their warmup, but gain
  nothing over GPipe)."""
  return 1 if name == "gpipe" else stages


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check(name: Any, *, stages: Any, microbatches: Any, virtual_stages: Any = 1,
          vocab_overlap: Any = False) -> None:
  """Raises ValueError (one line naming the field) unless the schedule can be built."""
  if name not in SCHEDULES:
    raise ValueError(f"pipeline.schedule={name!r} is unknown; valid: {', '.join(SCHEDULES)}")
  if not isinstance(vocab_overlap, (bool, np.bool_)):
    raise ValueError(f"pipeline.vocab_overlap={vocab_overlap!r} is invalid; valid: True, False")
  if vocab_overlap and name not in VOCAB_OVERLAP_SCHEDULES:
    raise ValueError(f"pipeline.vocab_overlap=True is invalid with pipeline.schedule={name}; "
                     f"valid: {', '.join(VOCAB_OVERLAP_SCHEDULES)} (or vocab_overlap=False)")
  if not _is_int(stages) or stages < 1:
    raise ValueError(f"mesh axis stage has size {stages!r}; valid: an int >= 1")
  if not _is_int(microbatches) or microbatches < 1:
    raise ValueError(f"pipeline.microbatches={microbatches!r} is invalid; valid: an int >= 1")
  if not _is_int(virtual_stages) or virtual_stages < 1:
    raise ValueError(f"pipeline.virtual_stages={virtual_stages!r} is invalid; valid: an int "
                     f">= 1")
  if name == "zbv" and virtual_stages != 2:
    raise ValueError(f"pipeline.virtual_stages={virtual_stages} is invalid for "
                     f"pipeline.schedule=zbv; valid: 2 (its V: two chunks a stage)")
  if name not in ("interleaved_1f1b", "zbv") and virtual_stages != 1:
    raise ValueError(f"pipeline.virtual_stages={virtual_stages} needs "
                     f"pipeline.schedule=interleaved_1f1b (got {name}, which needs 1)")
  low = min_microbatches(name, stages)
  if microbatches < low:
    raise ValueError(f"pipeline.microbatches={microbatches} is fewer than the {stages} stages; "
                     f"{name} needs microbatches >= stages ({low})")
  if name == "interleaved_1f1b" and microbatches % stages:
    raise ValueError(f"pipeline.microbatches={microbatches} is not a multiple of the {stages} "
                     f"stages; interleaved_1f1b needs microbatches % stages == 0")


# ---------------------------------------------------------------------------
# Program orders
# ---------------------------------------------------------------------------


def _loop_placement(p: int, v: int) -> np.ndarray:
  """chunk_of of a loop: chunk g on stage g % p, virtual g // p."""
  return np.arange(p * v, dtype=np.int32).reshape(v, p)


def _v_placement(p: int) -> np.ndarray:
  """chunk_of of a V: stage s runs chunk s (virtual 0) and chunk 2p - 1 - s (virtual 1)."""
  stage = np.arange(p, dtype=np.int32)
  return np.stack([stage, 2 * p - 1 - stage])


def _stage_of(chunk_of: np.ndarray) -> np.ndarray:
  stage_of = np.zeros(chunk_of.size, np.int32)
  for v, s in np.ndindex(*chunk_of.shape):
    stage_of[chunk_of[v, s]] = s
  return stage_of


def _gpipe_program(s: int, p: int, m: int) -> list[_Op]:
  return [(FORWARD, mb, s) for mb in range(m)] + [(BACKWARD, mb, s) for mb in range(m)]


def _interleaved_program(s: int, p: int, m: int, v: int, eager: bool = False,
                         extra_warmup: int = 0) -> list[_Op]:
  """Megatron's (interleaved) 1F1B order for stage s; v=1 is plain non-interleaved 1F1B,
  or with `eager` 1F1B with the interleaved warmup's 2(p - s - 1) forwards. `extra_warmup`
  forwards more (vocab_overlap: the head's gradient comes that many ticks later).

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

  warmup = p - s - 1 if v == 1 and not eager else (p - s - 1) * 2 + (v - 1) * p
  warmup = min(warmup + extra_warmup, total)
  prog = [op(FORWARD, k) for k in range(warmup)]
  for i in range(total - warmup):
    prog += [op(FORWARD, warmup + i), op(BACKWARD, i)]
  prog += [op(BACKWARD, k) for k in range(total - warmup, total)]
  return prog


def _zb_h1_program(s: int, p: int, m: int) -> list[_Op]:
  """ZB-H1 (Qi et al. 2023, arXiv 2401.10241, section 3) for stage s: 1F1B's order of
  forwards and input gradients, each weight gradient deferred on stage s by s microbatches
  into the cooldown, where 1F1B's stages idle. Residuals live from F to W, at most
  `stages` microbatches on stage 0 as in 1F1B; stage s also holds s + 1 output gradients
  between B and W.
  """
  ops = lambda kind, k: (kind, k, s)
  warmup = min(p - s - 1, m)
  prog = [ops(FORWARD, k) for k in range(warmup)]
  f, b, w = warmup, 0, 0
  for _ in range(s):  # W held back: one F, one B
    if f < m:
      prog += [ops(FORWARD, f), ops(BACKWARD_INPUT, b)]
      f, b = f + 1, b + 1
  while f < m:
    prog += [ops(FORWARD, f), ops(BACKWARD_INPUT, b), ops(BACKWARD_WEIGHT, w)]
    f, b, w = f + 1, b + 1, w + 1
  while b < m:
    prog += [ops(BACKWARD_INPUT, b), ops(BACKWARD_WEIGHT, w)]
    b, w = b + 1, w + 1
  prog += [ops(BACKWARD_WEIGHT, k) for k in range(w, m)]
  return prog


def _zbv_program(s: int, p: int, m: int) -> list[_Op]:
  """ZB-V (arXiv 2401.10241, section 6) for stage s: chunks s and 2p - 1 - s (the V),
  each a half stage. Warmup: 2(p - s) - 1 forwards of the first chunk, then s pairs of
  (second, first), then p - s rounds of the second chunk's F, B, W; steady state: F, B, W
  of the first chunk then of the second; cooldown: s pairs of B (first, second), then p - s
  rounds of B and W of the first chunk, then the remaining W's. At most 2p chunks (p
  stages' worth) of residuals on a stage, as 1F1B.
  """
  c0, c1 = s, 2 * p - 1 - s
  f = {c0: 0, c1: 0}
  b = {c0: 0, c1: 0}
  w = {c0: 0, c1: 0}
  prog: list[_Op] = []

  def run(kind, c, count):
    if count[c] < m:
      prog.append((kind, count[c], c))
      count[c] += 1

  for _ in range(2 * (p - s) - 1):
    run(FORWARD, c0, f)
  for _ in range(s):
    run(FORWARD, c1, f)
    run(FORWARD, c0, f)
  for _ in range(p - s):
    run(FORWARD, c1, f)
    run(BACKWARD_INPUT, c1, b)
    run(BACKWARD_WEIGHT, c1, w)
  while f[c1] < f[c0] or f[c0] < m:
    run(FORWARD, c0, f)
    run(BACKWARD_INPUT, c0, b)
    run(BACKWARD_WEIGHT, c0, w)
    run(FORWARD, c1, f)
    run(BACKWARD_INPUT, c1, b)
    run(BACKWARD_WEIGHT, c1, w)
  for _ in range(s):
    run(BACKWARD_INPUT, c0, b)
    run(BACKWARD_INPUT, c1, b)
  for _ in range(p - s):
    run(BACKWARD_INPUT, c0, b)
    run(BACKWARD_WEIGHT, c0, w)
  while w[c1] < m or w[c0] < m:
    while w[c1] < b[c1]:
      run(BACKWARD_WEIGHT, c1, w)
    while w[c0] < b[c0]:
      run(BACKWARD_WEIGHT, c0, w)
    if b[c0] < m or b[c1] < m:  # what the rounds above left (few microbatches)
      run(BACKWARD_INPUT, c1, b)
      run(BACKWARD_INPUT, c0, b)
  return prog


# ---------------------------------------------------------------------------
# Timing and buffer slots
# ---------------------------------------------------------------------------


def _needs(op: _Op, num_chunks: int) -> list[_Op]:
  """The ops whose results `op` reads: a forward its previous chunk's; a backward (or its
  input half) its own forward's residuals and the next chunk's gradient from the same kind
  (the last chunk's comes from the head, right after its forward); a weight gradient its
  input gradient's output gradient (the same stage's)."""
  kind, mb, g = op
  if kind == FORWARD:
    return [(FORWARD, mb, g - 1)] if g > 0 else []
  if kind == BACKWARD_WEIGHT:
    return [(BACKWARD_INPUT, mb, g)]
  return [(FORWARD, mb, g)] + ([(kind, mb, g + 1)] if g < num_chunks - 1 else [])


def _lane_of(kind: int, lanes: int) -> int:
  """The lane an action runs in: one lane, or backward-type in 0 and forward in 1."""
  return int(lanes == 2 and kind == FORWARD)


def _ready(op: _Op, need: _Op, done: dict[_Op, int], t: int, last: int,
           head_delay: int) -> bool:
  """Whether `need`, which `op` reads, has arrived by tick t: it ran at an earlier tick,
  `head_delay` ticks earlier still where it is the head's forward and `op` the backward of
  the last chunk (vocab_overlap: the S and T passes run in between)."""
  delay = head_delay if op[0] != FORWARD and need == (FORWARD, op[1], last) else 0
  return done.get(need, t) + delay < t


def _simulate(programs: list[list[_Op]], p: int, num_chunks: int, lanes: int = 1,
              head_delay: int = 0) -> list[list[list[_Op | None]]]:
  """ASAP timing: each tick each stage runs the next ops of its program whose inputs
  arrived by an earlier tick (`_ready`), at most one a lane, else idles. Rows
  [tick][stage][lane]."""
  done: dict[_Op, int] = {}  # op -> tick it ran
  pos = [0] * p
  rows: list[list[list[_Op | None]]] = []
  remaining = sum(len(prog) for prog in programs)
  waited = 0  # ticks in a row nothing ran: up to head_delay, all may wait on a head
  while remaining:
    t = len(rows)
    row: list[list[_Op | None]] = [[None] * lanes for _ in range(p)]
    for s in range(p):
      while pos[s] < len(programs[s]):
        op = programs[s][pos[s]]
        lane = _lane_of(op[0], lanes)
        # Everything finished at a tick < t has arrived by t (the head too: end of its tick).
        if row[s][lane] is not None or not all(_ready(op, n, done, t, num_chunks - 1, head_delay)
                                               for n in _needs(op, num_chunks)):
          break
        row[s][lane] = op
        pos[s] += 1
    placed = [op for ops in row for op in ops if op is not None]
    waited = 0 if placed else waited + 1
    if waited > head_delay:
      raise AssertionError(f"schedule deadlocks at tick {t}; stage positions {pos}")
    for op in placed:
      done[op] = t
    remaining -= len(placed)
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


def _build(name: str, p: int, m: int, v: int, programs: list[list[_Op]],
           chunk_of: np.ndarray, vocab_overlap: bool = False) -> Schedule:
  """Times the programs as the table and as fused ticks, and assigns every buffer slot."""
  chunk_of = np.array(chunk_of, np.int32)
  chunk_of.setflags(write=False)
  has_backward = any(op[0] != FORWARD for prog in programs for op in prog)
  overlap = vocab_overlap and has_backward
  delay = VOCAB_OVERLAP_TICKS if overlap else 0
  unfused, fused = (_assign(_simulate(programs, p, chunk_of.size, lanes, delay), chunk_of,
                            has_backward, overlap)
                    for lanes in (1, 2))
  return Schedule(name=name, stages=p, microbatches=m, virtual_stages=v, chunk_of=chunk_of,
                  unfused=unfused, fused=fused,
                  programs=tuple(tuple(prog) for prog in programs), vocab_overlap=overlap)


def _assign(rows: list[list[list[_Op | None]]], chunk_of: np.ndarray,
            has_backward: bool, vocab_overlap: bool = False) -> Ticks:
  """The tables of timed rows [tick][stage][lane], every buffer slot assigned."""
  num_chunks, p = chunk_of.size, chunk_of.shape[1]
  stage_of = _stage_of(chunk_of)
  virtual_of = np.zeros(num_chunks, np.int32)
  for vi, s in np.ndindex(*chunk_of.shape):
    virtual_of[chunk_of[vi, s]] = vi
  ticks, lanes = len(rows), len(rows[0][0])
  lane_tables = {k: np.full((ticks, lanes, p), -1, np.int32) for k in LANE_FIELDS}
  lane_tables["kind"][:] = IDLE
  arrivals = {k: np.full((ticks, p), -1, np.int32) for k in ARRIVAL_FIELDS}
  vectors = {k: np.full((ticks,), -1, np.int32) for k in TICK_FIELDS}
  kind, microbatch, virtual, res_slot, act_in, grad_in = (lane_tables[k] for k in LANE_FIELDS)

  def inbox(src: int, dst: int, buf: str, ahead: int) -> np.ndarray:
    """The recv table of a message from stage src to dst: the buffer's usual ring direction
    (`ahead` = +1 activations, -1 gradients) first, so p <= 2 uses it alone."""
    if (src + ahead) % p == dst:
      return arrivals[f"{buf}_recv"]
    return arrivals[f"{buf}_recv_self" if src == dst else f"{buf}_recv_back"]

  res = [_Slots() for _ in range(p)]
  act = [_Slots() for _ in range(p)]
  grad = [_Slots() for _ in range(p)]
  res_of: dict[tuple[int, int], int] = {}   # (mb, g) -> residual slot
  act_of: dict[tuple[int, int], int] = {}   # (mb, g) -> inbox slot holding g's input
  grad_of: dict[tuple[int, int], int] = {}  # (mb, g) -> inbox slot holding g's output grad
  last = num_chunks - 1
  head_stage = int(stage_of[last])
  head_arrivals: dict[int, int] = {}  # vocab_overlap: tick -> microbatch whose dy arrives

  for t in range(ticks):
    if t in head_arrivals:  # the T pass's input gradient, carried from the tick before
      mb = head_arrivals.pop(t)
      grad_of[(mb, last)] = vectors["vocab_dy_slot"][t] = grad[head_stage].take()
    # Arrivals at the start of tick t: what tick t-1 sent.
    for op in (op for ops in (rows[t - 1] if t else []) for op in ops if op is not None):
      k, mb, g = op
      if k == FORWARD and g < last:
        src, dst = stage_of[g], stage_of[g + 1]
        act_of[(mb, g + 1)] = inbox(src, dst, "act", 1)[t, dst] = act[dst].take()
      elif k in _SENDS_GRAD and g > 0:
        src, dst = stage_of[g], stage_of[g - 1]
        grad_of[(mb, g - 1)] = inbox(src, dst, "grad", -1)[t, dst] = grad[dst].take()
    freed = []  # (allocator, slot) of inboxes read this tick, free only after the tick
    for s, ops in enumerate(rows[t]):
      for lane, op in enumerate(ops):
        if op is None:
          continue
        k, mb, g = op
        at = (t, lane, s)
        kind[at], microbatch[at], virtual[at] = k, mb, virtual_of[g]
        if k == FORWARD:
          if g > 0:
            act_in[at] = act_of.pop((mb, g))
            freed.append((act[s], act_in[at]))
          else:
            vectors["embed_microbatch"][t] = mb
          if has_backward:
            res_of[(mb, g)] = res_slot[at] = res[s].take()
          continue
        # An input gradient leaves its residuals and output gradient to its weight gradient.
        keep = k == BACKWARD_INPUT
        res_slot[at] = res_of[(mb, g)] if keep else res_of.pop((mb, g))
        grad_in[at] = grad_of[(mb, g)] if keep else grad_of.pop((mb, g))
        if not keep:  # a later lane runs after this read: its forward may take the slot
          res[s].used.discard(int(res_slot[at]))
          freed.append((grad[s], grad_in[at]))
        if g == 0 and k in _SENDS_GRAD:
          vectors["embed_grad_microbatch"][t] = mb
    # The head writes at the end of the tick, before this tick's reads are freed.
    for op in (op for ops in rows[t] for op in ops if op is not None):
      if op[0] == FORWARD and op[2] == last:
        vectors["head_microbatch"][t] = op[1]
        if vocab_overlap:  # S pass at t + 1, T pass at t + 2, its dy arrives at t + 3
          vectors["vocab_s_microbatch"][t + 1] = vectors["vocab_t_microbatch"][t + 2] = op[1]
          head_arrivals[t + 1 + VOCAB_OVERLAP_TICKS] = op[1]
        elif has_backward:
          grad_of[(op[1], last)] = vectors["head_slot"][t] = grad[head_stage].take()
          # The backward of (mb, G-1) runs at t + 1 at the earliest: its T pass runs first.
          vectors["vocab_s_microbatch"][t] = vectors["vocab_t_microbatch"][t + 1] = op[1]
          vectors["vocab_t_slot"][t + 1] = vectors["head_slot"][t]
    for alloc, slot in freed:
      alloc.used.discard(int(slot))

  tables = {**lane_tables, **arrivals, **vectors}
  for arr in tables.values():
    arr.setflags(write=False)
  return Ticks(**tables, res_slots=max(a.peak for a in res),
               act_slots=max(1, max(a.peak for a in act)),
               grad_slots=max(1, max(a.peak for a in grad)) if has_backward else 0)


# ---------------------------------------------------------------------------
# Time with unequal forward and backward costs
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Costs:
  """Time of one microbatch's forward / backward through ALL the layers one stage holds.

  An interleaved or V chunk holds 1/v of them and costs 1/v, so makespans compare across
  schedules of the same model and stages. backward_input / backward_weight: the two
  passes zero-bubble schedules split the backward into (None: backward / 2 each); they
  need not add up to `backward` (an executor may redo work in each). comm: time of one
  ring permute of an activation or gradient between stages (asynchronous: per message
  between stages; lock step: per permute, `ring_sends` of them a tick).
  """
  forward: float
  backward: float
  comm: float = 0.0
  backward_input: float | None = None
  backward_weight: float | None = None

  def __post_init__(self):
    for field, low in (("forward", "> 0"), ("backward", "> 0"), ("comm", ">= 0"),
                       ("backward_input", "> 0"), ("backward_weight", "> 0")):
      x = getattr(self, field)
      if x is None and field.startswith("backward_"):
        continue
      ok = (isinstance(x, (int, float, np.integer, np.floating))
            and not isinstance(x, (bool, np.bool_)) and math.isfinite(x))
      if not ok or (x <= 0 if field != "comm" else x < 0):
        raise ValueError(f"Costs.{field}={x!r} is invalid; valid: a finite number {low}"
                         + (" or None" if field.startswith("backward_") else ""))

  def of_kind(self) -> np.ndarray:
    """Cost of each action kind (IDLE .. BACKWARD_WEIGHT) on a whole stage's layers."""
    half = self.backward / 2
    return np.array([0.0, self.forward, self.backward,
                     half if self.backward_input is None else self.backward_input,
                     half if self.backward_weight is None else self.backward_weight])


# The costs that pick the executor's tick shape (Schedule.executed): its chunk backward
# costs about twice the forward (1.95x-2.2x measured), split about evenly into B and W.
EXECUTOR_COSTS = Costs(forward=1.0, backward=2.0)


@dataclasses.dataclass(frozen=True)
class Timing:
  """Makespans and timed bubbles (idle time / (stages x makespan)) in the units of Costs.

  asynchronous: each stage runs its program order, every op as soon as the stage is free
    and its inputs have arrived (Megatron-style). lockstep_fused: the fused ticks, each as
    long as its slowest stage's lanes together, plus comm. lockstep_unfused: the table's
    ticks, each as long as its slowest action, plus comm. lockstep: that of the ticks the
    executor runs (`Schedule.executed`). busy: compute time per stage (the same for all);
    time spent in comm counts as idle.
  """
  asynchronous: float
  lockstep: float
  busy: tuple[float, ...]
  lockstep_fused: float
  lockstep_unfused: float

  def _bubble(self, makespan: float) -> float:
    return 1.0 - sum(self.busy) / (len(self.busy) * makespan) if makespan else 0.0

  @property
  def asynchronous_bubble(self) -> float:
    return self._bubble(self.asynchronous)

  @property
  def lockstep_bubble(self) -> float:
    return self._bubble(self.lockstep)


def ring_sends(ticks: Ticks) -> int:
  """The ring permutes the executor runs every tick: activations on to stage s + 1 and
  gradients back to s - 1, and a V's way back (`act_recv_back`, `grad_recv_back`) where the
  schedule sends that way. Each runs every tick, carrying data or not."""
  return 2 + int(np.any(ticks.act_recv_back >= 0)) + int(np.any(ticks.grad_recv_back >= 0))


def _lockstep(ticks: Ticks, cost: np.ndarray, comm: float) -> float:
  """Every tick waits for its slowest stage's lanes, one after the other, then its sends,
  one after the other (`ring_sends`)."""
  per_stage = cost[ticks.kind].sum(axis=1)  # [ticks, stages]
  return float(np.sum(per_stage.max(axis=1, initial=0.0))
               + comm * ring_sends(ticks) * ticks.ticks)


def timed(schedule: Schedule, costs: Costs) -> Timing:
  """The schedule's time under `costs`, asynchronous and in lock step (see Timing)."""
  p, v = schedule.stages, schedule.virtual_stages
  cost = costs.of_kind() / v
  kind, microbatch = schedule.unfused.kind[:, 0], schedule.unfused.microbatch[:, 0]
  chunk = schedule.chunk
  action = cost[kind]  # [ticks, stages]
  stage_of = schedule.stage_of
  # Asynchronous: the table's per-stage order is the program order, and everything an op
  # needs ran at an earlier tick, so walking the ticks visits producers first.
  end: dict[_Op, float] = {}
  free = [0.0] * p
  for t in range(schedule.ticks):
    for s in range(p):
      k = int(kind[t, s])
      if k == IDLE:
        continue
      mb, g = int(microbatch[t, s]), int(chunk[t, s])
      start = free[s]
      for n in _needs((k, mb, g), schedule.chunks):
        sent = stage_of[n[2]] != s  # only a message to another stage pays comm
        start = max(start, end[n] + (costs.comm if sent else 0.0))
      end[(k, mb, g)] = free[s] = start + cost[k]
  asynchronous = max(free) if end else 0.0
  fused, unfused = (_lockstep(t, cost, costs.comm) for t in (schedule.fused, schedule.unfused))
  return Timing(asynchronous=float(asynchronous),
                lockstep=fused if schedule.executed is schedule.fused else unfused,
                busy=tuple(float(x) for x in action.sum(axis=0)),
                lockstep_fused=fused, lockstep_unfused=unfused)
