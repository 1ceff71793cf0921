"""The one cost model: a layer's forward FLOPs and the planner's estimate from it."""
import numpy as np
import pytest

from jaxsys.parallel import cost, hdp_schedule

D = 8


def test_sequence_cost_is_causal_attention_plus_the_matmuls():
  assert cost.sequence_cost(10, d_model=D) == 2 * D * 10 ** 2 + 24 * D * D * 10
  np.testing.assert_array_equal(cost.sequence_cost(np.array([10, 20]), d_model=D),
                                [2 * D * 100 + 24 * D * D * 10, 2 * D * 400 + 24 * D * D * 20])


def test_sequence_cost_is_the_flop_models_sequence():
  lengths = np.array([1, 10, 4096, 262144])
  np.testing.assert_array_equal(cost.sequence_cost(lengths, d_model=D),
                                cost.flop_model(D).sequence(lengths))


def test_forward_estimate_counts_a_ring_member_and_a_short_sequence():
  estimate = cost.ForwardEstimate(cost.flop_model(D))
  # A cell's matmuls run over every slot, filled or not.
  assert estimate.cell(16) == 24 * D * D * 16
  # A member of a ring of 2 holding 10 and 20 tokens: its 16-slot cell and half the attention.
  assert estimate.ring(np.array([10, 20]), 2, 16) == 24 * D * D * 16 + 2 * D * (100 + 400) / 2
  assert estimate.short(10) == cost.sequence_cost(10, d_model=D)


def test_the_schedule_balances_the_forward_estimate_by_default():
  lengths = [9000, 300, 5000, 120, 2000, 700]
  kw = dict(num_devices=4, tokens_per_device=4096, d_model=D)
  default = hdp_schedule.schedule(lengths, **kw)
  given = hdp_schedule.schedule(lengths, cost=cost.ForwardEstimate(cost.flop_model(D)), **kw)
  assert default.rings == given.rings and default.local == given.local


def test_flop_model_links_are_free():
  model = cost.flop_model(D)
  assert model.hop(1000) == 0.0 and model.tensor_allreduce(1000) == 0.0
  with pytest.raises(ValueError, match=r"CostModel.d_model=0: must be an int >= 1"):
    cost.flop_model(0)
