"""Every notebook in colab/ executes top to bottom without error and shows what it computes."""
import ast
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))

# Smaller values for the costly notebooks' knobs (papermill's convention): a cell of these
# assignments runs right after the notebook's cell tagged "parameters", so every cell still
# runs, smaller, on a fraction of the CPU (the suite's budget, docs/results/testing.md).
SMALL = {
    "hdp": {"FIT_LENGTHS": [512, 1024, 1536, 2048], "FIT_TOKENS": [1024, 2048, 4096, 8192],
            "FIT_REPEATS": 3, "SIM_DEVICES": [8, 16]},
    # A lab run is two processes' start and compile (~12 s) at any size: one rate, one method
    # (tests/experiments/test_lab.py runs data parallelism); at 6 steps DiLoCo still syncs.
    "network_lab": {"RATES": ["50mbit"], "STEPS": 6, "METHODS": {"DiLoCo, H=5": [
        "--config.mesh=replica=2", "--config.outer.name=diloco", "--config.outer.sync_every=5"]}},
    "outer_optimizers": {"H": 2, "ROUNDS": 10},
    "quantization": {"STEPS": 5},
    "quickstart": {"STEPS": 6, "EVAL_EVERY": 3},
}


def with_parameters(nb, overrides: dict):
  """`nb` with a cell assigning `overrides` inserted after its "parameters" cell. Fails if
  there is no such cell or it assigns no variable of that name: the notebook would
  otherwise run at full size, silently."""
  tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", ())]
  assert len(tagged) == 1, f"{len(tagged)} cells tagged 'parameters', expected 1"
  assigned = {t.id for node in ast.parse(nb.cells[tagged[0]].source).body
              if isinstance(node, ast.Assign) for target in node.targets
              for t in ast.walk(target) if isinstance(t, ast.Name)}
  assert overrides.keys() <= assigned, \
      f"the parameters cell assigns no {sorted(overrides.keys() - assigned)}"
  source = "\n".join(f"{name} = {value!r}" for name, value in overrides.items())
  nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(
      source, metadata={"tags": ["injected-parameters"]}))
  return nb


def test_small_names_notebooks():
  """A renamed notebook would otherwise run at full size, its entry here unused."""
  missing = SMALL.keys() - {p.stem for p in NOTEBOOKS}
  assert not missing, f"SMALL names no notebook in colab/: {sorted(missing)}"


@pytest.mark.slow  # starts kernels and processes, trains end to end
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
  """From an empty directory, as Colab runs it: no import may need the working directory
  (the first cell finds jaxsys and the checkout's experiments/ itself)."""
  nb = nbformat.read(path, as_version=4)
  if path.stem in SMALL:
    nb = with_parameters(nb, SMALL[path.stem])
  try:
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
  except CellExecutionError as e:  # the failing cell's source and traceback, not the kernel's
    pytest.fail(f"{path.name}: a cell raised\n{e}", pytrace=False)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.execution_count for c in code), "a code cell did not run"
  # A notebook that runs but shows nothing (a table, a plot, a printed number) shows the
  # user nothing: each must end with a cell that outputs something.
  assert code[-1].get("outputs"), f"{path.name}: its last code cell shows nothing"
