"""Zero-bubble schedules (ZB-H1, ZBV) as tables: pure numpy, no devices."""

import itertools

import numpy as np
from absl.testing import absltest, parameterized

from jaxsys.parallel import schedules as sched_lib
from jaxsys.parallel.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, IDLE,
                                       Costs, make_schedule, timed)

# (name, stages, microbatches, virtual_stages): odd and uneven shapes, and the loop
# schedules too, so the general replay covers them.
_CASES = (
    [("zb_h1", p, m, 1) for p, m in [(1, 1), (1, 3), (2, 2), (2, 5), (3, 3), (3, 7), (4, 4),
                                     (4, 8), (8, 8), (8, 13)]]
    + [("zbv", p, m, 2) for p, m in [(1, 1), (1, 3), (2, 2), (2, 4), (2, 5), (3, 3), (3, 7),
                                     (4, 4), (4, 8), (4, 11), (8, 16)]]
    + [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1), ("interleaved_1f1b", 4, 8, 2)])
_NAMED = [(f"{n}_p{p}_m{m}_v{v}", n, p, m, v) for n, p, m, v in _CASES]
_RECV = {"act": ("act_recv", "act_recv_back", "act_recv_self"),
         "grad": ("grad_recv", "grad_recv_back", "grad_recv_self")}


def _dst(sched, src: int, via: str) -> int:
  """Where a message from `src` lands through the recv table named `via`."""
  step = {"act_recv": 1, "act_recv_back": -1, "grad_recv": -1, "grad_recv_back": 1}
  return src if via.endswith("self") else (src + step[via]) % sched.stages


def replay(sched: sched_lib.Schedule, ticks: sched_lib.Ticks | None = None) -> None:
  """Walks the ticks (default: the table's, one lane) as the executor does, moving symbolic
  values through every buffer.

  ("act", mb, g): chunk g's output; ("grad", mb, g): the gradient with respect to it;
  ("res", mb, g): chunk g's residuals. A message sent at tick t (a forward's output to the
  next chunk's stage, an input gradient to the previous chunk's) is written at t + 1 by
  the recv table of its route (from s - 1, from s + 1, from itself); a BACKWARD_INPUT reads
  its residuals and output gradient and leaves them, its BACKWARD_WEIGHT reads the same
  slots and frees them. A stage runs its lanes in order: a residual slot one frees is free
  for a later lane, inbox slots only after the tick. Writing a full slot, reading a wrong
  value, a message through the wrong route, or anything left behind fails.
  """
  ticks = sched.unfused if ticks is None else ticks
  p, G = sched.stages, sched.chunks
  stage_of = sched.stage_of
  training = bool(np.any(ticks.kind >= BACKWARD))
  busy = object()
  bufs = {"res": [[None] * ticks.res_slots for _ in range(p)],
          "act": [[None] * ticks.act_slots for _ in range(p)],
          "grad": [[None] * ticks.grad_slots for _ in range(p)]}

  def write(name, s, slot, value, what):
    buf = bufs[name]
    assert 0 <= slot < len(buf[s]), f"{what}: slot {slot} outside [0, {len(buf[s])})"
    assert buf[s][slot] is None, f"{what}: slot {slot} on stage {s} still holds {buf[s][slot]}"
    buf[s][slot] = value

  def read(name, s, slot, value, what, reading, free=True):
    buf = bufs[name]
    assert 0 <= slot < len(buf[s]), f"{what}: slot {slot} outside [0, {len(buf[s])})"
    assert buf[s][slot] == value, f"{what}: slot {slot} on stage {s} holds {buf[s][slot]}"
    if free and name == "res":  # read before any later lane runs
      buf[s][slot] = None
    elif free:  # an inbox slot read this tick is not writable until the tick ends
      buf[s][slot] = busy
      reading.append((buf, s, slot))

  sent = {"act": [], "grad": []}  # (src, dst, value) sent last tick
  for t in range(ticks.ticks):
    what = f"tick {t}"
    for name, tables in _RECV.items():
      landed = set()
      for via in tables:
        for s in range(p):
          slot = int(getattr(ticks, via)[t, s])
          if slot < 0:
            continue
          srcs = [src for src, dst, _ in sent[name] if dst == s and _dst(sched, src, via) == s]
          assert srcs, f"{what}: {via} on stage {s} but nothing sent that way"
          (value,) = [v for src, dst, v in sent[name] if dst == s and src in srcs]
          write(name, s, slot, value, f"{what} {via}")
          landed.add((s, value))
      assert landed == {(dst, v) for _, dst, v in sent[name]}, f"{what}: {name} lost"
    sent, reading = {"act": [], "grad": []}, []
    embed = embed_grad = head = -1
    for s, lane in itertools.product(range(p), range(ticks.lanes)):
      k, mb, vi, res_slot, act_in, grad_in = (int(getattr(ticks, f)[t, lane, s])
                                              for f in sched_lib.LANE_FIELDS)
      here = f"{what} stage {s} lane {lane}"
      if k == IDLE:
        assert (mb, vi, res_slot, act_in, grad_in) == (-1, -1, -1, -1, -1), here
        continue
      g = int(sched.chunk_of[vi, s])
      assert stage_of[g] == s, here
      if k == FORWARD:
        assert grad_in == -1, here
        if g == 0:
          assert act_in == -1 and embed == -1, here
          embed = mb
        else:
          read("act", s, act_in, ("act", mb, g - 1), f"{here} act_in", reading)
        if training:
          write("res", s, res_slot, ("res", mb, g), f"{here} res_slot")
        if g < G - 1:
          sent["act"].append((s, int(stage_of[g + 1]), ("act", mb, g)))
        else:
          assert head == -1, here
          head = mb
        continue
      assert act_in == -1, here
      free = k != BACKWARD_INPUT  # the weight gradient reads them again
      read("res", s, res_slot, ("res", mb, g), f"{here} res_slot", reading, free)
      read("grad", s, grad_in, ("grad", mb, g), f"{here} grad_in", reading, free)
      if k in (BACKWARD, BACKWARD_INPUT):
        if g > 0:
          sent["grad"].append((s, int(stage_of[g - 1]), ("grad", mb, g - 1)))
        else:
          assert embed_grad == -1, here
          embed_grad = mb
    assert ticks.embed_microbatch[t] == embed, what
    assert ticks.embed_grad_microbatch[t] == embed_grad, what
    assert ticks.head_microbatch[t] == head, what
    if head >= 0 and training:
      write("grad", sched.head_stage, int(ticks.head_slot[t]), ("grad", head, G - 1),
            f"{what} head")
    else:
      assert ticks.head_slot[t] == -1, what
    for buf, s, slot in reading:
      buf[s][slot] = None
  assert not sent["act"] and not sent["grad"], "messages sent on the last tick"
  for name, buf in bufs.items():
    for s, slots in enumerate(buf):
      assert all(x is None for x in slots), f"left in {name} on stage {s}: {slots}"


def _when(sched):
  """(kind, microbatch, chunk) -> tick, each op once."""
  when = {}
  table = sched.unfused
  for t, s in itertools.product(range(sched.ticks), range(sched.stages)):
    k = int(table.kind[t, 0, s])
    if k != IDLE:
      key = (k, int(table.microbatch[t, 0, s]), int(sched.chunk[t, s]))
      assert key not in when, key
      when[key] = t
  return when


class StructureTest(parameterized.TestCase):

  @parameterized.named_parameters(*_NAMED)
  def test_replay(self, name, p, m, v):
    replay(make_schedule(name, stages=p, microbatches=m, virtual_stages=v))

  @parameterized.named_parameters(*_NAMED)
  def test_replay_forward_only(self, name, p, m, v):
    full = make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
    fwd = full.forward_only()
    replay(fwd)
    np.testing.assert_array_equal(fwd.chunk_of, full.chunk_of)
    if name != "zbv":  # a loop's forwards alone: no bubble but the fill
      self.assertEqual(fwd.ticks, v * m + p - 1)
    self.assertFalse(np.any(fwd.unfused.kind >= BACKWARD))
    for s in range(p):
      order = lambda x: [(int(x.microbatch[t, 0, s]), int(x.virtual[t, 0, s]))
                         for t in range(x.ticks) if x.kind[t, 0, s] == FORWARD]
      self.assertEqual(order(fwd.unfused), order(full.unfused))

  @parameterized.named_parameters(*[c for c in _NAMED if c[1] in ("zb_h1", "zbv")])
  def test_f_before_b_before_w_and_across_stages(self, name, p, m, v):
    sched = make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
    G = p * v
    when = _when(sched)
    self.assertEqual(set(when), {(k, mb, g) for k in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
                                 for mb in range(m) for g in range(G)})
    self.assertTrue(sched.split_backward)
    for mb, g in itertools.product(range(m), range(G)):
      f, b, w = (when[(k, mb, g)] for k in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT))
      self.assertLess(f, b)
      self.assertLess(b, w)
      if g > 0:  # the input activation arrives one tick after it was sent
        self.assertGreater(f, when[(FORWARD, mb, g - 1)])
      if g < G - 1:  # the output gradient likewise, from the next chunk's input gradient
        self.assertGreater(b, when[(BACKWARD_INPUT, mb, g + 1)])
      else:  # the head runs at the end of the last forward's tick
        self.assertGreater(b, f)
    # Every stage runs 3 ops per microbatch and chunk.
    np.testing.assert_array_equal(np.sum(sched.unfused.kind[:, 0] != IDLE, axis=0), 3 * v * m)

  def test_v_placement(self):
    sched = make_schedule("zbv", stages=4, microbatches=8, virtual_stages=2)
    np.testing.assert_array_equal(sched.chunk_of, [[0, 1, 2, 3], [7, 6, 5, 4]])
    np.testing.assert_array_equal(sched.stage_of, [0, 1, 2, 3, 3, 2, 1, 0])
    self.assertEqual(sched.head_stage, 0)
    # The V's turn stays on stage 3; its way back up arrives from s + 1.
    self.assertTrue(np.any(sched.unfused.act_recv_self[:, 3] >= 0))
    self.assertTrue(np.all(sched.unfused.act_recv_self[:, :3] < 0))
    self.assertTrue(np.any(sched.unfused.act_recv_back >= 0))
    for loop in ("1f1b", "zb_h1"):
      other = make_schedule(loop, stages=4, microbatches=8)
      self.assertEqual(other.head_stage, 3)
      for k in ("act_recv_back", "act_recv_self", "grad_recv_back", "grad_recv_self"):
        self.assertTrue(np.all(getattr(other.unfused, k) < 0), (loop, k))

  def test_zb_h1_defers_each_stages_weight_gradients(self):
    # Stage s runs its first W after s + 1 input gradients (arXiv 2401.10241, ZB-H1).
    p, m = 4, 8
    sched = make_schedule("zb_h1", stages=p, microbatches=m)
    for s in range(p):
      ops = [int(k) for k in sched.unfused.kind[:, 0, s] if k != IDLE]
      first_w = ops.index(BACKWARD_WEIGHT)
      self.assertEqual(ops[:first_w].count(BACKWARD_INPUT), s + 1)
      self.assertEqual(ops[:first_w].count(FORWARD), min(p, m))

  def test_chart(self):
    lines = make_schedule("zb_h1", stages=2, microbatches=2).chart().splitlines()
    self.assertEqual(lines[1].split("|")[1].split(), ["F0", "F1", ".", "B0", "W0", "B1", "W1"])
    self.assertIn("W0b", make_schedule("zbv", stages=2, microbatches=2,
                                       virtual_stages=2).chart())


class FusedTest(parameterized.TestCase):
  """The fused ticks: the same program orders in two lanes a tick, backward-type then forward."""

  @parameterized.named_parameters(*_NAMED)
  def test_replay(self, name, p, m, v):
    sched = make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
    replay(sched, sched.fused)
    fwd = sched.forward_only()
    replay(fwd, fwd.fused)

  @parameterized.named_parameters(*_NAMED)
  def test_lanes_order_and_inputs(self, name, p, m, v):
    sched = make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
    fused = sched.fused
    self.assertEqual(fused.kind.shape, (fused.ticks, 2, p))
    self.assertTrue(np.all(np.isin(fused.kind[:, 1], (IDLE, FORWARD))))
    self.assertFalse(np.any(fused.kind[:, 0] == FORWARD))
    self.assertLessEqual(fused.ticks, sched.ticks)
    when = {}  # op -> fused tick
    for s in range(p):
      order = []
      for t, lane in itertools.product(range(fused.ticks), range(2)):
        k = int(fused.kind[t, lane, s])
        if k != IDLE:
          op = (k, int(fused.microbatch[t, lane, s]),
                int(sched.chunk_of[fused.virtual[t, lane, s], s]))
          order.append(op)
          when[op] = t
      # A stage's program order, a tick's backward-type action and forward in that order
      # only where they do not depend on each other.
      self.assertEqual(sorted(order), sorted(sched.programs[s]))
      self.assertEqual([op for op in sched.programs[s] if op[0] == FORWARD],
                       [op for op in order if op[0] == FORWARD])
      self.assertEqual([op for op in sched.programs[s] if op[0] != FORWARD],
                       [op for op in order if op[0] != FORWARD])
    for op, t in when.items():  # every input from an earlier tick
      for need in sched_lib._needs(op, sched.chunks):
        self.assertLess(when[need], t, (op, need))

  @parameterized.named_parameters(*_NAMED)
  def test_table_is_the_unfused_lane(self, name, p, m, v):
    sched = make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
    table = sched.unfused  # the table: one action a stage a tick
    for field in sched_lib.LANE_FIELDS:
      self.assertEqual(getattr(table, field).shape, (sched.ticks, 1, p), field)
    for field in sched_lib.ARRIVAL_FIELDS:
      self.assertEqual(getattr(table, field).shape, (sched.ticks, p), field)
    for field in sched_lib.TICK_FIELDS:
      self.assertEqual(getattr(table, field).shape, (sched.ticks,), field)
    counts = table.counts()
    for s in range(p):
      np.testing.assert_array_equal(counts[s], np.bincount(table.kind[:, 0, s], minlength=5))


class MemoryTest(parameterized.TestCase):

  def test_peak_activations_equal_1f1b(self):
    """ZB-H1 and ZBV hold at most `stages` microbatches of a stage's activations, as 1F1B
    (the paper's 'same memory'); GPipe holds all of them."""
    for p, m in itertools.product((1, 2, 3, 4, 8), (8, 9, 16, 32)):
      if m < p:
        continue
      one = make_schedule("1f1b", stages=p, microbatches=m)
      zb = make_schedule("zb_h1", stages=p, microbatches=m)
      zbv = make_schedule("zbv", stages=p, microbatches=m, virtual_stages=2)
      with self.subTest(p=p, m=m):
        self.assertEqual(one.peak_activations, p)
        self.assertEqual(zb.peak_activations, one.peak_activations)
        self.assertEqual(zb.max_in_flight, one.max_in_flight)
        self.assertEqual(zb.unfused.res_slots, zb.max_in_flight)
        self.assertEqual(zbv.peak_activations, one.peak_activations)
        self.assertEqual(zbv.max_in_flight, 2 * p)  # chunks of half a stage
    self.assertEqual(make_schedule("gpipe", stages=4, microbatches=8).peak_activations, 8)

  def test_output_gradients_held_between_b_and_w(self):
    # What the split costs beyond 1F1B: stage s keeps s + 1 output gradients for its Ws.
    p = 4
    zb = make_schedule("zb_h1", stages=p, microbatches=8)
    self.assertEqual(zb.unfused.grad_slots, p)
    self.assertEqual(make_schedule("1f1b", stages=p, microbatches=8).unfused.grad_slots, 1)


class TimedTest(parameterized.TestCase):

  def test_zb_h1_bubble_a_third_of_1f1b(self):
    """F = B = W (1F1B's backward = B + W = 2F): asynchronously 1F1B idles (p-1)(F+B+W),
    ZB-H1 (p-1)(F+B-W), a third of it (arXiv 2401.10241, section 3.1); ZBV less still."""
    costs = Costs(forward=1, backward=2, backward_input=1, backward_weight=1)
    for p, m in itertools.product((2, 3, 4, 8), (8, 9, 16, 32)):
      one = timed(make_schedule("1f1b", stages=p, microbatches=m), costs)
      zb = timed(make_schedule("zb_h1", stages=p, microbatches=m), costs)
      zbv = timed(make_schedule("zbv", stages=p, microbatches=m, virtual_stages=2), costs)
      with self.subTest(p=p, m=m):
        self.assertEqual(one.busy, zb.busy)
        self.assertEqual(one.asynchronous, 3 * m + 3 * (p - 1))
        self.assertEqual(zb.asynchronous, 3 * m + (p - 1))
        self.assertLess(zb.asynchronous_bubble, one.asynchronous_bubble)
        self.assertLess(zb.lockstep_bubble, one.lockstep_bubble)
        self.assertLessEqual(zbv.asynchronous, zb.asynchronous)
        # Every ZB-H1 tick holds actions of one cost: lock step loses nothing.
        self.assertEqual(zb.lockstep, zb.asynchronous)

  @parameterized.named_parameters(
      # (p, m, forward, backward, input, weight, ZB-H1 ends sooner): B = 2F split evenly;
      # the executor's split (dot FLOPs of its compiled chunk programs, d 64: B 1.0625 F,
      # W 0.9375 F, together the whole backward); and a W that walked the backward chain
      # again (W = the whole backward, the executor's first, black-box split): ZB-H1's
      # bubble stays below 1F1B's, but its extra work makes it end later.
      ("p4_m8_even", 4, 8, 1.0, 2.0, 1.0, 1.0, True),
      ("p8_m32_even", 8, 32, 1.0, 2.0, 1.0, 1.0, True),
      ("p4_m8_executor", 4, 8, 1.0, 2.0, 1.0625, 0.9375, True),
      ("p8_m32_executor", 8, 32, 1.0, 2.0, 1.0625, 0.9375, True),
      # bench_pipeline's all-op FLOP ratios (d 64, 16 layers, seq 32): B/F 1.954 split 1.095
      # + 0.864.
      ("p4_m8_bench", 4, 8, 1.0, 1.954, 1.095, 0.864, True),
      ("p8_m32_bench", 8, 32, 1.0, 1.954, 1.095, 0.864, True),
      ("p4_m8_w_redoes_the_chain", 4, 8, 1.0, 2.0, 1.0625, 2.0, False),
  )
  def test_zb_h1_below_1f1b(self, p, m, forward, backward, backward_input, backward_weight,
                            sooner):
    costs = Costs(forward=forward, backward=backward, backward_input=backward_input,
                  backward_weight=backward_weight)
    one = timed(make_schedule("1f1b", stages=p, microbatches=m), costs)
    zb = timed(make_schedule("zb_h1", stages=p, microbatches=m), costs)
    zbv = timed(make_schedule("zbv", stages=p, microbatches=m, virtual_stages=2), costs)
    self.assertLess(zb.asynchronous_bubble, one.asynchronous_bubble)
    self.assertLess(zbv.asynchronous_bubble, one.asynchronous_bubble)
    self.assertEqual(zb.asynchronous < one.asynchronous, sooner)

  def test_lock_step_zb_h1_beats_gpipe(self):
    """The executor's lock step (each tick as long as its slowest action) costs 1F1B 21-26%
    over GPipe at B = 2F: its ticks pair 1-unit forwards with 2-unit backwards. ZB-H1's
    ticks hold actions of about one cost, so even in lock step it ends before GPipe's ideal
    (at bench_pipeline's measured split: p=4 m=8 28.95 against 32.50, p=8 m=32 111.77
    against 115.22), where 1F1B takes 39.18 and 144.80."""
    costs = Costs(forward=1.0, backward=1.954, backward_input=1.095, backward_weight=0.864)
    for p, m, zb_lock, one_lock in ((4, 8, 28.95, 39.18), (8, 32, 111.77, 144.80)):
      gpipe = timed(make_schedule("gpipe", stages=p, microbatches=m), costs)
      one = timed(make_schedule("1f1b", stages=p, microbatches=m), costs)
      zb = timed(make_schedule("zb_h1", stages=p, microbatches=m), costs)
      self.assertAlmostEqual(zb.lockstep, zb_lock, delta=0.05)  # ratios rounded
      self.assertAlmostEqual(one.lockstep, one_lock, delta=0.05)
      self.assertLess(zb.lockstep, gpipe.lockstep)

  def test_default_split_halves_the_backward(self):
    np.testing.assert_array_equal(Costs(forward=1, backward=3).of_kind(), [0, 1, 3, 1.5, 1.5])
    np.testing.assert_array_equal(Costs(1, 3, backward_input=2, backward_weight=0.5).of_kind(),
                                  [0, 1, 3, 2, 0.5])

  @parameterized.named_parameters(
      ("input_zero", dict(backward_input=0), "Costs.backward_input=0 is invalid; valid: a "
       "finite number > 0 or None"),
      ("weight_negative", dict(backward_weight=-1.0), "Costs.backward_weight=-1.0 is invalid"),
      ("weight_bool", dict(backward_weight=True), "Costs.backward_weight=True is invalid"))
  def test_bad_split_costs(self, kwargs, fragment):
    with self.assertRaises(ValueError) as cm:
      Costs(forward=1, backward=2, **kwargs)
    self.assertIn(fragment, str(cm.exception))
    self.assertNotIn("\n", str(cm.exception))


class ErrorTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("zb_h1_few", "zb_h1", 4, 3, 1,
       "pipeline.microbatches=3 is fewer than the 4 stages; zb_h1 needs microbatches >= "
       "stages (4)"),
      ("zbv_few", "zbv", 4, 2, 2,
       "pipeline.microbatches=2 is fewer than the 4 stages; zbv needs microbatches >= "
       "stages (4)"),
      ("zbv_virtual", "zbv", 4, 8, 1,
       "pipeline.virtual_stages=1 is invalid for pipeline.schedule=zbv; valid: 2"),
      ("zbv_virtual_4", "zbv", 4, 8, 4, "pipeline.virtual_stages=4 is invalid"),
      ("zb_h1_virtual", "zb_h1", 4, 8, 2,
       "pipeline.virtual_stages=2 needs pipeline.schedule=interleaved_1f1b (got zb_h1"),
  )
  def test_errors(self, name, stages, microbatches, virtual, fragment):
    with self.assertRaises(ValueError) as cm:
      make_schedule(name, stages=stages, microbatches=microbatches, virtual_stages=virtual)
    self.assertIn(fragment, str(cm.exception))
    self.assertNotIn("\n", str(cm.exception))

  def test_min_microbatches(self):
    self.assertEqual(sched_lib.min_microbatches("gpipe", 4), 1)
    for name in ("1f1b", "interleaved_1f1b", "zb_h1", "zbv"):
      self.assertEqual(sched_lib.min_microbatches(name, 4), 4)


if __name__ == "__main__":
  absltest.main()
