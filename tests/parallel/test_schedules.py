"""Tests for jaxsys.parallel.schedules: pure numpy, no devices."""

import itertools
import pathlib
import subprocess
import sys
from fractions import Fraction

import numpy as np
from absl.testing import absltest, parameterized

from jaxsys.parallel import schedules as sched_lib
from jaxsys.parallel.schedules import BACKWARD, FORWARD, IDLE, Costs, make_schedule, timed

# (name, stages, microbatches, virtual_stages): small, odd and uneven shapes included.
_CASES = (
    [("gpipe", p, m, 1) for p, m in [(1, 1), (1, 3), (2, 1), (3, 2), (4, 4), (4, 8), (3, 7)]]
    + [("1f1b", p, m, 1) for p, m in [(1, 1), (1, 4), (2, 2), (3, 5), (4, 4), (4, 8), (8, 9)]]
    + [("interleaved_1f1b", p, m, v)
       for p, m, v in [(1, 2, 1), (1, 3, 3), (2, 2, 2), (2, 6, 3), (3, 3, 2), (3, 9, 4),
                       (4, 4, 2), (4, 8, 1), (4, 8, 2), (4, 12, 4), (8, 16, 2)]])


def _named(cases):
  return [(f"{n}_p{p}_m{m}_v{v}", n, p, m, v) for n, p, m, v in cases]


def _replay(sched: sched_lib.Schedule) -> None:
  """Walks the ticks as an executor would, moving symbolic values through every buffer.

  Values: ("act", mb, g) is chunk g's output activation, ("grad", mb, g) the gradient with
  respect to it, ("res", mb, g) chunk g's residuals. At each tick: arrivals sent the tick
  before are written at act_recv / grad_recv; each action reads its inputs (act_in, grad_in,
  res_slot) and writes its residuals; the head writes at the end of the tick; slots read in
  the tick are free only after it. Writing into a slot that holds a value (or is being read
  this tick), reading the wrong value, or leaving anything behind fails.
  """
  p, v, G = sched.stages, sched.virtual_stages, sched.chunks
  table = sched.unfused
  kind, microbatch, virtual, res_slot, act_in, grad_in = (
      getattr(table, f)[:, 0] for f in sched_lib.LANE_FIELDS)  # [ticks, stages]
  training = bool(np.any(kind == BACKWARD))
  busy = object()  # a slot read this tick: not writable until the tick ends
  res = [[None] * table.res_slots for _ in range(p)]
  act = [[None] * table.act_slots for _ in range(p)]
  grad = [[None] * table.grad_slots for _ in range(p)]

  def write(buf, s, slot, value, what):
    assert 0 <= slot < len(buf[s]), f"{what}: slot {slot} outside [0, {len(buf[s])})"
    assert buf[s][slot] is None, f"{what}: slot {slot} on stage {s} still holds {buf[s][slot]}"
    buf[s][slot] = value

  def read(buf, s, slot, value, what, reading):
    assert 0 <= slot < len(buf[s]), f"{what}: slot {slot} outside [0, {len(buf[s])})"
    assert buf[s][slot] == value, f"{what}: slot {slot} on stage {s} holds {buf[s][slot]}"
    buf[s][slot] = busy
    reading.append((buf, s, slot))

  sent_act, sent_grad = {}, {}  # destination stage -> value, sent last tick
  for t in range(sched.ticks):
    what = f"tick {t}"
    # Arrivals: exactly the stages something was sent to, nothing else.
    for name, sent, recv, buf in (("act", sent_act, table.act_recv, act),
                                  ("grad", sent_grad, table.grad_recv, grad)):
      got = {s for s in range(p) if recv[t, s] >= 0}
      assert got == set(sent), f"{what}: {name} arrives at {sorted(got)}, sent {sorted(sent)}"
      for s, value in sent.items():
        write(buf, s, int(recv[t, s]), value, f"{what} {name}_recv")
    sent_act, sent_grad, reading = {}, {}, []
    embed = embed_grad = head = -1
    for s in range(p):
      k, mb, vi = (int(x[t, s]) for x in (kind, microbatch, virtual))
      here = f"{what} stage {s}"
      if k == IDLE:
        assert (mb, vi, res_slot[t, s], act_in[t, s], grad_in[t, s]) == (
            -1, -1, -1, -1, -1), here
        continue
      assert 0 <= mb < sched.microbatches and 0 <= vi < v, here
      g = vi * p + s
      if k == FORWARD:
        assert grad_in[t, s] == -1, here
        if g == 0:
          assert act_in[t, s] == -1, here
          embed = mb
        else:
          read(act, s, int(act_in[t, s]), ("act", mb, g - 1), f"{here} act_in", reading)
        if training:
          write(res, s, int(res_slot[t, s]), ("res", mb, g), f"{here} res_slot")
        else:
          assert res_slot[t, s] == -1, here
        if g < G - 1:
          sent_act[(s + 1) % p] = ("act", mb, g)
        else:
          head = mb
      else:
        assert k == BACKWARD and training and act_in[t, s] == -1, here
        read(res, s, int(res_slot[t, s]), ("res", mb, g), f"{here} res_slot", reading)
        read(grad, s, int(grad_in[t, s]), ("grad", mb, g), f"{here} grad_in", reading)
        if g > 0:
          sent_grad[(s - 1) % p] = ("grad", mb, g - 1)
        else:
          embed_grad = mb
    assert table.embed_microbatch[t] == embed, what
    assert table.embed_grad_microbatch[t] == embed_grad, what
    assert table.head_microbatch[t] == head, what
    if head >= 0 and training:
      write(grad, (G - 1) % p, int(table.head_slot[t]), ("grad", head, G - 1), f"{what} head")
    else:
      assert table.head_slot[t] == -1, what
    for buf, s, slot in reading:
      buf[s][slot] = None
  assert not sent_act and not sent_grad, "messages sent on the last tick"
  for buf in res + act + grad:
    assert all(x is None for x in buf), f"left in a buffer: {buf}"


class RequiredNumbersTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("gpipe", "gpipe", 1, Fraction(3, 11), 22, 8),
      ("1f1b", "1f1b", 1, Fraction(3, 11), 22, 4),
      ("interleaved", "interleaved_1f1b", 2, Fraction(3, 19), 38, None),
  )
  def test_p4_m8(self, name, v, bubble, ticks, in_flight):
    sched = make_schedule(name, stages=4, microbatches=8, virtual_stages=v)
    self.assertEqual(sched.ticks, ticks)
    self.assertAlmostEqual(sched.bubble_fraction, float(bubble), places=12)
    self.assertAlmostEqual(sched.useful_fraction, 1 - float(bubble), places=12)
    if in_flight is not None:
      self.assertEqual(sched.max_in_flight, in_flight)
    self.assertEqual(sched.unfused.res_slots, sched.max_in_flight)

  def test_interleaved_formula_grid(self):
    for p, v in itertools.product((2, 4, 8), (1, 2, 4)):
      for m in range(p, 33, p):
        sched = make_schedule("interleaved_1f1b", stages=p, microbatches=m, virtual_stages=v)
        with self.subTest(p=p, m=m, v=v):
          self.assertEqual(sched.ticks, 2 * (v * m + p - 1))
          self.assertAlmostEqual(sched.bubble_fraction, (p - 1) / (v * m + p - 1), places=12)

  def test_gpipe_1f1b_formula_grid(self):
    for name, p in itertools.product(("gpipe", "1f1b"), (1, 2, 3, 4, 8)):
      for m in range(1 if name == "gpipe" else p, 33):
        sched = make_schedule(name, stages=p, microbatches=m)
        with self.subTest(name=name, p=p, m=m):
          self.assertEqual(sched.ticks, 2 * (m + p - 1))
          self.assertAlmostEqual(sched.bubble_fraction, (p - 1) / (m + p - 1), places=12)
          self.assertEqual(sched.max_in_flight, m if name == "gpipe" else p)
          self.assertEqual(sched.unfused.res_slots, sched.max_in_flight)

  def test_interleaved_v1_is_1f1b(self):
    for p, m in [(1, 3), (2, 4), (4, 8), (8, 16)]:
      a = make_schedule("interleaved_1f1b", stages=p, microbatches=m, virtual_stages=1)
      b = make_schedule("1f1b", stages=p, microbatches=m)
      for field in ("kind", "microbatch", "virtual", "res_slot", "act_recv", "act_in",
                    "grad_recv", "grad_in", "head_slot", "head_microbatch"):
        np.testing.assert_array_equal(getattr(a.unfused, field), getattr(b.unfused, field),
                                      err_msg=field)

  def test_one_stage(self):
    for name in ("gpipe", "1f1b", "interleaved_1f1b"):
      sched = make_schedule(name, stages=1, microbatches=3)
      self.assertEqual((sched.ticks, sched.bubble_fraction), (6, 0.0))
      self.assertEqual(sched.unfused.act_slots, 1)
    one = make_schedule("1f1b", stages=1, microbatches=3).unfused
    np.testing.assert_array_equal(one.kind[:, 0, 0], [FORWARD, BACKWARD] * 3)
    np.testing.assert_array_equal(one.microbatch[:, 0, 0], [0, 0, 1, 1, 2, 2])


class StructureTest(parameterized.TestCase):

  @parameterized.named_parameters(*_named(_CASES))
  def test_every_chunk_once_and_on_time(self, name, p, m, v):
    sched = make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
    G = p * v
    self.assertEqual(sched.chunks, G)
    table = sched.unfused
    for arr in (table.kind, table.microbatch, table.virtual, table.res_slot, table.act_in,
                table.grad_in):
      self.assertEqual((arr.shape, arr.dtype), ((sched.ticks, 1, p), np.int32))
    for arr in (table.act_recv, table.grad_recv):
      self.assertEqual((arr.shape, arr.dtype), ((sched.ticks, p), np.int32))
    for arr in (table.head_slot, table.head_microbatch, table.embed_microbatch,
                table.embed_grad_microbatch):
      self.assertEqual((arr.shape, arr.dtype), ((sched.ticks,), np.int32))
    when = {}  # (kind, mb, g) -> tick
    for t, s in itertools.product(range(sched.ticks), range(p)):
      k = int(table.kind[t, 0, s])
      if k == IDLE:
        continue
      g = int(sched.chunk[t, s])
      self.assertEqual(g % p, s)  # chunk g runs on stage g % p
      key = (k, int(table.microbatch[t, 0, s]), g)
      self.assertNotIn(key, when)
      when[key] = t
    expected = {(k, mb, g) for k in (FORWARD, BACKWARD) for mb in range(m) for g in range(G)}
    self.assertEqual(set(when), expected)
    for mb, g in itertools.product(range(m), range(G)):
      f, b = when[(FORWARD, mb, g)], when[(BACKWARD, mb, g)]
      self.assertLess(f, b)
      if g > 0:  # the input activation arrives one tick after it was sent
        self.assertGreaterEqual(f, when[(FORWARD, mb, g - 1)] + 1)
      if g < G - 1:  # the output gradient likewise
        self.assertGreaterEqual(b, when[(BACKWARD, mb, g + 1)] + 1)
      else:  # the head runs at the end of the last forward's tick
        self.assertGreaterEqual(b, f + 1)
    # Every stage is busy 2*v*m ticks.
    np.testing.assert_array_equal(np.sum(table.kind[:, 0] != IDLE, axis=0), 2 * v * m)

  @parameterized.named_parameters(*_named(_CASES))
  def test_replay(self, name, p, m, v):
    _replay(make_schedule(name, stages=p, microbatches=m, virtual_stages=v))

  @parameterized.named_parameters(*_named(_CASES))
  def test_replay_forward_only(self, name, p, m, v):
    full = make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
    fwd = full.forward_only()
    _replay(fwd)
    table = fwd.unfused
    self.assertFalse(np.any(table.kind == BACKWARD))
    self.assertEqual(int(np.sum(table.kind == FORWARD)), m * p * v)
    self.assertEqual(fwd.ticks, v * m + p - 1)
    self.assertEqual((table.res_slots, table.grad_slots, fwd.max_in_flight), (0, 0, 0))
    for arr in (table.res_slot, table.grad_recv, table.grad_in, table.head_slot,
                table.embed_grad_microbatch):
      np.testing.assert_array_equal(arr, -1)
    # The same per-stage order of forwards.
    for s in range(p):
      order = lambda x: [(int(x.microbatch[t, 0, s]), int(x.virtual[t, 0, s]))
                         for t in range(x.ticks) if x.kind[t, 0, s] == FORWARD]
      self.assertEqual(order(table), order(full.unfused))

  def test_interleaved_megatron_order(self):
    # Stage 0, p=2, m=4, v=2: warmup (2-0-1)*2 + (2-1)*2 = 4 forwards, microbatch groups of 2.
    table = make_schedule("interleaved_1f1b", stages=2, microbatches=4,
                          virtual_stages=2).unfused
    kind, microbatch, virtual = (x[:, 0, 0] for x in (table.kind, table.microbatch,
                                                      table.virtual))
    ops = [("F" if kind[t] == FORWARD else "B", int(microbatch[t]), int(virtual[t]))
           for t in range(table.ticks) if kind[t] != IDLE]
    self.assertEqual(ops[:6], [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
                               ("F", 2, 0), ("B", 0, 1)])
    self.assertEqual(ops[-2:], [("B", 2, 0), ("B", 3, 0)])

  def test_tables_read_only(self):
    sched = make_schedule("1f1b", stages=2, microbatches=2)
    with self.assertRaises(ValueError):
      sched.unfused.kind[0, 0, 0] = 2

  def test_chart_and_summary(self):
    sched = make_schedule("interleaved_1f1b", stages=2, microbatches=2, virtual_stages=2)
    self.assertEqual(sched.summary(), "schedule=interleaved_1f1b stages=2 microbatches=2 "
                     f"virtual=2 ticks={sched.ticks} bubble={1 / 5:.3f} "
                     f"max_in_flight={sched.max_in_flight} runs=9 fused ticks")
    self.assertTrue(make_schedule("1f1b", stages=4, microbatches=8).summary().endswith(
        "runs=22 table ticks"))  # fused 1F1B ends later in lock step
    lines = sched.chart().splitlines()
    self.assertEqual(lines[0], sched.summary())
    self.assertLen(lines, 3)
    self.assertEqual(lines[1].split("|")[1].split()[:4], ["F0a", "F1a", "F0b", "F1b"])
    self.assertEqual(len(lines[2].split("|")[1].split()), sched.executed.ticks)  # 9 fused
    self.assertIn("b1a", lines[1])
    self.assertIn("F1", make_schedule("gpipe", stages=2, microbatches=2).chart())

  def test_chart_draws_the_ticks_that_run(self):
    """Where fused ticks run, the chart draws them (both lanes' actions in a cell, backward
    first), not the table's ticks; where the table's run, the table."""
    gpipe = make_schedule("gpipe", stages=2, microbatches=2)
    self.assertIs(gpipe.executed, gpipe.fused)
    self.assertEqual(gpipe.chart().splitlines()[1:], ["stage 0 | F0   F1   .    b0   b1",
                                                      "stage 1 | .    F0   b0F1 b1   ."])
    one = make_schedule("1f1b", stages=2, microbatches=4)
    self.assertIs(one.executed, one.fused)
    rows = [line.split("|")[1].split() for line in one.chart().splitlines()[1:]]
    self.assertEqual([len(row) for row in rows], [one.fused.ticks] * 2)
    self.assertLess(one.fused.ticks, one.ticks)
    self.assertIn("b0F2", rows[0])
    table = make_schedule("1f1b", stages=4, microbatches=8)
    self.assertIs(table.executed, table.unfused)
    self.assertEqual(table.chart().splitlines()[4],
                     "stage 3 | .  .  .  F0 b0 F1 b1 F2 b2 F3 b3 F4 b4 F5 b5 F6 b6 F7 b7 .  .  .")


class ErrorTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("unknown", "foo", 4, 8, 1,
       "pipeline.schedule='foo' is unknown; valid: gpipe, 1f1b, eager_1f1b, interleaved_1f1b"),
      ("stages_zero", "gpipe", 0, 8, 1, "mesh axis stage has size 0"),
      ("stages_float", "gpipe", 2.0, 8, 1, "mesh axis stage has size 2.0"),
      ("microbatches_zero", "gpipe", 2, 0, 1, "pipeline.microbatches=0 is invalid"),
      ("microbatches_bool", "gpipe", 1, True, 1, "pipeline.microbatches=True is invalid"),
      ("1f1b_few", "1f1b", 4, 2, 1,
       "pipeline.microbatches=2 is fewer than the 4 stages; 1f1b needs microbatches >= stages"),
      ("interleaved_few", "interleaved_1f1b", 4, 2, 2,
       "pipeline.microbatches=2 is fewer than the 4 stages; interleaved_1f1b needs"),
      ("interleaved_multiple", "interleaved_1f1b", 4, 6, 2,
       "pipeline.microbatches=6 is not a multiple of the 4 stages"),
      ("virtual_zero", "interleaved_1f1b", 4, 8, 0, "pipeline.virtual_stages=0 is invalid"),
      ("virtual_gpipe", "gpipe", 4, 8, 2,
       "pipeline.virtual_stages=2 needs pipeline.schedule=interleaved_1f1b"),
      ("virtual_1f1b", "1f1b", 4, 8, 2,
       "pipeline.virtual_stages=2 needs pipeline.schedule=interleaved_1f1b"),
  )
  def test_errors(self, name, stages, microbatches, virtual, fragment):
    with self.assertRaises(ValueError) as cm:
      make_schedule(name, stages=stages, microbatches=microbatches, virtual_stages=virtual)
    msg = str(cm.exception)
    self.assertIn(fragment, msg)
    self.assertNotIn("\n", msg)

  def test_gpipe_allows_fewer_microbatches_than_stages(self):
    self.assertEqual(make_schedule("gpipe", stages=4, microbatches=2).ticks, 2 * (2 + 4 - 1))


class TimedTest(parameterized.TestCase):

  # Backward = 2 x forward, no comm, in units of one stage's forward (an interleaved chunk
  # is half a stage's layers). The table's lock step: 1F1B's ticks mix 1- and 2-unit
  # actions across stages and each waits for the slowest; asynchronous 1F1B matches GPipe.
  # Fused, interleaved 1F1B's ticks hold a forward and a backward on every stage: its lock
  # step is its asynchronous makespan; 1F1B keeps too few microbatches in flight for that.
  @parameterized.named_parameters(
      ("p4_m8_gpipe", "gpipe", 4, 8, 1, 33.0, 33.0, 33.0, 33.0),
      ("p4_m8_1f1b", "1f1b", 4, 8, 1, 40.0, 33.0, 40.0, 46.0),
      ("p4_m8_interleaved", "interleaved_1f1b", 4, 8, 2, 28.5, 28.5, 34.0, 28.5),
      ("p8_m32_gpipe", "gpipe", 8, 32, 1, 117.0, 117.0, 117.0, 117.0),
      ("p8_m32_1f1b", "1f1b", 8, 32, 1, 148.0, 117.0, 148.0, 192.0),
      ("p8_m32_interleaved", "interleaved_1f1b", 8, 32, 2, 106.5, 106.5, 134.0, 106.5),
  )
  def test_backward_twice_forward(self, name, p, m, v, lockstep, asynchronous, unfused, fused):
    t = timed(make_schedule(name, stages=p, microbatches=m, virtual_stages=v),
              Costs(forward=1, backward=2))
    self.assertEqual((t.lockstep, t.asynchronous), (lockstep, asynchronous))
    self.assertEqual((t.lockstep_unfused, t.lockstep_fused), (unfused, fused))
    self.assertEqual(t.busy, (3.0 * m,) * p)
    self.assertAlmostEqual(t.lockstep_bubble, 1 - 3 * m / lockstep, places=12)
    self.assertAlmostEqual(t.asynchronous_bubble, 1 - 3 * m / asynchronous, places=12)

  @parameterized.named_parameters(*_named(_CASES))
  def test_equal_costs_give_ticks(self, name, p, m, v):
    sched = make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
    t = timed(sched, Costs(forward=1, backward=1))
    # A tick is a chunk: 1/v of a stage's layers.
    self.assertAlmostEqual(t.lockstep * v, sched.ticks, places=9)
    self.assertAlmostEqual(t.asynchronous * v, sched.ticks, places=9)
    self.assertAlmostEqual(t.lockstep_bubble, sched.bubble_fraction, places=12)
    self.assertAlmostEqual(t.asynchronous_bubble, sched.bubble_fraction, places=12)

  def test_executed_is_the_shorter_lock_step(self):
    """The executor runs whichever of fused and table ticks is shorter at B = 2F; fusing
    never lengthens GPipe or interleaved 1F1B, and the executed lock step never starts
    anything earlier than the asynchronous run."""
    costs = Costs(forward=1, backward=2)
    for name, p, m, v in _CASES:
      sched = make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
      t = timed(sched, costs)
      with self.subTest(name=name, p=p, m=m, v=v):
        self.assertAlmostEqual(t.lockstep, min(t.lockstep_fused, t.lockstep_unfused), places=9)
        self.assertLessEqual(sched.executed.ticks, sched.ticks)
        self.assertLessEqual(t.asynchronous, min(t.lockstep_fused, t.lockstep_unfused) + 1e-9)
        if name == "gpipe" or v > 1:
          self.assertLessEqual(t.lockstep_fused, t.lockstep_unfused + 1e-9)
          self.assertIs(sched.executed, sched.fused)

  def test_fused_interleaved_lock_step_is_asynchronous(self):
    """Megatron's warmup keeps 2(p - s - 1) + (v - 1) p chunks ahead, enough for fused ticks
    that each run a forward and a backward on every stage: the lock step loses nothing."""
    for p, m, ratio in itertools.product((2, 4, 8), (8, 16, 32), (1.5, 2.0, 2.2)):
      costs = Costs(forward=1, backward=ratio)
      t = timed(make_schedule("interleaved_1f1b", stages=p, microbatches=m, virtual_stages=2),
                costs)
      with self.subTest(p=p, m=m, ratio=ratio):
        self.assertAlmostEqual(t.lockstep, t.asynchronous, places=9)
        self.assertAlmostEqual(t.lockstep_bubble, t.asynchronous_bubble, places=9)

  def test_asynchronous_1f1b_no_worse_than_gpipe(self):
    for p, m in itertools.product((2, 3, 4, 8), (8, 9, 16, 32)):
      costs = Costs(forward=1, backward=2)
      with self.subTest(p=p, m=m):
        gpipe = timed(make_schedule("gpipe", stages=p, microbatches=m), costs)
        one = timed(make_schedule("1f1b", stages=p, microbatches=m), costs)
        self.assertLessEqual(one.asynchronous, gpipe.asynchronous + 1e-9)
        for t in (gpipe, one):  # a lock-step tick never starts anything earlier
          self.assertLessEqual(t.asynchronous, t.lockstep + 1e-9)

  def test_eager_1f1b_takes_gpipe_s_time_in_lock_step_with_bounded_memory(self):
    """1F1B's lock step costs it up to 26% over GPipe at B = 2F; with the interleaved
    warmup it runs fused ticks in exactly GPipe's time, holding min(m, 2p - 1) microbatches
    of residuals (1F1B: p, GPipe: m)."""
    for p, m, ratio in itertools.product((2, 4, 8), (8, 16, 32), (1.5, 2.0, 3.0)):
      costs = Costs(forward=1, backward=ratio)
      eager = make_schedule("eager_1f1b", stages=p, microbatches=m)
      with self.subTest(p=p, m=m, ratio=ratio):
        gpipe = timed(make_schedule("gpipe", stages=p, microbatches=m), costs).lockstep
        self.assertAlmostEqual(timed(eager, costs).lockstep, gpipe, places=9)
        self.assertLess(gpipe, timed(make_schedule("1f1b", stages=p, microbatches=m),
                                     costs).lockstep)
        self.assertIs(eager.executed, eager.fused)
        self.assertEqual(eager.unfused.res_slots, min(m, 2 * p - 1))

  def test_comm_costs_1f1b_more_than_gpipe(self):
    # GPipe pays the 2(p-1) sends of one round trip once; 1F1B's steady state waits on a
    # round trip every p microbatches, so with comm > 0 it ends later even asynchronously.
    costs = Costs(forward=1, backward=2, comm=0.1)
    gpipe = timed(make_schedule("gpipe", stages=4, microbatches=8), costs)
    one = timed(make_schedule("1f1b", stages=4, microbatches=8), costs)
    self.assertAlmostEqual(gpipe.asynchronous, 33.6, places=9)  # 33 + 6 sends
    self.assertAlmostEqual(one.asynchronous, 34.6, places=9)

  def test_comm(self):
    # GPipe, p=2, m=1: F0, send, F1, B1 (the head's gradient is local), send, B0.
    # In lock step every tick runs the executor's two ring permutes (activations on,
    # gradients back), carrying data or not: 4 ticks x 2 x 0.25.
    t = timed(make_schedule("gpipe", stages=2, microbatches=1), Costs(1, 1, comm=0.25))
    self.assertEqual((t.asynchronous, t.lockstep), (4.5, 6.0))
    self.assertEqual(t.busy, (2.0, 2.0))
    self.assertAlmostEqual(t.lockstep_bubble, 1 - 4 / 12, places=12)
    sched = make_schedule("1f1b", stages=4, microbatches=8)
    self.assertEqual(timed(sched, Costs(1, 2, comm=0.5)).lockstep, 40.0 + 2 * 0.5 * sched.ticks)
    # A V also sends back up the ring (activations and gradients): 4 permutes a tick (at
    # p=2 the way back is the same neighbour, so the two rings carry it).
    self.assertEqual(sched_lib.ring_sends(make_schedule(
        "zbv", stages=2, microbatches=4, virtual_stages=2).executed), 2)
    zbv = make_schedule("zbv", stages=4, microbatches=8, virtual_stages=2)
    ticks = zbv.executed
    base = timed(zbv, Costs(1, 2)).lockstep
    self.assertEqual(sched_lib.ring_sends(ticks), 4)
    self.assertAlmostEqual(timed(zbv, Costs(1, 2, comm=0.5)).lockstep,
                           base + 4 * 0.5 * ticks.ticks, places=9)
    # One stage sends nothing: comm costs nothing asynchronously.
    one = make_schedule("interleaved_1f1b", stages=1, microbatches=3, virtual_stages=3)
    self.assertEqual(timed(one, Costs(1, 2, comm=5.0)).asynchronous, 9.0)

  @parameterized.named_parameters(
      ("forward_zero", dict(forward=0, backward=1), "Costs.forward=0 is invalid; valid: a "
       "finite number > 0"),
      ("forward_bool", dict(forward=True, backward=1), "Costs.forward=True is invalid"),
      ("forward_str", dict(forward="1", backward=1), "Costs.forward='1' is invalid"),
      ("backward_nan", dict(forward=1, backward=float("nan")), "Costs.backward=nan is invalid"),
      ("backward_inf", dict(forward=1, backward=float("inf")), "Costs.backward=inf is invalid"),
      ("backward_negative", dict(forward=1, backward=-2.0), "Costs.backward=-2.0 is invalid"),
      ("comm_negative", dict(forward=1, backward=2, comm=-0.1),
       "Costs.comm=-0.1 is invalid; valid: a finite number >= 0"),
  )
  def test_bad_costs(self, kwargs, fragment):
    with self.assertRaises(ValueError) as cm:
      Costs(**kwargs)
    msg = str(cm.exception)
    self.assertIn(fragment, msg)
    self.assertNotIn("\n", msg)

  def test_zero_comm_allowed(self):
    self.assertEqual(Costs(forward=1, backward=2.5, comm=0).comm, 0)


class ImportTest(absltest.TestCase):

  def test_no_jax(self):
    code = ("import sys; import jaxsys.parallel.schedules; "
            "sys.exit('jax' in sys.modules or 'jax.numpy' in sys.modules)")
    root = pathlib.Path(sched_lib.__file__).parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


if __name__ == "__main__":
  absltest.main()
