"""jaxsys/bench/hdp_calibrate.py (experiments/hdp_calibrate.py's library): the simulator's
prediction of one ring-attention step, checked by hand, and the pieces the measurement is
made of (no lab run here)."""
import dataclasses
import os

import pytest

from jaxsys.bench import hdp_calibrate
from jaxsys.lab import link as link_lib, physics
from jaxsys.parallel import cost

pytestmark = pytest.mark.slow  # starts processes or trains end to end

RATES = cost.CostModel(sec_per_attention_flop=2e-11, sec_per_linear_flop=1e-11)


def test_cost_model_is_the_measured_model():
  m = hdp_calibrate.cost_model(RATES, link_bytes_per_s=1e7)
  assert (m.d_model, m.n_layers, m.kv_dim, m.bytes_per_element) == (192, 2, 192, 4)
  assert m.compiled and m.overlap and m.pad_compute
  # d 192, 2 layers of 12 d^2 + 2 d, untied 256-token embedding and head, a final norm.
  assert m.params == 2 * (12 * 192 ** 2 + 2 * 192) + 2 * 256 * 192 + 192 == 984_000
  # The microbenchmark's rates alone leave the head out, as the tables do; the calibrated
  # model counts it.
  assert m.vocab_size == 0
  assert hdp_calibrate.cost_model(RATES, link_bytes_per_s=1e7, head=True).vocab_size == 256


@pytest.mark.parametrize("overlap,exchange", [(True, 1.0), (False, 1.0), (False, 2.0)])
def test_predict_by_hand(overlap, exchange):
  """Two 4096-token rows on a ring of 2 (compiled), one after the other: per row and layer
  3 Lin + 6 b + the hops (fwd K/V h overlapped with a block b, or added; dK/dV 2 g added;
  at c = 2 no backward K/V hop; h and g `exchange` times bytes / link), the row's layout
  all-gather; then the gradient all-reduce."""
  link = 1e7
  m = hdp_calibrate.cost_model(RATES, link_bytes_per_s=link, overlap=overlap,
                               hop_exchange=exchange)
  d, tokens = 192, 2048
  lin = 1e-11 * 24 * d * d * tokens
  b = 2e-11 * 2 * d * 4096 ** 2 / 2 / 2
  h = exchange * (2 * tokens * d * 4 + 8 * tokens) / link
  g = exchange * 2 * tokens * d * 4 / link
  forward = lin + b + (max(b, h) if overlap else b + h)
  backward = 2 * lin + 2 * b + 2 * b + 2 * g
  gather = 5 * 4 * 1 * tokens / link
  allreduce = 2 * 0.5 * 4 * (984_000 + 2) / link
  p = hdp_calibrate.predict(m, seq_len=4096)
  assert p["total_s"] == pytest.approx(2 * (2 * (forward + backward) + gather) + allreduce)
  assert p["compute_s"] == pytest.approx(2 * 2 * 3 * (lin + 2 * b), rel=1e-9)
  assert p["comm_s"] == pytest.approx(p["total_s"] - p["compute_s"])
  # Bytes a device sends: K/V + keys once a layer, dK/dV twice, the layout, a row each;
  # the gradients once.
  assert p["sent_bytes"] == pytest.approx(
      2 * (2 * (2 * tokens * d * 4 + 8 * tokens + 2 * 2 * tokens * d * 4) + gather * link)
      + allreduce * link)


def test_link_rate():
  payload = 100e6 / 8 * physics.MSS / (physics.MSS + link_lib.HEADER_BYTES)
  assert hdp_calibrate.link_rate("100mbit", "switched") == pytest.approx(payload)
  # The shared link carries both devices' sends.
  assert hdp_calibrate.link_rate("100mbit", "shared") == pytest.approx(payload / 2)
  # Unshaped, or shaped above what the path carries: the path's capacity.
  cap = hdp_calibrate.payload_rate(258e6)
  assert hdp_calibrate.link_rate("none", "switched") == pytest.approx(cap)
  assert hdp_calibrate.link_rate("1gbit", "switched") == pytest.approx(cap)
  assert hdp_calibrate.link_rate("none", "switched", 100.0) == pytest.approx(payload)


def test_runner_args_and_corpus(tmp_path):
  corpus = hdp_calibrate.make_corpus(str(tmp_path / "c"), files=3, size=1000)
  assert sorted(os.listdir(corpus)) == ["part000.txt", "part001.txt", "part002.txt"]
  assert all(os.path.getsize(os.path.join(corpus, f)) == 1000 for f in os.listdir(corpus))
  args = hdp_calibrate.runner_args(str(tmp_path / "w"), corpus, seq_len=4096, steps=5)
  assert "--config.mesh=context=2" in args and "--config.data.seq_len=4096" in args
  assert "--config.model.n_kv_heads=3" in args and args[-1] == f"--workdir={tmp_path / 'w'}"
  assert "--config.data.batch_size=2" in args


def test_case_row_and_table():
  rate = hdp_calibrate.link_rate("100mbit", "switched")
  p = hdp_calibrate.predict(hdp_calibrate.cost_model(RATES, link_bytes_per_s=rate), seq_len=4096)
  row = hdp_calibrate.case_row("lab switched 100mbit", RATES, rate, [0.5, p["total_s"], 9.0],
                               seq_len=4096, compiled_bytes=p["sent_bytes"],
                               measured_compute_s=1.0)
  assert row["error_simulator"] == pytest.approx(0.0)
  assert row["error_cpu_backend"] > 0 and row["measured_min_max_s"] == [0.5, 9.0]
  assert row["measured_comm_s"] == pytest.approx(p["total_s"] - 1.0)
  assert row["cpu_backend_comm_s"] > row["simulator_comm_s"] == pytest.approx(p["comm_s"])
  line = hdp_calibrate.table([row]).splitlines()[-1]
  assert line.startswith("| lab switched 100mbit | 11.96 |") and "| +0.0% |" in line
  assert line.endswith("| 1.000 |")


def test_mixes():
  assert hdp_calibrate.parse_mix("16x512") == (16, 512)
  for bad in ("2*4096", "0x4096", "x4096", "2x"):
    with pytest.raises(ValueError, match="ROWSxTOKENS"):
      hdp_calibrate.parse_mix(bad)
  step = hdp_calibrate.measured_step("8x1024", 0.5)
  assert (step.lengths, step.tokens_per_device, step.ring, step.seconds) == (
      (1024,) * 8, 512, 2, 0.5)


def test_compute_rows_by_hand():
  """An in-process mix's prediction is its rows' compute on a ring of 2: per row and layer
  3 (Lin + 2 b) with the calibrated terms in Lin (head and sec_per_element) and once a
  step sec_per_step; its error against the median."""
  rates = hdp_calibrate.cost_model(RATES, link_bytes_per_s=1e30)
  cal = dataclasses.replace(hdp_calibrate.cost_model(RATES, link_bytes_per_s=1e30, head=True),
                            sec_per_element=1e-9, sec_per_step=0.1)
  row = hdp_calibrate.compute_row("8x1024", "held out", [1.0, 2.0, 3.0], rates=rates,
                                  calibrated=cal)
  d, tokens = 192, 512
  b = 2e-11 * 2 * d * 1024 ** 2 / 2 / 2
  lin = 1e-11 * 24 * d * d * tokens
  head = 1e-11 * 2 * d * 256 * tokens / 2 + 1e-9 * d * tokens
  assert row["rates_s"] == pytest.approx(8 * 2 * 3 * (lin + 2 * b), rel=1e-9)
  assert row["calibrated_s"] == pytest.approx(8 * 2 * 3 * (lin + head + 2 * b) + 0.1, rel=1e-9)
  assert row["measured_s"] == 2.0 and row["measured_min_max_s"] == [1.0, 3.0]
  assert row["error_calibrated"] == pytest.approx(row["calibrated_s"] / 2.0 - 1)
  line = hdp_calibrate.compute_table([row]).splitlines()[-1]
  assert line.startswith("| 8x1024 | held out | 2.000 [1.000, 3.000] |")


def test_derived_7b_by_hand():
  """The head adds 2 d V / n_layers FLOPs a token a layer at the matmul rate, and
  sec_per_element d seconds a token a layer, to a layer's 24 d^2 (MHA) matmul FLOPs and
  its 2 d L^2 attention FLOPs of one L-token sequence."""
  cal = dataclasses.replace(RATES, sec_per_element=1e-9)
  out = hdp_calibrate.derived_7b(cal, tokens=1024)
  d, L = 4096, 1024
  base = 1e-11 * 24 * d * d * L + 2e-11 * 2 * d * L * L
  assert out["MHA"]["head"] == pytest.approx(1e-11 * 2 * d * 32000 / 32 * L / base)
  assert out["MHA"]["element"] == pytest.approx(1e-9 * d * L / base)
  assert out["GQA"]["element"] > out["MHA"]["element"]  # fewer matmul FLOPs with GQA
