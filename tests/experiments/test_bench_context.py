"""experiments/bench_context.py at tiny sizes: table, JSON, per-device memory, balanced work."""
import json

import pytest

from experiments import bench_context
from jaxsys.kernels import attention_xla

pytestmark = pytest.mark.slow  # starts processes or trains end to end


def test_tiny_run(tmp_path, monkeypatch):
  # 4 x 8 tiles, so each 16-token shard is several tiles and the balance shows.
  monkeypatch.setattr(attention_xla, "default_blocks", lambda rows: (4, 8))
  out = tmp_path / "bench.json"
  result = bench_context.run(seq_len=64, devices=4, batch=1, heads=2, kv_heads=1, head_dim=8,
                             layouts=["contiguous", "zigzag"], repeats=1, out_path=str(out))
  saved = json.loads(out.read_text())
  assert set(saved) == {"config", "jax_version", "memory", "work", "seconds"}
  mem = saved["memory"]
  # The SPMD executable is the per-device program: its arguments are one device's shards.
  for algorithm in ("ring", "all_gather"):
    assert mem[algorithm]["argument_bytes"] == mem["local_shard_bytes"] == mem["global_bytes"] // 4
    assert mem[algorithm]["temp_bytes"] > 0
  # All-gather: each device sends its K/V shard (half its q, k, v bytes with Hkv = Hq / 2)
  # and its tokens' causal keys (16 int32) to the 3 others, then reduce-scatters dk, dv.
  kv, keys = mem["local_shard_bytes"] // 2, 16 * 4
  assert mem["all_gather"]["sent_bytes"] == {"all-gather": 3 * (kv + keys),
                                             "reduce-scatter": 3 * kv}
  assert set(mem["ring"]["sent_bytes"]) == {"collective-permute"}
  work = {w["layout"]: w for w in saved["work"]}
  assert work["zigzag"]["max_over_mean"] == 1.0
  assert work["contiguous"]["max_over_mean"] > 1.3
  assert sum(work["zigzag"]["tiles"]) == sum(work["contiguous"]["tiles"])
  assert set(saved["seconds"]) == {"ring_contiguous", "ring_zigzag", "all_gather_zigzag",
                                   "single_xla"}
  text = bench_context.tables(result)
  assert text.count("\n|---") == 3 and "| zigzag | 4x8 |" in text


def test_bad_layout():
  with pytest.raises(ValueError, match=r"unknown layout 'striped'; valid: contiguous, zigzag"):
    bench_context.run(seq_len=64, devices=2, batch=1, heads=2, kv_heads=1, head_dim=8,
                      layouts=["striped"], repeats=0)
