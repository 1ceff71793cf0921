"""experiments/bench_hdp_planner.py at tiny sizes: the planner keeps a step that fits, in
fewer plans than one per offered document, and the table shows every row."""
from experiments import bench_hdp_planner


def test_tiny_run():
  rows = bench_hdp_planner.run(devices=[8], tokens_per_device=2048, micro_steps=2, steps=2,
                               baseline_max_devices=8)
  by = {(r["distribution"], r["fit"]): r for r in rows}
  assert set(by) == {(d, f) for d in ("stdlib", "long_tail")
                     for f in ("planner", "one plan per document")}
  for d in ("stdlib", "long_tail"):
    planner, baseline = by[d, "planner"], by[d, "one plan per document"]
    assert planner["offered"] == baseline["offered"] > 1
    assert planner["plans"] < baseline["plans"]
    assert 0.5 < planner["filled"] <= 1.0 and 0.5 < baseline["filled"] <= 1.0
  table = bench_hdp_planner.table(rows)
  assert table.count("\n") == 1 + len(rows) and "| stdlib | 8 | planner |" in table
