"""Tests for jaxsys.parallel.hdp_schedule (the per-rank HDP schedule) and its timing in
jaxsys.parallel.hdp_sim (schedule_times, simulate_per_rank)."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsys.parallel import cost, hdp, hdp_layout, hdp_schedule, hdp_sim
from tests.parallel import hdp_cases

# As in test_hdp_sim: attention(L) = L^2, linear(T) = T, hop(s) = s, one layer.
UNIT = cost.CostModel(sec_per_attention_flop=0.5, sec_per_linear_flop=1 / 24,
                         link_bytes_per_s=2.0, d_model=1, n_layers=1, kv_dim=1,
                         bytes_per_element=1, overlap=True, pad_compute=False)


def _check_schedule(sched, lengths, num_devices, tokens_per_device, widen=True):
  """Every invariant the schedule promises; fails naming the offending ring or batch."""
  lengths = [int(n) for n in lengths]
  T = tokens_per_device
  group_need = dict(hdp.share_groups(lengths, T, num_devices)) if lengths else {}
  assert sched.num_devices == num_devices
  assert sorted(sched.sequences() + list(sched.left)) == list(range(len(lengths))), (
      "each sequence exactly once, or left out by a budget")
  ringed = set()
  for ring in sched.rings:
    c, devs = len(ring.devices), ring.devices
    assert devs == tuple(range(devs[0], devs[0] + c)), devs
    assert 0 <= devs[0] and devs[-1] < num_devices, devs
    b = hdp.block_size(c)
    assert devs[0] // b == devs[-1] // b, f"ring {devs} crosses an aligned block of {b}"
    entries = ring.entries()
    whole = [i for i, rel in entries if len(rel) == c]
    assert whole, f"ring {devs} runs no sequence over its devices"
    cells = np.zeros(c, np.int64)
    needs = [math.ceil(lengths[i] / T) for i in whole]
    for i, need in zip(whole, needs):
      n = lengths[i]
      assert n > T, f"short sequence {i} (L={n}) split over {devs}"
      cells += [share.size for share in hdp_layout.ring_shares(n, c)]
      ringed.add(i)
    # A ring runs one share group, or one sequence alone, on the devices it needs or,
    # widened, on a power of two up to twice that; widen=False never widens.
    need = (hdp.devices_needed(lengths[ring.seqs[0]], T) if len(ring.seqs) == 1
            else group_need.get(tuple(ring.seqs)))
    assert need is not None, f"ring {devs} runs {ring.seqs}, not a share group"
    if widen and c != need:
      assert need < c <= 2 * need and c & (c - 1) == 0, (ring.seqs, need, devs)
    else:
      assert c == need, (ring.seqs, need, devs)
    if len(whole) == 1:
      assert needs[0] <= c <= 2 * needs[0], (whole, needs, devs)
    for i, rel in entries:
      if len(rel) != c:
        assert len(rel) == 1 and lengths[i] <= T, (i, rel, devs)
        cells[rel[0]] += lengths[i]
    assert cells.max() <= ring.cell <= T, f"ring {devs} cells hold {cells.tolist()} tokens > {ring.cell}"
    shares = hdp_schedule.member_tokens([lengths[i] for i in whole], c).max()
    assert ring.cell == hdp_schedule.cell_size(int(shares), T), (ring.cell, shares)
  for i, n in enumerate(lengths):
    assert i in sched.left or (i in ringed) == (n > T), f"sequence {i} (L={n}): {i in ringed}"
  for d, batches in enumerate(sched.local):
    for batch in batches:
      assert batch, f"device {d} has an empty micro-batch"
      assert sum(lengths[i] for i in batch) <= T, (d, batch)
  counts = sched.micro_batches()
  assert counts.shape == (num_devices,)
  assert counts.sum() == (sum(len(r.devices) for r in sched.rings)
                          + sum(len(b) for b in sched.local))


@settings(max_examples=120, deadline=None)
@given(**hdp_cases.LONG_TAIL)
def test_long_tail_invariants(log_devices, tokens, seed, count, sigma):
  lengths, num_devices = hdp_cases.long_tail_case(log_devices, tokens, seed, count, sigma)
  sched = hdp_schedule.schedule(lengths, num_devices=num_devices, tokens_per_device=tokens)
  _check_schedule(sched, lengths, num_devices, tokens)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), log_devices=st.integers(0, 4), tokens=st.integers(1, 40),
       widen=st.booleans(), simulated=st.booleans())
def test_arbitrary_lengths(data, log_devices, tokens, widen, simulated):
  num_devices = 2**log_devices
  lengths = data.draw(st.lists(st.integers(1, num_devices * tokens), max_size=40))
  # The default FLOP estimate, or the simulator's (link-bound hops: widening rarely pays).
  cost = hdp_sim.ScheduleCost(UNIT, tokens) if simulated else None
  sched = hdp_schedule.schedule(lengths, num_devices=num_devices, tokens_per_device=tokens,
                                widen=widen, cost=cost)
  _check_schedule(sched, lengths, num_devices, tokens, widen=widen)


@pytest.mark.parametrize("need, num_devices, widen, sizes", [
    (8, 64, True, [8, 16]),      # its aligned block; 32 would be 4x its need
    (5, 64, True, [5, 8]),       # 16 > 2 x 5
    (4, 64, True, [4, 8]),       # already aligned: the next block up
    (3, 4, True, [3, 4]),
    (8, 8, True, [8]),           # the pool holds no wider ring
    (1, 64, True, [1, 2]),
    (8, 64, False, [8]),
    (5, 64, False, [5]),
])
def test_ring_sizes(need, num_devices, widen, sizes):
  assert hdp_schedule._ring_sizes(need, num_devices, widen) == sizes


class _Cost:
  """A time estimate by hand, tokens_per_device T: a cell of t slots costs cell * t / T; a
  ring member costs its cell, work / devices and `hop` per hop (none hidden)."""

  def __init__(self, cell, work, hop, T):
    self._cell, self._work, self._hop, self._T = cell, work, hop, T

  def cell(self, tokens):
    return self._cell * tokens / self._T

  def ring(self, lengths, devices, cell):
    return self.cell(cell) + self._work / devices + self._hop * (devices - 1)

  def short(self, length):
    return float(length)


@pytest.mark.parametrize("cell, work, hop, widen, width", [
    # 8 devices: 1 + 8 = 9; 16 (cells of T/2): 0.5 + 4 = 4.5 ends sooner.
    (1.0, 64.0, 0.0, True, 16),
    (1.0, 64.0, 0.0, False, 8),
    # 8: 1 + 0.5 + 7 hops = 8.5; 16: 0.5 + 0.25 + 15 = 15.75 ends later: tight.
    (1.0, 4.0, 1.0, True, 8),
])
def test_a_ring_widens_when_it_ends_sooner(cell, work, hop, widen, width):
  T = 32
  sched = hdp_schedule.schedule([8 * T], num_devices=64, tokens_per_device=T, widen=widen,
                                cost=_Cost(cell, work, hop, T))
  (ring,) = sched.rings
  assert len(ring.devices) == width and ring.cell == 8 * T // width
  assert ring.devices[0] % width == 0  # an aligned block
  _check_schedule(sched, [8 * T], 64, T, widen=widen)


def test_runs_inside_aligned_blocks_with_their_wait():
  load = np.array([0.0, 5.0, 5.0, 5.0, 1.0, 2.0, 3.0, 4.0])
  firsts, starts, idle = hdp_schedule._runs(load, 2)
  assert firsts.tolist() == [0, 2, 4, 6]  # blocks of 2
  assert starts.tolist() == [5.0, 5.0, 2.0, 4.0] and idle.tolist() == [5.0, 0.0, 1.0, 1.0]
  firsts, starts, idle = hdp_schedule._runs(load, 3)  # inside blocks of 4
  assert firsts.tolist() == [0, 1, 4, 5]
  assert starts.tolist() == [5.0, 5.0, 3.0, 4.0] and idle.tolist() == [5.0, 0.0, 3.0, 3.0]


def test_cells_are_sized_to_the_largest_share():
  # 100 tokens zigzag over 4: chunks of 13,13,13,13,12,12,12,12: members hold 25 each.
  assert hdp_schedule.member_tokens([100], 4).tolist() == [25, 25, 25, 25]
  assert hdp_schedule.member_tokens([100, 9], 4).tolist() == [28, 27, 27, 27]
  # Steps of tokens_per_device / CELL_STEPS = 8 at T = 64, at most T.
  assert [hdp_schedule.cell_size(n, 64) for n in (1, 8, 9, 28, 63, 64)] == [8, 8, 16, 32, 64, 64]


def _check_budget(sched, lengths, budget, T):
  """At most `budget` micro-batches a device, and each short sequence left out found no
  room: every device has run its budget, and no micro-batch or ring cell can take it."""
  counts = sched.micro_batches()
  assert counts.max(initial=0) <= budget
  assert not set(sched.left) & set(sched.sequences())
  held = lambda batch: sum(lengths[i] for i in batch)
  for i in sched.left:
    n = lengths[i]
    if n > T:
      continue
    assert (counts == budget).all(), (i, counts.tolist())
    for batches in sched.local:
      assert all(hdp_schedule.local_cell(held(b), T) - held(b) < n for b in batches), i
      assert not batches or held(batches[-1]) + n > T, i  # nor could the newest grow
    for ring in sched.rings:
      c = len(ring.devices)
      spare = (ring.cell - hdp_schedule.member_tokens([lengths[j] for j in ring.seqs], c)
               - np.array([held(f) for f in ring.fill]))
      assert (spare < n).all(), (i, ring)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), log_devices=st.integers(0, 4), tokens=st.integers(1, 40),
       widen=st.booleans(), budget=st.integers(1, 3))
def test_a_budget_is_kept_and_what_it_leaves_found_no_room(data, log_devices, tokens, widen,
                                                          budget):
  num_devices = 2**log_devices
  lengths = data.draw(st.lists(st.integers(1, num_devices * tokens), min_size=1, max_size=40))
  sched = hdp_schedule.schedule(lengths, num_devices=num_devices, tokens_per_device=tokens,
                                widen=widen, budget=budget)
  assert 0 not in sched.left  # the first is placed first
  _check_budget(sched, lengths, budget, tokens)
  _check_schedule(sched, lengths, num_devices, tokens, widen=widen)


def test_fit_takes_one_schedule_and_keeps_the_first(monkeypatch):
  # Rings of 9000 and 5000 tokens fill every device's one micro-batch: the short first
  # document still runs (a micro-batch of the last device is kept for it), and so would
  # a first document left out by the step before, so none waits forever.
  lengths, calls = [300, 9000, 300, 5000, 120] * 3, []
  schedule = hdp_schedule.schedule
  monkeypatch.setattr(hdp_schedule, "schedule",
                      lambda *a, **k: calls.append(1) or schedule(*a, **k))
  for budget in (1, 2, 3):
    calls.clear()
    kept, sched = hdp_schedule.fit(lengths, budget=budget, num_devices=4, tokens_per_device=4096)
    assert len(calls) == 1 and kept[0] == 0 and kept == sorted(kept)
    # It indexes the kept documents; the run of them within the step's tokens comes first.
    kept_lengths = [lengths[i] for i in kept]
    _check_schedule(sched, kept_lengths, 4, 4096)
    _check_budget(sched, kept_lengths, budget, 4096)
    within = np.searchsorted(np.cumsum(lengths), budget * 4 * 4096, side="right")
    assert all(lengths[i] <= 4096 for i in kept if i >= within)
  assert len(hdp_schedule.fit(lengths, budget=1, num_devices=4, tokens_per_device=4096)[0]) < len(
      hdp_schedule.fit(lengths, budget=3, num_devices=4, tokens_per_device=4096)[0])


def test_local_micro_batches_are_sized_and_filled_before_growing():
  # T = 8: local batches of 8, 4, 2 or 1 slots; a batch of t slots costs t, no attention.
  # 5 opens an 8-slot batch on device 0 (3 free); the first 3 ends sooner in a new 4-slot
  # batch on device 1; the second ends at 8 anywhere (device 0's free slots, or growing
  # device 1's batch to 8 slots) and takes the free slots, which waste nothing.
  lengths = [5, 3, 3]
  sched = hdp_schedule.schedule(lengths, num_devices=2, tokens_per_device=8,
                                cost=_Cost(8.0, 0.0, 0.0, 8))
  assert sched.local == (((0, 2),), ((1,),))
  assert [hdp_schedule.local_cell(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
  assert sched.slots(np.array(lengths), 8) == 8 + 4
  _check_schedule(sched, lengths, 2, 8)


def test_docstring_example():
  sched = hdp_schedule.schedule([9000, 300, 5000, 120], num_devices=4, tokens_per_device=4096)
  # 9000 and 5000 share one ring of 4 (cells of 3584 slots: 3500 tokens each); the
  # short two run after it in local micro-batches of 512 slots (tpd / 8).
  assert [(r.seqs, r.devices, r.cell) for r in sched.rings] == [((0, 2), (0, 1, 2, 3), 3584)]
  assert sched.local == (((1,),), ((3,),), (), ())
  assert sched.micro_batches().tolist() == [2, 2, 1, 1]
  _check_schedule(sched, [9000, 300, 5000, 120], 4, 4096)


def test_empty():
  sched = hdp_schedule.schedule([], num_devices=4, tokens_per_device=8)
  assert sched.rings == () and sched.local == ((),) * 4
  assert sched.micro_batches().tolist() == [0] * 4


@pytest.mark.parametrize("lengths, kwargs", [
    ([1], dict(num_devices=2, tokens_per_device=0)),
    ([1], dict(num_devices=3, tokens_per_device=8)),
    ([1], dict(num_devices=0, tokens_per_device=8)),
    ([3, 65, 2], dict(num_devices=8, tokens_per_device=8)),
    ([3, 4, 0], dict(num_devices=2, tokens_per_device=8)),
    ([3.5], dict(num_devices=2, tokens_per_device=8)),
])
def test_errors_as_plan(lengths, kwargs):
  with pytest.raises(ValueError) as want:
    hdp.plan(lengths, **kwargs)
  with pytest.raises(ValueError) as got:
    hdp_schedule.schedule(lengths, **kwargs)
  assert str(got.value) == str(want.value)
  assert "\n" not in str(got.value)


def test_schedule_times_ring_with_fill_by_hand():
  # L=5 on a ring of 2 at tpd=4 (zigzag chunks 2,1,1,1: shares 3 + 2, cells of 3); L=1
  # fills member 1's spare slot.
  lengths = [5, 1]
  sched = hdp_schedule.schedule(lengths, num_devices=2, tokens_per_device=4)
  assert [(r.devices, r.cell) for r in sched.rings] == [((0, 1), 3)]
  assert sched.rings[0].fill == ((), (1,)) and sched.local == ((), ())
  # Both members' rows hold ceil(5 / 2) = 3 ring tokens. Member 0: 3 * (Lin 3 + A/c^2
  # 6.25 + 1 hop * max(6.25, h=3)) = 46.5; member 1 (and the fill): 3 * (4 + own 1 +
  # 6.25 + max(6.25, 4)) = 52.5. The ring lasts as long as its slowest member.
  times = hdp_sim.schedule_times(sched, lengths, tokens_per_device=4, model=UNIT)
  np.testing.assert_allclose(times, [52.5, 52.5])


def test_schedule_times_local_batch_by_hand():
  # L=3 on the ring (0, 1) at tpd=2 (shares 1 + 2, so member 0 has one spare slot); L=2
  # fits no cell, so it opens a local micro-batch on device 0 after the ring.
  lengths = [3, 2]
  kw = dict(num_devices=2, tokens_per_device=2)
  sched = hdp_schedule.schedule(lengths, **kw)
  assert [r.devices for r in sched.rings] == [(0, 1)] and sched.local == (((1,),), ())
  assert sched.micro_batches().tolist() == [2, 1]
  # Ring member: 3 * (Lin 2 + A/c^2 2.25 + max(2.25, h=2)) = 19.5; local: 3 * (2 + 4).
  times = hdp_sim.schedule_times(sched, lengths, tokens_per_device=2, model=UNIT)
  np.testing.assert_allclose(times, [37.5, 19.5])
  r = hdp_sim.simulate_per_rank(lengths, model=UNIT, **kw)
  assert r.name == "hdp_per_rank"
  assert r.time == pytest.approx(37.5) and r.steps == 2
  assert r.imbalance == pytest.approx(37.5 / 28.5)
  assert r.padding == pytest.approx(1 - 5 / 6)


def test_per_rank_near_the_bound_on_long_tail():
  # experiments/bench_hdp.py's settings (rates as fitted on the 2-core VM; cpu: 100 GB/s
  # links, accel: 400 TFLOP/s matmuls, 25 GB/s) on its first 64-device long-tail batch.
  # Measured: cpu 1.006x the bound, 2.01x faster than the packed static mesh in loader
  # order (itself 2.02x the bound: the most any schedule could gain); accel 1.047x the
  # bound, 1.99x over static (2.09x the bound). Tight rings: 1.04x and 1.05x.
  model = cost.CostModel(sec_per_attention_flop=6.275e-12, sec_per_linear_flop=5.301e-12,
                            link_bytes_per_s=100e9)
  accel = dataclasses.replace(model.scaled(400e12 * 5.301e-12), link_bytes_per_s=25e9)
  pool = hdp_sim.long_tail_lengths(200_000, seed=1234)
  lengths = hdp_sim.sample_batch(pool, int(0.95 * 64 * 32768 * 4), seed=0)
  for m, within in ((model, 1.02), (accel, 1.07)):
    kw = dict(num_devices=64, tokens_per_device=32768, model=m)
    per_rank = hdp_sim.simulate_per_rank(lengths, **kw)
    bound = hdp_sim.lower_bound(lengths, **kw)
    static = hdp_sim.simulate_static(lengths, max_len=262144, order="loader", **kw)
    assert bound * (1 - 1e-9) <= per_rank.time <= within * bound
    assert static.time >= 1.95 * per_rank.time
    assert per_rank.time < hdp_sim.simulate_hdp(lengths, executor="step_ring", **kw).time
    tight = hdp_sim.simulate_per_rank(lengths, widen=False, **kw)
    assert per_rank.time <= tight.time <= 1.1 * bound
