"""experiments/bench_hdp.py's library (jaxsys.bench.hdp, hdp_real) at tiny sizes: runs, prints the table, draws."""
import json

import pytest

from jaxsys.bench import hdp as bench_hdp
from jaxsys.parallel import cost, hdp_sim

pytestmark = pytest.mark.slow  # starts processes or trains end to end


def test_sim_part_tiny(tmp_path, capsys):
  chart, out = tmp_path / "hdp.png", tmp_path / "hdp.json"
  result = bench_hdp.sim_part(
      [8, 16], seeds=2, tokens_per_device=32768, batch_steps=1, max_len=262144,
      link_gbps=100.0, accel_tflops=400.0, accel_link_gbps=25.0, chart=str(chart),
      out=str(out), fit_kwargs=dict(lengths=(512, 1024, 2048),
                                    token_counts=(1024, 2048, 4096), repeats=1))
  printed = capsys.readouterr().out
  assert ("| distribution | setting | link GB/s | attention / matmul FLOP | K/V | N | HDP vs "
          "best static mesh | HDP vs two-pool | HDP vs balanced | HDP vs strongest static |"
          in printed)
  assert "accel: links 25 GB/s per direction" in printed
  # 2 distributions x 2 settings x 2 attentions x 2 device counts, one line each.
  table = [line for line in printed.splitlines() if line.startswith("| long_tail")
           or line.startswith("| stdlib")]
  assert len(table) == 16
  assert chart.stat().st_size > 0
  saved = json.loads(out.read_text())
  assert len(saved["rows"]) == len(result["rows"]) == 2 * 2 * 2 * 2 * 2
  header = printed.splitlines()[[line.startswith("| distribution") for line in
                                 printed.splitlines()].index(True)]
  assert all(line.count("|") == header.count("|") for line in table)
  statics = [f"static_{s}" for s in hdp_sim.STATIC_SCHEDULES]
  for row in saved["rows"]:
    best = min(row[s] for s in statics)
    assert row["best_static_time"] == best == row[f"static_{row['best_static']}"]
    for key, _ in bench_hdp.PER_RANK:
      assert row[f"{key}_speedup"] == pytest.approx(best / row[key])
      assert row[key] >= row["bound"] * (1 - 1e-9), key
    assert row["hdp_over_bound"] == pytest.approx(row["hdp"] / row["bound"])
    assert row["static_over_bound"] == pytest.approx(best / row["bound"])
    assert row["speedup_lpt"] == pytest.approx(row["static_lpt"] / row["hdp"])
    # No `once <= hdp` here: "once" is another plan (balanced without the rings' own
    # all-reduces), so the heuristic can time it either way under a fitted model; the same
    # plan timed both ways is test_hdp_sim.test_per_rank_all_reduces'.
    assert row["hdp_steps"] >= 1
    # The two-pool layouts search N / c_max rings too, which is the LPT mesh.
    assert row["two_pool"] <= row["static_lpt"] * (1 + 1e-12)
    assert row["balanced"] <= row["static_lpt"] * (1 + 1e-12)
    assert row["vs_two_pool"] == pytest.approx(row["two_pool"] / row["hdp"])
    assert row["vs_balanced"] == pytest.approx(row["balanced"] / row["hdp"])
    assert row["strongest_time"] == min(row[k] for k in bench_hdp.STATICS)
    assert row["vs_strongest"] == pytest.approx(row["strongest_time"] / row["hdp"])
    assert row["link_gbps"] == (25.0 if row["setting"] == "accel" else 100.0)
  models = saved["fit"]["models"]
  assert models["accel"]["link_bytes_per_s"] == 25e9 and models["cpu"]["compiled"]
  assert models["accel"]["sec_per_linear_flop"] == pytest.approx(1 / 400e12)
  assert models["cpu"]["params"] == cost.dense_params(4096, 32, 4096)
  assert saved["attentions"] == {"MHA": 4096, "GQA": 1024}


def test_settings_span_links_and_ratios():
  fit = bench_hdp.fixed_fit(2e-11, 1e-11)
  models = bench_hdp.settings(fit, link_gbps=0, accel_tflops=400.0,
                              accel_link_gbps=[25.0, 450.0], attention_ratios=[0.5, 1.4])
  assert list(models) == ["accel@25,r0.5", "accel@25,r1.4", "accel@450,r0.5", "accel@450,r1.4"]
  m = models["accel@450,r1.4"]
  assert m.link_bytes_per_s == 450e9 and m.sec_per_linear_flop == pytest.approx(1 / 400e12)
  assert m.sec_per_attention_flop == pytest.approx(1.4 / 400e12)
  plain = bench_hdp.settings(fit, link_gbps=100.0, accel_tflops=400.0, accel_link_gbps=[100.0])
  assert list(plain) == ["cpu", "accel@100"]
  # Without a ratio, attention keeps the fitted cost relative to the matmuls.
  assert plain["accel@100"].sec_per_attention_flop == pytest.approx(2 / 400e12)


def test_draw_schedule_spans_the_schedule():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from jaxsys.parallel import hdp_schedule
  model = cost.CostModel(sec_per_attention_flop=1e-14, sec_per_linear_flop=5e-15)
  lengths = [70000, 300, 5000, 120, 40000, 9000]
  sched = hdp_schedule.schedule(lengths, num_devices=4, tokens_per_device=32768)
  fig, ax = plt.subplots()
  end = bench_hdp.draw_schedule(ax, sched, lengths, tokens_per_device=32768, model=model,
                                title="per-rank")
  times = hdp_sim.schedule_times(sched, lengths, tokens_per_device=32768, model=model)
  assert end == pytest.approx(times.max())
  # Every device's bars end by its own finish: none is drawn past the all-reduce.
  right = max(p.get_x() + p.get_width() for p in ax.patches)
  assert right <= end * (1 + 1e-9)
  plt.close(fig)


def test_real_part_tiny():
  """Four layouts of the same documents train to the same loss; HDP pads least."""
  from jaxsys.bench import hdp_real
  # Documents cut at 8 x 32 tokens: the static ring still spans all 8 devices, and the
  # steps, most of this test's time, run a quarter of the tokens 128 a device would.
  rows = hdp_real.real_part(size="test", tokens_per_device=32, max_len=256, batch_steps=2,
                            batches=1, log=lambda *_: None)
  by = {r["layout"]: r for r in rows}
  assert set(by) == set(hdp_real.LAYOUTS)
  for name in hdp_real.LAYOUTS[1:]:
    assert by[name]["loss"] == pytest.approx(by["hdp_per_rank"]["loss"], rel=1e-5)
    assert by[name]["tokens"] == by["hdp_per_rank"]["tokens"]
  assert by["hdp_per_rank"]["waste"] <= by["static_padded"]["waste"]
  assert by["hdp_per_rank"]["micro_steps"] <= 2  # batch_steps
  assert "| hdp_per_rank |" in hdp_real.real_table(rows)
