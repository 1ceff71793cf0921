"""Tests for hdp_sim's compute terms beside attention and the layers' matmuls (the head,
sec_per_element, sec_per_step) and their fit to whole measured steps (`fit_step_costs`),
on step times made up from known terms: nothing here is timed."""

import dataclasses

import numpy as np
import pytest

from jaxsys.parallel import cost, hdp_sim

# The measured model's shape (experiments/hdp_calibrate.py): d 192, 2 layers, MHA, f32.
SHAPE = dict(d_model=192, n_layers=2, kv_dim=192, bytes_per_element=4, compiled=True,
             params=cost.dense_params(192, 2, 192, 256), vocab_size=256)
RATES = cost.CostModel(sec_per_attention_flop=9e-12, sec_per_linear_flop=6.7e-12, **SHAPE)
TRUE = dataclasses.replace(RATES, sec_per_attention_flop=2e-11, sec_per_element=2e-8,
                           sec_per_step=0.05)
# rows x tokens a row: attention against tokens, and tokens a step, varied.
MIXES = ((2, 4096), (8, 1024), (2, 2048), (4, 2048), (16, 512))


def steps(model=TRUE, mixes=MIXES, noise=()):
  """Each mix's step on a ring of 2 as `model` times it, times (1 + noise[i])."""
  out = []
  for i, (rows, length) in enumerate(mixes):
    step = hdp_sim.MeasuredStep((length,) * rows, 1.0, length // 2, ring=2, name=f"{rows}x{length}")
    seconds = hdp_sim.step_compute(model, step) * (1 + (noise[i] if noise else 0.0))
    out.append(dataclasses.replace(step, seconds=seconds))
  return out


def test_terms_by_hand():
  """d = 1, one layer: linear(T) = T (matmuls) + 2 V T / n_layers (head) + e T; a step
  adds sec_per_step once, with the pool's collectives."""
  unit = cost.CostModel(sec_per_attention_flop=0.5, sec_per_linear_flop=1.0,
                           link_bytes_per_s=2.0, d_model=1, n_layers=2, kv_dim=1,
                           bytes_per_element=1, pad_compute=False)
  assert unit.linear(5) == pytest.approx(24 * 5)
  m = dataclasses.replace(unit, vocab_size=3, sec_per_element=0.25, sec_per_step=7.0)
  assert m.linear(5) == pytest.approx(24 * 5 + 2 * 3 * 5 / 2 + 0.25 * 5)
  assert m.pool_sync(4) == pytest.approx(unit.pool_sync(4) + 7.0)
  # One sequence of 4 tokens on one device: 2 layers x 3 (Lin + A), then the step's 7 s.
  t = hdp_sim.simulate_static([4], num_devices=1, tokens_per_device=4, model=m, max_len=4)
  assert t.time == pytest.approx(2 * 3 * (m.linear(4) + 0.5 * 2 * 16) + 7.0)
  # Defaults leave them out: the tables' models are unchanged.
  assert (unit.vocab_size, unit.sec_per_element, unit.sec_per_step) == (0, 0.0, 0.0)
  half = m.scaled(2.0)
  assert (half.sec_per_element, half.sec_per_step) == (0.125, 3.5)


def test_step_compute_is_the_static_path_without_a_link():
  step = steps()[0]
  slow_link = dataclasses.replace(TRUE, link_bytes_per_s=1e6)
  whole = hdp_sim.simulate_static(list(step.lengths), num_devices=2, tokens_per_device=2048,
                                  max_len=4096, model=slow_link).time
  assert hdp_sim.step_compute(slow_link, step) == pytest.approx(step.seconds)
  assert whole > 2 * step.seconds  # the link's seconds are what step_compute leaves out


@pytest.mark.parametrize("terms", [
    ("sec_per_attention_flop", "sec_per_element", "sec_per_step"),
    ("sec_per_attention_flop", "sec_per_linear_flop", "sec_per_step"),
])
def test_fit_recovers_known_terms(terms):
  """Fitted to three mixes made up from known terms, the fit finds them and predicts the
  two held-out mixes exactly; RATES' wrong values (attention at 9e-12, no per-token or
  per-step terms) put them over 30% under."""
  true = TRUE if "sec_per_linear_flop" not in terms else dataclasses.replace(
      TRUE, sec_per_element=0.0, sec_per_linear_flop=1.3e-11)
  start = dataclasses.replace(RATES, sec_per_linear_flop=true.sec_per_linear_flop
                              if "sec_per_linear_flop" not in terms else 5e-12)
  measured = steps(true)
  fit = hdp_sim.fit_step_costs(measured[:3], start, terms)
  for term in cost.STEP_TERMS:
    assert getattr(fit.model, term) == pytest.approx(getattr(true, term), rel=1e-9, abs=1e-18)
  assert np.allclose(fit.errors, 0.0, atol=1e-12) and fit.terms == terms
  for held_out in measured[3:]:
    assert hdp_sim.step_compute(fit.model, held_out) == pytest.approx(held_out.seconds)
    assert hdp_sim.step_compute(RATES, held_out) / held_out.seconds - 1 < -0.3


def test_every_term_is_needed():
  """Leave a term out of the fit and the held-out mixes miss: each term moves the steps
  in its own way (none is absorbed by the others)."""
  measured = steps()
  for dropped in ("sec_per_attention_flop", "sec_per_element", "sec_per_step"):
    terms = [t for t in ("sec_per_attention_flop", "sec_per_element", "sec_per_step")
             if t != dropped]
    start = dataclasses.replace(RATES, **{dropped: 1e-12 if dropped.endswith("flop") else 0.0})
    fit = hdp_sim.fit_step_costs(measured[:3], start, terms)
    worst = max(abs(hdp_sim.step_compute(fit.model, s) / s.seconds - 1) for s in measured)
    assert worst > 0.03, dropped


def test_fit_with_noise_is_close():
  """1-2% noise on the steps (what a quiet machine shows) moves the fitted terms
  little and the held-out predictions within a few percent."""
  measured = steps(noise=(0.01, -0.015, 0.02, -0.01, 0.015))
  fit = hdp_sim.fit_step_costs(measured[:3], RATES)
  assert fit.model.sec_per_attention_flop == pytest.approx(2e-11, rel=0.1)
  for s in measured[3:]:
    assert abs(hdp_sim.step_compute(fit.model, s) / s.seconds - 1) < 0.05


def test_fit_errors():
  measured = steps()
  with pytest.raises(ValueError, match="2 measured steps cannot fit 3 terms"):
    hdp_sim.fit_step_costs(measured[:2], RATES)
  with pytest.raises(ValueError, match=r"terms=\('sec_per_flop',\): must be distinct names"):
    hdp_sim.fit_step_costs(measured, RATES, ["sec_per_flop"])
  # 2x4096, 8x1024 and 4x2048 all hold 8192 tokens: tokens and the fixed term grow together.
  same_tokens = [measured[0], measured[1], measured[3]]
  with pytest.raises(ValueError, match="do not separate the terms"):
    hdp_sim.fit_step_costs(same_tokens, RATES)
  # Steps that grow less with attention than the rest predicts: no positive rate fits.
  backwards = [dataclasses.replace(s, seconds=1.0 / s.lengths[0] ** 2) for s in measured[:3]]
  with pytest.raises(RuntimeError, match="sec_per_attention_flop'] fitted to 0"):
    hdp_sim.fit_step_costs(backwards, RATES)
  with pytest.raises(ValueError, match=r"MeasuredStep 2x4096.seconds=0.0: must be > 0"):
    dataclasses.replace(measured[0], seconds=0.0)
  with pytest.raises(ValueError, match=r"CostModel.sec_per_element=-1.0: must be >= 0"):
    dataclasses.replace(RATES, sec_per_element=-1.0)
  with pytest.raises(ValueError, match=r"CostModel.vocab_size=-1: must be an int >= 0"):
    dataclasses.replace(RATES, vocab_size=-1)


def test_fit_cost_model_times_every_device_at_once(monkeypatch):
  """devices=2: each op runs on two devices at once, a shard each, the FLOPs a device's."""
  d = 4 * 64

  def fake_time(fn, *args, repeats):
    x = args[0]
    assert len(x.sharding.device_set) == 2 and x.shape[0] % 2 == 0
    if len(args) == 3:  # q [devices, L, heads, head_dim]
      assert x.shape[0] == 2
      return 3e-11 * 2 * d * x.shape[1] ** 2 + 1e-4
    return 2e-11 * 8 * d * d * (x.shape[0] // 2) + 2e-4  # x [devices * T, d]

  monkeypatch.setattr(hdp_sim, "_min_time", fake_time)
  fit = hdp_sim.fit_cost_model(lengths=(256, 512), token_counts=(256, 512), repeats=1,
                               devices=2)
  assert fit.model.sec_per_attention_flop == pytest.approx(3e-11)
  assert fit.model.sec_per_linear_flop == pytest.approx(2e-11)
  with pytest.raises(ValueError, match=r"devices=0: must be in \[1, "):
    hdp_sim.fit_cost_model(devices=0)
