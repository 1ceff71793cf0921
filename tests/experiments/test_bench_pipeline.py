"""experiments/bench_pipeline.py's library (jaxsys.bench.pipeline) at the tiniest size: timed bubbles, executed counts, JSON keys."""
import json

import pytest

from jaxsys.bench import pipeline as bench_pipeline
from jaxsys.parallel import schedules

pytestmark = pytest.mark.slow  # starts processes or trains end to end


def test_tiny_run(tmp_path):
  out, chart = tmp_path / "bench.json", tmp_path / "chart.png"
  result = bench_pipeline.run(
      ["schedules", "memory", "vocab", "cpu"], stages_list=[2], microbatches_list=[2], d_model=16,
      # Each schedule compiled once: 1f1b and interleaved run, gpipe only compiles.
      names=["1f1b", "interleaved_1f1b"], mem_names=["gpipe"],
      n_layers=4, seq=8, mem_stages=2, mem_microbatches=[2], mem_seq=8, mem_rows=1,
      vocabs=[250], vocab_kw=dict(d_model=16, n_layers=2, d_ff=32, heads=2, stages=2, tokens=8),
      cpu_kw=dict(d_model=16, n_layers=4, vocab_size=256, seq=8, rows=8, stages=2,
                  microbatches=2, repeats=1),
      out_path=str(out), chart_path=str(chart))
  saved = json.loads(out.read_text())
  assert {"schedules", "memory", "vocab", "devices", "jax_version", "model"} <= set(saved)
  assert chart.stat().st_size > 0
  assert [(r["schedule"], r["microbatches"]) for r in saved["schedules"]] == [
      ("1f1b", 2), ("interleaved_1f1b", 2)]
  for r in saved["schedules"]:
    # The executor ran the table's ticks; the timed bubbles use the chunks' FLOP ratio.
    assert r["idle_ticks_per_stage_measured"] == r["idle_ticks_per_stage_theory"]
    assert "bubble_measured" not in r
    ratio = r["chunk_backward_flops"] / r["chunk_forward_flops"]
    assert r["backward_forward_flop_ratio"] == pytest.approx(ratio) and 1.5 < ratio < 3
    t = schedules.timed(schedules.make_schedule(r["schedule"], stages=2, microbatches=2,
                                                virtual_stages=r["virtual"]),
                        schedules.Costs(forward=1.0, backward=ratio))
    assert (r["bubble_async"], r["bubble_lockstep"]) == pytest.approx(
        (t.asynchronous_bubble, t.lockstep_bubble))
    assert r["makespan_async"] <= r["makespan_lockstep"]
    # Every stage runs each of its m * v chunks forward and backward exactly once.
    assert r["forward_ticks_per_stage"] == r["backward_ticks_per_stage"] == [2 * r["virtual"]] * 2
    assert 0.9 < r["flops_ratio"] < 1.3
  cpu = {r["schedule"]: r for r in saved["cpu"]}
  assert len(cpu) == 5 and cpu["unpipelined, data=8"]["ratio"] == 1.0
  assert all(r["seconds"] > 0 and r["ratio"] == pytest.approx(
      r["seconds"] / cpu["unpipelined, data=8"]["seconds"]) for r in cpu.values())
  (mem,) = saved["memory"]
  assert mem["schedule"] == "gpipe" and mem["res_slots"] == 2  # all m = 2 microbatches held
  assert mem["temp_bytes"] > mem["residual_bytes"] == 2 * mem["residual_slot_bytes"] > 0
  (v,) = saved["vocab"]
  assert v["vp_max_over_min"] == pytest.approx(1.0)  # 250 pads to 250 rows: 125 a stage
  assert v["mpmd_max_over_min"] > 1.0
  assert v["vocab_layer_bytes_vp"] < v["vocab_layer_bytes_replicated"]
  text = bench_pipeline.tables(result)
  assert text.count("\n|---") == 4


def test_covers_every_schedule():
  """The grid, the chart and the schedule table take every schedule the library has."""
  assert bench_pipeline.SCHEDULES == schedules.SCHEDULES
  assert [n for n, *_ in bench_pipeline.grid([2], [2])] == list(schedules.SCHEDULES)
  row = dict(stages=2, microbatches=2, bubble_theory=0.25, bubble_async=0.2,
             bubble_lockstep=0.3, backward_forward_flop_ratio=2.0, flops_ratio=1.0,
             forward_flops_ratio=1.0, backward_flops_ratio=1.0, max_in_flight=2)
  header, _, line = bench_pipeline.schedule_table(
      [dict(row, schedule=n) for n in schedules.SCHEDULES]).splitlines()
  assert header.count("| bubble ") == line.count("0.2500 / 0.2000 / 0.3000") == len(
      schedules.SCHEDULES)
