"""Tests for hdp_sim's two-pool static layouts (rings for long sequences only, plain data
parallelism for the rest) and their short-sequence packing, hand-checked on UNIT."""

import dataclasses

import numpy as np
import pytest

from jaxsys.parallel import cost, hdp_sim

# As test_hdp_sim.UNIT: attention(L) = L^2, linear(T) = T, hop(s) = s, one layer.
UNIT = cost.CostModel(sec_per_attention_flop=0.5, sec_per_linear_flop=1 / 24,
                         link_bytes_per_s=2.0, d_model=1, n_layers=1, kv_dim=1,
                         bytes_per_element=1, overlap=True, pad_compute=False)
KW = dict(num_devices=4, tokens_per_device=2, max_len=4, model=UNIT)


def test_two_pool_by_hand():
  # c_max = 2. Long (> 2 tokens): 4 and 3, a row each on the rings; short: 1, 1, 2.
  # Ring member of [4]: share 2, block 4, Lin 2: fwd 6 + max(4, hop 2) = 10, bwd 12 +
  # max(8, 2 + 2) = 20: 30. Of [3]: block 2.25: fwd 4.25 + 2.25, bwd 8.5 + 4.5: 19.5.
  # One ring runs both: 49.5. Shorts (rows [2], [1, 1]: 3 (2 + 4) = 18, 2 x 3 (1 + 1) = 12)
  # on devices 2 and 3.
  lengths = [4, 3, 1, 1, 2]
  one = hdp_sim.simulate_two_pool(lengths, rings=1, **KW)
  assert one.time == pytest.approx(49.5)
  np.testing.assert_allclose(one.device_time, [[49.5, 49.5, 18.0, 12.0]])
  assert one.layout == {"rings": 1, "ring": 2} and one.steps == 2
  # Two rings (no short pool): every sequence in FFD rows [4], [3, 1], [2, 1] of 30, 21
  # and 15.75 s, dealt LPT: 30 | 21 + 15.75: as the LPT static mesh.
  two = hdp_sim.simulate_two_pool(lengths, rings=2, **KW)
  assert two.time == pytest.approx(36.75)
  assert two.time == pytest.approx(hdp_sim.simulate_static(lengths, schedule="lpt", **KW).time)
  best = hdp_sim.simulate_two_pool(lengths, **KW)
  assert best.time == pytest.approx(36.75) and best.layout["rings"] == 2
  assert best.name == "two_pool"
  assert hdp_sim.simulate_two_pool(lengths, balance="cost", **KW).name == "balanced"


def test_two_pool_short_pool_wins_by_hand():
  # 8 devices, c_max 2, a slow link (hop(2) = 8 s, dK/dV 8 s): one long sequence and
  # twelve short ones. Ring member of [4]: fwd 6 + max(4, 8), bwd 12 + max(8, 16): 42.
  # One ring for it and the twelve rows [2] (18 s, no link) on six devices: 36 s each.
  lengths = [4] + [2] * 12
  kw = dict(KW, num_devices=8, model=dataclasses.replace(UNIT, link_bytes_per_s=0.5))
  best = hdp_sim.simulate_two_pool(lengths, **kw)
  assert best.layout["rings"] == 1
  assert best.time == pytest.approx(42.0)
  # Two rings leave 4 devices three rows each (54 s); the LPT mesh puts the shorts in
  # rows [2, 2] on rings (fwd 4 + 8, bwd 8 + 16: 36 s), two after the 42 s ring: 72 s.
  assert hdp_sim.simulate_two_pool(lengths, rings=2, **kw).time == pytest.approx(54.0)
  assert hdp_sim.simulate_static(lengths, schedule="lpt", **kw).time == pytest.approx(72.0)


def test_two_pool_no_long_sequences():
  r = hdp_sim.simulate_two_pool([1, 2, 2, 1], **KW)
  assert r.layout["rings"] == 0
  # Four devices, rows [2], [2], [1, 1] of 18, 18, 12: one each.
  assert r.time == pytest.approx(18.0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("balance", hdp_sim.POOL_BALANCES)
def test_two_pool_never_behind_the_lpt_mesh(seed, balance):
  """The search includes N / c_max rings, which is the LPT static mesh."""
  model = cost.CostModel(sec_per_attention_flop=3e-15, sec_per_linear_flop=2.5e-15,
                            link_bytes_per_s=25e9, compiled=True,
                            params=cost.dense_params(4096, 32, 4096))
  lengths = hdp_sim.long_tail_lengths(300, seed=seed)
  kw = dict(num_devices=32, tokens_per_device=32768, max_len=262144, model=model)
  pooled = hdp_sim.simulate_two_pool(lengths, balance=balance, **kw)
  static = hdp_sim.simulate_static(lengths, schedule="lpt", **kw)
  assert pooled.time <= static.time * (1 + 1e-12)
  # Every count of rings is no better than the one the search kept.
  for k in range(1, 5):
    assert hdp_sim.simulate_two_pool(lengths, balance=balance, rings=k, **kw).time \
        >= pooled.time * (1 - 1e-12)
  assert pooled.sent["all-reduce"] == pytest.approx(model.allreduce_bytes(32))


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("balance", hdp_sim.POOL_BALANCES)
def test_balance_short_times_are_its_micro_batches(pad, balance):
  """Each device's time is the sum of its micro-batches' (CostModel.device), each holds
  <= tpd tokens, and every sequence runs once."""
  model = dataclasses.replace(UNIT, pad_compute=pad)
  lengths = np.random.default_rng(0).integers(1, 9, size=40)
  finish, batches = hdp_sim.balance_short(lengths, devices=5, tokens_per_device=8,
                                          model=model, balance=balance)
  seen = sorted(i for mbs in batches for mb in mbs for i in mb)
  assert seen == list(range(lengths.size))
  for d, mbs in enumerate(batches):
    assert all(lengths[mb].sum() <= 8 for mb in mbs)
    assert finish[d] == pytest.approx(sum(hdp_sim._local_batch_time(model, lengths[mb], 8)
                                          for mb in mbs))


def test_balance_short_cost_by_hand():
  # pad_compute, tpd 4: a micro-batch costs 3 (4 + sum L^2). Costliest first: 3 (39) to
  # device 0; a 2 (24) to device 1; the other 2 joins it (+12: 36); the 1 joins the 3
  # (+3: 42) rather than open a micro-batch on device 1 (36 + 15).
  model = dataclasses.replace(UNIT, pad_compute=True)
  finish, batches = hdp_sim.balance_short([3, 1, 2, 2], devices=2, tokens_per_device=4,
                                          model=model, balance="cost")
  np.testing.assert_allclose(finish, [42.0, 36.0])
  assert batches == [[[0, 1]], [[2, 3]]]


def test_pool_errors():
  with pytest.raises(ValueError, match="balance='x'"):
    hdp_sim.simulate_two_pool([4, 1], balance="x", **KW)
  with pytest.raises(ValueError, match="rings=3"):
    hdp_sim.simulate_two_pool([4, 1], rings=3, **KW)
  with pytest.raises(ValueError, match="rings=0"):
    hdp_sim.simulate_two_pool([4, 1], rings=0, **KW)
  with pytest.raises(ValueError, match="long_threshold=3"):
    hdp_sim.simulate_two_pool([4, 1], long_threshold=3, **KW)
  with pytest.raises(ValueError, match="does not fit one device"):
    hdp_sim.balance_short([5], devices=1, tokens_per_device=4, model=UNIT)


@pytest.mark.parametrize("seed", range(3))
def test_two_pool_search_finds_the_best_count(seed):
  """The bisection's pick is the best of every ring count (a slow link, where the split
  matters: the best count lies inside the range, not at its ends)."""
  model = cost.CostModel(sec_per_attention_flop=3e-15, sec_per_linear_flop=2.5e-15,
                            link_bytes_per_s=25e9, compiled=True,
                            params=cost.dense_params(4096, 32, 4096))
  lengths = hdp_sim.long_tail_lengths(1200, seed=seed)
  kw = dict(num_devices=256, tokens_per_device=32768, max_len=262144, model=model)
  times = {k: hdp_sim.simulate_two_pool(lengths, rings=k, **kw).time for k in range(1, 33)}
  best = min(times, key=times.get)
  assert 1 < best < 32
  found = hdp_sim.simulate_two_pool(lengths, **kw)
  assert found.time == pytest.approx(times[best])  # counts may tie
