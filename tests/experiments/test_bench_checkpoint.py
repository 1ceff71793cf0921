"""experiments/bench_checkpoint.py's library (jaxsys.bench.checkpoint) on the tiny state, once:
table structure, positive numbers."""
import json
import os
import pytest

from jaxsys.bench import checkpoint as bench_checkpoint

pytestmark = pytest.mark.slow  # starts processes or trains end to end


def test_tiny_run(tmp_path):
  disk, shm, out = tmp_path / "disk", tmp_path / "shm", tmp_path / "bench.json"
  disk.mkdir()
  shm.mkdir()
  result = bench_checkpoint.run(
      ["tiny"], repeats=1, disk_dir=str(disk), shm_dir=str(shm), reshard_spec="data=4,tensor=2",
      variants=["default", "no_compression"], step_seq=16, json_path=str(out))
  saved = json.loads(out.read_text())
  assert {"machine", "orbax", "sizes", "load_avg_start", "load_avg_end"} <= set(saved)
  assert os.listdir(disk) == [] and os.listdir(shm) == []  # its temporary directories are gone
  (s,) = saved["sizes"]
  assert s["size"] == "tiny" and s["bytes"] == 3 * 4 * s["params"] + 3 * 4  # + 3 int32 counts
  assert s["restored_equal"] and s["saved_during_step_equal"]
  assert set(s["saves"]) == {"async_disk", "sync_disk", "async_shm", "no_compression"}
  for samples in s["saves"].values():
    (x,) = samples
    assert 0 < x["block_s"] <= x["commit_s"] <= x["sealed_s"] <= x["durable_s"]
  for b in s["bandwidth"]["disk"] + s["bandwidth"]["shm"]:
    assert b["bytes"] == s["bytes"] and 0 < b["write_s"] <= b["write_fsync_s"]
    assert b["read_s"] > 0 and b["read_hot_s"] > 0
  assert s["reshard"]["label"] == "fsdp=8 -> data=4,tensor=2"
  assert all(t > 0 for t in s["reshard"]["restore_s"] + s["reshard"]["same_layout_s"])
  assert s["convert"]["converted_equal"] and s["convert"]["bytes"] == 2 * s["bytes"]
  assert s["convert"]["label"] == "2 replicas on fsdp=8 -> one model on data=4,tensor=2"
  assert set(s["loads"]) == {"async_disk", "no_compression"}
  # One step before each loop save (3 checkpointers), one right after each.
  assert {k: len(v) for k, v in s["loop"].items()} == {k: 3 if k == "no_save" else 1
                                                       for k in s["loop"]}
  assert all(t > 0 for v in s["loop"].values() for t in v)
  assert set(s["loop"]) == {"no_save"} | {f"{w}_{k}" for w in ("after", "block")
                                           for k in ("async_disk", "async_shm", "no_compression")}

  text = bench_checkpoint.tables(result)
  main, variants, checks = text.split("\n\n")
  header, rule, *rows = main.splitlines()
  assert header.count("|") == rule.count("|") == 6 and len(rows) == 25
  for r in rows:
    cells = [c.strip() for c in r.strip("|").split("|")]
    assert len(cells) == 5 and cells[0].startswith("tiny (3.3M params")
    if cells[3]:
      assert float(cells[3]) > 0  # GB/s
  stalls = [r for r in rows if "stall:" in r]
  assert len(stalls) == 5 and "smaller than sync" in stalls[0]
  header, rule, *rows = variants.splitlines()
  assert len(rows) == 2 and "default" in rows[0] and "no_compression" in rows[1]
  assert all(r.count("|") == header.count("|") == 10 for r in rows)
  assert checks.startswith("Checks: tiny: restored == saved True")


def test_tiny_training_run(tmp_path):
  """--part=run: three modes from one state, each mode's saves counted, sync ones committed
  before the next step, the rotated order, the table."""
  out = tmp_path / "run.json"
  result = bench_checkpoint.run_training(["tiny"], steps=4, every=2, repeats=2, keep=1,
                                         disk_dir=str(tmp_path), step_seq=16,
                                         json_path=str(out))
  assert os.listdir(tmp_path) == ["run.json"]  # its temporary directories are gone
  (s,) = json.loads(out.read_text())["sizes"]
  assert s["checkpoints"] == 2 and s["order"] == [["none", "async", "sync"],
                                                  ["async", "sync", "none"]]
  losses = set()
  for mode, runs in s["runs"].items():
    assert len(runs) == 2
    for x in runs:
      assert 0 < x["steps_s"] <= x["wall_s"]
      saves = 0 if mode == "none" else 2
      assert len(x["block_s"]) == len(x["committed_at_return"]) == saves
      assert x["kept"] == ([] if mode == "none" else [4])  # keep=1: the last save only
      losses.add(x["loss"])
  assert len(losses) == 1  # every mode trains the same steps from the same state
  assert all(s["runs"]["sync"][r]["committed_at_return"] == [True, True] for r in range(2))
  # a sync save blocks for its whole write, an async one not
  assert min(t for x in s["runs"]["sync"] for t in x["block_s"]) > 0

  header, rule, *rows = bench_checkpoint.run_table(result).split("\n\n")[0].splitlines()
  assert "wall time, 4 steps" in header and len(rows) == 3
  assert all(r.count("|") == header.count("|") == rule.count("|") == 8 for r in rows)
  assert "no checkpoints" in rows[0] and "async save every 2 steps" in rows[1]
  assert "sync save every 2 steps" in rows[2]
  checks = bench_checkpoint.run_table(result).split("\n\n")[1]
  assert "loss after the last step identical" in checks and "committed before the next " \
      "step: True" in checks
