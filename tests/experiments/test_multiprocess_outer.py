"""DiLoCo across two processes on loopback (a replica per process): same run as one process."""
import json
import pathlib

import numpy as np

from test_multiprocess import _base_flags, run_single, run_two_processes


def _rows(workdir):
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def test_diloco_two_processes_match_one(small_corpus, tmp_path):
  # replica=2 x data=4: each process's 4 devices hold one replica, so the outer sync's
  # all-reduce crosses the process boundary; syncs at steps 2 and 4, int8 compressed.
  flags = _base_flags(small_corpus, "--config.mesh=replica=2,data=4",
                      "--config.optimizer.outer=diloco", "--config.optimizer.outer_sync_every=2",
                      "--config.optimizer.outer_compression=int8")
  run_single(flags, tmp_path / "single")
  outputs = run_two_processes(flags, tmp_path / "multi")
  assert "outer optimizer diloco over 2 replicas" in outputs[0][1]
  a, b = _rows(tmp_path / "single"), _rows(tmp_path / "multi")
  loss = lambda rows: {r["step"]: r["loss"] for r in rows if "loss" in r}
  assert sorted(loss(a)) == sorted(loss(b)) == [1, 2, 3, 4]
  np.testing.assert_allclose([loss(b)[s] for s in range(1, 5)], [loss(a)[s] for s in range(1, 5)],
                             rtol=1e-5)
  val = lambda rows: [r["val_bpb"] for r in rows if "val_bpb" in r]
  np.testing.assert_allclose(val(b), val(a), rtol=1e-5)
  assert [r["comm_bytes"] for r in b if "val_bpb" in r] == \
      [r["comm_bytes"] for r in a if "val_bpb" in r]
