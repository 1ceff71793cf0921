"""jaxsys/bench/train.py (experiments/bench_train.py's library): one tiny run's numbers, and
--runs' median [min, max]; the binary's one-line error."""
import copy
import subprocess
import sys
import pytest

from jaxsys.bench import train as bench_train
from jaxsys.configs import tiny_lm

pytestmark = pytest.mark.slow  # starts processes or trains end to end


def test_runs_summary_and_table():
  r = bench_train.bench(tiny_lm.get_config("size=test"), steps=2, warmup=1, segments=2, rounds=1)
  assert 0 < r["mfu_causal"] < r["mfu"] and r["tokens_per_s"] > 0 and r["peak_flops"] > 0
  # Three runs whose MFU and tokens/s differ: the summary is their median and range.
  runs = []
  for scale in (1.0, 5.0, 2.0):
    x = copy.deepcopy(r)
    x["mfu"], x["tokens_per_s"] = r["mfu"] * scale, r["tokens_per_s"] * scale
    x["step"]["median_s"] = r["step"]["median_s"] / scale
    runs.append(x)
  summary = bench_train.summarize(runs)
  assert summary["mfu"] == {"median": 2 * r["mfu"], "min": r["mfu"], "max": 5 * r["mfu"]}
  assert summary["tokens_per_s"]["median"] == 2 * r["tokens_per_s"]
  assert summary["step_s"]["min"] == r["step"]["median_s"] / 5
  assert summary["peak_flops"] == {k: r["peak_flops"] for k in ("median", "min", "max")}

  header, rule, *rows = bench_train.runs_table(runs).splitlines()
  assert len(rows) == 4 and rows[-1].startswith("| median [min, max] of 3 |")
  assert all(row.count("|") == header.count("|") == rule.count("|") == 9 for row in rows)
  mfu = lambda x: f"{x:.1%}"
  assert f"| {mfu(2 * r['mfu'])} [{mfu(r['mfu'])}, {mfu(5 * r['mfu'])}] |" in rows[-1]
  assert [row.split("|")[2].strip() for row in rows[:3]] == [mfu(r["mfu"] * s) for s in (1, 5, 2)]


def test_bad_runs_is_one_error_line():
  p = subprocess.run([sys.executable, "-m", "experiments.bench_train", "--runs=0"],
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == "error: --runs=0 must be >= 1"
