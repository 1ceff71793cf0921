"""Tests for jaxsys.parallel.hdp_sim: the fitted cost model, hand-checked times, orderings."""

import dataclasses

import numpy as np
import pytest

from jaxsys.parallel import cost, hdp, hdp_schedule, hdp_sim

# d_model = kv_dim = 1 and one layer make every term a small number: attention(L) = L^2,
# linear(T) = T, hop(s) = s (2 * s * 1 * 1 byte / 2 bytes per second).
UNIT = cost.CostModel(sec_per_attention_flop=0.5, sec_per_linear_flop=1 / 24,
                         link_bytes_per_s=2.0, d_model=1, n_layers=1, kv_dim=1,
                         bytes_per_element=1, overlap=True, pad_compute=False)


def test_unit_model_terms():
  assert UNIT.attention(3) == pytest.approx(9.0)
  assert UNIT.linear(5) == pytest.approx(5.0)
  assert UNIT.hop(2) == pytest.approx(2.0)


def test_fit_recovers_known_rates(monkeypatch):
  # Timings made up from known rates plus a dispatch overhead, so the test checks the fit
  # and not how busy the machine is (the notebook and the bench time it for real).
  d = 4 * 64

  def fake_time(fn, *args, repeats):
    x = args[0]
    if len(args) == 3:  # attention(q, k, v), q [1, L, heads, head_dim]
      return 1e-11 * 2 * d * x.shape[1] ** 2 + 1e-4
    return 4e-12 * 8 * d * d * x.shape[0] + 2e-4  # x [T, d] @ w [d, 4d]

  monkeypatch.setattr(hdp_sim, "_min_time", fake_time)
  fit = hdp_sim.fit_cost_model(lengths=(512, 1024, 2048), token_counts=(1024, 2048, 4096),
                               repeats=1)
  m = fit.model
  assert m.sec_per_attention_flop == pytest.approx(1e-11)
  assert m.sec_per_linear_flop == pytest.approx(4e-12)
  assert fit.attention_r2 == pytest.approx(1.0) and fit.linear_r2 == pytest.approx(1.0)
  lengths = np.array([1024, 4096, 32768, 262144])
  assert np.all(np.diff(m.attention(lengths)) > 0) and np.all(np.diff(m.linear(lengths)) > 0)
  assert m.hop(2048) > m.hop(1024) > 0
  # A member of a bigger ring of the same sequence does less: c=4 vs c=2 at 64K tokens.
  a = float(m.attention(65536))
  assert (m.ring_member(a / 4, float(m.linear(16384)), 16384, 4)
          < m.ring_member(a / 2, float(m.linear(32768)), 32768, 2))


def test_two_devices_by_hand():
  # L=3 needs a ring of 2 at tpd=2; L=1 runs alone. HDP: step 1 the ring, step 2 the short.
  lengths = [3, 1]
  kw = dict(num_devices=2, tokens_per_device=2)
  assert hdp.plan(lengths, **kw) == [[(0, (0, 1))], [(1, (0,))]]
  r = hdp_sim.simulate(lengths, model=UNIT, **kw)
  # Ring member: 3 * (Lin 2 + A/c 4.5/2 + 1 hop * max(2.25, h=2)) = 19.5; short: 3 * (1 + 1).
  np.testing.assert_allclose(r["hdp"].device_time, [[19.5, 19.5], [6.0, 0.0]])
  assert r["hdp"].time == pytest.approx(25.5)
  assert r["hdp"].steps == 2
  assert r["hdp"].imbalance == pytest.approx(25.5 / (19.5 + 3.0))
  assert r["hdp"].padding == pytest.approx(1 - 4 / 8)
  # Static: one row [3, 1] on the ring: A/c = (9 + 1)/2, share 2: 3 * (2 + 2.5 + 2.5) = 21.
  assert r["static_loader"].time == pytest.approx(21.0)
  assert r["static_loader"].steps == 1
  # Bound: all compute 3 * (9 + 3 + 1 + 1) over 2 devices; the hop (1.5) hides under 9/4.
  assert r["bound"] == pytest.approx(21.0)
  # Per-rank: the ring's member 0 also holds L=1 in its spare slot (3 tokens, counting
  # ceil(3/2) for its share): 3 * (3 + 1 + 2.25 + max(2.25, h=3)) = 27.75, and the ring
  # lasts as long as that member.
  assert r["hdp_per_rank"].time == pytest.approx(27.75)
  assert r["hdp_per_rank"].steps == 1
  # Lock-step: the ring's micro-step costs 19.5; the second step costs >= 0 (no padding).
  assert r["lockstep_bound"] == pytest.approx(19.5)
  serial = hdp_sim.simulate(lengths, model=dataclasses.replace(UNIT, overlap=False), **kw)
  assert serial["hdp"].time == pytest.approx(3 * (2 + 4.5 + 2) + 6)


def test_step_ring_executor_moves_every_block():
  # One micro-step: L=3 on the ring (0, 1), two one-token documents on devices 2 and 3.
  step = [[([3], (0, 1)), ([1], (2,)), ([1], (3,))]]
  kw = dict(num_devices=4, tokens_per_device=2, model=UNIT)
  ideal = hdp_sim.device_times(step, **kw)
  np.testing.assert_allclose(ideal, [[19.5, 19.5, 6.0, 6.0]])
  # jaxsys's executor runs the step in the data=2, context=2 view: the short devices'
  # blocks (1 token) take one hop too, with no attention to hide it: 3 * (1 + 1 + 1).
  ring = hdp_sim.device_times(step, executor="step_ring", **kw)
  np.testing.assert_allclose(ring, [[19.5, 19.5, 9.0, 9.0]])
  with pytest.raises(ValueError, match="executor="):
    hdp_sim.device_times(step, executor="mpmd", **kw)


def test_run_executor_hops_over_its_own_devices():
  # L=5 on a run of 3 devices (a per-rank ring): A/c = 25/3 in blocks of 25/9, 2 tokens.
  step = [[([5], (0, 1, 2))]]
  kw = dict(num_devices=3, tokens_per_device=2, model=UNIT)
  # run: 2 hops, each hidden by a block: 3 * (2 + 3 * 25/9) = 31.
  np.testing.assert_allclose(hdp_sim.device_times(step, executor="run", **kw), [[31.0] * 3])
  # step_ring: the view's context is the aligned block of 4, so one more bare hop (h=2).
  np.testing.assert_allclose(hdp_sim.device_times(step, executor="step_ring", **kw),
                             [[37.0] * 3])


def test_schedule_cost_is_the_simulators_time():
  cost = hdp_sim.ScheduleCost(UNIT, tokens_per_device=2)
  # As test_run_executor_hops_over_its_own_devices: L=5 on a run of 3 devices, 31.
  assert cost.ring([5], 3, 2) == pytest.approx(31.0)
  step = [[([5], (0, 1, 2))]]
  member = hdp_sim.device_times(step, num_devices=3, tokens_per_device=2, model=UNIT,
                                executor="run")[0].max()
  assert cost.ring(np.array([5]), 3, 2) == pytest.approx(member)
  # A whole short sequence: 3 * (linear 3 + attention 9).
  assert cost.short(3) == pytest.approx(36.0)
  # Without padding compute an empty cell costs nothing; with it, its slots' matmuls.
  assert cost.cell(2) == 0.0
  padded = hdp_sim.ScheduleCost(dataclasses.replace(UNIT, pad_compute=True), 2)
  assert padded.cell(2) == pytest.approx(3 * 2.0)
  assert padded.cell(1) == pytest.approx(3 * 1.0)


def test_slow_links_keep_rings_tight():
  # One 4-cell sequence (L=8, tpd=2) on 8 devices. Links free: widened to 8 its member
  # blocks shrink 4x and the ring ends sooner. At 1e-3 bytes/s a hop (of a padded 2-token
  # block) dwarfs the attention, so the link-aware estimate keeps the 3 hops of 4 devices.
  kw = dict(num_devices=8, tokens_per_device=2)
  fast = dataclasses.replace(UNIT, link_bytes_per_s=1e9, pad_compute=True)
  slow = dataclasses.replace(fast, link_bytes_per_s=1e-3)
  widths = {}
  for name, model in (("fast", fast), ("slow", slow)):
    sched = hdp_schedule.schedule([8], cost=hdp_sim.ScheduleCost(model, 2), **kw)
    (ring,) = sched.rings
    widths[name] = len(ring.devices)
    tight = hdp_sim.simulate_per_rank([8], model=model, widen=False, **kw)
    wide = hdp_sim.simulate_per_rank([8], model=model, **kw)
    assert wide.time <= tight.time * (1 + 1e-9), name
  assert widths == {"fast": 8, "slow": 4}
  # widen=False keeps the ring on the devices it needs, however fast the links.
  tight_sched = hdp_schedule.schedule([8], cost=hdp_sim.ScheduleCost(fast, 2), widen=False,
                                      **kw)
  assert [len(r.devices) for r in tight_sched.rings] == [4]


def test_padding_is_computed_when_asked():
  padded = dataclasses.replace(UNIT, pad_compute=True)
  r = hdp_sim.simulate_hdp([3, 1], num_devices=2, tokens_per_device=2, model=padded)
  # Step 2: the short sequence runs tpd=2 linear tokens; the idle device runs 2 padding.
  np.testing.assert_allclose(r.device_time[1], [3 * (2 + 1), 3 * 2])


def test_hdp_beats_static_on_long_tail_and_respects_bound():
  model = cost.CostModel(sec_per_attention_flop=1e-14, sec_per_linear_flop=5e-15,
                            link_bytes_per_s=25e9, compiled=True,
                            params=cost.dense_params(4096, 32, 4096))
  pool = hdp_sim.long_tail_lengths(20_000, seed=0)
  lengths = hdp_sim.sample_batch(pool, 64 * 32768 * 4, seed=1)
  r = hdp_sim.simulate(lengths, num_devices=64, tokens_per_device=32768, model=model,
                       max_len=262144)
  assert r["hdp"].time < r["static_loader"].time
  assert r["hdp"].time <= r["hdp_step_ring"].time
  for name in ("hdp", "hdp_step_ring", "hdp_per_rank", "static_loader", "static_sorted",
               "static_groups", "static_lpt"):
    assert r[name].time >= r["bound"] * (1 - 1e-9), name
  # Per-group accumulation deals the rows as the lock step does, minus the waiting.
  assert r["static_groups"].time <= r["static_loader"].time
  assert r["static_lpt"].time <= r["static_groups"].time
  assert r["hdp_per_rank"].time < r["hdp_step_ring"].time
  assert r["bound"] <= r["lockstep_bound"] <= r["hdp"].time * (1 + 1e-9)


# d_model = 1, kv_dim = 4, one layer, 16 bytes/s: attention(L) = L^2, linear(T) = T, a
# K/V hop of s tokens h = s (2 * 4 * 1 byte + 8 bytes of keys a token), its dK/dV g = 2s
# (2 * 4 * 4 bytes a token).
COMPILED = cost.CostModel(sec_per_attention_flop=0.5, sec_per_linear_flop=1 / 36,
                             link_bytes_per_s=16.0, d_model=1, n_layers=1, kv_dim=4,
                             bytes_per_element=1, overlap=True, pad_compute=False,
                             compiled=True)


def test_compiled_ring_member_by_hand():
  assert COMPILED.linear(3) == pytest.approx(3.0)
  assert COMPILED.hop(2) == pytest.approx(2.0)
  member = lambda model, c, tokens: model.device(attention=4.0 * c, linear=2.0, ring=c,
                                                 hop_tokens=tokens)
  # c=4, blocks of 4, h=1, g=2. Forward 2 + 4 + 3 max(4, 1) = 18; backward: K/V hidden by
  # the 8 of compute, dK/dV added, one more home: 2 (2 + 4) + 3 (max(8, 1) + 2) + 2 = 44.
  assert member(COMPILED, 4, 1) == pytest.approx(62.0)
  # c=2: XLA reuses the forward's K/V hop; forward 10, backward 12 + (8 + 2) + 2 = 24.
  assert member(COMPILED, 2, 1) == pytest.approx(34.0)
  # Slow hops (h=10, g=20) show through: 36 + 12 + 3 (max(8, 10) + 20) + 20 = 158.
  assert member(COMPILED, 4, 10) == pytest.approx(158.0)
  # Nothing overlapped: 3 * 18 of compute and every hop: forward 3, backward 3 + 4 * 2.
  serial = dataclasses.replace(COMPILED, overlap=False)
  assert member(serial, 4, 1) == pytest.approx(54.0 + 14.0)
  assert COMPILED.hops(4) == (3, 3, 4) and COMPILED.hops(2) == (1, 0, 2)
  assert COMPILED.hops(1) == (0, 0, 0) and UNIT.hops(4) == (3, 3, 3)
  assert COMPILED.sent(1, 4) == {"kv": 6 * 8.0, "keys": 6 * 8.0, "dkv": 4 * 32.0}


def test_allreduce_bytes():
  model = dataclasses.replace(COMPILED, params=10)
  assert model.grad_bytes() == 4 * 12  # f32 gradients, loss sum and token count
  assert model.allreduce_bytes(4) == pytest.approx(2 * 3 / 4 * 48)
  assert model.allreduce(4) == pytest.approx(72 / 16)
  assert COMPILED.allreduce_bytes(8) == 0.0  # params=0: no all-reduce modeled
  assert cost.dense_params(4096, 32, 4096) == 6_704_861_184
  assert cost.dense_params(4096, 32, 1024) == 5_899_554_816
  gqa = dataclasses.replace(COMPILED, d_model=4096, kv_dim=1024)
  mha = dataclasses.replace(gqa, kv_dim=4096)
  assert gqa.linear(1) / mha.linear(1) == pytest.approx(21 / 24)  # k, v are d x kv_dim


def test_sharded_terms_by_hand():
  """tensor=2: half the compute and K/V a device, its activation all-reduces added to the
  matmuls; fsdp=2: the parameters' gather before the step."""
  model = dataclasses.replace(COMPILED, params=13, tensor_link_bytes_per_s=4.0)
  split = dataclasses.replace(model, tensor=2, fsdp=2)
  assert split.attention(4) == pytest.approx(model.attention(4) / 2)
  assert split.kv_bytes(3) == model.kv_bytes(3) / 2 and split.key_bytes(3) == model.key_bytes(3)
  assert split.dkv_bytes(3) == model.dkv_bytes(3) / 2
  # Per token, over 2 devices: 2 (1/2) ((7 + 2) d = 9 bytes of activations + 12 of loss).
  assert split.tensor_bytes(2) == pytest.approx(2 * 21.0)
  # A third of the 42 bytes / 4 B/s a layer, beside half the matmuls.
  assert split.linear(2) == pytest.approx(model.linear(2) / 2 + 42 / 4 / 3)
  assert model.tensor_bytes(2) == 0.0
  # Norms (2 n_layers + 1) d = 3 whole, the other 10 parameters split.
  assert split.shard_params() == 8 and split.grad_bytes() == 4 * 10
  assert split.gather_bytes() == pytest.approx(0.5 * 4 * 8)
  assert split.pool_sync(4) == pytest.approx(split.allreduce(4) + 16 / 16.0)
  lengths, kw = [5, 1, 2], dict(num_devices=2, tokens_per_device=4)
  zero = hdp_sim.simulate_per_rank(lengths, model=split, **kw)
  tensor = hdp_sim.simulate_per_rank(lengths, model=dataclasses.replace(split, fsdp=1), **kw)
  assert zero.time - tensor.time == pytest.approx(split.gather())
  assert zero.sent["all-gather"] == split.gather_bytes() and zero.sent["tensor"] > 0


@pytest.mark.parametrize("pad_compute", [True, False])
def test_time_is_compute_plus_bytes_over_the_link(pad_compute):
  """With nothing overlapped, a strategy's time is its compute plus every byte its
  busiest device sends over the link: the timed and the counted traffic are one."""
  model = dataclasses.replace(COMPILED, overlap=False, params=3, pad_compute=pad_compute)
  free = dataclasses.replace(model, link_bytes_per_s=1e30)
  lengths = [8, 5, 3, 2, 6, 1]
  kw = dict(num_devices=4, tokens_per_device=2, max_len=8)  # one data group, c_max = 4
  for schedule in hdp_sim.STATIC_SCHEDULES:
    timed = hdp_sim.simulate_static(lengths, model=model, schedule=schedule, **kw)
    compute = hdp_sim.simulate_static(lengths, model=free, schedule=schedule, **kw)
    assert timed.time - compute.time == pytest.approx(
        sum(timed.sent.values()) / model.link_bytes_per_s), schedule
  # One sequence on the 4 devices it needs: a ring, its all-reduce, the pool's.
  kw = dict(num_devices=4, tokens_per_device=2, widen=False)
  timed = hdp_sim.simulate_per_rank([8], model=model, **kw)
  compute = hdp_sim.simulate_per_rank([8], model=free, **kw)
  assert timed.sent["all-reduce"] == pytest.approx(2 * model.allreduce_bytes(4))
  assert timed.time - compute.time == pytest.approx(
      sum(timed.sent.values()) / model.link_bytes_per_s)


def test_static_schedules_by_hand():
  # FFD rows of 4 tokens on rings of 2 (tpd 2), 2 data groups, in loader order: [2] (9 s:
  # 3 * (1 + 1 + max(1, h=1))), [0] (30 s), [1, 3] (21 s); see test_two_devices_by_hand.
  lengths = [4, 3, 2, 1]
  kw = dict(num_devices=4, tokens_per_device=2, max_len=4, model=UNIT)
  rows, c = hdp_sim.static_rows(lengths, num_devices=4, tokens_per_device=2, max_len=4)
  assert (rows, c) == ([[2], [0], [1, 3]], 2)
  times = {s: hdp_sim.simulate_static(lengths, schedule=s, **kw) for s in hdp_sim.STATIC_SCHEDULES}
  # Lock step: micro-steps ([2], [0]) and ([1, 3]): 30 + 21.
  assert times["lockstep"].time == pytest.approx(51.0) and times["lockstep"].steps == 2
  assert times["lockstep"].name == "static_loader"
  # Per group, dealt in order: group 0 runs [2] then [1, 3] (30 s), group 1 [0] (30 s).
  assert times["groups"].time == pytest.approx(30.0)
  # LPT: [0] to group 0, [1, 3] to group 1, then [2] to group 1 (21 < 30).
  assert times["lpt"].time == pytest.approx(30.0)
  np.testing.assert_allclose(times["lpt"].device_time, [[30, 30, 21, 21], [0, 0, 9, 9]])
  assert times["groups"].padding == pytest.approx(1 - 10 / 12)  # 3 rows of 4 slots
  assert times["lockstep"].padding == pytest.approx(1 - 10 / 16)  # 2 steps of 8


def test_per_rank_all_reduces():
  """PerRankHDPStep all-reduces each ring program's gradients over its devices, then ends
  a step with one all-reduce over the pool; "once" keeps every sum per device until then."""
  model = dataclasses.replace(COMPILED, params=5)
  lengths = [8, 2, 2, 1, 1, 2, 1]
  kw = dict(num_devices=4, tokens_per_device=2, model=model)
  sched = hdp_schedule.schedule(lengths, num_devices=4, tokens_per_device=2,
                                cost=hdp_sim.ScheduleCost(model, 2))
  (ring,) = sched.rings
  executor = hdp_sim.simulate_per_rank(lengths, **kw)
  once = hdp_sim.simulate_per_rank(lengths, allreduce="once", **kw)
  assert once.sent["all-reduce"] == pytest.approx(model.allreduce_bytes(4))
  assert executor.sent["all-reduce"] == pytest.approx(
      model.allreduce_bytes(4) + model.allreduce_bytes(len(ring.devices)))
  assert executor.name == "hdp_per_rank" and once.name == "hdp_per_rank_once"
  # Planned as if rings had no all-reduce of their own, timed with them.
  blind = hdp_sim.simulate_per_rank(lengths, estimate="once", **kw)
  assert blind.name == "hdp_per_rank" and blind.sent["all-reduce"] > once.sent["all-reduce"]
  # A ring's own all-reduce is part of its job, and of the schedule's estimate.
  (ring,) = sched.rings
  (job, *_) = hdp_sim.schedule_jobs(sched, lengths, tokens_per_device=2, model=model)
  bare = hdp_sim.schedule_jobs(sched, lengths, tokens_per_device=2, model=model,
                               allreduce="once")[0]
  assert job.end - bare.end == pytest.approx(model.allreduce(len(ring.devices)))
  assert job.sent["all-reduce"] == model.allreduce_bytes(len(ring.devices))


def test_lower_bound_counts_unhidden_hops_and_the_final_all_reduce():
  # L=4 on the 2 devices it needs (tpd 2), nothing overlapped: all compute, both members'
  # hops of 2 real tokens (forward 1 K/V hop, backward 2 dK/dV), one all-reduce, over N=2.
  model = dataclasses.replace(COMPILED, overlap=False, params=1)
  compute = 3 * (model.attention(4) + model.linear(4))
  hops = 2 * sum(model.sent(2, 2).values()) / model.link_bytes_per_s
  assert hdp_sim.lower_bound([4], num_devices=2, tokens_per_device=2, model=model) == (
      pytest.approx((compute + hops) / 2 + model.allreduce(2)))


def test_long_tail_shape():
  lengths = hdp_sim.long_tail_lengths(50_000, seed=3)
  assert lengths.min() >= 1 and lengths.max() <= 262144
  assert abs(np.mean(lengths <= 4096) - 0.8) < 0.02
  assert 0.5 < lengths[lengths > 32768].sum() / lengths.sum() < 0.75
  np.testing.assert_array_equal(lengths, hdp_sim.long_tail_lengths(50_000, seed=3))
  assert hdp_sim.long_tail_lengths(1000, seed=0, max_len=8192).max() <= 8192


def test_stdlib_lengths():
  lengths = hdp_sim.stdlib_lengths(max_len=65536)
  assert lengths.size > 100 and lengths.min() >= 1 and lengths.max() == 65536


def test_sample_batch_fills_its_budget():
  pool = np.array([10, 20, 30])
  batch = hdp_sim.sample_batch(pool, 1000, seed=0)
  assert 1000 - pool.max() < batch.sum() <= 1000


def test_pack_rows_first_fit_decreasing():
  rows = hdp.pack_rows([5, 3, 8, 2, 6], 10)
  assert rows == [[2, 3], [4, 1], [0]]
  assert sorted(i for r in rows for i in r) == list(range(5))


def test_errors():
  with pytest.raises(ValueError, match="sec_per_linear_flop"):
    dataclasses.replace(UNIT, sec_per_linear_flop=0.0)
  with pytest.raises(ValueError, match=r"CostModel.params=-1: must be an int >= 0"):
    dataclasses.replace(UNIT, params=-1)
  with pytest.raises(ValueError, match="num_devices=4"):
    hdp_sim.static_ring(262144, 4, 32768)
  kw = dict(num_devices=1, tokens_per_device=1, model=UNIT)
  with pytest.raises(ValueError, match="order="):
    hdp_sim.simulate_static([1], max_len=1, order="random", **kw)
  with pytest.raises(ValueError, match=r"schedule='fifo': must be one of \('lockstep'"):
    hdp_sim.simulate_static([1], max_len=1, schedule="fifo", **kw)
  with pytest.raises(ValueError, match=r"allreduce='never': must be one of \('executor'"):
    hdp_sim.simulate_per_rank([1], allreduce="never", **kw)
  with pytest.raises(ValueError, match=r"estimate='all': must be one of"):
    hdp_sim.simulate_per_rank([1], estimate="all", **kw)
  with pytest.raises(ValueError, match="does not fit a row"):
    hdp.pack_rows([11], 10)
