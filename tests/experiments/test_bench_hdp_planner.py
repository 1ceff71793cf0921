"""jaxsys/bench/hdp_planner.py (experiments/bench_hdp_planner.py's library) at tiny sizes:
training's fit keeps a step in one schedule, the binary search in fewer plans than one per
offered document, and the table shows every row."""
import pytest

from jaxsys.bench import hdp_planner

pytestmark = pytest.mark.slow  # starts processes or trains end to end

FITS = ("one schedule", "binary search", "one plan per document")


def test_tiny_run():
  rows = hdp_planner.run(devices=[8], tokens_per_device=2048, micro_steps=2, steps=2,
                         baseline_max_devices=8)
  by = {(r["distribution"], r["fit"]): r for r in rows}
  assert set(by) == {(d, f) for d in ("stdlib", "long_tail") for f in FITS}
  for d in ("stdlib", "long_tail"):
    one, search, baseline = (by[d, f] for f in FITS)
    assert one["offered"] == search["offered"] == baseline["offered"] > 1
    assert one["plans"] == 1 < search["plans"] < baseline["plans"]
    assert all(0.5 < r["filled"] <= 1.0 for r in (one, search, baseline))
  table = hdp_planner.table(rows)
  assert table.count("\n") == 1 + len(rows) and "| stdlib | 8 | one schedule |" in table


def test_program_counts():
  """Ring programs come per block of slots and cell, in fewer shapes; the buckets' padding
  is a share of the slots."""
  row = hdp_planner.count_programs(devices=8, tokens_per_device=2048, micro_steps=2,
                                   batches=3, distribution="long_tail")
  assert 0 < row["ring shape programs"] <= row["ring programs"] and row["local programs"] > 0
  assert 0 <= row["ring padding"] < 1 and 0 <= row["local padding"] < 1
  assert "| long_tail | 8 | 3 |" in hdp_planner.programs_table([row])
