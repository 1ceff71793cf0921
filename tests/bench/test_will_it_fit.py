"""jaxsys/bench/will_it_fit (experiments/will_it_fit's rows): the layouts its search tries and how a row's failure reads."""
import pytest

from jaxsys.configs import llama3
from jaxsys.bench import will_it_fit


@pytest.mark.parametrize("size,topology", [("8b", "v5p-128"), ("gpt2", "v5e-8"), ("1b", "h100-16")])
def test_search_tries_every_mesh_the_model_can_take(size, topology):
  _, layers, _, kv, *_ = llama3.SIZES[size]
  devices = {"v5p-128": 64, "v5e-8": 8, "h100-16": 16}[topology]
  meshes = set()
  for row in will_it_fit.search_rows(size, topology, ("model.remat=full",)):
    mesh = dict(part.split("=") for part in row.overrides[0][len("mesh="):].split(","))
    sizes = {axis: int(n) for axis, n in mesh.items()}
    assert sizes.get("fsdp", 1) * sizes.get("tensor", 1) * sizes.get("stage", 1) == devices
    assert kv % sizes.get("tensor", 1) == 0 and layers % sizes.get("stage", 1) == 0
    assert ("pipeline.schedule=1f1b" in row.overrides) == ("stage" in sizes)
    assert ("pipeline.gather_once=true" in row.overrides) == ("stage" in sizes and "fsdp" in sizes)
    assert "model.remat=full" in row.overrides
    meshes.add((sizes.get("tensor", 1), sizes.get("stage", 1)))
  expected = {(t, s) for t in (1, 2, 4, 8) for s in (1, 2, 4, 8)
              if devices % (t * s) == 0 and kv % t == 0 and layers % s == 0}
  assert meshes == expected


def test_a_failed_row_says_why_in_one_line():
  log = ("I1127 noise\nF1127 12:00:00 spmd_partitioner.cc:1] Check failed: "
         "target.IsManualSubgroup() == sharding().IsManualSubgroup()\n*** Begin stack trace\n")
  assert will_it_fit._why(log, -6).startswith("F1127 12:00:00 spmd_partitioner.cc:1] Check failed")
  assert will_it_fit._why("error: mesh data=16 needs 16 devices\n", 1) == (
      "error: mesh data=16 needs 16 devices")
  assert will_it_fit._why("", -9) == "exit code -9: no output"
  aborted = "F1127 x.cc:1] Check failed: a == b\nFatal Python error: Aborted\n"
  assert will_it_fit._why(aborted, -6) == "F1127 x.cc:1] Check failed: a == b"
  row = will_it_fit.Row("8B, FSDP", "8b", "v5p-128", ("mesh=fsdp=64",))
  cells = will_it_fit.cells(row, {"failed": "not compiled within 900 s"})
  assert cells[3] == "failed: not compiled within 900 s" and len(cells) == len(will_it_fit.HEADER)
