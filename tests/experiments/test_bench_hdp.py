"""experiments/bench_hdp.py --part=sim at tiny sizes: runs, prints the table, draws."""
import json

import pytest

from experiments import bench_hdp


def test_sim_part_tiny(tmp_path, capsys):
  chart, out = tmp_path / "hdp.png", tmp_path / "hdp.json"
  result = bench_hdp.sim_part(
      [8, 16], seeds=2, tokens_per_device=32768, batch_steps=1, max_len=262144,
      link_gbps=100.0, accel_tflops=400.0, accel_link_gbps=25.0, chart=str(chart),
      out=str(out), fit_kwargs=dict(lengths=(512, 1024, 2048),
                                    token_counts=(1024, 2048, 4096), repeats=1))
  printed = capsys.readouterr().out
  assert "| distribution | setting | N |" in printed
  # 2 distributions x 2 settings x 2 device counts, one line each.
  table = [line for line in printed.splitlines() if line.startswith("| long_tail")
           or line.startswith("| stdlib")]
  assert len(table) == 8
  assert chart.stat().st_size > 0
  saved = json.loads(out.read_text())
  assert len(saved["rows"]) == len(result["rows"]) == 2 * 2 * 2 * 2
  for row in saved["rows"]:
    assert row["hdp_over_bound"] >= 1 - 1e-9
    assert row["per_rank_over_bound"] >= 1 - 1e-9
    assert row["speedup_loader"] == pytest.approx(
        row["static_loader_time"] / row["hdp_time"])
  accel = saved["fit"]["models"]["accel"]
  assert accel["link_bytes_per_s"] == 25e9
  assert accel["sec_per_linear_flop"] == pytest.approx(1 / 400e12)


def test_real_part_tiny():
  """Three layouts of the same documents train to the same loss; HDP pads least."""
  from experiments import hdp_real
  rows = hdp_real.real_part(size="test", tokens_per_device=128, max_len=1024, batch_steps=4,
                            batches=1, log=lambda *_: None)
  by = {r["layout"]: r for r in rows}
  assert set(by) == set(hdp_real.LAYOUTS)
  assert by["hdp"]["loss"] == pytest.approx(by["static_padded"]["loss"], rel=1e-5)
  assert by["hdp"]["loss"] == pytest.approx(by["static_packed"]["loss"], rel=1e-5)
  assert by["hdp"]["tokens"] == by["static_packed"]["tokens"]
  assert by["hdp"]["waste"] <= by["static_padded"]["waste"]
  assert "| hdp |" in hdp_real.real_table(rows)
