"""Every notebook in colab/ executes top to bottom without error and shows what it computes."""
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

pytestmark = pytest.mark.slow  # starts processes or trains end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
  """From an empty directory, as Colab runs it: no import may need the working directory
  (the first cell finds jaxsys and the checkout's experiments/ itself)."""
  nb = nbformat.read(path, as_version=4)
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
